#!/usr/bin/env python3
"""The learned memory's runs side by side: python3 sum.py DIR... (each a
bench-e2e --suite output). Per workload and policy (approximate mode learned,
approximate mode fixed at 120 s, events mode): mean and p90 TTFT, ITL, E2E,
hit rate and its share of the oracle, and from the status page the memory
the zone ended with (index.ttl_ms), the samples it learned from and the
blocks it expired; then learned over fixed and learned over events.

Names: in the runs before 17:20 UTC `kvroute-approx` was the learned memory
and `kvroute-approx-fixed` the fixed one; from then on (conv2a, conv2b)
`kvroute-approx-learn` is the learned one and `kvroute-approx` the fixed
one (the default). Each run is read by the names it has."""
import glob
import json
import os
import sys

for d in sys.argv[1:]:
    x = json.load(open(os.path.join(d, "summary.json")))
    for ri, run in enumerate(x["runs"]):
        for wl, r in run.items():
            pool = r["settings"].get("num_blocks")
            P = (("kvroute-approx-learn", "kvroute-approx", "kvroute")
                 if "kvroute-approx-learn" in r else
                 ("kvroute-approx", "kvroute-approx-fixed", "kvroute"))
            for p in P:
                if p not in r:
                    continue
                v = r[p]
                st = glob.glob("%s/run%d/%s/%s.status.json" % (d, ri + 1, wl, p))
                z = json.load(open(st[0]))["zones"]["kv"] if st else {"index": {}}
                print("%-8s %-13s %6s %-21s ttft %7.1f p90 %7.1f itl %5.1f e2e %7.0f hit %.3f "
                      "of oracle %.2f ttl_ms %6s samples %5s expired %7s"
                      % (os.path.basename(d.rstrip("/")), wl, pool, p, v["ttft_mean_ms"],
                         v["ttft_p90_ms"], v["itl_mean_ms"], v["e2e_mean_ms"], v["hit_rate"],
                         v.get("share_of_oracle") or 0, z["index"].get("ttl_ms"),
                         z.get("ttl_samples"), z["index"].get("expired")))
            if P[0] in r and P[1] in r:
                a, b = r[P[0]], r[P[1]]
                print("%-8s %-13s %6s learned / fixed: ttft %.3f p90 %.3f itl %.3f e2e %.3f "
                      "hit %+.3f" % (os.path.basename(d.rstrip("/")), wl, pool,
                                     a["ttft_mean_ms"] / b["ttft_mean_ms"],
                                     a["ttft_p90_ms"] / b["ttft_p90_ms"],
                                     a["itl_mean_ms"] / b["itl_mean_ms"],
                                     a["e2e_mean_ms"] / b["e2e_mean_ms"],
                                     a["hit_rate"] - b["hit_rate"]))
            if P[0] in r and P[2] in r:
                print("%-8s %-13s %6s learned / events: ttft %.3f" % (
                    os.path.basename(d.rstrip("/")), wl, pool,
                    r[P[0]]["ttft_mean_ms"] / r[P[2]]["ttft_mean_ms"]))
