"""Disaggregated prefill and decode between real kvworker processes
(the worker side): a decode worker given X-KVRoute-Prefill pulls
the prompt's KV from that prefill worker over POST /kvroute/v1/prefill
(docs/PROTOCOL.md) and decodes; any failure falls back to a local prefill.
Direct HTTP to the workers, no nginx."""
import ctypes
import http.client
import http.server
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import threading

import pytest

import kvt
import kvnats

TINY = os.path.join(kvt.BIN, "kvtiny-model")
QWEN_TOK = os.path.join(kvt.TOP, "conf", "tokenizers", "qwen2.5-instruct", "tokenizer.json")
PATH = "/kvroute/v1/prefill"
HDR, BLK, END, TOK = 64, 32, 16, 24

_xxh = ctypes.CDLL("libxxhash.so.0")
_xxh.XXH3_64bits.restype = ctypes.c_uint64
_xxh.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]


def xxh3(b):
    return _xxh.XXH3_64bits(bytes(b), len(b))


PROMPT = ("The cat sat on the mat and looked at the long quiet street for a while, "
          "then it walked to the window and watched the rain fall on the old roofs. ") * 3
MORE = " After a long time it went back to sleep by the warm fire, dreaming of fish."


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("disagg") / "tiny")
    r = subprocess.run([TINY, "--out", d, "--tokenizer", QWEN_TOK, "--seed", "5", "--layers",
                        "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2"],
                       capture_output=True, text=True, cwd=kvt.TOP)
    assert r.returncode == 0, r.stderr
    return d


def cpu(stack, model, role="aggregated", extra=(), wait=True):
    return stack.worker(extra=["--engine", "cpu", "--model", model, "--num-blocks", "512",
                               "--role", role] + list(extra), wait=wait)


def addr(w):
    return "127.0.0.1:%d" % w.ports[0]


def metrics(w):
    _, _, body = kvt.request(w.ports[0], "GET", "/metrics")
    out = {}
    for line in body.decode().splitlines():
        m = re.match(r'^(\w+)\{engine="0"\} (\S+)$', line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def complete(w, prompt, prefill=None, stream=False, chat=False, max_tokens=8, timeout=60,
             **sampling):
    """(status, headers, text) of a greedy request (or sampled, with sampling's fields),
    streamed or not."""
    body = {"max_tokens": max_tokens, "temperature": 0, "stream": stream}
    body.update(sampling)
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    headers = {"X-KVRoute-Prefill": prefill} if prefill else {}
    status, hdrs, data = kvt.request(w.ports[0], "POST", path, body, headers, timeout=timeout)
    if status != 200:
        return status, hdrs, data.decode()
    if not stream:
        c = json.loads(data)["choices"][0]
        return status, hdrs, c["message"]["content"] if chat else c["text"]
    text = ""
    for e in kvt.sse_events(data):
        if e == "[DONE]":
            continue
        for c in json.loads(e).get("choices", []):
            text += (c.get("delta", {}).get("content") or "") if chat else c.get("text", "")
    return status, hdrs, text


# --- the CPU engine: the same greedy output, aggregated or split -----------------------

@pytest.fixture
def trio(stack, model):
    """An aggregated worker, a prefill worker and a decode worker that always disaggregates."""
    return stack.ready(cpu(stack, model, wait=False), cpu(stack, model, "prefill", wait=False),
                       cpu(stack, model, "decode", ["--disagg-min-tokens", "1"], wait=False))


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_split_output_equals_aggregated(trio, chat, stream):
    agg, pre, dec = trio
    s, _, want = complete(agg, PROMPT, chat=chat, stream=stream)
    assert s == 200, want
    s, h, got = complete(dec, PROMPT, prefill=addr(pre), chat=chat, stream=stream)
    assert s == 200, got
    assert h.get("x-kvroute-prefilled-by") == addr(pre), h
    assert got == want
    m, p = metrics(dec), metrics(pre)
    assert m["kvworker_xfer_pulled_total"] == 1 and m["kvworker_xfer_fallbacks_total"] == 0
    # the first token came with the KV, sampled by the prefill worker
    assert m["kvworker_xfer_first_tokens_total"] == 1
    assert m["kvworker_xfer_pulled_blocks_total"] >= 4
    # real bytes moved: the engine's blocks, all layers, K and V
    assert m["kvworker_xfer_pulled_bytes_total"] == p["kvworker_xfer_served_bytes_total"] > 0
    assert p["kvworker_xfer_served_total"] == 1


@pytest.mark.parametrize("sampling", [
    {"temperature": 0.9, "top_p": 0.95, "top_k": 40, "seed": 1234},
    {"temperature": 1.3},                       # no seed: both sides seed from the prompt
    {"temperature": 0.7, "seed": -5},           # a negative seed: 64 bits either way
], ids=["seeded", "unseeded", "negative-seed"])
def test_split_sampled_output_equals_aggregated(trio, sampling):
    """Sampled, not greedy: the prefill worker samples the first token with the
    request's own parameters and seed, and the decode worker goes on from the
    sampler's state after it, so the answer is the aggregated worker's, token
    for token (one sample draw more or less on either side would change it)."""
    agg, pre, dec = trio
    s, _, want = complete(agg, PROMPT, max_tokens=24, **sampling)
    assert s == 200, want
    s, h, got = complete(dec, PROMPT, prefill=addr(pre), max_tokens=24, **sampling)
    assert s == 200 and h.get("x-kvroute-prefilled-by") == addr(pre), (h, got)
    assert got == want
    assert metrics(dec)["kvworker_xfer_first_tokens_total"] == 1
    # a greedy answer differs from these (else the test would not test sampling)
    assert complete(agg, PROMPT, max_tokens=24)[2] != want


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_split_one_token_answer(trio, stream):
    """max_tokens 1: the given first token is the whole answer; the decode
    worker finishes the request without a step of its own."""
    agg, pre, dec = trio
    s, _, want = complete(agg, PROMPT, max_tokens=1, stream=stream)
    s, h, got = complete(dec, PROMPT, prefill=addr(pre), max_tokens=1, stream=stream)
    assert s == 200 and h.get("x-kvroute-prefilled-by") == addr(pre), (h, got)
    assert got == want and got != ""
    m = metrics(dec)
    assert m["kvworker_xfer_first_tokens_total"] == 1
    assert m["kvworker_generation_tokens_total"] == 1


def test_part_cached_on_decode_side(trio):
    """The decode worker already holds the prompt's first blocks: it asks only for
    the rest, and the output is still the aggregated one."""
    agg, pre, dec = trio
    s, h, _ = complete(dec, PROMPT)                 # no header: a local prefill
    assert s == 200 and h.get("x-kvroute-prefilled-by") == "local"
    before = metrics(dec)["kvworker_xfer_pulled_blocks_total"]
    s, _, want = complete(agg, PROMPT + MORE)
    s, h, got = complete(dec, PROMPT + MORE, prefill=addr(pre))
    assert s == 200 and h.get("x-kvroute-prefilled-by") == addr(pre), (h, got)
    assert got == want
    m = metrics(dec)
    n_prompt_blocks = m["kvworker_kv_blocks_used"]      # an upper bound
    pulled = m["kvworker_xfer_pulled_blocks_total"] - before
    assert 0 < pulled < n_prompt_blocks
    # the served side sent exactly what the decode side lacked
    assert metrics(pre)["kvworker_xfer_served_blocks_total"] == pulled
    # and again, now all cached on the decode side: short uncached part, local
    s, h, again = complete(dec, PROMPT + MORE, prefill=addr(pre))
    assert h.get("x-kvroute-prefilled-by") == "local" and again == want


def test_short_prompt_prefilled_locally(stack, model):
    """Conditional disaggregation: under --disagg-min-tokens uncached tokens, local."""
    agg, pre, dec = stack.ready(
        cpu(stack, model, wait=False), cpu(stack, model, "prefill", wait=False),
        cpu(stack, model, "decode", ["--disagg-min-tokens", "100000"], wait=False))
    s, _, want = complete(agg, PROMPT)
    s, h, got = complete(dec, PROMPT, prefill=addr(pre))
    assert s == 200 and got == want
    assert h.get("x-kvroute-prefilled-by") == "local"
    assert "short" in h.get("x-kvroute-prefill-fallback", "")
    assert metrics(pre)["kvworker_xfer_served_total"] == 0


def test_aggregated_and_prefill_roles_ignore_the_header(trio):
    agg, pre, _ = trio
    for w in (agg, pre):
        s, h, _ = complete(w, PROMPT, prefill="127.0.0.1:1")
        assert s == 200 and "x-kvroute-prefilled-by" not in h


def test_prefill_unreachable_falls_back(stack, model):
    agg, dec = stack.ready(cpu(stack, model, wait=False),
                           cpu(stack, model, "decode", ["--disagg-min-tokens", "1"], wait=False))
    s, _, want = complete(agg, PROMPT)
    dead = "127.0.0.1:%d" % kvt.free_port()
    for target in (dead, "no-port-here", "[::1]:0"):
        s, h, got = complete(dec, PROMPT + target, prefill=target)
        assert s == 200, got
        assert h.get("x-kvroute-prefilled-by") == "local" and h["x-kvroute-prefill-fallback"]
    s, h, got = complete(dec, PROMPT, prefill=dead)
    assert got == want
    assert metrics(dec)["kvworker_xfer_fallbacks_total"] >= 1


def test_prefill_killed_mid_request_falls_back(stack, model):
    """The prefill worker dies holding the request (stopped, then killed): the decode
    worker prefills locally, with the same output."""
    agg, pre, dec = stack.ready(
        cpu(stack, model, wait=False), cpu(stack, model, "prefill", wait=False),
        cpu(stack, model, "decode", ["--disagg-min-tokens", "1"], wait=False))
    s, _, want = complete(agg, PROMPT)
    os.kill(pre.pid, signal.SIGSTOP)
    out = {}
    t = threading.Thread(target=lambda: out.update(r=complete(dec, PROMPT, prefill=addr(pre))))
    t.start()
    # the decode worker's request sits in the stopped worker's socket
    kvt.wait_until(lambda: established(pre.ports[0]), what="the transfer connection")
    os.kill(pre.pid, signal.SIGKILL)
    t.join(60)
    s, h, got = out["r"]
    assert s == 200 and got == want
    assert h.get("x-kvroute-prefilled-by") == "local" and h["x-kvroute-prefill-fallback"]


# --- the prefill side fails mid-stream (kvw_xfer_serve.c cut_short, --xfer-fault) ----

@pytest.fixture(scope="module")
def big_model(tmp_path_factory):
    """Blocks large enough that a transfer spans several send windows (4 MB):
    32 layers, 2 KV heads of 64, f32: 512 KiB per 16-token block, 7 per window;
    little compute per token (hidden 128, a narrow MLP)."""
    d = str(tmp_path_factory.mktemp("disagg-big") / "tiny")
    r = subprocess.run([TINY, "--out", d, "--tokenizer", QWEN_TOK, "--seed", "7", "--layers",
                        "32", "--hidden", "128", "--heads", "2", "--kv-heads", "2",
                        "--intermediate", "64"], capture_output=True, text=True, cwd=kvt.TOP)
    assert r.returncode == 0, r.stderr
    return d


FAULT_AT = 10       # blocks sent before the fault: past the first window (7 blocks)
# the prefill side's --xfer-timeout-ms: from the request's arrival to the stream's end
STALL_MS = 3000


@pytest.mark.parametrize("kind", ["read", "alloc", "stall"])
def test_prefill_fails_mid_stream(stack, big_model, kind):
    """The prefill worker has sent the reply's head and its first window of blocks when
    it fails (a block read, a send buffer's allocation, or nothing more is sent until
    its serve timeout): it cuts the connection, the decode worker sees the cut at once
    (its own deadline is ten minutes, the request's two), prefills locally, and
    answers what the aggregated worker answers; nothing of the cut stream is used."""
    agg = cpu(stack, big_model, wait=False)
    # the serve timeout counts from the request's arrival, the prefill's compute included
    # (seconds under the sanitizers). "stall" waits it out twice, so its prefill worker
    # holds each prompt before the transfer (warm(), below): the timeout then covers only
    # the stream, and a short one is still one that "stall" is what cuts. "read" and
    # "alloc" keep the computed prefill's way into the stream, and a timeout that only
    # a stall reaches.
    timeout_ms = STALL_MS if kind == "stall" else 15000
    pre = cpu(stack, big_model, "prefill", ["--xfer-fault", "%s:%d" % (kind, FAULT_AT),
                                            "--xfer-timeout-ms", str(timeout_ms)], wait=False)
    dec = cpu(stack, big_model, "decode", ["--disagg-min-tokens", "1",
                                           "--xfer-timeout-ms", "600000"], wait=False)
    stack.ready(agg, pre, dec)

    def warm(p):
        if kind == "stall":
            s, _, data = complete(pre, p, max_tokens=1, timeout=120)
            assert s == 200, data

    prompt = PROMPT * 4
    status, _, data = kvt.request(agg.ports[0], "POST", "/v1/completions",
                                  {"prompt": prompt, "max_tokens": 1}, timeout=60)
    assert status == 200, data
    n_blocks = json.loads(data)["usage"]["prompt_tokens"] // 16
    assert n_blocks > FAULT_AT + 2, n_blocks       # the fault lands inside the stream
    s, _, want = complete(agg, prompt)
    assert s == 200, want
    warm(prompt)
    s, h, got = complete(dec, prompt, prefill=addr(pre), timeout=120)
    assert s == 200, got
    assert h.get("x-kvroute-prefilled-by") == "local", h
    # the reply's head had arrived (a refusal or a dead peer reads otherwise): a cut stream
    assert "closed mid-transfer" in h["x-kvroute-prefill-fallback"], (h, open(pre.log).read()[-3000:])
    assert got == want
    m, p = metrics(dec), metrics(pre)
    assert m["kvworker_xfer_fallbacks_total"] == 1 and m["kvworker_xfer_pulled_total"] == 0
    # blocks had arrived, and were checked, before the cut (window 2 is only queued once
    # half of window 1 reached the socket); they were dropped, never joined the cache
    assert 0 < m["kvworker_xfer_pulled_blocks_total"] < n_blocks
    # the prefill side queued the first window(s), then failed: no transfer was served whole
    assert FAULT_AT <= p["kvworker_xfer_served_blocks_total"] < n_blocks
    assert p["kvworker_xfer_served_total"] == 0
    with open(pre.log, errors="replace") as f:
        log = f.read()
    assert "--xfer-fault %s injected at block %d" % (kind, FAULT_AT) in log, log[-2000:]
    if kind == "stall":
        assert "timed out after %d ms (streaming)" % STALL_MS in log, log[-2000:]
    # the prefill worker let its pins go and still serves (every transfer fails the same way)
    kvt.wait_until(lambda: metrics(pre)["kvworker_kv_blocks_active"] == 0,
                   what="the prefill worker's pins released")
    warm("Again. " + prompt)
    s, h, got = complete(dec, "Again. " + prompt, prefill=addr(pre), timeout=120)
    assert s == 200 and h.get("x-kvroute-prefilled-by") == "local", h
    assert metrics(dec)["kvworker_xfer_fallbacks_total"] == 2


def established(port):
    r = subprocess.run(["ss", "-Htn", "state", "established", "( sport = :%d )" % port],
                       capture_output=True, text=True)
    return r.returncode == 0 and r.stdout.strip() != ""


# --- a forging proxy: the real stream, altered on its way ---------------------------------

class Forger:
    """Serves POST /kvroute/v1/prefill by asking the real prefill worker and
    passing its answer on through edit(bytes) -> bytes (or a callable that
    writes the reply itself)."""

    def __init__(self, upstream_port):
        self.edit = lambda b: b
        self.cut = None                 # bytes to send before dropping the connection
        self.body = None                # the last transfer request
        forger = self

        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                forger.body = body
                c = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=60)
                c.request("POST", PATH, body, {"Content-Type": "application/json"})
                r = c.getresponse()
                data = r.read()
                c.close()
                if r.status == 200:
                    data = forger.edit(data)
                self.send_response(r.status)
                self.send_header("Content-Type", r.getheader("Content-Type"))
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Connection", "close")
                self.end_headers()
                if forger.cut is not None:
                    self.wfile.write(data[:forger.cut])
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.wfile.write(data)

        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.srv.server_address[1]
        self.thread = threading.Thread(target=self.srv.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.srv.shutdown()
        self.srv.server_close()


def reheader(data, **fields):
    """Rewrites header fields, with a valid checksum: a consistent but wrong peer."""
    h = bytearray(data[:HDR])
    offs = {"model_fp": (8, "<Q"), "layout_fp": (16, "<Q"), "block_size": (24, "<I"),
            "first": (28, "<I"), "count": (32, "<I"), "block_bytes": (40, "<Q")}
    for k, v in fields.items():
        o, f = offs[k]
        struct.pack_into(f, h, o, v)
    struct.pack_into("<Q", h, 56, xxh3(h[:56]))
    return bytes(h) + data[HDR:]


def blocks_at(data):
    """Where the first block frame starts: after the header and, when its flags say
    so (KVX_F_TOKEN), the first-token frame."""
    return HDR + (TOK if struct.unpack_from("<I", data, 36)[0] & 2 else 0)


def flip(data, at):
    b = bytearray(data)
    b[at] ^= 0x40
    return bytes(b)


FORGERIES = {
    "model_fp": (lambda d: reheader(d, model_fp=12345), "model fingerprint"),
    "block_size": (lambda d: reheader(d, block_size=32), "block size"),
    "layout_fp": (lambda d: reheader(d, layout_fp=99), "layout fingerprint"),
    "block_bytes": (lambda d: reheader(d, block_bytes=1024), "block bytes"),
    "bad_hash": (lambda d: flip(d, blocks_at(d) + 8), "is not the prompt's"),
    "bad_payload": (lambda d: flip(d, blocks_at(d) + BLK + 100), "checksum"),
    "bad_first_token": (lambda d: flip(d, HDR + 4), "first-token frame"),
    "truncated": (lambda d: d[:blocks_at(d) + BLK + 1000], "truncated"),
    "no_end_frame": (lambda d: d[:-END], "truncated"),
    "garbage": (lambda d: b"\x00" * len(d), "magic"),
    "trailing": (lambda d: d + b"xx", "after the end"),
}


@pytest.fixture
def forged(stack, model):
    agg, pre, dec = stack.ready(
        cpu(stack, model, wait=False), cpu(stack, model, "prefill", wait=False),
        cpu(stack, model, "decode", ["--disagg-min-tokens", "1"], wait=False))
    f = Forger(pre.ports[0])
    yield agg, pre, dec, f
    f.close()


def test_malformed_transfers_refused(forged):
    agg, pre, dec, f = forged
    for name, (edit, reason) in sorted(FORGERIES.items()):
        # a prompt of its own each time: a fallback caches its blocks on the decode side
        prompt = name + ": " + PROMPT
        s, _, want = complete(agg, prompt)
        f.edit = edit
        s, h, got = complete(dec, prompt, prefill="127.0.0.1:%d" % f.port)
        assert s == 200, (name, got)
        assert h.get("x-kvroute-prefilled-by") == "local", (name, h)
        assert reason in h["x-kvroute-prefill-fallback"], (name, h)
        # nothing of the refused transfer was used
        assert got == want, name
    # the decode worker still takes transfers, and serves them correctly, afterwards
    f.edit = lambda d: d
    s, _, want = complete(agg, PROMPT + MORE)
    s, h, got = complete(dec, PROMPT + MORE, prefill="127.0.0.1:%d" % f.port)
    assert h.get("x-kvroute-prefilled-by") == "127.0.0.1:%d" % f.port and got == want
    m = metrics(dec)
    assert m["kvworker_xfer_fallbacks_total"] == len(FORGERIES)
    assert m["kvworker_xfer_pulled_total"] == 1


def test_connection_cut_mid_stream(forged):
    """The prefill worker's connection drops in the middle of the blocks."""
    agg, pre, dec, f = forged
    s, _, want = complete(agg, PROMPT)
    f.cut = HDR + BLK + 500
    s, h, got = complete(dec, PROMPT, prefill="127.0.0.1:%d" % f.port)
    assert s == 200 and got == want
    assert h.get("x-kvroute-prefilled-by") == "local", h
    assert h["x-kvroute-prefill-fallback"], h


def test_prefill_side_refuses_mismatch(stack, model, tmp_path):
    """The prefill worker checks the request first: another model -> 409 with a reason."""
    other = str(tmp_path / "renamed")
    shutil.copytree(model, other)
    agg, pre, dec = stack.ready(
        cpu(stack, model, wait=False), cpu(stack, other, "prefill", wait=False),
        cpu(stack, model, "decode", ["--disagg-min-tokens", "1"], wait=False))
    s, _, want = complete(agg, PROMPT)
    s, h, got = complete(dec, PROMPT, prefill=addr(pre))
    assert s == 200 and got == want
    assert h.get("x-kvroute-prefilled-by") == "local"
    assert "409" in h["x-kvroute-prefill-fallback"]
    assert "model_mismatch" in h["x-kvroute-prefill-fallback"]
    assert metrics(pre)["kvworker_xfer_refused_total"] == 1
    # a malformed request body is refused with a reason too
    s, _, data = kvt.request(pre.ports[0], "POST", PATH, {"v": 1, "tokens": "x"})
    assert s == 400 and b"tokens" in data
    s, _, data = kvt.request(pre.ports[0], "GET", PATH)
    assert s == 405


# --- the mock engine: manifests, link time, events -------------------------------------

def mock(stack, role, extra=()):
    return stack.worker(extra=["--role", role, "--speedup", "100"] + list(extra))


def test_mock_roles_charge_link_time(stack):
    # both sides model the same KV size (it is part of the layout fingerprint)
    agg, pre = mock(stack, "aggregated"), mock(stack, "prefill", ["--kv-bytes-per-token", "1000"])
    dec = mock(stack, "decode", ["--disagg-min-tokens", "1", "--link-gbps", "pcie",
                                 "--kv-bytes-per-token", "1000"])
    prompt = "x" * 1000          # one token per byte: 62 full blocks of 16
    s, _, want = complete(agg, prompt, max_tokens=6)
    s, h, got = complete(dec, prompt, prefill=addr(pre), max_tokens=6)
    assert s == 200 and got == want
    assert h.get("x-kvroute-prefilled-by") == addr(pre)
    m = metrics(dec)
    blocks = (1000 - 1) // 16
    assert m["kvworker_xfer_pulled_blocks_total"] == blocks
    assert m["kvworker_xfer_pulled_bytes_total"] == blocks * 16 * 1000
    # the modelled link time: bytes x 8 / 512 Gb/s (pcie)
    assert m["kvworker_xfer_link_seconds_total"] == pytest.approx(blocks * 16 * 1000 * 8 / 512e9)
    assert metrics(pre)["kvworker_xfer_served_blocks_total"] == blocks
    assert metrics(pre)["kvworker_xfer_served_bytes_total"] == 0     # a manifest


def test_mock_mismatched_kv_size_refused(stack):
    pre = mock(stack, "prefill", ["--kv-bytes-per-token", "2000"])
    dec = mock(stack, "decode", ["--disagg-min-tokens", "1"])
    s, h, _ = complete(dec, "y" * 600, prefill=addr(pre))
    assert s == 200 and "layout_mismatch" in h["x-kvroute-prefill-fallback"]


def test_lora_request_pulls_its_adapters_blocks(stack):
    """A LoRA adapter's blocks are hashed with its name (as vLLM keeps them
    apart): the transfer names the adapter, so the prefill side computes and
    sends the adapter's blocks. It refuses an adapter it does not serve, and
    the decode side prefills that one itself."""
    lora = ["--lora-modules", "sql", "--model", "base"]
    pre = mock(stack, "prefill", lora)
    dec = mock(stack, "decode", ["--disagg-min-tokens", "1", "--lora-modules", "sql,chat",
                                 "--model", "base"])
    prompt = "q" * 700
    blocks = (700 - 1) // 16
    s, h, _ = complete(dec, prompt, prefill=addr(pre), max_tokens=2, model="sql")
    assert s == 200 and h.get("x-kvroute-prefilled-by") == addr(pre), h
    assert metrics(dec)["kvworker_xfer_pulled_blocks_total"] == blocks
    # the decode side now holds the prompt under the adapter only
    for model, cached in (("sql", blocks * 16), ("base", 0)):
        body = {"prompt": prompt, "max_tokens": 1, "model": model}
        s, _, data = kvt.request(dec.ports[0], "POST", "/v1/completions", body)
        usage = json.loads(data)["usage"]
        assert s == 200 and usage["prompt_tokens_details"]["cached_tokens"] == cached, \
            (model, usage)
    s, h, _ = complete(dec, "r" * 700, prefill=addr(pre), max_tokens=2, model="chat")
    assert s == 200 and h.get("x-kvroute-prefilled-by") == "local"
    assert "model_mismatch" in h["x-kvroute-prefill-fallback"], h


def test_mock_overloaded_prefill_worker(stack):
    """--prefill-queue-limit: a busy prefill worker answers overloaded and the decode
    worker prefills itself."""
    pre = stack.worker(extra=["--role", "prefill", "--speedup", "0.02",
                              "--prefill-queue-limit", "1"])
    dec = mock(stack, "decode", ["--disagg-min-tokens", "1"])
    out = {}
    t = threading.Thread(target=lambda: out.update(
        r=complete(dec, "a" * 700, prefill=addr(pre), max_tokens=2)))
    t.start()
    kvt.wait_until(lambda: metrics(pre).get("kvworker_requests_running", 0) >= 1,
                   what="the first prefill to run")
    s, h, _ = complete(dec, "b" * 700, prefill=addr(pre), max_tokens=2)
    assert s == 200 and h.get("x-kvroute-prefilled-by") == "local"
    assert "prefill_overloaded" in h["x-kvroute-prefill-fallback"]
    t.join(120)
    assert out["r"][0] == 200 and out["r"][1]["x-kvroute-prefilled-by"] == addr(pre)
    assert metrics(pre)["kvworker_xfer_overloaded_total"] == 1


def test_transfer_that_asks_to_close_is_served(stack):
    """A transfer request asking the prefill worker to close the connection
    (Connection: close, or HTTP/1.0): ending the reply, libevent freed the
    connection at once and ran its close callback, which freed the
    transfer's state; the worker then freed it again and aborted."""
    pre = mock(stack, "prefill", ["--kv-bytes-per-token", "1000"])
    dec = mock(stack, "decode", ["--disagg-min-tokens", "1", "--kv-bytes-per-token", "1000"])
    f = Forger(pre.ports[0])
    try:
        via = "127.0.0.1:%d" % f.port
        s, h, _ = complete(dec, "c" * 700, prefill=via, max_tokens=2)
        assert s == 200 and h.get("x-kvroute-prefilled-by") == via, h
        for version in (11, 10):
            c = http.client.HTTPConnection("127.0.0.1", pre.ports[0], timeout=30)
            if version == 10:
                c._http_vsn, c._http_vsn_str = 10, "HTTP/1.0"
            c.request("POST", PATH, f.body, {"Content-Type": "application/json",
                                             "Connection": "close"})
            r = c.getresponse()
            data = r.read()
            c.close()
            assert r.status == 200 and data, (version, r.status, data[:200])
        assert pre.poll() is None, open(pre.log).read()[-2000:]
        assert metrics(pre)["kvworker_xfer_served_total"] == 3
    finally:
        f.close()


def test_both_pools_publish_events(stack):
    ns = stack.nats()
    nc = kvnats.Nats(ns.port)
    try:
        sid = nc.subscribe("namespace.dynamo.component.backend.kv-events")
        pre = mock(stack, "prefill", ["--nats", ns.url, "--worker-id", "1001"])
        dec = mock(stack, "decode", ["--nats", ns.url, "--worker-id", "2002",
                                     "--disagg-min-tokens", "1"])
        s, h, _ = complete(dec, "z" * 400, prefill=addr(pre))
        assert s == 200 and h.get("x-kvroute-prefilled-by") == addr(pre)

        def stored_by(msgs):
            ids = {}
            for m in msgs:
                for ev in (m.json() if isinstance(m.json(), list) else [m.json()]):
                    if "stored" in (ev["event"]["data"] or {}):
                        n = len(ev["event"]["data"]["stored"]["blocks"])
                        ids[ev["worker_id"]] = ids.get(ev["worker_id"], 0) + n
            return ids
        msgs = nc.wait(sid, lambda ms: set(stored_by(ms)) >= {1001, 2002})
        ids = stored_by(msgs)
        # both pools hold the prompt's full blocks: (400 - 1) // 16 = 24
        assert ids[1001] >= 24 and ids[2002] >= 24, ids
    finally:
        nc.close()


def test_kvxfer_bench_smoke():
    """tools/kvxfer-bench, trimmed: it runs and reports a whole transfer."""
    r = subprocess.run([os.path.join(kvt.TOP, ".venv", "bin", "python"),
                        os.path.join(kvt.TOP, "tools", "kvxfer-bench"), "--tokens", "81",
                        "--trials", "1", "--build", os.path.relpath(kvt.BUILD, kvt.TOP)],
                       capture_output=True, text=True, cwd=kvt.TOP, env=kvt.sanitizer_env(),
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")]
    assert lines[0]["blocks"] == 5 and lines[0]["bytes"] == 5 * 524288
    assert lines[-1]["summary"] and lines[-1]["GB_per_s_median"] > 0
