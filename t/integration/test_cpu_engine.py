"""The CPU engine on tiny random-weight models made by
kvtiny-model, against an independent numpy implementation (t/ref), and
through kvworker's scheduler and HTTP front."""
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

import kvt

sys.path.insert(0, os.path.join(kvt.TOP, "t", "ref"))
import llama_ref  # noqa: E402

TINY = os.path.join(kvt.BIN, "kvtiny-model")
ENGINE = os.path.join(kvt.BIN, "kvengine")
PHI3_TOK = os.path.join(kvt.TOP, "conf", "tokenizers", "phi-3-mini-4k-instruct",
                        "tokenizer.json")
QWEN_TOK = os.path.join(kvt.TOP, "conf", "tokenizers", "qwen2.5-instruct", "tokenizer.json")
GPT2_TOK = os.path.join(kvt.TOP, "conf", "tokenizers", "gpt2", "tokenizer.json")

CONFIGS = {
    "gqa": ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2"],
    "mha_tied": ["--layers", "2", "--hidden", "48", "--heads", "3", "--kv-heads", "3", "--tie"],
    "qwen2_bias": ["--layers", "2", "--hidden", "64", "--heads", "8", "--kv-heads", "2",
                   "--qkv-bias"],
    "llama3_rope_bf16": ["--layers", "1", "--hidden", "64", "--heads", "4", "--kv-heads", "1",
                         "--rope-scaling", "llama3", "--dtype", "bf16"],
    "linear_rope_f16": ["--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "2",
                        "--rope-scaling", "linear", "--dtype", "f16"],
    # 16 query heads on one KV head: more than the CUDA engine's grouped attention serves
    "mqa_wide": ["--layers", "1", "--hidden", "64", "--heads", "16", "--kv-heads", "1"],
}

TOKENS = [17, 4, 290, 1000, 5, 5, 77, 31337, 12, 9, 100, 2, 8, 3000, 44, 45, 46, 47, 48, 49,
          50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65, 66, 67]


_made = {}          # (args, tokenizer) -> the model kvtiny-model made for them this session


def make(tmp_path, name, args, tokenizer=GPT2_TOK):
    """A model of kvtiny-model's, the test's own copy in tmp_path/name (tests edit
    theirs). kvtiny-model's output depends only on its arguments (the seed is fixed),
    so each set of arguments is made once a session and copied: most of the CPU and
    CUDA engine tests share a handful of models."""
    out = str(tmp_path / name)
    key = (tuple(args), tokenizer)
    if key not in _made:
        src = os.path.join(_made_dir, str(len(_made)))
        r = subprocess.run([TINY, "--out", src, "--tokenizer", tokenizer, "--seed", "3"] + args,
                           capture_output=True, text=True, cwd=kvt.TOP)
        assert r.returncode == 0, r.stderr
        _made[key] = src
    shutil.copytree(_made[key], out)
    return out


_made_dir = tempfile.mkdtemp(prefix="kvtiny-models-")
atexit.register(shutil.rmtree, _made_dir, True)


def engine_logits(model, tokens, *extra):
    r = subprocess.run([ENGINE, "logits", "--model", model, "--tokens", json.dumps(tokens)]
                       + list(extra), capture_output=True, text=True, env=kvt.sanitizer_env())
    assert r.returncode == 0, r.stderr
    return np.array(json.loads(r.stdout))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_numpy_reference(tmp_path, name):
    model = make(tmp_path, name, CONFIGS[name])
    ours = engine_logits(model, TOKENS)
    ref = llama_ref.logits(model, TOKENS)
    assert ours.shape == ref.shape
    err = np.max(np.abs(ours - ref)) / (np.max(np.abs(ref)) + 1e-9)
    assert err < 2e-4, err
    assert int(np.argmax(ours)) == int(np.argmax(ref))


def test_prefix_reuse_and_chunking_equal_cold(tmp_path):
    model = make(tmp_path, "m", CONFIGS["gqa"])
    cold = engine_logits(model, TOKENS)
    # the first 32 tokens (2 blocks) run first; the rest reads them from the pool
    warm = engine_logits(model, TOKENS, "--prefix", "32")
    chunked = engine_logits(model, TOKENS, "--chunk", "5")
    batched = engine_logits(model, TOKENS, "--batch", "5")
    assert np.max(np.abs(cold - warm)) < 1e-5
    assert np.max(np.abs(cold - chunked)) < 1e-5
    # in one step with four other sequences of other lengths
    assert np.max(np.abs(cold - batched)) < 1e-5


def test_unsupported_config_is_refused(tmp_path):
    model = make(tmp_path, "m", CONFIGS["gqa"])
    cfg = json.load(open(model + "/config.json"))
    for key, value, needle in (("hidden_act", "gelu", "hidden_act gelu"),
                               ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "yarn"),
                               ("num_local_experts", 8, "mixture-of-experts"),
                               ("model_type", "gpt_neox", "gpt_neox")):
        bad = dict(cfg, **{key: value})
        json.dump(bad, open(model + "/config.json", "w"))
        r = subprocess.run([ENGINE, "logits", "--model", model, "--tokens", "[1,2]"],
                           capture_output=True, text=True)
        assert r.returncode == 1 and needle in r.stderr, r.stderr
    json.dump(cfg, open(model + "/config.json", "w"))


def test_corrupt_model_is_refused_cleanly(tmp_path):
    """A config or safetensors header whose sizes overflow: refused with a
    message. vocab_size = hidden_size = 2^31 with an empty embed tensor
    wrapped the element count to 0 bytes and the loader wrote past a
    malloc(0); 2e9 layers made an unchecked calloc NULL."""
    model = make(tmp_path, "m", CONFIGS["gqa"])
    cfg = json.load(open(model + "/config.json"))
    path = model + "/model.safetensors"
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])

    def run():
        return subprocess.run([ENGINE, "logits", "--model", model, "--tokens", "[1,2]"],
                              capture_output=True, text=True)
    for key, value in (("vocab_size", 1 << 31), ("hidden_size", 1 << 31),
                       ("num_hidden_layers", 2000000000), ("head_dim", 0)):
        json.dump(dict(cfg, **{key: value}), open(model + "/config.json", "w"))
        r = run()
        assert r.returncode == 1 and "out of range" in r.stderr, (key, r.stderr)
    json.dump(cfg, open(model + "/config.json", "w"))
    for shape in ([1 << 32, 1 << 32, 1 << 32, 1 << 32], [-1, -64], ["x"]):
        bad = dict(header)
        bad["model.embed_tokens.weight"] = dict(header["model.embed_tokens.weight"],
                                                shape=shape, data_offsets=[0, 0])
        h = json.dumps(bad).encode()
        h += b" " * (-len(h) % 8)
        open(path, "wb").write(len(h).to_bytes(8, "little") + h + raw[8 + n:])
        r = run()
        assert r.returncode == 1 and "embed_tokens" in r.stderr, (shape, r.stderr)
    open(path, "wb").write(raw[:8] + b"{not json" + raw[17:])
    r = run()
    assert r.returncode == 1 and "header" in r.stderr, r.stderr


def test_kvworker_cpu_engine_serves_and_reuses_prefix(stack, tmp_path):
    model = make(tmp_path, "m", ["--layers", "2", "--hidden", "64", "--heads", "4",
                                 "--kv-heads", "2"], tokenizer=QWEN_TOK)
    w = stack.worker(extra=["--engine", "cpu", "--model", model, "--tokenizer",
                            model + "/tokenizer.json", "--num-blocks", "256"])
    port = w.ports[0]
    prompt = "The cat sat on the mat and looked at the long quiet street for a while. " * 4
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
    s, _, cold, _ = kvt.post_json(port, "/v1/completions", body)
    assert s == 200, cold
    s, _, warm, _ = kvt.post_json(port, "/v1/completions", body)
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16, (cold, warm)
    assert cold["choices"] and warm["choices"], json.dumps([cold, warm])
    # greedy: the same tokens whether the prompt's blocks were cached or not
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    s, _, streamed = kvt.request(port, "POST", "/v1/completions", dict(body, stream=True))
    text = "".join(json.loads(e)["choices"][0]["text"] for e in kvt.sse_events(streamed)
                   if e != "[DONE]" and json.loads(e).get("choices"))
    assert text == cold["choices"][0]["text"]


# --- the CUDA engine -------------------------------------------------------------
#
# Each CUDA test runs on three targets: "gpu", the nvcc build (libkvcuda.so,
# skipped where there is no GPU), and "emu-forward"/"emu-reverse", the same
# sources built for the host against workers/cuda/emu (libkvcuda-emu.so,
# under ASan/UBSan), with the threads of each block run in forward or
# reverse order. The emulation has no GPU's freedom of summation order, so
# its figures are held tighter, and its chunked, cached, batched and decode
# runs must give exactly the same logits.

CUDA_LIB = os.path.join(kvt.BUILD, "lib", "libkvcuda.so")
# (overridable to run the tests on a scratch build with a seeded bug)
EMU_LIB = os.environ.get("KVROUTE_CUDA_EMU_LIB",
                         os.path.join(kvt.BUILD, "lib", "libkvcuda-emu.so"))
CUDA_TARGETS = ["gpu", "emu-forward", "emu-reverse"]
# largest |difference| / largest |logit| against the CPU engine, by weight dtype
TOL = {"gpu": {"f32": 1e-3, "bf16": 3e-2, "f16": 3e-2},
       "emu": {"f32": 2e-6, "bf16": 1.5e-2, "f16": 2e-3}}


def sanitizer_runtime():
    """The ASan runtime libkvcuda-emu.so needs first in the process."""
    return subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True,
                          text=True).stdout.strip()


def cuda_env(target, dtype="f32", env=None):
    env = kvt.sanitizer_env(env)
    env["KVW_CUDA_DTYPE"] = dtype
    if target == "gpu":
        if not os.path.exists(CUDA_LIB):
            pytest.skip("no CUDA engine here: libkvcuda.so is built only where nvcc exists")
        env.pop("KVW_CUDA_LIB", None)
        if kvt.SANITIZE:    # ASan's shadow gap hides the address range the CUDA driver wants
            env["ASAN_OPTIONS"] = env.get("ASAN_OPTIONS", "") + ":protect_shadow_gap=0"
        return env
    if not os.path.exists(EMU_LIB):
        pytest.skip("no emulated CUDA engine: libkvcuda-emu.so is built only where g++ exists")
    env["KVW_CUDA_LIB"] = EMU_LIB
    env["KVW_CUDAEMU_ORDER"] = target.split("-")[1]
    env["LD_PRELOAD"] = sanitizer_runtime()
    env["ASAN_OPTIONS"] = "detect_leaks=1:abort_on_error=0"
    env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"
    return env


def cuda_logits(model, tokens, dtype, *extra, target="gpu", env=None):
    """The CUDA engine's logits with weights in dtype; skips where there is no GPU."""
    env = dict(cuda_env(target, dtype), **(env or {}))
    r = subprocess.run([ENGINE, "logits", "--engine", "cuda", "--model", model, "--tokens",
                        json.dumps(tokens)] + list(extra), capture_output=True, text=True,
                       env=env)
    if target == "gpu" and r.returncode != 0 and "no CUDA device" in r.stderr:
        pytest.skip("no GPU: " + r.stderr.strip())
    assert r.returncode == 0, r.stderr
    assert "ERROR: AddressSanitizer" not in r.stderr, r.stderr
    return np.array(json.loads(r.stdout))


def rel(a, b):
    return np.max(np.abs(a - b)) / np.max(np.abs(b))


def tol(target, dtype):
    return TOL["gpu" if target == "gpu" else "emu"][dtype]


@pytest.mark.parametrize("target", CUDA_TARGETS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cuda_engine_matches_cpu_and_reference(tmp_path, name, target):
    """f32 weights: the CPU engine's numbers and the numpy reference's, up to
    summation order."""
    model = make(tmp_path, "m", CONFIGS[name])
    gpu = cuda_logits(model, TOKENS, "f32", target=target)
    cpu = engine_logits(model, TOKENS)
    assert rel(gpu, cpu) < tol(target, "f32")
    assert rel(gpu, llama_ref.logits(model, TOKENS)) < tol(target, "f32")
    assert int(np.argmax(gpu)) == int(np.argmax(cpu))


@pytest.mark.parametrize("target", CUDA_TARGETS)
@pytest.mark.parametrize("name", ["gqa", "qwen2_bias", "mha_tied"])
def test_cuda_engine_paging_chunking_batching(tmp_path, name, target):
    """Paged prefill chunks, a prefix read back from the pool, a 5-sequence
    batch, and decode steps (alone and batched) give the cold run's logits:
    exactly on the emulation, within summation order on a GPU."""
    model = make(tmp_path, "m", CONFIGS[name])
    cold = cuda_logits(model, TOKENS, "f32", target=target)
    cpu = engine_logits(model, TOKENS)
    for extra in (["--chunk", "5", "--prefix", "16"], ["--prefix", "32"], ["--batch", "5"],
                  ["--decode", "3"], ["--batch", "5", "--decode", "4"]):
        got = cuda_logits(model, TOKENS, "f32", *extra, target=target)
        if target == "gpu":
            assert rel(got, cpu) < 1e-4 + rel(cold, cpu), extra
        else:
            assert np.array_equal(got, cold), (extra, rel(got, cold))


@pytest.mark.parametrize("target", ["emu-forward", "gpu"])
def test_cuda_gemv_decode_matches_cublas(tmp_path, target):
    """Decode steps through k_gemv (KVW_CUDA_GEMV=all: every matmul of a step
    of at most 4 tokens, the tiny model's short rows included; by default
    only rows of 512 weights or more) give cuBLAS's logits within summation
    order: one sequence with f32 weights, three with bf16 (where a last-bit
    difference can flip an activation's bf16 rounding: 9.7e-4 seen). A
    32,000-token vocabulary: the emulation runs a warp per lm_head row."""
    model = make(tmp_path, "m", CONFIGS["gqa"], tokenizer=PHI3_TOK)
    for dtype, extra, limit in (("f32", ["--decode", "2"], 1e-5),
                                ("bf16", ["--batch", "3", "--decode", "2"], 5e-3)):
        ref = cuda_logits(model, TOKENS, dtype, *extra, target=target, env={"KVW_CUDA_GEMV": "0"})
        got = cuda_logits(model, TOKENS, dtype, *extra, target=target,
                          env={"KVW_CUDA_GEMV": "all"})
        assert rel(got, ref) < limit, (dtype, rel(got, ref))
        assert int(np.argmax(got)) == int(np.argmax(ref))


@pytest.mark.parametrize("target", ["gpu"])
def test_cuda_fused_overlapped_decode_matches_plain(tmp_path, target):
    """On a GPU (the emulation's bit-for-bit check is in test_cuda_emu.py):
    batch-1 decode steps with the norms and SwiGLU inside k_gemv (the
    default) and the kernels overlapping (KVW_CUDA_PDL=1: programmatic
    dependent launch) give the logits of the separate kernels launched
    plainly (KVW_CUDA_FUSE=rope), over three runs of each combination: a
    kernel reading its predecessor's output too early would show as a
    difference that comes and goes."""
    model = make(tmp_path, "m", CONFIGS["gqa"], tokenizer=PHI3_TOK)
    env = {"KVW_CUDA_GEMV": "all"}
    ref = cuda_logits(model, TOKENS, "f32", "--decode", "4", target=target,
                      env=dict(env, KVW_CUDA_FUSE="rope"))
    for extra in ({}, {"KVW_CUDA_PDL": "1"}, {"KVW_CUDA_FUSE": "rope", "KVW_CUDA_PDL": "1"}):
        for _ in range(3):
            got = cuda_logits(model, TOKENS, "f32", "--decode", "4", target=target,
                              env=dict(env, **extra))
            assert rel(got, ref) < 1e-6, (extra, rel(got, ref))


@pytest.mark.parametrize("target", CUDA_TARGETS)
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_cuda_engine_half_weights_close_to_cpu(tmp_path, dtype, target):
    """bf16/f16 weights and matmul inputs: within their rounding (the
    emulation: bf16 5.4e-3, f16 7.4e-4 of the largest logit on this model)."""
    model = make(tmp_path, "m", CONFIGS["gqa"])
    gpu = cuda_logits(model, TOKENS, dtype, target=target)
    cpu = engine_logits(model, TOKENS)
    assert rel(gpu, cpu) < tol(target, dtype)


@pytest.mark.parametrize("target", CUDA_TARGETS)
def test_cuda_blocks_move_between_engines(tmp_path, target):
    """block_read/block_write: a prefix computed on one engine and moved
    block by block into another engine's pool (other block ids) serves the
    rest of the prompt as if computed there; the CPU and CUDA engines'
    blocks are byte-compatible."""
    model = make(tmp_path, "m", CONFIGS["gqa"])
    cpu = engine_logits(model, TOKENS)
    cold = cuda_logits(model, TOKENS, "f32", target=target)
    for src in ("cuda", "cpu"):
        got = cuda_logits(model, TOKENS, "f32", "--prefix", "20", "--transfer", src,
                          target=target)
        if src == "cuda" and target != "gpu":
            assert np.array_equal(got, cold)
        assert rel(got, cpu) < tol(target, "f32"), src
    # and from the CUDA engine into the CPU engine
    r = subprocess.run([ENGINE, "logits", "--model", model, "--tokens", json.dumps(TOKENS),
                        "--prefix", "20", "--transfer", "cuda"], capture_output=True, text=True,
                       env=cuda_env(target))
    if target == "gpu" and r.returncode != 0 and "no CUDA device" in r.stderr:
        pytest.skip("no GPU: " + r.stderr.strip())
    assert r.returncode == 0, r.stderr
    assert rel(np.array(json.loads(r.stdout)), cpu) < tol(target, "f32")


def test_cpu_blocks_move_between_engines(tmp_path):
    """block_read/block_write on the CPU engine alone: bit for bit."""
    model = make(tmp_path, "m", CONFIGS["gqa"])
    cold = engine_logits(model, TOKENS)
    assert np.array_equal(engine_logits(model, TOKENS, "--prefix", "20", "--transfer", "cpu"),
                          cold)
    assert np.array_equal(engine_logits(model, TOKENS, "--batch", "5", "--decode", "4"), cold)


# --- config.json and checkpoint conventions --------------------------------

def add_tensors(model, tensors):
    """Rewrites model.safetensors with these f32 tensors added (or replaced)."""
    path = model + "/model.safetensors"
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    blobs, out = [], {}
    off = 0
    for name, t in header.items():
        if name == "__metadata__" or name in tensors:
            continue
        a, b = t["data_offsets"]
        blobs.append(data[a:b])
        out[name] = dict(t, data_offsets=[off, off + b - a])
        off += b - a
    for name, arr in tensors.items():
        b = np.ascontiguousarray(arr, dtype="<f4").tobytes()
        blobs.append(b)
        out[name] = {"dtype": "F32", "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        off += len(b)
    h = json.dumps(out).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little") + h + b"".join(blobs))


def edit_config(model, **kv):
    cfg = json.load(open(model + "/config.json"))
    for k, v in kv.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    json.dump(cfg, open(model + "/config.json", "w"))
    return cfg


def test_llama_attention_bias_includes_o_proj(tmp_path):
    """Llama's attention_bias: true puts a bias on q, k, v AND o_proj (HF
    LlamaAttention); o_proj's must not be dropped, and a checkpoint that
    lacks it is refused."""
    model = make(tmp_path, "m", CONFIGS["gqa"])
    rng = np.random.default_rng(5)
    H, qd, kd = 64, 64, 32
    biases = {}
    for l in range(2):
        p = "model.layers.%d.self_attn." % l
        biases[p + "q_proj.bias"] = rng.normal(0, 0.3, qd)
        biases[p + "k_proj.bias"] = rng.normal(0, 0.3, kd)
        biases[p + "v_proj.bias"] = rng.normal(0, 0.3, kd)
    add_tensors(model, biases)
    edit_config(model, attention_bias=True)
    r = subprocess.run([ENGINE, "logits", "--model", model, "--tokens", "[1,2]"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "o_proj.bias" in r.stderr, r.stderr
    add_tensors(model, {"model.layers.%d.self_attn.o_proj.bias" % l: rng.normal(0, 0.5, H)
                        for l in range(2)})
    ours = engine_logits(model, TOKENS)
    ref = llama_ref.logits(model, TOKENS)
    assert rel(ours, ref) < 2e-6
    # the o bias changes the result: a reference without it is far off
    without = dict(json.load(open(model + "/config.json")))
    assert without["attention_bias"] is True
    add_tensors(model, {"model.layers.%d.self_attn.o_proj.bias" % l: np.zeros(H)
                        for l in range(2)})
    assert rel(engine_logits(model, TOKENS), ours) > 1e-3


@pytest.mark.parametrize("target", ["emu-forward"])
def test_cuda_attention_bias_includes_o_proj(tmp_path, target):
    model = make(tmp_path, "m", CONFIGS["gqa"])
    rng = np.random.default_rng(6)
    t = {}
    for l in range(2):
        p = "model.layers.%d.self_attn." % l
        for name, n in (("q", 64), ("k", 32), ("v", 32), ("o", 64)):
            t[p + name + "_proj.bias"] = rng.normal(0, 0.4, n)
    add_tensors(model, t)
    edit_config(model, attention_bias=True)
    cpu = engine_logits(model, TOKENS)
    assert rel(cuda_logits(model, TOKENS, "f32", target=target), cpu) < tol(target, "f32")


def test_rope_parameters_are_read(tmp_path):
    """Newer transformers configs put rope_theta (and the scaling) under
    rope_parameters: the same model either way, and not theta 10000."""
    model = make(tmp_path, "m", CONFIGS["gqa"])
    edit_config(model, rope_theta=500000.0)
    top = engine_logits(model, TOKENS)
    edit_config(model, rope_theta=None, rope_parameters={"rope_type": "default",
                                                         "rope_theta": 500000.0})
    nested = engine_logits(model, TOKENS)
    assert np.array_equal(top, nested)
    assert rel(nested, llama_ref.logits(model, TOKENS)) < 2e-6
    edit_config(model, rope_parameters=None)
    assert rel(engine_logits(model, TOKENS), top) > 1e-4
    # llama3 scaling under rope_parameters
    model = make(tmp_path, "l3", CONFIGS["llama3_rope_bf16"])
    flat = engine_logits(model, TOKENS)
    cfg = json.load(open(model + "/config.json"))
    edit_config(model, rope_theta=None, rope_scaling=None,
                rope_parameters=dict(cfg["rope_scaling"], rope_theta=cfg["rope_theta"]))
    assert np.array_equal(engine_logits(model, TOKENS), flat)
    assert rel(flat, llama_ref.logits(model, TOKENS)) < 2e-4


def first_greedy_token(model, prompt):
    return int(np.argmax(engine_logits(model, prompt)))


@pytest.mark.parametrize("where", ["config", "generation_config"])
def test_every_eos_token_id_stops(stack, tmp_path, where):
    """Several eos_token_ids (Llama-3 instruct: <|end_of_text|> and
    <|eot_id|>): generation stops at any of them, not only the first."""
    model = make(tmp_path, "m", CONFIGS["gqa"], tokenizer=QWEN_TOK)
    prompt = TOKENS[:20]
    tok = first_greedy_token(model, prompt)
    other = (tok + 1) % 1000
    if where == "config":
        edit_config(model, eos_token_id=[other, tok])
    else:
        edit_config(model, eos_token_id=other)
        json.dump({"eos_token_id": [other, tok]}, open(model + "/generation_config.json", "w"))
    w = stack.worker(extra=["--engine", "cpu", "--model", model, "--num-blocks", "64"])
    s, _, out, _ = kvt.post_json(w.ports[0], "/v1/completions",
                                 {"prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert s == 200, out
    assert out["choices"][0]["finish_reason"] == "stop", out
    assert out["usage"]["completion_tokens"] <= 1, out


def test_f16_checkpoint_stays_f16(tmp_path):
    """Without KVW_CUDA_DTYPE the CUDA engine keeps the checkpoint's type:
    an f16 model runs in f16 (not bf16), a bf16 one in bf16."""
    for name, want in (("linear_rope_f16", "f16"), ("llama3_rope_bf16", "bf16")):
        model = make(tmp_path, name, CONFIGS[name])
        env = cuda_env("emu-forward")
        env.pop("KVW_CUDA_DTYPE")
        r = subprocess.run([ENGINE, "logits", "--engine", "cuda", "--model", model, "--tokens",
                            json.dumps(TOKENS)], capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stderr
        assert "weights in %s (checkpoint %s)" % (want, want) in r.stderr, r.stderr
        got = np.array(json.loads(r.stdout))
        assert rel(got, engine_logits(model, TOKENS)) < TOL["emu"][want]
