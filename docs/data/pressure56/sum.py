#!/usr/bin/env python3
"""The caches-under-pressure runs side by side: python3 sum.py DIR... (each a
bench-e2e --suite output with summary.json). Per run and workload: the pool,
kvroute's (events) mean TTFT and least_conn's and round_robin's over it,
approximate mode's over events mode's, the hit rates as shares of the oracle
and of the free oracle, and KV active; then kvroute's ITL, E2E, output rate
and p90 TTFT over least_conn's."""
import json
import os
import sys

for d in sys.argv[1:]:
    s = json.load(open(os.path.join(d, "summary.json")))
    for k, run in enumerate(s["runs"]):
        for w, r in run.items():
            kv, ap, lc, rr = (r.get(p, {}) for p in
                              ("kvroute", "kvroute-approx", "least_conn", "round_robin"))
            t = lambda x: x.get("ttft_mean_ms")          # noqa: E731
            pc = lambda v: "  -" if v is None else "%3.0f" % (100 * v)  # noqa: E731
            print("%-8s run%d %-12s pool %5d  kvroute %5.0f ms  lc/kv %.2f  rr/kv %.2f  "
                  "approx/events %.3f  hit ev %.3f ap %.3f  of oracle ev %3.0f%% ap %3.0f%%  "
                  "of free ev %s%% ap %s%%  KV active ev %s%% lc %s%%  spread %.2f"
                  % (os.path.basename(d.rstrip("/")), k + 1, w, r["settings"]["num_blocks"],
                     t(kv), t(lc) / t(kv), t(rr) / t(kv), t(ap) / t(kv), kv["hit_rate"],
                     ap["hit_rate"], 100 * kv["share_of_oracle"], 100 * ap["share_of_oracle"],
                     pc(kv.get("share_of_free_oracle")), pc(ap.get("share_of_free_oracle")),
                     pc(kv.get("kv_active")), pc(lc.get("kv_active")),
                     kv["load_spread"]))
            print("%-8s run%d %-12s kvroute / least_conn: ITL %.2f  E2E %.2f  output %.2f  "
                  "p90 TTFT %.2f" % (os.path.basename(d.rstrip("/")), k + 1, w,
                                     kv["itl_mean_ms"] / lc["itl_mean_ms"],
                                     kv["e2e_mean_ms"] / lc["e2e_mean_ms"],
                                     kv["throughput_tok_s"] / lc["throughput_tok_s"],
                                     kv["ttft_p90_ms"] / lc["ttft_p90_ms"]))
