#!/usr/bin/env python3
"""Per workload: each kvroute slot's mean TTFT, p90, ITL, E2E, hit, share of the
oracle, busy spread, and its TTFT over the main slot's in the same mode."""
import json
import sys

s = json.load(open(sys.argv[1]))
for run in s["runs"]:
    for w, r in run.items():
        pol = {k: v for k, v in r.items() if isinstance(v, dict) and "ttft_mean_ms" in v}
        for p in sorted(pol):
            v = {k: (x if x is not None else float("nan")) for k, x in pol[p].items()}
            base = pol.get(p.split("@")[0], v)
            print("%-10s %-20s ttft %7.1f p90 %7.1f itl %5.2f e2e %7.1f hit %.4f oracle %.3f busy %.3f ttft/main %.3f"
                  % (w, p, v["ttft_mean_ms"], v.get("ttft_p90_ms", 0), v.get("itl_mean_ms", 0),
                     v.get("e2e_mean_ms", 0), v.get("hit_rate", 0), v.get("share_of_oracle", 0),
                     v.get("load_spread", 0), v["ttft_mean_ms"] / base["ttft_mean_ms"]))
