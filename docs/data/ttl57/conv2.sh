#!/bin/sh
# After the criterion (stop 57): two more pairs on the conversation trace at
# 524k-token pools, main's learned memory (three quarters) against the fixed
# one, both slot orders. Information for the next stop, not a new decision.
set -e
D=docs/data/ttl57
B="tools/bench-e2e --build build --suite --no-plots --workloads conversation --num-blocks 8192"
$B --policies kvroute-approx,kvroute-approx-learn --out $D/conv2a
$B --policies kvroute-approx-learn,kvroute-approx --out $D/conv2b
