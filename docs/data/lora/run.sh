#!/bin/sh
# The A/B of docs/BENCHMARKS.md "LoRA adapters named by model": each
# configuration SEEDS times, alternated, under the bench lock. OLD is a
# build of bdf58ef with this stop's kvworker copied over its own.
OLD=${OLD:-/tmp/kvmix}
NEW=${NEW:-$PWD/build}
for shared in 0 1; do
for seed in ${SEEDS:-1 2 3}; do
    for cfg in "$OLD|" "$OLD|model=base" "$NEW|model=base lora=*" "$NEW|"; do
        KVROUTE_BUILD=${cfg%%|*} PARAMS=${cfg#*|} SEED=$seed SHARED=$shared \
            .venv/bin/python docs/data/lora/lora_ab.py
    done
done
done
