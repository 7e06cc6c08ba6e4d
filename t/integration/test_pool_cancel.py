"""A client that goes away while its prompt waits in the tokenization
thread pool (docs/SECURITY.md, section 4): the prompt is dropped unprepared, the
request is never routed (nothing in the pending index, no request to a
worker) and the requests ahead of it are unaffected. Real nginx,
nats-server, kvworker."""
import concurrent.futures
import json
import socket

import kvt
from kvpool import setup, words


def zone(ng):
    s, _, body = kvt.request(ng.port, "GET", "/kvroute/status")
    return json.loads(body)["zones"]["kv"]


def test_client_gone_while_queued_is_dropped(stack):
    # one nginx worker: all seven share its one-thread pool, so the seventh
    # is surely queued behind the six when its client goes (with two, it
    # could land on the other worker's idle thread and be tokenized and
    # routed before the close was read: the flake CI saw)
    ng, _ = setup(stack, workers=1)
    before = zone(ng)
    ahead = [words(i, 120000) for i in range(6)]    # ~0.25 s of tokenization each, one thread
    # the seventh body is built before any prompt is sent: building it while
    # the six are queued gave the pool time to drain on a loaded machine
    body = json.dumps({"prompt": words(99, 120000), "max_tokens": 1}).encode()

    def post(text):
        return kvt.post_json(ng.port, "/v1/completions", {"prompt": text, "max_tokens": 1},
                             timeout=120)
    with concurrent.futures.ThreadPoolExecutor(6) as ex:
        futs = [ex.submit(post, t) for t in ahead]
        kvt.wait_until(lambda: zone(ng)["threaded"] >= before["threaded"] + 6, timeout=30,
                       what="six prompts in the pool")
        c = socket.create_connection(("127.0.0.1", ng.port))
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        kvt.wait_until(lambda: zone(ng)["threaded"] >= before["threaded"] + 7, timeout=30,
                       what="the seventh in the pool")
        c.close()                                   # gone while six are ahead of it
        got = [f.result() for f in futs]
    assert [g[0] for g in got] == [200] * 6
    # dropped unprepared (from kvroute's queue, or skipped in the pool); a
    # running tokenization interrupted counts too, though one worker makes
    # that unlikely (test_pool_fair.py tests that case)
    def gone(z):
        return (z["threaded_cancelled"] - before["threaded_cancelled"]
                + z["tokenize_interrupted"] - before["tokenize_interrupted"])
    st = kvt.wait_until(lambda: (lambda z: z if gone(z) >= 1 else None)(zone(ng)),
                        timeout=60, what="the seventh dropped")
    assert gone(st) == 1
    assert st["decisions"] == before["decisions"] + 6      # the seventh was never routed
    log = ng.log()
    assert "left in connection" not in log and "aborting" not in log
    assert ng.alerts() == []
