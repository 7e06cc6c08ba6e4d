"""The CPU engine on tiny random-weight models made by
kvtiny-model, against an independent numpy implementation (t/ref), and
through kvworker's scheduler and HTTP front."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import kvt

sys.path.insert(0, os.path.join(kvt.TOP, "t", "ref"))
import llama_ref  # noqa: E402

TINY = os.path.join(kvt.BIN, "kvtiny-model")
ENGINE = os.path.join(kvt.BIN, "kvengine")
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
}

TOKENS = [17, 4, 290, 1000, 5, 5, 77, 31337, 12, 9, 100, 2, 8, 3000, 44, 45, 46, 47, 48, 49,
          50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65, 66, 67]


def make(tmp_path, name, args, tokenizer=GPT2_TOK):
    out = str(tmp_path / name)
    r = subprocess.run([TINY, "--out", out, "--tokenizer", tokenizer, "--seed", "3"] + args,
                       capture_output=True, text=True, cwd=kvt.TOP)
    assert r.returncode == 0, r.stderr
    return out


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


def cuda_logits(model, tokens, dtype, *extra):
    """The CUDA engine's logits with weights in dtype; skips where there is no GPU."""
    lib = os.path.join(kvt.BUILD, "lib", "libkvcuda.so")
    if not os.path.exists(lib):
        pytest.skip("no CUDA engine here: libkvcuda.so is built only where nvcc exists")
    env = kvt.sanitizer_env()
    env["KVW_CUDA_DTYPE"] = dtype
    if kvt.SANITIZE:    # ASan's shadow gap hides the address range the CUDA driver wants
        env["ASAN_OPTIONS"] = env.get("ASAN_OPTIONS", "") + ":protect_shadow_gap=0"
    r = subprocess.run([ENGINE, "logits", "--engine", "cuda", "--model", model, "--tokens",
                        json.dumps(tokens)] + list(extra), capture_output=True, text=True,
                       env=env)
    if r.returncode != 0 and "no CUDA device" in r.stderr:
        pytest.skip("no GPU: " + r.stderr.strip())
    assert r.returncode == 0, r.stderr
    return np.array(json.loads(r.stdout))


@pytest.mark.parametrize("name", ["gqa", "qwen2_bias", "mha_tied"])
def test_cuda_engine_matches_cpu(tmp_path, name):
    """f32 weights: the CPU engine's numbers, up to summation order."""
    model = make(tmp_path, "m", CONFIGS[name])
    gpu = cuda_logits(model, TOKENS, "f32")
    cpu = engine_logits(model, TOKENS)
    assert np.max(np.abs(gpu - cpu)) / np.max(np.abs(cpu)) < 1e-3
    assert int(np.argmax(gpu)) == int(np.argmax(cpu))
    # paged prefill chunks and a prefix read back from the pool give the same
    chunked = cuda_logits(model, TOKENS, "f32", "--chunk", "5", "--prefix", "16")
    assert np.max(np.abs(chunked - gpu)) / np.max(np.abs(cpu)) < 1e-4
    batched = cuda_logits(model, TOKENS, "f32", "--batch", "5")
    assert np.max(np.abs(batched - gpu)) / np.max(np.abs(cpu)) < 1e-4


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_cuda_engine_half_weights_close_to_cpu(tmp_path, dtype):
    """bf16/f16 weights and matmul inputs: within their rounding (about 1%
    of the largest logit on this model, by a numpy simulation of the
    rounding; 3% allowed)."""
    model = make(tmp_path, "m", CONFIGS["gqa"])
    gpu = cuda_logits(model, TOKENS, dtype)
    cpu = engine_logits(model, TOKENS)
    assert np.max(np.abs(gpu - cpu)) / np.max(np.abs(cpu)) < 3e-2
