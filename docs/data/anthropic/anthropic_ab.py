"""Agent sessions over the Anthropic Messages API (/v1/messages), as Claude
Code sends them to a vLLM it is pointed at, through nginx in events mode.

4 kvworker mock engines with the Qwen2.5 tokenizer and chat template
(--speedup SPEEDUP). CONVS sessions of TURNS turns, CLIENTS at a time. Each
session has one of 4 system prompts (SYS_CHARS of prose) sent as Claude
Code sends it: a first text block "x-anthropic-billing-header: ...; cch=H"
with H new each request, then the prompt; the same 12 tools every request;
metadata.user_id naming the session. Turn 1 is a user task; each later turn
sends back the model's reply as an assistant message with a tool_use block,
then a user message with its tool_result (RESULT_CHARS of prose). THINK_MS:
a random pause before each turn. Streamed, max_tokens 24. KVROUTE_BUILD picks
the module build. Prints one JSON line: the engines' cached share of the
prompts (their own usage), TTFT mean/p50/p90 (ms), requests per engine.
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
TURNS = int(os.environ.get("TURNS", "8"))
CLIENTS = int(os.environ.get("CLIENTS", "12"))
SPEEDUP = os.environ.get("SPEEDUP", "1")
SYS_CHARS = int(os.environ.get("SYS_CHARS", "1200"))
RESULT_CHARS = int(os.environ.get("RESULT_CHARS", "2000"))
THINK_MS = float(os.environ.get("THINK_MS", "100"))


TOOLS = [{"name": "tool_%d" % i,
          "description": "Tool %d: reads or edits files of the repository by path." % i,
          "input_schema": {"type": "object", "required": ["path"],
                           "properties": {"path": {"type": "string"},
                                          "limit": {"type": "integer"}}}}
         for i in range(12)]


def stream(port, body):
    """(ttft s, reply text, usage, worker) of one streamed message"""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    t0 = time.monotonic()
    c.request("POST", "/v1/messages", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200, r.read()
    first, text, usage = None, [], None
    for line in r:
        if not line.startswith(b"data:"):
            continue
        ev = json.loads(line[5:])
        if ev["type"] == "content_block_delta":
            first = first if first is not None else time.monotonic() - t0
            text.append(ev["delta"]["text"])
        elif ev["type"] == "message_start":
            usage = ev["message"]["usage"]
    c.close()
    return first, "".join(text), usage, r.getheader("x-kvroute-worker")



def main():
    rng = random.Random(SEED)
    passage = passages(rng)

    systems = [passage(SYS_CHARS) for _ in range(4)]
    convs = [{"system": systems[rng.randrange(4)], "task": passage(400),
              "results": [passage(RESULT_CHARS) for _ in range(TURNS)]} for _ in range(CONVS)]
    st = kvt.Stack("anthropic-ab")
    rows, lock = [], threading.Lock()
    try:
        ng = fleet(st, SPEEDUP)
        todo = list(range(CONVS))

        def client():
            r = random.Random(SEED * 7 + threading.get_ident())
            while True:
                with lock:
                    if not todo:
                        return
                    k = todo.pop(0)
                conv = convs[k]
                history = [{"role": "user", "content": [{"type": "text", "text": conv["task"]}]}]
                for t in range(TURNS):
                    time.sleep(r.uniform(0, THINK_MS) / 1000)
                    billing = "x-anthropic-billing-header: cc_version=2.1.3; cch=%08x;" \
                        % r.getrandbits(32)
                    ttft, text, usage, wk = stream(ng.port, {
                        "model": "kvroute-mock", "max_tokens": 24, "stream": True,
                        "system": [{"type": "text", "text": billing},
                                   {"type": "text", "text": conv["system"],
                                    "cache_control": {"type": "ephemeral"}}],
                        "tools": TOOLS, "metadata": {"user_id": "user_x_session_%d" % k},
                        "messages": history})
                    call = "toolu_%d_%d" % (k, t)
                    history.append({"role": "assistant", "content": [
                        {"type": "text", "text": text or "."},
                        {"type": "tool_use", "id": call, "name": "tool_%d" % (t % 12),
                         "input": {"path": "src/file_%d.c" % t}}]})
                    history.append({"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": call,
                         "content": conv["results"][t]}]})
                    with lock:
                        rows.append((ttft * 1000, usage["input_tokens"],
                                     usage["cache_read_input_tokens"], wk))

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
            "turns": TURNS, "sys_chars": SYS_CHARS, "result_chars": RESULT_CHARS,
            "speedup": SPEEDUP, "think_ms": THINK_MS,
            "hit_rate": round(sum(r[2] for r in rows) / sum(r[1] for r in rows), 4),
            "prompt_tokens_mean": round(sum(r[1] for r in rows) / len(rows)),
            "ttft_mean": round(sum(ttft) / len(ttft), 1), "ttft_p50": round(pct(ttft, .5), 1),
            "ttft_p90": round(pct(ttft, .9), 1),
            "requests_per_engine": sorted(per.values())}))
        assert ng.alerts() == []
    finally:
        st.close()


main()
