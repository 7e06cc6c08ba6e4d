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
    for k in ("ttft_ms", "itl_ms", "e2e_ms"):
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


class FakeOpenAI(http.server.BaseHTTPRequestHandler):
    """Streams two tokens and a usage chunk saying a quarter of the prompt was cached."""
    protocol_version = "HTTP/1.1"
    bodies = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeOpenAI.bodies.append(body)
        n = len(body["prompt"])
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        events = [{"choices": [{"index": 0, "text": " hi"}]},
                  {"choices": [{"index": 0, "text": " there"}]},
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
