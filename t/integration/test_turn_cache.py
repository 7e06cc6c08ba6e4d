"""Turn-delta tokenization in nginx (kvroute_zone turn_cache=): a chat's
next turn reuses the token ids of the conversation so far, whichever nginx
worker process tokenized it, and counts exactly as many prompt tokens as the
engine does. Real nginx (2 worker processes), real kvworker."""
import json
import os

import kvt

QWEN = os.path.join(kvt.TOP, "conf", "tokenizers", "qwen2.5-instruct")

CONF = """
    kvroute_zone kv 16m turn_cache=%(size)s turn_cache_ttl=60s;
    upstream llm {
        zone llm 64k;
        kvroute zone=kv tokenizer=%(dir)s/tokenizer.json chat_template=%(dir)s/tokenizer_config.json;
        %(servers)s
    }
    server {
        listen 127.0.0.1:%%(port)s reuseport;
        client_body_buffer_size 1m;
        location /v1/ {
            kvroute_upstream llm;
            proxy_pass http://llm;
            add_header X-KVRoute-Prompt-Tokens $kvroute_prompt_tokens always;
            add_header X-KVRoute-Turn-Cached $kvroute_turn_cached_tokens always;
            add_header X-Pid $pid always;
        }
        location = /kvroute/status { kvroute_status; }
    }
"""

SYSTEM = "You are a careful assistant who answers in full sentences."


def setup(stack, size="1m"):
    w = stack.worker(extra=["--tokenizer", QWEN + "/tokenizer.json",
                            "--chat-template", QWEN + "/tokenizer_config.json"], wait=False)
    servers = "\n".join("server 127.0.0.1:%d;" % p for p in w.ports)
    # nginx loads its tokenizer while the worker loads its own
    ng = stack.nginx(CONF % {"dir": QWEN, "servers": servers, "size": size})
    stack.ready(w)
    return ng


def conversation(seed, turns, edit=None):
    msgs = [{"role": "system", "content": SYSTEM}]
    for t in range(turns):
        text = "Conversation %d, turn %d: %s" % (seed, t, "tell me more about caches. " * (5 + t))
        if edit == t:
            text = "EDITED " + text
        msgs.append({"role": "user", "content": text})
        if t < turns - 1:
            msgs.append({"role": "assistant", "content": "Caches keep work. " * (3 + t)})
    return msgs


def ask(port, msgs):
    s, h, body, _ = kvt.post_json(port, "/v1/chat/completions",
                                  {"model": "kvroute-mock", "max_tokens": 2, "messages": msgs})
    assert s == 200, body
    # the router counted exactly the engine's prompt tokens
    assert int(h["x-kvroute-prompt-tokens"]) == body["usage"]["prompt_tokens"]
    return int(h["x-kvroute-turn-cached"]), int(h["x-kvroute-prompt-tokens"]), h["x-pid"]


def status(port):
    s, _, body = kvt.request(port, "GET", "/kvroute/status")
    return json.loads(body)["zones"]["kv"]["turn_cache"]


def test_follow_up_turns_reuse_across_worker_processes(stack):
    ng = setup(stack)
    cross = [0]

    def one_conversation(seed):
        first_cached, _, pid = ask(ng.port, conversation(seed, 1))
        assert first_cached == 0
        for t in range(2, 5):
            cached, tokens, p = ask(ng.port, conversation(seed, t))
            assert 0 < cached < tokens
            if p != pid:
                cross[0] += 1       # stored by one process, reused by the other
            pid = p

    seed = [0]

    def crossed():
        one_conversation(seed[0])
        seed[0] += 1
        return cross[0] > 0
    kvt.wait_until(crossed, timeout=120, interval=0, what="a turn reused by another process")
    st = status(ng.port)
    assert st["hits"] >= 3 * seed[0] and st["misses"] >= seed[0]
    assert st["hit_tokens"] > 0 and st["stored"] > 0 and st["bytes"] > 0
    s, _, text = kvt.request(ng.port, "GET", "/kvroute/status?format=prometheus")
    assert b'kvroute_turn_cache_hits_total{zone="kv"}' in text


def test_edited_history_reuses_only_the_unchanged_part(stack):
    ng = setup(stack)
    for t in range(1, 5):
        ask(ng.port, conversation(7, t))
    full, tokens, _ = ask(ng.port, conversation(7, 5))
    edited, etokens, _ = ask(ng.port, conversation(7, 5, edit=1))
    assert etokens == tokens + 2    # "EDITED " is two tokens
    assert 0 < edited < full        # the system prompt and turn 0 still reused
    edited0, _, _ = ask(ng.port, conversation(7, 5, edit=0))
    assert edited0 < edited


def test_turn_cache_off(stack):
    ng = setup(stack, size="0")
    for t in range(1, 4):
        cached, _, _ = ask(ng.port, conversation(1, t))
        assert cached == 0
    s, _, body = kvt.request(ng.port, "GET", "/kvroute/status")
    assert "turn_cache" not in json.loads(body)["zones"]["kv"]


def test_small_turn_cache_evicts_and_stays_exact(stack):
    ng = setup(stack, size="64k")
    seed = [100]

    def evicted():
        for t in range(1, 4):
            ask(ng.port, conversation(seed[0], t))
        seed[0] += 1
        return status(ng.port)["evicted"] >= 3     # the first three: conversation 100
    kvt.wait_until(evicted, timeout=120, interval=0, what="an eviction")
    # the oldest conversations' prefixes are gone: their next turn misses,
    # and is still counted exactly (ask checks it against the engine)
    cached, _, _ = ask(ng.port, conversation(100, 4))
    assert cached == 0
