#!/bin/sh
# Credits weighed by the engines' kept share (w58.so) against main's learner
# (m58.so) and the fixed memory; two runs a workload, orders reversed (stop 58).
set -e
D=docs/data/ttl58
B="tools/bench-e2e --build build --suite --no-plots --variant w=/work/helpers/w58.so --variant m=/work/helpers/m58.so"
F=kvroute-approx@m; M=kvroute-approx-learn@m; W=kvroute-approx-learn@w
for r in 1 2; do
    if [ $r = 1 ]; then P=$F,$M,$W; else P=$W,$M,$F; fi
    $B --workloads hotprefix --num-blocks 1024 --policies $P --out $D/hot$r
    $B --workloads mooncake --num-blocks 8192 --policies $P --out $D/moon$r
    $B --workloads conversation --num-blocks 8192 --policies $P --out $D/conv$r
done
