#!/bin/bash
cd "$(dirname "$0")/../../.."
for run in 1 2; do
  echo "=== run $run $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
  tools/bench-disagg --rate 6 --build build --out ${OUT:-/tmp}/disagg-$run --fleets aggregated,4p4d-c-k3072,2p6d-c-k3072 2>&1 | tail -30
  echo "=== end run $run $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
done
