"""(throwaway, 2026-11-28) Time /kvroute/status with 4,096 servers (bench_scale's decision stack), after
routing 300 requests so that 64 servers are indexed; KVROUTE_BUILD picks the build."""
import os, sys, time, random, json, urllib.request
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools"))
sys.path.insert(0, "/work/main/tools")
import bench_scale as b
kvt = b.kvt
st = kvt.Stack("status-time")
try:
    w = st.worker(port=b.port_run(4096), engines=4096, wait=False, extra=["--speedup", "200", "--num-blocks", "256"])
    for p in (w.ports[0], w.ports[-1]):
        kvt.wait_port(p, proc=w, what="kvworker")
    n = 4096
    zones = "kvroute_zone kv%d %dm max_workers=4096;" % (n, 8 + n // 128)
    ups = "upstream u%d { zone u%d 4m; kvroute zone=kv%d; %s keepalive 16; }" % (n, n, n, " ".join("server 127.0.0.1:%d;" % p for p in w.ports[:n]))
    locs = "location /u%d/ { kvroute_upstream u%d; proxy_pass http://u%d/; proxy_http_version 1.1; proxy_set_header Connection \"\"; }" % (n, n, n)
    ng = st.nginx(b.DECISION_CONF % {"zones": zones, "upstreams": ups, "locations": locs}, workers=1)
    rnd = random.Random(7)
    prefixes = [[rnd.randrange(100, 30000) for _ in range(768)] for _ in range(64)]
    for i in range(300):
        ids = prefixes[rnd.randrange(64)] + [rnd.randrange(100, 30000) for _ in range(256)]
        s, body = b.call(ng.port, "POST", "/u%d/v1/completions" % n, {"model": "kvroute-mock", "prompt": ids, "max_tokens": 1})
    open("/tmp/s39/ngpid", "w").write(os.popen("pgrep -P $(pgrep -f \"nginx: master.*status-time\" | head -1) | head -1").read()); time.sleep(1.5)
    ts = []
    for i in range(int(os.environ.get("N", "10"))):
        t = time.perf_counter()
        with urllib.request.urlopen("http://127.0.0.1:%d/kvroute/status" % ng.port) as r:
            r.read()
        ts.append((time.perf_counter() - t) * 1e3)
    ts.sort()
    print("status at 4,096 servers: ms min %.1f median %.1f max %.1f" % (ts[0], ts[len(ts)//2], ts[-1]))
finally:
    st.close()
