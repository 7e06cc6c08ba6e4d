"""kvsynth on the shipped Mooncake trace: fidelity at multiplier 1, each
knob moving what it should, determinism, bad input."""
import json
import os
import subprocess

import pytest

import kvt

KVSYNTH = os.path.join(kvt.BIN, "kvsynth")
TRACE = os.path.join(kvt.TOP, "t", "data", "mooncake_synthetic_trace.jsonl")


def run(*args, check=True):
    r = subprocess.run([KVSYNTH] + list(args), capture_output=True, text=True,
                       env=kvt.sanitizer_env())
    if check:
        assert r.returncode == 0, r.stderr
    return r


def stats(path):
    return json.loads(run("stats", path).stdout)


def synth(tmp_path, name, *knobs):
    out = str(tmp_path / name)
    run("synthesize", TRACE, "--out", out, *knobs)
    return out, stats(out)


def close(a, b, tol):
    return abs(a - b) <= tol * abs(b)


@pytest.fixture(scope="module")
def source():
    return stats(TRACE)


def test_multiplier_one_reproduces_the_source(tmp_path, source):
    for seed in ("1", "2", "3"):
        _, s = synth(tmp_path, "s%s.jsonl" % seed, "--seed", seed)
        assert s["requests"] == source["requests"]
        assert close(s["ideal_reuse"], source["ideal_reuse"], 0.05), s
        assert close(s["mean_input_length"], source["mean_input_length"], 0.05), s
        assert close(s["mean_output_length"], source["mean_output_length"], 0.05), s
        assert close(s["std_input_length"], source["std_input_length"], 0.10), s


def test_deterministic_for_a_seed(tmp_path):
    a, _ = synth(tmp_path, "a.jsonl", "--seed", "7", "--num-requests", "500")
    b, _ = synth(tmp_path, "b.jsonl", "--seed", "7", "--num-requests", "500")
    c, _ = synth(tmp_path, "c.jsonl", "--seed", "8", "--num-requests", "500")
    assert open(a, "rb").read() == open(b, "rb").read()
    assert open(a, "rb").read() != open(c, "rb").read()


def test_knobs(tmp_path, source):
    _, base = synth(tmp_path, "base.jsonl", "--seed", "5")
    _, osl = synth(tmp_path, "osl.jsonl", "--seed", "5", "--osl-multiplier", "2")
    assert close(osl["mean_output_length"], 2 * base["mean_output_length"], 0.02)
    assert osl["mean_input_length"] == base["mean_input_length"]
    assert osl["ideal_reuse"] == base["ideal_reuse"]

    _, sp = synth(tmp_path, "sp.jsonl", "--seed", "5", "--speedup-ratio", "4")
    assert close(sp["mean_interarrival_ms"], base["mean_interarrival_ms"] / 4, 0.02)
    assert sp["mean_input_length"] == base["mean_input_length"]

    _, pl = synth(tmp_path, "pl.jsonl", "--seed", "5", "--prompt-len-multiplier", "2")
    assert pl["mean_input_length"] > 1.2 * base["mean_input_length"]
    assert pl["mean_output_length"] == base["mean_output_length"]
    assert pl["ideal_reuse"] < base["ideal_reuse"]      # longer unique parts

    _, px = synth(tmp_path, "px.jsonl", "--seed", "5", "--prefix-len-multiplier", "2")
    assert px["mean_input_length"] > 1.2 * base["mean_input_length"]
    assert px["ideal_reuse"] > base["ideal_reuse"]      # longer shared prefixes
    assert px["mean_output_length"] == base["mean_output_length"]

    _, pr = synth(tmp_path, "pr.jsonl", "--seed", "5", "--prefix-root-multiplier", "4")
    # disjoint copies of the tree: more distinct ids for the same requests
    assert pr["blocks"] > 1.3 * base["blocks"]
    assert pr["ideal_reuse"] < base["ideal_reuse"]      # less sharing across copies
    assert close(pr["mean_input_length"], base["mean_input_length"], 0.10)   # seed noise


def test_bad_input_line_is_reported(tmp_path):
    bad = tmp_path / "bad.jsonl"
    lines = open(TRACE).read().splitlines()[:5]
    lines[3] = '{"timestamp": 1, "input_length": "x"}'
    bad.write_text("\n".join(lines) + "\n")
    r = run("stats", str(bad), check=False)
    assert r.returncode == 1 and "line 4" in r.stderr
    notree = tmp_path / "notree.jsonl"
    notree.write_text('{"timestamp":0,"input_length":1024,"output_length":1,"hash_ids":[1,2]}\n'
                      '{"timestamp":1,"input_length":1024,"output_length":1,"hash_ids":[3,2]}\n')
    r = run("synthesize", str(notree), check=False)
    assert r.returncode == 1 and "two different parents" in r.stderr
