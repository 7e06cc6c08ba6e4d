"""Decision time for 1,024-token-id prompts, and optionally a perf profile.

One nginx (1 worker process, pinned to CPU 0) fronts 4 trivial upstream
servers (another nginx, pinned to CPU 1) through a kvroute upstream in
approximate mode (tools/bench_balancer.py's configuration); wrk, pinned to
CPU 1, sends 1,024-id completions on 4 connections for SECS seconds. Prints
p50/p90/p99 of $kvroute_decision_us (body in hand -> choice: parse, hash,
match, score). PERF=FILE records the nginx worker with perf meanwhile.
The module comes from KVROUTE_BUILD (default build/), so two builds can be
compared in alternation:  .venv/bin/python tools/bench_decision_ids.py
ROUNDS=N first runs N alternating rounds of kvroute vs least_conn throughput
(64-id prompts, wrk -c32 on CPU 1, the nginx worker alone on CPU 0).
"""
import json
import os
import subprocess
import sys
import time

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(TOOLS, "..", "t", "lib"))
sys.path.insert(0, TOOLS)
import kvt  # noqa: E402
import bench_balancer as bb  # noqa: E402

SECS = int(os.environ.get("SECS", "5"))
PERF = os.environ.get("PERF")
ROUNDS = int(os.environ.get("ROUNDS", "0"))   # > 0: also kvroute vs least_conn, alternating


def pin(pid, cpu):
    subprocess.run(["taskset", "-pc", str(cpu), str(pid)], capture_output=True)


def main():
    st = kvt.Stack("bench-decision")
    try:
        ports = [kvt.free_port() for _ in range(4)]
        up = st.nginx(kvt.canned_servers(ports, bb.REPLY), workers=1, port=ports[0])
        servers = " ".join("server 127.0.0.1:%d;" % p for p in ports)
        tok = os.path.join(kvt.TOP, "conf", "tokenizers", "qwen2.5-instruct", "tokenizer.json")
        front = st.nginx(bb.FRONT % {"servers": servers, "dir": st.dir, "tok": tok}, workers=1)
        kvt.wait_until(lambda: len(front.children()) >= 1, timeout=30, what="nginx worker")
        worker = sorted(front.children())[0]
        pin(worker, 0)
        for p in up.children():
            pin(p, 1)
        script = os.path.join(st.dir, "big.lua")
        with open(script, "w") as f:
            f.write(bb.LUA % 1024)
        if ROUNDS:
            small = os.path.join(st.dir, "small.lua")
            with open(small, "w") as f:
                f.write(bb.LUA % 64)
            rps = {"kv": [], "lc": []}
            for _ in range(ROUNDS):
                for loc in ("kv", "lc"):
                    o = subprocess.run(["taskset", "-c", "1", "wrk", "-t1", "-c32",
                                        "-d%ds" % SECS, "-s", small,
                                        "http://127.0.0.1:%d/%s/v1/completions" % (front.port, loc)],
                                       capture_output=True, text=True, check=True).stdout
                    rps[loc].append(float([l for l in o.splitlines()
                                           if l.startswith("Requests/sec")][0].split()[1]))
            ratios = sorted(k / l for k, l in zip(rps["kv"], rps["lc"]))
            print(json.dumps({"figure": "throughput_vs_least_conn", "prompt": "64 token ids",
                              "kvroute_rps": rps["kv"], "least_conn_rps": rps["lc"],
                              "ratio_median": round(ratios[len(ratios) // 2], 3),
                              "load": round(os.getloadavg()[0], 2)}))
        url = "http://127.0.0.1:%d/kvlog/v1/completions" % front.port
        log = os.path.join(st.dir, "kv.log")
        wrk = ["taskset", "-c", "1", "wrk", "-t1", "-c4", "-s", script, url]
        subprocess.run(wrk[:5] + ["-d1s"] + wrk[5:], capture_output=True, check=True)  # warm up
        kvt.wait_until(lambda: os.path.exists(log) and os.path.getsize(log) > 0, timeout=30,
                       what="access log")
        start = os.path.getsize(log)
        perf = None
        if PERF:
            perf = subprocess.Popen(["perf", "record", "-q", "-g", "-o", PERF, "-p", str(worker),
                                     "--", "sleep", str(SECS)])
        out = subprocess.run(wrk[:5] + ["-d%ds" % SECS] + wrk[5:], capture_output=True,
                             text=True, check=True).stdout
        if perf:
            perf.wait()
        with open(log) as f:
            f.seek(start)
            us = sorted(int(l.split()[0]) for l in f if l.split()[1:2] == ["1024"])
        rps = [l.split()[1] for l in out.splitlines() if l.startswith("Requests/sec")]
        q = lambda p: us[min(len(us) - 1, int(p * len(us)))]
        print(json.dumps({"figure": "decision_time", "prompt": "1024 token ids",
                          "build": kvt.BUILD, "n": len(us), "p50_us": q(0.5), "p90_us": q(0.9),
                          "p99_us": q(0.99), "rps": float(rps[0]) if rps else None,
                          "load": round(os.getloadavg()[0], 2)}))
    finally:
        st.close()


if __name__ == "__main__":
    main()
