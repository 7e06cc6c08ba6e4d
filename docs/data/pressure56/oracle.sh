#!/bin/sh
# The oracle's hit rate on 8 engines at each KV pool size (block 64, balance 1.1),
# as bench-e2e asks it: sh oracle.sh TRACES (a bench-e2e --suite OUT/traces with the
# seed-16 sysprompt and hotprefix traces). Output: oracle.txt.
T=${1:?traces dir}
o() { build/bin/kvbench oracle --trace "$1" --engines 8 --cache-tokens $(($2 * 64)) \
        --block-size 64 --trace-block-size "$3" --balance 1.1 $4 2>&1 | head -1; }
for nb in 32768 16384 8192 4096; do
    o t/data/mooncake_conversation_trace.jsonl $nb 512 "--max-requests 1500"
    o t/data/mooncake_synthetic_trace.jsonl $nb 512 "--max-requests 2000"
done
for nb in 4096 2048 1536 1024; do o "$T"/sysprompt-n420-r7-s16.jsonl $nb 16; done
for nb in 2048 1024 768; do o "$T"/hotprefix-n1100-r22-s16.jsonl $nb 16; done
