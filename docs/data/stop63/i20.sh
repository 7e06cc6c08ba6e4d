#!/bin/bash
cd "$(dirname "$0")/../../.."
echo "=== $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
for i in 1 2; do KVROUTE_BUILD=build SECS=4 .venv/bin/python tools/bench_decision_ids.py 2>&1 | tail -3; done
for i in 1 2; do taskset -c 0 build/bin/kvtok bench --tokenizer conf/tokenizers/qwen2.5-instruct/tokenizer.json t/data/prose_en.txt 2>&1 | tail -4; done
CONVS=300 TURNS=2 SIDES=on tools/bench.d/turns build 2>&1 | tail -6
echo "=== end $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
