"""The CUDA engine's handling of devices and device failures, on the host
emulation of CUDA (libkvcuda-emu.so, workers/cuda/emu), which can fake
what a GPU-less machine cannot show: a device count error of any kind,
several devices, a sticky fault in the middle of serving, a small device
memory. Skipped where g++ (and so the emulated build) is missing."""
import json
import os
import re
import subprocess
import time

import numpy as np
import pytest

import kvnats
import kvt
from test_cpu_engine import CONFIGS, ENGINE, cuda_env, make
import kvproto

P = kvproto.DEFAULT_PREFIX


def engine(model, *args, env_extra=None, cmd="info"):
    env = cuda_env("emu-forward")
    env.update(env_extra or {})
    return subprocess.run([ENGINE, cmd, "--engine", "cuda", "--model", model] + list(args),
                          capture_output=True, text=True, env=env)


@pytest.fixture
def model(tmp_path):
    return make(tmp_path, "m", CONFIGS["gqa"])


@pytest.mark.parametrize("code,driver,verdict", [
    ("100", None, "no CUDA device"),                    # cudaErrorNoDevice
    ("35", "/nonexistent/libcuda.so.1", "no CUDA device"),  # no driver installed at all
    ("35", "libm.so.6", "present but unusable"),        # a driver older than CUDA 13
    ("46", None, "present but unusable"),               # busy or prohibited devices
    ("803", None, "present but unusable"),              # driver/library mismatch
    ("804", None, "present but unusable"),              # forward compatibility refused
])
def test_device_count_errors_are_told_apart(model, code, driver, verdict):
    """Only "no device" reads "no CUDA device" (what tests skip on); a
    device that is there but unusable is a loud failure that says why."""
    extra = {"KVW_CUDAEMU_DEVICE_ERROR": code}
    if driver:
        extra["KVW_CUDA_DRIVER_LIB"] = driver
    r = engine(model, env_extra=extra)
    assert r.returncode == 1 and verdict in r.stderr, r.stderr
    if verdict != "no CUDA device":
        assert "no CUDA device" not in r.stderr
        assert "CUDA 13.0" in r.stderr


def test_device_flag_picks_the_gpu(model, stack):
    two = {"KVW_CUDAEMU_DEVICES": "2"}
    assert engine(model, "--device", "1", env_extra=two).returncode == 0
    r = engine(model, "--device", "2", env_extra=two)
    assert r.returncode == 1 and "--device 2" in r.stderr and "2 CUDA devices" in r.stderr
    # kvworker passes it on, and refuses a device that is not there
    env = cuda_env("emu-forward")
    env.update(two)
    port = kvt.free_port()
    p = stack.spawn([os.path.join(kvt.BIN, "kvworker"), "--engine", "cuda", "--model", model,
                     "--port", str(port), "--device", "3", "--num-blocks", "64"],
                    "worker-bad.log", env=env)
    assert p.wait(timeout=60) != 0
    assert "--device 3" in open(p.log).read()


def test_scratch_is_sized_for_the_batched_token_limit(model):
    """The scratch for the scheduler's largest step is allocated before the
    pool, so the pool takes what is left (fewer blocks for a larger limit)
    and a limit that cannot fit fails at start with the reason, not in the
    middle of serving."""
    mem = {"KVW_CUDAEMU_MEM_MB": "600"}
    small = engine(model, "--num-blocks", "0", "--max-batched", "256", "--max-seqs", "8",
                   env_extra=mem)
    large = engine(model, "--num-blocks", "0", "--max-batched", "8192", "--max-seqs", "256",
                   env_extra=mem)
    assert small.returncode == 0 and large.returncode == 0, small.stderr + large.stderr
    nb_small = json.loads(small.stdout)["num_blocks"]
    nb_large = json.loads(large.stdout)["num_blocks"]
    assert nb_large < nb_small, (nb_small, nb_large)
    r = engine(model, "--num-blocks", "0", "--max-batched", "400000", "--max-seqs", "256",
               env_extra=mem)
    assert r.returncode == 1 and "400000-token" in r.stderr, r.stderr


def wait_until(cond, what, timeout=60.0):
    deadline = time.time() + timeout
    while not cond():
        if time.time() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def test_sticky_cuda_error_makes_the_worker_unhealthy(stack, tmp_path):
    """A fault that poisons the CUDA context (here injected at the 20th
    kernel launch: the 2-layer model's prefill launches 15 kernels, the
    first decode step 13 more, captured as a graph that later steps replay)
    fails that request; from then on the worker fails /health, refuses
    requests with 503 and stops heartbeating, so routers stop sending to
    it, instead of failing every step while looking healthy."""
    model = make(tmp_path, "m", CONFIGS["gqa"])
    ns = stack.nats()
    nc = kvnats.Nats(ns.port)
    hb = nc.subscribe(kvproto.heartbeat(P))
    env = cuda_env("emu-forward")
    env["KVW_CUDAEMU_FAIL_LAUNCH"] = "20"
    port = kvt.free_port()
    p = stack.spawn([os.path.join(kvt.BIN, "kvworker"), "--engine", "cuda", "--model", model,
                     "--port", str(port), "--num-blocks", "64", "--nats", ns.url,
                     "--heartbeat-ms", "100", "--worker-id", "7"], "worker.log", env=env)
    kvt.wait_port(port, proc=p, what="kvworker")
    nc.wait(hb, lambda ms: any(m.json()["worker_id"] == 7 for m in ms), timeout=30)
    s, _, _ = kvt.request(port, "GET", "/health")
    assert s == 200
    s, _, out, raw = kvt.post_json(port, "/v1/completions",
                                   {"prompt": list(range(100, 120)), "max_tokens": 8,
                                    "temperature": 0})
    # the request ends (an error or an aborted completion), it does not hang
    assert s != 200 or out["choices"][0]["finish_reason"] != "length", raw

    def unhealthy():
        return kvt.request(port, "GET", "/health")[0] == 503
    wait_until(unhealthy, "/health never turned 503")
    s, _, body = kvt.request(port, "GET", "/health")
    assert b"unusable" in body and b"illegal memory access" in body, body
    s, _, out, raw = kvt.post_json(port, "/v1/completions", {"prompt": [1, 2, 3],
                                                             "max_tokens": 2})
    assert s == 503, raw
    # silent on NATS from now on: at most one heartbeat already in flight
    n0 = len(nc.messages(hb))
    time.sleep(1.0)     # ten heartbeat intervals in which none may come
    assert len(nc.messages(hb)) - n0 <= 1
    assert "this worker stops taking requests" in open(p.log).read()
    nc.close()


def test_greedy_tokens_from_the_device_argmax_match_the_cpu_engine(stack, tmp_path):
    """Greedy sequences get their token from an argmax on the device (one
    int back instead of a row of logits): the same completion as the CPU
    engine's; a request with a temperature still samples on the host."""
    model = make(tmp_path, "m", CONFIGS["gqa"])
    env = cuda_env("emu-reverse")
    texts = {}
    for eng in ("cpu", "cuda"):
        port = kvt.free_port()
        p = stack.spawn([os.path.join(kvt.BIN, "kvworker"), "--engine", eng, "--model", model,
                         "--port", str(port), "--num-blocks", "64"], "worker-%s.log" % eng,
                        env=env)
        kvt.wait_port(port, proc=p, what="kvworker")
        s, _, out, raw = kvt.post_json(port, "/v1/completions",
                                       {"prompt": list(range(100, 140)), "max_tokens": 6,
                                        "temperature": 0, "ignore_eos": True})
        assert s == 200, raw
        texts[eng] = out["choices"][0]["text"]
        assert out["usage"]["completion_tokens"] == 6
        s, _, out, raw = kvt.post_json(port, "/v1/completions",
                                       {"prompt": list(range(100, 140)), "max_tokens": 4,
                                        "temperature": 0.8, "seed": 1, "ignore_eos": True})
        assert s == 200 and out["usage"]["completion_tokens"] == 4, raw
    assert texts["cuda"] == texts["cpu"]


# --- the decode path's kernels (docs/CUDA.md; split-K attention, bf16 KV cache, device sampling,
# --- CUDA graphs, fused kernels), against the CPU engine on the emulation

from test_cpu_engine import PHI3_TOK, TOKENS, engine_logits, rel  # noqa: E402

def cuda_run(model, *extra, env_extra=None, target="emu-forward", dtype="f32", cmd="logits",
             ok=True):
    env = cuda_env(target, dtype)
    env.update(env_extra or {})
    args = [ENGINE, cmd, "--engine", "cuda", "--model", model]
    if cmd == "logits":
        args += ["--tokens", json.dumps(TOKENS)]
    r = subprocess.run(args + list(extra), capture_output=True, text=True, env=env)
    if ok:
        assert r.returncode == 0, r.stderr
        assert "ERROR: AddressSanitizer" not in r.stderr, r.stderr
    return r


def lg(r):
    return np.array(json.loads(r.stdout))


@pytest.mark.parametrize("target", ["emu-forward", "emu-reverse"])
@pytest.mark.parametrize("name", ["gqa", "qwen2_bias", "llama3_rope_bf16"])
def test_split_attention_matches_cpu_and_one_pass_kernels(tmp_path, name, target):
    """Split-K attention (the default) at split lengths that cut KV blocks
    anywhere (1, 5 and 16 positions with 16-slot blocks): the CPU engine's
    logits, the one-pass kernels' (KVW_CUDA_ATTENTION=gqa|head) up to
    summation order, and a token's result does not depend on the rest of
    its step (batched decode = the cold prefill, bit for bit)."""
    model = make(tmp_path, "m", CONFIGS[name])
    cpu = engine_logits(model, TOKENS)
    gqa = lg(cuda_run(model, env_extra={"KVW_CUDA_ATTENTION": "gqa"}, target=target))
    head = lg(cuda_run(model, env_extra={"KVW_CUDA_ATTENTION": "head"}, target=target))
    assert rel(gqa, cpu) < 2e-6 and rel(head, cpu) < 2e-6
    for split in ("1", "5", "16"):
        env = {"KVW_CUDA_ATT_SPLIT": split}
        cold = lg(cuda_run(model, env_extra=env, target=target))
        assert rel(cold, cpu) < 2e-6, split
        assert rel(cold, gqa) < 2e-6, split
        assert int(np.argmax(cold)) == int(np.argmax(cpu))
        if split == "5":
            for extra in (["--batch", "5", "--decode", "4"], ["--chunk", "7", "--prefix", "16"]):
                got = lg(cuda_run(model, *extra, env_extra=env, target=target))
                assert np.array_equal(got, cold), (extra, rel(got, cold))


def test_attention_and_kv_options_are_checked(model):
    for var, val in (("KVW_CUDA_ATTENTION", "fast"), ("KVW_CUDA_ATT_SPLIT", "0"),
                     ("KVW_CUDA_ATT_SPLIT", "12x"), ("KVW_CUDA_KV_DTYPE", "f16")):
        r = cuda_run(model, env_extra={var: val}, ok=False)
        assert r.returncode == 1 and var in r.stderr, r.stderr


@pytest.mark.parametrize("target", ["emu-forward", "emu-reverse"])
def test_bf16_kv_cache(tmp_path, target):
    """KVW_CUDA_KV_DTYPE=bf16: half the block bytes, a layout string that
    says so, logits within bf16 rounding of the CPU engine's, the same
    logits for batched decode and for blocks moved between two bf16
    engines, and blocks of the f32 CPU engine refused, not misread."""
    model = make(tmp_path, "m", CONFIGS["gqa"])
    bf = {"KVW_CUDA_KV_DTYPE": "bf16"}
    f32_info = json.loads(cuda_run(model, "--num-blocks", "8", cmd="info").stdout)
    bf_info = json.loads(cuda_run(model, "--num-blocks", "8", cmd="info", env_extra=bf).stdout)
    assert bf_info["block_bytes"] * 2 == f32_info["block_bytes"]
    assert f32_info["kv_layout"].startswith("kvw-kv/1 f32 [block][layer=2][K|V][slot=16]")
    assert bf_info["kv_layout"].startswith("kvw-kv/1 bf16 ")
    assert bf_info["kv_layout"] != f32_info["kv_layout"]
    cpu = engine_logits(model, TOKENS)
    cold = lg(cuda_run(model, env_extra=bf, target=target))
    assert rel(cold, cpu) < 1e-2
    assert rel(cold, cpu) > 0       # it is rounded: the option took effect
    for extra in (["--batch", "5", "--decode", "4"], ["--prefix", "20", "--transfer", "cuda"]):
        assert np.array_equal(lg(cuda_run(model, *extra, env_extra=bf, target=target)), cold)
    r = cuda_run(model, "--prefix", "20", "--transfer", "cpu", env_extra=bf, ok=False)
    assert r.returncode != 0 and "bytes" in r.stderr, r.stderr


@pytest.mark.parametrize("target", ["emu-forward", "emu-reverse"])
def test_graph_replay_equals_direct_launches(tmp_path, target):
    """Decode steps run through CUDA graphs (captured once per batch shape,
    replayed after): the same logits as direct launches (KVW_CUDA_GRAPHS=0),
    bit for bit, also across split-K grid changes (a split every 3
    positions: a new shape every third step)."""
    model = make(tmp_path, "m", CONFIGS["gqa"])
    for split in ("128", "3"):
        env = {"KVW_CUDA_ATT_SPLIT": split, "KVW_CUDA_STATS": "1"}
        direct = cuda_run(model, "--batch", "5", "--decode", "6", target=target,
                          env_extra=dict(env, KVW_CUDA_GRAPHS="0"))
        graphs = cuda_run(model, "--batch", "5", "--decode", "6", target=target, env_extra=env)
        assert np.array_equal(lg(graphs), lg(direct))
        assert "graphs captured 0, replayed 0" in direct.stderr
        cap, rep = map(int, re.search(r"graphs captured (\d+), replayed (\d+)",
                                      graphs.stderr).groups())
        assert cap + rep == 6 and rep >= (4 if split == "128" else 2), graphs.stderr
    # a driver that cannot capture: said once, and the steps run directly
    r = cuda_run(model, "--batch", "5", "--decode", "6", target=target,
                 env_extra=dict(env, KVW_CUDAEMU_NO_CAPTURE="1"))
    assert np.array_equal(lg(r), lg(graphs))
    assert r.stderr.count("decode steps run without CUDA graphs") == 1, r.stderr


def test_sampling_on_the_device_follows_the_cpu_sampler(stack, tmp_path):
    """Requests with a temperature (and top-k / top-p) sample on the device:
    per-chunk candidates instead of the logits row, then kvw_sample's walk
    with the request's RNG stream. Same seed, same completion as the CPU
    engine, token for token; with KVW_CUDA_HOST_SAMPLING (full rows to the
    host, kvw_sample) the same again."""
    model = make(tmp_path, "m", CONFIGS["gqa"])
    reqs = [{"temperature": 0.9, "top_k": 5, "seed": 3}, {"temperature": 0.7, "top_p": 0.6,
                                                            "top_k": 20, "seed": 4},
            {"temperature": 1.2, "seed": 5}, {"temperature": 0.8, "top_p": 0.9, "seed": 6}]
    texts = {}
    for eng, extra in (("cpu", {}), ("cuda", {}), ("cuda-host", {"KVW_CUDA_HOST_SAMPLING": "1"})):
        env = cuda_env("emu-forward")
        env.update(extra)
        port = kvt.free_port()
        p = stack.spawn([os.path.join(kvt.BIN, "kvworker"), "--engine", eng.split("-")[0],
                         "--model", model, "--port", str(port), "--num-blocks", "64"],
                        "worker-%s.log" % eng, env=env)
        kvt.wait_port(port, proc=p, what="kvworker")
        texts[eng] = []
        for req in reqs:
            body = dict(req, prompt=list(range(100, 130)), max_tokens=6, ignore_eos=True)
            s, _, out, raw = kvt.post_json(port, "/v1/completions", body)
            assert s == 200 and out["usage"]["completion_tokens"] == 6, raw
            texts[eng].append(out["choices"][0]["text"])
    assert texts["cuda"] == texts["cpu"]
    assert texts["cuda-host"] == texts["cpu"]
    assert len(set(texts["cpu"])) > 1


@pytest.mark.parametrize("target", ["emu-forward", "emu-reverse"])
def test_fused_kernels_change_no_bit(tmp_path, target):
    """Decode steps with RoPE and the KV write inside the split-K attention,
    the embedding fused with the first norm and o_proj's bias with the MLP
    norm: the logits of the unfused kernels (KVW_CUDA_FUSE=0 leaves RoPE in
    its own kernel) and of the cold prefill, bit for bit, with q/k/v biases
    and o_proj biases (Llama's attention_bias)."""
    from test_cpu_engine import add_tensors, edit_config
    model = make(tmp_path, "m", CONFIGS["gqa"])
    rng = np.random.default_rng(8)
    add_tensors(model, {"model.layers.%d.self_attn.%s_proj.bias" % (l, n): rng.normal(0, 0.4, d)
                        for l in range(2)
                        for n, d in (("q", 64), ("k", 32), ("v", 32), ("o", 64))})
    edit_config(model, attention_bias=True)
    cpu = engine_logits(model, TOKENS)
    cold = lg(cuda_run(model, target=target))
    assert rel(cold, cpu) < 2e-6
    for split in ("", "128", "4"):      # "": the default, splits sized by the step, as cold's
        env = {"KVW_CUDA_ATT_SPLIT": split}
        fused = lg(cuda_run(model, "--batch", "3", "--decode", "5", target=target, env_extra=env))
        plain = lg(cuda_run(model, "--batch", "3", "--decode", "5", target=target,
                            env_extra=dict(env, KVW_CUDA_FUSE="0")))
        assert np.array_equal(fused, plain)
        if split == "":
            assert np.array_equal(fused, cold)


def stat(r, what):
    return int(re.search(what + r" (\d+)", r.stderr).group(1))


@pytest.mark.parametrize("name,dtype,target", [("gqa", "f32", "emu-forward"),
                                               ("gqa", "f32", "emu-reverse"),
                                               ("qwen2_bias", "bf16", "emu-forward"),
                                               ("mha_tied", "f16", "emu-reverse")])
def test_fused_norms_and_overlap_change_no_bit(tmp_path, name, dtype, target):
    """Batch-1 decode steps (the first captured as a graph, the second
    replayed) through k_gemv (KVW_CUDA_GEMV=all: the tiny models' rows too)
    with the norms and SwiGLU inside it (k_gemv_norm, k_gemv_glu) and the
    decode kernels launched to overlap (KVW_CUDA_PDL=1: programmatic
    dependent launch; kvemu fails such a launch if a block never calls
    kvc_pdl_wait): the logits of the separate kernels launched plainly
    (KVW_CUDA_FUSE=rope, and PDL is off by default) bit for bit, the CPU engine's within the weights'
    rounding; KVW_CUDA_STATS says which path ran. (Phi-3's 32k vocabulary:
    the emulated lm_head is most of the time.)"""
    model = make(tmp_path, "m", CONFIGS[name], tokenizer=PHI3_TOK)
    env = {"KVW_CUDA_GEMV": "all", "KVW_CUDA_STATS": "1"}
    fused = cuda_run(model, "--decode", "2", target=target, dtype=dtype,
                     env_extra=dict(env, KVW_CUDA_PDL="1"))
    plain = cuda_run(model, "--decode", "2", target=target, dtype=dtype,
                     env_extra=dict(env, KVW_CUDA_FUSE="rope"))
    assert stat(fused, "fused-norm steps") == 2
    assert stat(fused, r"overlapped \(PDL\) steps") == 2
    assert stat(plain, "fused-norm steps") == 0
    assert stat(plain, r"overlapped \(PDL\) steps") == 0
    assert np.array_equal(lg(fused), lg(plain))
    cpu = engine_logits(model, TOKENS)
    assert rel(lg(fused), cpu) < {"f32": 2e-6, "bf16": 3e-2, "f16": 3e-3}[dtype]


# --- the tensor-core prefill attention (k_attn_prefill_tc, wmma on kvemu) ---------------------

def tc_steps(r):
    return stat(r, "tensor-core prefill steps")


@pytest.mark.parametrize("dtype,kv", [("bf16", "f32"), ("bf16", "bf16"), ("f16", "f32"),
                                      ("f16", "bf16")])
def test_tensor_core_prefill(tmp_path, dtype, kv):
    """Prefill steps of f16/bf16 models run the tensor-core attention
    (flash-attention tiles through wmma): the CPU engine's logits within the
    weights' rounding (bf16 KV: bf16's), in both thread orders with the same
    bits; the earlier kernels (KVW_CUDA_TC_PREFILL=0) within the same; a
    row's result independent of the rest of its tiles (chunked prefill after
    a cached prefix, a 5-sequence batch: the cold run bit for bit); decode
    steps after it (split-K) within the rounding."""
    model = make(tmp_path, "m", CONFIGS["gqa"])
    tol = {"bf16": 1.5e-2, "f16": 2e-3}["bf16" if kv == "bf16" else dtype]
    env = {"KVW_CUDA_KV_DTYPE": kv, "KVW_CUDA_STATS": "1"}
    cpu = engine_logits(model, TOKENS)
    runs = {o: cuda_run(model, target="emu-" + o, dtype=dtype, env_extra=env)
            for o in ("forward", "reverse")}
    cold = lg(runs["forward"])
    assert tc_steps(runs["forward"]) == 1, runs["forward"].stderr
    assert np.array_equal(lg(runs["reverse"]), cold)
    assert rel(cold, cpu) < tol
    off = cuda_run(model, dtype=dtype, env_extra=dict(env, KVW_CUDA_TC_PREFILL="0"))
    assert tc_steps(off) == 0
    assert rel(lg(off), cpu) < tol and rel(cold, lg(off)) < tol
    assert not np.array_equal(cold, lg(off))    # it did run another kernel
    # chunks of 4 after a prefix of 16: no chunk of one token (a decode step: split-K)
    for extra in (["--chunk", "4", "--prefix", "16"], ["--batch", "5"]):
        r = cuda_run(model, *extra, target="emu-reverse", dtype=dtype, env_extra=env)
        assert tc_steps(r) >= 1 and np.array_equal(lg(r), cold), extra
    r = cuda_run(model, "--batch", "3", "--decode", "3", dtype=dtype, env_extra=env)
    assert rel(lg(r), cpu) < tol


def test_tensor_core_prefill_falls_back(tmp_path):
    """Where the rule says no (head_dim not a multiple of 16, f32 weights)
    the step takes the earlier kernels: the same bits as with the
    tensor-core path switched off."""
    model = make(tmp_path, "m", CONFIGS["qwen2_bias"])             # head_dim 8
    env = {"KVW_CUDA_STATS": "1"}
    on = cuda_run(model, dtype="bf16", env_extra=env)
    off = cuda_run(model, dtype="bf16", env_extra=dict(env, KVW_CUDA_TC_PREFILL="0"))
    assert tc_steps(on) == 0 and np.array_equal(lg(on), lg(off))
    f32 = cuda_run(make(tmp_path, "g", CONFIGS["gqa"]), env_extra=env)
    assert tc_steps(f32) == 0
