"""Disaggregated serving, the nginx side (kvroute ... prefill=UPSTREAM): real
nginx with the module, real nats-server and kvworker processes as the prefill
pool publishing KV events, and, as decode servers, small HTTP servers in this
process that record the request headers nginx sends them (what
X-KVRoute-Prefill said) and can hold or drop a request."""
import http.server
import json
import socketserver
import threading
import zlib

import pytest

import kvt

CONF = """
    kvroute_zone kv 16m;
    %(events)s
    upstream prefill {
        zone prefill 64k;
        kvroute zone=kv %(mode)s;
        %(prefill)s
    }
    upstream decode {
        zone decode 64k;
        kvroute zone=kv %(mode)s prefill=prefill %(params)s;
        %(decode)s
    }
    upstream plain {
        kvroute;
        %(decode)s
    }
    server {
        listen 127.0.0.1:%%(port)s;
        client_max_body_size 8m;
        location /v1/ {
            kvroute_upstream decode;
            proxy_pass http://decode;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_next_upstream error timeout invalid_header http_502 non_idempotent;
            kvroute_debug_headers on;
            add_header X-Var-Prefill "$kvroute_prefill_worker";
            add_header X-Var-Prefill-Overlap "$kvroute_prefill_overlap_blocks";
            add_header X-Var-Prefill-Reason "$kvroute_prefill_reason";
            add_header X-Var-Prefilled-By "$upstream_http_x_kvroute_prefilled_by";
            add_header X-Var-Prefill-Est "$kvroute_prefill_remote_ms $kvroute_prefill_local_ms";
        }
        location /plain/ {
            kvroute_upstream plain;
            proxy_pass http://plain/v1/;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }
        location = /kvroute/status { kvroute_status; }
    }
"""


class Decode:
    """A decode server stand-in: answers an OpenAI completion, names what
    X-KVRoute-Prefill it got (X-KVRoute-Prefilled-By, as a decode worker
    does), and records every request's prefill headers. mode: "ok", "hold"
    (wait for release() before any header), "drop" (close, no response)."""

    def __init__(self):
        self.seen = []          # per request: the list of X-KVRoute-Prefill values
        self.mode = "ok"
        self.gate = threading.Event()
        self.arrived = threading.Event()
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_POST(self):
                n = int(self.headers.get("Content-Length", "0"))
                self.rfile.read(n)
                vals = [v for k, v in self.headers.items() if k.lower() == "x-kvroute-prefill"]
                outer.seen.append(vals)
                outer.arrived.set()
                if outer.mode == "drop":
                    self.close_connection = True
                    return
                if outer.mode == "hold":
                    outer.gate.wait(60)
                body = json.dumps({"id": "x", "object": "text_completion", "model": "m",
                                   "choices": [{"index": 0, "text": "ok",
                                                "finish_reason": "length"}],
                                   "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                                             "total_tokens": 2}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("X-KVRoute-Prefilled-By", vals[0] if vals else "local")
                self.end_headers()
                self.wfile.write(body)

        class S(socketserver.ThreadingMixIn, http.server.HTTPServer):
            daemon_threads = True
            allow_reuse_address = True

        self.server = S(("127.0.0.1", 0), H)
        self.port = self.server.server_address[1]
        self.addr = "127.0.0.1:%d" % self.port
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.gate.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def decoders():
    ds = [Decode(), Decode()]
    yield ds
    for d in ds:
        d.close()


def ids(name, n):
    h = zlib.crc32(name.encode()) % 10000
    return [1000 + (h * 31 + i) % 30000 for i in range(n)]


def complete(port, prompt, headers=None, path="/v1/completions"):
    return kvt.post_json(port, path, {"model": "kvroute-mock", "prompt": prompt,
                                      "max_tokens": 1}, headers=headers)


def status(port):
    s, _, body = kvt.request(port, "GET", "/kvroute/status")
    assert s == 200
    return json.loads(body)["zones"]["kv"]


def server_stat(port, upstream, server):
    for x in status(port)["upstreams"][upstream]:
        if x["server"] == server:
            return x
    raise KeyError(server)


def all_idle(port):
    for name, servers in status(port)["upstreams"].items():
        for x in servers:
            if x["active_requests"] or x["active_prefill_tokens"] or x["active_decode_blocks"]:
                return False
    return True


def start(stack, decoders, prefill_servers, events=False, params="", prefill_extra=()):
    """nginx with decode = the stand-ins and prefill = prefill_servers (a
    list of addresses, or a kvworker started here when None)."""
    nats = w = None
    ev = ""
    mode = "mode=approximate"
    if events:
        nats = stack.nats()
        ev = "kvroute_events %s zone=kv;" % nats.url
        mode = "mode=events"
    if prefill_servers is None:
        extra = ["--speedup", "50"]
        if nats:
            extra += ["--nats", nats.url, "--heartbeat-ms", "200"]
        w = stack.worker(engines=2, extra=extra)
        prefill_servers = ["127.0.0.1:%d" % p for p in w.ports]
    pre = "\n".join("server %s%s;" % (a, "" if " " in a else " max_fails=0")
                    for a in prefill_servers)
    dec = "\n".join("server %s max_fails=0;" % d.addr for d in decoders)
    ng = stack.nginx(CONF % {"events": ev, "mode": mode, "prefill": pre, "decode": dec,
                             "params": params})
    if events:
        kvt.wait_until(lambda: len([x for x in status(ng.port)["events"]["workers"]
                                    if x["state"] == "live"]) == 2,
                       what="prefill workers announced")
    return ng, w, prefill_servers


def test_client_header_is_always_stripped(stack, decoders):
    """A client's X-KVRoute-Prefill never reaches a decode server: not with a
    short prompt (local prefill), not with a long one (nginx's own value
    replaces it), not through a kvroute upstream without prefill= or zone=."""
    ng, _, pre = start(stack, decoders, None)
    forged = {"X-KVRoute-Prefill": "10.9.9.9:1", "x-kvroute-prefill": "10.9.9.9:2"}
    s, h, _, _ = complete(ng.port, ids("short", 64), {"X-KVRoute-Prefill": "10.9.9.9:1"})
    assert s == 200
    assert h["x-kvroute-prefill-worker"] == "local"
    assert h["x-kvroute-prefill-reason"] == "short"
    assert h["x-var-prefilled-by"] == "local"
    s, h, _, _ = complete(ng.port, ids("long", 2048), forged)
    assert s == 200
    assert h["x-kvroute-prefill-reason"] == "remote"
    assert h["x-kvroute-prefill-worker"] in pre
    assert h["x-var-prefill"] == h["x-kvroute-prefill-worker"]
    assert h["x-var-prefilled-by"] == h["x-kvroute-prefill-worker"]
    s, _, _, _ = complete(ng.port, ids("plain", 64), {"X-KVRoute-Prefill": "10.9.9.9:3"},
                          path="/plain/completions")
    assert s == 200
    seen = decoders[0].seen + decoders[1].seen
    assert len(seen) == 3
    assert sorted(len(v) for v in seen) == [0, 0, 1]
    assert [v for v in seen if v] == [[h["x-kvroute-prefill-worker"]]]
    assert ng.alerts() == []


def test_prefill_worker_chosen_by_overlap(stack, decoders):
    """Events from the prefill workers steer each long prompt to the prefill
    worker that holds it; the decode worker gets its address."""
    ng, w, pre = start(stack, decoders, None, events=True)
    for name, port in (("doc-a", w.ports[0]), ("doc-b", w.ports[1])):
        s, _, body, _ = complete(port, ids(name, 1600))
        assert s == 200, body
    kvt.wait_until(lambda: all(server_stat(ng.port, "prefill", a)["indexed_blocks"] >= 100
                               for a in pre), what="prefill workers' events indexed")
    for name, addr in (("doc-a", pre[0]), ("doc-b", pre[1])):
        s, h, _, _ = complete(ng.port, ids(name, 1600) + [7] * 32)
        assert s == 200
        assert h["x-kvroute-prefill-reason"] == "remote"
        assert h["x-kvroute-prefill-worker"] == addr
        assert h["x-var-prefill"] == addr
        assert h["x-var-prefill-overlap"] == "100"
        assert h["x-var-prefilled-by"] == addr
        # the decode worker now holds the prompt too (the router's own
        # record until its events say so): the next turn stays there and
        # has only its new 32 tokens to prefill, locally
        decode = h["x-kvroute-worker"]
        s, h, _, _ = complete(ng.port, ids(name, 1600) + [7] * 32 + [8] * 32)
        assert s == 200
        assert h["x-kvroute-worker"] == decode
        assert h["x-kvroute-overlap"] == "102"
        assert h["x-kvroute-prefill-reason"] == "short"
        assert h.get("x-var-prefill-est", "").strip() == ""     # no estimate made
        assert h["x-kvroute-prefill-worker"] == "local"
        assert "x-var-prefill-overlap" not in h or h["x-var-prefill-overlap"] == ""
    seen = decoders[0].seen + decoders[1].seen
    assert sorted(v[0] for v in seen if v) == sorted(pre)
    assert sum(1 for v in seen if not v) == 2
    # the prefill servers' counters saw them; nothing is left held
    assert server_stat(ng.port, "prefill", pre[0])["requests"] == 1
    kvt.wait_until(lambda: all_idle(ng.port), what="load released")
    assert ng.alerts() == []


def test_prefill_load_held_until_decode_header(stack, decoders):
    """The prefill server carries the prompt's tokens from the decision to
    the decode server's response header, then nothing."""
    ng, _, pre = start(stack, decoders, None)
    for d in decoders:
        d.mode = "hold"
    out = {}
    t = threading.Thread(target=lambda: out.update(r=complete(ng.port, ids("held", 2048))))
    t.start()
    try:
        kvt.wait_until(lambda: decoders[0].arrived.is_set() or decoders[1].arrived.is_set(),
                       what="request at a decode server")
        held = [server_stat(ng.port, "prefill", a) for a in pre]
        assert sorted(x["active_prefill_tokens"] for x in held) == [0, 2048]
        assert sorted(x["active_requests"] for x in held) == [0, 1]
        dec = [server_stat(ng.port, "decode", d.addr) for d in decoders]
        # the decode server prefills nothing itself, but holds the blocks
        assert sorted(x["active_requests"] for x in dec) == [0, 1]
        assert all(x["active_prefill_tokens"] == 0 for x in dec)
        assert sorted(x["active_decode_blocks"] for x in dec) == [0, 128]
    finally:
        for d in decoders:
            d.gate.set()
        t.join(30)
    assert out["r"][0] == 200
    kvt.wait_until(lambda: all_idle(ng.port), what="load released")
    assert ng.alerts() == []


def test_load_released_when_decode_fails(stack, decoders):
    """A decode server that drops the request: the retry decides again (and
    sets the header again); when every decode server drops it the client
    gets nginx's error; either way every counter returns to zero."""
    ng, _, pre = start(stack, decoders, None)
    decoders[0].mode = "drop"
    for i in range(4):
        s, h, _, _ = complete(ng.port, ids("retry%d" % i, 2048))
        assert s == 200
        assert h["x-kvroute-worker"] == decoders[1].addr
        assert h["x-kvroute-prefill-worker"] in pre
    assert all(len(v) == 1 for v in decoders[0].seen + decoders[1].seen)
    kvt.wait_until(lambda: all_idle(ng.port), what="load released after retries")
    decoders[1].mode = "drop"
    s, _, _, _ = complete(ng.port, ids("fail", 2048))
    assert s == 502
    kvt.wait_until(lambda: all_idle(ng.port), what="load released after failure")
    totals = sum(server_stat(ng.port, "prefill", a)["requests"] for a in pre)
    attempts = decoders[0].seen + decoders[1].seen
    assert len(attempts) >= 4 + 2
    assert totals == len(attempts)      # every attempt made its own decision
    assert ng.alerts() == []


def test_dead_prefill_upstream_means_local_prefill(stack, decoders):
    """Every prefill server down: long prompts are served, prefilled
    locally, with no header; never a client error."""
    ng, _, _ = start(stack, decoders, ["127.0.0.1:1 down", "127.0.0.1:2 down"])
    for i in range(3):
        s, h, _, _ = complete(ng.port, ids("dead%d" % i, 2048),
                              {"X-KVRoute-Prefill": "127.0.0.1:9"})
        assert s == 200
        assert h["x-kvroute-prefill-worker"] == "local"
        assert h["x-kvroute-prefill-reason"] == "none"
        assert h["x-var-prefilled-by"] == "local"
    assert all(v == [] for v in decoders[0].seen + decoders[1].seen)
    kvt.wait_until(lambda: all_idle(ng.port), what="load released")
    assert ng.alerts() == []


def test_prefill_min_tokens(stack, decoders):
    """prefill_min_tokens= moves the local/remote line."""
    ng, _, _ = start(stack, decoders, None, params="prefill_min_tokens=4000")
    s, h, _, _ = complete(ng.port, ids("mid", 2048))
    assert s == 200 and h["x-kvroute-prefill-reason"] == "short"
    assert h.get("x-var-prefill-est", "").strip() == ""    # no estimate made
    s, h, _, _ = complete(ng.port, ids("big", 4096 + 16))
    assert s == 200 and h["x-kvroute-prefill-reason"] == "remote"


def held_requests(ng, decoders, names, tokens=2048):
    """Sends one request per name, each once the one before it reached a
    decode server (held there: "hold" mode), so each decision sees the load
    of those before it. Returns the threads and their results (filled once
    the decoders are released)."""
    out, threads = {}, []
    for i, name in enumerate(names):
        t = threading.Thread(target=lambda n=name: out.update({n: complete(ng.port,
                                                                       ids(n, tokens))}))
        t.start()
        threads.append(t)
        kvt.wait_until(lambda: len(decoders[0].seen) + len(decoders[1].seen) == i + 1,
                       what="request %d held at a decode server" % (i + 1))
    return threads, out


def test_loaded_prefill_pool_prefills_locally(stack, decoders):
    """Conditional disaggregation: the prefill pool's queue (prompts held
    there until their decode server's header) makes nginx's estimate for a
    remote prefill worse than an idle decode worker's own, and the next
    long prompt is prefilled locally ("faster"), with no header; once the
    queue drains, long prompts go remote again. 2048-token prompts at the
    default 8 tokens/ms: own prefill 256 ms; the stall weight 0.1 x one
    request decoding, the margin 25%: local 336 ms against remote 512 once
    both prefill servers hold one prompt."""
    ng, _, pre = start(stack, decoders, None,
                       params="prefill_stall_weight=0.1 prefill_margin=0.25")
    for d in decoders:
        d.mode = "hold"
    threads, out = held_requests(ng, decoders, ["q1", "q2", "q3"])
    try:
        held = [server_stat(ng.port, "prefill", a) for a in pre]
        assert sorted(x["active_prefill_tokens"] for x in held) == [2048, 2048]
        dec = [server_stat(ng.port, "decode", d.addr) for d in decoders]
        # the third prompt is the decode server's own to prefill
        assert sum(x["active_prefill_tokens"] for x in dec) == 2048
        assert sum(x["active_requests"] for x in dec) == 3
    finally:
        for d in decoders:
            d.gate.set()
        for t in threads:
            t.join(30)
    reasons = [out[n][1]["x-var-prefill-reason"] for n in ("q1", "q2", "q3")]
    assert reasons == ["remote", "remote", "faster"]
    # the two TTFT estimates behind each decision ($kvroute_prefill_remote_ms,
    # $kvroute_prefill_local_ms; the stall left out): the idle pool 256 ms
    # against an idle decode server's 256, then 512 against 256
    est = [[float(x) for x in out[n][1]["x-var-prefill-est"].split()]
           for n in ("q1", "q2", "q3")]
    assert est[0] == pytest.approx([256, 256], abs=1)
    assert est[2] == pytest.approx([512, 256], abs=1)
    assert all(out[n][0] == 200 for n in out)
    h = out["q3"][1]
    assert h["x-kvroute-prefill-worker"] == "local"
    assert h["x-kvroute-prefill-reason"] == "faster"
    assert h["x-var-prefilled-by"] == "local"
    seen = decoders[0].seen + decoders[1].seen
    assert sorted(len(v) for v in seen) == [0, 1, 1]
    kvt.wait_until(lambda: all_idle(ng.port), what="load released")

    # drained: the pool is idle again, and a long prompt goes remote
    for d in decoders:
        d.mode = "ok"
    s, h, _, _ = complete(ng.port, ids("after", 2048))
    assert s == 200
    assert h["x-kvroute-prefill-reason"] == "remote"
    assert h["x-kvroute-prefill-worker"] in pre
    kvt.wait_until(lambda: all_idle(ng.port), what="load released")
    assert ng.alerts() == []


def test_conditional_off_and_stall_weight(stack, decoders):
    """prefill_conditional=off: the same queue, every long prompt remote
    (the prefill workers' own queue limit is then the only overload
    signal). A stall weight that makes the decode server's running
    requests count heavily keeps it remote too."""
    for params in ("prefill_conditional=off", "prefill_stall_weight=10"):
        ds = [Decode(), Decode()]
        try:
            ng, _, _ = start(stack, ds, None, params=params)
            for d in ds:
                d.mode = "hold"
            threads, out = held_requests(ng, ds, ["o1", "o2", "o3"])
            for d in ds:
                d.gate.set()
            for t in threads:
                t.join(30)
            assert [out[n][1]["x-var-prefill-reason"] for n in ("o1", "o2", "o3")] \
                == ["remote"] * 3, params
            assert all(len(v) == 1 for v in ds[0].seen + ds[1].seen)
            kvt.wait_until(lambda: all_idle(ng.port), what="load released")
            assert ng.alerts() == []
        finally:
            for d in ds:
                d.close()


@pytest.mark.parametrize("bad,why", [
    ("prefill=nosuch", 'no upstream "nosuch"'),
    ("prefill=decode", "names itself"),
    ("prefill=other", 'needs "kvroute zone=kv"'),
    ("prefill_conditional=maybe", 'invalid parameter "prefill_conditional=maybe"'),
    ("prefill_stall_weight=-1", 'invalid parameter "prefill_stall_weight=-1"'),
])
def test_prefill_misconfigured(stack, bad, why):
    conf = """
    kvroute_zone kv 16m;
    kvroute_zone kv2 16m;
    upstream other { kvroute zone=kv2; server 127.0.0.1:1; }
    upstream decode { kvroute zone=kv %s; server 127.0.0.1:2; }
    server { listen 127.0.0.1:%%(port)s; location / { kvroute_upstream decode; proxy_pass http://decode; } }
""" % bad
    n = kvt.Nginx(stack, conf, "", kvt.free_port(), 1)
    ok, out = n.check()
    assert not ok
    assert why in out


# --- end to end: real prefill and decode kvworkers (CPU engine) ------------------
#
# A tiny random-weight model (kvtiny-model), prefill and decode pools of two
# CPU engines each publishing KV events, and an aggregated worker of the
# same model as the reference: greedy output through the split pools is the
# aggregated worker's, and the decode worker says it pulled the KV from the
# prefill worker nginx chose.

QWEN_TOK = kvt.os.path.join(kvt.TOP, "conf", "tokenizers", "qwen2.5-instruct",
                            "tokenizer.json")

E2E = """
    kvroute_zone kv 16m;
    kvroute_events %(nats)s zone=kv heartbeat_timeout=%(hb)s;
    upstream prefill {
        zone prefill 64k;
        kvroute zone=kv mode=events tokenizer=%(tok)s;
        %(prefill)s
    }
    upstream decode {
        zone decode 64k;
        kvroute zone=kv mode=events tokenizer=%(tok)s prefill=prefill
                prefill_min_tokens=%(min)d;
        %(decode)s
        keepalive 8;
    }
    server {
        listen 127.0.0.1:%%(port)s;
        location /v1/ {
            kvroute_upstream decode;
            proxy_pass http://decode;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 120s;
            kvroute_debug_headers on;
        }
        location = /kvroute/status { kvroute_status; }
    }
"""


def tiny_model(tmp_path):
    out = str(tmp_path / "m")
    r = kvt.subprocess.run([kvt.os.path.join(kvt.BIN, "kvtiny-model"), "--out", out,
                            "--tokenizer", QWEN_TOK, "--seed", "3", "--layers", "2",
                            "--hidden", "64", "--heads", "4", "--kv-heads", "2"],
                           capture_output=True, text=True, cwd=kvt.TOP)
    assert r.returncode == 0, r.stderr
    return out


def e2e(stack, tmp_path, min_tokens=64, hb="3s"):
    model = tiny_model(tmp_path)
    nats = stack.nats()
    cpu = ["--engine", "cpu", "--model", model, "--tokenizer", model + "/tokenizer.json",
           "--num-blocks", "512"]
    ev = ["--nats", nats.url, "--heartbeat-ms", "200"]
    pre = stack.worker(engines=2, extra=cpu + ev + ["--role", "prefill"], wait=False)
    dec = stack.worker(engines=2, extra=cpu + ev + ["--role", "decode",
                                                    "--disagg-min-tokens", str(min_tokens)],
                       wait=False)
    agg = stack.worker(engines=1, extra=cpu, wait=False)
    stack.ready(pre, dec, agg)
    ng = stack.nginx(E2E % {
        "nats": nats.url, "hb": hb, "tok": QWEN_TOK, "min": min_tokens,
        "prefill": "\n".join("server 127.0.0.1:%d max_fails=0;" % p for p in pre.ports),
        "decode": "\n".join("server 127.0.0.1:%d max_fails=0;" % p for p in dec.ports)})
    kvt.wait_until(lambda: len([x for x in status(ng.port)["events"]["workers"]
                                if x["state"] == "live"]) == 4, what="4 workers announced")
    return ng, pre, dec, agg


def generate(port, prompt, stream=False):
    body = {"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "stream": stream}
    s, h, data = kvt.request(port, "POST", "/v1/completions", body, timeout=120)
    assert s == 200, data
    if stream:
        text = "".join(json.loads(e)["choices"][0]["text"] for e in kvt.sse_events(data)
                       if e != "[DONE]" and json.loads(e).get("choices"))
    else:
        text = json.loads(data)["choices"][0]["text"]
    return h, text


STORY = ("The lighthouse keeper counted the ships that passed the rocky point each night, "
         "writing their names in a worn leather book beside the lamp. ")


def test_e2e_split_output_equals_aggregated(stack, tmp_path):
    ng, pre, dec, agg = e2e(stack, tmp_path)
    prefill = ["127.0.0.1:%d" % p for p in pre.ports]
    prompt = STORY * 8
    _, ref = generate(agg.ports[0], prompt)
    h, text = generate(ng.port, prompt)
    assert h["x-kvroute-prefill-reason"] == "remote"
    assert h["x-kvroute-prefill-worker"] in prefill
    # the decode worker pulled the KV from the prefill worker nginx named
    assert h["x-kvroute-prefilled-by"] == h["x-kvroute-prefill-worker"]
    assert text == ref
    # streamed, a new prompt: the same
    prompt2 = "Then the fog came. " + STORY * 7 + "By dawn the fog had lifted from the bay."
    _, ref2 = generate(agg.ports[0], prompt2, stream=True)
    h, text2 = generate(ng.port, prompt2, stream=True)
    assert h["x-kvroute-prefilled-by"] == h["x-kvroute-prefill-worker"] != "local"
    assert text2 == ref2
    assert ref2 != ref          # the model's output depends on its prompt
    # the next turn: its decode worker holds the prompt, little is left:
    # prefilled in place, the same text as the aggregated worker's
    prompt3 = prompt + "Tonight the sea was calm."
    _, ref3 = generate(agg.ports[0], prompt3)
    h, text3 = generate(ng.port, prompt3)
    assert h["x-kvroute-prefill-reason"] == "short"
    assert h["x-kvroute-prefilled-by"] == "local"
    assert text3 == ref3
    # both pools' events reached the index
    st = status(ng.port)["upstreams"]
    assert sum(x["indexed_blocks"] for x in st["prefill"]) > 0
    assert sum(x["indexed_blocks"] for x in st["decode"]) > 0
    kvt.wait_until(lambda: all_idle(ng.port), what="load released")
    assert ng.alerts() == []


def test_e2e_dead_prefill_pool_prefills_locally(stack, tmp_path):
    """The prefill workers killed: nginx names one while it still believes
    it up, and the decode worker, failing to pull, prefills itself (the
    worker-level tests cover that pull failure deterministically); once the
    registry has them gone, nginx names none. The client sees the
    aggregated output every time, never an error."""
    ng, pre, dec, agg = e2e(stack, tmp_path, hb="1s")
    prompt = STORY * 8
    _, ref = generate(agg.ports[0], prompt)
    kvt._kill(pre)
    h, text = generate(ng.port, prompt)
    # whether nginx still named a prefill worker or already knew it gone,
    # the decode worker prefilled itself; when named, it says why it fell back
    assert h["x-kvroute-prefill-reason"] in ("remote", "none"), h
    if h["x-kvroute-prefill-reason"] == "remote":
        assert h.get("x-kvroute-prefill-fallback"), h
    assert h["x-kvroute-prefilled-by"] == "local"
    assert text == ref
    # silent past heartbeat_timeout: dropped from the registry
    known = lambda: [x for x in status(ng.port)["events"]["workers"]    # noqa: E731
                     if x["address"] in ["127.0.0.1:%d" % p for p in pre.ports]
                     and x["state"] != "gone"]
    kvt.wait_until(lambda: not known(), what="prefill workers gone")
    prompt = "Another night. " + STORY * 6
    _, ref = generate(agg.ports[0], prompt)
    h, text = generate(ng.port, prompt)
    assert h["x-kvroute-prefill-reason"] == "none"
    assert h["x-kvroute-prefill-worker"] == "local"
    assert h["x-kvroute-prefilled-by"] == "local"
    assert text == ref
    kvt.wait_until(lambda: all_idle(ng.port), what="load released")
    assert ng.alerts() == []
