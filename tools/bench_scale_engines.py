#!/usr/bin/env python3
"""Per engine, one `tools/bench-scale share` run (docs/BENCHMARKS.md "Scale-out round 6"):
busy time, requests, conversations, the rule that placed each conversation's first turn,
the union of its requests' intervals (busy time is that union on the mock engine).
Each why.log line is matched to its trace request by prompt tokens and start time.
usage: tools/bench_scale_engines.py TRACE RUN.json
  TRACE: the run's sessions.jsonl (kvsynth sessions, as bench_scale.py writes it);
  RUN.json: one run's JSON line from bench-scale's output (it names its why.log files).
Writes RUN.json.analysis.json (per engine; per request: engine, rule, overlap, start, duration)."""
import json, sys, collections, heapq, statistics as st
from bench_scale import busy_union

trace = [json.loads(l) for l in open(sys.argv[1])]
run = json.loads(open(sys.argv[2]).read())
m = run["instances"]
conv_of = {}
convs = collections.OrderedDict()
for i, r in enumerate(trace):
    k = (r["hash_ids"][0] >> 32, r["hash_ids"][64])
    convs.setdefault(k, []).append(i)
    conv_of[i] = k

# log lines -> trace requests
place = {}      # trace idx -> (engine, why, overlap, start, dur)
unmatched = 0
for k, path in enumerate(run["logs"]):
    rows = []
    for line in open(path):
        a = line.split()
        if len(a) < 6:
            continue
        end, dur = float(a[4]), float(a[5])
        rows.append([a[0].rsplit(":", 1)[-1], a[1], int(a[2] or 0) if a[2].isdigit() else 0,
                     int(a[3]) if a[3].isdigit() else -1, end - dur, dur])
    mine = list(range(len(trace)))[k::m]
    t0 = min(r[4] for r in rows)
    bytok = collections.defaultdict(list)
    for r in rows:
        bytok[r[3]].append(r)
    for i in mine:
        c = bytok.get(trace[i]["input_length"])
        if not c:
            unmatched += 1
            continue
        want = t0 + trace[i]["timestamp"] / 1000.0
        j = min(range(len(c)), key=lambda j: abs(c[j][4] - want))
        r = c.pop(j)
        place[i] = (r[0], r[1], r[2], r[4], r[5])
ports = sorted(run["why"].keys())
# busy_s is in the worker's port order (consecutive ports)
base = min(int(p) for p in ports)
busy = {str(base + j): b for j, b in enumerate(run["busy_s"])}
mean_busy = st.mean(run["busy_s"])

per = {p: {"busy": busy[p], "req": 0, "conv": set(), "first": collections.Counter(),
           "work": 0.0, "iv": []} for p in busy}
for i, (e, why, ov, s, d) in place.items():
    q = per[e]
    q["req"] += 1
    q["conv"].add(conv_of[i])
    q["work"] += d
    q["iv"].append((s, s + d))
    if convs[conv_of[i]][0] == i:
        q["first"][why] += 1

union = busy_union

print("run: instances %d, hit %s, TTFT %s, busy spread %s, unmatched %d of %d"
      % (m, run["hit_rate"], run["ttft_mean_ms"], run["busy_spread"], unmatched, len(trace)))
print("mean busy %.2f s; max %.2f" % (mean_busy, max(busy.values())))
# conversations: total turns and time span
print("%6s %6s %5s %5s %5s %7s %s" % ("engine", "busy", "req", "convs", "firsts", "union", "first turns by rule"))
rows = sorted(per.items(), key=lambda kv: -kv[1]["busy"])
for p, q in rows:
    print("%6s %6.2f %5d %5d %5d %7.2f %s" % (p, q["busy"], q["req"], len(q["conv"]),
          sum(q["first"].values()), union(q["iv"]), dict(q["first"])))
idle = [p for p, q in per.items() if q["req"] == 0]
print("idle engines:", len(idle))
json.dump({"per": {p: {"busy": q["busy"], "req": q["req"], "conv": len(q["conv"]),
                       "first": dict(q["first"]), "union": union(q["iv"])} for p, q in per.items()},
           "place": {str(i): v for i, v in place.items()}},
          open(sys.argv[2] + ".analysis.json", "w"))
