"""LoRA adapters named by `model` alone, as OpenAI clients send them: the
engines' cached share of the prompts, through nginx in events mode.

4 kvworker mock engines serve a base model and 3 adapters
(--lora-modules sql,chat,code: each adapter's blocks kept apart and
tagged as vLLM's). 24 system prompts of 1,024 tokens (6 per model name),
each request one of them + 128 tokens of its own, REQUESTS requests, 8 at
a time, seeded. SHARED=1: the model names share the same 6 system prompts
(an application with an adapter per tenant): the engine still keeps each
adapter's blocks apart. KVROUTE_BUILD picks the module build (its kvworker must
know --lora-modules: copy this stop's over an old build), PARAMS the
kvroute parameters: "model=base lora=*" (this stop), "model=base" (the
adapters' requests route by load), "" (hashed as the base model).
Prints one JSON line."""
import concurrent.futures as cf
import json
import os
import random
import sys

TOP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..")
sys.path.insert(0, os.path.join(TOP, "t", "lib"))
import kvt  # noqa: E402

PARAMS = os.environ.get("PARAMS", "model=base lora=*")
REQUESTS = int(os.environ.get("REQUESTS", "480"))
SEED = int(os.environ.get("SEED", "1"))
SHARED = int(os.environ.get("SHARED", "0"))
MODELS = ["base", "sql", "chat", "code"]

CONF = """
    kvroute_zone kv 64m;
    kvroute_events %(nats)s zone=kv;
    upstream llm {
        zone llm 64k;
        kvroute zone=kv mode=events %(params)s;
        %(servers)s
        keepalive 16;
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
    }
"""


def main():
    rng = random.Random(SEED)
    # SHARED=1: every model name uses the same 6 system prompts (one
    # application, an adapter per tenant); else each has its own 6
    shared = {k: [rng.randrange(1000, 30000) for _ in range(1024)] for k in range(6)}
    systems = {(m, k): shared[k] if SHARED else [rng.randrange(1000, 30000) for _ in range(1024)]
               for m in MODELS for k in range(6)}
    reqs = []
    for i in range(REQUESTS):
        m, k = rng.choice(MODELS), rng.randrange(6)
        reqs.append((m, systems[(m, k)] + [rng.randrange(1000, 30000) for _ in range(128)], k))

    st = kvt.Stack("lora-ab")
    try:
        nats = st.nats()
        w = st.worker(engines=4, extra=["--model", "base", "--lora-modules", "sql,chat,code",
                                        "--nats", nats.url, "--heartbeat-ms", "200",
                                        "--speedup", "10"])
        servers = "\n".join("server 127.0.0.1:%d;" % p for p in w.ports)
        ng = st.nginx(CONF % {"nats": nats.url, "servers": servers, "params": PARAMS})

        def send(r):
            s, h, body, raw = kvt.post_json(ng.port, "/v1/completions",
                                            {"model": r[0], "prompt": r[1], "max_tokens": 16})
            assert s == 200, raw
            u = body["usage"]
            return (r[0], u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"],
                    int(h["x-kvroute-overlap"]), h["x-kvroute-worker"])

        with cf.ThreadPoolExecutor(8) as ex:
            rows = list(ex.map(send, reqs))
        out = {"build": kvt.BUILD, "params": PARAMS, "requests": len(rows), "seed": SEED,
               "shared": SHARED,
               "hit_rate": round(sum(r[2] for r in rows) / sum(r[1] for r in rows), 4)}
        for m in MODELS:
            mine = [r for r in rows if r[0] == m]
            out["hit_" + m] = round(sum(r[2] for r in mine) / sum(r[1] for r in mine), 4)
        # what the router claimed against what the engine had: a claim above
        # the engine's cached blocks is a wrong overlap
        out["overclaimed_requests"] = sum(1 for r in rows if 16 * r[3] > r[2] + 16)
        per = {}
        for r in rows:
            per[r[4]] = per.get(r[4], 0) + 1
        out["requests_per_engine"] = sorted(per.values())
        # the best any router can do: each system prompt used computed once
        used = len({(r[0], r[2]) for r in reqs})
        out["hit_bound"] = round(1 - (used * 1024 + len(rows) * 128)
                                 / sum(r[1] for r in rows), 4)
        print(json.dumps(out))
        assert ng.alerts() == []
    finally:
        st.close()


main()
