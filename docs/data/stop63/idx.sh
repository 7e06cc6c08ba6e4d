#!/bin/bash
# issue 20: index match p99 against the writer's pace (kvindex-bench --write-rate)
cd "$(dirname "$0")/../../.."
for round in 1 2 3; do
  for r in 0 400000 40000; do
    echo "round $round rate $r $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
    build/bin/kvindex-bench --workers 64 --request-blocks 256 --readers 1 --hot-request --write-rate $r
  done
done
