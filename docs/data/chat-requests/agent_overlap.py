"""Agent conversations with tools through nginx in events mode: per turn,
the router's overlap against the prompt blocks the worker really had cached.
KVROUTE_BUILD picks the build (module + kvworker)."""
import json, os, sys, time
TOP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..")
sys.path.insert(0, os.path.join(TOP, "t", "lib"))
sys.path.insert(0, os.path.join(TOP, "t", "integration"))
import kvt
import test_text_routing as T

def conv(c, turns):
    body = T.agent_body(min(turns, 3))
    body["messages"][1]["content"] = "Conversation %d: check policy %d for water damage." % (c, 4400 + c)
    msgs = body["messages"]
    for k in range(3, turns):
        msgs += [{"role": "assistant", "content": None, "tool_calls": [{"id": "call_%d" % k, "type": "function",
                  "function": {"name": "lookup_policy_%d" % k, "arguments": "{\"policy\":\"%d\",\"holder\":\"H %d\"}" % (4400 + c, k)}}]},
                 {"role": "tool", "tool_call_id": "call_%d" % k, "content": "Clause %d: result %d." % (k, c)},
                 {"role": "user", "content": "Next step %d?" % k}]
    return body

def main():
    st = kvt.Stack("agent-overlap")
    try:
        ng, ports = T.setup(st)
        rows = []
        for c in range(6):
            for turns in range(1, 7):
                s, h, body, _ = kvt.post_json(ng.port, "/v1/chat/completions", conv(c, turns))
                assert s == 200, body
                p = body["usage"]["prompt_tokens"]
                cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
                rows.append((c, turns, p, int(h["x-kvroute-overlap"]), cached))
                srv = h["x-kvroute-worker"]
                kvt.wait_until(lambda: T.indexed(ng.port, srv) >= 1, what="indexed")
                time.sleep(0.3)     # events of this turn reach the index
        follow = [r for r in rows if r[1] > 1]
        print(json.dumps({"build": kvt.BUILD,
                          "follow_turns": len(follow),
                          "router_overlap_tokens": sum(16 * r[3] for r in follow),
                          "engine_cached_tokens": sum(r[4] for r in follow),
                          "prompt_tokens": sum(r[2] for r in follow),
                          "rows": rows}))
    finally:
        st.close()


if __name__ == "__main__":
    main()
