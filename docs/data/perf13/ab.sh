#!/bin/sh
# ab.sh ROUNDS "EXTRA" NAME... : alternates /tmp/ix/NAME-bench, prints name p50 p99 p999 ingest
R=$1; X=$2; shift 2
for r in $(seq 1 $R); do
  if [ $((r % 2)) = 1 ]; then L="$*"; else L=$(echo "$*" | tr ' ' '\n' | tac | tr '\n' ' '); fi
  for n in $L; do
    /tmp/ix/$n-bench --workers 64 --request-blocks 256 --readers 1 --hot-request $X | \
      python3 -c "import json,sys; d=json.load(sys.stdin); print('$n', d['match_p50_us'], d['match_p99_us'], d['match_p999_us'], round(d['ingest_blocks_per_s']/1e6,2), round(d['write_blocks_per_s_during_match']/1e6,2), sep='\t')"
  done
done
