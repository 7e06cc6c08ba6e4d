"""What the conversation A/Bs share (responses/responses_ab.py,
anthropic/anthropic_ab.py): 4 kvworker mock engines with the Qwen2.5
tokenizer and chat template behind nginx in events mode, prose passages,
percentiles."""
import os
import sys

TOP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(TOP, "t", "lib"))
import kvt  # noqa: E402

QWEN = os.path.join(TOP, "conf", "tokenizers", "qwen2.5-instruct")

CONF = """
    kvroute_zone kv 64m;
    kvroute_events %(nats)s zone=kv;
    upstream llm {
        zone llm 64k;
        kvroute zone=kv mode=events tokenizer=%(dir)s/tokenizer.json
                chat_template=%(dir)s/tokenizer_config.json;
        %(servers)s
        keepalive 32;
    }
    server {
        listen 127.0.0.1:%%(port)s;
        client_body_buffer_size 1m;
        location /v1/ {
            kvroute_upstream llm;
            proxy_pass http://llm;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            kvroute_debug_headers on;
        }
    }
"""


def fleet(st, speedup):
    """nginx (KVROUTE_BUILD's module) in front of 4 mock engines, events over NATS"""
    nats = st.nats()
    w = st.worker(engines=4, extra=["--nats", nats.url, "--heartbeat-ms", "200",
                                    "--speedup", speedup,
                                    "--tokenizer", QWEN + "/tokenizer.json",
                                    "--chat-template", QWEN + "/tokenizer_config.json"])
    servers = "\n".join("server 127.0.0.1:%d;" % p for p in w.ports)
    return st.nginx(CONF % {"nats": nats.url, "servers": servers, "dir": QWEN})


def passages(rng):
    """passage(n): n characters of t/data/prose_en.txt from a place rng picks"""
    prose = open(os.path.join(TOP, "t", "data", "prose_en.txt"), encoding="utf-8").read()

    def passage(n):
        at = rng.randrange(0, len(prose) - n)
        return prose[at:at + n]
    return passage


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0
