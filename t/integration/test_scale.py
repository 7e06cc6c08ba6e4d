"""Fleets of thousands of servers (docs/CONFIG.md, "Large fleets"): the load table sized from the
configuration, every server's load counted, decisions over candidates.

One kvworker process serves 4,096 mock engines on consecutive ports, so
every upstream server is real."""
import concurrent.futures
import json
import os
import random
import re
import socket

import pytest

import kvt

CONF = """
    kvroute_zone kv %(size)s max_workers=4096;
    upstream llm {
        zone llm 4m;
        kvroute zone=kv;
        %(servers)s
    }
    log_format kv '$kvroute_worker $kvroute_overlap_blocks $kvroute_decision_us';
    server {
        listen 127.0.0.1:%%(port)s;
        location /v1/ {
            access_log %(log)s kv;
            kvroute_upstream llm;
            proxy_pass http://llm;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            kvroute_debug_headers on;
        }
        location = /kvroute/status { kvroute_status; }
    }
"""

N = 4096


def conf(stack, ports, size):
    servers = "\n".join("server 127.0.0.1:%d;" % p for p in ports)
    return CONF % {"size": size, "servers": servers, "log": os.path.join(stack.dir, "kv.log")}


def ids(seed, n):
    return [1000 + (seed * 7919 + i * 31) % 30000 for i in range(n)]


def status(port):
    s, _, body = kvt.request(port, "GET", "/kvroute/status")
    assert s == 200
    return json.loads(body)


def servers(port):
    return status(port)["zones"]["kv"]["upstreams"]["llm"]


def test_zone_too_small_says_what_it_needs(stack):
    ports = list(range(20000, 20000 + N))          # nginx -t connects to none
    n = kvt.Nginx(stack, conf(stack, ports, "4m"), "", kvt.free_port(), 2)
    ok, out = n.check()
    m = re.search(r'kvroute_zone "kv" is too small for its 4096 upstream servers: '
                  r'at least (\d+)k', out)
    assert not ok and m, out
    n.write_conf(conf(stack, ports, "%sk" % m.group(1)), "", 2)
    ok, out = n.check()
    assert ok, out


def port_run(n):
    """n consecutive free loopback ports below the kernel's ephemeral range
    (where outgoing connections take ports, a run of 4,096 is rarely free)
    and below the 8,192 from which kvt.free_port() picks servers' ports."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    rnd = random.Random(os.getpid())
    for _ in range(50):
        base = rnd.randrange(10000, max(10001, low - 8192 - n))
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    pytest.skip("no run of %d free ports" % n)


@pytest.fixture
def large(stack):
    # waiting on every port would leave 4,096 connections in TIME_WAIT:
    # kvworker listens on all of them before it serves any, so the first
    # and last tell
    w = stack.worker(port=port_run(N), engines=N, wait=False,
                     extra=["--speedup", "50", "--num-blocks", "512"])
    for p in (w.ports[0], w.ports[-1]):
        kvt.wait_port(p, proc=w, what="kvworker")
    ng = stack.nginx(conf(stack, w.ports, "64m"))
    return ng, w.ports


def test_every_server_counted_and_load_steers(large):
    ng, ports = large
    log = ng.log()
    assert "load table full" not in log and "routes without load" not in log
    before = servers(ng.port)
    assert len(before) == N

    # 48 fresh prompts at once, each long enough to stay in flight a while:
    # the least-loaded order and the ring spread them, one per server
    def one(i):
        body = {"model": "kvroute-mock", "prompt": ids(i, 512), "max_tokens": 64}
        s, h, _, raw = kvt.post_json(ng.port, "/v1/completions", body)
        assert s == 200, raw
        return h["x-kvroute-worker"]

    with concurrent.futures.ThreadPoolExecutor(48) as ex:
        chosen = list(ex.map(one, range(48)))
    assert len(set(chosen)) >= 40
    # servers past the old fixed table of 1,024 are routed to, with load
    index = {"127.0.0.1:%d" % p: i for i, p in enumerate(ports)}
    assert max(index[c] for c in chosen) >= 1024

    # nginx releases an attempt's load when it finalizes the request, just
    # after the client has its response
    kvt.wait_until(lambda: all(s["active_requests"] == 0 for s in servers(ng.port)),
                   what="every server's load released")
    after = {s["server"]: s for s in servers(ng.port)}
    assert sum(s["requests"] for s in after.values()) == 48
    for c in set(chosen):
        assert after[c]["requests"] == chosen.count(c)

    # a repeat of each prompt goes where its first went (approximate mode
    # remembers the decision), for any server of the fleet
    for i in range(0, 48, 6):
        body = {"model": "kvroute-mock", "prompt": ids(i, 512) + [5, 6], "max_tokens": 2}
        s, h, _, raw = kvt.post_json(ng.port, "/v1/completions", body)
        assert s == 200, raw
        assert h["x-kvroute-worker"] == chosen[i]
        assert int(h["x-kvroute-overlap"]) == 32
    assert ng.alerts() == []


def test_in_flight_load_moves_servers_in_the_order(large):
    """A server holding requests is not among the least loaded: fresh
    prompts sent while one server is busy avoid it."""
    ng, ports = large
    hold = {"model": "kvroute-mock", "prompt": ids(999, 256), "max_tokens": 2000}
    s, h, _, raw = kvt.post_json(ng.port, "/v1/completions", dict(hold, max_tokens=1))
    assert s == 200, raw
    busy = h["x-kvroute-worker"]

    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        # three long requests on the same prefix: the holder takes them
        futs = [ex.submit(kvt.post_json, ng.port, "/v1/completions", hold) for _ in range(3)]
        kvt.wait_until(lambda: {x["server"]: x for x in servers(ng.port)}[busy]
                       ["active_requests"] >= 1, what="load on the holder")
        for i in range(20):
            body = {"model": "kvroute-mock", "prompt": ids(5000 + i, 64), "max_tokens": 1}
            s, h, _, raw = kvt.post_json(ng.port, "/v1/completions", body)
            assert s == 200, raw
            assert h["x-kvroute-worker"] != busy
        for f in futs:
            assert f.result()[0] == 200
    kvt.wait_until(lambda: all(x["active_requests"] == 0 for x in servers(ng.port)),
                   what="every server's load released")
