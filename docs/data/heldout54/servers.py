"""Per-server requests and learned lines from a bench-e2e run's kvroute status pages:
python3 servers.py OUT/run1/WORKLOAD/kvroute.status.json [...]"""
import json
import sys

for path in sys.argv[1:]:
    z = json.load(open(path))["zones"]["kv"]
    print(path)
    print("%9s %8s %12s %12s %11s %8s" % ("worker", "requests", "prefill t/ms", "prefill base",
                                          "decode pace", "indexed"))
    for s in z["upstreams"]["llm"]:
        print("%9d %8d %12.2f %12.0f %11.2f %8d" % (s["worker_id"], s["requests"],
                                                   s["prefill_rate"], s["prefill_base"],
                                                   s["decode_pace"], s["indexed_blocks"]))
