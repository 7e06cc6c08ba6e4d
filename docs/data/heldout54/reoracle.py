"""The two-speed runs' hit rates against `kvbench oracle --slow-engines` (a load bound
that counts work in time, added after these runs) beside the equal-engine oracle they
printed: python3 reoracle.py BUILD SUMMARY.json [...] (run from the repository root,
with the runs' traces where the summaries name them)."""
import json
import subprocess
import sys

build = sys.argv[1]
for path in sys.argv[2:]:
    s = json.load(open(path))
    for res in s["runs"]:
        for w, r in res.items():
            st = r["settings"]
            cmd = [build + "/bin/kvbench", "oracle", "--trace", st["trace"], "--engines",
                   str(st["engines"]), "--cache-tokens",
                   str(st["num_blocks"] * st["block_size"]), "--block-size",
                   str(st["block_size"]), "--trace-block-size", str(st["trace_block"]),
                   "--max-requests", str(st["requests"]), "--slow-engines", "4",
                   "--slow-factor", "0.5"]
            o = json.loads(subprocess.run(cmd, check=True, capture_output=True,
                                          text=True).stdout)
            for p in s["policies"]:
                x = r.get(p, {})
                if not x.get("hit_rate"):
                    continue
                print("%-13s %-10s %-15s hit %.3f  equal-engine oracle %.3f (%3.0f%%)  "
                      "two-speed oracle %.3f (%3.0f%%)" % (
                          path.split("/")[-2], w, p, x["hit_rate"], r["oracle_hit_rate"],
                          100 * x["hit_rate"] / r["oracle_hit_rate"], o["oracle_hit_rate"],
                          100 * x["hit_rate"] / o["oracle_hit_rate"]))
