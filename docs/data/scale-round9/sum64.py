#!/usr/bin/env python3
"""Summarise ab64.sh logs: one line per build, run and instance count."""
import json
import re
import sys

for path in sys.argv[1:]:
    text = open(path).read()
    parts = re.split(r"^=== (\S+) (\S+) (\S+) load (\S+)$", text, flags=re.M)
    for i in range(1, len(parts) - 4, 5):
        tag, build, start, load, body = parts[i:i + 5]
        if build == "end":
            continue
        for line in body.splitlines():
            if not line.startswith('{"instances"'):
                continue
            o = json.loads(line)
            reqs = o["requests"]
            why = {}
            for per in o["why"].values():
                for k, v in per.items():
                    why[k] = why.get(k, 0) + v
            print("%s %-5s %s inst %d %-11s busy %.3f hit %.4f ttft %5.1f idle(0 req) %d  <=3 req %d  seed %d spill %d"
                  % (tag, build, start, o["instances"], o["mode"], o["busy_spread"], o["hit_rate"],
                     o["ttft_mean_ms"], sum(1 for r in reqs if r == 0), sum(1 for r in reqs if r <= 3),
                     why.get("seed", 0), why.get("spill", 0)))
