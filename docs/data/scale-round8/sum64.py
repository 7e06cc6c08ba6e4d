import json, sys
for fn in sys.argv[1:]:
    b = None
    for line in open(fn):
        if line.startswith('=== ') and not line.startswith('=== end'):
            _, tag, b, t = line.split()[:4]
        if line.startswith('{"instances"'):
            d = json.loads(line)
            why = {}
            for e in d['why'].values():
                for k, v in e.items(): why[k] = why.get(k, 0) + v
            bs = d['busy_s']; idle = sum(1 for r in d['requests'] if r == 0)
            print(f"{tag} {t} {b:5s} inst {d['instances']} {d['mode'][:6]:6s} hit {d['hit_rate']:.3f} ttft {d['ttft_mean_ms']:.1f} "
                  f"busy {d['busy_spread']:.2f} idle {idle} min-max {min(bs):.1f}-{max(bs):.1f} shared/seed {why.get('shared',0)}/{why.get('seed',0)} "
                  f"load {d['load_avg_1m'][0]:.1f}-{d['load_avg_1m'][1]:.1f}")
