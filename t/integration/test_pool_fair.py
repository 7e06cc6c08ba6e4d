"""kvroute's tokenization queue in front of nginx's thread pool (issue 23,
finding 7): small prompts are not starved by big ones (shortest-first with
aging), the bytes in tokenization at once stay within tokenize_budget, a
prompt that waits past tokenize_wait is routed by load, and a client that
goes away mid-tokenization stops the tokenizer and frees its share.

Real nginx (one worker process, a one-thread pool), nats-server and a
two-engine kvworker; conditions only, no timing asserted."""
import concurrent.futures
import json
import socket

import kvt
from kvpool import CONF, MAIN, QWEN, words


def setup(stack, params):
    nats = stack.nats()
    w = stack.worker(engines=2, extra=["--speedup", "1000", "--nats", nats.url,
                                       "--tokenizer", QWEN + "/tokenizer.json",
                                       "--num-blocks", "65536"], wait=False)
    servers = "\n".join("server 127.0.0.1:%d;" % p for p in w.ports)
    conf = CONF.replace("thread_threshold=64k;", "thread_threshold=64k %s;" % params)
    conf = conf % {"nats": nats.url, "dir": QWEN, "servers": servers}
    # nginx loads its tokenizer while the worker loads its own
    ng = stack.nginx(conf, main_conf=MAIN, workers=1)
    stack.ready(w)
    return ng


def zone(ng):
    _, _, body = kvt.request(ng.port, "GET", "/kvroute/status")
    return json.loads(body)["zones"]["kv"]


def post(ng, text):
    return kvt.post_json(ng.port, "/v1/completions", {"prompt": text, "max_tokens": 1},
                         timeout=300)[0]


def test_small_prompt_passes_queued_big_ones(stack):
    # one big body (~1.3 MB) fits the budget at a time; tokenize_wait=0: no bound
    ng = setup(stack, "tokenize_budget=2m tokenize_wait=0")
    big = [words(i, 200000) for i in range(8)]
    small = words(99, 12000)                        # ~80 KB: still through the pool
    assert len(small) > 65536
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        futs = [ex.submit(post, ng, t) for t in big]
        kvt.wait_until(lambda: zone(ng)["tokenize_queued"] >= 5, timeout=60,
                       what="big prompts waiting in kvroute's queue")
        assert post(ng, small) == 200
        pending = sum(not f.done() for f in futs)
        got = [f.result() for f in futs]
    assert got == [200] * 8
    # FIFO would have served it after all eight; it went ahead of the queued ones
    assert pending >= 2, pending
    z = zone(ng)
    assert z["tokenize_queued"] == 0 and z["tokenize_bytes"] == 0
    assert z["fallbacks"].get("tokenize_wait", 0) == 0
    assert ng.alerts() == []


def test_bytes_in_tokenization_stay_within_budget(stack):
    budget = 1 << 20
    ng = setup(stack, "tokenize_budget=1m")
    bodies = [words(i, 45000) for i in range(8)]    # ~300 KB each, 2.4 MB in all
    assert sum(len(b) for b in bodies) > 2 * budget
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        got = list(ex.map(lambda t: post(ng, t), bodies))
    assert got == [200] * 8
    z = zone(ng)
    assert max(len(b) for b in bodies) <= z["tokenize_bytes_peak"] <= budget
    assert z["tokenize_bytes"] == 0 and z["tokenize_queued"] == 0
    assert z["threaded"] == 8
    assert ng.alerts() == []


def test_prompt_waiting_past_the_bound_is_routed_by_load(stack):
    # ~0.9 MB each, one at a time in the pool: those behind the first wait
    # at least its tokenization, which no CPU does in 1 ms (900 MB/s)
    ng = setup(stack, "tokenize_budget=1m tokenize_wait=1ms")
    bodies = [words(i, 140000) for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        got = list(ex.map(lambda t: post(ng, t), bodies))
    assert got == [200] * 8                         # a fallback, never an error
    z = zone(ng)
    assert z["fallbacks"]["tokenize_wait"] >= 1
    assert z["decisions"] == 8
    assert z["tokenize_queued"] == 0 and z["tokenize_bytes"] == 0
    assert "waited" in ng.log() and "routing by load only" in ng.log()
    assert ng.alerts() == []


def test_client_gone_mid_tokenization_stops_it(stack):
    ng = setup(stack, "")
    before = zone(ng)
    # ~3.5 MB of random words: seconds of tokenizing, under max_tokenize (4m)
    body = json.dumps({"prompt": words(7, 540000)[:3500000], "max_tokens": 1}).encode()
    c = socket.create_connection(("127.0.0.1", ng.port))
    c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    kvt.wait_until(lambda: zone(ng)["tokenize_bytes"] > 0, timeout=60,
                   what="the prompt in the (idle, one-thread) pool")
    c.close()
    z = kvt.wait_until(lambda: (lambda z: z if z["tokenize_interrupted"] >= 1
                                and z["tokenize_bytes"] == 0 else None)(zone(ng)),
                       timeout=120, what="tokenizing stopped and its share freed")
    assert z["tokenize_interrupted"] == before["tokenize_interrupted"] + 1
    assert z["decisions"] == before["decisions"]    # never routed
    # its share is back: the next prompt is tokenized and served
    assert post(ng, words(8, 20000)) == 200
    assert zone(ng)["decisions"] == before["decisions"] + 1
    log = ng.log()
    assert "left in connection" not in log and "aborting" not in log
    assert ng.alerts() == []
