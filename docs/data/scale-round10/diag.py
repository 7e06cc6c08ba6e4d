# diag.py RUN.log...: per engine, busy time against sessions started there (any reason but sticky) and sticky turns,
# from bench-scale share output (BENCH_SCALE_LOGS kept the why.log of each run, in the same order, in diag/)
import json,collections,statistics,sys,glob,os
logs=sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'diag', 'why-*.log')))
for i,fn in enumerate(sys.argv[1:]):
    r=[json.loads(l) for l in open(fn) if l.startswith('{"instances"')][0]
    busy=r['busy_s']; ports=r['ports']; why=r['why_by_engine']
    lines=[l.split() for l in open(logs[i])]
    starts=collections.Counter(); sticky=collections.Counter(); unc=collections.Counter()
    for l in lines:
        p=int(l[0].rsplit(':',1)[1]); ov=int(l[2]) if l[2].isdigit() else 0
        if l[1]=='sticky': sticky[p]+=1
        else: starts[p]+=1
        unc[p]+=int(l[3])-16*ov
    mb=statistics.mean(busy)
    rows=sorted(((b/mb,starts[p],sticky[p],unc[p],why[k]) for k,(b,p) in enumerate(zip(busy,ports))),reverse=True)
    top=rows[:8]; bot=[x for x in rows if x[0]>0][-8:]
    def m(v): return statistics.mean(v)
    print(fn, 'spread %.3f'%rows[0][0], 'engines idle',sum(1 for x in rows if x[0]==0))
    print('  top 8 busy %.2f-%.2fx: starts %.1f sticky %.1f uncached %.0f'%(top[-1][0],top[0][0],m([x[1] for x in top]),m([x[2] for x in top]),m([x[3] for x in top])))
    print('  bottom 8 busy %.2f-%.2fx: starts %.1f sticky %.1f uncached %.0f'%(bot[-1][0],bot[0][0],m([x[1] for x in bot]),m([x[2] for x in bot]),m([x[3] for x in bot])))
    print('  all: starts %.1f sticky %.1f; reasons %s'%(m([x[1] for x in rows]),m([x[2] for x in rows]), dict(sum((collections.Counter(x[4]) for x in rows),collections.Counter()))))
    # correlation of busy with starts
    xs=[x[1] for x in rows]; ys=[x[0] for x in rows]
    print('  corr(busy, starts) %.2f; corr(busy, sticky) %.2f'%(statistics.correlation(xs,ys), statistics.correlation([x[2] for x in rows],ys)))
