"""Per-tenant figures of a mixed run: split.py OUT (bench-e2e's output directory);
requests with 256-token prompts are the short tenant, the rest the agent loops."""
import json
import os
import sys

for p in ["kvroute", "kvroute-approx", "least_conn", "round_robin"]:
    recs = [json.loads(l) for l in open(os.path.join(sys.argv[1], p + ".jsonl"))]
    for name, short in (("short", True), ("agent", False)):
        x = [r for r in recs if (r["input_length"] == 256) == short and r["status"] == 200]
        t = sorted(r["ttft_ms"] for r in x)
        itl = [r["itl_ms"] for r in x if r.get("itl_ms")]
        print("%-15s %-6s %4d  TTFT %4.0f ms  p90 %5.0f ms  ITL %5.1f ms  E2E %5.0f ms"
              % (p, name, len(x), sum(t) / len(t), t[int(0.9 * len(t))], sum(itl) / len(itl),
                 sum(r["e2e_ms"] for r in x) / len(x)))
