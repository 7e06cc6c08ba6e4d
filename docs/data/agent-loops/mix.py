"""Mixed tenants on one fleet: an agent-loop trace (bench-e2e's `agent`, 16-token ids)
merged with 256-token prompts shared with nobody (64-192 output tokens) at RATE/s over
the same span. Usage: mix.py AGENT.jsonl RATE SEED OUT.jsonl (docs/BENCHMARKS.md,
"Routing round 17")."""
import json
import random
import sys

agent = [json.loads(l) for l in open(sys.argv[1])]
rate, seed = float(sys.argv[2]), int(sys.argv[3])
end = max(r["timestamp"] for r in agent)
rnd, t, short = random.Random(seed), 0.0, []
while True:
    t += rnd.expovariate(rate / 1000.0)
    if t > end:
        break
    i = len(short)
    # the suite's own-prompt ids (bench-e2e _own): no other request uses them
    short.append({"timestamp": int(t), "input_length": 256,
                  "output_length": rnd.randint(64, 192),
                  "hash_ids": [10 ** 12 + i * 4096 + k for k in range(16)]})
with open(sys.argv[4], "w") as f:
    for r in sorted(agent + short, key=lambda r: r["timestamp"]):
        f.write(json.dumps(r) + "\n")
print(len(agent), len(short))
