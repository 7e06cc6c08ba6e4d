#!/bin/sh
# Repeats of the two runs that moved most (stop 57): hot prefix on 65k-token
# pools and the conversation trace on 524k, learned and fixed alternated.
set -e
D=docs/data/ttl57
B="tools/bench-e2e --build build --suite --no-plots"
$B --workloads hotprefix --num-blocks 1024 --policies kvroute-approx-fixed,kvroute-approx --runs 2 --out $D/hot1kB
$B --workloads conversation --num-blocks 8192 --policies kvroute-approx-fixed,kvroute-approx --out $D/conv8kB
