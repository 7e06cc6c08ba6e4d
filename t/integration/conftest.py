import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lib"))

import kvt  # noqa: E402

LOG_TAIL = 40       # lines of each process's log shown with a failure


@pytest.fixture
def stack(request):
    s = kvt.Stack(request.node.name[:40])
    yield s
    s.close()


def _tail(path, n):
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError as e:
        return ["(unreadable: %s)" % e]
    return lines[-n:]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test that ran processes shows the end of each one's log (a
    worker's stderr, nginx's error log), so a failure seen once on CI can be
    read without rerunning it; the stack's directory itself stays in /tmp."""
    out = yield
    rep = out.get_result()
    s = getattr(item, "funcargs", {}).get("stack")
    if not rep.failed or not isinstance(s, kvt.Stack):
        return
    parts = ["stack directory: %s" % s.dir]
    logs = [p.log for p in s.procs if getattr(p, "log", None)]
    logs += [n.error_log for n in s.nginxes]
    for path in dict.fromkeys(logs):
        parts.append("--- %s (last %d lines)" % (os.path.basename(path), LOG_TAIL))
        parts.extend(_tail(path, LOG_TAIL))
    rep.sections.append(("process logs", "\n".join(parts)))
