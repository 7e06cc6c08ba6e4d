"""Self-checking index (docs/SECURITY.md, section 6): nginx compares each response's
usage.prompt_tokens_details.cached_tokens with the overlap the index
predicted for the worker chosen; a worker whose predictions drift is
resynced, or routed by load alone until they agree again.

Real processes throughout: nginx with the module, nats-server, kvworker
engines. A second kvworker on a private nats-server is the hash oracle: its
dump gives the block hashes of any prompt, which the forgers then claim for
a worker that does not hold them."""
import json
import os
import random
import signal
import time
import zlib

import kvt
from kvfake import PREFIX, FakeWorker
from kvnats import Nats

CONF = """
    kvroute_zone kv 16m;
    kvroute_events %(nats)s zone=kv heartbeat_timeout=10s;
    upstream llm {
        zone llm 64k;
        kvroute zone=kv mode=events;
        %(extra)s
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
            kvroute_debug_headers on;
        }
        location = /kvroute/status { kvroute_status; }
    }
"""

BLOCKS = 8                      # whole blocks of each test prompt


def conf(nats_url, ports, extra=""):
    servers = "\n".join("server 127.0.0.1:%d;" % p for p in ports)
    return CONF % {"nats": nats_url, "servers": servers, "extra": extra}


def prompt(name):
    """BLOCKS x 16 token ids of its own, then a short tail (the engine always
    computes the last token, so BLOCKS whole blocks is the most it can hit)."""
    r = random.Random(zlib.crc32(name.encode()))    # distinct prompts, distinct blocks
    return [r.randrange(1000, 30000) for _ in range(BLOCKS * 16)] + [7, 8, 9]


def complete(port, ids, **extra):
    body = {"model": "kvroute-mock", "prompt": ids, "max_tokens": 1}
    body.update(extra)
    return kvt.post_json(port, "/v1/completions", body)


def status(port):
    s, _, body = kvt.request(port, "GET", "/kvroute/status")
    assert s == 200
    return json.loads(body)["zones"]["kv"]


def worker_status(port, wid):
    for w in status(port)["events"]["workers"]:
        if w["worker_id"] == wid:
            return w
    return None


def worker_id(port, server):
    for w in status(port)["events"]["workers"]:
        if w["address"] == server:
            return w["worker_id"]
    return None


def indexed(port, server):
    for x in status(port)["upstreams"]["llm"]:
        if x["server"] == server:
            return x["indexed_blocks"]
    raise KeyError(server)


class Oracle:
    """A kvworker on its own nats-server: serves prompts, then dumps the
    block hashes it computed ([parent, hash, tokens_hash], parents first):
    those of the prompts of this call only."""

    def __init__(self, stack):
        self.nats = stack.nats()
        self.w = stack.worker(extra=["--speedup", "50", "--nats", self.nats.url,
                                     "--worker-id", "900", "--heartbeat-ms", "200"])
        self.nc = Nats(self.nats.port)
        self.seen = set()

    def blocks(self, prompts):
        for p in prompts:
            s, _, body, _ = complete(self.w.ports[0], p)
            assert s == 200, body
        known = set()

        def whole(msgs):
            chunks = [m.json() for m in msgs]
            return chunks and len(chunks) >= chunks[0]["chunks"]
        for _ in range(50):
            try:
                msgs = self.nc.request_all(PREFIX + ".kvroute.dump.900", {"dp_rank": 0}, whole)
            except TimeoutError:
                continue                # kvworker answers 8 dumps a second: ask again
            out = [b for m in msgs for b in m.json()["blocks"] if b[1] not in self.seen]
            known = {b[1] for b in out}
            if len(known) >= len(prompts) * BLOCKS:
                self.seen |= known
                return out
        raise AssertionError("oracle dump holds %d blocks" % len(known))


def test_forged_dump_is_detected_and_healed_by_resync(stack):
    """The forgery nothing else can see (docs/SECURITY.md section 1): a dump
    reply with the victim's exact head fields and another prompt's blocks.
    Requests for those prompts go to the victim, which reports 0 cached
    tokens: the self-check finds the drift and resyncs it from its own dump."""
    nats = stack.nats()
    oracle = Oracle(stack)
    # default worker ids (a hash of host:port): nginx maps them without
    # kvroute_worker_id in every nginx worker process
    a = stack.worker(extra=["--speedup", "50", "--nats", nats.url, "--heartbeat-ms", "200"])
    b = stack.worker(extra=["--speedup", "50", "--nats", nats.url, "--heartbeat-ms", "200"])
    ng = stack.nginx(conf(nats.url, [a.ports[0], b.ports[0]]))
    server_a = "127.0.0.1:%d" % a.ports[0]
    kvt.wait_until(lambda: len([w for w in status(ng.port)["events"]["workers"]
                                if w["state"] == "live"]) == 2, what="workers live")
    wid = worker_id(ng.port, server_a)
    prompts = [prompt("forged-%d" % i) for i in range(16)]
    forged_blocks = oracle.blocks(prompts)

    # what the forger needs: the victim's head fields, from its heartbeats
    evil = Nats(nats.port)
    hb = evil.subscribe(PREFIX + ".kvroute.heartbeat")
    msgs = evil.wait(hb, lambda ms: any(m.json().get("worker_id") == wid for m in ms))
    head = [m.json() for m in msgs if m.json().get("worker_id") == wid][-1]
    answered = []

    def answer(subject, reply, payload):
        if answered or not reply:
            return
        evil.publish(reply, {"worker_id": wid, "dp_rank": 0, "instance_id": head["instance_id"],
                             "last_event_id": head["last_event_id"], "block_size": 16,
                             "chunk": 0, "chunks": 1, "blocks": forged_blocks})
        answered.append(time.time())
    evil.subscribe(PREFIX + ".kvroute.dump.%d" % wid, answer)
    dumps = status(ng.port)["events"]["dumps"]
    # the victim is paused so the forger answers first; a far-ahead event
    # makes the router ask for a dump (the defence of section 1)
    os.kill(a.pid, signal.SIGSTOP)
    try:
        evil.publish(PREFIX + ".kv-events",
                     {"worker_id": wid, "storage_tier": "device",
                      "event": {"event_id": 1 << 62, "data": "cleared", "dp_rank": 0}})
        evil.flush()
        kvt.wait_until(lambda: status(ng.port)["events"]["dumps"] > dumps
                       and worker_status(ng.port, wid)["state"] == "live",
                       what="the forged dump applied")
    finally:
        os.kill(a.pid, signal.SIGCONT)
    assert answered
    assert indexed(ng.port, server_a) >= len(prompts) * BLOCKS

    # the index now sends those prompts to a, which has none of them
    t0 = None
    sent = 0
    while worker_status(ng.port, wid)["selfcheck_resyncs"] == 0:
        assert sent < 12, worker_status(ng.port, wid)
        s, h, body, _ = complete(ng.port, prompts[sent])
        assert s == 200
        assert h["x-kvroute-worker"] == server_a and h["x-kvroute-overlap"] == str(BLOCKS)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        t0 = t0 or time.time()
        sent += 1
        if sent >= 8:   # a verdict needs 8 samples; then wait for the helper's tick
            kvt.wait_until(lambda: worker_status(ng.port, wid)["selfcheck_resyncs"] > 0,
                           timeout=5, what="drift found")
    t_detect = time.time()
    w = worker_status(ng.port, wid)
    assert w["selfcheck_drifts"] == 1 and w["selfcheck_over"] >= 8
    assert w["selfcheck_load_only"] is False

    # healed: a's own dump replaced the forgery; a prompt never sent is not
    # credited to a any more, one that a served is
    def healed():
        w = worker_status(ng.port, wid)
        return (w["state"] == "live" and w["resyncs"] >= 2
                and indexed(ng.port, server_a) < len(prompts) * BLOCKS)
    kvt.wait_until(healed, timeout=30, what="resynced from the real dump")
    t_heal = time.time()
    s, h, _, _ = complete(ng.port, prompts[-1])
    print("\n".join(l[20:130] for l in open(ng.error_log) if "DBG" in l))
    assert s == 200 and h["x-kvroute-overlap"] == "0"
    s, h, body, _ = complete(ng.port, prompts[0])
    assert h["x-kvroute-worker"] == server_a and h["x-kvroute-overlap"] == str(BLOCKS)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == BLOCKS * 16
    # docs/BENCHMARKS.md (bench-faults): the time to detect is set by the
    # request rate (8 mispredicted responses) plus one helper tick
    print("\nself-check: drift detected %.2f s after the first mispredicted response "
          "(%d responses), healed (resync applied) %.2f s after it" % (t_detect - t0, sent,
                                                                       t_heal - t0))
    assert "self-check: worker %d" % wid in open(ng.error_log).read()
    assert ng.alerts() == []


def test_lying_publisher_is_routed_by_load_until_it_agrees(stack):
    """A publisher that does not announce itself (no dump to resync from)
    claims blocks its engine does not hold: the worker is routed by load.
    Once its events match the engine again, cache-aware routing returns."""
    nats = stack.nats()
    oracle = Oracle(stack)
    d = stack.worker(extra=["--speedup", "50"])        # the engine, publishes nothing
    server_d = "127.0.0.1:%d" % d.ports[0]
    ng = stack.nginx(conf(nats.url, d.ports, extra="kvroute_worker_id 555 %s;" % server_d))
    kvt.wait_until(lambda: status(ng.port)["events"]["nats"] == "connected", what="helper")
    liar = FakeWorker(nats.port, 555, announce=False)

    def claim(blocks):
        for parent, h, th in blocks:
            liar.store([(h, th)], parent=parent)
        liar.nc.flush()

    prompts = [prompt("lie-%d" % i) for i in range(64)]
    claim(oracle.blocks(prompts))
    kvt.wait_until(lambda: indexed(ng.port, server_d) >= len(prompts) * BLOCKS, what="claimed")
    sent = 0
    while not worker_status(ng.port, 555)["selfcheck_load_only"]:
        assert sent < 12, worker_status(ng.port, 555)
        s, h, body, _ = complete(ng.port, prompts[sent])
        assert s == 200 and h["x-kvroute-overlap"] == str(BLOCKS)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        sent += 1
        if sent >= 8:
            kvt.wait_until(lambda: worker_status(ng.port, 555)["selfcheck_load_only"],
                           timeout=5, what="load only")
    w = worker_status(ng.port, 555)
    assert w["selfcheck_drifts"] == 1 and w["selfcheck_resyncs"] == 0

    # routed by load: the index's claim no longer earns d any credit (each
    # try a prompt not sent before, so the router's own pending decisions do
    # not credit it either; an nginx worker process that missed the record
    # looks it up again within a second)
    fresh = iter(prompts[12:])
    kvt.wait_until(lambda: complete(ng.port, next(fresh))[1]["x-kvroute-overlap"] == "0",
                   what="claim ignored")
    assert worker_status(ng.port, 555)["selfcheck_load_only"]

    # the publisher tells the truth again: it claims only what d holds
    liar.clear()
    truth = [prompt("true-%d" % i) for i in range(4)]
    for p in truth:
        s, _, _, _ = complete(d.ports[0], p)
        assert s == 200
    claim(oracle.blocks(truth))
    kvt.wait_until(lambda: indexed(ng.port, server_d) == len(truth) * BLOCKS, what="truth")
    n = 0

    def agreed():
        nonlocal n
        s, _, body, _ = complete(ng.port, truth[n % len(truth)])
        assert s == 200
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == BLOCKS * 16
        n += 1
        return not worker_status(ng.port, 555)["selfcheck_load_only"]
    kvt.wait_until(agreed, timeout=30, what="cache-aware routing restored")
    w = worker_status(ng.port, 555)
    assert w["selfcheck_recoveries"] == 1 and w["selfcheck_error"] < 0.2
    s, h, _, _ = complete(ng.port, truth[0])
    assert h["x-kvroute-overlap"] == str(BLOCKS)
    assert ng.alerts() == []


def test_stream_usage_is_checked_and_plain_stream_ignored(stack):
    """The final SSE chunk's usage counts (stream_options.include_usage); a
    stream without usage gives no sample. Agreeing predictions keep the
    error at 0 and cost no resync."""
    nats = stack.nats()
    a = stack.worker(extra=["--speedup", "50", "--nats", nats.url, "--heartbeat-ms", "200"])
    ng = stack.nginx(conf(nats.url, a.ports))
    kvt.wait_until(lambda: len([w for w in status(ng.port)["events"]["workers"]
                                if w["state"] == "live"]) == 1, what="worker live")
    wid = status(ng.port)["events"]["workers"][0]["worker_id"]
    p = prompt("stream")
    s, _, _, _ = complete(a.ports[0], p)
    server_a = "127.0.0.1:%d" % a.ports[0]
    kvt.wait_until(lambda: indexed(ng.port, server_a) >= BLOCKS, what="indexed")
    s, _, _, _ = complete(ng.port, p, stream=True)
    assert s == 200
    assert worker_status(ng.port, wid)["selfcheck_samples"] == 0
    for i in range(10):
        s, _, raw, _ = complete(ng.port, p, stream=True,
                                stream_options={"include_usage": True})
        assert s == 200
    w = worker_status(ng.port, wid)
    assert w["selfcheck_samples"] == 10 and w["selfcheck_over"] == 0
    assert w["selfcheck_under"] == 0 and w["selfcheck_error"] == 0
    assert w["selfcheck_predicted_tokens"] == w["selfcheck_cached_tokens"] == 10 * BLOCKS * 16
    assert w["selfcheck_drifts"] == 0
    s, _, body = kvt.request(ng.port, "GET", "/kvroute/status?format=prometheus")
    assert b"kvroute_worker_selfcheck_error{" in body
    assert b"kvroute_worker_selfcheck_samples_total{" in body
