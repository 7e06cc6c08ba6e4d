#!/usr/bin/env python3
"""Poll the learned prefill lines during a bench-e2e invocation (routing round 15).

usage: poll_lines.py BENCH_E2E_LOG OUT.jsonl

Follows bench-e2e's log; while a policy runs ("== POLICY" then its replay's
--url http://127.0.0.1:PORT), reads PORT's /kvroute/status once a second and
appends one line per poll: the policy, the time, and each server's
prefill_rate, prefill_base and requests. Stop it when bench-e2e ends. Its
requests show in the decisions log as "-" and route nothing.
"""
import json
import re
import sys
import time
import urllib.request


def main():
    log, out = sys.argv[1], sys.argv[2]
    with open(out, "a") as o:
        while True:
            runs = re.findall(r"== (\S+)\n.*?--url http://127.0.0.1:(\d+)", open(log).read(), re.S)
            if runs:
                policy, port = runs[-1]
                try:
                    url = "http://127.0.0.1:%s/kvroute/status" % port
                    ss = json.load(urllib.request.urlopen(url, timeout=1))
                    ss = ss["zones"]["kv"]["upstreams"]["llm"]
                    o.write(json.dumps({"p": policy, "t": time.time(),
                                        "r": [x["prefill_rate"] for x in ss],
                                        "b": [x["prefill_base"] for x in ss],
                                        "n": [x["requests"] for x in ss]}) + "\n")
                    o.flush()
                except (OSError, ValueError, KeyError):
                    pass
            time.sleep(1)


if __name__ == "__main__":
    main()
