"""The balancer re-reads every server's indexed blocks for a seed and a spill
(src/ngx/ngx_http_kvroute_balancer.c, kv_route_why_reads_blocks(), issue 18):
real nginx in events mode, one nats-server, four kvworker mock engines A, B,
C, D publishing KV events and heartbeats.

The gather reads a server's block count (tree_blocks) only where it holds
part of the prompt. A seed (a branch off a head held by two servers or more,
all at capacity: kv_route.c, pick_shared) and a spill (the prompt's holders
saturated) both go to a server holding none of the prompt, chosen by
pick_spill: fewest requests in flight, then fewest indexed blocks (within a
band of one prompt's blocks), then the rendezvous order of the prompt's first
block. Without the re-read every non-holder counts 0 blocks and rendezvous
alone decides: with C holding many blocks and D few, some of the prompts
below go to C (the engines' worker ids are fixed, so which ones is too:
with the re-read limited to spills, 4 of the 8 seeds went to C; with it
removed, those 4 and 5 of the 8 spills). With it, every one goes to D.

Load comes from the workers' reports (worker_load=max): the requests that
keep A and B busy are sent to them directly, never through nginx, so each
test waits for a report that shows them (and one that shows the engine
that served the last request idle again) before it sends the next prompt."""
import http.client
import json
import random
import re
import time
import zlib

import kvt

CONF = """
    kvroute_zone kv 16m;
    kvroute_events %(nats)s zone=kv;
    upstream llm {
        zone llm 64k;
        kvroute zone=kv mode=events worker_load=max;
        %(ids)s
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
            add_header X-Why $kvroute_why;
        }
        location = /kvroute/status { kvroute_status; }
    }
"""

ENGINES = 4
FIRST_ID = 7000             # engine i is worker 7000 + i: a fixed rendezvous order
BS = 16                     # the mock's block size (tokens)
HEADS = 8                   # prompts placed by the rule under test, one each
HEAD_TOKENS = 4 * BS
QUESTION_TOKENS = 2 * BS    # band: one prompt's blocks, 6
C_PROMPTS = 4               # C holds about 4 x 64 blocks ...
C_TOKENS = 64 * BS
D_TOKENS = 4 * BS           # ... D about 4, and 4 + 8 x 7 after the heads
BUSY_OUT = 100000           # outputs no test waits for (closed at its end)


def tokens(name, n):
    """n token ids of their own: no block shared with another name's."""
    r = random.Random(zlib.crc32(name.encode()))
    return [r.randrange(1000, 30000) for _ in range(n)]


def addr(port):
    return "127.0.0.1:%d" % port


def zone(port):
    s, _, body = kvt.request(port, "GET", "/kvroute/status")
    assert s == 200
    return json.loads(body)["zones"]["kv"]


def indexed(port):
    return {x["server"]: x["indexed_blocks"] for x in zone(port)["upstreams"]["llm"]}


def nginx_idle(port):
    return all(x["active_requests"] == 0 for x in zone(port)["upstreams"]["llm"])


def report(port, address):
    """The engine's last heartbeat as nginx holds it, and when it came
    (time.monotonic())."""
    t = time.monotonic()
    for w in zone(port)["events"]["workers"]:
        if w["address"] == address:
            return w, t - w["seen_ms_ago"] / 1000.0
    return None, 0


def running(wport):
    """Requests the engine itself runs or queues (its /metrics)."""
    s, _, body = kvt.request(wport, "GET", "/metrics")
    assert s == 200
    n = 0
    for name in ("kvworker_requests_running", "kvworker_requests_waiting"):
        m = re.search(r"^%s(?:\{[^}]*\})? (\S+)$" % name, body.decode(), re.M)
        assert m, body
        n += int(float(m.group(1)))
    return n


def direct(wport, prompt, max_tokens=1):
    """A request to the engine itself, past nginx: its events fill the index."""
    s, _, _, raw = kvt.post_json(wport, "/v1/completions",
                                 {"model": "kvroute-mock", "prompt": prompt,
                                  "max_tokens": max_tokens})
    assert s == 200, raw


class Busy:
    """A request in flight on one engine until close(): an output far longer
    than any test, never read."""

    def __init__(self, wport, prompt):
        self.c = http.client.HTTPConnection("127.0.0.1", wport, timeout=30)
        self.c.request("POST", "/v1/completions",
                       body=json.dumps({"model": "kvroute-mock", "prompt": prompt,
                                        "max_tokens": BUSY_OUT, "stream": True}),
                       headers={"Content-Type": "application/json"})

    def close(self):
        self.c.close()


def make_fleet(stack):
    nats = stack.nats()
    # heartbeats every 250 ms: a report is believed for 10 of them and a
    # silent worker goes stale after 3, margin for a loaded machine; every
    # load change (a request in, one out) is reported at once (--load-ms)
    w = stack.worker(engines=ENGINES, extra=["--nats", nats.url, "--heartbeat-ms", "250",
                                             "--worker-id", str(FIRST_ID)])
    ids = "\n".join("kvroute_worker_id %d %s;" % (FIRST_ID + i, addr(p))
                    for i, p in enumerate(w.ports))
    servers = "\n".join("server %s;" % addr(p) for p in w.ports)
    ng = stack.nginx(CONF % {"nats": nats.url, "ids": ids, "servers": servers}, workers=1)
    kvt.wait_until(lambda: len([x for x in zone(ng.port)["events"]["workers"]
                                if x["state"] == "live"]) == ENGINES,
                   what="every engine live")
    return w, ng


def fill(ng, wport, prompts):
    """Sends prompts to one engine directly and waits until nginx indexed
    all their full blocks for it."""
    before = indexed(ng.port)[addr(wport)]
    for p in prompts:
        direct(wport, p)
    want = before + sum(len(p) // BS for p in prompts)
    kvt.wait_until(lambda: indexed(ng.port)[addr(wport)] >= want,
                   what="%s indexed %d blocks" % (addr(wport), want))


def keep_busy(ng, wport, n, busy):
    """n requests in flight on the engine, and a heartbeat in nginx that
    counts them all: started one by one, each waits for the engine to run
    it; then a report that could only have been sent with all n running
    (its decode blocks hold the last one's whole prompt and at least one
    block of each other: the earlier never end)."""
    prompts = [tokens("busy-%d-%d" % (wport, i), (i + 1) * 40 * BS) for i in range(n)]
    for i, p in enumerate(prompts):
        busy.append(Busy(wport, p))
        kvt.wait_until(lambda: running(wport) >= i + 1,
                       what="%s runs %d requests" % (addr(wport), i + 1))
    floor = len(prompts[-1]) // BS + (n - 1)
    kvt.wait_until(lambda: (report(ng.port, addr(wport))[0] or {}).get(
        "active_decode_blocks", 0) >= floor,
        what="nginx holds a report of %s running %d" % (addr(wport), n))


def settled(ng, wports, busy_ports):
    """Nothing nginx sent is in flight, and the engines not kept busy ran
    nothing when they last reported (a report that came before the last
    request ended is not taken: a stale one saying D runs a request would
    lift the capacity to 2 and let A take the branch)."""
    since = time.monotonic()
    kvt.wait_until(lambda: nginx_idle(ng.port), what="nginx counts nothing in flight")
    for p in wports:
        if p in busy_ports:
            continue
        kvt.wait_until(lambda: running(p) == 0, what="%s idle" % addr(p))

        def idle_report():
            w, seen = report(ng.port, addr(p))
            return (w is not None and seen > since and w["active_decode_blocks"] == 0
                    and w["active_prefill_tokens"] == 0)
        kvt.wait_until(idle_report, what="a report of %s idle" % addr(p))


def send(ng, prompt):
    s, h, _, raw = kvt.post_json(ng.port, "/v1/completions",
                                 {"model": "kvroute-mock", "prompt": prompt, "max_tokens": 1})
    assert s == 200, raw
    return h["x-kvroute-worker"], h.get("x-why")


def test_seed_goes_to_the_server_with_fewest_blocks(stack):
    """Heads held by A and B, both at capacity (1 request in flight each
    on 4 engines: capacity ceil(1.25 x 3 / 4) = 1), so a branch off each
    head seeds C or D, idle both; C holds ~256 blocks, D ~4 (~60 once the
    seeds are in: still far below C's less the band of 6)."""
    w, ng = make_fleet(stack)
    a, b, c, d = w.ports
    heads = [tokens("head-%d" % j, HEAD_TOKENS) for j in range(HEADS)]
    fill(ng, a, heads)
    fill(ng, b, heads)
    fill(ng, c, [tokens("c-%d" % j, C_TOKENS) for j in range(C_PROMPTS)])
    fill(ng, d, [tokens("d", D_TOKENS)])
    busy = []
    try:
        keep_busy(ng, a, 1, busy)
        keep_busy(ng, b, 1, busy)
        where = []
        for j, head in enumerate(heads):
            settled(ng, w.ports, (a, b))
            blocks = indexed(ng.port)
            assert blocks[addr(c)] > blocks[addr(d)] + (HEAD_TOKENS + QUESTION_TOKENS) // BS, \
                blocks
            where.append((j,) + send(ng, head + tokens("question-%d" % j, QUESTION_TOKENS)))
            # D holds the branch before the next: its count is the next input
            kvt.wait_until(lambda: indexed(ng.port)[where[-1][1]] > blocks[where[-1][1]],
                           what="%s indexed the branch" % where[-1][1])
        assert [x for x in where if x[1:] != (addr(d), "seed")] == [], \
            "D is %s, C %s: %s" % (addr(d), addr(c), where)
    finally:
        for x in busy:
            x.close()
    assert ng.alerts() == []


def test_spill_goes_to_the_server_with_fewest_blocks(stack):
    """Prefixes held by A alone, A saturated (2 requests in flight where
    the mean is 0.75: outside the load bound 0.75 x 1.25 + 1), B busy with
    1 (not among the least loaded), so each prefix's next request spills to
    C or D, idle both; C holds ~256 blocks, D ~4."""
    w, ng = make_fleet(stack)
    a, b, c, d = w.ports
    prefixes = [tokens("prefix-%d" % j, HEAD_TOKENS) for j in range(HEADS)]
    fill(ng, a, prefixes)
    fill(ng, c, [tokens("c-%d" % j, C_TOKENS) for j in range(C_PROMPTS)])
    fill(ng, d, [tokens("d", D_TOKENS)])
    busy = []
    try:
        keep_busy(ng, a, 2, busy)
        keep_busy(ng, b, 1, busy)
        where = []
        for j, prefix in enumerate(prefixes):
            settled(ng, w.ports, (a, b))
            blocks = indexed(ng.port)
            assert blocks[addr(c)] > blocks[addr(d)] + (HEAD_TOKENS + QUESTION_TOKENS) // BS, \
                blocks
            where.append((j,) + send(ng, prefix + tokens("turn-%d" % j, QUESTION_TOKENS)))
            kvt.wait_until(lambda: indexed(ng.port)[where[-1][1]] > blocks[where[-1][1]],
                           what="%s indexed the turn" % where[-1][1])
        assert [x for x in where if x[1:] != (addr(d), "spill")] == [], \
            "D is %s, C %s: %s" % (addr(d), addr(c), where)
    finally:
        for x in busy:
            x.close()
    assert ng.alerts() == []
