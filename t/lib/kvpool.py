"""A stack whose large prompts go through a one-thread tokenization pool:
real nginx (thread_threshold=64k), nats-server and a two-engine kvworker.
Shared by the pool's lifecycle tests (reload, quit, cancel)."""
import os
import random

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
        location /v1/ { kvroute_upstream llm; proxy_pass http://llm; proxy_read_timeout 120s; }
        location = /kvroute/status { kvroute_status; }
    }
"""


def setup(stack, workers=2):
    nats = stack.nats()
    w = stack.worker(engines=2, extra=["--speedup", "1000", "--nats", nats.url,
                                       "--tokenizer", QWEN + "/tokenizer.json",
                                       "--num-blocks", "65536"], wait=False)
    servers = "\n".join("server 127.0.0.1:%d;" % p for p in w.ports)
    conf = CONF % {"nats": nats.url, "dir": QWEN, "servers": servers}
    # nginx loads its tokenizer while the worker loads its own
    ng = stack.nginx(conf, main_conf=MAIN, workers=workers)
    stack.ready(w)
    return ng, conf


def words(seed, n):
    """Random words: tokenization work that no cache of repeated words skips."""
    r = random.Random(seed)
    return " ".join("".join(r.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(r.randrange(2, 9)))
                    for _ in range(n))
