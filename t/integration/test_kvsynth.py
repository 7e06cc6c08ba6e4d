"""kvsynth, the real binary: stats, fidelity of a multiplier-1 synthesis,
determinism, disjoint tree copies, and errors that name the bad line."""
import json
import os
import subprocess

import kvt

KVSYNTH = os.path.join(kvt.BIN, "kvsynth")
SOURCE = os.path.join(kvt.TOP, "t", "data", "mooncake_synthetic_trace.jsonl")
BS = 512


def run(*args, stdin=None):
    return subprocess.run([KVSYNTH, *args], input=stdin, capture_output=True, timeout=60,
                          env=kvt.sanitizer_env())


def stats(path_or_bytes):
    if isinstance(path_or_bytes, bytes):
        r = run("stats", "-", stdin=path_or_bytes)
    else:
        r = run("stats", path_or_bytes)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def synth(*knobs):
    r = run("synthesize", SOURCE, *knobs)
    assert r.returncode == 0, r.stderr
    return r.stdout


def rows(data):
    return [json.loads(line) for line in data.splitlines() if line.strip()]


def ideal_reuse(reqs):
    seen, hits, total = set(), 0, 0
    for q in reqs:
        prefix, hit = 0, True
        for h in q["hash_ids"]:
            prefix = hash((prefix, h))      # names the whole prefix up to h
            hit = hit and prefix in seen
            seen.add(prefix)
            hits += hit
        total += len(q["hash_ids"])
    return hits / total


def test_stats_of_source():
    s = stats(SOURCE)
    assert s["requests"] == 3993
    assert s["blocks"] == 43924
    assert abs(s["ideal_reuse"] - 0.6396) < 0.001
    for key in ("mean_input_length", "std_input_length", "mean_output_length",
                "std_output_length", "mean_inter_arrival_ms", "core_nodes", "core_depth",
                "branching", "tree_violations"):
        assert key in s
    assert s["core_nodes"] > 0 and s["tree_violations"] == 0


def test_multiplier_one_close_to_source():
    src = stats(SOURCE)
    got = [stats(synth("--seed", str(seed))) for seed in (11, 12, 13)]
    for key, tol in (("ideal_reuse", 0.05), ("mean_input_length", 0.05),
                     ("mean_output_length", 0.05), ("std_input_length", 0.10)):
        mean = sum(g[key] for g in got) / len(got)
        assert abs(mean / src[key] - 1) <= tol, (key, mean, src[key])
    for g in got:
        assert g["requests"] == src["requests"]


def test_deterministic_and_out_file(tmp_path):
    a = synth("--seed", "9", "--num-requests", "300")
    b = synth("--seed", "9", "--num-requests", "300")
    c = synth("--seed", "10", "--num-requests", "300")
    assert a == b and a != c
    out = tmp_path / "x.jsonl"
    synth("--seed", "9", "--num-requests", "300", "--out", str(out))
    assert out.read_bytes() == a
    assert len(rows(a)) == 300


def test_lengths_match_hash_ids_under_knobs():
    data = synth("--prefix-len-multiplier", "1.5", "--prompt-len-multiplier", "0.7",
                 "--prefix-root-multiplier", "2", "--osl-multiplier", "3",
                 "--speedup-ratio", "2", "--num-requests", "2000")
    for q in rows(data):
        assert len(q["hash_ids"]) == -(-q["input_length"] // BS)


def test_root_copies_keep_reuse_per_copy():
    """Two copies, twice the requests: each copy is reused like the one tree."""
    n = stats(SOURCE)["requests"]
    core = stats(SOURCE)["core_blocks"]
    one = rows(synth("--seed", "3"))
    two = rows(synth("--seed", "3", "--prefix-root-multiplier", "2",
                     "--num-requests", str(2 * n)))
    copies = ([], [])
    for i, q in enumerate(two):
        ids = q["hash_ids"]
        core_ids = [h for h in ids if h < 2 * core]
        if core_ids:
            assert len({h // core for h in core_ids}) == 1   # one copy per request
            copies[core_ids[0] // core].append(q)
        else:
            copies[i % 2].append(q)                          # prompt unique from the root
    r1 = ideal_reuse(one)
    for c in copies:
        assert abs(len(c) / n - 1) < 0.1
        assert abs(ideal_reuse(c) / r1 - 1) < 0.05
    a = {h for q in copies[0] for h in q["hash_ids"]}
    b = {h for q in copies[1] for h in q["hash_ids"]}
    assert not a & b                                         # disjoint hash ids
    assert ideal_reuse(two) < r1 * 1.02


def test_bad_line_reports_its_number(tmp_path):
    lines = open(SOURCE, "rb").read().splitlines(keepends=True)[:4]
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"".join(lines[:2]) + b'{"timestamp": 1, "input_length": "x"}\n' + lines[3])
    for cmd in ("synthesize", "stats"):
        r = run(cmd, str(bad))
        assert r.returncode != 0
        assert b"line 3" in r.stderr
        assert r.stdout == b""


def test_bad_options():
    assert run("synthesize", SOURCE, "--speedup-ratio", "0").returncode == 2
    assert run("synthesize", SOURCE, "--num-requests", "-3").returncode == 2
    assert run("synthesize", SOURCE, "--bogus", "1").returncode == 2
    assert run("frobnicate", SOURCE).returncode == 2
    r = run("stats", "/nonexistent/trace.jsonl")
    assert r.returncode == 1 and b"nonexistent" in r.stderr


def sessions(*knobs):
    r = run("sessions", *[str(k) for k in knobs])
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_sessions_shape_and_determinism():
    out = sessions("--num-requests", 400, "--rate", 5, "--seed", 3)
    assert out == sessions("--num-requests", 400, "--rate", 5, "--seed", 3)
    assert out != sessions("--num-requests", 400, "--rate", 5, "--seed", 4)
    reqs = rows(out)
    assert len(reqs) == 400
    ts = [q["timestamp"] for q in reqs]
    assert ts == sorted(ts)
    # a session is named by its first user message, the ids right after the system prompt
    sys_blocks = 1024 // 16
    by_session = {}
    for q in reqs:
        ids = q["hash_ids"]
        assert q["input_length"] == 16 * len(ids)
        assert 64 <= q["output_length"] <= 384
        assert len(set(ids[:sys_blocks])) == sys_blocks and ids[0] >> 32 in range(1, 17)
        by_session.setdefault(ids[sys_blocks], []).append(q)
    turns = [len(v) for v in by_session.values()]
    assert max(turns) <= 6 and max(turns) > 2
    for v in by_session.values():
        for a, b in zip(v, v[1:]):
            # each turn resends the previous prompt, then the reply and a new message
            assert b["hash_ids"][:len(a["hash_ids"])] == a["hash_ids"]
            reply = -(-a["output_length"] // 16)
            assert len(b["hash_ids"]) >= len(a["hash_ids"]) + reply + 4
            # the user thinks 10-60 s between turns
            assert 10000 <= b["timestamp"] - a["timestamp"] <= 60000


def test_sessions_bad_knobs():
    for bad in (["--turns", "3:2"], ["--rate", "0"], ["--think-s", "30:10:60"],
                ["--user-tokens", "5"], ["--num-requests", "x"], ["--bogus", "1"]):
        r = run("sessions", *bad)
        assert r.returncode == 2 and b"kvsynth" in r.stderr and r.stdout == b"", bad
