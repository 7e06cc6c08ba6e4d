"""Approximate mode learns how long engines keep blocks (kv_retain.h), with
ttl_learn=on (off by default: docs/CONFIG.md, "Which mode").

Real nginx with the module, real kvworker mock engines whose KV pools hold
two prompts each. Prompts cycle through more than a pool holds, so every
resent prompt's blocks were evicted; the engines' usage.cached_tokens says
so, and the zone's memory (index.ttl_ms) falls from ttl= to what the
answers support. By default it stays at ttl=. With pools that hold
everything, every credited block is found and it stays at ttl= too."""
import json
import time
import zlib

import kvt

CONF = """
    kvroute_zone kv 16m ttl=60s %(learn)s;
    upstream llm {
        zone llm 64k;
        kvroute zone=kv mode=approximate;
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

DOCS = 8            # distinct prompts
BLOCKS = 32         # whole 16-token blocks of each


def ids(doc):
    h = zlib.crc32(("doc%d" % doc).encode()) % 10000
    return [1000 + (h * 37 + i) % 30000 for i in range(BLOCKS * 16)] + [7, 8, 9]


def zone(port):
    s, _, body = kvt.request(port, "GET", "/kvroute/status")
    assert s == 200
    return json.loads(body)["zones"]["kv"]


def stack_with(stack, num_blocks, learn="", engines=2):
    w = stack.worker(engines=engines, extra=["--speedup", "50", "--num-blocks", str(num_blocks)])
    servers = "\n".join("server 127.0.0.1:%d;" % p for p in w.ports)
    return stack.nginx(CONF % {"learn": learn, "servers": servers})


def send_round(port):
    """Every prompt once, streamed with usage as OpenAI clients ask for it;
    the cached tokens each engine reported."""
    cached = []
    for d in range(DOCS):
        body = {"model": "kvroute-mock", "prompt": ids(d), "max_tokens": 1, "stream": True,
                "stream_options": {"include_usage": True}}
        s, _, _, raw = kvt.post_json(port, "/v1/completions", body)
        assert s == 200, raw
        usage = [json.loads(e).get("usage") for e in kvt.sse_events(raw) if e != "[DONE]"]
        usage = [u for u in usage if u]
        assert usage, raw
        cached.append(usage[-1]["prompt_tokens_details"]["cached_tokens"])
    return cached


def rounds_apart(port, n, gap_s=2.2):
    """n rounds, each starting gap_s after the one before: the credited
    blocks are then older than the learner's floor (2 s), where a miss is an
    eviction and not two prefills racing."""
    out = []
    for i in range(n):
        start = time.monotonic()
        out.append(send_round(port))
        if i + 1 < n:
            kvt.wait_until(lambda: time.monotonic() - start >= gap_s, interval=0.05,
                           what="the round's age")
    return out


def test_evicting_engines_shorten_the_memory(stack):
    # one engine whose pool holds one 515-token prompt and 3 spare blocks: every
    # prompt comes back after seven others, evicted whatever the placement
    ng = stack_with(stack, num_blocks=36, learn="ttl_learn=on", engines=1)
    assert zone(ng.port)["index"]["ttl_ms"] == 60000
    # a verdict needs 16 samples in one age bucket, and they decay: three
    # rounds of resends, 24 samples
    rounds = rounds_apart(ng.port, 4)
    # LRU has evicted all of each prompt but the spare blocks before it comes back
    assert all(c <= 3 * 16 for r in rounds for c in r), rounds
    z = kvt.wait_until(lambda: (lambda z: z if z["index"]["ttl_ms"] < 60000 else None)(
        zone(ng.port)), what="a shorter memory")
    assert z["ttl_samples"] >= 3 * DOCS
    # the youngest age that missed: the 2 s bucket (rounds 2.2-2.8 s apart)
    assert 2000 <= z["index"]["ttl_ms"] <= 2828, z["index"]
    # the status shows why: that bucket's credited tokens were mostly gone
    b = {x["age_ms"]: x for x in z["ttl_learn"]["buckets"]}
    assert z["index"]["ttl_ms"] in b, b
    stale = b[z["index"]["ttl_ms"]]
    assert stale["wrong_tokens"] > stale["right_tokens"] and stale["samples"] >= 16, stale
    s, _, text = kvt.request(ng.port, "GET", "/kvroute/status?format=prometheus")
    assert s == 200
    assert 'kvroute_ttl_learn_wrong_tokens{zone="kv",age_ms="%d"}' % z["index"]["ttl_ms"] \
        in text.decode()
    assert 'kvroute_index_ttl_ms{zone="kv"} %d' % z["index"]["ttl_ms"] in text.decode()
    # and the memory is used: what was recorded that long ago expires
    kvt.wait_until(lambda: zone(ng.port)["index"]["expired"] > 0, what="expiry")


def test_by_default_the_memory_is_the_configured_one(stack):
    ng = stack_with(stack, num_blocks=36, engines=1)
    rounds_apart(ng.port, 3)
    z = zone(ng.port)
    assert z["ttl_samples"] == 0 and "ttl_learn" not in z
    # the timer has run (twice a second) and left it alone
    time_seen = time.monotonic()
    kvt.wait_until(lambda: time.monotonic() - time_seen > 1.0, what="two ticks")
    assert zone(ng.port)["index"]["ttl_ms"] == 60000


def test_engines_that_keep_everything_keep_the_memory(stack):
    ng = stack_with(stack, num_blocks=4096, learn="ttl_learn=on")
    rounds = rounds_apart(ng.port, 3)
    assert all(c == BLOCKS * 16 for r in rounds[1:] for c in r), rounds
    z = zone(ng.port)
    assert z["ttl_samples"] >= 2 * DOCS
    assert z["index"]["ttl_ms"] == 60000


def test_ttl_learn_takes_on_or_off(stack):
    for value, good in (("on", True), ("off", True), ("yes", False)):
        ok, out, _ = stack.nginx_t(CONF % {"learn": "ttl_learn=" + value,
                                           "servers": "server 127.0.0.1:1;"})
        assert ok == good, out
        if not good:
            assert 'invalid "ttl_learn=yes"' in out and "ttl_learn=on" in out, out
