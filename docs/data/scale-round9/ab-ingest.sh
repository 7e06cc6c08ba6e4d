#!/bin/bash
# kvindex-bench ingest at 64 and 4,096 workers: main (5eaea05) and the slot hints, alternated
for r in 1 2 3; do
  for w in 64 4096; do
    for b in main hint main hint; do
      [ $((r % 2)) = 0 ] && b=$( [ $b = main ] && echo hint || echo main )
      d=$( [ $b = main ] && echo /tmp/s41/new-build || echo /tmp/s41/build-hint )
      printf "%s %s %s " $r $w $b
      taskset -c 0 $d/bin/kvindex-bench --workers $w --seconds 1 2>&1 | tail -1 | python3 -c '
import json,sys; o=json.loads(sys.stdin.read())
print("ingest %.2fM decode_apply %.2fM match_p50 %.2f p99 %.2f writes_during_match %.2fM" % (o["ingest_blocks_per_s"]/1e6, o["decode_apply_blocks_per_s"]/1e6, o["match_p50_us"], o["match_p99_us"], o["write_blocks_per_s_during_match"]/1e6))'
    done
  done
done
