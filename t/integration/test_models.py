"""Several models behind one location, and LoRA adapters, chosen by the
request's `model` as OpenAI clients send it: real nginx, nats-server and
kvworker mock engines (`--lora-modules`, whose adapter blocks are tagged
as vLLM tags them)."""
import json
import zlib

import kvt


def ids(name, n):
    h = zlib.crc32(name.encode()) % 10000
    return [1000 + (h * 31 + i) % 30000 for i in range(n)]


def complete(port, model, prompt, path="/v1/completions", max_tokens=1):
    body = {"prompt": prompt, "max_tokens": max_tokens}
    if model is not None:
        body["model"] = model
    return kvt.post_json(port, path, body)


def upstream_servers(ports):
    return "\n".join("server 127.0.0.1:%d;" % p for p in ports)


# --- LoRA adapters in events mode -------------------------------------------

EVENTS_CONF = """
    kvroute_zone kv 16m;
    kvroute_events %(nats)s zone=kv;
    upstream llm {
        zone llm 64k;
        kvroute zone=kv mode=events model=base lora=sql,chat;
        %(servers)s
    }
    server {
        listen 127.0.0.1:%%(port)s;
        location /v1/ {
            kvroute_upstream llm;
            proxy_pass http://llm;
            kvroute_debug_headers on;
        }
        location = /kvroute/status { kvroute_status; }
    }
"""


def indexed(port, server):
    s, _, body = kvt.request(port, "GET", "/kvroute/status")
    assert s == 200
    for x in json.loads(body)["zones"]["kv"]["upstreams"]["llm"]:
        if x["server"] == server:
            return x["indexed_blocks"]
    raise KeyError(server)


def test_lora_requests_find_their_adapters_blocks_only(stack):
    nats = stack.nats()
    w = stack.worker(engines=2, extra=["--model", "base", "--lora-modules", "sql,chat",
                                       "--nats", nats.url, "--heartbeat-ms", "200"])
    a, b = w.ports
    ng = stack.nginx(EVENTS_CONF % {"nats": nats.url, "servers": upstream_servers(w.ports)})

    # the worker lists its adapters as vLLM does
    s, _, body = kvt.request(a, "GET", "/v1/models")
    assert s == 200
    assert [(m["id"], m.get("parent")) for m in json.loads(body)["data"]] == [
        ("base", None), ("sql", "base"), ("chat", "base")]
    s, _, body = kvt.request(a, "GET", "/v1/models/chat")
    assert s == 200 and json.loads(body)["parent"] == "base"
    assert kvt.request(a, "GET", "/v1/models/nope")[0] == 404

    # the same prompt, cached as adapter "sql" on a and as the base on b
    doc = ids("doc", 320)
    for port, model in ((a, "sql"), (b, "base")):
        s, _, body, raw = complete(port, model, doc)
        assert s == 200, raw
        assert body["model"] == model
    kvt.wait_until(lambda: indexed(ng.port, "127.0.0.1:%d" % a) >= 20
                   and indexed(ng.port, "127.0.0.1:%d" % b) >= 20, what="events indexed")

    for tail, (model, port) in enumerate((("sql", a), ("base", b), (None, b))):
        s, h, body, raw = complete(ng.port, model, doc + [7 + tail] * 16)
        assert s == 200, raw
        assert h["x-kvroute-worker"] == "127.0.0.1:%d" % port, model
        assert h["x-kvroute-overlap"] == "20"
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 320

    # another adapter shares nothing with either: no overlap claimed, and
    # the engine that serves it computes the prompt again
    s, h, body, raw = complete(ng.port, "chat", doc + [20] * 16)
    assert s == 200, raw
    assert h["x-kvroute-overlap"] == "0"
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    # a name neither the router nor the worker serves
    s, h, body, raw = complete(ng.port, "nope", doc)
    assert s == 404 and body["error"]["code"] == "model_not_found", raw
    assert ng.alerts() == []


def test_worker_lora_modules_checked():
    import subprocess
    import os
    kvw = os.path.join(kvt.BIN, "kvworker")
    for extra in (["--lora-modules", "a", "--engine", "cpu"],
                  ["--lora-modules", ""], ["--lora-modules", "*"], ["--lora-modules", "a,,b"],
                  ["--lora-modules", "a,"], ["--lora-modules", "x" * 128]):
        r = subprocess.run([kvw, "--port", str(kvt.free_port())] + extra, capture_output=True,
                           text=True, timeout=10)
        assert r.returncode != 0 and "--lora-modules" in r.stderr, extra


# --- several models behind one location ------------------------------------

MODELS_CONF = """
    kvroute_zone kv 16m;
    upstream alpha {
        zone alpha 64k;
        kvroute zone=kv mode=approximate model=org/alpha,alpha;
        %(alpha)s
    }
    upstream beta {
        zone beta 64k;
        kvroute zone=kv mode=approximate model=beta lora=beta-sql;
        %(beta)s
    }
    server {
        listen 127.0.0.1:%%(port)s;
        client_body_buffer_size 8k;
        kvroute_debug_headers on;
        location /v1/ {
            kvroute_upstream alpha beta;
            proxy_pass http://$kvroute_upstream;
        }
        location /v1/models {
            kvroute_models alpha beta;
        }
        location /fixed/ {                  # proxies to alpha whatever the model
            kvroute_upstream alpha beta;
            rewrite ^/fixed(/.*)$ $1 break;
            proxy_pass http://alpha;
        }
        location /first/ {
            kvroute_upstream alpha beta;
            rewrite ^/first(/.*)$ /v1$1 break;
            proxy_pass http://$kvroute_upstream;
        }
    }
"""


def test_model_picks_the_upstream(stack):
    wa = stack.worker(engines=2, extra=["--model", "org/alpha"])
    wb = stack.worker(engines=2, extra=["--model", "beta", "--lora-modules", "beta-sql"])
    ng = stack.nginx(MODELS_CONF % {"alpha": upstream_servers(wa.ports),
                                    "beta": upstream_servers(wb.ports)})
    at = {"127.0.0.1:%d" % p for p in wa.ports}
    bt = {"127.0.0.1:%d" % p for p in wb.ports}

    for model, where, served in (("org/alpha", at, "org/alpha"), ("beta", bt, "beta"),
                                 ("beta-sql", bt, "beta-sql"), (None, at, "org/alpha")):
        prompt = ids("p-%s" % model, 64)
        s, h, body, raw = complete(ng.port, model, prompt)
        assert s == 200, raw
        assert h["x-kvroute-worker"] in where and body["model"] == served
        # the upstream's own index: the same prompt again finds its blocks
        s, h2, _, raw = complete(ng.port, model, prompt)
        assert s == 200 and h2["x-kvroute-worker"] == h["x-kvroute-worker"], raw
        assert h2["x-kvroute-overlap"] == "4"

    # an alias of the first upstream's model (vLLM serves several names;
    # this kvworker only its own, so it answers 404 from the right pool)
    s, h, body, raw = complete(ng.port, "alpha", ids("alias", 64))
    assert s == 404 and h["x-kvroute-worker"] in at, raw

    # chat requests too, and a body nginx keeps in a temporary file
    s, h, body, raw = kvt.post_json(ng.port, "/v1/chat/completions",
                                    {"model": "beta", "max_tokens": 1,
                                     "messages": [{"role": "user", "content": "hi " * 6000}]})
    assert s == 200 and h["x-kvroute-worker"] in bt, raw
    assert "buffered to a temporary file" in ng.log()

    # a model no upstream serves: answered here, nothing proxied
    s, h, body, raw = complete(ng.port, "gamma", ids("g", 64))
    assert s == 404, raw
    assert body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"
    assert "x-kvroute-worker" not in h

    # requests kvroute does not read go to the first upstream
    s, _, body = kvt.request(ng.port, "GET", "/first/models")
    assert s == 200 and [m["id"] for m in json.loads(body)["data"]] == ["org/alpha"]

    # a location that proxies elsewhere than $kvroute_upstream: the model's
    # upstream is not the one proxied to, refused and logged
    s, _, _, raw = complete(ng.port, "org/alpha", ids("f", 64), path="/fixed/v1/completions")
    assert s == 200, raw
    s, _, _, raw = complete(ng.port, "beta", ids("f", 64), path="/fixed/v1/completions")
    assert s == 500, raw
    assert 'kvroute_upstream is "beta" but it proxies to "alpha"' in ng.log()

    # a body that is not JSON: the first upstream, whose engine says why
    s, _, _ = kvt.request(ng.port, "POST", "/v1/completions", b"{not json")
    assert s == 400
    assert ng.alerts() == []


def test_models_listed_for_every_upstream(stack):
    ng = stack.nginx(MODELS_CONF % {"alpha": "server 127.0.0.1:1;",
                                    "beta": "server 127.0.0.1:2;"})
    s, h, body = kvt.request(ng.port, "GET", "/v1/models")
    assert s == 200 and h["content-type"] == "application/json", body
    doc = json.loads(body)
    assert doc["object"] == "list"
    assert [(m["id"], m["parent"]) for m in doc["data"]] == [
        ("org/alpha", None), ("alpha", None), ("beta", None), ("beta-sql", "beta")]
    assert all(m["object"] == "model" and m["owned_by"] == "kvroute" for m in doc["data"])

    for mid, parent in (("org/alpha", None), ("alpha", None), ("beta-sql", "beta")):
        s, _, body = kvt.request(ng.port, "GET", "/v1/models/" + mid)
        assert s == 200 and json.loads(body)["id"] == mid, body
        assert json.loads(body)["parent"] == parent
    s, _, body = kvt.request(ng.port, "GET", "/v1/models/gamma")
    assert s == 404 and json.loads(body)["error"]["code"] == "model_not_found"
    s, h, body = kvt.request(ng.port, "HEAD", "/v1/models")
    assert s == 200 and body == b"" and int(h["content-length"]) > 0
    s, _, _ = kvt.request(ng.port, "POST", "/v1/models", {"x": 1})
    assert s == 405
    assert ng.alerts() == []


def test_model_choice_misconfigurations_fail_nginx_t(stack):
    up = """
    kvroute_zone kv 4m;
    upstream a { zone a 64k; kvroute zone=kv %s; server 127.0.0.1:1; }
    upstream b { zone b 64k; kvroute zone=kv model=b; server 127.0.0.1:2; }
    upstream c { zone c 64k; kvroute; server 127.0.0.1:3; }
    server { listen 127.0.0.1:%%(port)s; location / { %s proxy_pass http://$kvroute_upstream; } }
    """
    for a, loc, want in (
            ("model=a", "kvroute_upstream a b;", None),
            ("", "kvroute_upstream b a;", None),
            ("", "kvroute_upstream a b;", 'kvroute_upstream "a" has no model= and serves every'),
            ("model=a", "kvroute_upstream a c;", 'kvroute_upstream "c": choosing by model needs'),
            ("model=a", "kvroute_upstream a nope;", 'kvroute_upstream "nope": no upstream block'),
            ("lora=x", "kvroute_upstream a;", "lora= needs model="),
            ("model=a lora=x,,y", "kvroute_upstream a;", 'invalid parameter "lora=x,,y"'),
            ("model=a lora=x,*", "kvroute_upstream a;", 'invalid parameter "lora=x,*"'),
            ("model=a lora=*", "kvroute_upstream a b;", None),
            ("model=a,", "kvroute_upstream a;", 'invalid parameter "model=a,"'),
            ("model=a,*", "kvroute_upstream a;", 'invalid parameter "model=a,*"'),
            ("model=a,b lora=*", "kvroute_upstream a b;", None),
            ("model=a lora=", "kvroute_upstream a;", 'invalid parameter "lora="'),
            ("model=a lora=b", "kvroute_models a b;", None),
            ("model=a", "kvroute_models a c;", 'kvroute_models "c": its "kvroute" has no model=')):
        ok, out, _ = stack.nginx_t(up % (a, loc))
        if want is None:
            assert ok, out
        else:
            assert not ok and want in out, (a, loc, out)
