"""The KV-aware balancer: real nginx + the module, real kvworker mock engines."""
import concurrent.futures
import json
import os
import signal
import zlib

import pytest

import kvt

CONF = """
    kvroute_zone kv 16m;
    upstream llm {
        zone llm 64k;
        kvroute zone=kv %(params)s;
        %(servers)s
        keepalive 8;
    }
    log_format kv '$kvroute_worker $kvroute_overlap_blocks $kvroute_prompt_blocks '
                  '$kvroute_prompt_tokens $kvroute_decision_us "$kvroute_fallback" '
                  '$http_x_case';
    server {
        listen 127.0.0.1:%%(port)s;
        client_body_buffer_size 1m;
        client_max_body_size 8m;
        location /v1/ {
            access_log %(log)s kv;
            kvroute_upstream llm;
            proxy_pass http://llm;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            kvroute_debug_headers on;
            %(loc)s
        }
        location = /kvroute/status { kvroute_status; }
    }
"""


def conf(stack, ports, params="", loc="", servers=None):
    servers = servers or "\n".join("server 127.0.0.1:%d;" % p for p in ports)
    return CONF % {"params": params, "servers": servers, "loc": loc,
                   "log": os.path.join(stack.dir, "kv.log")}


def ids(prefix, n, base=1000):
    """n token ids; the same prefix name gives the same ids."""
    h = zlib.crc32(prefix.encode()) % 10000
    return [base + (h * 31 + i) % 30000 for i in range(n)]


def complete(port, prompt, max_tokens=2, **extra):
    body = {"model": "kvroute-mock", "prompt": prompt, "max_tokens": max_tokens}
    body.update(extra)
    return kvt.post_json(port, "/v1/completions", body)


def status(port):
    s, _, body = kvt.request(port, "GET", "/kvroute/status")
    assert s == 200
    return json.loads(body)


def fleet(stack, n=4, params="", loc="", extra=(), speedup=20):
    w = stack.worker(engines=n, extra=["--speedup", str(speedup)] + list(extra))
    ng = stack.nginx(conf(stack, w.ports, params, loc))
    return ng, w.ports


def test_shared_prefix_sticks(stack):
    ng, ports = fleet(stack)
    first = {}
    for doc in range(6):
        base = ids("doc%d" % doc, 256)
        s, h, body, _ = complete(ng.port, base + [7, 8, 9])
        assert s == 200, body
        first[doc] = h["x-kvroute-worker"]
        assert h["x-kvroute-overlap"] == "0"
    # approximate mode remembers each decision: follow-ups with the same
    # 256-token prefix (16 blocks) go where the prefix went
    for doc in range(6):
        base = ids("doc%d" % doc, 256)
        for q in range(3):
            s, h, body, _ = complete(ng.port, base + [100 + q] * 20)
            assert s == 200
            assert h["x-kvroute-worker"] == first[doc]
            assert int(h["x-kvroute-overlap"]) == 16
    st = status(ng.port)["zones"]["kv"]
    assert st["mode"] == "approximate"
    servers = st["upstreams"]["llm"]
    assert sum(s["requests"] for s in servers) == 24
    assert sum(s["overlap_hits"] for s in servers) == 18
    # an attempt's load is released when nginx finalizes it, just after
    # the client has the last byte
    kvt.wait_until(lambda: all(s["active_requests"] == 0 and s["active_prefill_tokens"] == 0
                               and s["active_decode_blocks"] == 0
                               for s in status(ng.port)["zones"]["kv"]["upstreams"]["llm"]),
                   what="load released")
    assert ng.alerts() == []


def test_fresh_prompts_spread_by_load(stack):
    ng, ports = fleet(stack)
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        res = list(ex.map(lambda i: complete(ng.port, ids("u%d" % i, 64), max_tokens=30),
                          range(16)))
    used = {h["x-kvroute-worker"] for s, h, _, _ in res}
    assert all(s == 200 for s, _, _, _ in res)
    assert len(used) >= 3


def test_load_pushes_away_from_saturated_holder(stack):
    """A prefix holder made busy loses the prefix's next request (Dynamo's
    cost, where the blocks held by decoding requests weigh against overlap;
    the TTFT policy's saturation rules are in t/unit/test_route.c)."""
    ng, ports = fleet(stack, n=2, params="policy=dynamo")
    long_prefix = ids("long", 4096)              # 256 blocks
    s, h, _, _ = complete(ng.port, long_prefix)
    holder = h["x-kvroute-worker"]
    other = [p for p in ("127.0.0.1:%d" % q for q in ports) if p != holder][0]
    # a short prefix (4 blocks) that also lives on the holder
    for i in range(40):
        probe = ids("probe%d" % i, 64)
        s, h, _, _ = complete(ng.port, probe)
        if h["x-kvroute-worker"] == holder:
            break
    assert h["x-kvroute-worker"] == holder
    # requests pinned to the holder by the long prefix keep it busy
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        futs = [ex.submit(complete, ng.port, long_prefix + ids("t%d" % i, 32), 800)
                for i in range(2)]
        def holder_busy():
            st = status(ng.port)["zones"]["kv"]["upstreams"]["llm"]
            busy = {x["server"]: x["active_decode_blocks"] for x in st}
            return busy[holder] > 256
        kvt.wait_until(holder_busy, what="the holder busy with the pinned requests")
        s, h, _, _ = complete(ng.port, probe + [5] * 16)
        assert h["x-kvroute-worker"] == other
        assert h["x-kvroute-overlap"] == "0"
        for f in futs:
            assert f.result()[0] == 200
    # both now hold the short prefix (approximate mode recorded the detour)
    s, h, _, _ = complete(ng.port, probe + [6] * 16)
    assert h["x-kvroute-overlap"] == "4"


def test_sse_passes_through_byte_for_byte(stack):
    w = stack.worker(engines=1, extra=["--speedup", "20"])
    ng = stack.nginx(conf(stack, w.ports))
    body = {"model": "kvroute-mock", "prompt": ids("sse", 40), "max_tokens": 12,
            "stream": True, "seed": 1}
    s1, h1, via = kvt.request(ng.port, "POST", "/v1/completions", body)
    s2, h2, direct = kvt.request(w.ports[0], "POST", "/v1/completions", body)
    assert s1 == s2 == 200
    strip = lambda b: [json.loads(e) if e != "[DONE]" else e for e in kvt.sse_events(b)]
    a, b = strip(via), strip(direct)
    assert len(a) == len(b) and a[-1] == "[DONE]"
    # ids and timestamps differ per request; the token text must not
    text = lambda evs: "".join(e["choices"][0]["text"] for e in evs
                               if e != "[DONE]" and e.get("choices"))
    assert text(a) == text(b)
    assert via.count(b"data: ") == direct.count(b"data: ")


def test_fallbacks_route_by_load(stack):
    ng, ports = fleet(stack, n=2)
    cases = [
        ("not json", b"{nope", "parse_error"),
        ("no prompt", json.dumps({"model": "m"}).encode(), "no_prompt"),
        ("text, no tokenizer", json.dumps({"prompt": "hello"}).encode(), "no_tokenizer"),
        ("chat, no template", json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(),
         "no_tokenizer"),
    ]
    for i, (what, body, reason) in enumerate(cases):
        s, h, data = kvt.request(ng.port, "POST", "/v1/completions", body,
                                 headers={"X-Case": str(i)})
        assert s in (200, 400), (what, s, data)      # the worker's answer, never nginx's 5xx
        assert "x-kvroute-worker" in h, what
    path = os.path.join(stack.dir, "kv.log")
    kvt.wait_until(lambda: len(open(path).read().splitlines()) == len(cases), what="log lines")
    with open(path) as f:
        lines = f.read().splitlines()
    # two nginx workers each log after sending the response: lines may come in
    # either order, so each names its case
    reasons = {int(l.rsplit(" ", 1)[1]): l.split('"')[1] for l in lines}
    assert reasons == {i: c[2] for i, c in enumerate(cases)}
    fb = status(ng.port)["zones"]["kv"]["fallbacks"]
    assert fb["parse_error"] == 1 and fb["no_prompt"] == 1 and fb["no_tokenizer"] == 2


def test_oversized_body_is_413_not_a_crash(stack):
    ng, ports = fleet(stack, n=2)
    big = json.dumps({"prompt": list(range(2_000_000))}).encode()     # ~15 MB > 8m
    s, h, data = kvt.request(ng.port, "POST", "/v1/completions", big)
    assert s == 413
    # a body over client_body_buffer_size (1m) goes to a temp file and still routes
    body = {"model": "kvroute-mock", "prompt": ids("file", 200000), "max_tokens": 1}
    s, h, data = kvt.request(ng.port, "POST", "/v1/completions", body)
    assert s == 200
    assert h["x-kvroute-worker"]
    assert ng.alerts() == []


def test_variables_in_access_log(stack):
    ng, ports = fleet(stack, n=2)
    complete(ng.port, ids("v", 100))
    path = os.path.join(stack.dir, "kv.log")
    # the access log line is written after the response has gone out
    line = kvt.wait_until(lambda: os.path.exists(path) and open(path).read().strip(),
                          what="access log line")
    worker, overlap, blocks, tokens, us, fb, case = line.split()
    assert worker in ("127.0.0.1:%d" % p for p in ports)
    assert (overlap, blocks, tokens, fb, case) == ("0", "6", "100", '""', "-")
    assert int(us) >= 0     # a duration: how long is a benchmark figure, not a test's


def test_weight_and_down(stack):
    w = stack.worker(engines=3, extra=["--speedup", "20"])
    a, b, c = w.ports
    servers = ("server 127.0.0.1:%d weight=3; server 127.0.0.1:%d; server 127.0.0.1:%d down;"
               % (a, b, c))
    ng = stack.nginx(conf(stack, w.ports, servers=servers))
    with concurrent.futures.ThreadPoolExecutor(12) as ex:
        res = list(ex.map(lambda i: complete(ng.port, ids("w%d" % i, 160), max_tokens=40),
                          range(24)))
    count = {}
    for s, h, _, _ in res:
        assert s == 200
        count[h["x-kvroute-worker"]] = count.get(h["x-kvroute-worker"], 0) + 1
    assert "127.0.0.1:%d" % c not in count
    assert count.get("127.0.0.1:%d" % a, 0) > count.get("127.0.0.1:%d" % b, 0)


def test_retry_goes_to_next_best(stack):
    w = stack.worker(engines=1, extra=["--speedup", "20"])
    dead = kvt.free_port()
    servers = "server 127.0.0.1:%d; server 127.0.0.1:%d;" % (dead, w.ports[0])
    ng = stack.nginx(conf(stack, w.ports, servers=servers))

    def sent_to_dead():
        for x in status(ng.port)["zones"]["kv"]["upstreams"]["llm"]:
            if x["server"] == "127.0.0.1:%d" % dead:
                return x["requests"]
        raise KeyError(dead)
    # cold prefixes: each picks either server, so within a few one picks
    # the dead one; its attempt fails and the retry lands on the live one
    for i in range(20):
        s, h, body, _ = complete(ng.port, ids("r%d" % i, 48))
        assert s == 200
        assert h["x-kvroute-worker"] == "127.0.0.1:%d" % w.ports[0]
        if sent_to_dead():
            break
    # one attempt only: max_fails=1 took the dead server out for fail_timeout
    assert sent_to_dead() == 1
    for i in range(4):
        s, h, body, _ = complete(ng.port, ids("r2-%d" % i, 48))
        assert s == 200 and h["x-kvroute-worker"] == "127.0.0.1:%d" % w.ports[0]
    assert sent_to_dead() == 1
    # released when nginx finalizes each attempt, just after the client has the reply
    kvt.wait_until(lambda: all(x["active_requests"] == 0 for x in
                               status(ng.port)["zones"]["kv"]["upstreams"]["llm"]),
                   what="load released")


def test_all_busy_gives_503_with_retry_after(stack):
    ng, ports = fleet(stack, n=2, params="busy_decode_blocks=10 retry_after=7", speedup=2)
    def busy(servers):
        return lambda: sum(x["active_decode_blocks"] >= 10 for x in
                           status(ng.port)["zones"]["kv"]["upstreams"]["llm"]) >= servers

    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        # one after the other: two decisions made at the same instant both
        # see two idle servers, and a cold prefix's hash order may pick the
        # same one for both (load is counted once a decision is made)
        futs = [ex.submit(complete, ng.port, ids("b0", 400), 300)]
        kvt.wait_until(busy(1), what="one worker past busy_decode_blocks")
        futs.append(ex.submit(complete, ng.port, ids("b1", 400), 300))
        kvt.wait_until(busy(2), what="both workers past busy_decode_blocks")
        s, h, data = kvt.request(ng.port, "POST", "/v1/completions",
                                 {"prompt": ids("x", 32), "max_tokens": 1})
        assert s == 503
        assert h["retry-after"] == "7"
        for f in futs:
            assert f.result()[0] == 200
    s, h, data = kvt.request(ng.port, "POST", "/v1/completions",
                             {"prompt": ids("x", 32), "max_tokens": 1})
    assert s == 200
    assert status(ng.port)["zones"]["kv"]["busy_rejects"] == 1


def test_client_abort_releases_load(stack):
    """Clients that leave mid-stream: each request is cancelled in its
    worker and its load released in nginx. The generations are long (they
    would run for minutes), so only the aborts can end them."""
    ng, ports = fleet(stack, n=2)
    import socket
    body = json.dumps({"prompt": ids("abort", 300), "max_tokens": 100000, "stream": True,
                       "ignore_eos": True})
    for _ in range(3):
        sk = socket.create_connection(("127.0.0.1", ng.port))
        sk.sendall(("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    "Content-Length: %d\r\n\r\n%s" % (len(body), body)).encode())
        sk.recv(100)
        sk.close()
    def idle():
        st = status(ng.port)["zones"]["kv"]["upstreams"]["llm"]
        return all(x["active_requests"] == 0 and x["active_decode_blocks"] == 0 for x in st)
    kvt.wait_until(idle, what="load released after client aborts")

    def cancelled():
        n = 0
        for p in ports:
            _, _, m = kvt.request(p, "GET", "/metrics")
            for line in m.decode().splitlines():
                if line.startswith("kvworker_requests_cancelled_total"):
                    n += float(line.rsplit(" ", 1)[1])
        return n
    kvt.wait_until(lambda: cancelled() == 3, what="the three generations cancelled")


def test_reload_under_load_keeps_index_and_counts(stack):
    ng, ports = fleet(stack, n=2)
    base = ids("reload", 160)
    s, h, _, _ = complete(ng.port, base)
    holder = h["x-kvroute-worker"]
    with concurrent.futures.ThreadPoolExecutor(6) as ex:
        futs = [ex.submit(complete, ng.port, ids("rl%d" % i, 200), 150) for i in range(6)]
        kvt.wait_until(lambda: sum(x["active_requests"] for x in
                                   status(ng.port)["zones"]["kv"]["upstreams"]["llm"]) > 0,
                       what="requests in flight")
        ng.reload()
        for f in futs:
            assert f.result()[0] == 200
    s, h, _, _ = complete(ng.port, base + [1])
    assert h["x-kvroute-worker"] == holder and h["x-kvroute-overlap"] == "10"
    def idle():
        st = status(ng.port)["zones"]["kv"]["upstreams"]["llm"]
        return all(x["active_requests"] == 0 and x["active_prefill_tokens"] == 0
                   and x["active_decode_blocks"] == 0 for x in st)
    kvt.wait_until(idle, what="no leaked load after reload")
    assert ng.alerts() == []


def test_killed_worker_process_load_is_reclaimed(stack):
    ng, ports = fleet(stack, n=2, speedup=2)
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        futs = [ex.submit(complete, ng.port, ids("k%d" % i, 200), 400) for i in range(4)]
        kvt.wait_until(lambda: sum(x["active_requests"] for x in
                                   status(ng.port)["zones"]["kv"]["upstreams"]["llm"]) > 0,
                       what="requests in flight")
        # SIGKILL every nginx worker process: the master starts new ones
        import subprocess
        pids = subprocess.run(["pgrep", "-P", str(ng.proc.pid)], capture_output=True,
                              text=True).stdout.split()
        for p in pids:
            os.kill(int(p), signal.SIGKILL)
        for f in futs:
            try:
                f.result()      # the killed processes' connections drop
            except Exception:
                pass
    def idle():
        try:
            st = status(ng.port)["zones"]["kv"]
        except Exception:
            return False
        return all(x["active_requests"] == 0 for x in st["upstreams"]["llm"]) and st["load_rows_reaped"] >= 1
    kvt.wait_until(idle, what="dead workers' load reclaimed")


def test_prometheus_status(stack):
    ng, ports = fleet(stack, n=2)
    complete(ng.port, ids("p", 64))
    s, h, body = kvt.request(ng.port, "GET", "/kvroute/status?format=prometheus")
    assert s == 200 and h["content-type"].startswith("text/plain")
    text = body.decode()
    assert 'kvroute_requests_total{zone="kv"} 1' in text
    assert 'kvroute_decision_seconds_count{zone="kv"} 1' in text
    assert "kvroute_server_active_requests{upstream=\"llm\"" in text


@pytest.mark.parametrize("params,needle", [
    ("zone=nope", 'uses zone=nope but there is no "kvroute_zone nope SIZE;"'),
    ("temperature=-1", 'invalid parameter "temperature=-1"'),
    ("block_size=0", 'invalid parameter "block_size=0"'),
    ("mode=fast", 'invalid "mode=fast"'),
    ("mode=events", "has mode=events but no kvroute_events"),
    ("tokenizer=/nonexistent/tokenizer.json", "tokenizer=/nonexistent/tokenizer.json"),
    ("bogus=1", 'invalid parameter "bogus=1"'),
])
def test_nginx_t_rejects_bad_config(stack, params, needle):
    text = conf(stack, [1], params).replace("kvroute zone=kv ", "kvroute ")
    if "zone=" not in params:
        text = text.replace("kvroute ", "kvroute zone=kv ", 1).replace("kvroute_zone kv", "kvroute_zone kv", 1)
    n = kvt.Nginx(stack, text, "", kvt.free_port(), 1)
    ok, out = n.check()
    assert not ok
    assert needle in out, out


def test_zone_too_small_and_worker_id_mismatch(stack):
    n = kvt.Nginx(stack, conf(stack, [1]).replace("kvroute_zone kv 16m", "kvroute_zone kv 64k"),
                  "", kvt.free_port(), 1)
    ok, out = n.check()
    assert not ok and 'kvroute_zone "kv" is too small' in out
    text = conf(stack, [1]).replace("keepalive 8;", "kvroute_worker_id 42 127.0.0.1:9; keepalive 8;")
    n = kvt.Nginx(stack, text, "", kvt.free_port(), 1)
    ok, out = n.check()
    assert not ok and "kvroute_worker_id 42 127.0.0.1:9: no such server" in out


def test_temperature_spreads_and_zero_does_not(stack):
    for params, expect_spread in (("policy=dynamo temperature=0", False),
                                  ("policy=dynamo temperature=50", True)):
        w = stack.worker(engines=3, extra=["--speedup", "50"])
        ng = stack.nginx(conf(stack, w.ports, params))
        base = ids("temp" + params, 160)
        seen = set()
        for i in range(24):
            s, h, _, _ = complete(ng.port, base + [i], max_tokens=1)
            assert s == 200
            seen.add(h["x-kvroute-worker"])
        assert (len(seen) > 1) == expect_spread, (params, seen)


def load_while_held(stack, path, body):
    """The server's active (prefill tokens, decode blocks, decode tokens) while
    a stand-in server holds the request before answering; checks the request
    then succeeds and its load is all released."""
    from test_disagg_nginx import Decode
    held = Decode()
    try:
        held.mode = "hold"
        ng = stack.nginx(conf(stack, [], servers="server %s;" % held.addr).replace(
            "location /v1/ {", "location / {"))

        def active():
            st = status(ng.port)["zones"]["kv"]["upstreams"]["llm"][0]
            return (st["active_prefill_tokens"], st["active_decode_blocks"],
                    st["active_decode_tokens"])

        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            fut = ex.submit(kvt.post_json, ng.port, path, body)
            kvt.wait_until(held.arrived.is_set, what="the request at the server")
            seen = active()
            held.gate.set()
            assert fut.result()[0] == 200
        kvt.wait_until(lambda: active() == (0, 0, 0), what="load released")
        assert ng.alerts() == []
        ng.stop()
        return seen
    finally:
        held.close()


def test_n_sequences_count_in_decode_load(stack):
    """A request for n completions (RL rollouts ask 8-16) makes the server
    decode n sequences: its decode load is max_tokens times n, the larger of
    n and best_of, while it runs, and released after."""
    assert load_while_held(stack, "/v1/completions", {
        "prompt": ids("n", 64), "max_tokens": 50, "n": 4, "best_of": 6})[2] == 300


def test_batch_of_prompts_counts_every_prompt(stack):
    """A completion request with a batch of prompts (evaluation harnesses
    send 8-64 at once) is routed by its first prompt, but the server
    prefills every prompt and decodes n sequences of each: the prefill load
    holds each prompt's part past its common prefix with the first, the
    decode load max_tokens x n x prompts; all released after."""
    first = ids("batch", 64)
    batch = [first, first[:32] + ids("other", 32), ids("third", 48)]
    # 64 + 32 + 48 tokens; 4 blocks + 80 tokens' 5; 50 x 2 x 3
    assert load_while_held(stack, "/v1/completions",
                           {"prompt": batch, "max_tokens": 50, "n": 2}) == (144, 9, 300)


def test_embeddings_route_on_their_input_and_decode_nothing(stack):
    """vLLM serves embeddings beside completions on one port, so one kvroute
    location fronts both. An embeddings request's `input` (one prompt, a
    batch, token ids) is its prompt: it routes on its blocks like a
    completion's, and the server decodes nothing for it, so no output
    tokens are counted (they were: the default max_tokens, 256, for every
    embedding, and the `input` was read as a Responses API conversation).
    On a path kvroute does not know, `encoding_format` (the openai client
    always sends it) says the same. A score counts its bytes as prefill, a
    tokenize nothing."""
    ports = kvt.free_ports(2)
    text = conf(stack, [], servers="\n".join("server 127.0.0.1:%d;" % p for p in ports))
    text = text.replace("location /v1/ {", "location / {") + kvt.canned_servers(
        ports, '{"object":"list","data":[]}')
    ng = stack.nginx(text)

    def embed(path, body):
        s, h, _, raw = kvt.post_json(ng.port, path, body)
        assert s == 200, raw
        return h["x-kvroute-worker"], int(h["x-kvroute-overlap"])

    doc = ids("document", 128)
    w, overlap = embed("/v1/embeddings", {"model": "m", "input": [doc + ids("chunk1", 16)]})
    assert overlap == 0
    # the next chunk of the same document shares its 8 blocks: same server
    assert embed("/v1/embeddings", {"model": "m", "input": doc + ids("chunk2", 16)}) == (w, 8)
    assert embed("/rewritten/embed", {"input": doc, "encoding_format": "float"}) == (w, 8)
    assert ng.alerts() == []
    ng.stop()
    assert load_while_held(stack, "/v1/embeddings", {"model": "m", "input": ids("e", 64)}) \
        == (64, 4, 0)
    # a batch of inputs: each one past its common prefix with the first
    assert load_while_held(stack, "/v1/embeddings", {
        "input": [ids("e", 64), ids("e", 32) + ids("f", 32)], "max_tokens": 9}) == (96, 6, 0)
    assert load_while_held(stack, "/elsewhere", {
        "input": ids("e", 64), "encoding_format": "base64"}) == (64, 4, 0)
    score = {"model": "m", "query": "q" * 40, "documents": ["d" * 100, "e" * 100]}
    active = load_while_held(stack, "/v1/rerank", score)
    assert active[2] == 0 and active[0] == (len(json.dumps(score)) + 3) // 4
    assert load_while_held(stack, "/tokenize", {"prompt": ids("t", 64)}) == (0, 0, 0)



class ResponsesStream:
    """A vLLM Responses API stream stand-in: response.created and
    response.in_progress at once (vLLM sends them before the engine has the
    request), then, once `gate` is set, the first output events."""

    def __init__(self):
        import http.server
        import threading
        self.gate = threading.Event()
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()

                def event(kind, **data):
                    data["type"] = kind
                    self.wfile.write(("event: %s\ndata: %s\n\n"
                                      % (kind, json.dumps(data))).encode())
                    self.wfile.flush()
                event("response.created", response={"status": "in_progress", "output": []})
                event("response.in_progress", response={"status": "in_progress"})
                outer.gate.wait(60)
                event("response.output_item.added", item={"type": "message"})
                event("response.output_text.delta", delta="ok")
                event("response.completed", response={"status": "completed"})

        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.addr = "127.0.0.1:%d" % self.srv.server_address[1]
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def close(self):
        self.gate.set()
        self.srv.shutdown()
        self.srv.server_close()


def test_responses_stream_prefill_ends_past_its_preamble(stack):
    """vLLM's Responses API stream opens with response.created and
    response.in_progress before the engine runs: the prefill load used to be
    released (and a prefill rate learned) at that first byte, a few ms after
    the request whatever its prompt. It is now held until the first event
    past them."""
    import http.client
    qwen = os.path.join(kvt.TOP, "conf", "tokenizers", "qwen2.5-instruct")
    srv = ResponsesStream()
    try:
        ng = stack.nginx(conf(stack, [], servers="server %s;" % srv.addr,
                              params="tokenizer=%s/tokenizer.json chat_template=%s/"
                                     "tokenizer_config.json" % (qwen, qwen)))

        def active():
            st = status(ng.port)["zones"]["kv"]["upstreams"]["llm"][0]
            return st["active_prefill_tokens"], st["prefill_rate"]

        c = http.client.HTTPConnection("127.0.0.1", ng.port, timeout=30)
        c.request("POST", "/v1/responses", json.dumps({
            "model": "m", "stream": True, "instructions": "Answer briefly. " * 40,
            "input": "What is the capital of France?"}), {"Content-Type": "application/json"})
        r = c.getresponse()
        assert r.status == 200
        seen = []
        while len(seen) < 2:
            line = r.readline()
            if line.startswith(b"event:"):
                seen.append(line.split()[1])
        assert seen == [b"response.created", b"response.in_progress"]
        held, rate = active()
        assert held > 100 and rate == 0         # the prompt is still being prefilled
        srv.gate.set()
        assert b"response.completed" in r.read()
        c.close()
        kvt.wait_until(lambda: active()[0] == 0, what="prefill released")
        assert active()[1] > 0                  # one sample, at the first output event
        assert ng.alerts() == []
    finally:
        srv.close()

def test_all_busy_counts_a_failed_server_as_down(stack):
    """busy_*: the 503 when every server that is up is busy. A server failed
    out (max_fails) counted as up and idle, so the 503 never came while the
    live one was driven past its threshold."""
    w = stack.worker(engines=1, extra=["--speedup", "2"])
    dead = kvt.free_port()
    servers = ("server 127.0.0.1:%d max_fails=1 fail_timeout=600s;\n"
               "server 127.0.0.1:%d;" % (dead, w.ports[0]))
    ng = stack.nginx(conf(stack, w.ports, params="busy_decode_blocks=10", servers=servers))
    # two new prefixes: the second goes to the server holding nothing (the
    # dead one, if the first did not), fails there and is retried
    for i in range(2):
        s, h, body, _ = complete(ng.port, ids("f%d" % i, 48))
        assert s == 200, body
        assert h["x-kvroute-worker"] == "127.0.0.1:%d" % w.ports[0]

    def busy():
        return any(x["active_decode_blocks"] >= 10
                   for x in status(ng.port)["zones"]["kv"]["upstreams"]["llm"])

    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(complete, ng.port, ids("long", 400), 300)
        kvt.wait_until(busy, what="the live server past busy_decode_blocks")
        s, h, data = kvt.request(ng.port, "POST", "/v1/completions",
                                 {"prompt": ids("x", 32), "max_tokens": 1})
        assert s == 503, data
        assert fut.result()[0] == 200


def test_error_answers_teach_no_rates(stack):
    """A streamed request the engine refuses at once (a prompt over its KV
    pool: a 400 in a few ms) was a sample of the server's prefill rate (its
    2,000 tokens over those ms) and decode pace: one such client made a
    server look idle to every estimate. Only 200s teach them now."""
    ng, ports = fleet(stack, n=1, extra=["--num-blocks", "16"])

    def learned():
        st = status(ng.port)["zones"]["kv"]["upstreams"]["llm"][0]
        return st["active_requests"], st["prefill_rate"], st["decode_pace"]

    for i in range(4):
        s, _, body, _ = complete(ng.port, ids("long%d" % i, 2000), max_tokens=50, stream=True)
        assert s == 400, body
    kvt.wait_until(lambda: learned()[0] == 0, what="load released")
    assert learned()[1:] == (0, 0)
    # a 200 still teaches both
    s, _, body, _ = complete(ng.port, ids("short", 64), max_tokens=20, stream=True)
    assert s == 200, body
    kvt.wait_until(lambda: learned()[0] == 0 and learned()[1] > 0 and learned()[2] > 0,
                   what="rates learned from a 200")
    assert ng.alerts() == []


def test_sglang_generate_routes_and_counts(stack):
    """SGLang's native /generate (RL rollout frameworks send it token ids):
    `input_ids` routes on its blocks like a completion's prompt, and
    sampling_params' max_new_tokens x n, per prompt of a batch, is the
    decode load; the Responses API's `text` object is not taken for a
    prompt (this upstream has no tokenizer for its `input`: routed by load,
    not refused)."""
    ports = kvt.free_ports(2)
    text = conf(stack, [], servers="\n".join("server 127.0.0.1:%d;" % p for p in ports))
    text = text.replace("location /v1/ {", "location / {") + kvt.canned_servers(
        ports, '{"text":"ok","meta_info":{}}')
    ng = stack.nginx(text)

    def generate(body):
        s, h, _, raw = kvt.post_json(ng.port, "/generate", body)
        assert s == 200, raw
        return h["x-kvroute-worker"], int(h["x-kvroute-overlap"])

    a = ids("rollout", 64)
    w, overlap = generate({"input_ids": a, "sampling_params": {"max_new_tokens": 8}})
    assert overlap == 0
    # the next turn of the rollout extends the prompt: it follows its blocks
    assert generate({"input_ids": a + ids("turn", 32),
                     "sampling_params": {"temperature": 1.0, "max_new_tokens": 8}}) == (w, 4)
    s, h, _, raw = kvt.post_json(ng.port, "/v1/responses",
                                 {"model": "m", "input": "x", "text": {"format": {"type": "text"}}})
    assert s == 200, raw
    assert ng.alerts() == []
    ng.stop()
    assert load_while_held(stack, "/generate", {
        "input_ids": [a, ids("other", 48)],
        "sampling_params": [{"max_new_tokens": 40, "n": 3}, {"max_new_tokens": 20}],
    })[2] == 40 * 3 * 2
