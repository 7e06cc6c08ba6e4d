"""Shared decisions between nginx instances (issue 18, kvroute_share):
three nginx instances on loopback in approximate mode (no KV events, no
worker heartbeats), one nats-server that only they use, kvworker mock
engines. Each instance's helper publishes its decisions and its own
in-flight load on P.kvroute.decisions and applies the others'
(docs/PROTOCOL.md, "Shared decisions")."""
import json
import os
import signal
import struct
import sys

import pytest

import kvt

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "lib"))
import kvnats  # noqa: E402
import test_multi_instance as multi  # noqa: E402

SUBJECT = "namespace.dynamo.component.backend.kvroute.decisions"

# test_multi_instance's stack, with instances that share decisions instead
# of reading KV events
CONF = (multi.CONF
        .replace("kvroute_events %(nats)s zone=kv;",
                 "kvroute_share %(nats)s zone=kv lease=1s;")
        .replace("mode=events worker_load=%(load)s", "mode=approximate"))
assert "kvroute_share" in CONF and "mode=approximate" in CONF

ENGINES, ids, zone = multi.ENGINES, multi.ids, multi.zone


def share(port):
    return zone(port)["share"]


def active(port):
    return {x["server"]: x["active_requests"] for x in zone(port)["upstreams"]["llm"]}


def complete(port, prompt, max_tokens=1):
    s, h, _, raw = kvt.post_json(port, "/v1/completions",
                                 {"model": "kvroute-mock", "prompt": prompt,
                                  "max_tokens": max_tokens})
    assert s == 200, raw
    return h["x-kvroute-worker"], int(h["x-kvroute-overlap"])


def make_fleet(stack, params="", worker_extra=()):
    nats = stack.nats()
    w = stack.worker(engines=ENGINES, extra=["--speedup", "20"] + list(worker_extra))
    servers = "\n".join("server 127.0.0.1:%d;" % p for p in w.ports)
    ngs = [stack.nginx(CONF % {"nats": nats.url, "servers": servers, "params": params},
                       workers=1)
           for _ in range(3)]
    for ng in ngs:
        kvt.wait_until(lambda: share(ng.port)["connected"] == 1,
                       what="instance %d's share helper connected" % ng.port)
    return nats, w, ngs


def test_approximate_turns_round_robin_land_on_one_worker(stack):
    """Each turn goes to the next instance, which learned the previous
    turn's decision from the instance that made it: it routes with the
    whole conversation so far as overlap, to the same worker."""
    _, _, ngs = make_fleet(stack)
    for conv in range(4):
        prompt = ids("system-%d" % conv, 256)
        where = set()
        for turn in range(6):
            prompt = prompt + ids("conv-%d-turn-%d" % (conv, turn), 48)
            ng = ngs[turn % 3]
            before = [share(x.port)["records_in"] for x in ngs]
            worker, overlap = complete(ng.port, prompt)
            where.add(worker)
            if turn > 0:
                # an instance that never saw this conversation still knew it
                assert overlap > 0, (conv, turn)
            for x, was in zip(ngs, before):
                if x is not ng:
                    kvt.wait_until(lambda: share(x.port)["records_in"] > was,
                                   what="instance %d heard the decision" % x.port)
                    # and that the request ended: the decision's message may
                    # carry its load, and a holder still counted busy may
                    # rightly lose the next turn to an idle server
                    kvt.wait_until(lambda: share(x.port)["remote_requests"] == 0,
                                   what="instance %d heard the request end" % x.port)
        assert len(where) == 1, (conv, where)
    for ng in ngs:
        st = share(ng.port)
        assert st["dropped"] == 0 and st["rejected"] == 0, st
        assert ng.alerts() == []

    # the same counters in Prometheus
    from prometheus_client.parser import text_string_to_metric_families
    s, _, body = kvt.request(ngs[0].port, "GET", "/kvroute/status?format=prometheus")
    assert s == 200
    fams = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert fams["kvroute_share_records_in"].samples[0].value == share(ngs[0].port)["records_in"]
    assert "kvroute_share_dropped" in fams and "kvroute_share_rejected" in fams


def test_continued_responses_through_any_instance(stack):
    """A Responses API conversation whose turns go round-robin over the
    instances, each continuing the last response (previous_response_id):
    every instance learns which engine made each response from the one it
    went through (a response record), so every turn reaches the engine
    holding the conversation, the only one that can continue it (any other
    answers 404)."""
    _, _, ngs = make_fleet(stack, worker_extra=["--responses-store", "64"])
    made = 0
    for conv in range(3):
        rid, home = None, None
        for turn in range(4):
            ng = ngs[(conv + turn) % 3]
            body = {"model": "kvroute-mock", "input": "conversation %d, turn %d" % (conv, turn),
                    "max_output_tokens": 2}
            if rid:
                body["previous_response_id"] = rid
            s, h, parsed, raw = kvt.post_json(ng.port, "/v1/responses", body)
            assert s == 200, raw
            assert home is None or h["x-kvroute-worker"] == home, (conv, turn)
            home, rid = h["x-kvroute-worker"], parsed["id"]
            made += 1
            for x in ngs:
                kvt.wait_until(lambda: zone(x.port)["responses"]["stored"] >= made,
                               what="instance %d knows %d responses" % (x.port, made))


def hold(port, prompt, max_tokens=30000):
    return multi.hold(port, prompt, max_tokens)


def test_load_through_one_instance_steers_the_others(stack):
    """Three long requests through instance A occupy three engines; B and C,
    which sent nothing and get no heartbeat from any worker, count them from
    A's messages and send new prompts to the fourth engine."""
    _, w, ngs = make_fleet(stack, "decode_pace=0.01")
    a, b, c = ngs
    held = [hold(a.port, ids("long-%d" % i, 64)) for i in range(3)]
    busy = {wk for _, wk in held}
    assert len(busy) == 3
    idle = {"127.0.0.1:%d" % p for p in w.ports} - busy
    for ng in (b, c):
        kvt.wait_until(lambda: all(active(ng.port)[x] == 1 for x in busy)
                       and share(ng.port)["remote_requests"] == 3,
                       what="A's load reached instance %d" % ng.port)
        assert zone(ng.port)["requests"] == 0
    for i in range(6):
        ng = (b, c)[i % 2]
        # everything the others published so far has reached ng (what
        # another sent after its last request ended included)
        others = [x for x in ngs if x is not ng]
        sent = sum(share(x.port)["messages_out"] for x in others)
        kvt.wait_until(lambda: share(ng.port)["messages_in"] >= sent
                       and all(active(ng.port)[x] == 0 for x in idle),
                       what="the idle engine idle again at %d" % ng.port)
        got = complete(ng.port, ids("fresh-%d" % i, 64))
        assert got[0] in idle, (i, got, zone(ng.port)["upstreams"]["llm"])
    for s, _ in held:
        s.close()


def test_killed_instance_leaves_no_remote_load(stack):
    """A dies with requests in flight: it publishes nothing more, and the
    others forget its load when the lease (1 s here) runs out."""
    _, _, ngs = make_fleet(stack, "decode_pace=0.01")
    a, b, c = ngs
    held = [hold(a.port, ids("dies-%d" % i, 64)) for i in range(3)]
    for ng in (b, c):
        kvt.wait_until(lambda: share(ng.port)["remote_requests"] == 3,
                       what="A's load reached instance %d" % ng.port)
    os.killpg(a.proc.pid, signal.SIGKILL)
    a.proc.wait()
    for ng in (b, c):
        kvt.wait_until(lambda: share(ng.port)["remote_requests"] == 0
                       and all(v == 0 for v in active(ng.port).values()),
                       what="no load of the dead instance left at %d" % ng.port)
        st = share(ng.port)
        assert st["expired"] >= 3 and st["instances"] == 0, st   # the others sent nothing
    for s, _ in held:
        s.close()


def requests_in(msg):
    """The requests in flight a message says its sender holds (the wire
    format: kv_share.c)."""
    nrec, nload = struct.unpack_from("<HH", msg, 16)
    off = 32
    for _ in range(nrec):
        off += 16 + 8 * struct.unpack_from("<I", msg, off + 12)[0]
    return sum(struct.unpack_from("<q", msg, off + 40 * i + 24)[0] for i in range(nload))


def test_malformed_messages_rejected_and_counted(stack):
    """Garbage on the subject is refused whole and counted; the instance
    keeps routing and applying well-formed messages. A well-formed message
    from an instance that never speaks again (a replay under a new id) adds
    its load only until the lease runs out."""
    nats, w, ngs = make_fleet(stack, "decode_pace=0.01")
    a, b, _ = ngs
    nc = kvnats.Nats(nats.port)
    sid = nc.subscribe(SUBJECT)
    # one prompt twice: both on one server (the second is sticky to the
    # first's blocks), so one load entry says 2 whenever the two start; on
    # two servers a message says both only if they started within one send
    # interval (refreshes keep each server's own phase), which a loaded
    # machine missed
    held = [hold(a.port, ids("real", 64)) for _ in range(2)]
    assert held[0][1] == held[1][1], held
    kvt.wait_until(lambda: share(b.port)["remote_requests"] == 2, what="B counts A's load")
    # a message that says both (a refresh: every nonzero server)
    msgs = nc.wait(sid, lambda m: any(requests_in(x.data) == 2 for x in m))
    real = [m.data for m in msgs if requests_in(m.data) == 2][-1]
    for s, _ in held:
        s.close()
    kvt.wait_until(lambda: share(b.port)["remote_requests"] == 0, what="A's requests ended")

    bad = [b"", b"KVD1", b"XXXX" + real[4:], real[:-1], real + b"\0",
           real[:4] + b"\x02\x00" + real[6:],                       # version 2
           real[:8] + b"\0" * 8 + real[16:],                        # instance 0
           real[:16] + b"\xff\xff" + real[18:],                     # 65535 records
           real[:32] + b"\0" * 8 + b"\xff" * 32 + real[72:]]        # negative load
    # a decision record with n = 1000 hashes
    bad.append(real[:16] + b"\x01\x00\x00\x00" + real[20:32]
               + struct.pack("<QII", 1, 0, 1000) + b"\0" * 64)
    before = share(b.port)["rejected"]
    for x in bad:
        nc.publish(SUBJECT, x)
    nc.flush()
    kvt.wait_until(lambda: share(b.port)["rejected"] == before + len(bad),
                   what="every malformed message counted")
    assert complete(b.port, ids("still-routes", 64))[0]

    # a replay of A's load under another instance id: applied, then expired
    ghost = real[:8] + struct.pack("<Q", 0x600d) + real[16:]
    nc.publish(SUBJECT, ghost)
    nc.flush()
    kvt.wait_until(lambda: share(b.port)["remote_requests"] == 2, what="the ghost's load counted")
    kvt.wait_until(lambda: share(b.port)["remote_requests"] == 0,
                   what="the ghost's load expired with its lease")
    for ng in ngs:
        assert ng.alerts() == []
    nc.close()


TWO_ZONES = """
    kvroute_zone sh 16m;
    kvroute_share nats://127.0.0.1:%(dead)d zone=sh lease=1s;
    kvroute_zone kv 16m;
    kvroute_events %(nats)s zone=kv heartbeat_timeout=3s;
    upstream shared {
        zone shared 64k;
        kvroute zone=sh mode=approximate;
        %(servers)s
    }
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
        }
        location = /kvroute/status { kvroute_status; }
    }
"""


def test_share_with_nats_down_stops_no_other_helper(stack):
    """kvroute_share connected with cnats' retry and no connected callback,
    which blocks until NATS answers: with its NATS down, the process that
    runs every zone's helper stopped there, and another zone's KV events
    were never read. Now it connects in the background and says so."""
    nats = stack.nats()
    w = stack.worker(engines=2, extra=["--speedup", "50", "--nats", nats.url,
                                       "--heartbeat-ms", "200"])
    servers = "\n".join("server 127.0.0.1:%d;" % p for p in w.ports)
    dead = kvt.free_port()
    ng = stack.nginx(TWO_ZONES % {"dead": dead, "nats": nats.url, "servers": servers})

    def live():
        z = zone(ng.port)                       # zone "kv"
        return len([x for x in z["events"]["workers"] if x["state"] == "live"])

    kvt.wait_until(lambda: live() == 2, what="the events zone's workers announced")
    s, _, body = kvt.request(ng.port, "GET", "/kvroute/status")
    assert s == 200
    assert json.loads(body)["zones"]["sh"]["share"]["connected"] == 0
    # and it connects once its NATS is up
    stack.nats(port=dead)
    kvt.wait_until(lambda: json.loads(kvt.request(ng.port, "GET", "/kvroute/status")[2])
                   ["zones"]["sh"]["share"]["connected"] == 1, what="the share helper connected")
