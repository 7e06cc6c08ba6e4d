#!/usr/bin/env python3
"""The learned lines' spread across servers, per policy run (routing round 15).

usage: T=TOKENS lines_spread.py POLLS.jsonl...

For each poll once 100 requests are in: the coefficient of variation of the
servers' prefill_rate, and of their predicted time base + T / rate (T: 2048
hotprefix, 12000 conversation and mooncake, 512 short); printed as the mean
over a run's polls, with the mean and widest max/min of the rates.
"""
import collections
import json
import os
import statistics as st
import sys


def cv(x):
    return st.pstdev(x) / st.mean(x)


def main():
    t = float(os.environ.get("T", "2048"))
    for f in sys.argv[1:]:
        runs = collections.defaultdict(list)
        for line in open(f):
            d = json.loads(line)
            if sum(d["n"]) < 100:
                continue
            pred = [b + t / r for b, r in zip(d["b"], d["r"]) if r > 0]
            runs[d["p"]].append((cv(d["r"]), max(d["r"]) / min(d["r"]), cv(pred)))
        for p, v in runs.items():
            print("%-12s %-14s polls %3d  rate cv %.3f  max/min mean %.2f widest %.2f  "
                  "predicted cv at %d tokens %.3f" % (
                      os.path.basename(f), p, len(v), st.mean(x[0] for x in v),
                      st.mean(x[1] for x in v), max(x[1] for x in v), t,
                      st.mean(x[2] for x in v)))


if __name__ == "__main__":
    main()
