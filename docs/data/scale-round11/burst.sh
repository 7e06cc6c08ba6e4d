#!/bin/bash
# burst.sh ROUNDS BUILD_A BUILD_B ... : 64 engines, 1,600 requests, one instance, events; alternated
cd "$(dirname "$0")/../../.."
rounds=$1; shift
for r in $(seq $rounds); do
  for b in "$@"; do
    env BENCH_SCALE_INSTANCES=1 BENCH_SCALE_MODES=events BENCH_SCALE_ONE_MODES=events \
      BENCH_SCALE_ENGINES=64 BENCH_SCALE_SPEEDUP=0.5 BENCH_SCALE_RATE=128 BENCH_SCALE_REQUESTS=${REQ:-1600} \
      tools/bench-scale --build "$b" share 2>&1 | grep '^{"instances"' | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); b=r['busy_s']
    print('$b', r['mode'], r['instances'], 'spread %.3f'%r['busy_spread'], 'hit %.4f'%r['hit_rate'], 'ttft %.1f'%r['ttft_mean_ms'], 'eng %.1f'%(r.get('engine_ttft_mean_ms') or 0), 'idle', sum(1 for x in b if x==0), 'maxbusy %.2f'%max(b))
"
  done
done
