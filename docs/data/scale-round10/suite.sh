#!/bin/bash
# issue 16's 8-engine suite, events mode, main (slack 0.25) and a module whose default slack is 0.10 (s10),
# one run per seed: suite.sh S10_MODULE SEED...
cd "$(dirname "$0")/../../.."
mod=$1; shift
for seed in "$@"; do
  echo "=== suite seed $seed $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  tools/bench-e2e --suite --scale 0.4 --seed $seed --policies kvroute,kvroute@s10 \
    --variant s10=$mod --no-plots --out /tmp/s43/suite-s$seed 2>&1 | tail -3
  echo "=== end $seed $(date -u +%T)"
done
