"""Documented behaviours with no test before: `backup` and `max_conns`
servers, `busy_prefill_tokens=`, and the two resync deadlines of
kvroute_events (`dump_timeout=` over NATS, `replay_timeout=` over ZMQ).
Real nginx with the module, real kvworker mock engines, nats-server, the
project's FakeWorker (t/lib/kvfake.py) and vLLM publisher (t/lib/vllm_pub.py)."""
import concurrent.futures
import json
import socket
import zlib

import pytest

import kvt
import kvproto
from kvfake import PREFIX, FakeWorker
from kvnats import Nats

CONF = """
    kvroute_zone kv 16m;
    %(http_events)s
    upstream llm {
        zone llm 64k;
        kvroute zone=kv %(params)s;
        %(servers)s
        %(events)s
        keepalive 8;
    }
    server {
        listen 127.0.0.1:%%(port)s;
        location /v1/ {
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


def conf(servers, params="", events="", http_events=""):
    return CONF % {"servers": servers, "params": params, "events": events,
                   "http_events": http_events}


def addr(port):
    return "127.0.0.1:%d" % port


def ids(name, n):
    h = zlib.crc32(name.encode()) % 10000
    return [1000 + (h * 31 + i) % 30000 for i in range(n)]


def complete(port, prompt, max_tokens=1, timeout=30.0):
    return kvt.post_json(port, "/v1/completions",
                         {"model": "kvroute-mock", "prompt": prompt, "max_tokens": max_tokens},
                         timeout=timeout)


def zone(port):
    s, _, body = kvt.request(port, "GET", "/kvroute/status")
    assert s == 200
    return json.loads(body)["zones"]["kv"]


def servers_status(port):
    return {x["server"]: x for x in zone(port)["upstreams"]["llm"]}


def held_stream(port, prompt):
    """A streamed generation that only its client's leaving ends, returned
    once its first bytes have come (it is in flight); close() the socket to
    abort it."""
    body = json.dumps({"model": "kvroute-mock", "prompt": prompt, "max_tokens": 100000,
                       "stream": True, "ignore_eos": True})
    sk = socket.create_connection(("127.0.0.1", port), timeout=30)
    sk.sendall(("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                "Content-Length: %d\r\n\r\n%s" % (len(body), body)).encode())
    head = b""
    while b"\r\n\r\n" not in head:
        more = sk.recv(4096)
        assert more, head
        head += more
    assert head.startswith(b"HTTP/1.1 200"), head
    return sk, head


# --- backup and max_conns ---------------------------------------------------

def test_backup_unused_while_a_primary_is_up_then_takes_over(stack):
    """Backups are used only when no primary is usable: a balancer that
    treated `backup` servers as candidates would send them some of this
    traffic; one that never fell back to them would fail every request once
    the primaries' process dies."""
    prim = stack.worker(engines=2, extra=["--speedup", "20"])
    back = stack.worker(engines=1, extra=["--speedup", "20"])
    a, b = prim.ports
    c = back.ports[0]
    ng = stack.nginx(conf("server %s; server %s; server %s backup;"
                          % (addr(a), addr(b), addr(c))))
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        res = list(ex.map(lambda i: complete(ng.port, ids("p%d" % i, 160), 30), range(16)))
    used = {}
    for s, h, body, _ in res:
        assert s == 200, body
        used[h["x-kvroute-worker"]] = used.get(h["x-kvroute-worker"], 0) + 1
    assert set(used) <= {addr(a), addr(b)}, used
    st = servers_status(ng.port)
    assert st[addr(c)]["backup"] and not st[addr(a)]["backup"]
    assert st[addr(c)]["requests"] == 0
    assert st[addr(a)]["requests"] + st[addr(b)]["requests"] == 16

    kvt._kill(prim)                          # both primaries' engines gone
    for i in range(6):
        s, h, body, _ = complete(ng.port, ids("after%d" % i, 64))
        assert s == 200, body
        assert h["x-kvroute-worker"] == addr(c)
    assert servers_status(ng.port)[addr(c)]["requests"] == 6
    assert ng.alerts() == []


def test_backups_round_robin_when_every_primary_is_down(stack):
    """Primaries marked `down`: every request goes to the backups, and both
    backups take turns (round robin), not the first one always."""
    w = stack.worker(engines=4, extra=["--speedup", "20"])
    a, b, c, d = w.ports
    ng = stack.nginx(conf("server %s down; server %s down; server %s backup; server %s backup;"
                          % (addr(a), addr(b), addr(c), addr(d))))
    used = {}
    for i in range(8):
        s, h, body, _ = complete(ng.port, ids("rr%d" % i, 64))
        assert s == 200, body
        used[h["x-kvroute-worker"]] = used.get(h["x-kvroute-worker"], 0) + 1
    assert set(used) == {addr(c), addr(d)}, used
    st = servers_status(ng.port)
    assert st[addr(a)]["requests"] == st[addr(b)]["requests"] == 0
    assert st[addr(c)]["requests"] + st[addr(d)]["requests"] == 8


def test_primary_at_max_conns_is_skipped(stack):
    """A primary with max_conns=1 and one request in flight is not usable:
    the next request goes to the backup, and to the primary again once the
    first has ended. A balancer that ignored max_conns would queue it there."""
    w = stack.worker(engines=2, extra=["--speedup", "20"])
    a, c = w.ports
    ng = stack.nginx(conf("server %s max_conns=1; server %s backup;" % (addr(a), addr(c))))
    sk, head = held_stream(ng.port, ids("hold", 64))
    try:
        assert b"X-KVRoute-Worker: " + addr(a).encode() in head
        s, h, body, _ = complete(ng.port, ids("next", 64))
        assert s == 200, body
        assert h["x-kvroute-worker"] == addr(c)
    finally:
        sk.close()
    kvt.wait_until(lambda: servers_status(ng.port)[addr(a)]["active_requests"] == 0,
                   what="the held request ended")
    s, h, body, _ = complete(ng.port, ids("again", 64))
    assert s == 200, body
    assert h["x-kvroute-worker"] == addr(a)


# --- busy_prefill_tokens ------------------------------------------------------

def test_all_past_busy_prefill_tokens_gives_503_with_retry_after(stack):
    """busy_prefill_tokens=: each engine runs one sequence at a time
    (--max-num-seqs 1) and is kept occupied by a stream sent to it directly,
    so a request routed to it waits unprefilled and its 400 prompt tokens
    stay counted as active prefill. Once both servers hold one, the next
    request is answered 503 with Retry-After, not queued behind them."""
    w = stack.worker(engines=2, extra=["--speedup", "20", "--max-num-seqs", "1"])
    ng = stack.nginx(conf("\n".join("server %s;" % addr(p) for p in w.ports),
                          params="busy_prefill_tokens=100 retry_after=9"))
    blockers = [held_stream(p, ids("block%d" % p, 32))[0] for p in w.ports]

    def busy(n):
        return lambda: sum(x["active_prefill_tokens"] >= 100
                           for x in servers_status(ng.port).values()) >= n
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        try:
            # one after the other, so the second sees the first's load
            futs = [ex.submit(complete, ng.port, ids("q0", 400))]
            kvt.wait_until(busy(1), what="one server past busy_prefill_tokens")
            futs.append(ex.submit(complete, ng.port, ids("q1", 400)))
            kvt.wait_until(busy(2), what="both servers past busy_prefill_tokens")
            s, h, data = kvt.request(ng.port, "POST", "/v1/completions",
                                     {"prompt": ids("x", 32), "max_tokens": 1}, timeout=10)
            assert s == 503, data
            assert h["retry-after"] == "9"
            assert json.loads(data)["error"]["code"] == "server_busy"
        finally:
            for sk in blockers:
                sk.close()
        for f in futs:
            assert f.result()[0] == 200
    s, _, body, _ = complete(ng.port, ids("x", 32))
    assert s == 200, body
    assert zone(ng.port)["busy_rejects"] == 1


# --- dump_timeout (NATS) --------------------------------------------------------

WID = 77


def test_incomplete_dump_is_asked_again_after_dump_timeout(stack):
    """A resync dump answered with only its first chunk (of two) is not
    complete: the worker stays resyncing (load only), the dump fails at
    dump_timeout and is asked for again; a full answer then makes it live
    with the dump's blocks. Catches a helper that waits forever for the
    rest, or trusts a partial dump."""
    nats = stack.nats()
    server = addr(kvt.free_port())          # the fake's address; no request sent
    ng = stack.nginx(conf("server %s;" % server, params="mode=events",
                          http_events="kvroute_events %s zone=kv dump_timeout=300ms;"
                          % nats.url))
    kvt.wait_until(lambda: zone(ng.port)["events"]["nats"] == "connected", what="connected")

    w = FakeWorker(nats.port, WID, address=server, interval_ms=300, announce=False)
    w.answer_dumps = False
    w.store([(501, 5001), (502, 5002)], skip=True)      # only a dump can tell of these
    requests = []
    partial = {"on": True}
    obs = Nats(nats.port)

    def on_dump(subject, reply, payload):
        requests.append(reply)
        if partial["on"]:
            obs.publish(reply, {"worker_id": WID, "dp_rank": 0, "instance_id": w.instance_id,
                                "last_event_id": w.event_id, "block_size": 16, "chunk": 0,
                                "chunks": 2, "blocks": [[None, 501, 5001]]})
    obs.subscribe(kvproto.dump(WID, PREFIX), on_dump)
    obs.flush()

    def rec():
        for x in zone(ng.port)["events"]["workers"]:
            if x["worker_id"] == WID:
                return x
        return None
    w.heartbeat("announce")
    w.start_heartbeats()

    def asked_again():
        r = rec()
        assert r is None or r["state"] == "resyncing", r     # never live on a part
        return len(requests) >= 3
    kvt.wait_until(asked_again, what="the dump asked for again, twice")
    ev = zone(ng.port)["events"]
    assert ev["dump_failures"] >= 1 and ev["dumps"] == 0
    assert len(set(requests)) >= 2                      # a new request, not the same one

    partial["on"] = False
    w.answer_dumps = True
    kvt.wait_until(lambda: (rec() or {}).get("state") == "live"
                   and zone(ng.port)["events"]["dumps"] >= 1, what="live after a full dump")
    # the zone's index (this worker's alone): the dump's two blocks, and the
    # server shows them before any request was routed (its id is the one it
    # announced: the status follows announced ids itself)
    assert zone(ng.port)["index"]["blocks"] == 2
    assert servers_status(ng.port)[server]["indexed_blocks"] == 2
    w.close()
    obs.close()


# --- replay_timeout (ZMQ) ---------------------------------------------------------

def test_replay_held_past_replay_timeout_clears_then_recovers(stack):
    """A gap's replay that sends nothing within replay_timeout has failed:
    the worker's blocks are cleared (they may lack what was lost), the
    failure is counted, the live messages held meanwhile are applied and
    the worker is live again, routed by what it publishes next."""
    vllm_pub = pytest.importorskip("vllm_pub")
    w = stack.worker(engines=1, extra=["--speedup", "50"])
    server = addr(w.ports[0])
    p = vllm_pub.VllmPublisher()
    try:
        ng = stack.nginx(conf(
            "server %s;" % server, params="mode=events block_size=16",
            events="kvroute_events %s replay=%s server=%s replay_timeout=300ms;"
                   % (p.url, p.replay_url, server)))

        def rec():
            for x in zone(ng.port)["events"]["workers"]:
                if x["address"] == server:
                    return x
            return None

        def indexed():
            return servers_status(ng.port)[server]["indexed_blocks"]

        def probe():                    # PUB drops what precedes the subscription
            p.store(ids("probe", 16))
            r = rec()
            return r is not None and r["events"] > 0 and r["state"] == "live"
        kvt.wait_until(probe, timeout=15, interval=0.2, what="subscribed")
        a = ids("a", 48)
        p.store(a)
        kvt.wait_until(lambda: indexed() == 4, what="probe + a indexed")
        before = zone(ng.port)["events"]

        p.replay_gate.clear()           # the replay asked for gets no reply
        p.store(ids("lost", 16), drop=True)
        c = ids("c", 32)
        p.store(c)                      # the gap shows here; held during the replay
        kvt.wait_until(lambda: p.replay_requests, what="replay requested")
        kvt.wait_until(lambda: zone(ng.port)["events"]["dump_failures"]
                       > before["dump_failures"], what="the replay timed out")
        ev = zone(ng.port)["events"]
        assert ev["cleared_workers"] > before["cleared_workers"]
        assert ev["dumps"] == before["dumps"]
        # cleared, then the held message applied: c alone
        kvt.wait_until(lambda: indexed() == 2 and rec()["state"] == "live",
                       what="blocks cleared, held message applied, live")

        p.replay_gate.set()             # a late reply to the abandoned request: ignored
        d = ids("d", 48)
        p.store(d)
        kvt.wait_until(lambda: indexed() == 5, what="new events after the failure")
        s, h, body, _ = complete(ng.port, d + [7] * 16)
        assert s == 200, body
        assert (h["x-kvroute-worker"], h["x-kvroute-overlap"]) == (server, "3")
        assert rec()["state"] == "live"
        assert ng.alerts() == []
    finally:
        p.close()
