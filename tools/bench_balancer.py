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

UPSTREAM_NGINX = """
    access_log off;
    server {
        listen 127.0.0.1:%(p)d;
        location / { default_type application/json;
                     return 200 '{"id":"c","object":"text_completion","choices":[{"index":0,"text":"x","finish_reason":"length"}],"usage":{"prompt_tokens":64,"completion_tokens":1,"total_tokens":65}}'; }
    }
"""

FRONT = """
    kvroute_zone kv 64m;
    upstream kv { zone kv_up 256k; kvroute zone=kv; %(servers)s keepalive 64; }
    upstream lc { zone lc_up 256k; least_conn; %(servers)s keepalive 64; }
    log_format dec '$kvroute_decision_us $kvroute_prompt_tokens "$kvroute_fallback"';
    server {
        listen 127.0.0.1:%%(port)s;
        client_body_buffer_size 1m;
        location /kv/ { access_log off; proxy_pass http://kv/; proxy_http_version 1.1;
                        proxy_set_header Connection ""; }
        location /kvlog/ { access_log %(dir)s/kv.log dec; proxy_pass http://kv/;
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


def main():
    st = kvt.Stack("bench-balancer")
    try:
        ports = [kvt.free_port() for _ in range(4)]
        up = st.nginx("".join(UPSTREAM_NGINX % {"p": p} for p in ports).replace(
            "listen 127.0.0.1:%d;" % ports[0], "listen 127.0.0.1:%d;" % ports[0]), workers=1,
            port=ports[0])
        servers = " ".join("server 127.0.0.1:%d;" % p for p in ports)
        front = st.nginx(FRONT % {"servers": servers, "dir": st.dir}, workers=1)
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
    finally:
        st.close()


if __name__ == "__main__":
    main()
