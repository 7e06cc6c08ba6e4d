#!/bin/sh
# The A/B of docs/BENCHMARKS.md "Agent sessions over the Anthropic Messages
# API": each build SEEDS times, alternated, under the bench lock. OLD is a
# build of 4958205 (which reads /v1/messages as OpenAI chat messages and
# never sees `system`) with this tree's kvworker copied over its own (the old
# one does not serve /v1/messages); NEW this tree's.
OLD=${OLD:-/tmp/kvold/build}
NEW=${NEW:-$PWD/build}
for seed in ${SEEDS:-1 2 3}; do
    for b in "$OLD" "$NEW"; do
        KVROUTE_BUILD=$b SEED=$seed SYS_CHARS=${SYS_CHARS:-1200} TURNS=${TURNS:-8} \
            CONVS=${CONVS:-48} .venv/bin/python docs/data/anthropic/anthropic_ab.py
    done
done
# The second set (long shared system prompts, more and shorter sessions):
# SYS_CHARS=12000 TURNS=4 CONVS=96 SEEDS="1 2 3" sh docs/data/anthropic/run.sh
