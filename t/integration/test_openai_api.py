"""The OpenAI API as OpenAI clients see it: the official `openai`
Python client against a real kvworker, and through real nginx with the
module, including the errors nginx and kvroute produce."""
import concurrent.futures
import http.client
import json
import os
import socket
import zlib

import openai
import pytest

import kvt

MODEL = "kvroute-mock"


def client(port):
    # no retries: a 503 must reach the test as it reached the client
    return openai.OpenAI(base_url="http://127.0.0.1:%d/v1" % port, api_key="none",
                         max_retries=0, timeout=30)


def error_of(exc):
    """The {"error": {...}} object of an openai.APIStatusError."""
    body = exc.response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.fixture
def worker(stack):
    w = stack.worker(extra=["--speedup", "50"])
    return w.ports[0]


def test_models_list_and_retrieve(worker):
    c = client(worker)
    assert [m.id for m in c.models.list()] == [MODEL]
    m = c.models.retrieve(MODEL)
    assert (m.id, m.object) == (MODEL, "model")
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("gpt-4o")
    err = error_of(e.value)
    assert (err["code"], err["param"], err["type"]) == \
        ("model_not_found", "model", "invalid_request_error")


def test_chat_and_completion_and_stream(worker):
    c = client(worker)
    r = c.chat.completions.create(model=MODEL, max_tokens=3,
                                  messages=[{"role": "user", "content": "hello"}])
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    r = c.completions.create(model=MODEL, prompt="hello", max_tokens=2)
    assert r.usage.completion_tokens == 2
    chunks = list(c.chat.completions.create(model=MODEL, max_tokens=3, stream=True,
                                            stream_options={"include_usage": True},
                                            messages=[{"role": "user", "content": "hi"}]))
    assert chunks[-1].usage.completion_tokens == 3
    # a request without "model" is served by the worker's model
    s, _, body, _ = kvt.post_json(worker, "/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert s == 200 and body["model"] == MODEL


def test_responses_api_with_the_openai_client(worker):
    """/v1/responses, as the official client sends and reads it: the text
    and usage of a Response, its streamed events (created, deltas,
    completed), and the chat its instructions and input make (the same
    prompt tokens as that chat request)."""
    c = client(worker)
    r = c.responses.create(model=MODEL, instructions="Be brief.", input="hello there",
                           max_output_tokens=4)
    assert r.status == "incomplete" and r.usage.output_tokens == 4
    assert len(r.output_text) > 0
    chat = c.chat.completions.create(model=MODEL, max_tokens=1, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}])
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    events = list(c.responses.create(model=MODEL, max_output_tokens=3, stream=True, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]))
    kinds = [e.type for e in events]
    # created and in_progress before the engine runs, as vLLM sends them
    assert kinds == ["response.created", "response.in_progress"] + \
        ["response.output_text.delta"] * 3 + ["response.completed"], kinds
    assert [e.sequence_number for e in events] == list(range(6))
    done = events[-1].response
    assert done.output_text == "".join(e.delta for e in events[2:5])
    assert done.usage.output_tokens == 3
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model=MODEL, input="x", tools=[
            {"type": "function", "name": "f", "parameters": {}}])
    assert error_of(e.value)["param"] == "tools"


def test_unknown_model_is_404_model_not_found(worker):
    with pytest.raises(openai.NotFoundError) as e:
        client(worker).chat.completions.create(
            model="gpt-4o", max_tokens=1, messages=[{"role": "user", "content": "hi"}])
    err = error_of(e.value)
    assert (err["code"], err["param"]) == ("model_not_found", "model")
    assert "gpt-4o" in err["message"]


@pytest.mark.parametrize("chat,extra,param,code", [
    (True, {"temperature": "hot"}, "temperature", "invalid_type"),
    (True, {"temperature": 7}, "temperature", "invalid_value"),
    (True, {"top_p": "1"}, "top_p", "invalid_type"),
    (True, {"top_p": 0}, "top_p", "invalid_value"),
    (True, {"max_tokens": 2.5}, "max_tokens", "invalid_type"),
    (True, {"stream": "yes"}, "stream", "invalid_type"),
    (True, {"seed": "1"}, "seed", "invalid_type"),
    (True, {"stop": 3}, "stop", "invalid_type"),
    (True, {"n": 2}, "n", "unsupported_parameter"),
    (True, {"logprobs": True}, "logprobs", "unsupported_parameter"),
    (True, {"top_logprobs": 2}, "top_logprobs", "unsupported_parameter"),
    (False, {"logprobs": 1}, "logprobs", "unsupported_parameter"),
    (False, {"best_of": 3}, "best_of", "unsupported_parameter"),
    (False, {"n": 3}, "n", "unsupported_parameter"),
    (False, {"model": 5}, "model", "invalid_type"),
])
def test_bad_parameters_are_400_with_param(worker, chat, extra, param, code):
    c = client(worker)
    with pytest.raises(openai.BadRequestError) as e:
        if chat:
            c.chat.completions.create(model=MODEL, max_tokens=1,
                                      messages=[{"role": "user", "content": "hi"}],
                                      extra_body=extra)
        else:
            c.completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_body=extra)
    err = error_of(e.value)
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error"), err


def test_supported_values_still_accepted(worker):
    """n=1, logprobs false/null and numeric types are fine."""
    c = client(worker)
    r = c.chat.completions.create(model=MODEL, max_tokens=1, n=1, logprobs=False,
                                  temperature=0.5, top_p=0.9, seed=3,
                                  messages=[{"role": "user", "content": "hi"}])
    assert len(r.choices) == 1
    r = c.completions.create(model=MODEL, prompt="hi", max_tokens=1, logprobs=None, best_of=1)
    assert len(r.choices) == 1


def test_errors_fill_param_and_code(worker):
    s, _, body, _ = kvt.post_json(worker, "/v1/chat/completions", {"model": MODEL})
    assert s == 400
    assert body["error"]["param"] == "messages"
    assert body["error"]["code"] == "missing_required_parameter"
    s, _, data = kvt.request(worker, "POST", "/v1/completions", b"{not json")
    assert s == 400 and json.loads(data)["error"]["code"] == "invalid_json"
    s, h, data = kvt.request(worker, "GET", "/v1/completions")
    assert s == 405 and json.loads(data)["error"]["code"] == "method_not_allowed"
    assert h["allow"] == "POST"
    s, _, data = kvt.request(worker, "GET", "/v1/nothing")
    assert s == 404 and json.loads(data)["error"]["code"] == "unknown_url"


@pytest.mark.parametrize("path", ["/metrics", "/v1/models", "/v1/models/" + MODEL, "/health"],
                         ids=["metrics", "models", "model", "health"])
def test_head_gets_headers_without_body(worker, path):
    s, h, body = kvt.request(worker, "GET", path)
    assert s == 200 and body
    c = http.client.HTTPConnection("127.0.0.1", worker, timeout=10)
    c.request("HEAD", path)
    r = c.getresponse()
    assert r.status == 200
    assert int(r.getheader("Content-Length")) == len(body)
    assert r.getheader("Content-Type") == h["content-type"]
    # the connection stays usable: no body was sent after the headers
    r.read()
    c.request("GET", path)
    r = c.getresponse()
    assert r.status == 200 and r.read() == body
    c.close()


# --- through nginx ---------------------------------------------------------

ERRORS_CONF = os.path.join(kvt.TOP, "conf", "kvroute-openai-errors.conf")

NGINX_CONF = """
    kvroute_zone kv 16m;
    upstream llm {
        kvroute zone=kv %(params)s;
        %(servers)s
    }
    upstream dead { server 127.0.0.1:%(dead)d; }
    upstream silent { server 127.0.0.1:%(silent)d; }
    server {
        listen 127.0.0.1:%%(port)s;
        client_body_buffer_size 64k;
        client_max_body_size 64k;
        include %(errors)s;
        location /v1/ {
            kvroute_upstream llm;
            proxy_pass http://llm;
            proxy_http_version 1.1;
            proxy_buffering off;
        }
        location /dead/v1/ { proxy_pass http://dead/v1/; }
        location /silent/v1/ { proxy_pass http://silent/v1/; proxy_read_timeout 1s; }
        location = /kvroute/status { kvroute_status; }
    }
"""


def front(stack, ports, params=""):
    dead = kvt.free_port()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)      # accepts (in the kernel) and never answers
    stack.silent = silent
    servers = "\n".join("server 127.0.0.1:%d;" % p for p in ports)
    return stack.nginx(NGINX_CONF % {"params": params, "servers": servers, "dead": dead,
                                     "silent": silent.getsockname()[1], "errors": ERRORS_CONF})


def test_openai_client_through_nginx(stack):
    w = stack.worker(engines=2, extra=["--speedup", "50"])
    ng = front(stack, w.ports)
    c = client(ng.port)
    r = c.chat.completions.create(model=MODEL, max_tokens=2,
                                  messages=[{"role": "user", "content": "hello"}])
    assert r.usage.completion_tokens == 2
    assert [m.id for m in c.models.list()] == [MODEL]
    # the workers' own errors pass through unchanged
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="other", prompt="hi", max_tokens=1)
    assert error_of(e.value)["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="hi", max_tokens=1, n=2)
    assert error_of(e.value)["param"] == "n"
    assert not ng.alerts()


def test_nginx_errors_are_openai_json(stack):
    """The error_page recipe in conf/kvroute-openai-errors.conf: 413, 502, 504."""
    w = stack.worker(extra=["--speedup", "50"])
    ng = front(stack, w.ports)

    with pytest.raises(openai.APIStatusError) as e:
        client(ng.port).completions.create(model=MODEL, prompt="x" * 100000, max_tokens=1)
    assert e.value.status_code == 413
    assert error_of(e.value)["code"] == "request_too_large"

    for prefix, status, code in (("/dead", 502, "bad_gateway"),
                                 ("/silent", 504, "gateway_timeout")):
        c = openai.OpenAI(base_url="http://127.0.0.1:%d%s/v1" % (ng.port, prefix),
                          api_key="none", max_retries=0, timeout=30)
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model=MODEL, prompt="hi", max_tokens=1)
        assert e.value.status_code == status
        assert e.value.response.headers["content-type"] == "application/json"
        assert error_of(e.value)["code"] == code


def ids(prefix, n, base=1000):
    h = zlib.crc32(prefix.encode()) % 10000
    return [base + (h * 31 + i) % 30000 for i in range(n)]


def test_all_busy_503_is_openai_json_with_retry_after(stack):
    w = stack.worker(engines=1, extra=["--speedup", "2"])
    ng = front(stack, w.ports, "busy_decode_blocks=10 retry_after=7")

    def status():
        return json.loads(kvt.request(ng.port, "GET", "/kvroute/status")[2])

    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        long = ex.submit(kvt.post_json, ng.port, "/v1/completions",
                         {"model": MODEL, "prompt": ids("b", 400), "max_tokens": 300})
        kvt.wait_until(lambda: status()["zones"]["kv"]["upstreams"]["llm"][0]
                       ["active_decode_blocks"] >= 10, timeout=20, what="a busy server")
        with pytest.raises(openai.InternalServerError) as e:
            client(ng.port).completions.create(model=MODEL, prompt=ids("x", 32), max_tokens=1)
        assert e.value.status_code == 503
        assert e.value.response.headers["retry-after"] == "7"
        assert e.value.response.headers["content-type"] == "application/json"
        err = error_of(e.value)
        assert (err["type"], err["code"]) == ("server_error", "server_busy")
        # HEAD-less clients aside, the body is exactly the announced length
        assert int(e.value.response.headers["content-length"]) == len(e.value.response.content)
        assert long.result()[0] == 200
    assert status()["zones"]["kv"]["busy_rejects"] == 1
    assert not ng.alerts()
