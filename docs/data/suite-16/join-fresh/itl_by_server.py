import json,collections,sys
# per-server requests, cold decisions and token-weighted ITL, joining the
# decision log (field 2: seconds to the last byte) with kvbench's records
d=sys.argv[1]
for pol in ['kvroute@m','kvroute@f','least_conn']:
    recs=[json.loads(l) for l in open(f'{d}/{pol}.jsonl')]
    bye2e=collections.defaultdict(list)
    for r in recs: bye2e[round(r['e2e_ms'])].append(r)
    per=collections.defaultdict(lambda:[0,0.0,0,0])
    miss=0
    for l in open(f'{d}/{pol}.decisions.log'):
        f=l.split(); e=round(float(f[1])*1000); c=None
        for k in (e,e-1,e+1):
            if bye2e.get(k): c=bye2e[k].pop(); break
        if c is None or not c['chunks']: miss+=1; continue
        p=per[f[2]]; p[0]+=1; p[1]+=c['itl_ms']*c['chunks']; p[2]+=c['chunks']; p[3]+=f[3]=='cold'
    itl=[p[1]/p[2] for p in per.values()]
    n=[p[0] for p in per.values()]
    print(f"{pol:11s} unmatched {miss:3d}  ITL {sum(p[1] for p in per.values())/sum(p[2] for p in per.values()):.2f} ms; per server ITL {min(itl):.1f}-{max(itl):.1f}, requests {min(n)}-{max(n)}")
