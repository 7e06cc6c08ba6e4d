#!/usr/bin/env python3
"""Stop 58's runs side by side: python3 sum.py DIR... (bench-e2e --suite
outputs of run.sh). Per workload: each policy's mean and p90 TTFT, ITL, hit
rate, share of the oracle and the memory its zone ended with (index.ttl_ms);
then the same-run ratios of mean TTFT: w/m (credits weighed by the kept
share, against main's learner), w/fixed and m/fixed, and at the end their
means over the runs given. In run-w90.sh's runs (v-*) "w" is w90
(kvroute-approx-learn@v)."""
import glob
import json
import os
import sys

F, M = "kvroute-approx@m", "kvroute-approx-learn@m"
ratios = {}
for d in sys.argv[1:]:
    x = json.load(open(os.path.join(d, "summary.json")))
    name = os.path.basename(d.rstrip("/"))
    for ri, run in enumerate(x["runs"]):
        for wl, r in run.items():
            W = "kvroute-approx-learn@v" if "kvroute-approx-learn@v" in r else "kvroute-approx-learn@w"
            for p in (F, M, W):
                if p not in r:
                    continue
                v = r[p]
                st = glob.glob("%s/run%d/%s/%s.status.json" % (d, ri + 1, wl, p))
                z = json.load(open(st[0]))["zones"]["kv"] if st else {"index": {}}
                print("%-6s %-13s %-23s ttft %7.1f p90 %7.1f itl %5.1f hit %.3f of oracle %.2f "
                      "ttl_ms %6s samples %5s" % (name, wl, p, v["ttft_mean_ms"], v["ttft_p90_ms"],
                                                  v["itl_mean_ms"], v["hit_rate"],
                                                  v.get("share_of_oracle") or 0,
                                                  z["index"].get("ttl_ms"), z.get("ttl_samples")))
            for a, b, tag in ((W, M, "w/m"), (W, F, "w/fixed"), (M, F, "m/fixed")):
                if a in r and b in r:
                    q = r[a]["ttft_mean_ms"] / r[b]["ttft_mean_ms"]
                    ratios.setdefault((wl, tag), []).append(q)
                    print("%-6s %-13s %-8s ttft %.3f p90 %.3f hit %+.3f" % (
                        name, wl, tag, q, r[a]["ttft_p90_ms"] / r[b]["ttft_p90_ms"],
                        r[a]["hit_rate"] - r[b]["hit_rate"]))
print()
for (wl, tag), qs in sorted(ratios.items()):
    print("%-13s %-8s mean %.3f over %d: %s" % (wl, tag, sum(qs) / len(qs), len(qs),
                                                " ".join("%.3f" % q for q in qs)))
