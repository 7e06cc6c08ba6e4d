#!/bin/bash
# alternate decision benches: base (a7da384) and the slot-log change, ROUNDS pairs (default 3)
cd "$(dirname "$0")/../../.."
for r in $(seq ${ROUNDS:-3}); do
  for b in base new; do
    if [ $b = base ]; then d=/tmp/s41/base/build; else d=/tmp/s41/new-build; fi
    echo "== run $r $b $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    tools/bench-scale --build $d decision 2>&1 | python3 -c '
import json,sys
t=sys.stdin.read(); i=t.index("{"); o=json.loads(t[i:t.rindex("}")+1])
o=o.get("decision",o)
print("ratio", o["p99_4096_over_p99_8"])
for n,v in o["sizes"].items(): print(n, "p50",v["p50_us"],"p99",v["p99_us"],"cold",v["cold"],"cold_p50",v["cold_p50_us"],"cold_max",v["cold_max_us"],"warm_p99",v["warm_p99_us"],"counted",v["requests_counted"])
'
  done
done
