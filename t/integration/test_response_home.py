"""A Responses API request that continues a response (previous_response_id)
goes back to the engine that made it: vLLM keeps responses in the process
that made them (its store, when turned on) and any other engine answers 404.
kvroute reads each response's id as it streams past and keeps which server
made it in the zone (kvroute_zone responses=, docs/CONFIG.md, "Continued
responses"). Real nginx (two worker processes sharing the zone) and real
kvworker mock engines keeping their responses (--responses-store)."""
import json

import kvt

CONF = """
    kvroute_zone kv 16m %(zone)s;
    upstream llm {
        zone llm 64k;
        kvroute zone=kv;
        %(servers)s
    }
    server {
        listen 127.0.0.1:%%(port)s;
        location /v1/ {
            kvroute_upstream llm;
            proxy_pass http://llm;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_next_upstream error timeout;
            kvroute_debug_headers on;
            add_header X-Why $kvroute_why always;
        }
        location = /kvroute/status { kvroute_status; }
    }
"""

STORE = ["--responses-store", "64", "--speedup", "20"]


def start(stack, workers, zone=""):
    servers = "\n".join("server 127.0.0.1:%d max_fails=1;" % p
                        for w in workers for p in w.ports)
    return stack.nginx(CONF % {"zone": zone, "servers": servers})


def respond(port, text, previous=None, stream=False):
    """(status, the server that answered, why, the response's id or error)."""
    body = {"model": "kvroute-mock", "input": text, "max_output_tokens": 3, "stream": stream}
    if previous:
        body["previous_response_id"] = previous
    s, h, parsed, raw = kvt.post_json(port, "/v1/responses", body)
    if s != 200:
        return s, h.get("x-kvroute-worker"), h.get("x-why"), parsed
    if stream:
        first = json.loads(kvt.sse_events(raw)[0])
        assert first["type"] == "response.created", raw
        rid = first["response"]["id"]
    else:
        rid = parsed["id"]
    return s, h["x-kvroute-worker"], h["x-why"], rid


def responses_status(port):
    s, _, body = kvt.request(port, "GET", "/kvroute/status")
    assert s == 200
    return json.loads(body)["zones"]["kv"]["responses"]


def test_a_conversation_stays_on_the_engine_holding_it(stack):
    """Six turns, streamed and not, each continuing the one before: every
    one is served (none is a 404) by the engine that made the first."""
    ng = start(stack, [stack.worker(engines=4, extra=STORE)])
    s, home, _, rid = respond(ng.port, "Tell me about the sea.")
    assert s == 200
    for turn in range(1, 6):
        s, server, why, rid = respond(ng.port, "And then? (%d)" % turn, previous=rid,
                                      stream=turn % 2 == 1)
        assert s == 200, rid
        assert (server, why) == (home, "response")
    st = responses_status(ng.port)
    assert st["stored"] >= 6 and st["hits"] >= 5 and st["capacity"] >= 65536, st


def test_many_conversations_each_on_its_own_engine(stack):
    """Conversations started by load spread over the engines, and each one's
    turns follow it wherever it started."""
    ng = start(stack, [stack.worker(engines=4, extra=STORE)])
    homes = {}
    last = {}
    for c in range(8):
        s, homes[c], _, last[c] = respond(ng.port, "conversation %d begins" % c)
        assert s == 200
    for turn in range(2):
        for c in range(8):
            s, server, why, last[c] = respond(ng.port, "turn %d of %d" % (turn, c),
                                              previous=last[c])
            assert (s, server, why) == (200, homes[c], "response"), last[c]
    assert len(set(homes.values())) >= 2


def test_without_the_map_continuations_miss(stack):
    """responses=0: a continuation is routed as any request, and the engine
    that did not make the response answers 404, as vLLM does: what the map
    is for."""
    ng = start(stack, [stack.worker(engines=4, extra=STORE)], zone="responses=0")
    statuses = []
    for c in range(12):
        s, _, _, rid = respond(ng.port, "conversation %d" % c)
        assert s == 200
        s, _, why, err = respond(ng.port, "and?", previous=rid)
        assert why != "response"
        if s == 404:
            assert "not found" in err["error"]["message"], err
        statuses.append(s)
    assert 404 in statuses and 200 in statuses


def test_a_dead_home_leaves_the_engines_own_error(stack):
    """The engine holding the response is gone: the continuation is routed
    by the policy and answered by a live engine (its 404: the response is
    lost with its engine), never a hang or a gateway error; new
    conversations go on."""
    workers = [stack.worker(extra=STORE, wait=False) for _ in range(3)]
    stack.ready(*workers)
    ng = start(stack, workers)
    s, home, _, rid = respond(ng.port, "A conversation whose engine dies.")
    assert s == 200
    dead = next(w for w in workers if "127.0.0.1:%d" % w.ports[0] == home)
    kvt._kill(dead)
    s, server, why, err = respond(ng.port, "still there?", previous=rid)
    assert s == 404 and server != home and why != "response", (s, server, why, err)
    s, server, _, rid = respond(ng.port, "A new conversation.")
    assert s == 200 and server != home
    s, again, why, _ = respond(ng.port, "and on", previous=rid)
    assert (s, again, why) == (200, server, "response")
