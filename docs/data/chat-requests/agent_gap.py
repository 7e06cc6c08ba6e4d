"""Agent conversations with tools through nginx (events mode, 2 mock engines),
turns coming back after the router's 10 s pending window: the engine's
cached share of each follow-up prompt. KVROUTE_BUILD picks the build."""
import json, os, sys, time
TOP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..")
sys.path.insert(0, os.path.join(TOP, "t", "lib"))
sys.path.insert(0, os.path.join(TOP, "t", "integration"))
import kvt
import test_text_routing as T
from agent_overlap import conv  # noqa: E402 (the same conversations)

GAP = float(os.environ.get("GAP", "11"))
st = kvt.Stack("agent-gap")
try:
    ng, ports = T.setup(st)
    rows = []
    for turns in range(1, 6):
        for c in range(8):
            s, h, body, _ = kvt.post_json(ng.port, "/v1/chat/completions", conv(c, turns))
            assert s == 200, body
            rows.append((c, turns, body["usage"]["prompt_tokens"], int(h["x-kvroute-overlap"]),
                         body["usage"]["prompt_tokens_details"]["cached_tokens"], h["x-kvroute-worker"]))
        time.sleep(GAP)
    follow = [r for r in rows if r[1] > 1]
    print(json.dumps({"build": kvt.BUILD, "gap_s": GAP, "follow_turns": len(follow),
                      "prompt_tokens": sum(r[2] for r in follow),
                      "router_overlap_tokens": sum(16 * r[3] for r in follow),
                      "engine_cached_tokens": sum(r[4] for r in follow),
                      "moved_turns": sum(1 for r in follow if r[5] != [x for x in rows if x[0] == r[0] and x[1] == r[1] - 1][0][5]),
                      "rows": rows}))
finally:
    st.close()
