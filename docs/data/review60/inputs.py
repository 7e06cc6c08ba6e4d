"""Inputs for the stop-60 review figures (docs/BENCHMARKS.md, "Stop 60: what a
code review's fixes changed"): python3 inputs.py DIR writes them to DIR."""
import json
import os
import sys

out = sys.argv[1]
os.makedirs(out, exist_ok=True)


def dump(name, obj):
    with open(os.path.join(out, name), "w") as f:
        json.dump(obj, f, separators=(",", ":"))


# one message with 80,000 extra keys (1 MB): pairwise duplicate-key checks
m = {"role": "user", "content": "hi"}
m.update({"k%07d" % i: 0 for i in range(80000)})
dump("wide_message.json", {"messages": [m]})
# 30,000 system messages: DeepSeek-V3's template appends each to one string
dump("many_system.json", {"messages": [{"role": "system", "content": "x"}] * 30000
                          + [{"role": "user", "content": "hi"}]})
# 15,000 tools: SmolLM3's template appends each to one string
dump("many_tools.json", {"messages": [{"role": "user", "content": "hi"}],
                         "tools": [{"type": "function", "function": {"name": "f%d" % i}}
                                   for i in range(15000)]})
# 4 MB of "<" and of "<|": every position starts one of SmolLM3's 256 added tokens
with open(os.path.join(out, "lt.txt"), "w") as f:
    f.write("<" * (4 << 20))
with open(os.path.join(out, "ltbar.txt"), "w") as f:
    f.write("<|" * (2 << 20))
