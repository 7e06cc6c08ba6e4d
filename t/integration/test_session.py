"""Session affinity through real nginx and real kvworker mock engines: an
operator's session value (kvroute session=$http_x_session_id), then OpenAI's
prompt_cache_key, then user keep a session's requests on its home server
while it is not saturated (docs/CONFIG.md, "Session affinity")."""
import concurrent.futures
import json
import zlib

import kvt

CONF = """
    kvroute_zone kv 16m;
    upstream llm {
        zone llm 64k;
        kvroute zone=kv %(params)s;
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
            kvroute_debug_headers on;
            add_header X-Why $kvroute_why always;
        }
        location = /kvroute/status { kvroute_status; }
    }
"""


def fleet(stack, n=4, params="session=$http_x_session_id", speedup=20):
    w = stack.worker(engines=n, extra=["--speedup", str(speedup)])
    servers = "\n".join("server 127.0.0.1:%d;" % p for p in w.ports)
    return stack.nginx(CONF % {"params": params, "servers": servers})


def unique(name, n=64):
    """n token ids no other name shares (no prefix overlap anywhere)."""
    h = zlib.crc32(name.encode())
    return [1000 + (h * 7 + i * 131) % 40000 for i in range(n)]


def send(port, name, max_tokens=2, header=None, **hints):
    """Streamed, so the first token ends the prefill nginx counts."""
    body = {"model": "kvroute-mock", "prompt": unique(name), "max_tokens": max_tokens,
            "stream": True}
    body.update(hints)
    s, h, _, data = kvt.post_json(port, "/v1/completions", body,
                                  headers={"X-Session-Id": header} if header else None)
    assert s == 200, data
    return h


def servers(port):
    s, _, body = kvt.request(port, "GET", "/kvroute/status")
    assert s == 200
    return json.loads(body)["zones"]["kv"]["upstreams"]["llm"]


def idle(port):
    kvt.wait_until(lambda: all(x["active_requests"] == 0 for x in servers(port)),
                   what="no request in flight")


def test_session_stays_home_and_sessions_spread(stack):
    """Every request of a session, each with a prompt nobody caches, goes to
    one server, named by the session alone; sessions spread."""
    ng = fleet(stack)
    homes = {}
    for sess in range(12):
        for turn in range(3):
            h = send(ng.port, "s%d-t%d" % (sess, turn), user="user-%d" % sess)
            assert h["x-why"] == "session"
            assert h["x-kvroute-overlap"] == "0"
            homes.setdefault(sess, h["x-kvroute-worker"])
            assert h["x-kvroute-worker"] == homes[sess]
    assert len(set(homes.values())) >= 2
    # without a session the same kind of request is placed by load
    h = send(ng.port, "nobody")
    assert h["x-why"] == "cold"


def test_precedence_header_then_cache_key_then_user(stack):
    ng = fleet(stack)
    for i in range(8):
        by_header = send(ng.port, "h%d" % i, header="H%d" % i)["x-kvroute-worker"]
        by_key = send(ng.port, "k%d" % i, prompt_cache_key="K%d" % i)["x-kvroute-worker"]
        by_user = send(ng.port, "u%d" % i, user="U%d" % i)["x-kvroute-worker"]
        # all three given: the header decides
        h = send(ng.port, "a%d" % i, header="H%d" % i, prompt_cache_key="K%d" % i,
                 user="U%d" % i)
        assert h["x-why"] == "session" and h["x-kvroute-worker"] == by_header
        # no header: prompt_cache_key before user
        h = send(ng.port, "b%d" % i, prompt_cache_key="K%d" % i, user="U%d" % i)
        assert h["x-kvroute-worker"] == by_key
        h = send(ng.port, "c%d" % i, user="U%d" % i)
        assert h["x-kvroute-worker"] == by_user
        # an empty header is no session: the body's hints decide
        h = send(ng.port, "d%d" % i, header="", user="U%d" % i)
        assert h["x-kvroute-worker"] == by_user


def test_session_off_ignores_hints(stack):
    ng = fleet(stack, params="session=off")
    h = send(ng.port, "x", user="someone", prompt_cache_key="k")
    assert h["x-why"] == "cold"


def test_prefix_index_comes_before_the_session(stack):
    """Approximate mode remembers where a prompt went: the same prompt sent
    again under another session goes where its prefix is, not home."""
    ng = fleet(stack, params="mode=approximate session=$http_x_session_id")
    first = send(ng.port, "doc", header="A")
    for sess in "BCDEFG":
        h = send(ng.port, "doc", header=sess)
        assert h["x-why"] == "sticky"
        assert h["x-kvroute-worker"] == first["x-kvroute-worker"]


def test_saturated_home_passes_the_session_on(stack):
    """Requests of one session held in flight on its home: once the home is
    above the load bound (1.25 x the mean + 1 requests), the session's next
    request goes to another server; with the load gone it is home again."""
    ng = fleet(stack, speedup=0.5)
    home = send(ng.port, "warm", header="S")["x-kvroute-worker"]
    idle(ng.port)
    # in flight and past its first byte (no prefill queued on the home)
    active = lambda: sum(x["active_requests"] for x in servers(ng.port)
                         if x["active_prefill_tokens"] == 0)
    with concurrent.futures.ThreadPoolExecutor(3) as ex:
        held = []
        for k in range(2):
            held.append(ex.submit(send, ng.port, "held%d" % k, 400, "S"))
            kvt.wait_until(lambda: active() == k + 1, what="request %d in flight" % k)
        # home has 2 of 2 in flight: mean 0.5, bound 1.625
        h = send(ng.port, "next", header="S")
        assert h["x-why"] == "session"
        assert h["x-kvroute-worker"] != home
        assert all(f.result()["x-kvroute-worker"] == home for f in held)
    idle(ng.port)
    assert send(ng.port, "later", header="S")["x-kvroute-worker"] == home


def test_a_body_without_a_prompt_keeps_its_session(stack):
    """A request whose prompt kvroute cannot read (here Responses API
    requests to an upstream with no tokenizer for their `input`: routed by
    load, no_tokenizer) still stays on its session's home by
    prompt_cache_key, so an agent's turns land where its KV is."""
    ng = fleet(stack, params="")
    homes = set()
    for i in range(4):
        s, h, _, _ = kvt.post_json(ng.port, "/v1/responses",
                                   {"model": "kvroute-mock", "input": "turn %d" % i,
                                    "prompt_cache_key": "conversation-7"})
        homes.add(h["x-kvroute-worker"])
        assert i == 0 or h["x-why"] == "session", h
    assert len(homes) == 1
    others = set()
    for k in range(12):
        s, h, _, _ = kvt.post_json(ng.port, "/v1/responses",
                                   {"model": "kvroute-mock", "input": "x",
                                    "prompt_cache_key": "conversation-%d" % k})
        others.add(h["x-kvroute-worker"])
    assert len(others) > 1
