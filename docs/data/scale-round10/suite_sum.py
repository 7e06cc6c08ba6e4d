# suite_sum.py SUMMARY.json...: kvroute@s10 (default slack 0.10) against kvroute (0.25), per workload, one run each
import json, os, re, sys
print("| seed | workload | TTFT s10 / main | engines' TTFT | hit main -> s10 | of oracle main -> s10 | ITL | E2E |")
print("|---|---|---|---|---|---|---|---|")
for fn in sys.argv[1:]:
    seed = re.search(r"s(\d+)", os.path.basename(os.path.dirname(fn)) if fn.endswith("/summary.json")
                     else os.path.basename(fn)).group(1)
    for w, d in json.load(open(fn))["runs"][0].items():
        a, b = d["kvroute"], d["kvroute@s10"]
        so = lambda x: "-" if x["share_of_oracle"] is None else "%.0f%%" % (100 * x["share_of_oracle"])
        print("| %s | %s | %.3f | %.3f | %.3f -> %.3f | %s -> %s | %.3f | %.3f |" % (
            seed, w, b["ttft_mean_ms"] / a["ttft_mean_ms"], b["engine_ttft_mean_ms"] / a["engine_ttft_mean_ms"],
            a["hit_rate"], b["hit_rate"], so(a), so(b), b["itl_mean_ms"] / a["itl_mean_ms"],
            b["e2e_mean_ms"] / a["e2e_mean_ms"]))
