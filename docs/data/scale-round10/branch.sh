#!/bin/bash
# 64 engines, 1,600 requests, one instance in events mode: main's build and BUILD_B10 (a build directory whose
# module bounds new branches at 0.4 x slack in pick_shared, branch.diff), alternated: branch.sh BUILD_B10 ROUND...
cd "$(dirname "$0")/../../.."
b10=$1; shift
for r in "$@"; do
  for b in build "$b10"; do
    echo "=== build=$b round $r $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
    env BENCH_SCALE_INSTANCES=1,8 BENCH_SCALE_MODES=events BENCH_SCALE_ONE_MODES=events \
      BENCH_SCALE_ENGINES=64 BENCH_SCALE_SPEEDUP=0.5 BENCH_SCALE_RATE=128 BENCH_SCALE_REQUESTS=1600 \
      tools/bench-scale --build "$b" share 2>&1
  done
done
