#!/bin/sh
# Held-out runs for the learned memory (stop 57): approximate mode learned
# (kvroute-approx), fixed at 120 s (kvroute-approx-fixed) and events mode,
# one run each, slot orders varied. Run from the repository root.
set -e
D=docs/data/ttl57
B="tools/bench-e2e --build build --suite --no-plots"
$B --workloads mooncake --num-blocks 8192 --policies kvroute-approx-fixed,kvroute-approx,kvroute --out $D/moonB
$B --workloads conversation --num-blocks 8192 --policies kvroute-approx,kvroute-approx-fixed,kvroute --out $D/conv8k
$B --workloads conversation --num-blocks 16384 --policies kvroute-approx-fixed,kvroute-approx,kvroute --out $D/conv16k
$B --workloads hotprefix --num-blocks 1024 --policies kvroute-approx,kvroute-approx-fixed,kvroute --out $D/hot1k
$B --workloads sysprompt,agent --num-blocks 4096 --policies kvroute-approx-fixed,kvroute-approx,kvroute --out $D/sys4k
