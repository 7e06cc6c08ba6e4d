#!/bin/sh
# Ten runs each of hotprefix at 65k and mooncake at 524k: fixed memory,
# main's learner (m58.so), weighed credits (w58b.so); slot order rotated
# (stop 59, criterion.txt).
set -e
D=docs/data/ttl59
B="tools/bench-e2e --build build --suite --no-plots --variant w=/work/helpers/w58b.so --variant m=/work/helpers/m58.so"
F=kvroute-approx@m; M=kvroute-approx-learn@m; W=kvroute-approx-learn@w
for r in 1 2 3 4 5 6 7 8 9 10; do
    case $((r % 3)) in
        1) P=$F,$M,$W ;;
        2) P=$M,$W,$F ;;
        0) P=$W,$F,$M ;;
    esac
    $B --workloads hotprefix --num-blocks 1024 --policies $P --out $D/hot$r
    $B --workloads mooncake --num-blocks 8192 --policies $P --out $D/moon$r
    find $D/hot$r $D/moon$r -name '*.jsonl' -o -name '*.decisions.log' | xargs rm -f
done
