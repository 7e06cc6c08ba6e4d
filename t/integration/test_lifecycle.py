"""Worker lifecycle (docs/SECURITY.md, section 2): records and index slots are freed
when a worker leaves, a worker restarting under a new id replaces its old
one, and a full table evicts the stalest record instead of refusing live
workers; thousands of ids churn through max_workers=4 while the real
workers stay indexed and routed (real nats-server, kvingest, nginx,
kvworker)."""
import json
import random

import pytest

import kvingest
import kvt
from kvfake import PREFIX, FakeWorker
from kvnats import Nats
import kvproto

ok, why = kvingest.available()
pytestmark = pytest.mark.skipif(not ok, reason="kvingest unavailable: %s" % why)

SUBJ = kvproto.events(PREFIX)
HB = kvproto.heartbeat(PREFIX)


def chain(base, n):
    return [(base + i, base * 7 + i + 1) for i in range(n)]


def start(stack, max_workers=4):
    nats = stack.nats()
    ing = kvingest.Ingest(stack, nats.url, extra=["--max-workers", str(max_workers)])
    ing.wait(lambda s: s["nats"] == "connected", what="connected")
    return nats, ing


def real_worker(ing, port, wid, base):
    w = FakeWorker(port, wid, address="127.0.0.1:%d" % (8000 + wid % 1000), interval_ms=300)
    ing.wait(lambda s: (ing.worker(wid, st=s) or {}).get("state") == "live"
             and ing.worker(wid, st=s)["resyncs"] >= 1, what="worker %d verified" % wid)
    w.store(chain(base, 2))
    ing.wait(lambda s: ing.worker(wid, st=s)["blocks"] == 2, what="worker %d stored" % wid)
    return w


def test_leave_frees_record_and_slots(stack):
    nats, ing = start(stack)
    w = real_worker(ing, nats.port, 11, 1000)
    w.leave()
    st = ing.wait(lambda s: ing.worker(11, st=s) is None and s["index_blocks"] == 0,
                  what="record and blocks freed")
    assert st["removed"] == 1 and st["index_workers"] == 0
    assert ing.match([1000 * 7 + 1]) == {}


def test_restart_under_new_id_replaces_the_old_one(stack):
    """Engines that take a new id on every restart (Dynamo's) used to fill
    max_workers=4 after four restarts; the fifth was never indexed."""
    nats, ing = start(stack)
    prev = None
    for n in range(8):
        wid = 500 + n
        if prev is not None:
            prev.close()                                        # crashed: no leave
        w = FakeWorker(nats.port, wid, address="127.0.0.1:9100", interval_ms=300)
        ing.wait(lambda s: (ing.worker(wid, st=s) or {}).get("state") == "live",
                 what="incarnation %d live" % n)
        w.store(chain(2000 + 10 * n, 1))
        st = ing.wait(lambda s: ing.worker(wid, st=s)["blocks"] == 1, what="indexed %d" % n)
        assert ing.match([(2000 + 10 * n) * 7 + 1]) == {wid: 1}
        if prev is not None:
            assert ing.worker(prev.worker_id, st=st) is None    # replaced at once
        assert len(st["workers"]) == 1
        prev = w
    prev.close()


def test_churn_thousands_of_ids_keeps_live_workers(stack):
    nats, ing = start(stack)
    a = real_worker(ing, nats.port, 21, 3000)
    b = real_worker(ing, nats.port, 22, 4000)
    evil = Nats(nats.port)
    rnd = random.Random(7)
    for k in range(3000):
        wid = rnd.getrandbits(62) | 1 << 40
        evil.publish(SUBJ, json.dumps({"worker_id": wid, "event": {
            "event_id": rnd.randrange(1, 1000), "dp_rank": 0, "data": {"stored": {
                "parent_hash": None, "blocks": [{"block_hash": k, "tokens_hash": k}]}}}}))
        if k % 10 == 0:     # heartbeats nobody answers dumps for
            evil.publish(HB, {"type": "announce", "worker_id": wid + 1, "dp_rank": 0,
                              "instance_id": 5, "address": "10.0.0.%d:1" % (k % 250),
                              "last_event_id": 0, "interval_ms": 1000})
    evil.flush()
    st = ing.wait(lambda s: s["messages"] >= 3000 and s["heartbeats"] >= 300,
                  timeout=30, what="flood received")
    assert st["removed"] >= 3000 - 4
    for w, base in ((a, 3000), (b, 4000)):
        rec = ing.worker(w.worker_id, st=st)
        assert rec is not None and rec["state"] == "live" and rec["blocks"] == 2, rec
        assert ing.match([base * 7 + 1]) == {w.worker_id: 1}
    assert len(st["workers"]) <= 4 and st["index_workers"] <= 4
    # live workers keep applying, and a newcomer is indexed (evicting a fake)
    a.store(chain(5000, 1))
    c = real_worker(ing, nats.port, 23, 6000)
    st = ing.wait(lambda s: ing.worker(21, st=s)["blocks"] == 3, what="a still applied")
    assert ing.worker(22, st=st)["blocks"] == 2 and ing.worker(23, st=st)["blocks"] == 2
    for w in (a, b, c):
        w.close()


NGINX_CONF = """
    kvroute_zone kv 16m max_workers=4;
    kvroute_events %(nats)s zone=kv;
    upstream llm {
        zone llm 64k;
        kvroute zone=kv mode=events;
        %(servers)s
    }
    server {
        listen 127.0.0.1:%%(port)s;
        location /v1/ {
            kvroute_upstream llm;
            proxy_pass http://llm;
            kvroute_debug_headers on;
        }
        location = /kvroute/status { kvroute_status; }
    }
"""


def test_churn_through_nginx_keeps_routing(stack):
    """The same flood against the nginx helper: the two real kvworkers stay
    live, indexed and routed by overlap."""
    nats = stack.nats()
    w = stack.worker(engines=2, extra=["--speedup", "50", "--nats", nats.url,
                                       "--heartbeat-ms", "200"])
    servers = "\n".join("server 127.0.0.1:%d;" % p for p in w.ports)
    ng = stack.nginx(NGINX_CONF % {"nats": nats.url, "servers": servers})

    def status():
        s, _, body = kvt.request(ng.port, "GET", "/kvroute/status")
        return json.loads(body)["zones"]["kv"]

    def live():
        return [x for x in status()["events"]["workers"] if x["state"] == "live"
                and x["address"] in ("127.0.0.1:%d" % p for p in w.ports)]
    kvt.wait_until(lambda: len(live()) == 2, what="workers announced")
    evil = Nats(nats.port)
    rnd = random.Random(9)
    for k in range(3000):
        evil.publish(SUBJ, json.dumps({"worker_id": rnd.getrandbits(62), "event": {
            "event_id": 5, "dp_rank": 0, "data": {"stored": {
                "parent_hash": None, "blocks": [{"block_hash": k, "tokens_hash": k}]}}}}))
    evil.flush()
    kvt.wait_until(lambda: status()["events"]["messages"] >= 3000, timeout=30, what="flood")
    assert len(live()) == 2
    prompt = [1000 + i for i in range(320)]
    blocks = status()["events"]["blocks"]
    s, _, body = kvt.request(w.ports[0], "POST", "/v1/completions", json.dumps(
        {"model": "kvroute-mock", "prompt": prompt, "max_tokens": 1}).encode(),
        {"Content-Type": "application/json"})
    assert s == 200, body
    kvt.wait_until(lambda: status()["events"]["blocks"] >= blocks + 20, what="indexed")

    def routed():
        s, h, _, _ = kvt.post_json(ng.port, "/v1/completions",
                                   {"model": "kvroute-mock", "prompt": prompt + [7] * 16,
                                    "max_tokens": 1})
        return s == 200 and h["x-kvroute-worker"] == "127.0.0.1:%d" % w.ports[0] \
            and h["x-kvroute-overlap"] == "20"
    kvt.wait_until(routed, timeout=10, what="routed to the cache holder after the flood")
    assert len(live()) == 2
    evil.close()
