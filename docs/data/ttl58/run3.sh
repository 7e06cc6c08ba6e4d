#!/bin/sh
# After the criterion (characterization only): the conversation trace at 524k
# with the fixed memory twice, main's learner and w58b (w with the age fix).
set -e
D=docs/data/ttl58
B="tools/bench-e2e --build build --suite --no-plots --variant w=/work/helpers/w58b.so --variant m=/work/helpers/m58.so --variant f=/work/helpers/m58.so"
$B --workloads conversation --num-blocks 8192 --policies kvroute-approx@m,kvroute-approx-learn@w,kvroute-approx-learn@m,kvroute-approx@f --out $D/conv3
