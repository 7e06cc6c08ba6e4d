# slack_sum.py LOG...: busy spread, hit, TTFT (client and engines), idle engines, seeds per slack and instance count
import collections, json, sys
rows = collections.defaultdict(list)
for fn in sys.argv[1:]:
    sl = None
    for line in open(fn):
        if line.startswith("=== slack="):
            sl = line.split()[1]
        if line.startswith('{"instances"'):
            r = json.loads(line)
            b = r["busy_s"]
            rows[(r["instances"], sl)].append(r | {"idle": sum(1 for x in b if x == 0),
                                                   "seeds": sum(w.get("seed", 0) for w in r["why_by_engine"])})
print("| instances | slack | runs | busy spread | hit rate | client TTFT ms | engines' TTFT ms | idle engines | seeds |")
print("|---|---|---|---|---|---|---|---|---|")
for (m, sl), v in sorted(rows.items(), key=lambda kv: (kv[0][0], -float(kv[0][1].split("=")[1]))):
    f = lambda k, fmt="%.3f": ", ".join(fmt % x[k] for x in v)
    print("| %d | %s | %d | %s | %s | %s | %s | %s | %s |" % (m, sl.split("=")[1], len(v), f("busy_spread"),
          f("hit_rate", "%.4f"), f("ttft_mean_ms", "%.1f"), f("engine_ttft_mean_ms", "%.1f"),
          f("idle", "%d"), f("seeds", "%d")))
