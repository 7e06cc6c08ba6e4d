"""A client that goes away while its prompt waits in the tokenization
thread pool (issue 23, finding 7): the prompt is dropped unprepared, the
request is never routed (nothing in the pending index, no request to a
worker) and the requests ahead of it are unaffected. Real nginx,
nats-server, kvworker."""
import concurrent.futures
import json
import os
import random
import socket

import kvt

QWEN = os.path.join(kvt.TOP, "conf", "tokenizers", "qwen2.5-instruct")

MAIN = "thread_pool kvtp threads=1;"

CONF = """
    kvroute_zone kv 16m;
    kvroute_events %(nats)s zone=kv;
    upstream llm {
        zone llm 64k;
        kvroute zone=kv tokenizer=%(dir)s/tokenizer.json thread_pool=kvtp thread_threshold=64k;
        %(servers)s
    }
    server {
        listen 127.0.0.1:%%(port)s;
        client_body_buffer_size 4m;
        client_max_body_size 8m;
        location /v1/ { proxy_pass http://llm; proxy_read_timeout 120s; }
        location = /kvroute/status { kvroute_status; }
    }
"""


def setup(stack):
    nats = stack.nats()
    w = stack.worker(engines=2, extra=["--speedup", "1000", "--nats", nats.url,
                                       "--tokenizer", QWEN + "/tokenizer.json",
                                       "--num-blocks", "65536"])
    servers = "\n".join("server 127.0.0.1:%d;" % p for p in w.ports)
    conf = CONF % {"nats": nats.url, "dir": QWEN, "servers": servers}
    ng = stack.nginx(conf, main_conf=MAIN)
    return ng, conf


def words(seed, n):
    """Random words: tokenization work that no cache of repeated words skips."""
    r = random.Random(seed)
    return " ".join("".join(r.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(r.randrange(2, 9)))
                    for _ in range(n))


def zone(ng):
    s, _, body = kvt.request(ng.port, "GET", "/kvroute/status")
    return json.loads(body)["zones"]["kv"]


def test_client_gone_while_queued_is_dropped(stack):
    ng, _ = setup(stack)
    before = zone(ng)
    ahead = [words(i, 120000) for i in range(6)]    # ~0.25 s of tokenization each, one thread

    def post(text):
        return kvt.post_json(ng.port, "/v1/completions", {"prompt": text, "max_tokens": 1},
                             timeout=120)
    with concurrent.futures.ThreadPoolExecutor(6) as ex:
        futs = [ex.submit(post, t) for t in ahead]
        kvt.wait_until(lambda: zone(ng)["threaded"] >= before["threaded"] + 6, timeout=30,
                       what="six prompts in the pool")
        body = json.dumps({"prompt": words(99, 120000), "max_tokens": 1}).encode()
        c = socket.create_connection(("127.0.0.1", ng.port))
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        kvt.wait_until(lambda: zone(ng)["threaded"] >= before["threaded"] + 7, timeout=30,
                       what="the seventh in the pool")
        c.close()                                   # gone while six are ahead of it
        got = [f.result() for f in futs]
    assert [g[0] for g in got] == [200] * 6
    st = kvt.wait_until(lambda: (lambda z: z if z["threaded_cancelled"] >= 1 else None)(zone(ng)),
                        timeout=60, what="the seventh dropped")
    assert st["threaded_cancelled"] == before["threaded_cancelled"] + 1
    assert st["decisions"] == before["decisions"] + 6      # the seventh was never routed
    log = ng.log()
    assert "left in connection" not in log and "aborting" not in log
    assert ng.alerts() == []
