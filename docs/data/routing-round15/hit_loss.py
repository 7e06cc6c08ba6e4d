#!/usr/bin/env python3
"""Where a bench-e2e run's hit rate falls short of the trace's ideal (routing round 15).

usage: hit_loss.py RUN/POLICY.decisions.log TRACE.jsonl N [TRACE_BLOCK] [ENGINE_BLOCK]

Reads the decisions log (kvdecision format: $msec $request_time $kvroute_worker $kvroute_why
$kvroute_overlap_blocks $kvroute_prompt_blocks $kvroute_prompt_tokens ...), the run's request
records (POLICY.jsonl beside it) and the first N requests of the Mooncake-format trace. Each
record is matched to its decision by start time (within 200 ms) and prompt tokens (the
decision's count is the record's + 0..3); unmatched ones are left out and counted.

For every request, the ideal reuse is the longest prefix of its hash_ids that an earlier
request had (one infinite cache), and its holder the server the latest such request was sent
to. A request that got at least one engine block less than the ideal is "moved" if its holder
is another server, else "same server" (evicted, or held only in part). For moved requests:
was the holder beyond the bounded-load rule L (requests in flight > 1.25 x the mean + 1,
counted from the log's start and end times, as one router counts them), and how many uncached
prompt tokens were queued before their first byte on the holder and on the chosen server
(from the records' ttft_ms).
"""
import collections
import json
import os
import statistics as st
import sys


def load(log, trace, n):
    tr = [json.loads(l) for l in open(trace)][:n]
    rec = sorted((json.loads(l) for l in open(log[:-len(".decisions.log")] + ".jsonl")),
                 key=lambda r: r["start_ms"])
    dec = []
    for l in open(log):
        x = l.split()
        if x[3] == "-":
            continue
        dec.append({"start": float(x[0]) - float(x[1]), "end": float(x[0]), "server": x[2],
                    "why": x[3], "overlap": int(x[4]), "tokens": int(x[6]), "used": False})
    dec.sort(key=lambda d: d["start"])
    t0 = dec[0]["start"] * 1000 - rec[0]["start_ms"]
    match = {}
    for r in rec:
        best = None
        for d in dec:
            if d["used"] or not 0 <= d["tokens"] - r["prompt_tokens"] <= 3:
                continue
            dt = abs(d["start"] * 1000 - t0 - r["start_ms"])
            if best is None or dt < best[0]:
                best = (dt, d)
        if best and best[0] < 200:
            best[1]["used"] = True
            best[1]["ttft_s"] = r["ttft_ms"] / 1000
            match[r["index"]] = best[1]
    return tr, dec, match


def main():
    log, trace, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    tblock = int(sys.argv[4]) if len(sys.argv) > 4 else 512
    eblock = int(sys.argv[5]) if len(sys.argv) > 5 else 64
    tr, dec, match = load(log, trace, n)
    servers = sorted(set(d["server"] for d in dec))
    owner, total, got_sum, ideal_sum = {}, 0, 0, 0
    lost = collections.Counter()
    count = collections.Counter()
    moved = []
    for i, t in enumerate(tr):
        h, k = t["hash_ids"], 0
        while k < len(h) and tuple(h[:k + 1]) in owner:
            k += 1
        d = match.get(i)
        if d is None:
            continue
        ideal = min(k * tblock, t["input_length"])
        got = min(d["overlap"] * eblock, d["tokens"])
        total += t["input_length"]
        got_sum += got
        ideal_sum += ideal
        if got + eblock <= ideal:
            holder = owner[tuple(h[:k])]
            kind = "moved" if holder != d["server"] else "same server"
            lost[kind] += ideal - got
            count[kind] += 1
            if kind == "moved":
                moved.append((d, holder, ideal - got))
        for j in range(len(h)):
            owner[tuple(h[:j + 1])] = d["server"]

    def inflight(t):
        c = collections.Counter({s: 0 for s in servers})
        for d in dec:
            if d["start"] < t < d["end"]:
                c[d["server"]] += 1
        return c

    def queued(t, srv):
        return sum(d["tokens"] - min(d["overlap"] * eblock, d["tokens"]) for d in match.values()
                   if d["server"] == srv and d["start"] < t < d["start"] + d["ttft_s"])

    print("%s: matched %d of %d; hit %.4f, ideal %.4f" % (
        os.path.basename(log), len(match), len(tr), got_sum / total, ideal_sum / total))
    for kind in ("moved", "same server"):
        print("  %-11s requests %4d, tokens lost %.4f of all prompt tokens" % (
            kind, count[kind], lost[kind] / total))
    beyond, big = 0, []
    for d, holder, tokens in moved:
        c = inflight(d["start"] - 1e-6)
        beyond += c[holder] > 1.25 * sum(c.values()) / len(c) + 1
        if tokens >= 2048:
            big.append((queued(d["start"] - 1e-6, holder), queued(d["start"] - 1e-6, d["server"]),
                        tokens))
    print("  moved with the holder beyond L: %d, within L: %d" % (beyond, len(moved) - beyond))
    if big:
        q = sorted(b[0] for b in big)
        print("  moved, >= 2,048 tokens lost: %d; queued prefill tokens on the holder median %d "
              "(p25 %d, p75 %d), on the chosen server median %d; re-prefilled median %d" % (
                  len(big), st.median(q), q[len(q) // 4], q[3 * len(q) // 4],
                  st.median(b[1] for b in big), st.median(b[2] for b in big)))


if __name__ == "__main__":
    main()
