#!/bin/sh
# The A/B of docs/BENCHMARKS.md "Batches of prompts": each build SEEDS
# times, alternated, under the bench lock. OLD is a build of 8453fdd (a
# batch counted as its first prompt), NEW this tree's.
OLD=${OLD:-/tmp/kvold/build}
NEW=${NEW:-$PWD/build}
for seed in ${SEEDS:-1 2 3}; do
    for b in "$OLD" "$NEW"; do
        KVROUTE_BUILD=$b SEED=$seed .venv/bin/python docs/data/batch/batch_ab.py
    done
done
