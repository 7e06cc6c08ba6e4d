"""The first real path: client -> nginx (kvroute balancer) -> kvworker mock."""
import concurrent.futures
import json

import kvt

UPSTREAM = """
    upstream llm {
        zone llm 64k;
        kvroute;
        server 127.0.0.1:%(a)d;
        server 127.0.0.1:%(b)d;
        keepalive 8;
    }
    server {
        listen 127.0.0.1:%%(port)s;
        location /v1/ {
            kvroute_upstream llm;
            proxy_pass http://llm;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            add_header X-Upstream $upstream_addr always;
        }
    }
"""


def two_workers(stack):
    w = stack.worker(engines=2, extra=["--speedup", "5"])
    a, b = w.ports
    return stack.nginx(UPSTREAM % {"a": a, "b": b}), a, b


def test_chat_completion_through_nginx(stack):
    ng, a, b = two_workers(stack)
    status, hdrs, body, _ = kvt.chat(ng.port, "hello there", max_tokens=5)
    assert status == 200
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["message"]["content"]
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5
    assert hdrs["x-upstream"] in ("127.0.0.1:%d" % a, "127.0.0.1:%d" % b)
    assert ng.alerts() == []


def test_both_workers_answer(stack):
    """Concurrent requests: least-load spreads them, both answers are whole."""
    ng, a, b = two_workers(stack)
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        results = list(ex.map(lambda i: kvt.chat(ng.port, "q%d" % i, max_tokens=20), range(8)))
    seen = set()
    for status, hdrs, body, _ in results:
        assert status == 200
        assert body["usage"]["completion_tokens"] == 20
        seen.add(hdrs["x-upstream"])
    assert seen == {"127.0.0.1:%d" % a, "127.0.0.1:%d" % b}


def test_streaming_completion(stack):
    ng, _, _ = two_workers(stack)
    status, hdrs, raw = kvt.request(ng.port, "POST", "/v1/completions", {
        "model": "kvroute-mock", "prompt": "once upon", "max_tokens": 6, "stream": True,
        "stream_options": {"include_usage": True}})
    assert status == 200
    assert hdrs["content-type"].startswith("text/event-stream")
    events = kvt.sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert len([t for t in texts if t]) == 6
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 6


def test_bad_json_is_openai_error(stack):
    ng, _, _ = two_workers(stack)
    status, _, body, _ = kvt.post_json(ng.port, "/v1/chat/completions", "{not json")
    assert status == 400
    assert body["error"]["type"] == "invalid_request_error"
