#!/usr/bin/env python3
"""Plots of a bench-e2e run: TTFT CDF per policy and hit rate per policy.

usage: plot-bench-e2e.py DIR     (DIR holds summary.json and <policy>.jsonl)
writes DIR/ttft_cdf.png and DIR/hit_rate.png
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
    ideal = summary.get("ideal_reuse")
    if ideal is not None:
        ax.axhline(ideal, color="tab:red", linestyle="--", label="ideal reuse %.2f" % ideal)
        ax.legend(loc="upper right", fontsize=8)
    for i, v in enumerate(vals):
        ax.text(i, v + 0.01, "%.2f" % v, ha="center", fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel("prefix hit rate (cached / prompt tokens)")
    ax.set_title("Prefix hit rate per policy")
    fig.tight_layout()
    fig.savefig(os.path.join(d, "hit_rate.png"), dpi=110)


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    d = sys.argv[1]
    with open(os.path.join(d, "summary.json")) as f:
        summary = json.load(f)
    names = policies(summary)
    if not names:
        print("plot-bench-e2e: no policy ran; nothing to plot")
        return
    ttft_cdf(d, summary, names)
    hit_rate(d, summary, names)
    print("plots: %s, %s" % (os.path.join(d, "ttft_cdf.png"), os.path.join(d, "hit_rate.png")))


if __name__ == "__main__":
    main()
