#!/usr/bin/env python3
"""Plots of a bench-e2e run: TTFT CDF per policy and hit rate per policy.

usage: plot-bench-e2e.py DIR     (DIR holds summary.json and <policy>.jsonl)
writes DIR/ttft_cdf.png and DIR/hit_rate.png; for a suite (summary.json with "runs",
from bench-e2e --suite) DIR/suite.png: per workload and policy, mean TTFT (run 1)
and hit rate as a share of the load-bounded oracle.
"""
import json
import os
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def policies(summary):
    return [p for p, v in summary.items() if isinstance(v, dict) and "hit_rate" in v]


def ttft_cdf(d, summary, names):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in names:
        path = os.path.join(d, p + ".jsonl")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            v = sorted(r["ttft_ms"] for r in map(json.loads, f) if r.get("ttft_ms") is not None)
        if not v:
            continue
        ax.plot(v, [(i + 1) / len(v) for i in range(len(v))],
                label="%s (mean %.0f ms)" % (p, summary[p]["ttft_mean_ms"]))
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms, log scale)")
    ax.set_ylabel("share of requests")
    s = summary.get("settings", {})
    ax.set_title("TTFT CDF: %s requests, %s engines, speedup %s" %
                 (s.get("requests"), s.get("engines"), s.get("speedup")))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(d, "ttft_cdf.png"), dpi=110)


def hit_rate(d, summary, names):
    fig, ax = plt.subplots(figsize=(7, 4))
    vals = [summary[p]["hit_rate"] or 0 for p in names]
    ax.bar(names, vals, color="tab:blue")
    oracle = summary.get("oracle_hit_rate")
    ideal = summary.get("ideal_hit_rate", summary.get("ideal_reuse"))
    if oracle is not None:
        ax.axhline(oracle, color="tab:green", linestyle=":",
                   label="load-bounded oracle %.2f" % oracle)
    if ideal is not None:
        ax.axhline(ideal, color="tab:red", linestyle="--",
                   label="ideal (one infinite cache) %.2f" % ideal)
    if oracle is not None or ideal is not None:
        ax.legend(loc="upper right", fontsize=8)
    for i, v in enumerate(vals):
        ax.text(i, v + 0.01, "%.2f" % v, ha="center", fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel("prefix hit rate (cached / prompt tokens)")
    ax.set_title("Prefix hit rate per policy")
    fig.tight_layout()
    fig.savefig(os.path.join(d, "hit_rate.png"), dpi=110)


def suite(d, s):
    run = s["runs"][0]
    work = list(run)
    pols = s["policies"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    w = 0.8 / max(1, len(pols))
    for k, p in enumerate(pols):
        xs = [i + k * w for i in range(len(work))]
        a1.bar(xs, [run[x].get(p, {}).get("ttft_mean_ms") or 0 for x in work], w, label=p)
        a2.bar(xs, [run[x].get(p, {}).get("share_of_oracle") or 0 for x in work], w, label=p)
    for ax in (a1, a2):
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(work))])
        ax.set_xticklabels(work, fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    a1.set_yscale("log")
    a1.set_ylabel("mean TTFT (ms, log scale)")
    a2.set_ylabel("hit rate / load-bounded oracle's")
    a2.axhline(0.9, color="tab:red", linestyle="--", linewidth=0.8)
    a1.legend(fontsize=8)
    fig.suptitle("Workload suite, run 1 of %d" % len(s["runs"]))
    fig.tight_layout()
    fig.savefig(os.path.join(d, "suite.png"), dpi=110)
    print("plot: %s" % os.path.join(d, "suite.png"))


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    d = sys.argv[1]
    with open(os.path.join(d, "summary.json")) as f:
        summary = json.load(f)
    if "runs" in summary:
        return suite(d, summary)
    names = policies(summary)
    if not names:
        print("plot-bench-e2e: no policy ran; nothing to plot")
        return
    ttft_cdf(d, summary, names)
    hit_rate(d, summary, names)
    print("plots: %s, %s" % (os.path.join(d, "ttft_cdf.png"), os.path.join(d, "hit_rate.png")))


if __name__ == "__main__":
    main()
