"""Batches of prompts beside interactive traffic: what an evaluation job
sending `"prompt": [...]` batches does to everyone else's time to first
token, through nginx in events mode.

4 kvworker mock engines (the default timing model, --speedup SPEEDUP, default 1).
Interactive: CLIENTS loops, each sending streamed completions of one of 8
system prompts (1,024 tokens) + 64 tokens of its own, max_tokens 32, one
after another. Batch: BATCHERS loops, each sending batches of BATCH prompts
(a 256-token few-shot prefix shared by the batch + 768 tokens each),
max_tokens 64, not streamed. Every loop runs for SECONDS. KVROUTE_BUILD
picks the module build (an old one counts a batch as its first prompt).
Prints one JSON line: the interactive requests' TTFT (mean, p50, p90, p99,
ms), the batches' time, the requests per engine.
"""
import http.client
import json
import os
import random
import sys
import threading
import time

TOP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..")
sys.path.insert(0, os.path.join(TOP, "t", "lib"))
import kvt  # noqa: E402

SEED = int(os.environ.get("SEED", "1"))
CLIENTS = int(os.environ.get("CLIENTS", "6"))
BATCHERS = int(os.environ.get("BATCHERS", "2"))
BATCH = int(os.environ.get("BATCH", "32"))
SECONDS = float(os.environ.get("SECONDS", "30"))
SPEEDUP = os.environ.get("SPEEDUP", "1")

CONF = """
    kvroute_zone kv 64m;
    kvroute_events %(nats)s zone=kv;
    upstream llm {
        zone llm 64k;
        kvroute zone=kv mode=events;
        %(servers)s
        keepalive 32;
    }
    server {
        listen 127.0.0.1:%%(port)s;
        client_body_buffer_size 1m;
        location /v1/ {
            kvroute_upstream llm;
            proxy_pass http://llm;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            kvroute_debug_headers on;
        }
    }
"""


def post(port, body, stream):
    """(status, seconds to the first body byte, seconds in all, worker)"""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    t0 = time.monotonic()
    c.request("POST", "/v1/completions", json.dumps(body),
              {"Content-Type": "application/json"})
    r = c.getresponse()
    first = None
    if stream:
        for line in r:
            if line.startswith(b"data:") and first is None:
                first = time.monotonic() - t0
    else:
        r.read()
    end = time.monotonic() - t0
    c.close()
    return r.status, first if first is not None else end, end, r.getheader("x-kvroute-worker")


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0


def main():
    rng = random.Random(SEED)
    systems = [[rng.randrange(1000, 30000) for _ in range(1024)] for _ in range(8)]
    st = kvt.Stack("batch-ab")
    rows, batches, lock = [], [], threading.Lock()
    try:
        nats = st.nats()
        w = st.worker(engines=4, extra=["--nats", nats.url, "--heartbeat-ms", "200",
                                        "--speedup", SPEEDUP])
        servers = "\n".join("server 127.0.0.1:%d;" % p for p in w.ports)
        ng = st.nginx(CONF % {"nats": nats.url, "servers": servers})
        end = time.monotonic() + SECONDS

        def interactive(k):
            r = random.Random(SEED * 1000 + k)
            while time.monotonic() < end:
                prompt = systems[r.randrange(8)] + [r.randrange(1000, 30000) for _ in range(64)]
                s, ttft, e2e, wk = post(ng.port, {"prompt": prompt, "max_tokens": 32,
                                                  "stream": True, "ignore_eos": True}, True)
                assert s == 200
                with lock:
                    rows.append((ttft, e2e, wk))

        def batcher(k):
            r = random.Random(SEED * 2000 + k)
            while time.monotonic() < end:
                shot = [r.randrange(1000, 30000) for _ in range(256)]
                prompts = [shot + [r.randrange(1000, 30000) for _ in range(768)]
                           for _ in range(BATCH)]
                s, _, e2e, wk = post(ng.port, {"prompt": prompts, "max_tokens": 64,
                                               "ignore_eos": True}, False)
                assert s == 200
                with lock:
                    batches.append((e2e, wk))

        th = [threading.Thread(target=interactive, args=(k,)) for k in range(CLIENTS)]
        th += [threading.Thread(target=batcher, args=(k,)) for k in range(BATCHERS)]
        for t in th:
            t.start()
        for t in th:
            t.join()
        ttft = [r[0] * 1000 for r in rows]
        per, bper = {}, {}
        for r in rows:
            per[r[2]] = per.get(r[2], 0) + 1
        for b in batches:
            bper[b[1]] = bper.get(b[1], 0) + 1
        out = {"build": kvt.BUILD, "seed": SEED, "clients": CLIENTS, "batchers": BATCHERS,
               "batch": BATCH, "interactive": len(rows), "batches": len(batches),
               "ttft_mean": round(sum(ttft) / len(ttft), 1), "ttft_p50": round(pct(ttft, .5), 1),
               "ttft_p90": round(pct(ttft, .9), 1), "ttft_p99": round(pct(ttft, .99), 1),
               "batch_s_mean": round(sum(b[0] for b in batches) / max(1, len(batches)), 2),
               "interactive_per_engine": sorted(per.values()),
               "batches_per_engine": sorted(bper.values())}
        print(json.dumps(out))
        assert ng.alerts() == []
    finally:
        st.close()


main()
