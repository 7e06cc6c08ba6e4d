import sys, collections
for f in sys.argv[1:]:
    c = collections.defaultdict(lambda: [0, 0, 0])
    for l in open(f):
        x = l.split()
        if len(x) < 10 or x[3] == '-': continue
        pt = int(x[6]); ten = 'short' if pt == 256 else 'docs' if pt == 2304 else 'chat'
        k = (ten, x[3]); c[k][0] += 1; c[k][1] += int(x[4]); c[k][2] += int(x[5])
    print(f.split('/')[-1])
    for k in sorted(c): print('  %-6s %-7s n=%4d overlap/prompt blocks %.3f' % (k[0], k[1], c[k][0], c[k][1] / max(1, c[k][2])))
