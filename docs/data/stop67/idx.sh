#!/bin/bash
# issue 20: the index match's p99 beside the host's floor (a loop of
# arithmetic with the match's median, same clock) and the p99 of each
# document's median match (the work's own spread); writer flat out (the
# issue's figure) and paced to 40k blocks/s, 4 KB and huge pages.
cd "$(dirname "$0")/../../.."
echo "machine: $(nproc) vCPU, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')"
for round in 1 2 3; do
  for r in 0 40000; do
    for h in "" --hugepages; do
      echo "round $round rate $r $h $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
      build/bin/kvindex-bench --workers 64 --request-blocks 256 --readers 1 --hot-request --write-rate $r $h
    done
  done
done
