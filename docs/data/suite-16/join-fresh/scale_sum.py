import json,sys
cur=None
for l in open(sys.argv[1]):
    if l.startswith('=== build'): cur=l.split()[1]+' r'+l.split()[3]; continue
    if l.startswith('{"instances"'):
        d=json.loads(l)
        idle=sum(1 for r in d['requests'] if r<=3)
        print(f"{cur:32s} inst {d['instances']} spread {d['busy_spread']:.3f} hit {d['hit_rate']:.4f} engTTFT {d['engine_ttft_mean_ms']} idle {idle}")
