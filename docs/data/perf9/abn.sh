#!/bin/bash
# abn.sh R "EXTRA" NAME...: R rounds of /tmp/s39/NAME-bench EXTRA, names alternated (ABBA)
# NAME-bench: kvindex-bench binaries copied aside to /tmp/s39 (main: a1c26aa; ra: with runahead.diff)
R=$1; EXTRA=$2; shift 2
A="--workers 64 --request-blocks 256 --readers 1"
for r in $(seq 1 $R); do
  if [ $((r % 2)) -eq 1 ]; then names="$*"; else names=$(echo "$*" | tr ' ' '\n' | tac | tr '\n' ' '); fi
  for n in $names; do
    l=$(cut -d' ' -f1 /proc/loadavg)
    /tmp/s39/$n-bench $A $EXTRA | python3 -c "
import json,sys,time
d=json.load(sys.stdin)
print('%s r%d %-5s load %s | p50 %.2f p99 %.2f p999 %.1f | ingest %.1fM | matches %d | cap %d idx %d' % (time.strftime('%H:%M:%S',time.gmtime()), $r, '$n', '$l', d['match_p50_us'], d['match_p99_us'], d['match_p999_us'], d['ingest_blocks_per_s']/1e6, d['matches'], d['capacity'], d['indexed']))"
  done
done
