#!/bin/bash
# usage: [ONE=least_conn,events] docs/data/scale-round10/len64.sh N... (each N: requests in the trace, one share run)
# 64-engine share runs at several trace lengths: least_conn, events, approximate at one instance, events at 8.
cd "$(dirname "$0")/../../.."
for n in "$@"; do
  echo "=== n=$n $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
  env BENCH_SCALE_INSTANCES=1,8 BENCH_SCALE_MODES=events BENCH_SCALE_ONE_MODES=${ONE:-least_conn,events,approximate} \
    BENCH_SCALE_ENGINES=64 BENCH_SCALE_SPEEDUP=0.5 BENCH_SCALE_RATE=128 BENCH_SCALE_REQUESTS=$n \
    tools/bench-scale share 2>&1
  echo "=== end n=$n $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
done
