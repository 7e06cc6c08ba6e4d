"""A trimmed `make bench-e2e`: 8 mock engines, a few hundred requests with
heavy prefix sharing at high speedup, through kvroute (events and
approximate) and round_robin. kvroute must find more cached prefix than
round robin does. The full comparison is `make bench-e2e` (docs/BENCHMARKS.md).
"""
import json
import os
import random
import subprocess
import sys

import pytest

import kvt

TOP = kvt.TOP
ENGINES = 8
REQUESTS = 150 if kvt.SANITIZE else 300


def accepts(http_conf):
    """(ok, nginx -t output) for an upstream using these directives."""
    s = kvt.Stack("bench-probe")
    try:
        n = kvt.Nginx(s, http_conf, "", kvt.free_port(), 1)
        return n.check()
    finally:
        s.close()


KVROUTE_OK, KVROUTE_WHY = accepts(
    "kvroute_zone kv 64m;\nupstream u { kvroute zone=kv; server 127.0.0.1:1; }\n")
NOT_MERGED = pytest.mark.xfail(not KVROUTE_OK, strict=False,
                               reason="KV-aware balancer not merged yet: nginx -t says "
                                      + KVROUTE_WHY.strip().splitlines()[0][:200]
                                      if not KVROUTE_OK else "")


def shared_prefix_trace(path, n, groups=16, prefix_blocks=4, seed=7):
    """n requests, each one of `groups` documents (prefix_blocks trace blocks)
    followed by one block of its own: ideal reuse is about 0.8."""
    rnd = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            g = rnd.randrange(groups)
            ids = [g * 100 + b for b in range(prefix_blocks)] + [100000 + i]
            f.write(json.dumps({"timestamp": i * 100, "input_length": 512 * len(ids),
                                "output_length": 8, "hash_ids": ids}) + "\n")
    return path


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench-e2e")
    trace = shared_prefix_trace(str(d / "trace.jsonl"), REQUESTS)
    env = dict(os.environ, KVROUTE_BUILD=kvt.BUILD)
    r = subprocess.run([sys.executable, os.path.join(TOP, "tools", "bench-e2e"),
                        "--build", kvt.BUILD, "--trace", trace, "--requests", str(REQUESTS),
                        "--engines", str(ENGINES), "--speedup", "10", "--engine-speedup", "4",
                        "--policies", "kvroute,kvroute-approx,round_robin", "--out", str(d),
                        "--no-plots"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    with open(d / "summary.json") as f:
        return json.load(f), r.stdout


def test_round_robin_runs_clean(bench):
    s, out = bench
    rr = s["round_robin"]
    assert "skipped" not in rr, rr
    assert rr["errors"] == 0 and rr["completed"] == REQUESTS, out
    assert 0.7 < s["ideal_reuse"] < 0.85
    assert "policy" in out and "round_robin" in out
    # the honest references: the oracle on this fleet and the infinite single cache
    assert 0 < s["oracle_hit_rate"] <= s["ideal_hit_rate"] <= 1
    assert rr["share_of_oracle"] == pytest.approx(rr["hit_rate"] / s["oracle_hit_rate"])
    assert rr["share_of_ideal"] == pytest.approx(rr["hit_rate"] / s["ideal_hit_rate"])
    # load spread from every engine's kvworker_busy_seconds_total
    assert len(rr["busy_s"]) == ENGINES and all(b > 0 for b in rr["busy_s"])
    assert rr["load_spread"] >= 1 and "/oracle" in out and "spread" in out
    # the host's share of the run: every engine's kvworker_late_seconds_total, summed
    assert rr["late_s"] is not None and rr["late_s"] >= 0 and "late s" in out
    # the engines' own time to first token is read (compared with the client's in the bench, not here)
    assert rr["engine_ttft_mean_ms"] > 0 and "eng TTFT" in out
    # how much of each pool running requests held, and the oracle with only the rest as cache
    assert 0 <= rr["kv_active"] <= 1 and rr["preemptions"] >= 0 and "KV act" in out
    assert 0 < rr["free_oracle_hit_rate"] <= s["ideal_hit_rate"] and "/free" in out
    assert rr["share_of_free_oracle"] == pytest.approx(rr["hit_rate"] / rr["free_oracle_hit_rate"])
    assert rr["kv_blocks"] == [32768] * ENGINES     # --num-blocks' default, as the engines report it


def test_the_pressure_workload_runs_on_its_own_pool(tmp_path):
    """The suite's `pressure` workload (the conversation trace on half the KV pool) starts
    its engines with its own pool whatever --num-blocks says, and its oracles use it."""
    r = subprocess.run([sys.executable, os.path.join(TOP, "tools", "bench-e2e"),
                        "--build", kvt.BUILD, "--suite", "--workloads", "pressure",
                        "--scale", "0.02", "--policies", "round_robin", "--engines", "2",
                        "--out", str(tmp_path), "--no-plots"],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, KVROUTE_BUILD=kvt.BUILD))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    with open(tmp_path / "run1" / "pressure" / "summary.json") as f:
        s = json.load(f)
    rr = s["round_robin"]
    assert rr["errors"] == 0 and rr["completed"] == 30, rr
    assert s["settings"]["num_blocks"] == 16384 and rr["kv_blocks"] == [16384, 16384]
    assert s["oracle"]["cache_tokens"] == 16384 * 64


@NOT_MERGED
@pytest.mark.parametrize("policy", ["kvroute", "kvroute-approx"])
def test_kvroute_hit_rate_beats_round_robin(bench, policy):
    s, out = bench
    kv, rr = s[policy], s["round_robin"]
    if "skipped" in kv:
        pytest.xfail("%s not accepted by this module: %s" % (policy, kv["skipped"]))
    assert kv["errors"] == 0, out
    assert kv["hit_rate"] > rr["hit_rate"], out


def test_a_policy_named_twice_is_refused(tmp_path):
    """Two runs of one policy would write the same files and summary key: the
    second would silently replace the first. bench-e2e says so and starts
    nothing."""
    r = subprocess.run([sys.executable, os.path.join(TOP, "tools", "bench-e2e"), "--build",
                        kvt.BUILD, "--policies", "round_robin,least_conn,round_robin",
                        "--out", str(tmp_path / "out")], capture_output=True, text=True)
    assert r.returncode != 0 and "round_robin named twice" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_bench_scale_share_runs_clean():
    """A trimmed `make bench-scale` share run (issue 18's load spread): one
    instance behind least_conn and in events mode, then two instances, over
    8 mock engines. Every request completes, every engine's busy time and
    scheduled TTFT are read, and kvroute finds more of the sessions' shared
    prefixes than least_conn does. The sessions' trace (ten seconds of think times) is
    replayed three times as fast on engines three times as fast (4 x 3): the same run as
    at speedup 4, in a third of the time."""
    env = dict(os.environ, KVROUTE_BUILD=kvt.BUILD, BENCH_SCALE_INSTANCES="1,2",
               BENCH_SCALE_MODES="events", BENCH_SCALE_ONE_MODES="least_conn,events",
               BENCH_SCALE_REQUESTS="120", BENCH_SCALE_RATE="32", BENCH_SCALE_SPEEDUP="12",
               BENCH_SCALE_REPLAY_SPEEDUP="3")
    r = subprocess.run([sys.executable, os.path.join(TOP, "tools", "bench_scale.py"), "share"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    runs = json.loads(r.stdout[r.stdout.index('{\n "share"'):])["share"]
    assert [(x["instances"], x["mode"]) for x in runs] == \
        [(1, "least_conn"), (1, "events"), (2, "events")]
    for x in runs:
        assert x["errors"] == 0 and x["completed"] == 120, x
        assert len(x["busy_s"]) == ENGINES and x["busy_spread"] >= 1, x
        assert sum(x["requests"]) == 120, x
        assert x["engine_ttft_mean_ms"] > 0 and x["ttft_mean_ms"] > 0, x
    assert runs[1]["hit_rate"] > runs[0]["hit_rate"], runs


@NOT_MERGED
def test_a_mixed_fleet_runs_clean(tmp_path):
    """--slow-engines K: the last K engines are a second kvworker process at another
    speed, whose worker ids follow the first's (the router tells every engine apart
    and counts each one's load), weighted by speed with --weigh-speeds (nginx accepts
    weight= beside kvroute); every request completes, every engine's busy time is read,
    and the oracle is the two-speed one."""
    trace = shared_prefix_trace(str(tmp_path / "trace.jsonl"), 40)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, os.path.join(TOP, "tools", "bench-e2e"),
                        "--build", kvt.BUILD, "--trace", trace, "--requests", "40",
                        "--engines", "4", "--slow-engines", "2", "--slow-factor", "0.5",
                        "--weigh-speeds",
                        "--speedup", "10", "--engine-speedup", "4", "--policies", "kvroute",
                        "--out", str(out), "--no-plots"],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, KVROUTE_BUILD=kvt.BUILD))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    with open(out / "summary.json") as f:
        s = json.load(f)
    kv = s["kvroute"]
    assert kv["errors"] == 0 and kv["completed"] == 40, kv
    assert len(kv["busy_s"]) == 4 and None not in kv["busy_s"], kv
    assert s["settings"]["slow_engines"] == 2 and s["settings"]["slow_factor"] == 0.5
    assert s["settings"]["weigh_speeds"] is True
    # the oracle was asked for the fleet's two speeds
    assert s["oracle"]["slow_engines"] == 2 and s["oracle"]["slow_factor"] == 0.5
    with open(out / "kvroute.status.json") as f:
        servers = json.load(f)["zones"]["kv"]["upstreams"]["llm"]
    assert sorted(x["worker_id"] for x in servers) == [7000, 7001, 7002, 7003]
    assert sum(x["requests"] for x in servers) == 40
