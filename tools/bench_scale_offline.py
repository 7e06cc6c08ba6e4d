#!/usr/bin/env python3
"""Offline placement of whole conversations (kept sticky) on E engines
(docs/BENCHMARKS.md "Scale-out round 6"): what busy-time spread each placement gives.
usage: tools/bench_scale_offline.py TRACE [E] [RUN.json.analysis.json]
With a run's analysis (tools/bench_scale_engines.py) each request's measured duration
stands in for the model's.
A request's service interval is modelled on the mock engine (speedup 0.5):
[t, t + (prefill(uncached) + 6 ms x output) / 0.5]; an engine's busy time is the
union of its requests' intervals (busy time is flat in the batch)."""
import json, sys, collections, random, statistics as st, heapq
from bench_scale import busy_union
from mock_model import prefill_ms as pre
E = int(sys.argv[2]) if len(sys.argv) > 2 else 64
trace = [json.loads(l) for l in open(sys.argv[1])]
convs = collections.OrderedDict()
for i, r in enumerate(trace):
    convs.setdefault((r["hash_ids"][0] >> 32, r["hash_ids"][64]), []).append(i)
iv = {}
for k, v in convs.items():
    for j, i in enumerate(v):
        r = trace[i]
        cached = 1024 if j == 0 else len(trace[v[j-1]]["hash_ids"]) * 16
        d = (pre(r["input_length"] - cached) + 6.0 * r["output_length"]) / 0.5 / 1000
        iv[i] = (r["timestamp"] / 1000, r["timestamp"] / 1000 + d)
if len(sys.argv) > 3:   # measured durations from a run's analysis (analyze.py)
    pl = json.load(open(sys.argv[3]))["place"]
    t0 = min(v[3] for v in pl.values())
    for i, v in pl.items():
        i = int(i); a0 = trace[i]["timestamp"] / 1000
        iv[i] = (a0, a0 + v[4])
work = {k: sum(iv[i][1] - iv[i][0] for i in v) for k, v in convs.items()}
union = busy_union
def spread(assign):
    per = collections.defaultdict(list)
    for k, e in assign.items(): per[e] += [iv[i] for i in convs[k]]
    b = [union(per[e]) for e in range(E)]
    return max(b)/st.mean(b), max(b), st.mean(b), sum(1 for x in b if x == 0)
ks = list(convs)
print("conversations %d, work total %.1f s, max conv %.2f s, mean %.2f" % (len(ks), sum(work.values()), max(work.values()), st.mean(work.values())))
# LPT on total work
h = [(0.0, e) for e in range(E)]; a = {}
for k in sorted(ks, key=lambda k: -work[k]):
    w, e = heapq.heappop(h); a[k] = e; heapq.heappush(h, (w + work[k], e))
print("LPT total work:            spread %.3f (max %.2f mean %.2f idle %d)" % spread(a))
# online: at first turn, engine with least work assigned so far (whole conv known? no: past only)
for name, key in (("least conversations so far", "n"), ("least past busy (up to now)", "past"),
                  ("least work placed (future turns unknown, count first turn only)", "first")):
    res = []
    for seed in range(10):              # ties broken at random: 10 draws
        rnd = random.Random(seed)
        a = {}; cnt = [0]*E; placed = collections.defaultdict(list)
        for k in sorted(ks, key=lambda k: trace[convs[k][0]]["timestamp"]):
            t = trace[convs[k][0]]["timestamp"]/1000
            if key == "n": sc = cnt
            elif key == "past":
                sc = [sum(min(b, t)-a_ for a_, b in placed[e] if a_ < t) for e in range(E)]
            else:
                sc = [sum(b-a_ for a_, b in placed[e]) for e in range(E)]
            r = [rnd.random() for _ in range(E)]
            e = min(range(E), key=lambda e: (sc[e], cnt[e], r[e]))
            a[k] = e; cnt[e] += 1
            placed[e] += [iv[i] for i in convs[k]] if key != "first" else [iv[convs[k][0]]]
        res.append(spread(a)[0])
    print("online, %s: spread %.3f-%.3f (median %.3f)" % (name, min(res), max(res), st.median(res)))
rs = []
for seed in range(20):
    rnd = random.Random(seed); a = {k: rnd.randrange(E) for k in ks}; rs.append(spread(a)[0])
print("random placement: spread %.3f-%.3f (median %.3f)" % (min(rs), max(rs), st.median(rs)))
a = {k: j % E for j, k in enumerate(sorted(ks, key=lambda k: trace[convs[k][0]]["timestamp"]))}
print("round robin by first turn: spread %.3f" % spread(a)[0])
