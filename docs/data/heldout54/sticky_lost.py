"""Sticky decisions that lost reuse, on a fleet of two speeds (worker ids 7004+ slow):
python3 sticky_lost.py OUT/run1/WORKLOAD POLICY. For each, the best holder is the server
with the longest prefix of the request by earlier requests' placement (infinite caches);
tallies, by the best holder's and the chosen server's speed and by whether the best holder
had more requests in flight than L (mean x 1.25 + 1, unweighted, as the client saw them),
the requests and tokens lost. Pairing of records and decisions as tools/bench-e2e-lost."""
import collections, json, os, sys
d, pol = sys.argv[1], sys.argv[2]
summ = json.load(open(os.path.join(d, "summary.json"))); st = summ["settings"]; tb = st.get("trace_block", 512)
recs = {r["index"]: r for r in map(json.loads, open(os.path.join(d, pol + ".jsonl")))}
trace = [json.loads(l) for l, _ in zip(open(st["trace"]), range(len(recs)))]
status = json.load(open(os.path.join(d, pol + ".status.json")))["zones"]["kv"]["upstreams"]["llm"]
slow = {s["server"] for s in status if s["worker_id"] >= 7004}
dec = []
for line in open(os.path.join(d, pol + ".decisions.log")):
    f = line.split()
    if len(f) < 10 or f[3] == "-" or f[6] == "-": continue
    dec.append((float(f[0]) - float(f[1]), f))
dec.sort()
order = sorted(recs, key=lambda i: recs[i]["start_ms"])
why, used = {}, [False] * len(dec)
for pos, i in enumerate(order):
    for j in range(max(0, pos - 40), min(len(dec), pos + 40)):
        if not used[j] and int(dec[j][1][6]) == recs[i]["prompt_tokens"]:
            used[j] = True; why[i] = (dec[j][1][3], dec[j][1][2]); break
held = collections.defaultdict(set)   # server -> prefixes (tuples)
iv = [(recs[i]["start_ms"], recs[i]["start_ms"] + recs[i]["e2e_ms"], recs[i]["start_ms"] + recs[i]["ttft_ms"], why[i][1], recs[i]["prompt_tokens"] - max(0, recs[i].get("cached_tokens") or 0)) for i in order if i in why and recs[i].get("ttft_ms") is not None]
cnt = collections.Counter(); lostt = collections.Counter()
for i in order:
    if i not in why: continue
    h = trace[i]["hash_ids"]; n = trace[i]["input_length"]
    def plen(s):
        k = 0
        while k < len(h) and tuple(h[:k+1]) in held[s]: k += 1
        return min(n, k * tb)
    to = why[i][1]
    best = max(held, key=plen) if held else None
    bl = plen(best) if best else 0; got = plen(to)
    if why[i][0] == "sticky" and bl > got:
        t0 = recs[i]["start_ms"]
        nin = lambda s: sum(1 for x in iv if x[3] == s and x[0] <= t0 < x[1])
        k = ("best slow" if best in slow else "best fast") + (" -> slow" if to in slow else " -> fast")
        srv = set(x[3] for x in iv)
        mean = sum(nin(s) for s in srv) / len(srv)
        k += " L-bound" if nin(best) > mean * 1.25 + 1 else " within L"
        cnt[k] += 1; lostt[k] += bl - got
    for j in range(len(h)): held[to].add(tuple(h[:j+1]))
for k in cnt: print(k, cnt[k], "requests", lostt[k], "tokens lost")
