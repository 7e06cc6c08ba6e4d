#!/bin/sh
# Ten runs of the conversation trace at 524k: fixed memory, main's learner,
# weighed credits (w58b); slot order rotated (stop 58, characterization).
set -e
D=docs/data/ttl58
B="tools/bench-e2e --build build --suite --no-plots --variant w=/work/helpers/w58b.so --variant m=/work/helpers/m58.so"
F=kvroute-approx@m; M=kvroute-approx-learn@m; W=kvroute-approx-learn@w
for r in 1 2 3 4 5 6 7 8 9 10; do
    case $((r % 3)) in
        1) P=$F,$M,$W ;;
        2) P=$M,$W,$F ;;
        0) P=$W,$F,$M ;;
    esac
    $B --workloads conversation --num-blocks 8192 --policies $P --out $D/p-conv$r
    find $D/p-conv$r -name '*.jsonl' -o -name '*.decisions.log' | xargs rm -f
done
