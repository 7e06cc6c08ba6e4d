# suite_sum.py TAG SUMMARY.json...: kvroute@TAG against kvroute (main), per workload, one run each.
# TAG s10: a module whose default slack is 0.10; b10: new branches bounded at 0.4 x slack (branch.diff).
import json, os, re, sys
tag = sys.argv[1]
print("| seed | workload | TTFT %s / main | engines' TTFT | hit main -> %s | of oracle main -> %s | ITL | E2E |"
      % (tag, tag, tag))
print("|---|---|---|---|---|---|---|---|")
for fn in sys.argv[2:]:
    seed = re.search(r"s(\d+)", os.path.basename(os.path.dirname(fn)) if fn.endswith("/summary.json")
                     else os.path.basename(fn)).group(1)
    for w, d in json.load(open(fn))["runs"][0].items():
        a, b = d["kvroute"], d["kvroute@" + tag]
        so = lambda x: "-" if x["share_of_oracle"] is None else "%.0f%%" % (100 * x["share_of_oracle"])
        print("| %s | %s | %.3f | %.3f | %.3f -> %.3f | %s -> %s | %.3f | %.3f |" % (
            seed, w, b["ttft_mean_ms"] / a["ttft_mean_ms"], b["engine_ttft_mean_ms"] / a["engine_ttft_mean_ms"],
            a["hit_rate"], b["hit_rate"], so(a), so(b), b["itl_mean_ms"] / a["itl_mean_ms"],
            b["e2e_mean_ms"] / a["e2e_mean_ms"]))
