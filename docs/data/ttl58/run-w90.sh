#!/bin/sh
# w90 (credits weighed by the kept share, memory where 90 % is gone) against
# main's learner and the fixed memory; two runs a workload (stop 58).
set -e
D=docs/data/ttl58
B="tools/bench-e2e --build build --suite --no-plots --variant v=/work/helpers/w90.so --variant m=/work/helpers/m58.so"
F=kvroute-approx@m; M=kvroute-approx-learn@m; V=kvroute-approx-learn@v
for r in 1 2; do
    if [ $r = 1 ]; then P=$F,$M,$V; else P=$V,$M,$F; fi
    $B --workloads hotprefix --num-blocks 1024 --policies $P --out $D/v-hot$r
    $B --workloads mooncake --num-blocks 8192 --policies $P --out $D/v-moon$r
    $B --workloads conversation --num-blocks 8192 --policies $P --out $D/v-conv$r
done
