#!/bin/sh
# The stale share at 75 % (t75.so: KV_RETAIN_STALE_PCT 75) against main's 50 %
# (m57.so) and the fixed memory, in one run per workload (stop 57).
set -e
D=docs/data/ttl57
B="tools/bench-e2e --build build --suite --no-plots --variant t75=/work/helpers/t75.so --variant m=/work/helpers/m57.so"
$B --workloads hotprefix --num-blocks 1024 --policies kvroute-approx-learn@t75,kvroute-approx@m,kvroute-approx-learn@m --out $D/t75hot
$B --workloads mooncake --num-blocks 8192 --policies kvroute-approx@m,kvroute-approx-learn@m,kvroute-approx-learn@t75 --out $D/t75moon
$B --workloads conversation --num-blocks 8192 --policies kvroute-approx-learn@t75,kvroute-approx@m --out $D/t75conv
