"""The routing decision through real nginx: the configured block size
reaches the cost, and a worker's own events win over the router's guesses."""
import json
import os
import zlib

import pytest

import kvt

APPROX = """
    kvroute_zone kv 16m;
    upstream llm {
        zone llm 64k;
        kvroute zone=kv %(params)s;
        %(servers)s
    }
    server {
        listen 127.0.0.1:%%(port)s;
        client_max_body_size 8m;
        location /v1/ {
            proxy_pass http://llm;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            kvroute_debug_headers on;
            add_header X-Cost $kvroute_cost;
        }
        location = /kvroute/status { kvroute_status; }
    }
"""


def ids(name, n):
    h = zlib.crc32(name.encode()) % 10000
    return [1000 + (h * 31 + i) % 30000 for i in range(n)]


def complete(port, prompt, max_tokens=1):
    return kvt.post_json(port, "/v1/completions",
                         {"model": "kvroute-mock", "prompt": prompt, "max_tokens": max_tokens})


@pytest.mark.parametrize("bs", [16, 32, 64])
def test_block_size_reaches_the_cost(stack, bs):
    """An idle server, a prompt of 10 blocks: Dynamo's cost is 10 blocks of
    prefill plus 10 new blocks whatever the block size, and once those 10
    are cached (the first request done) nothing is left. Scoring with 16
    instead of the configured size gives 80 at 64, and 48 when cached."""
    w = stack.worker(engines=1, extra=["--speedup", "50"])
    servers = "server 127.0.0.1:%d;" % w.ports[0]
    ng = stack.nginx(APPROX % {"params": "block_size=%d" % bs, "servers": servers})
    s, h, _, _ = complete(ng.port, ids("bs", 10 * bs))
    assert s == 200
    assert h["x-kvroute-overlap"] == "0"
    assert float(h["x-cost"]) == pytest.approx(20.0)
    s, h, _, _ = complete(ng.port, ids("bs", 10 * bs))
    assert h["x-kvroute-overlap"] == "10"
    assert float(h["x-cost"]) == pytest.approx(0.0)
