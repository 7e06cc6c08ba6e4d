#!/usr/bin/env python3
"""run.sh's runs: python3 sum.py WORKLOAD DIR... Per run the
mean TTFT of the fixed memory, main's learner (m) and the weighed credits (w),
then the mean and standard error of the same-run ratios."""
import json
import math
import os
import sys

F, M, W = "kvroute-approx@m", "kvroute-approx-learn@m", "kvroute-approx-learn@w"
q = {"m/fixed": [], "w/fixed": [], "w/m": []}
wl = sys.argv[1]
for d in sorted(sys.argv[2:], key=lambda s: int("".join(c for c in os.path.basename(s.rstrip("/")) if c.isdigit()))):
    if not os.path.exists(os.path.join(d, "summary.json")):
        continue                # a run still going
    r = json.load(open(os.path.join(d, "summary.json")))["runs"][0][wl]
    f, m, w = (r[p]["ttft_mean_ms"] for p in (F, M, W))
    q["m/fixed"].append(m / f)
    q["w/fixed"].append(w / f)
    q["w/m"].append(w / m)
    print("%-8s fixed %6.0f m %6.0f w %6.0f  m/fixed %.3f w/fixed %.3f w/m %.3f  hit %.3f %.3f %.3f"
          % (os.path.basename(d.rstrip("/")), f, m, w, m / f, w / f, w / m,
             r[F]["hit_rate"], r[M]["hit_rate"], r[W]["hit_rate"]))
for k, v in q.items():
    n = len(v)
    mean = sum(v) / n
    se = math.sqrt(sum((x - mean) ** 2 for x in v) / (n - 1) / n) if n > 1 else float("nan")
    print("%-8s mean %.3f s.e. %.3f over %d runs: mean + 2 s.e. %.3f, %s" % (
        k, mean, se, n, mean + 2 * se,
        "distinguishable from 1" if abs(mean - 1) > 2 * se else "not distinguishable from 1"))
