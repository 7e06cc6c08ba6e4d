import json,sys,collections
rows=collections.defaultdict(list)
for fn in sys.argv[1:]:
  n=None; lcmax=None
  for l in open(fn):
    if l.startswith('=== n='): n=int(l.split()[1][2:]); lcmax=None
    if l.startswith('{"instances"'):
        r=json.loads(l); b=r['busy_s']; m=sum(b)/len(b)
        if r['mode']=='least_conn': lcmax=max(b); lcttft=r['ttft_mean_ms']
        rows[(n,r['instances'],r['mode'])].append(dict(spread=r['busy_spread'],hit=r['hit_rate'],ttft=r['ttft_mean_ms'],
            maxrel=max(b)/lcmax if lcmax else None, ttftrel=r['ttft_mean_ms']/lcttft if lcmax else None, zero=sum(1 for x in b if x==0), late=r['late_s'], mean=m))
def rg(v,f='%.3f'): v=[x for x in v if x is not None]; return (f%min(v))+('-'+f%max(v) if len(v)>1 else '') if v else '-'
print('| requests | instances | mode | runs | busy spread (max/mean) | max busy / least_conn\'s max busy | hit rate | mean TTFT ms | TTFT / least_conn\'s | engines idle |')
print('|---|---|---|---|---|---|---|---|---|---|')
for k in sorted(rows, key=lambda k:(k[0],k[1],['least_conn','events','approximate'].index(k[2]))):
    v=rows[k]
    print('| %d | %d | %s | %d | %s | %s | %s | %s | %s | %s |'%(k[0],k[1],k[2],len(v),
      ', '.join('%.3f'%x['spread'] for x in v), rg([x['maxrel'] for x in v]) if k[2]!='least_conn' else '1', rg([x['hit'] for x in v],'%.4f'),
      rg([x['ttft'] for x in v],'%.1f'), rg([x['ttftrel'] for x in v],'%.2f') if k[2]!='least_conn' else '1', ', '.join(str(x['zero']) for x in v)))
print('late s max', max(x['late'] for v in rows.values() for x in v))
