"""kvworker parses a request body once however many prompts it holds
(docs/SECURITY.md, section 5: a 54 MB body of 64 prompts used to be parsed 64
times on the event loop, stalling every other request for 34 s)."""
import json

import kvt


def parsed(port):
    s, _, body = kvt.request(port, "GET", "/metrics")
    assert s == 200
    for line in body.decode().splitlines():
        if line.startswith("kvworker_request_bodies_parsed_total"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError("kvworker_request_bodies_parsed_total")


def test_multi_prompt_body_parsed_once(stack):
    w = stack.worker(extra=["--speedup", "200"])
    port = w.ports[0]
    before = parsed(port)
    prompts = ["prompt %d " % i + "x" * 8000 for i in range(64)]
    s, _, body, _ = kvt.post_json(port, "/v1/completions",
                                  {"model": "kvroute-mock", "prompt": prompts, "max_tokens": 1})
    assert s == 200, body
    assert sorted(c["index"] for c in body["choices"]) == list(range(64))
    assert body["usage"]["prompt_tokens"] > 64 * 8000
    assert parsed(port) == before + 1
    # a bad prompt late in the list is still found, and still one parse
    bad = prompts[:10] + [{"not": "a prompt"}]
    s, _, body, _ = kvt.post_json(port, "/v1/completions",
                                  {"model": "kvroute-mock", "prompt": bad, "max_tokens": 1})
    assert s == 400 and body["error"]["param"] == "prompt"
    assert parsed(port) == before + 2
    s, _, data = kvt.request(port, "POST", "/v1/completions", "{not json")
    assert s == 400 and json.loads(data)["error"]["code"] == "invalid_json"
    assert parsed(port) == before + 3
