#!/bin/bash
# issue 16's 8-engine suite, main (5eaea05) and empty-first (e0) in one run per seed
cd "$(dirname "$0")/../../.."
for seed in "$@"; do
  echo "=== suite seed $seed $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  tools/bench-e2e --build /tmp/s41/build-new --suite --scale 0.4 --seed $seed \
    --policies kvroute,kvroute@e0,kvroute-approx,kvroute-approx@e0 \
    --variant e0=/tmp/s41/build-e0/modules/ngx_http_kvroute_module.so --no-plots --out /tmp/s41/suite-s$seed 2>&1 | tail -3
  echo "=== end $seed $(date -u +%T)"
done
