#!/bin/bash
# 64 engines, 1,600 requests, one and 8 instances in events mode, slack 0.25 and 0.10, alternated.
cd "$(dirname "$0")/../../.."
for r in "$@"; do
  for sl in 0.25 0.10; do
    echo "=== slack=$sl round $r $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
    env BENCH_SCALE_PARAMS="slack=$sl" BENCH_SCALE_INSTANCES=1,8 BENCH_SCALE_MODES=events \
      BENCH_SCALE_ONE_MODES=events BENCH_SCALE_ENGINES=64 BENCH_SCALE_SPEEDUP=0.5 \
      BENCH_SCALE_RATE=128 BENCH_SCALE_REQUESTS=${N:-1600} tools/bench-scale share 2>&1
  done
done
