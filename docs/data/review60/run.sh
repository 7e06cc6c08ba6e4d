#!/bin/sh
# Stop 60's review figures, the session's first commit and its last side by
# side (docs/BENCHMARKS.md, "Stop 60"). OLD, NEW: checkouts of each, built
# (make -j2 build/bin/kvtok build/bin/kvindex-bench); IX_OLD: a kvindex-bench
# built from NEW's tools/kvindex-bench/main.c with OLD's src/index/kv_index.c
# (the old tree's bench has no --churn):
#   cc -O2 -pthread -D_GNU_SOURCE -I$OLD/src/index -I$OLD/src/core \
#      -o ixold $NEW/tools/kvindex-bench/main.c $OLD/src/index/kv_index.c \
#      $NEW/build/lib/libkvcore.a -lxxhash -lm
# Run from NEW's root.
set -e
D=${D:-/tmp/review60}
H=$(dirname "$0")
python3 "$H/inputs.py" "$D"
T=conf/tokenizers
for c in "$OLD" "$NEW"; do
  cc -O2 -D_GNU_SOURCE -I$c/src/core -I$c/src/text -I$c/src/route -o "$D/render_body" \
    "$H/render_body.c" "$c/build/lib/libkvcore.a" -ljansson -lxxhash -lutf8proc -lm -pthread
  echo "$c $("$D/render_body" "$D/wide_message.json")"
  for case in "qwen2.5-instruct many_system.json deepseek-v3" \
              "smollm3-3b many_tools.json smollm3-3b"; do
    set -- $case
    /usr/bin/time -f "$c kvtok --chat --template $3 < $2: %e s, %M KB" \
      "$c/build/bin/kvtok" encode --tokenizer $T/$1/tokenizer.json --chat --template "$3" \
      < "$D/$2" > /dev/null
  done
  for f in lt.txt ltbar.txt; do
    /usr/bin/time -f "$c kvtok smollm3 < $f: %e s, %M KB" \
      "$c/build/bin/kvtok" encode --tokenizer $T/smollm3-3b/tokenizer.json < "$D/$f" > /dev/null
  done
done
for i in 1 2 3; do
  for c in "$OLD" "$NEW"; do
    echo "$c $(taskset -c 0 "$c/build/bin/kvtok" bench \
      --tokenizer $T/qwen2.5-instruct/tokenizer.json t/data/prose_en.txt)"
  done
done
for i in 1 2 3; do
  for b in "$IX_OLD" "$NEW/build/bin/kvindex-bench"; do
    for churn in 0 100 1000; do
      echo "$b churn=$churn $($b --workers 64 --request-blocks 256 --readers 1 \
        --hot-request --churn $churn --seconds 2)"
    done
  done
done
