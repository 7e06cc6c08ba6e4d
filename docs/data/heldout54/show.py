"""Each policy's figures from a bench-e2e summary.json, with the busy time of the
first K engines and of the rest (a fleet of two speeds): python3 show.py SUMMARY [K]"""
import json,sys
s=json.load(open(sys.argv[1]))
K=int(sys.argv[2]) if len(sys.argv)>2 else 4
for i,res in enumerate(s['runs']):
    for w,r in res.items():
        o=r.get('oracle_hit_rate') or 0
        for p in s['policies']:
            x=r.get(p,{})
            if not x or 'skipped' in x: continue
            b=x['busy_s']
            print("r%d %-10s %-15s ttft %6.0f p90 %6.0f eng %6.0f itl %5.1f e2e %6.0f tok/s %6.0f hit %.3f (%3.0f%%) spread %.2f busy fast %.0f slow %.0f err %s"%(i+1,w,p,x['ttft_mean_ms'],x['ttft_p90_ms'],x.get('engine_ttft_mean_ms') or 0,x['itl_mean_ms'],x['e2e_mean_ms'],x['throughput_tok_s'],x['hit_rate'] or 0,100*(x['hit_rate'] or 0)/o if o else 0,x['load_spread'],sum(b[:K])/K,sum(b[K:])/max(1,len(b)-K),x['errors']))
