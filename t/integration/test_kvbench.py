"""kvbench replay against a real kvworker, a stand-in OpenAI server and nothing at all."""
import http.server
import json
import os
import subprocess
import threading

import pytest

import kvt

KVBENCH = os.path.join(kvt.BIN, "kvbench")


def write_trace(path, reqs):
    with open(path, "w") as f:
        for r in reqs:
            f.write(json.dumps(r) + "\n")
    return path


def small_trace(tmp_path, n=6, blocks=2, shared=1):
    """n requests of blocks*16 tokens; the first `shared` blocks are common to all."""
    reqs = []
    for i in range(n):
        ids = list(range(shared)) + [1000 + i * 10 + b for b in range(blocks - shared)]
        reqs.append({"timestamp": i * 10, "input_length": blocks * 16, "output_length": 3 + i % 3,
                     "hash_ids": ids})
    return write_trace(str(tmp_path / "trace.jsonl"), reqs), reqs


def kvbench(*args, timeout=60):
    r = subprocess.run([KVBENCH, "replay"] + [str(a) for a in args], capture_output=True,
                       text=True, timeout=timeout, env=kvt.sanitizer_env())
    return r


def summary(r):
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1, r.stdout
    return json.loads(lines[0])


def records(path):
    with open(path) as f:
        return [json.loads(l) for l in f]


def test_summary_fields_against_kvworker(stack, tmp_path):
    w = stack.worker(engines=1, extra=["--speedup", "20"])
    trace, reqs = small_trace(tmp_path)
    rec = tmp_path / "rec.jsonl"
    s = summary(kvbench("--trace", trace, "--url", "http://127.0.0.1:%d" % w.ports[0],
                        "--block-size", 16, "--concurrency", 2, "--records", rec))
    assert s["requests"] == 6 and s["completed"] == 6 and s["errors"] == 0
    for k in ("ttft_ms", "itl_ms", "e2e_ms", "itl_token_ms"):
        for f in ("mean", "p50", "p90", "p99"):
            assert s[k][f] >= 0, (k, f)
    assert s["ttft_ms"]["mean"] <= s["e2e_ms"]["mean"]
    assert s["request_throughput_rps"] > 0 and s["output_throughput_tok_s"] > 0
    assert s["output_tokens"] == sum(r["output_length"] for r in reqs)
    rs = records(rec)
    assert [r["index"] for r in rs] == list(range(6))
    assert all(r["prompt_tokens"] == 32 and r["error"] is None for r in rs)
    # the hit rate is what the server's usage said, summed over requests
    cached = sum(r["cached_tokens"] or 0 for r in rs)
    assert s["cached_tokens"] == cached
    assert s["hit_rate"] == pytest.approx(cached / sum(r["prompt_tokens"] for r in rs))


def test_text_prompts_share_prefixes(stack, tmp_path):
    w = stack.worker(engines=1, extra=["--speedup", "20"])
    trace, _ = small_trace(tmp_path, n=3)
    s = summary(kvbench("--trace", trace, "--url", "http://127.0.0.1:%d/v1/completions"
                        % w.ports[0], "--block-size", 16, "--text", "--concurrency", 1))
    assert s["completed"] == 3 and s["prompts"] == "text"


def test_chat_prompts_through_tokenizer_and_template(stack, tmp_path):
    model = os.path.join(kvt.TOP, "conf", "tokenizers", "qwen2.5-instruct")
    w = stack.worker(engines=1, extra=["--speedup", "20",
                                       "--tokenizer", os.path.join(model, "tokenizer.json"),
                                       "--chat-template", os.path.join(model,
                                                                       "tokenizer_config.json")])
    trace, _ = small_trace(tmp_path, n=3)
    rec = tmp_path / "rec.jsonl"
    s = summary(kvbench("--trace", trace, "--url", "http://127.0.0.1:%d" % w.ports[0],
                        "--block-size", 16, "--chat", "--concurrency", 1, "--records", rec))
    assert s["completed"] == 3 and s["errors"] == 0 and s["prompts"] == "chat"
    # the template wraps the 32 words in the chat markup: more prompt tokens than words
    assert all(r["prompt_tokens"] > 32 for r in records(rec))
    _, _, body = kvt.request(w.ports[0], "GET", "/metrics")
    busy = [l for l in body.decode().splitlines() if l.startswith("kvworker_busy_seconds_total")]
    assert len(busy) == 1 and float(busy[0].split()[-1]) > 0, body


class FakeOpenAI(http.server.BaseHTTPRequestHandler):
    """Streams two tokens and a usage chunk saying a quarter of the prompt was cached."""
    protocol_version = "HTTP/1.1"
    bodies = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        body["path"] = self.path
        FakeOpenAI.bodies.append(body)
        chat = "messages" in body
        n = len(body["messages"][0]["content"].split()) if chat else len(body["prompt"])
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        # chat: the second piece is a NUL character, valid JSON that jansson refuses by default
        events = [{"choices": [{"index": 0, "delta": {"content": " hi"}}]},
                  {"choices": [{"index": 0, "delta": {"content": "\u0000"}}]}] if chat else \
                 [{"choices": [{"index": 0, "text": " hi"}]},
                  {"choices": [{"index": 0, "text": " there"}]}]
        events += [
                  {"choices": [], "usage": {"prompt_tokens": n, "completion_tokens": 2,
                                            "prompt_tokens_details": {"cached_tokens": n // 4}}}]
        for e in events:
            self.chunk("data: %s\r\n\r\n" % json.dumps(e))
        self.chunk("data: [DONE]\n\n")
        self.chunk("")

    def chunk(self, s):
        b = s.encode()
        self.wfile.write(b"%x\r\n%s\r\n" % (len(b), b))
        self.wfile.flush()

    def log_message(self, *a):
        pass


@pytest.fixture
def fake_server():
    FakeOpenAI.bodies = []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_hit_rate_from_usage_and_request_shape(fake_server, tmp_path):
    trace, reqs = small_trace(tmp_path, n=4, blocks=2, shared=1)
    s = summary(kvbench("--trace", trace, "--url", "http://127.0.0.1:%d" % fake_server.server_port,
                        "--block-size", 16, "--model", "m1", "--speedup", 100))
    assert s["completed"] == 4, s
    assert s["hit_rate"] == pytest.approx(0.25)
    assert s["prompt_tokens"] == 4 * 32 and s["cached_tokens"] == 4 * 8
    assert s["output_tokens"] == 8
    b = sorted(FakeOpenAI.bodies, key=lambda b: b["max_tokens"])
    assert all(x["stream"] is True and x["ignore_eos"] is True and x["model"] == "m1"
               and x["stream_options"] == {"include_usage": True} for x in b)
    assert sorted(x["max_tokens"] for x in b) == sorted(r["output_length"] for r in reqs)
    # the shared hash id expands to the same 16 tokens; the others differ
    prompts = [x["prompt"] for x in FakeOpenAI.bodies]
    assert all(len(p) == 32 for p in prompts)
    assert all(p[:16] == prompts[0][:16] for p in prompts)
    assert len({tuple(p[16:]) for p in prompts}) == 4


def test_chat_request_shape_and_nul_text(fake_server, tmp_path):
    trace, _ = small_trace(tmp_path, n=3)
    rec = tmp_path / "rec.jsonl"
    s = summary(kvbench("--trace", trace, "--url", "http://127.0.0.1:%d" % fake_server.server_port,
                        "--block-size", 16, "--chat", "--speedup", 100, "--records", rec))
    assert s["completed"] == 3 and s["errors"] == 0 and s["prompts"] == "chat", s
    assert all(r["chunks"] == 2 for r in records(rec))
    for b in FakeOpenAI.bodies:
        assert b["path"] == "/v1/chat/completions" and "prompt" not in b
        assert [m["role"] for m in b["messages"]] == ["user"]
        assert len(b["messages"][0]["content"].split()) == 32


def test_arrival_times_are_scaled(fake_server, tmp_path):
    trace = write_trace(str(tmp_path / "t.jsonl"), [
        {"timestamp": 1000, "input_length": 8, "output_length": 1, "hash_ids": [1]},
        {"timestamp": 1600, "input_length": 8, "output_length": 1, "hash_ids": [2]}])
    rec = tmp_path / "rec.jsonl"
    summary(kvbench("--trace", trace, "--url", "http://127.0.0.1:%d" % fake_server.server_port,
                    "--speedup", 2, "--records", rec))
    rs = records(rec)
    assert rs[0]["due_ms"] == 0 and rs[1]["due_ms"] == pytest.approx(300)
    # never sent early (a busy machine may only send it later: no upper bound)
    assert rs[1]["start_ms"] >= 290


def test_dead_url_counts_errors(tmp_path):
    trace, _ = small_trace(tmp_path, n=3)
    s = summary(kvbench("--trace", trace, "--url", "http://127.0.0.1:%d" % kvt.free_port(),
                        "--speedup", 100, "--timeout", 5))
    assert s["errors"] == 3 and s["completed"] == 0
    assert s["ttft_ms"] is None and s["hit_rate"] is None
    assert sum(s["error_kinds"].values()) == 3


def test_http_errors_are_counted(stack, tmp_path):
    w = stack.worker(engines=1)
    trace, _ = small_trace(tmp_path, n=2)
    s = summary(kvbench("--trace", trace, "--url", "http://127.0.0.1:%d/v1/nowhere" % w.ports[0],
                        "--speedup", 100))
    assert s["errors"] == 2
    assert all(k.startswith("HTTP 4") for k in s["error_kinds"]), s["error_kinds"]


def test_bad_trace_line_is_reported_with_its_number(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n'
                 '\n'
                 '{"timestamp": 5, "input_length": "x", "output_length": 2, "hash_ids": [1]}\n')
    r = kvbench("--trace", p, "--url", "http://127.0.0.1:9")
    assert r.returncode == 2
    assert "line 3" in r.stderr and "input_length" in r.stderr
    assert r.stdout == ""


def test_usage_errors(tmp_path):
    trace, _ = small_trace(tmp_path, n=1)
    for args in (["--trace", trace], ["--trace", trace, "--url", "ftp://x"],
                 ["--trace", trace, "--url", "http://h:1", "--speedup", "0"],
                 ["--url", "http://h:1"], ["--trace", tmp_path / "missing", "--url", "http://h:1"]):
        r = kvbench(*args)
        assert r.returncode == 2 and r.stderr.startswith("kvbench: "), (args, r.stderr)


def test_ideal_reuse(tmp_path):
    trace = write_trace(str(tmp_path / "t.jsonl"), [
        {"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]},
        {"timestamp": 1, "input_length": 1024, "output_length": 1, "hash_ids": [1, 3]}])
    r = subprocess.run([KVBENCH, "ideal", "--trace", trace], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"requests": 2, "ideal_reuse": 0.25}


def oracle(trace, *args):
    r = subprocess.run([KVBENCH, "oracle", "--trace", trace] + [str(a) for a in args],
                       capture_output=True, text=True, timeout=60, env=kvt.sanitizer_env())
    return r


def oracle_json(trace, *args):
    r = oracle(trace, *args)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("\n") == 1, r.stdout
    assert "oracle:" in r.stderr and "hit rate" in r.stderr     # the human line
    return json.loads(r.stdout)


# Four 2-block prompts (trace block = engine block = 16 tokens), 2 engines of 2 blocks each.
ORACLE_TRACE = [([1, 2], 32), ([1, 3], 32), ([4, 5], 32), ([1, 2], 32)]


def oracle_trace(tmp_path, reqs=ORACLE_TRACE):
    return write_trace(str(tmp_path / "oracle.jsonl"),
                       [{"timestamp": i, "input_length": n, "output_length": 1, "hash_ids": ids}
                        for i, (ids, n) in enumerate(reqs)])


def test_oracle_load_bound_by_hand(tmp_path):
    """Worked by hand with balance 1.5 (W = assigned uncached tokens):
    r0 [1,2]: no engine eligible (2*32 > 1.5*32): fallback to e0. W=[32,0]
    r1 [1,3]: e0 has [1] but 2*(32+16) > 1.5*48; e1 ok: e1, 0 cached. W=[32,32]
    r2 [4,5]: both eligible, no prefix, equal work: e0, which evicts [1,2] and [1]. W=[64,32]
    r3 [1,2]: e0 has nothing now, e1 has [1]: e1, 16 cached (evicts [1,3]). W=[64,48]
    Oracle 16/128; ideal (one infinite cache) r1 16 + r3 32 = 48/128; spread 64/56."""
    s = oracle_json(oracle_trace(tmp_path), "--engines", 2, "--cache-tokens", 32,
                    "--block-size", 16, "--trace-block-size", 16, "--balance", 1.5)
    assert s["requests"] == 4 and s["prompt_tokens"] == 128
    assert s["oracle_cached_tokens"] == 16 and s["ideal_cached_tokens"] == 48
    assert s["oracle_hit_rate"] == pytest.approx(0.125)
    assert s["ideal_hit_rate"] == pytest.approx(0.375)
    assert s["oracle_share_of_ideal"] == pytest.approx(1 / 3, abs=1e-5)
    assert s["fallbacks"] == 1 and s["evictions"] == 3
    assert s["oracle_work_spread"] == pytest.approx(64 / 56, abs=1e-5)


def test_oracle_without_load_bound_by_hand(tmp_path):
    """Balance 100 (no bound): r1 follows [1] to e0 (16 cached) and, touched tail first,
    evicts [1,2]; r2 goes to the idle e1; r3 finds only [1] on e0: 32/128."""
    s = oracle_json(oracle_trace(tmp_path), "--engines", 2, "--cache-tokens", 32,
                    "--block-size", 16, "--trace-block-size", 16, "--balance", 100)
    assert s["oracle_cached_tokens"] == 32 and s["fallbacks"] == 0
    assert s["oracle_hit_rate"] == pytest.approx(0.25)
    # a cache big enough for everything on one engine reaches the ideal
    s = oracle_json(oracle_trace(tmp_path), "--engines", 1, "--cache-tokens", 1000,
                    "--block-size", 16, "--trace-block-size", 16)
    assert s["oracle_cached_tokens"] == s["ideal_cached_tokens"] == 48
    assert s["evictions"] == 0


def test_oracle_two_speeds_by_hand(tmp_path):
    """Six 16-token prompts that share nothing, 2 engines, balance 1: the bound counts work
    in time. One speed: the work splits 48:48. With the second engine at half speed
    (speeds 1 and 0.5, sum 1.5), e is eligible when 1.5 x (W_e + 16) <= (sum W + 16) x s_e:
    r0, r1 fall back to e0 ((W+u)/s: 16 against 32, then 32 against 32, the lower index),
    r2 fits e1 (24 <= 24), r3 and r4 fall back to e0, r5 fits e1 (48 <= 48): 64:32, the
    speeds' ratio. --slow-factor 1 is the one-speed oracle."""
    t = oracle_trace(tmp_path, [([i], 16) for i in range(1, 7)])
    args = ["--engines", 2, "--cache-tokens", 1024, "--block-size", 16, "--trace-block-size",
            16, "--balance", 1]
    one = oracle_json(t, *args)
    assert one["oracle_work_spread"] == pytest.approx(1.0) and one["fallbacks"] == 3
    assert "slow_engines" not in one
    two = oracle_json(t, *args, "--slow-engines", 1, "--slow-factor", 0.5)
    assert two["oracle_work_spread"] == pytest.approx(64 / 48, abs=1e-5)
    assert two["fallbacks"] == 4
    assert two["slow_engines"] == 1 and two["slow_factor"] == 0.5
    same = oracle_json(t, *args, "--slow-engines", 1, "--slow-factor", 1)
    assert same["oracle_work_spread"] == one["oracle_work_spread"]
    assert same["fallbacks"] == one["fallbacks"]
    # more slow engines than engines, or a factor outside (0, 1]: refused with a reason
    for bad in (["--slow-engines", 3], ["--slow-engines", 1, "--slow-factor", 0],
                ["--slow-engines", 1, "--slow-factor", 1.5]):
        r = oracle(t, *args, *bad)
        assert r.returncode == 2 and "slow" in r.stderr, (bad, r.stderr)


def test_oracle_engine_blocks_inside_trace_blocks(tmp_path):
    """Trace blocks of 32 tokens, engine blocks of 16: only full engine blocks count.
    r0 [7] 20 tokens: one full block. r1 [7,8] 40 tokens: two full blocks, the first
    is r0's (tokens 0-15 of id 7). r2 [9] 40 tokens: tokens 32-39 are its own."""
    t = oracle_trace(tmp_path, [([7], 20), ([7, 8], 40), ([9], 40), ([7], 31)])
    s = oracle_json(t, "--engines", 1, "--cache-tokens", 1 << 20, "--block-size", 16,
                    "--trace-block-size", 32)
    # r3 (31 tokens, one full block) finds block 0 of id 7
    assert s["prompt_tokens"] == 131
    assert s["ideal_cached_tokens"] == 32 and s["oracle_cached_tokens"] == 32


# The mock's prefill model (workers/kvw_mock_model.c), worked by hand:
# prefill(16) = 16.74446, prefill(32) = 16.98772 ms.
def test_oracle_floor_by_hand(tmp_path):
    """Same fleet as test_oracle_load_bound_by_hand, engine speedup 2. The engine computes at
    least one token, so a fully cached 32-token prompt still computes its last 16-token block.
    Ideal hits 0, 16, 0, 32 -> computed 32, 16, 32, 16; oracle hits 0, 0, 0, 16 -> 32, 32, 32,
    16. The order-free floor takes the ideal's 48 hits of 128 tokens as a total: (80 tokens x
    0.01518344 + 4 steps x 16.50142) / 4 / 2. Without --floor-speedup there is no floor."""
    args = ["--engines", 2, "--cache-tokens", 32, "--block-size", 16, "--trace-block-size", 16,
            "--balance", 1.5]
    s = oracle_json(oracle_trace(tmp_path), *args, "--floor-speedup", 2)
    assert s["ideal_floor_ttft_ms"] == pytest.approx((2 * 16.98772 + 2 * 16.74446) / 4 / 2,
                                                     abs=1e-3)
    assert s["oracle_floor_ttft_ms"] == pytest.approx((3 * 16.98772 + 16.74446) / 4 / 2,
                                                      abs=1e-3)
    assert s["any_order_floor_ttft_ms"] == pytest.approx((80 * 0.01518344 + 4 * 16.50142) / 8,
                                                         abs=1e-3)
    assert s["floor_budget"] == 8192
    assert "ideal_floor_ttft_ms" not in oracle_json(oracle_trace(tmp_path), *args)


def floor_json(records, *args):
    r = subprocess.run([KVBENCH, "floor", "--records", records] + [str(a) for a in args],
                       capture_output=True, text=True, timeout=60, env=kvt.sanitizer_env())
    return r


def test_floor_of_recorded_requests(tmp_path):
    """kvbench floor reads a replay's records: a 20,000-token prompt with a budget of 8,192
    tokens a step is cheapest in 3 steps (3 x prefill(6,667) = 409.31 ms; 2 steps 420.87, 4
    steps 411.77); with a budget of 30,000 the floor still splits it in 3, since one step
    (488.57 ms) costs more. Failed requests and lines that are not records are skipped."""
    rec = tmp_path / "records.jsonl"
    rec.write_text("\n".join([
        json.dumps({"prompt_tokens": 32, "cached_tokens": 32, "ttft_ms": 20.0, "status": 200}),
        json.dumps({"prompt_tokens": 20000, "cached_tokens": 0, "ttft_ms": 500.0,
                    "status": 200}),
        json.dumps({"prompt_tokens": 64, "cached_tokens": 0, "ttft_ms": None, "status": 0}),
        "not json"]) + "\n")
    for budget in (8192, 30000):
        r = floor_json(str(rec), "--block-size", 16, "--floor-speedup", 1,
                       "--floor-budget", budget)
        assert r.returncode == 0, r.stderr
        f = json.loads(r.stdout)
        assert f["requests"] == 2 and f["skipped"] == 2
        assert f["ttft_ms"] == pytest.approx(260.0)
        assert f["floor_ttft_ms"] == pytest.approx((16.74446 + 409.30625) / 2, abs=1e-3)
    r = floor_json(str(tmp_path / "missing.jsonl"), "--floor-speedup", 1)
    assert r.returncode == 2 and "missing.jsonl" in r.stderr and r.stdout == ""
    r = floor_json(str(rec))            # no --floor-speedup: nothing to compute
    assert r.returncode == 2 and "--floor-speedup" in r.stderr


def test_oracle_is_deterministic_and_rejects_bad_options(tmp_path):
    t = oracle_trace(tmp_path)
    args = ["--engines", 2, "--cache-tokens", 32, "--block-size", 16]
    a = oracle(t, *args)
    assert a.returncode == 0 and a.stdout == oracle(t, *args).stdout
    # cache-tokens 8 is less than one 16-token block
    for bad in (["--balance", "0.5"], ["--engines", "0"], ["--cache-tokens", "8"],
                ["--block-size", "x"]):
        r = oracle(t, *(["--block-size", 16] if bad[0] != "--block-size" else []), *bad)
        assert r.returncode == 2 and "kvbench" in r.stderr and r.stdout == "", bad
