"""The routing decision through real nginx: the configured block size
reaches the cost, and a worker's own events win over the router's guesses."""
import json
import os
import subprocess
import zlib

import pytest

import kvnats
import kvt
import kvproto

APPROX = """
    kvroute_zone kv 16m;
    upstream llm {
        zone llm 64k;
        kvroute zone=kv %(params)s;
        %(servers)s
    }
    server {
        listen 127.0.0.1:%%(port)s;
        client_max_body_size 8m;
        location /v1/ {
            kvroute_upstream llm;
            proxy_pass http://llm;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            kvroute_debug_headers on;
            add_header X-Cost $kvroute_cost;
        }
        location = /kvroute/status { kvroute_status; }
    }
"""


def ids(name, n):
    h = zlib.crc32(name.encode()) % 10000
    return [1000 + (h * 31 + i) % 30000 for i in range(n)]


def complete(port, prompt, max_tokens=1):
    return kvt.post_json(port, "/v1/completions",
                         {"model": "kvroute-mock", "prompt": prompt, "max_tokens": max_tokens})


@pytest.mark.parametrize("policy", ["ttft", "dynamo"])
@pytest.mark.parametrize("bs", [16, 32, 64])
def test_block_size_reaches_the_cost(stack, bs, policy):
    """An idle server, a prompt of 10 blocks, twice: the second time all 10
    blocks are cached, so nothing is left to prefill (estimate 0 in both
    policies). Scored with 16 instead of the configured size, 10 blocks
    would cover only 160 tokens and leave 480 of 640 to prefill at 64.
    Dynamo's cost of the first is 10 blocks of prefill + 10 new blocks."""
    w = stack.worker(engines=1, extra=["--speedup", "50"])
    servers = "server 127.0.0.1:%d;" % w.ports[0]
    params = "block_size=%d policy=%s" % (bs, policy)
    ng = stack.nginx(APPROX % {"params": params, "servers": servers})
    s, h, _, _ = complete(ng.port, ids("bs", 10 * bs))
    assert s == 200
    assert h["x-kvroute-overlap"] == "0"
    if policy == "dynamo":
        assert float(h["x-cost"]) == pytest.approx(20.0)
    else:
        assert float(h["x-cost"]) > 0
    s, h, _, _ = complete(ng.port, ids("bs", 10 * bs))
    assert h["x-kvroute-overlap"] == "10"
    assert float(h["x-cost"]) == pytest.approx(0.0)


EVENTS = """
    kvroute_zone kv 16m;
    kvroute_events %(nats)s zone=kv;
    upstream llm {
        zone llm 64k;
        kvroute zone=kv mode=events;
        %(servers)s
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

SUBJECT = kvproto.events()
WORKER = 7587886123456789


def status(port):
    s, _, body = kvt.request(port, "GET", "/kvroute/status")
    assert s == 200
    return json.loads(body)["zones"]["kv"]


def indexed(port, server):
    for x in status(port)["upstreams"]["llm"]:
        if x["server"] == server:
            return x["indexed_blocks"]
    raise KeyError(server)


def hashes(tokens, bs=16):
    r = subprocess.run([os.path.join(kvt.BIN, "kvtok"), "hash", "--block-size", str(bs)],
                           input=json.dumps(tokens).encode(), capture_output=True)
    return [int(x) for x in r.stdout.split()]


def dynamo_event(worker, event_id, data):
    return json.dumps({"worker_id": worker, "storage_tier": "device", "dp_rank": 0,
                       "event": {"event_id": event_id, "data": data}}).encode()


@pytest.mark.parametrize("order", ["stored_first", "routed_first"])
@pytest.mark.parametrize("how", ["removed", "cleared"])
def test_worker_events_win_over_pending_guesses(stack, how, order):
    """A worker holds 40 blocks of a prompt by its own events and has been
    sent that prompt (the router's pending index guesses it holds them), in
    either order; then it reports them Removed (or Cleared): the next
    request must not see overlap 40 on it."""
    nats = stack.nats()
    w = stack.worker(engines=2, extra=["--speedup", "50"])       # silent: no events of its own
    a, b = w.ports
    servers = ("server 127.0.0.1:%d;\nserver 127.0.0.1:%d;\n"
               "kvroute_worker_id %d 127.0.0.1:%d;\nkvroute_worker_id %d 127.0.0.1:%d;"
               % (a, b, WORKER, a, WORKER + 1, b))
    ng = stack.nginx(EVENTS % {"nats": nats.url, "servers": servers})
    kvt.wait_until(lambda: status(ng.port)["events"]["nats"] == "connected", what="connected")
    prompt = ids("evict", 40 * 16)
    seq = hashes(prompt)
    assert len(seq) == 40
    blocks = [{"block_hash": seq[i], "tokens_hash": hashes(prompt[i * 16:(i + 1) * 16])[0],
               "mm_extra_info": None} for i in range(40)]
    pub = kvnats.Nats(nats.port)

    def store(server):
        worker = WORKER if server == "127.0.0.1:%d" % a else WORKER + 1
        pub.publish(SUBJECT, dynamo_event(worker, 1, {"stored": {
            "parent_hash": None, "start_position": None, "blocks": blocks}}))
        pub.flush()
        kvt.wait_until(lambda: indexed(ng.port, server) == 40, what="stored applied")
        return worker

    if order == "stored_first":
        holder = "127.0.0.1:%d" % b
        worker = store(holder)
        s, h, _, _ = complete(ng.port, prompt + [1, 2, 3])
        assert h["x-kvroute-worker"] == holder and h["x-kvroute-overlap"] == "40"
    else:
        s, h, _, _ = complete(ng.port, prompt + [1, 2, 3])
        holder = h["x-kvroute-worker"]
        assert status(ng.port)["pending"]["blocks"] >= 40
        worker = store(holder)
    data = {"removed": {"block_hashes": seq}} if how == "removed" else "cleared"
    pub.publish(SUBJECT, dynamo_event(worker, 2, data))
    pub.flush()
    # the helper drops the pending guesses before the index's blocks
    kvt.wait_until(lambda: indexed(ng.port, holder) == 0, what="removal applied")
    s, h, _, _ = complete(ng.port, prompt + [4, 5, 6])
    assert s == 200
    assert h["x-kvroute-overlap"] == "0", h
    pub.close()


def test_pending_guesses_extend_confirmed_prefix(stack):
    """A worker holds 40 blocks of a prompt by its own events and is sent
    that prompt grown to 60 blocks; before it reports the 20 new ones, the
    next request with the same 60 blocks must see overlap 60 on it (the
    router's guess continues what the events confirm), as approximate mode
    would. Guesses recorded past the confirmed part alone were never
    credited: a match counts a run from the prompt's first block."""
    nats = stack.nats()
    w = stack.worker(engines=2, extra=["--speedup", "50"])       # silent: no events of its own
    a, b = w.ports
    servers = ("server 127.0.0.1:%d;\nserver 127.0.0.1:%d;\n"
               "kvroute_worker_id %d 127.0.0.1:%d;\nkvroute_worker_id %d 127.0.0.1:%d;"
               % (a, b, WORKER, a, WORKER + 1, b))
    ng = stack.nginx(EVENTS % {"nats": nats.url, "servers": servers})
    kvt.wait_until(lambda: status(ng.port)["events"]["nats"] == "connected", what="connected")
    prompt = ids("extend", 60 * 16)
    seq = hashes(prompt)
    assert len(seq) == 60
    blocks = [{"block_hash": seq[i], "tokens_hash": hashes(prompt[i * 16:(i + 1) * 16])[0],
               "mm_extra_info": None} for i in range(40)]
    holder = "127.0.0.1:%d" % b
    pub = kvnats.Nats(nats.port)
    pub.publish(SUBJECT, dynamo_event(WORKER + 1, 1, {"stored": {
        "parent_hash": None, "start_position": None, "blocks": blocks}}))
    pub.flush()
    kvt.wait_until(lambda: indexed(ng.port, holder) == 40, what="stored applied")
    s, h, _, _ = complete(ng.port, prompt + [1, 2, 3])
    assert s == 200
    assert h["x-kvroute-worker"] == holder and h["x-kvroute-overlap"] == "40", h
    s, h, _, _ = complete(ng.port, prompt + [4, 5, 6])
    assert s == 200
    assert h["x-kvroute-worker"] == holder and h["x-kvroute-overlap"] == "60", h
    pub.close()
