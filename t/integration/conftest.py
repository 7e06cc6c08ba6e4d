import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lib"))

import kvt  # noqa: E402


@pytest.fixture
def stack(request):
    s = kvt.Stack(request.node.name[:40])
    yield s
    s.close()
