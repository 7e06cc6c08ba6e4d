"""The CUDA engine's handling of devices and device failures, on the host
emulation of CUDA (libkvcuda-emu.so, workers/cuda/emu), which can fake
what a GPU-less machine cannot show: a device count error of any kind,
several devices, a sticky fault in the middle of serving, a small device
memory. Skipped where g++ (and so the emulated build) is missing."""
import json
import os
import subprocess
import time

import pytest

import kvnats
import kvt
from test_cpu_engine import CONFIGS, ENGINE, QWEN_TOK, cuda_env, make
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
    """A fault that poisons the CUDA context (here injected at the 30th
    kernel launch, in a decode step) fails that request; from then on the
    worker fails /health, refuses requests with 503 and stops heartbeating,
    so routers stop sending to it, instead of failing every step while
    looking healthy."""
    model = make(tmp_path, "m", CONFIGS["gqa"], tokenizer=QWEN_TOK)
    ns = stack.nats()
    nc = kvnats.Nats(ns.port)
    hb = nc.subscribe(kvproto.heartbeat(P))
    env = cuda_env("emu-forward")
    env["KVW_CUDAEMU_FAIL_LAUNCH"] = "30"
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
    model = make(tmp_path, "m", CONFIGS["gqa"], tokenizer=QWEN_TOK)
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
