#!/bin/bash
# tok-ab.sh R NAME...: R rounds of kvtok bench (Qwen2.5, prose), names alternated; cold / best CPU MB/s
# kvtok-NAME: kvtok binaries copied aside to /tmp/s39/tok (main: a1c26aa; p1, w1m: see tok-runs.txt)
R=$1; shift
cd "$(dirname "$0")/../../.."
for r in $(seq 1 $R); do
  if [ $((r % 2)) -eq 1 ]; then names="$*"; else names=$(echo "$*" | tr ' ' '\n' | tac | tr '\n' ' '); fi
  for n in $names; do
    taskset -c 0 /tmp/s39/tok/kvtok-$n bench --tokenizer conf/tokenizers/qwen2.5-instruct/tokenizer.json t/data/prose_en.txt | python3 -c "
import json,sys; d=json.load(sys.stdin); print('r$r %-6s cold %.1f best %.1f tokens %d' % ('$n', d['cold_cpu_mb_per_s'], d['cpu_mb_per_s'], d['tokens']))"
  done
done
