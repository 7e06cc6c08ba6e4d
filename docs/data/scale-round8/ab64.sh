#!/bin/bash
# ab64.sh TAG BUILD...: issue 18's 64-engine share matrix, one run per build, in order.
# Each BUILD is a build directory copied aside as $BUILDS/build-BUILD (default /tmp/s39):
# main = a whole build of a1c26aa; C1, C2, C3 = the same directory with the module built
# from variants.diff with "#define SPREAD_VARIANT 1", 2 or 3 at the top of kv_route.c.
tag=$1; shift
cd "$(dirname "$0")/../../.."
for b in "$@"; do
  echo "=== $tag $b $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
  env BENCH_SCALE_INSTANCES=1,2,4,8 BENCH_SCALE_MODES=events BENCH_SCALE_ENGINES=64 \
    BENCH_SCALE_SPEEDUP=0.5 BENCH_SCALE_RATE=128 BENCH_SCALE_REQUESTS=1600 \
    tools/bench-scale --build ${BUILDS:-/tmp/s39}/build-$b share 2>&1
  echo "=== end $b $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
done
