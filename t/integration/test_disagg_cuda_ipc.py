"""CUDA IPC between a prefill and a decode worker on one node
(docs/PROTOCOL.md, "CUDA IPC"), on the host emulation of CUDA (kvemu,
workers/cuda/emu): two real kvworker processes with the CUDA engine, the
prefill side exporting its KV pool (cudaIpcGetMemHandle, a memfd under the
emulation), the decode side mapping it (cudaIpcOpenMemHandle) and copying
the named blocks device to device. The split and forged-stream tests run
on a real GPU too (target "gpu", the nvcc build; skipped where there is
none). What the emulation cannot show (the real driver's and P2P's
behaviour, speed) is in docs/CUDA.md."""
import os
import struct
import subprocess

import pytest

import kvt
from test_cpu_engine import CONFIGS, ENGINE, cuda_env, make
from test_disagg_worker import (BLK, HDR, blocks_at, MORE, PROMPT, Forger, addr, complete, metrics,
                                xxh3)

IPC = 96        # the IPC frame after the header (docs/PROTOCOL.md)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make(tmp_path_factory.mktemp("ipc"), "m", CONFIGS["gqa"])


def require_gpu(model, target):
    """Skips a "gpu" run where libkvcuda.so is not built or no GPU answers."""
    if target != "gpu":
        return
    r = subprocess.run([ENGINE, "info", "--engine", "cuda", "--model", model, "--num-blocks",
                        "16"], capture_output=True, text=True, env=cuda_env("gpu"))
    if r.returncode != 0 and "no CUDA device" in r.stderr:
        pytest.skip("no GPU: " + r.stderr.strip())
    assert r.returncode == 0, r.stderr


def cuda_worker(stack, model, role, extra=(), env_extra=None, target="emu-forward"):
    """Started, not waited for: stack.ready() waits for the workers started together."""
    env = cuda_env(target)
    env.update(env_extra or {})
    port = kvt.free_port()
    p = stack.spawn([os.path.join(kvt.BIN, "kvworker"), "--engine", "cuda", "--model", model,
                     "--port", str(port), "--num-blocks", "128", "--role", role] + list(extra),
                    "worker-%s-%d.log" % (role, port), env=env)
    p.ports = [port]
    return p


def decode(stack, model, extra=(), env_extra=None, target="emu-forward"):
    return cuda_worker(stack, model, "decode", ["--disagg-min-tokens", "1"] + list(extra),
                       env_extra, target)


@pytest.mark.parametrize("target", ["emu-forward", "gpu"])
def test_ipc_split_output_equals_aggregated(stack, model, target):
    """The decode worker maps the prefill worker's pool and copies the blocks
    device to device: the same greedy output as an aggregated worker, also
    when part of the prompt is already cached on the decode side."""
    require_gpu(model, target)
    agg = cuda_worker(stack, model, "aggregated", target=target)
    pre = cuda_worker(stack, model, "prefill", target=target)
    dec = decode(stack, model, target=target)
    stack.ready(agg, pre, dec)
    s, _, want = complete(agg, PROMPT)
    assert s == 200, want
    s, h, got = complete(dec, PROMPT, prefill=addr(pre))
    assert s == 200, got
    assert h["x-kvroute-prefilled-by"] == addr(pre), h
    assert got == want
    m, p = metrics(dec), metrics(pre)
    assert m["kvworker_xfer_pulled_total"] == 1 and m["kvworker_xfer_pulled_ipc_total"] == 1
    assert m["kvworker_xfer_ipc_fallbacks_total"] == 0 and m["kvworker_xfer_fallbacks_total"] == 0
    assert p["kvworker_xfer_served_ipc_total"] == 1
    assert m["kvworker_xfer_pulled_blocks_total"] >= 4
    assert m["kvworker_xfer_pulled_bytes_total"] == p["kvworker_xfer_served_bytes_total"] > 0
    # the prompt's first blocks are now cached on the decode side: only the rest moves
    blocks = m["kvworker_xfer_pulled_blocks_total"]
    s, _, want = complete(agg, PROMPT + MORE)
    s, h, got = complete(dec, PROMPT + MORE, prefill=addr(pre))
    assert s == 200 and h["x-kvroute-prefilled-by"] == addr(pre), h
    assert got == want
    m = metrics(dec)
    assert m["kvworker_xfer_pulled_ipc_total"] == 2
    assert 0 < m["kvworker_xfer_pulled_blocks_total"] - blocks < blocks


def test_ipc_open_refused_falls_back_to_bytes(stack, model):
    """The decode worker's device cannot reach the prefill worker's
    (KVW_CUDAEMU_NO_PEER: cudaIpcOpenMemHandle fails with
    cudaErrorPeerAccessUnsupported): the same pull asks again for the byte
    stream, the output is the aggregated one, and IPC is not offered to that
    prefill worker again."""
    agg = cuda_worker(stack, model, "aggregated")
    pre = cuda_worker(stack, model, "prefill")
    dec = decode(stack, model, ["--device", "1"],
                 {"KVW_CUDAEMU_DEVICES": "2", "KVW_CUDAEMU_NO_PEER": "1"})
    stack.ready(agg, pre, dec)
    s, _, want = complete(agg, PROMPT)
    s, h, got = complete(dec, PROMPT, prefill=addr(pre))
    assert s == 200 and h["x-kvroute-prefilled-by"] == addr(pre), (h, got)
    assert got == want
    m, p = metrics(dec), metrics(pre)
    assert m["kvworker_xfer_ipc_fallbacks_total"] == 1 and m["kvworker_xfer_pulled_ipc_total"] == 0
    assert m["kvworker_xfer_pulled_total"] == 1 and m["kvworker_xfer_fallbacks_total"] == 0
    assert p["kvworker_xfer_served_ipc_total"] == 1 and p["kvworker_xfer_served_total"] == 2
    log = open(dec.log).read()
    assert "CUDA IPC failed" in log and "cudaErrorPeerAccessUnsupported" in log, log
    # not offered again: the next pull is bytes from the start
    s, _, want = complete(agg, PROMPT + MORE)
    s, h, got = complete(dec, PROMPT + MORE, prefill=addr(pre))
    assert s == 200 and got == want
    m, p = metrics(dec), metrics(pre)
    assert m["kvworker_xfer_ipc_fallbacks_total"] == 1 and m["kvworker_xfer_pulled_total"] == 2
    assert p["kvworker_xfer_served_ipc_total"] == 1


def test_ipc_export_refused_sends_bytes(stack, model):
    """A prefill worker that cannot export (KVW_CUDAEMU_IPC=0: no IPC on this
    platform) answers the offer with the byte stream."""
    agg = cuda_worker(stack, model, "aggregated")
    pre = cuda_worker(stack, model, "prefill", env_extra={"KVW_CUDAEMU_IPC": "0"})
    dec = decode(stack, model)
    stack.ready(agg, pre, dec)
    s, _, want = complete(agg, PROMPT)
    s, h, got = complete(dec, PROMPT, prefill=addr(pre))
    assert s == 200 and h["x-kvroute-prefilled-by"] == addr(pre) and got == want
    m, p = metrics(dec), metrics(pre)
    assert m["kvworker_xfer_pulled_total"] == 1 and m["kvworker_xfer_pulled_ipc_total"] == 0
    assert m["kvworker_xfer_ipc_fallbacks_total"] == 0
    assert p["kvworker_xfer_served_ipc_total"] == 0 and p["kvworker_xfer_served_total"] == 1
    assert "cudaErrorNotSupported" in open(pre.log).read()


def ipc_stream(d):
    return len(d) >= HDR and struct.unpack_from("<I", d, 36)[0] & 1


def stale_handle(d):
    """The IPC frame's handle with another inode (a freed allocation's), re-checksummed."""
    return forged_handle(d, lambda h: h[:33] + bytes([h[33] ^ 1]) + h[34:])


def garbage_handle(d):
    """The IPC frame's handle with every byte flipped (the real driver's handle
    is opaque: which bytes it reads is not ours to know), re-checksummed."""
    return forged_handle(d, lambda h: bytes(x ^ 0xff for x in h))


def forged_handle(d, edit):
    """d with its IPC frame's 64-byte handle replaced by edit(handle)."""
    if not ipc_stream(d):
        return d
    b, at = bytearray(d), blocks_at(d)     # the IPC frame follows the header and token frames
    b[at + 16:at + 80] = edit(bytes(b[at + 16:at + 80]))
    struct.pack_into("<Q", b, at + 88, xxh3(b[at:at + 88]))
    return bytes(b)


def offset_outside(d):
    """The first block's offset past the end of the exported pool."""
    if not ipc_stream(d):
        return d
    b, at = bytearray(d), blocks_at(d)
    pool = struct.unpack_from("<Q", b, at + 8)[0]
    struct.pack_into("<Q", b, at + IPC + 24, pool)
    return bytes(b)


@pytest.mark.parametrize("target", ["emu-forward", "gpu"])
def test_ipc_forged_streams(stack, model, target):
    """A handle that no longer opens (stale: cudaErrorInvalidValue on the
    emulation; the real driver's own error on a GPU) is an IPC failure: the
    pull is repeated as bytes. A block offset outside the exported pool is a
    broken stream: refused, the request prefilled locally. Either way the
    output is the aggregated one."""
    require_gpu(model, target)
    agg = cuda_worker(stack, model, "aggregated", target=target)
    pre = cuda_worker(stack, model, "prefill", target=target)
    dec = decode(stack, model, target=target)
    stack.ready(agg, pre, dec)
    f = Forger(pre.ports[0])
    try:
        via = "127.0.0.1:%d" % f.port
        f.edit = offset_outside
        s, _, want = complete(agg, PROMPT)
        s, h, got = complete(dec, PROMPT, prefill=via)
        assert s == 200 and got == want
        assert h["x-kvroute-prefilled-by"] == "local", h
        assert "offset" in h["x-kvroute-prefill-fallback"], h
        f.edit = garbage_handle if target == "gpu" else stale_handle
        s, _, want = complete(agg, "stale: " + PROMPT)
        s, h, got = complete(dec, "stale: " + PROMPT, prefill=via)
        assert s == 200 and got == want
        assert h["x-kvroute-prefilled-by"] == via, h
        m = metrics(dec)
        assert m["kvworker_xfer_ipc_fallbacks_total"] == 1
        assert m["kvworker_xfer_pulled_total"] == 1 and m["kvworker_xfer_pulled_ipc_total"] == 0
        assert m["kvworker_xfer_fallbacks_total"] == 1
        log = open(dec.log).read()
        assert "CUDA IPC failed" in log, log
        if target != "gpu":
            assert "cudaErrorInvalidValue" in log, log
    finally:
        f.close()
