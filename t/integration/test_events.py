"""Event ingestion: the helper process in nginx, real nats-server,
real kvworker engines publishing KV events."""
import json
import os
import signal
import socket
import subprocess
import zlib

import pytest

import kvt

CONF = """
    kvroute_zone kv 16m;
    kvroute_events %(nats)s zone=kv heartbeat_timeout=%(hb)s %(events)s;
    upstream llm {
        zone llm 64k;
        kvroute zone=kv mode=events;
        %(servers)s
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


def conf(nats_url, ports, events="", hb="3s", servers=None):
    servers = servers or "\n".join("server 127.0.0.1:%d;" % p for p in ports)
    return CONF % {"nats": nats_url, "servers": servers, "events": events, "hb": hb}


def ids(name, n):
    h = zlib.crc32(name.encode()) % 10000
    return [1000 + (h * 31 + i) % 30000 for i in range(n)]


def complete(port, prompt, max_tokens=1):
    return kvt.post_json(port, "/v1/completions",
                         {"model": "kvroute-mock", "prompt": prompt, "max_tokens": max_tokens})


def status(port):
    s, _, body = kvt.request(port, "GET", "/kvroute/status")
    assert s == 200
    return json.loads(body)["zones"]["kv"]


def events_status(port):
    return status(port)["events"]


def indexed(port, server):
    for x in status(port)["upstreams"]["llm"]:
        if x["server"] == server:
            return x["indexed_blocks"]
    raise KeyError(server)


def setup(stack, engines=2, events="", hb="3s", nats=None, jetstream=False):
    nats = nats or stack.nats(jetstream=jetstream)
    w = stack.worker(engines=engines, extra=["--speedup", "50", "--nats", nats.url,
                                             "--heartbeat-ms", "200"])
    ng = stack.nginx(conf(nats.url, w.ports, events, hb))
    kvt.wait_until(lambda: len([x for x in events_status(ng.port)["workers"]
                                if x["state"] == "live"]) == engines,
                   what="workers announced")
    return nats, w, ng


def warm(worker_port, prompt):
    """Send a request straight to one worker: nginx learns of it only by events."""
    s, _, body, _ = complete(worker_port, prompt)
    assert s == 200, body


def test_events_steer_requests_to_the_cache_holder(stack):
    nats, w, ng = setup(stack)
    a, b = w.ports
    for name, port in (("doc-a", a), ("doc-b", b)):
        warm(port, ids(name, 320))
    kvt.wait_until(lambda: indexed(ng.port, "127.0.0.1:%d" % a) >= 20
                   and indexed(ng.port, "127.0.0.1:%d" % b) >= 20, what="events indexed")
    for name, port in (("doc-a", a), ("doc-b", b)):
        for i in range(3):
            s, h, body, _ = complete(ng.port, ids(name, 320) + [i] * 16)
            assert s == 200
            assert h["x-kvroute-worker"] == "127.0.0.1:%d" % port
            assert h["x-kvroute-overlap"] == "20"
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 320
    ev = events_status(ng.port)
    assert ev["nats"] == "connected" and ev["decode_errors"] == 0 and ev["gaps"] == 0
    assert ev["events"] > 0 and ev["blocks"] >= 40
    assert status(ng.port)["mode"] == "events"
    assert ng.alerts() == []


def test_helper_killed_is_respawned_and_index_kept(stack):
    nats, w, ng = setup(stack)
    a, b = w.ports
    warm(a, ids("kill", 160))
    kvt.wait_until(lambda: indexed(ng.port, "127.0.0.1:%d" % a) >= 10, what="indexed")
    pid = events_status(ng.port)["helper_pid"]
    os.kill(pid, signal.SIGKILL)
    kvt.wait_until(lambda: events_status(ng.port)["helper_pid"] not in (0, pid), timeout=20,
                   what="new helper")
    # the new helper resyncs every announced worker from its dump
    kvt.wait_until(lambda: events_status(ng.port)["dumps"] >= 2, timeout=20, what="resync dumps")
    assert indexed(ng.port, "127.0.0.1:%d" % a) >= 10
    # routing trusts the worker's overlap again once its resync is complete
    # (waited for without sending the prefix: a request routed while a is
    # still resyncing goes cold, perhaps to b, which then holds the prefix
    # too and may keep it on a tie)
    kvt.wait_until(lambda: len([x for x in events_status(ng.port)["workers"]
                                if x["state"] == "live"]) == 2, timeout=30,
                   what="workers live")
    s, h, _, _ = complete(ng.port, ids("kill", 160) + [1])
    assert h["x-kvroute-worker"] == "127.0.0.1:%d" % a and h["x-kvroute-overlap"] == "10", h
    warm(b, ids("after", 160))
    kvt.wait_until(lambda: indexed(ng.port, "127.0.0.1:%d" % b) >= 10, what="new events")
    alerts = [l for l in ng.alerts() if "exited on signal 9" not in l]
    assert alerts == []


def test_reload_keeps_index_and_one_writer(stack):
    nats, w, ng = setup(stack)
    a, b = w.ports
    warm(a, ids("reload", 160))
    kvt.wait_until(lambda: indexed(ng.port, "127.0.0.1:%d" % a) >= 10, what="indexed")
    before = events_status(ng.port)["helper_pid"]
    ng.reload()
    kvt.wait_until(lambda: events_status(ng.port)["helper_pid"] not in (0, before),
                   what="new helper after reload")
    # the new helper keeps the blocks but resyncs each announced worker
    # (kv_ingest.c, adopt): its dump replaces them, so between the dump's
    # first chunk and its last the worker holds few or none (and is not
    # trusted); a busy machine (the sanitized suite) showed 0 there. Once
    # the worker is live again its blocks are all there.
    kvt.wait_until(lambda: len([x for x in events_status(ng.port)["workers"]
                                if x["state"] == "live"]) == 2, what="workers live")
    assert indexed(ng.port, "127.0.0.1:%d" % a) >= 10
    s, h, _, _ = complete(ng.port, ids("reload", 160) + [1])
    assert h["x-kvroute-worker"] == "127.0.0.1:%d" % a
    # exactly one helper process holds the lease
    out = subprocess.run(["pgrep", "-f", "-P", str(ng.proc.pid), "cache manager"],
                         capture_output=True, text=True).stdout.split()
    assert len(out) == 1
    assert ng.alerts() == []


def test_nats_down_at_start_then_up(stack):
    port = kvt.free_port()
    url = "nats://127.0.0.1:%d" % port
    w = stack.worker(engines=2, extra=["--speedup", "50", "--nats", url, "--heartbeat-ms", "200"])
    ng = stack.nginx(conf(url, w.ports))
    # serving without NATS: load only
    s, h, _, _ = complete(ng.port, ids("down", 64))
    assert s == 200
    assert events_status(ng.port)["nats"] != "connected"
    stack.nats(port=port)
    kvt.wait_until(lambda: events_status(ng.port)["nats"] == "connected", timeout=30,
                   what="helper connected")
    kvt.wait_until(lambda: len([x for x in events_status(ng.port)["workers"]
                                if x["state"] == "live"]) == 2, timeout=30, what="workers")
    warm(w.ports[1], ids("up", 160))
    kvt.wait_until(lambda: indexed(ng.port, "127.0.0.1:%d" % w.ports[1]) >= 10,
                   what="events after NATS came up")


def test_nats_restart_reconnects_and_resyncs(stack):
    """After NATS comes back, every worker is resynced from a dump: events
    published meanwhile may be lost (kvworker's client buffers them, but a
    restarted server forgets what it held). The dumps are what is checked:
    the buffered events alone would refill b's blocks without any resync."""
    nats, w, ng = setup(stack)
    a, b = w.ports
    warm(a, ids("nr1", 160))
    kvt.wait_until(lambda: indexed(ng.port, "127.0.0.1:%d" % a) >= 10, what="indexed")
    dumps = events_status(ng.port)["dumps"]
    port = nats.port
    kvt._kill(nats)
    kvt.wait_until(lambda: events_status(ng.port)["nats"] != "connected",
                   what="the helper sees NATS down")
    s, h, _, _ = complete(ng.port, ids("nr-during", 64))
    assert s == 200
    warm(b, ids("nr2", 160))
    stack.nats(port=port)
    kvt.wait_until(lambda: events_status(ng.port)["dumps"] >= dumps + 2, timeout=30,
                   what="both workers resynced from dumps")
    kvt.wait_until(lambda: len([x for x in events_status(ng.port)["workers"]
                                if x["state"] == "live"]) == 2, what="workers live again")
    kvt.wait_until(lambda: indexed(ng.port, "127.0.0.1:%d" % b) >= 10, timeout=20,
                   what="b's blocks indexed")
    assert events_status(ng.port)["nats"] == "connected"


def test_nats_down_means_no_overlap_credit(stack):
    """Workers not live (NATS down past stale_lag) earn no overlap: their
    blocks are kept for when they are back, but routing is by load only.
    a is warmed directly: a request through nginx would leave its prefix in
    the router's pending index, which credits a by design."""
    nats, w, ng = setup(stack, events="stale_lag=500ms")
    a, b = w.ports
    warm(a, ids("stale", 160))
    kvt.wait_until(lambda: indexed(ng.port, "127.0.0.1:%d" % a) >= 10, what="indexed")
    kvt._kill(nats)
    kvt.wait_until(lambda: all(x["state"] != "live" for x in events_status(ng.port)["workers"]),
                   what="workers not live")
    assert indexed(ng.port, "127.0.0.1:%d" % a) >= 10      # blocks kept
    s, h, _, _ = complete(ng.port, ids("stale", 160) + [2] * 16)
    assert s == 200 and h["x-kvroute-overlap"] == "0", h


def test_worker_silent_loses_blocks(stack):
    nats, w, ng = setup(stack, hb="1s")
    a, b = w.ports
    warm(a, ids("silent", 160))
    kvt.wait_until(lambda: indexed(ng.port, "127.0.0.1:%d" % a) >= 10, what="indexed")
    os.kill(w.pid, signal.SIGSTOP)
    try:
        kvt.wait_until(lambda: indexed(ng.port, "127.0.0.1:%d" % a) == 0, timeout=30,
                       what="blocks dropped after heartbeat timeout")
        assert events_status(ng.port)["timeouts"] >= 1
    finally:
        os.kill(w.pid, signal.SIGCONT)
    # back: resynced from its dump
    kvt.wait_until(lambda: indexed(ng.port, "127.0.0.1:%d" % a) >= 10, timeout=30,
                   what="resync after return")


def test_master_process_off(stack):
    nats = stack.nats()
    w = stack.worker(engines=2, extra=["--speedup", "50", "--nats", nats.url,
                                       "--heartbeat-ms", "200"])
    ng = stack.nginx(conf(nats.url, w.ports), main_conf="master_process off;")
    warm(w.ports[0], ids("single", 160))
    kvt.wait_until(lambda: indexed(ng.port, "127.0.0.1:%d" % w.ports[0]) >= 10,
                   what="single-process helper")
    s, h, _, _ = complete(ng.port, ids("single", 160) + [3])
    assert h["x-kvroute-worker"] == "127.0.0.1:%d" % w.ports[0]


def test_bad_events_config_rejected(stack):
    for text, needle in (
        ("kvroute_events nats://127.0.0.1:1;", "needs zone=NAME at http level"),
        ("kvroute_events http://x zone=kv;", 'invalid NATS URL "http://x"'),
        ("kvroute_events nats://127.0.0.1:1 zone=kv jetstream=S;", "durable=NAME"),
        ("kvroute_events nats://127.0.0.1:1 zone=kv bogus=1;", 'invalid parameter "bogus=1"'),
    ):
        body = conf("nats://127.0.0.1:1", [1]).replace(
            "kvroute_events nats://127.0.0.1:1 zone=kv heartbeat_timeout=3s ;", text)
        n = kvt.Nginx(stack, body, "", kvt.free_port(), 1)
        ok, out = n.check()
        assert not ok and needle in out, out


# --- events from a publisher that is not kvworker --------------------------

import kvnats  # noqa: E402
import kvproto

SUBJECT = kvproto.events()
DYNAMO_WORKER = 7587886123456789


def hashes(tokens, bs=16):
    """Dynamo's local and sequence hashes (kvtok hash gives the sequence ones)."""
    r = subprocess.run([os.path.join(kvt.BIN, "kvtok"), "hash", "--block-size", str(bs)],
                       input=json.dumps(tokens).encode(), capture_output=True)
    return [int(x) for x in r.stdout.split()]


def test_dynamo_events_with_worker_id_mapping(stack):
    """Events in Dynamo's exact JSON from a raw NATS publisher, for a worker
    that never announces; kvroute_worker_id maps it to a server."""
    nats = stack.nats()
    w = stack.worker(engines=2, extra=["--speedup", "50"])       # no NATS: silent workers
    a, b = w.ports
    servers = "server 127.0.0.1:%d;\nserver 127.0.0.1:%d;\nkvroute_worker_id %d 127.0.0.1:%d;" % (
        a, b, DYNAMO_WORKER, b)
    ng = stack.nginx(conf(nats.url, w.ports, servers=servers))
    kvt.wait_until(lambda: events_status(ng.port)["nats"] == "connected", what="connected")
    prompt = ids("dynamo", 64)
    seq = hashes(prompt)
    assert len(seq) == 4
    pub = kvnats.Nats(nats.port)
    # older shape first (signed worker id, no dp_rank/tier), then the newer one
    old = {"worker_id": DYNAMO_WORKER, "event": {"event_id": 1, "data": {"stored": {
        "parent_hash": None, "blocks": [{"block_hash": seq[0], "tokens_hash": seq[0]}]}}}}
    # Dynamo's local hash of block i is what the router chains; recover it from kvtok
    # by hashing each block alone (a one-block sequence hash is its local hash)
    local = [hashes(prompt[i * 16:(i + 1) * 16])[0] for i in range(4)]
    new = {"worker_id": DYNAMO_WORKER, "storage_tier": "device", "event": {"event_id": 2, "data": {
        "stored": {"parent_hash": seq[0], "start_position": None, "blocks": [
            {"block_hash": 1000 + i, "tokens_hash": local[i], "mm_extra_info": None}
            for i in (1, 2, 3)]}}, "dp_rank": 0}}
    pub.publish(SUBJECT, json.dumps(old).encode())
    pub.publish(SUBJECT, json.dumps(new).encode())
    pub.publish(SUBJECT, b'{"worker_id": "broken"')
    pub.flush()
    kvt.wait_until(lambda: indexed(ng.port, "127.0.0.1:%d" % b) == 4, what="Dynamo events indexed")
    s, h, _, _ = complete(ng.port, prompt + [1, 2, 3])
    assert h["x-kvroute-worker"] == "127.0.0.1:%d" % b and h["x-kvroute-overlap"] == "4"
    assert events_status(ng.port)["decode_errors"] == 1
    # removal by the engine's own (opaque) hash
    rm = {"worker_id": DYNAMO_WORKER, "storage_tier": "device", "event": {"event_id": 3, "data": {
        "removed": {"block_hashes": [1003]}}, "dp_rank": 0}}
    pub.publish(SUBJECT, json.dumps(rm).encode())
    pub.flush()
    kvt.wait_until(lambda: indexed(ng.port, "127.0.0.1:%d" % b) == 3, what="removal applied")
    pub.close()


def stored(worker, event_id, tokens):
    """A Dynamo RouterEvent storing every full block of tokens from the root."""
    seq = hashes(tokens)
    local = [hashes(tokens[i * 16:(i + 1) * 16])[0] for i in range(len(seq))]
    return {"worker_id": worker, "storage_tier": "device", "event": {"event_id": event_id,
            "data": {"stored": {"parent_hash": None, "start_position": None, "blocks": [
                {"block_hash": seq[i], "tokens_hash": local[i], "mm_extra_info": None}
                for i in range(len(seq))]}}, "dp_rank": 0}}


def test_jetstream_replays_what_nginx_missed(stack):
    """A publisher that never announces (so nothing can be resynced by dump):
    only the durable consumer can bring back what was published while
    nginx was down."""
    nats = stack.nats(jetstream=True)
    w = stack.worker(engines=2, extra=["--speedup", "50"])
    a, b = w.ports
    pub = kvnats.Nats(nats.port)
    pub.request_all("$JS.API.STREAM.CREATE.KVEVENTS",
                    json.dumps({"name": "KVEVENTS", "subjects": [SUBJECT]}).encode(),
                    until=lambda msgs: len(msgs) >= 1)
    servers = "server 127.0.0.1:%d;\nserver 127.0.0.1:%d;\nkvroute_worker_id %d 127.0.0.1:%d;" % (
        a, b, DYNAMO_WORKER, b)
    events = "jetstream=KVEVENTS durable=kvroute-test"
    ng = stack.nginx(conf(nats.url, w.ports, events, servers=servers))
    pub.publish(SUBJECT, json.dumps(stored(DYNAMO_WORKER, 1, ids("js1", 64))).encode())
    pub.flush()
    kvt.wait_until(lambda: indexed(ng.port, "127.0.0.1:%d" % b) == 4, what="indexed via JS")
    ng.stop()
    pub.publish(SUBJECT, json.dumps(stored(DYNAMO_WORKER, 2, ids("js2", 96))).encode())
    pub.flush()
    ng2 = stack.nginx(conf(nats.url, w.ports, events, servers=servers), port=kvt.free_port())
    kvt.wait_until(lambda: indexed(ng2.port, "127.0.0.1:%d" % b) >= 6, timeout=30,
                   what="events published while nginx was down")
    s, h, _, _ = complete(ng2.port, ids("js2", 96) + [5])
    assert h["x-kvroute-worker"] == "127.0.0.1:%d" % b and h["x-kvroute-overlap"] == "6"
    pub.close()


def test_jetstream_stream_it_creates_is_bounded(stack):
    """A stream kvroute creates keeps an hour and 1 GiB of events: the
    default keeps every event for ever on the NATS server's disk."""
    nats = stack.nats(jetstream=True)
    w = stack.worker(engines=1, extra=["--speedup", "50"])
    ng = stack.nginx(conf(nats.url, w.ports, "jetstream=KVNEW durable=kvroute-new"))
    pub = kvnats.Nats(nats.port)

    def info():
        r = pub.request_all("$JS.API.STREAM.INFO.KVNEW", b"", until=lambda m: len(m) >= 1)
        return json.loads(r[0].data)

    kvt.wait_until(lambda: "config" in info(), what="the stream created")
    c = info()["config"]
    assert c["max_age"] == 3600 * 10**9 and c["max_bytes"] == 1 << 30, c
    assert ng.alerts() == []
    pub.close()


def test_reload_to_events_mode_says_when_the_pending_index_has_no_room(stack):
    """A zone laid out for approximate mode and reused by a reload to events
    mode has no room for the pending index (the index took it): that was
    silent; it is a warning with the remedy now."""
    nats = stack.nats()
    w = stack.worker(engines=2, extra=["--speedup", "50"])
    events = conf(nats.url, w.ports)
    approx = (events.replace("kvroute_events %s zone=kv heartbeat_timeout=3s ;" % nats.url, "")
              .replace("mode=events", "mode=approximate"))
    assert "kvroute_events" not in approx and "mode=approximate" in approx
    ng = stack.nginx(approx)
    assert "pending" not in status(ng.port)
    ng.reload(events)
    kvt.wait_until(lambda: "no room for the pending index" in ng.log(), what="the warning")
    assert "restart nginx or change the zone's size" in ng.log()
    s, h, _, _ = complete(ng.port, ids("after", 64))
    assert s == 200
    assert ng.alerts() == []


def test_reload_raising_max_workers_says_the_registry_keeps_its_size(stack):
    """max_workers= raised by a reload rebuilds the index, but the worker
    registry is laid out once with the zone: that was left unsaid."""
    nats = stack.nats()
    w = stack.worker(engines=1, extra=["--speedup", "50"])
    ng = stack.nginx(conf(nats.url, w.ports))
    ng.reload(conf(nats.url, w.ports).replace("kvroute_zone kv 16m;",
                                              "kvroute_zone kv 16m max_workers=512;"))
    kvt.wait_until(lambda: "the worker registry keeps its 256 records" in ng.log(),
                   what="the warning")
    assert ng.alerts() == []


def test_pending_decisions_count_before_events_arrive(stack):
    """Events come only after a worker has prefilled: until then the router's
    own recent decisions (a short-TTL pending index) keep a prefix together."""
    nats = stack.nats()
    w = stack.worker(engines=3, extra=["--speedup", "50"])     # silent: no events ever
    ng = stack.nginx(conf(nats.url, w.ports))
    kvt.wait_until(lambda: events_status(ng.port)["nats"] == "connected", what="connected")
    s, h, _, _ = complete(ng.port, ids("pending", 160))
    first = h["x-kvroute-worker"]
    for i in range(3):
        s, h, _, _ = complete(ng.port, ids("pending", 160) + [i] * 8)
        assert h["x-kvroute-worker"] == first and h["x-kvroute-overlap"] == "10"
    assert status(ng.port)["pending"]["blocks"] >= 10
    assert indexed(ng.port, first) == 0          # the events index never heard of it
