"""kvworker's side of docs/PROTOCOL.md against a real nats-server: KV events
agree with the cache (checked against a dump), discover -> announce,
heartbeats, reconnect when NATS comes up late."""
import json
import time

import kvnats
import kvt
import kvproto

P = kvproto.DEFAULT_PREFIX


def metrics(port):
    status, _, body = kvt.request(port, "GET", "/metrics")
    assert status == 200
    out = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = float(value)
    return out


def flatten(msgs):
    """kv-events messages -> RouterEvents (a message is one event or a list)."""
    out = []
    for m in msgs:
        v = m.json()
        out.extend(v if isinstance(v, list) else [v])
    return out


def apply_events(events):
    """What a router would hold: block_hash -> (parent, tokens_hash)."""
    state = {}
    for ev in events:
        data = ev["event"]["data"]
        if data == "cleared":
            state.clear()
        elif "stored" in data:
            parent = data["stored"]["parent_hash"]
            for b in data["stored"]["blocks"]:
                state[b["block_hash"]] = (parent, b["tokens_hash"])
                parent = b["block_hash"]
        else:
            for h in data["removed"]["block_hashes"]:
                state.pop(h, None)
    return state


def dump(nc, worker_id):
    def complete(msgs):
        return msgs and len(msgs) == msgs[0].json()["chunks"]
    msgs = nc.request_all(kvproto.dump(worker_id, P), {"dp_rank": 0}, complete)
    chunks = [m.json() for m in msgs]
    assert [c["chunk"] for c in chunks] == list(range(len(chunks)))
    assert len({c["last_event_id"] for c in chunks}) == 1
    blocks = [b for c in chunks for b in c["blocks"]]
    return chunks[0], blocks


def test_events_agree_with_dump(stack):
    ns = stack.nats()
    nc = kvnats.Nats(ns.port)
    sid = nc.subscribe(kvproto.events(P))
    hb = nc.subscribe(kvproto.heartbeat(P))
    # a small pool so the mix below evicts
    w = stack.worker(extra=["--nats", ns.url, "--speedup", "50", "--num-blocks", "64",
                            "--worker-id", "4242"])
    port = w.ports[0]
    nc.wait(hb, timeout=30)
    base = "".join(chr(97 + i % 26) for i in range(300))
    prompts = [base + str(i) for i in range(4)] + \
              ["x%d" % i * 90 for i in range(8)] + [base[:200] + "tail%d" % i for i in range(4)]
    for p in prompts:
        status, _, body, _ = kvt.post_json(port, "/v1/completions",
                                           {"prompt": p, "max_tokens": 20})
        assert status == 200, body
    assert metrics(port)["kvworker_kv_blocks_active"] == 0

    header, blocks = dump(nc, 4242)
    last = header["last_event_id"]
    events = flatten(nc.wait(sid, lambda ms: sum(
        len(m.json()) if m.data.startswith(b"[") else 1 for m in ms) >= last))
    ids = [e["event"]["event_id"] for e in events]
    assert ids == list(range(1, len(ids) + 1)), "event ids are 1, 2, 3, ..."
    assert all(e["worker_id"] == 4242 and e["event"]["dp_rank"] == 0 for e in events)
    assert any("removed" in e["event"]["data"] for e in events), "the mix should evict"
    state = apply_events([e for e in events if e["event"]["event_id"] <= last])
    dumped = {b[1]: (b[0], b[2]) for b in blocks}
    assert dumped == state
    # parents come before children within the dump
    seen = set()
    for parent, h, _ in blocks:
        assert parent is None or parent in seen or parent not in dumped
        seen.add(h)
    assert header["block_size"] == 16 and header["worker_id"] == 4242
    nc.close()


def test_discover_announces_every_engine(stack):
    ns = stack.nats()
    nc = kvnats.Nats(ns.port)
    hb = nc.subscribe(kvproto.heartbeat(P))
    w = stack.worker(engines=2, extra=["--nats", ns.url, "--heartbeat-ms", "200",
                                       "--worker-id", "100"])
    msgs = nc.wait(hb, lambda ms: len({m.json()["worker_id"] for m in ms}) == 2)
    first = [m.json() for m in msgs]
    assert all(a["type"] == "announce" for a in first[:2])
    start = len(msgs)
    nc.publish(kvproto.discover(P), {})
    msgs = nc.wait(hb, lambda ms: sum(1 for m in ms[start:]
                                      if m.json()["type"] == "announce") >= 2)
    ann = [m.json() for m in msgs[start:] if m.json()["type"] == "announce"]
    assert {a["worker_id"] for a in ann} == {100, 101}
    assert {a["address"] for a in ann} == {"127.0.0.1:%d" % p for p in w.ports}
    for a in ann:
        assert a["instance_id"] > 0 and a["block_size"] == 16 and a["num_blocks"] == 16384
        assert a["model"] == "kvroute-mock" and a["interval_ms"] == 200
        assert set(a["load"]) >= {"active_prefill_tokens", "active_decode_blocks",
                                  "kv_used_blocks", "waiting", "running",
                                  "max_num_batched_tokens", "max_num_seqs"}
    # heartbeats keep coming
    n = len(msgs)
    msgs = nc.wait(hb, lambda ms: sum(1 for m in ms[n:] if m.json()["type"] == "heartbeat") >= 4)
    nc.close()


def test_nats_late_start_reconnects(stack):
    port = kvt.free_port()
    w = stack.worker(extra=["--nats", "nats://127.0.0.1:%d" % port, "--heartbeat-ms", "200"])
    # HTTP serves while NATS is down
    status, _, body, _ = kvt.post_json(w.ports[0], "/v1/completions",
                                       {"prompt": "a" * 40, "max_tokens": 2})
    assert status == 200
    ns = stack.nats(port=port)
    nc = kvnats.Nats(ns.port)
    hb = nc.subscribe(kvproto.heartbeat(P))
    msgs = nc.wait(hb, timeout=30)
    wid = msgs[0].json()["worker_id"]
    header, blocks = dump(nc, wid)
    assert len(blocks) == 2          # 40 prompt tokens + 1 computed output: 2 full blocks
    nc.close()


def test_nats_restart_announces_and_resyncs(stack):
    """NATS goes away and comes back: HTTP keeps serving, the worker
    announces again, and a dump reflects every event it has numbered."""
    ns = stack.nats()
    nc0 = kvnats.Nats(ns.port)
    hb0 = nc0.subscribe(kvproto.heartbeat(P))
    w = stack.worker(extra=["--nats", ns.url, "--heartbeat-ms", "200", "--speedup", "50",
                            "--worker-id", "77"])
    port = w.ports[0]
    # a restart of a server the worker is connected to (a server dying during
    # the worker's first handshake is another case: docs/PROTOCOL.md)
    nc0.wait(hb0, lambda ms: any(m.json()["worker_id"] == 77 for m in ms), timeout=30)
    nc0.close()
    kvt._kill(ns)
    for i in range(3):
        status, _, _, _ = kvt.post_json(port, "/v1/completions",
                                        {"prompt": "%d" % i * 64, "max_tokens": 2})
        assert status == 200
    ns2 = stack.nats(port=ns.port)
    nc = kvnats.Nats(ns2.port)
    hb = nc.subscribe(kvproto.heartbeat(P))
    # the worker is back once its heartbeats are; the announce it sends on
    # reconnecting may have gone before this subscription existed, so ask
    # as routers do after every reconnect (discover -> announce)
    nc.wait(hb, lambda ms: any(m.json()["worker_id"] == 77 for m in ms), timeout=30)
    nc.publish(kvproto.discover(P), {})
    msgs = nc.wait(hb, lambda ms: any(m.json()["type"] == "announce" for m in ms), timeout=30)
    ann = [m.json() for m in msgs if m.json()["type"] == "announce"][0]
    header, blocks = dump(nc, 77)
    assert header["last_event_id"] >= ann["last_event_id"] >= 3
    assert len(blocks) == 12        # 3 prompts x 64 tokens: 4 full blocks each
    nc.close()
