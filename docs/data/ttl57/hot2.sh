#!/bin/sh
# After the decision (stop 57): one more hot-prefix pair at 65k-token pools,
# main's learned memory (three quarters) first, then the fixed one.
set -e
tools/bench-e2e --build build --suite --no-plots --workloads hotprefix --num-blocks 1024 --policies kvroute-approx-learn,kvroute-approx --out docs/data/ttl57/hot2
