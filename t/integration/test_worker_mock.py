"""kvworker --engine mock over HTTP: OpenAI shapes, errors, the step schedule
of Dynamo's perf model, client disconnects."""
import json
import os
import signal
import socket
import time

import kvt


def metrics(port):
    status, _, body = kvt.request(port, "GET", "/metrics")
    assert status == 200
    out = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = float(value)
    return out


def test_prompt_shapes_and_usage(stack):
    port = stack.worker(extra=["--speedup", "100"]).ports[0]
    text = "the quick brown fox jumps over the lazy dog " * 2
    s, _, a, _ = kvt.post_json(port, "/v1/completions", {"prompt": text, "max_tokens": 5})
    assert s == 200 and a["usage"]["completion_tokens"] == 5
    assert a["usage"]["prompt_tokens"] == len(text)
    assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert a["model"] == "kvroute-mock"
    # the same prompt again: full blocks come from the prefix cache
    s, _, b, _ = kvt.post_json(port, "/v1/completions", {"prompt": text, "max_tokens": 5})
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(text) - 1) // 16 * 16
    assert b["choices"][0]["text"] == a["choices"][0]["text"], "deterministic tokens"
    # token ids, a list of strings, a list of token id lists
    s, _, c, _ = kvt.post_json(port, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2})
    assert s == 200 and c["usage"]["prompt_tokens"] == 3
    s, _, d, _ = kvt.post_json(port, "/v1/completions",
                               {"prompt": ["one", "two words"], "max_tokens": 3})
    assert s == 200 and [ch["index"] for ch in d["choices"]] == [0, 1]
    assert d["usage"]["prompt_tokens"] == 3 + 9 and d["usage"]["completion_tokens"] == 6
    s, _, e, _ = kvt.post_json(port, "/v1/completions",
                               {"prompt": [[5, 6], [7, 8, 9]], "max_tokens": 1})
    assert s == 200 and len(e["choices"]) == 2 and e["usage"]["prompt_tokens"] == 5
    # models, health
    s, _, body = kvt.request(port, "GET", "/v1/models")
    assert s == 200 and json.loads(body)["data"][0]["id"] == "kvroute-mock"
    assert kvt.request(port, "GET", "/health")[0] == 200


def test_stop_string_and_streaming(stack):
    port = stack.worker(extra=["--speedup", "100"]).ports[0]
    body = {"prompt": "stop test", "max_tokens": 40}
    s, _, full, _ = kvt.post_json(port, "/v1/completions", body)
    text = full["choices"][0]["text"]
    stop = text[10:13]
    first = text.find(stop)
    s, _, cut, _ = kvt.post_json(port, "/v1/completions", dict(body, stop=[stop]))
    assert cut["choices"][0]["text"] == text[:first]
    assert cut["choices"][0]["finish_reason"] == "stop"
    # streamed: the same text, token by token, then usage and [DONE]
    s, hdrs, raw = kvt.request(port, "POST", "/v1/completions",
                               dict(body, stream=True, stop=[stop],
                                    stream_options={"include_usage": True}))
    assert s == 200 and hdrs["content-type"].startswith("text/event-stream")
    events = kvt.sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text[:first]
    assert chunks[-1]["usage"]["completion_tokens"] == cut["usage"]["completion_tokens"]
    # chat, streamed
    s, _, raw = kvt.request(port, "POST", "/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 4, "stream": True})
    chunks = [json.loads(e) for e in kvt.sse_events(raw)[:-1]]
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_bad_requests_get_openai_errors(stack):
    port = stack.worker(extra=["--num-blocks", "8"]).ports[0]
    cases = [
        ("/v1/completions", b'{"prompt": "x", '),
        ("/v1/completions", b'[1, 2]'),
        ("/v1/completions", b'{"max_tokens": 3}'),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}'),
        ("/v1/completions", b'{"prompt": "x", "stop": [1]}'),
        ("/v1/completions", b'{"prompt": [-1]}'),
        ("/v1/completions", b'{"prompt": ""}'),
        ("/v1/completions", b'{"prompt": []}'),
        ("/v1/completions", json.dumps({"prompt": "y" * 200}).encode()),   # > 8 blocks of 16
        ("/v1/chat/completions", b'{"messages": "hi"}'),
        ("/v1/chat/completions", b'{"messages": [{"content": "no role"}]}'),
    ]
    for path, body in cases:
        s, hdrs, raw = kvt.request(port, "POST", path, body)
        assert s == 400, (body, s, raw)
        err = json.loads(raw)["error"]
        assert err["type"] == "invalid_request_error" and err["message"], body
    assert kvt.request(port, "GET", "/v1/completions")[0] == 405
    assert kvt.request(port, "GET", "/nope")[0] == 404
    # still serving
    s, _, ok, _ = kvt.post_json(port, "/v1/completions", {"prompt": "fine", "max_tokens": 2})
    assert s == 200


def open_long_stream(port):
    """A streamed generation of 100,000 tokens, its first token read: the
    socket, which ends it when closed."""
    body = json.dumps({"prompt": "z" * 500, "max_tokens": 100000, "stream": True,
                       "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    got = b""
    while b"data: " not in got:
        got += sock.recv(4096)
    return sock


def test_client_disconnect_frees_blocks(stack):
    port = stack.worker().ports[0]      # speedup 1: a long generation
    sock = open_long_stream(port)
    m = metrics(port)
    assert m["kvworker_requests_running"] == 1 and m["kvworker_kv_blocks_active"] >= 32
    sock.close()
    kvt.wait_until(lambda: metrics(port)["kvworker_kv_blocks_active"] == 0,
                   what="blocks freed after disconnect")
    m = metrics(port)
    assert m["kvworker_requests_running"] == 0 and m["kvworker_requests_cancelled_total"] == 1
    assert m["kvworker_kv_blocks_used"] >= 31       # the prompt's full blocks stay cached


def test_client_disconnect_frees_blocks_of_a_reply_not_streamed(stack):
    """The same for a reply that is not streamed: nothing is written to the
    client until the end, so only reading the socket can tell it left."""
    port = stack.worker().ports[0]      # speedup 1: a long generation
    body = json.dumps({"prompt": "z" * 500, "max_tokens": 100000,
                       "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    kvt.wait_until(lambda: metrics(port)["kvworker_requests_running"] == 1,
                   what="the generation running")
    sock.close()
    kvt.wait_until(lambda: metrics(port)["kvworker_kv_blocks_active"] == 0,
                   what="blocks freed after disconnect")
    m = metrics(port)
    assert m["kvworker_requests_running"] == 0 and m["kvworker_requests_cancelled_total"] == 1


def test_stream_its_client_does_not_read_is_cut(stack):
    """The engine does not wait for a stream's reader: past
    --stream-backlog-kb unread, the stream is cut and its request cancelled
    (its output piled up in memory without bound before)."""
    w = stack.worker(extra=["--speedup", "1000", "--stream-backlog-kb", "64"])
    port = w.ports[0]
    body = json.dumps({"prompt": "z" * 100, "max_tokens": 100000, "stream": True,
                       "ignore_eos": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        kvt.wait_until(lambda: metrics(port)["kvworker_requests_cancelled_total"] == 1,
                       what="the unread stream cancelled")
        m = metrics(port)
        assert m["kvworker_requests_running"] == 0 and m["kvworker_kv_blocks_active"] == 0
        assert "left over 64 KB unread" in open(w.log).read()
    finally:
        sock.close()
    status, _, _ = kvt.request(port, "POST", "/v1/completions",
                               {"prompt": "hi", "max_tokens": 2})
    assert status == 200


def test_a_starved_engine_counts_its_late_steps(stack):
    """The mock engine's timings are only faithful while the host gives its
    loop the CPU; when it does not, kvworker_late_seconds_total says how
    much simulated time was lost (bench-e2e reports it for each run). The
    worker is stopped (SIGSTOP) for 300 ms mid-generation: its next step
    starts that late, and the counter shows it."""
    w = stack.worker()                  # speedup 1: steps of ~10 ms, a long generation
    port = w.ports[0]
    sock = open_long_stream(port)
    before = metrics(port)["kvworker_late_seconds_total"]
    os.kill(w.pid, signal.SIGSTOP)
    time.sleep(0.3)                     # the starvation itself, not a wait for a condition
    os.kill(w.pid, signal.SIGCONT)
    kvt.wait_until(lambda: metrics(port)["kvworker_late_seconds_total"] - before >= 0.25,
                   what="the stopped time counted as late")
    sock.close()


def test_first_token_time_is_the_engines_schedule(stack):
    """kvworker_first_token_seconds_total sums each request's time to first
    token as the engine scheduled it: the step's due time, not when the
    loop delivered it. A request's one prefill step (~0.5 s simulated at
    speedup 0.1) is seen in flight, then the worker is stopped (SIGSTOP)
    until well past the step's due time: the client waits for the stop on
    top, the engine's figure does not count it."""
    w = stack.worker(extra=["--speedup", "0.1"])
    port = w.ports[0]
    body = json.dumps({"prompt": "y" * 2000, "max_tokens": 1}).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    t0 = time.monotonic()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    kvt.wait_until(lambda: metrics(port)["kvworker_requests_running"] == 1,
                   what="the prefill step in flight")
    os.kill(w.pid, signal.SIGSTOP)
    time.sleep(1.2)                     # the stall itself, well past the step's due time
    os.kill(w.pid, signal.SIGCONT)
    got = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
    client = time.monotonic() - t0
    sock.close()
    assert got.startswith(b"HTTP/1.1 200"), got[:200]
    m = metrics(port)
    assert m["kvworker_first_tokens_total"] == 1
    assert 0 < m["kvworker_first_token_seconds_total"] < client - 0.5, (m, client)


def test_idle_engine_runs_the_modeled_schedule(stack):
    """A 4096-token prompt and 30 tokens on an idle engine: one prefill step
    (it fits the token budget) and 29 decode steps, each timed by Dynamo's
    polynomial model. The model's figures are unit-tested
    (t/unit/test_kvw_mock.c); how closely wall-clock time follows them is a
    benchmark figure (tools/bench.d/mock, docs/BENCHMARKS.md), not asserted
    here: a shared machine only ever adds time."""
    w = stack.worker(extra=["--num-blocks", "512", "--speedup", "100"])
    port = w.ports[0]
    for ch in "ab":                                 # no cache hits
        m0 = metrics(port)
        s, _, body, _ = kvt.post_json(port, "/v1/completions",
                                      {"prompt": ch * 4096, "max_tokens": 30,
                                       "ignore_eos": True})
        m1 = metrics(port)
        assert s == 200 and body["usage"]["completion_tokens"] == 30
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert m1["kvworker_steps_total"] - m0["kvworker_steps_total"] == 30
        assert m1["kvworker_prefill_steps_total"] - m0["kvworker_prefill_steps_total"] == 1
        assert m1["kvworker_generation_tokens_total"] - m0["kvworker_generation_tokens_total"] == 30
