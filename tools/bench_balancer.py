"""kvroute vs least_conn throughput on trivial upstreams, and decision time.

One nginx (1 worker process) fronts 4 trivial upstream servers (another
nginx answering a fixed completion) through three locations: kvroute
(approximate mode), least_conn and kvroute again with long prompts. wrk
drives each in turn, alternating A/B runs, and we report the medians and
their ratio. Decision times come from $kvroute_decision_us in the access log.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "t", "lib"))
import kvt  # noqa: E402

SECONDS = int(os.environ.get("BENCH_SECONDS", "8"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
CONNS = int(os.environ.get("BENCH_CONNS", "32"))

REPLY = ('{"id":"c","object":"text_completion","choices":[{"index":0,"text":"x",'
         '"finish_reason":"length"}],"usage":{"prompt_tokens":64,"completion_tokens":1,'
         '"total_tokens":65}}')

FRONT = """
    kvroute_zone kv 64m;
    kvroute_zone kvt 64m;
    kvroute_zone kvn 64m;
    upstream kv { zone kv_up 256k; kvroute zone=kv; %(servers)s keepalive 64; }
    upstream kvt { zone kvt_up 256k; kvroute zone=kvt tokenizer=%(tok)s; %(servers)s keepalive 64; }
    upstream kvn { zone kvn_up 256k; kvroute zone=kvn tokenizer=%(tok)s thread_threshold=0;
                   %(servers)s keepalive 64; }
    upstream lc { zone lc_up 256k; least_conn; %(servers)s keepalive 64; }
    log_format dec '$kvroute_decision_us $kvroute_prompt_tokens "$kvroute_fallback"';
    server {
        listen 127.0.0.1:%%(port)s;
        client_body_buffer_size 1m;
        location /kv/ { access_log off; kvroute_upstream kv; proxy_pass http://kv/; proxy_http_version 1.1;
                        proxy_set_header Connection ""; }
        location /kvlog/ { access_log %(dir)s/kv.log dec; kvroute_upstream kv; proxy_pass http://kv/;
                        proxy_http_version 1.1; proxy_set_header Connection ""; }
        location /kvt/ { access_log %(dir)s/kvt.log dec; kvroute_upstream kvt; proxy_pass http://kvt/;
                        proxy_http_version 1.1; proxy_set_header Connection ""; }
        location /kvn/ { access_log off; kvroute_upstream kvn; proxy_pass http://kvn/;
                        proxy_http_version 1.1; proxy_set_header Connection ""; }
        location /lc/ { access_log off; proxy_pass http://lc/; proxy_http_version 1.1;
                        proxy_set_header Connection ""; }
    }
"""

LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local n = %d
local bodies = {}
for k = 1, 64 do
  local ids = {}
  for i = 1, n do ids[i] = tostring((k * 7919 + i * 31) %% 30000 + 100) end
  bodies[k] = '{"model":"m","max_tokens":1,"prompt":[' .. table.concat(ids, ",") .. ']}'
end
local c = 0
request = function()
  c = c + 1
  return wrk.format(nil, nil, nil, bodies[(c %% 64) + 1])
end
"""


def wrk(port, path, script):
    out = subprocess.run(["wrk", "-t1", "-c%d" % CONNS, "-d%ds" % SECONDS, "-s", script,
                          "http://127.0.0.1:%d%s" % (port, path)],
                         capture_output=True, text=True, check=True).stdout
    rps = float([l for l in out.splitlines() if l.startswith("Requests/sec")][0].split()[1])
    errs = [l for l in out.splitlines() if "Non-2xx" in l or "Socket errors" in l]
    return rps, errs


def percentiles(xs):
    xs = sorted(xs)
    q = lambda p: xs[min(len(xs) - 1, int(p * len(xs)))]
    return {"p50_us": q(0.5), "p99_us": q(0.99), "n": len(xs)}


def text_decisions(st, front):
    """8k-token English text prompts: decision time includes tokenization."""
    prose = open(os.path.join(kvt.TOP, "t", "data", "prose_en.txt"), encoding="utf-8").read()
    script = os.path.join(st.dir, "text.lua")
    # 64 different ~8k-token slices of real text (~4.3 bytes per token)
    bodies = [json.dumps({"model": "m", "max_tokens": 1,
                          "prompt": prose[i * 20000:i * 20000 + 34000]}) for i in range(64)]
    with open(script, "w") as f:
        f.write('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                "local bodies = {\n" + ",\n".join("[==[%s]==]" % b for b in bodies) + "}\n"
                "local c = 0\nrequest = function() c = c + 1\n"
                "return wrk.format(nil, nil, nil, bodies[(c % 64) + 1]) end\n")
    global CONNS
    save, CONNS = CONNS, 4
    rps, errs = wrk(front.port, "/kvt/v1/completions", script)
    CONNS = save
    import time
    time.sleep(0.5)
    rows = [l.split() for l in open(os.path.join(st.dir, "kvt.log"))]
    us = [int(r[0]) for r in rows]
    toks = sorted(int(r[1]) for r in rows)
    print(json.dumps(dict({"figure": "decision_time", "prompt": "~8k-token English text (Qwen2.5)",
                           "prompt_tokens_p50": toks[len(toks) // 2], "rps": rps},
                          **percentiles(us))))


def stall(st, front):
    """Small requests' latency while 600 KB text prompts are being tokenized,
    with the thread pool (kvt) and on the event loop (kvn)."""
    import threading
    import time
    big = json.dumps({"model": "m", "max_tokens": 1,
                      "prompt": open(os.path.join(kvt.TOP, "t", "data", "prose_en.txt"),
                                     encoding="utf-8").read()[:600000]})
    out = {}
    for loc in ("kvt", "kvn"):
        stop = time.time() + 4
        def hammer():
            while time.time() < stop:
                kvt.request(front.port, "POST", "/%s/v1/completions" % loc, big, timeout=60)
        ths = [threading.Thread(target=hammer) for _ in range(2)]
        for t in ths:
            t.start()
        time.sleep(0.3)
        lat = []
        while time.time() < stop - 0.2:
            t0 = time.time()
            kvt.request(front.port, "POST", "/%s/v1/completions" % loc,
                        {"model": "m", "max_tokens": 1, "prompt": [1, 2, 3]})
            lat.append((time.time() - t0) * 1000)
        for t in ths:
            t.join()
        lat.sort()
        out[loc] = {"small_p50_ms": round(lat[len(lat) // 2], 2),
                    "small_p99_ms": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 2),
                    "small_max_ms": round(lat[-1], 2), "n": len(lat)}
    print(json.dumps({"figure": "event_loop_stall", "big_prompt_bytes": len(big),
                      "thread_pool": out["kvt"], "event_loop": out["kvn"]}))


def main():
    st = kvt.Stack("bench-balancer")
    try:
        ports = [kvt.free_port() for _ in range(4)]
        up = st.nginx(kvt.canned_servers(ports, REPLY), workers=1, port=ports[0])
        servers = " ".join("server 127.0.0.1:%d;" % p for p in ports)
        tok = os.path.join(kvt.TOP, "conf", "tokenizers", "qwen2.5-instruct", "tokenizer.json")
        front = st.nginx(FRONT % {"servers": servers, "dir": st.dir, "tok": tok}, workers=1)
        small = os.path.join(st.dir, "small.lua")
        with open(small, "w") as f:
            f.write(LUA % 64)
        res = {"kvroute": [], "least_conn": []}
        wrk(front.port, "/kv/v1/completions", small)         # warm up
        for _ in range(ROUNDS):
            res["kvroute"].append(wrk(front.port, "/kv/v1/completions", small)[0])
            res["least_conn"].append(wrk(front.port, "/lc/v1/completions", small)[0])
        kv, lc = statistics.median(res["kvroute"]), statistics.median(res["least_conn"])
        print(json.dumps({"figure": "throughput_vs_least_conn", "prompt": "64 token ids",
                          "conns": CONNS, "seconds": SECONDS, "rounds": ROUNDS,
                          "kvroute_rps": res["kvroute"], "least_conn_rps": res["least_conn"],
                          "ratio_median": round(kv / lc, 3)}))
        # decision time for 1k-token id prompts
        big = os.path.join(st.dir, "big.lua")
        with open(big, "w") as f:
            f.write(LUA % 1024)
        rps, errs = wrk(front.port, "/kvlog/v1/completions", big)
        import time
        time.sleep(0.5)
        us = [int(l.split()[0]) for l in open(os.path.join(st.dir, "kv.log"))
              if l.split()[1] == "1024"]
        print(json.dumps(dict({"figure": "decision_time", "prompt": "1024 token ids",
                               "rps": rps}, **percentiles(us))))
        text_decisions(st, front)
        stall(st, front)
    finally:
        st.close()


if __name__ == "__main__":
    main()
