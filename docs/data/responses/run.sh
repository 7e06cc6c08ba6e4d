#!/bin/sh
# The A/B of docs/BENCHMARKS.md "Conversations over the Responses API":
# each build SEEDS times, alternated, under the bench lock. OLD is a build
# of 8453fdd (which does not read /v1/responses) with this tree's kvworker
# copied over its own (the old one does not serve /v1/responses); NEW this
# tree's.
OLD=${OLD:-/tmp/kvold/build}
NEW=${NEW:-$PWD/build}
for seed in ${SEEDS:-1 2 3}; do
    for b in "$OLD" "$NEW"; do
        KVROUTE_BUILD=$b SEED=$seed SPEEDUP=1 CLIENTS=12 SYS_CHARS=1200 USER_CHARS=2000 \
            TURNS=8 THINK_MS=${THINK_MS:-100} .venv/bin/python docs/data/responses/responses_ab.py
    done
done
