"""vLLM / SGLang KV events over ZMQ: real nginx with the module,
its helper process subscribed to publishers written from vLLM's schema
(t/lib/vllm_pub.py, real libzmq PUB and ROUTER sockets), real kvworker mock
engines as the upstream servers."""
import json

import pytest

import kvt

vllm_pub = pytest.importorskip("vllm_pub")

CONF = """
    kvroute_zone kv 16m;
    upstream llm {
        zone llm 64k;
        kvroute zone=kv mode=events block_size=16 %(params)s;
        %(servers)s
        %(events)s
        keepalive 8;
    }
    server {
        listen 127.0.0.1:%%(port)s;
        location /v1/ {
            kvroute_upstream llm;
            proxy_pass http://llm;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            kvroute_debug_headers on;
        }
        location = /kvroute/status { kvroute_status; }
    }
"""


def conf(d, params="salt=$http_x_lora"):
    return CONF % dict({"params": params}, **d)


def ids(seed, n):
    return [1000 + (seed * 7919 + i * 31) % 30000 for i in range(n)]


def status(port):
    s, _, body = kvt.request(port, "GET", "/kvroute/status")
    assert s == 200
    return json.loads(body)["zones"]["kv"]


def ev_status(port):
    return status(port)["events"]


def worker_rec(port, server):
    for w in ev_status(port)["workers"]:
        if w["address"] == server:
            return w
    return None


def indexed(port, server):
    """Blocks the events index holds for server (routing adds, for 10 s, the
    router's own recent decisions: the pending index; this does not)."""
    for x in status(port)["upstreams"]["llm"]:
        if x["server"] == server:
            return x["indexed_blocks"]
    raise KeyError(server)


def route(port, tokens, lora=None, cache_salt=None):
    headers = {"X-Lora": lora} if lora else None
    body = {"model": "kvroute-mock", "prompt": tokens, "max_tokens": 1}
    if cache_salt:
        body["cache_salt"] = cache_salt
    s, h, body, _ = kvt.post_json(port, "/v1/completions", body, headers=headers)
    assert s == 200, body
    return h["x-kvroute-worker"], int(h["x-kvroute-overlap"])


class Fleet:
    """n mock workers, a publisher per worker, nginx following them."""

    def __init__(self, stack, n=2, hash_kinds=None, replay=True, pubs=None, events=None,
                 wait_live=True, block_size=16, forms=None, params="salt=$http_x_lora",
                 worker_extra=()):
        self.stack = stack
        self.w = stack.worker(engines=n, extra=["--speedup", "50"] + list(worker_extra))
        self.servers = ["127.0.0.1:%d" % p for p in self.w.ports]
        kinds = hash_kinds or ["bytes"] * n
        forms = forms or ["array"] * n
        self.pubs = pubs or [vllm_pub.VllmPublisher(hash_kind=kinds[i], replay=replay,
                                                    block_size=block_size, form=forms[i])
                             for i in range(n)]
        if events is None:
            events = "\n".join(
                "kvroute_events %s %sserver=%s;" % (
                    p.url, "replay=%s " % p.replay_url if p.router is not None else "", s)
                for p, s in zip(self.pubs, self.servers))
        self.ng = stack.nginx(conf({
            "servers": "\n".join("server %s;" % s for s in self.servers), "events": events},
            params))
        if wait_live:
            self.wait_live()

    def wait_live(self, timeout=15):
        kvt.wait_until(lambda: ev_status(self.ng.port)["zmq_connected"] == len(self.pubs)
                       and all((worker_rec(self.ng.port, s) or {}).get("state") == "live"
                               for s in self.servers),
                       timeout=timeout, what="publishers connected")

    def indexed(self, i, n):
        return lambda: indexed(self.ng.port, self.servers[i]) == n

    def routes_to(self, tokens, i, blocks, lora=None):
        return lambda: route(self.ng.port, tokens, lora) == (self.servers[i], blocks)

    def close(self):
        for p in self.pubs:
            p.close()


@pytest.fixture
def fleet(stack):
    made = []

    def make(*a, **kw):
        f = Fleet(stack, *a, **kw)
        made.append(f)
        return f
    yield make
    for f in made:
        f.close()


def subscribed(f, i, probe_seed):
    """PUB drops what it sends before the subscription arrives: publish a
    probe until the helper has applied one (a fresh publisher starts at seq 0)."""
    p = f.pubs[i]

    def probe():
        p.store(ids(probe_seed, 16))
        rec = worker_rec(f.ng.port, f.servers[i])
        return rec is not None and rec["events"] > 0
    kvt.wait_until(probe, timeout=15, interval=0.2, what="subscription")


def gone(f, p, what="publisher gone: load only"):
    """Closes worker 0's publisher and waits until its worker is routed by
    load only (the engine's process gone, as a restart starts)."""
    p.close()
    kvt.wait_until(lambda: worker_rec(f.ng.port, f.servers[0])["state"] == "stale", what=what)


def test_stored_removed_cleared_drive_routing(fleet):
    f = fleet(2)
    for i in range(2):
        subscribed(f, i, 900 + i)
    a = ids(1, 64)
    b = ids(2, 64)
    ha = f.pubs[0].store(a)
    f.pubs[1].store(b)
    kvt.wait_until(lambda: f.indexed(0, 5)() and f.indexed(1, 5)(), what="stored")
    assert route(f.ng.port, a + [5] * 8) == (f.servers[0], 4)
    assert route(f.ng.port, b + [5] * 8) == (f.servers[1], 4)
    # a child extends a's chain by its parent's engine hash
    c = ids(3, 32)
    f.pubs[0].store(c, parent=ha[-1])
    kvt.wait_until(f.indexed(0, 7), what="chained store")
    assert route(f.ng.port, a + c) == (f.servers[0], 6)
    # removals and clear (asked of the events index: the pending index
    # remembers the router's own decisions for a while)
    f.pubs[0].remove(ha[2:])
    kvt.wait_until(f.indexed(0, 5), what="removed")
    f.pubs[0].clear()
    kvt.wait_until(f.indexed(0, 0), what="cleared")
    assert f.indexed(1, 5)()
    st = ev_status(f.ng.port)
    assert st["decode_errors"] == 0 and st["gaps"] == 0 and st["zmq_publishers"] == 2
    rec = worker_rec(f.ng.port, f.servers[0])
    assert rec["block_size"] == 16 and rec["state"] == "live"
    assert f.ng.alerts() == []


def test_bytes_and_int_hashes(fleet):
    f = fleet(2, hash_kinds=["bytes", "int"])
    for i in range(2):
        subscribed(f, i, 910 + i)
    a, b, c = ids(11, 48), ids(12, 48), ids(13, 320)
    f.pubs[0].store(a)
    hb = f.pubs[1].store(b)
    hc = f.pubs[1].store(c)
    assert isinstance(hb[0], int) and any(h < 0 for h in hb + hc)   # signed ints too
    kvt.wait_until(lambda: f.indexed(0, 4)() and f.indexed(1, 24)(), what="stored")
    assert route(f.ng.port, a) == (f.servers[0], 3)
    assert route(f.ng.port, b) == (f.servers[1], 3)
    assert route(f.ng.port, c) == (f.servers[1], 20)
    f.pubs[1].remove(hc[10:] + hb[:1])
    kvt.wait_until(f.indexed(1, 13), what="int removal")
    f.pubs[0].remove(f.pubs[0].chain(a)[1:])
    kvt.wait_until(f.indexed(0, 2), what="bytes removal")


def test_lora_blocks_do_not_match_base(fleet):
    f = fleet(2)
    for i in range(2):
        subscribed(f, i, 920 + i)
    a = ids(21, 64)
    f.pubs[0].store(a, lora_id=1, lora_name="sql-adapter")
    f.pubs[1].store(ids(22, 64))
    kvt.wait_until(lambda: f.indexed(0, 5)() and f.indexed(1, 5)(), what="stored")
    assert route(f.ng.port, a, lora="sql-adapter") == (f.servers[0], 4)
    assert route(f.ng.port, a)[1] == 0          # the base model's blocks differ
    assert route(f.ng.port, a, lora="other")[1] == 0


def test_lora_named_by_the_requests_model(fleet):
    """OpenAI clients pick an adapter with `model` alone: with model= and
    lora= the router seeds such a request with the adapter's name, as vLLM
    tags the adapter's blocks (lora_name), and base requests stay apart."""
    f = fleet(2, params="model=base lora=*",
              worker_extra=["--model", "base", "--lora-modules", "sql-adapter"])
    for i in range(2):
        subscribed(f, i, 930 + i)
    a = ids(23, 64)
    f.pubs[0].store(a, lora_id=1, lora_name="sql-adapter")
    f.pubs[1].store(a)
    kvt.wait_until(lambda: f.indexed(0, 5)() and f.indexed(1, 5)(), what="stored")

    def by_model(model, tail):
        s, h, body, raw = kvt.post_json(f.ng.port, "/v1/completions",
                                        {"model": model, "prompt": a + [tail] * 16,
                                         "max_tokens": 1})
        assert s == 200, raw
        return h["x-kvroute-worker"], int(h["x-kvroute-overlap"])

    assert by_model("sql-adapter", 1) == (f.servers[0], 4)
    assert by_model("base", 2) == (f.servers[1], 4)


def test_removals_win_over_the_routers_guesses(fleet):
    """The router credits a server with the blocks of the requests it just
    sent there (the pending index, 10 s); blocks the engine reports removed,
    or all of them when it clears, must leave those guesses too."""
    f = fleet(2)
    for i in range(2):
        subscribed(f, i, 930 + i)
    a = ids(71, 64)
    ha = f.pubs[0].store(a)
    kvt.wait_until(f.indexed(0, 5), what="stored")
    assert route(f.ng.port, a + [5] * 8) == (f.servers[0], 4)
    f.pubs[0].remove(ha[2:])
    kvt.wait_until(f.indexed(0, 3), what="removed")
    assert route(f.ng.port, a + [5] * 8) == (f.servers[0], 2)
    f.pubs[0].clear()
    kvt.wait_until(f.indexed(0, 0), what="cleared")
    assert route(f.ng.port, a + [5] * 8)[1] == 0


def test_salted_prompts_match_salted_requests(fleet):
    """vLLM names a request's cache_salt in its first block's extra keys
    only; every later block of the prompt, in this event or a later one, is
    salted too, as the router hashes a salted request."""
    f = fleet(2, forms=["array", "map"])
    for i in range(2):
        subscribed(f, i, 940 + i)
    a, b = ids(41, 64), ids(42, 64)
    ha = f.pubs[0].store(a[:32], cache_salt="tenant-a")
    f.pubs[0].store(a[32:], parent=ha[-1])                  # a later step: no salt of its own
    hb = f.pubs[1].store(b, cache_salt="tenant-b", lora_name="sql", lora_id=1)
    kvt.wait_until(lambda: f.indexed(0, 5)() and f.indexed(1, 5)(), what="stored")
    assert route(f.ng.port, a + [5] * 8, cache_salt="tenant-a") == (f.servers[0], 4)
    assert route(f.ng.port, a + [5] * 8)[1] == 0           # unsalted: other blocks
    assert route(f.ng.port, a + [5] * 8, cache_salt="tenant-b")[1] == 0
    assert route(f.ng.port, b + [5] * 8, cache_salt="tenant-b") == (f.servers[1], 4)
    # salted blocks are removed by their engine hashes like any others
    f.pubs[1].remove(hb[2:])
    kvt.wait_until(f.indexed(1, 3), what="removed")
    assert route(f.ng.port, b + [5] * 8, cache_salt="tenant-b")[1] == 2
    assert ev_status(f.ng.port)["decode_errors"] == 0


def test_sglang_and_map_forms(fleet):
    """SGLang's (and vLLM 0.9's) short arrays and newer vLLM's maps drive
    routing as vLLM 0.10's arrays do."""
    f = fleet(2, forms=["sglang", "map"], hash_kinds=["int", "bytes"])
    for i in range(2):
        subscribed(f, i, 960 + i)
    a, b = ids(61, 64), ids(62, 64)
    ha = f.pubs[0].store(a)
    hb = f.pubs[1].store(b)
    kvt.wait_until(lambda: f.indexed(0, 5)() and f.indexed(1, 5)(), what="stored")
    assert route(f.ng.port, a + [5] * 8) == (f.servers[0], 4)
    assert route(f.ng.port, b + [5] * 8) == (f.servers[1], 4)
    f.pubs[0].remove(ha[2:])
    f.pubs[1].remove(hb[1:])
    kvt.wait_until(lambda: f.indexed(0, 3)() and f.indexed(1, 2)(), what="removed")
    f.pubs[1].clear()
    kvt.wait_until(f.indexed(1, 0), what="cleared")
    assert ev_status(f.ng.port)["decode_errors"] == 0
    assert f.ng.alerts() == []


def test_hybrid_model_keeps_the_full_attention_group(fleet):
    """A hybrid model publishes a sliding-window group beside its full-
    attention group, under the same block hashes: the window's evictions
    must not take the prefix out of the index."""
    f = fleet(1, forms=["map"])
    subscribed(f, 0, 970)
    p = f.pubs[0]
    a = ids(71, 128)
    sw, fa = (0, "sliding_window"), (1, "full_attention")
    ev_sw, ha = p.stored_event(a, group=sw)
    ev_fa, _ = p.stored_event(a, group=fa)
    p.send([ev_sw, ev_fa])
    kvt.wait_until(f.indexed(0, 9), what="stored")      # 8 + the probe's 1
    p.remove(ha[:6], group=sw)                          # the window moved on
    p.store(ids(72, 16), group=fa)                      # a marker after it
    kvt.wait_until(f.indexed(0, 10), what="marker")
    assert route(f.ng.port, a) == (f.servers[0], 8)
    # the prefix itself evicted (asked of the events index: the pending
    # index remembers the route above for a while)
    p.remove(ha[4:], group=fa)
    kvt.wait_until(f.indexed(0, 6), what="full-attention removal")
    assert "hybrid KV cache: indexing group 1 (full_attention)" in f.ng.log()
    st = ev_status(f.ng.port)
    assert st["decode_errors"] == 0
    assert st["skipped_events"] == 2        # the window's store and its removal


def test_data_parallel_rank_with_its_own_server(fleet, stack):
    """vLLM's data parallelism with external load balancing: each rank has
    its own HTTP port and publishes on its own port with its rank in every
    batch. A rank other than 0 must still credit its server."""
    pubs = [vllm_pub.VllmPublisher(dp_rank=r) for r in (0, 1)]
    f = fleet(2, pubs=pubs)
    for i in range(2):
        subscribed(f, i, 980 + i)
    a, b = ids(81, 64), ids(82, 64)
    f.pubs[0].store(a)
    f.pubs[1].store(b)
    kvt.wait_until(lambda: f.indexed(0, 5)() and f.indexed(1, 5)(), what="stored")
    assert route(f.ng.port, a + [5] * 8) == (f.servers[0], 4)
    assert route(f.ng.port, b + [5] * 8) == (f.servers[1], 4)


def test_malformed_frames_counted_and_skipped(fleet):
    f = fleet(1)
    subscribed(f, 0, 930)
    p = f.pubs[0]
    before = ev_status(f.ng.port)["decode_errors"]
    p.send_raw([b"", b"short", b"\x90"])                    # seq not 8 bytes
    p.send_raw([b"", b"\0" * 8])                            # two frames
    p.send_payload(b"\xc1\xc1")                             # not msgpack (consumes a seq)
    p.send_payload(vllm_pub.msgpack.packb([1.0, [["BlockStored", [b"x"], None, [1, 2, 3],
                                                  16, None, "GPU"]]]))   # 3 tokens for 16
    a = ids(31, 32)
    p.store(a)
    kvt.wait_until(f.indexed(0, 3), what="good event after bad ones")
    st = ev_status(f.ng.port)
    assert st["decode_errors"] - before == 4
    assert st["gaps"] == 0                                  # bad payloads kept the sequence
    assert f.ng.alerts() == []


def test_dropped_message_recovered_by_replay(fleet):
    f = fleet(1)
    subscribed(f, 0, 940)
    p = f.pubs[0]
    a = ids(41, 64)
    ha = p.store(a[:32])
    p.store(a[32:], parent=ha[-1], drop=True)     # lost on the way
    p.store(ids(42, 16))                          # the gap shows here
    kvt.wait_until(f.indexed(0, 6), what="dropped store recovered by replay")
    assert route(f.ng.port, a) == (f.servers[0], 4)
    st = ev_status(f.ng.port)
    assert st["gaps"] >= 1 and st["resyncs"] >= 1 and st["dumps"] >= 1
    assert st["cleared_workers"] == 0
    assert p.replay_requests and p.replay_requests[-1] >= 1


def test_live_copy_after_the_replay_is_not_a_restart(fleet):
    """The replay socket and the SUB socket keep no order between them: a
    message the replay already gave can still come live after the replay's
    end, behind our sequence number. It is the same message, not a restarted
    engine: the worker keeps its blocks."""
    f = fleet(1)
    subscribed(f, 0, 945)
    p = f.pubs[0]
    a = ids(46, 64)
    ha = p.store(a[:32])
    late = p.seq
    p.store(a[32:], parent=ha[-1], drop=True)     # not live yet...
    p.store(ids(47, 16))                          # ...so a gap: the replay gives it
    kvt.wait_until(f.indexed(0, 6), what="recovered by replay")
    before = ev_status(f.ng.port)
    p.resend(late)                                # ...and now its live copy
    p.store(ids(48, 16))
    kvt.wait_until(f.indexed(0, 7), what="the live traffic after the copy")
    st = ev_status(f.ng.port)
    assert st["cleared_workers"] == before["cleared_workers"] == 0, st
    assert st["engine_restarts"] == before["engine_restarts"], st
    assert route(f.ng.port, a) == (f.servers[0], 4)


def test_replay_never_resurrects_a_removed_block(fleet):
    f = fleet(1)
    subscribed(f, 0, 950)
    p = f.pubs[0]
    a = ids(51, 32)
    p.replay_gate.clear()                         # hold replies until the live removal is in
    ha = p.store(a, drop=True)                    # lost store...
    p.remove(ha)                                  # ...and its live removal: a gap, replay asked
    kvt.wait_until(lambda: p.replay_requests, what="replay requested")
    p.store(ids(52, 16))                          # more live traffic while the replay waits
    # load only meanwhile (the helper may publish the state just after it asks)
    kvt.wait_until(lambda: worker_rec(f.ng.port, f.servers[0])["state"] == "stale",
                   what="stale while the replay is held")
    p.replay_gate.set()
    kvt.wait_until(lambda: ev_status(f.ng.port)["dumps"] >= 1
                   and worker_rec(f.ng.port, f.servers[0])["state"] == "live",
                   what="replay done")
    kvt.wait_until(f.indexed(0, 2), what="live events after replay")
    assert route(f.ng.port, a)[1] == 0            # the replayed store did not come back


def test_engine_restart_clears_worker(fleet):
    f = fleet(1)
    subscribed(f, 0, 960)
    p = f.pubs[0]
    a = ids(61, 48)
    p.store(a)
    for _ in range(3):
        p.store(ids(62, 16))
    kvt.wait_until(f.indexed(0, 5), what="stored")
    port, rport = p.port, p.replay_port
    gone(f, p)
    assert ev_status(f.ng.port)["zmq_connected"] == 0
    # the engine comes back: new process, same ports, sequence from 0
    q = vllm_pub.VllmPublisher(port=port, replay_port=rport)
    f.pubs[0] = q
    b = ids(63, 32)

    def restarted():
        q.store(b)
        return ev_status(f.ng.port)["engine_restarts"] >= 1
    kvt.wait_until(restarted, timeout=15, interval=0.2, what="restart detected")
    kvt.wait_until(f.indexed(0, 2), what="only the new process's blocks")
    f.wait_live()
    assert route(f.ng.port, b) == (f.servers[0], 2)


def test_restart_past_the_old_seq_before_reconnect_clears(fleet):
    """A restarted engine that published past our last seq before the SUB
    socket came back: its replay from there looks like our stream's next
    messages, but its message at our last seq is not the one we applied."""
    f = fleet(1)
    subscribed(f, 0, 995)
    p = f.pubs[0]
    a = ids(96, 48)
    p.store(a)
    kvt.wait_until(f.indexed(0, 4), what="stored")          # the probe's block and a's 3
    old_next = p.seq
    port, rport = p.port, p.replay_port
    gone(f, p)
    # the new process answers no replay until it is past the old sequence
    q = vllm_pub.VllmPublisher(port=port, replay_port=rport, replay_held=True)
    f.pubs[0] = q
    b = ids(97, 32)
    while q.seq <= old_next + 2:
        q.store(b, drop=True)                   # before we subscribed: only in its buffer
    q.replay_gate.set()
    kvt.wait_until(lambda: q.replay_requests, what="replay asked of the new process")
    f.wait_live()
    kvt.wait_until(f.indexed(0, 2), what="only the new process's blocks")
    st = ev_status(f.ng.port)
    assert st["engine_restarts"] >= 1 and st["cleared_workers"] >= 1
    assert route(f.ng.port, a)[1] == 0
    assert route(f.ng.port, b) == (f.servers[0], 2)


def test_publisher_death_and_reconnect(fleet):
    f = fleet(2)
    for i in range(2):
        subscribed(f, i, 970 + i)
    p = f.pubs[0]
    a = ids(71, 32)
    p.store(a)
    kvt.wait_until(f.indexed(0, 3), what="stored")
    port, rport = p.port, p.replay_port
    seq, buf = p.seq, list(p.buffer)
    gone(f, p, what="load only while unreachable")
    # requests are still served (by load) meanwhile
    assert route(f.ng.port, ids(72, 32))[0] in f.servers
    # the same engine process is reachable again (e.g. a network blip): same
    # sequence, nothing lost; what it published meanwhile comes back by replay
    q = vllm_pub.VllmPublisher(port=port, replay_port=rport)
    q.seq = seq
    q.buffer.extend(buf)
    f.pubs[0] = q
    b = ids(73, 32)
    q.store(b, drop=True)                         # published while we were away
    f.wait_live()
    kvt.wait_until(f.indexed(0, 5), what="missed events replayed after reconnect")
    st = ev_status(f.ng.port)
    assert st["engine_restarts"] == 0 and st["connects"] >= 3 and st["disconnects"] >= 1
    assert route(f.ng.port, b) == (f.servers[0], 2)


def test_reload_keeps_index_and_catches_up(fleet):
    f = fleet(1)
    subscribed(f, 0, 985)
    p = f.pubs[0]
    a = ids(86, 48)
    p.store(a)
    kvt.wait_until(f.indexed(0, 4), what="stored")
    before = ev_status(f.ng.port)["helper_pid"]
    p.replay_gate.clear()                 # the new helper's catch-up waits for us
    f.ng.reload()
    kvt.wait_until(lambda: ev_status(f.ng.port)["helper_pid"] not in (0, before),
                   timeout=20, what="new helper")
    b = ids(87, 32)
    p.store(b, drop=True)                 # published during the handover, never seen live
    p.replay_gate.set()
    kvt.wait_until(f.indexed(0, 6), what="kept, and caught up by replay")
    st = ev_status(f.ng.port)
    assert st["cleared_workers"] == 0 and st["engine_restarts"] == 0
    assert "adopted from the previous helper" in f.ng.log()
    f.wait_live()
    assert route(f.ng.port, a) == (f.servers[0], 3)


def test_restart_during_reload_clears(fleet):
    """The new helper adopts the old one's seq and the fingerprint of the
    batch applied there (the registry record): an engine that restarted
    meanwhile, past that seq, is told apart as on a reconnect."""
    f = fleet(1)
    subscribed(f, 0, 988)
    p = f.pubs[0]
    a = ids(88, 48)
    p.store(a)
    kvt.wait_until(f.indexed(0, 4), what="stored")
    old_next = p.seq
    port, rport = p.port, p.replay_port
    gone(f, p)
    before = ev_status(f.ng.port)["helper_pid"]
    f.ng.reload()
    kvt.wait_until(lambda: ev_status(f.ng.port)["helper_pid"] not in (0, before),
                   timeout=20, what="new helper")
    q = vllm_pub.VllmPublisher(port=port, replay_port=rport, replay_held=True)
    f.pubs[0] = q
    b = ids(89, 32)
    while q.seq <= old_next + 2:
        q.store(b, drop=True)
    q.replay_gate.set()
    kvt.wait_until(lambda: q.replay_requests, what="catch-up replay asked")
    f.wait_live()
    kvt.wait_until(f.indexed(0, 2), what="only the new process's blocks")
    assert "adopted from the previous helper" in f.ng.log()
    assert ev_status(f.ng.port)["engine_restarts"] >= 1
    assert route(f.ng.port, a)[1] == 0


def test_no_replay_socket_gap_clears(fleet):
    f = fleet(1, replay=False)
    subscribed(f, 0, 980)
    p = f.pubs[0]
    a = ids(81, 32)
    p.store(a)
    kvt.wait_until(f.indexed(0, 3), what="stored")
    p.store(ids(82, 16), drop=True)
    b = ids(83, 16)
    p.store(b)
    kvt.wait_until(f.indexed(0, 1), what="cleared after the gap, then b")
    assert ev_status(f.ng.port)["cleared_workers"] == 1


def test_no_replay_socket_reconnect_clears(fleet):
    """Without a replay socket nothing tells a blip from a restarted engine
    that went on numbering where the old one stopped: a reconnect clears."""
    f = fleet(1, replay=False)
    subscribed(f, 0, 982)
    p = f.pubs[0]
    a = ids(84, 32)
    p.store(a)
    kvt.wait_until(f.indexed(0, 3), what="stored")
    port, seq = p.port, p.seq
    gone(f, p)
    q = vllm_pub.VllmPublisher(port=port, replay=False, xpub=True)
    f.pubs[0] = q
    q.wait_subscribed()                           # reconnected: nothing sent is dropped now
    q.seq = seq                                   # its first message is the seq we expect
    b = ids(85, 16)
    q.store(b)
    kvt.wait_until(f.indexed(0, 1), what="cleared on reconnect, then b")
    assert "no replay to tell a restart from a blip" in f.ng.log()


def test_no_replay_socket_reload_keeps_a_stream_that_goes_on(fleet):
    """A reload without a replay socket: the new helper saw no disconnect,
    so its first message judges. The next seq goes on: the blocks stay (a
    reload must not cost every such worker its cache)."""
    p = vllm_pub.VllmPublisher(replay=False, xpub=True)
    f = fleet(1, replay=False, pubs=[p])
    p.wait_subscribed()
    subscribed(f, 0, 984)
    a = ids(190, 32)
    p.store(a)
    kvt.wait_until(f.indexed(0, 3), what="stored")
    before = ev_status(f.ng.port)["helper_pid"]
    f.ng.reload()
    kvt.wait_until(lambda: ev_status(f.ng.port)["helper_pid"] not in (0, before),
                   timeout=20, what="new helper")
    p.wait_subscribed()                           # the new helper's subscription
    b = ids(191, 16)
    p.store(b)
    kvt.wait_until(f.indexed(0, 4), what="b applied on top of what was kept")
    assert "adopted from the previous helper" in f.ng.log()
    assert ev_status(f.ng.port)["cleared_workers"] == 0
    f.wait_live()
    assert route(f.ng.port, a) == (f.servers[0], 2)


def test_block_size_mismatch_is_loud(fleet):
    f = fleet(1, wait_live=False, block_size=32)
    p = f.pubs[0]

    def seen():
        p.store(ids(91, 64))
        return ev_status(f.ng.port)["block_size_mismatch"] == 1
    kvt.wait_until(seen, timeout=15, interval=0.2, what="mismatch reported")
    rec = worker_rec(f.ng.port, f.servers[0])
    assert rec["block_size"] == 32 and rec["state"] == "stale"
    assert "BLOCK SIZE MISMATCH" in f.ng.log()
    assert route(f.ng.port, ids(91, 64))[1] == 0


TWO_SIZES = """
    kvroute_zone kv 16m;
    upstream small {
        zone small 64k;
        kvroute zone=kv mode=events block_size=16;
        server %(s0)s;
        kvroute_events %(p0)s server=%(s0)s;
    }
    upstream big {
        zone big 64k;
        kvroute zone=kv mode=events block_size=32;
        server %(s1)s;
        kvroute_events %(p1)s server=%(s1)s;
    }
    server {
        listen 127.0.0.1:%%(port)s;
        location /v1/ {
            kvroute_upstream small;
            proxy_pass http://small;
            kvroute_debug_headers on;
        }
        location /big/v1/ {
            rewrite ^/big(/.*)$ $1 break;
            kvroute_upstream big;
            proxy_pass http://big;
            kvroute_debug_headers on;
        }
        location = /kvroute/status { kvroute_status; }
    }
"""


def test_upstreams_of_two_block_sizes_share_a_zone(stack):
    """Each publisher is checked against its own upstream's block_size= (it
    was checked against the zone's first upstream's: the 32-token engine was
    flagged a mismatch and its events dropped)."""
    w = stack.worker(engines=2, extra=["--speedup", "50"])
    s = ["127.0.0.1:%d" % p for p in w.ports]
    pubs = [vllm_pub.VllmPublisher(block_size=16, replay=False),
            vllm_pub.VllmPublisher(block_size=32, replay=False)]
    try:
        ng = stack.nginx(TWO_SIZES % {"s0": s[0], "s1": s[1], "p0": pubs[0].url,
                                      "p1": pubs[1].url})
        toks = ids(95, 128)

        def indexed_big():
            pubs[1].store(toks)
            rec = worker_rec(ng.port, s[1])
            return rec is not None and rec["events"] > 0
        kvt.wait_until(indexed_big, timeout=15, interval=0.2, what="the 32-token engine")
        rec = worker_rec(ng.port, s[1])
        assert rec["block_size"] == 32 and rec["state"] == "live", rec
        assert ev_status(ng.port)["block_size_mismatch"] == 0
        body = {"model": "kvroute-mock", "prompt": toks + [5] * 8, "max_tokens": 1}
        st, h, out, _ = kvt.post_json(ng.port, "/big/v1/completions", body)
        assert st == 200 and h["x-kvroute-worker"] == s[1], out
        assert int(h["x-kvroute-overlap"]) == 4
        assert "BLOCK SIZE MISMATCH" not in ng.log()
    finally:
        for p in pubs:
            p.close()


def test_pattern_form_expands_per_server(stack):
    # publishers on each server's port + an offset are hard to get from the
    # kernel: this checks the expansion (a publisher per server), not traffic
    w = stack.worker(engines=2, extra=["--speedup", "50"])
    servers = ["127.0.0.1:%d" % p for p in w.ports]
    ng = stack.nginx(conf({
        "servers": "\n".join("server %s;" % s for s in servers),
        "events": "kvroute_events zmq://$host:$port+1 replay=zmq://$host:$port-1;"}))
    kvt.wait_until(lambda: ev_status(ng.port)["zmq_publishers"] == 2, what="two publishers")
    names = sorted(w["address"] for w in ev_status(ng.port)["workers"])
    assert names == sorted(servers)
    assert route(ng.port, ids(99, 32))[0] in servers     # unreachable: load only
    assert ng.alerts() == []


@pytest.mark.parametrize("line,needle", [
    ("kvroute_events zmq://127.0.0.1:5557 bogus=1;", 'invalid parameter "bogus=1"'),
    ("kvroute_events http://127.0.0.1:5557 server=127.0.0.1:1;", "zmq://host:port for vLLM"),
    ("kvroute_events zmq://127.0.0.1:5557 replay=udp://x:1 server=127.0.0.1:1;",
     "invalid ZMQ URL"),
])
def test_nginx_t_rejects_bad_zmq_lines(stack, line, needle):
    n = kvt.Nginx(stack, conf({"servers": "server 127.0.0.1:1;", "events": line}),
                  "", kvt.free_port(), 1)
    ok, out = n.check()
    assert not ok and needle in out, out


def test_kvrelay_republishes_on_nats(stack):
    """tools/kvrelay: one ZMQ stream -> Dynamo events on NATS -> two nginx."""
    nats = stack.nats()
    w = stack.worker(engines=1, extra=["--speedup", "50"])
    server = "127.0.0.1:%d" % w.ports[0]
    p = vllm_pub.VllmPublisher(dp_rank=2)      # a data-parallel rank behind its own port
    try:
        relay = stack.spawn([kvt.os.path.join(kvt.BIN, "kvrelay"), "--zmq", p.url,
                             "--replay", p.replay_url, "--server", server, "--nats", nats.url,
                             "--block-size", "16"], "kvrelay.log")
        text = conf({"servers": "server %s;" % server,
                      "events": "kvroute_events %s;" % nats.url})
        ngs = [stack.nginx(text), stack.nginx(text)]
        for ng in ngs:
            kvt.wait_until(lambda: ev_status(ng.port)["nats"] == "connected", what="nats")

        def probe():
            p.store(ids(990, 16))
            return all(indexed(ng.port, server) == 1 for ng in ngs)
        kvt.wait_until(probe, timeout=15, interval=0.2, what="relay subscribed, nginx fed")
        a = ids(991, 64)
        ha = p.store(a[:32])
        p.store(a[32:], parent=ha[-1], drop=True)           # recovered by the relay's replay
        p.store(ids(992, 16))
        for ng in ngs:
            kvt.wait_until(lambda: indexed(ng.port, server) == 6, what="replayed through relay")
            assert route(ng.port, a) == (server, 4)
        p.remove(ha[1:])
        for ng in ngs:
            kvt.wait_until(lambda: indexed(ng.port, server) == 5, what="removal relayed")
        # the engine restarts: the relay tells every consumer to drop the worker
        port, rport = p.port, p.replay_port
        p.close()
        p = vllm_pub.VllmPublisher(port=port, replay_port=rport, dp_rank=2)
        b = ids(993, 32)

        def restarted():
            p.store(b)
            return all(indexed(ng.port, server) == 2 for ng in ngs)
        kvt.wait_until(restarted, timeout=15, interval=0.2, what="restart relayed")
        relay.send_signal(kvt.signal.SIGTERM)
        relay.wait(10)
        with open(relay.log) as f:
            stats = json.loads([l for l in f if l.startswith("{")][-1])
        assert stats["gaps"] >= 1 and stats["replays"] >= 1 and stats["restarts"] == 1
        assert stats["publish_errors"] == 0
        for ng in ngs:
            assert ng.alerts() == []
    finally:
        p.close()


@pytest.mark.parametrize("args", [["--mode", "throughput", "--seconds", "0.3"],
                                  ["--mode", "latency", "--seconds", "0.3"],
                                  ["--mode", "replay", "--gap", "200"]])
def test_kvzmq_bench_smoke(args):
    """tools/kvzmq-bench runs and reports (figures: docs/BENCHMARKS.md)."""
    r = kvt.subprocess.run([kvt.os.path.join(kvt.BIN, "kvzmq-bench")] + args,
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["mode"] == args[1]
    if args[1] == "replay":
        assert out["replay_failures"] == 0 and out["cleared"] == 0
