import collections,statistics as st,sys,math
rows=[l.split() for l in open(sys.argv[1])]
d=collections.defaultdict(list)
for n,p50,p99,p999,ing,w in rows: d[n].append((float(p50),float(p99),float(ing)))
base=sys.argv[2] if len(sys.argv)>2 else 'base'
for n,v in d.items():
    b=d[base]
    r99=[b[i][1]/v[i][1] for i in range(min(len(b),len(v)))]
    r50=[b[i][0]/v[i][0] for i in range(min(len(b),len(v)))]
    gm=lambda r: math.exp(sum(map(math.log,r))/len(r))
    print('%-6s n=%d p50 med %.3f p99 med %.3f  vs %s: p99 gm %.3f (%.2f-%.2f) p50 gm %.3f ingest %.2f'%(n,len(v),st.median(x[0] for x in v),st.median(x[1] for x in v),base,gm(r99),min(r99),max(r99),gm(r50),st.mean(x[2] for x in v)))
