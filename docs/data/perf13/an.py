import sys, numpy as np
for f in sys.argv[1:]:
    a=np.loadtxt(f)
    lat,reads,steps,lines=a[:,0],a[:,1],a[:,2],a[:,3]
    print(f, 'n',len(a),'p50 %.2f p99 %.2f'%tuple(np.percentile(lat,[50,99])))
    # regression lat ~ reads + lines
    X=np.column_stack([np.ones(len(a)),reads,lines])
    c,*_=np.linalg.lstsq(X,lat,rcond=None); print(' fit: %.3f + %.4f*reads + %.4f*lines'%tuple(c))
    print(' lines crossed per match: mean %.2f p50 %d p90 %d p99 %d'%(lines.mean(),*np.percentile(lines,[50,90,99])))
    for lo,hi in [(0,1),(2,3),(4,6),(7,10),(11,15),(16,99)]:
        m=(lines>=lo)&(lines<=hi)
        if m.sum(): print('  lines %2d-%2d: %5.1f%% of matches, lat p50 %.2f p99 %.2f, reads %.1f'%(lo,hi,100*m.mean(),np.percentile(lat[m],50),np.percentile(lat[m],99),reads[m].mean()))
    # what p99 would be if every match had lat of matches with same reads but lines<=1
