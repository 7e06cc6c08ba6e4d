"""Conversations over the Responses API (/v1/responses), as agent clients
send them with vLLM (no stored responses: the history goes back in
`input` every turn), through nginx in events mode.

4 kvworker mock engines with the Qwen2.5 tokenizer and chat template
(--speedup SPEEDUP). CONVS conversations of TURNS turns, CLIENTS at a time:
each has one of 4 `instructions` (system prompts of ~1,000 tokens of
prose) and, each turn, a new user message of ~150 tokens of prose; the
model's reply goes back into the next turn's `input` as an assistant
message item; THINK_MS: a random pause before each turn (clients are not
in lockstep; without it a router that ignores the prompt can keep each
client on one engine by accident). Streamed, max_output_tokens 24. KVROUTE_BUILD picks the
module build (one that does not read /v1/responses routes them by load).
Prints one JSON line: the engines' cached share of the prompts (their own
usage), TTFT mean/p50/p90 (ms), requests per engine.
"""
import http.client
import json
import os
import random
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from convbench import fleet, passages, pct, kvt  # noqa: E402

SEED = int(os.environ.get("SEED", "1"))
CONVS = int(os.environ.get("CONVS", "48"))
TURNS = int(os.environ.get("TURNS", "6"))
CLIENTS = int(os.environ.get("CLIENTS", "8"))
SPEEDUP = os.environ.get("SPEEDUP", "2")
SYS_CHARS = int(os.environ.get("SYS_CHARS", "4500"))      # ~1,000 tokens
USER_CHARS = int(os.environ.get("USER_CHARS", "650"))     # ~150 tokens
THINK_MS = float(os.environ.get("THINK_MS", "0"))         # a pause of 0..THINK_MS between turns



def stream(port, body):
    """(ttft s, reply text, usage, worker) of one streamed Response"""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    t0 = time.monotonic()
    c.request("POST", "/v1/responses", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200, r.read()
    first, done = None, None
    for line in r:
        if not line.startswith(b"data:"):
            continue
        ev = json.loads(line[5:])
        if ev["type"] == "response.output_text.delta" and first is None:
            first = time.monotonic() - t0
        elif ev["type"] == "response.completed":
            done = ev["response"]
    c.close()
    text = done["output"][0]["content"][0]["text"] if done["output"] else ""
    return first, text, done["usage"], r.getheader("x-kvroute-worker")



def main():
    rng = random.Random(SEED)
    passage = passages(rng)

    systems = [passage(SYS_CHARS) for _ in range(4)]
    convs = [{"instructions": systems[rng.randrange(4)],
              "users": [passage(USER_CHARS) for _ in range(TURNS)]} for _ in range(CONVS)]
    st = kvt.Stack("responses-ab")
    rows, lock = [], threading.Lock()
    try:
        ng = fleet(st, SPEEDUP)
        todo = list(range(CONVS))

        def client():
            pause = random.Random(SEED * 7 + threading.get_ident())
            while True:
                with lock:
                    if not todo:
                        return
                    k = todo.pop(0)
                conv, history = convs[k], []
                for t in range(TURNS):
                    time.sleep(pause.uniform(0, THINK_MS) / 1000)
                    history.append({"role": "user", "content": conv["users"][t]})
                    ttft, text, usage, wk = stream(ng.port, {
                        "model": "kvroute-mock", "instructions": conv["instructions"],
                        "input": history, "max_output_tokens": 24, "stream": True})
                    history.append({"type": "message", "role": "assistant",
                                    "content": [{"type": "output_text", "text": text}]})
                    with lock:
                        rows.append((ttft * 1000, usage["input_tokens"],
                                     usage["input_tokens_details"]["cached_tokens"], wk))

        th = [threading.Thread(target=client) for _ in range(CLIENTS)]
        for t in th:
            t.start()
        for t in th:
            t.join()
        ttft = [r[0] for r in rows]
        per = {}
        for r in rows:
            per[r[3]] = per.get(r[3], 0) + 1
        print(json.dumps({
            "build": kvt.BUILD, "seed": SEED, "requests": len(rows), "clients": CLIENTS,
            "turns": TURNS, "sys_chars": SYS_CHARS, "user_chars": USER_CHARS, "speedup": SPEEDUP, "think_ms": THINK_MS,
            "hit_rate": round(sum(r[2] for r in rows) / sum(r[1] for r in rows), 4),
            "ttft_mean": round(sum(ttft) / len(ttft), 1), "ttft_p50": round(pct(ttft, .5), 1),
            "ttft_p90": round(pct(ttft, .9), 1),
            "requests_per_engine": sorted(per.values())}))
        assert ng.alerts() == []
    finally:
        st.close()


main()
