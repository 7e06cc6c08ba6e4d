"""Per-tenant means of a mixed run: TTFT, ITL, E2E by tenant (from the trace's hash-id range)."""
import json, sys, os
d = sys.argv[1]
trace = [json.loads(l) for l in open(sys.argv[2])]
ten = [r["hash_ids"][0] // 10 ** 14 for r in trace]
names = {1: "chat", 2: "docs", 3: "short"}
pols = [p for p in ("kvroute", "kvroute-approx", "least_conn", "round_robin")
        if os.path.exists(os.path.join(d, p + ".jsonl"))]
res = {}
for p in pols:
    recs = [json.loads(l) for l in open(os.path.join(d, p + ".jsonl"))]
    for t in (1, 2, 3):
        x = [r for r in recs if ten[r["index"]] == t and r["status"] == 200]
        res[p, t] = tuple(sum(r[k] for r in x) / len(x) for k in ("ttft_ms", "itl_ms", "e2e_ms")) + (len(x), sum(r["cached_tokens"] for r in x) / sum(r["prompt_tokens"] for r in x))
print("%-15s %-6s %9s %8s %9s %5s %6s   x least_conn (TTFT ITL E2E)" % ("policy", "tenant", "TTFT", "ITL", "E2E", "n", "hit"))
for t in (1, 2, 3):
    for p in pols:
        a, b = res[p, t], res.get(("least_conn", t))
        print("%-15s %-6s %7.0f ms %5.1f ms %7.0f ms %5d %6.3f   %.2f %.2f %.2f" % (p, names[t], a[0], a[1], a[2], a[3], a[4], a[0] / b[0], a[1] / b[1], a[2] / b[2]))
