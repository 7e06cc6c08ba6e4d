"""The operator's cache salt (docs/SECURITY.md, section 5): `salt=$var` reaches the
engine and no client can override it. nginx combines the operator's salt
with the body's own (kv_prompt_salt: "<len>:<operator><client>"), hashes
with that, and rewrites the proxied body so its only cache_salt is that
value. Real nginx, nats-server and kvworker engines in events mode."""
import json
import zlib

import kvt

CONF = """
    kvroute_zone kv 16m;
    kvroute_events %(nats)s zone=kv;
    upstream llm {
        zone llm 64k;
        kvroute zone=kv mode=events salt=$http_x_tenant;
        %(servers)s
        keepalive 8;
    }
    server {
        listen 127.0.0.1:%%(port)s;
        client_body_buffer_size 1k;     # larger bodies go to a temp file
        location /v1/ {
            kvroute_upstream llm;
            proxy_pass http://llm;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            kvroute_debug_headers on;
        }
        location /raw/ {
            proxy_request_buffering off;
            rewrite ^/raw(/.*)$ $1 break;
            kvroute_upstream llm;
            proxy_pass http://llm;
        }
        location = /kvroute/status { kvroute_status; }
    }
"""


def ids(name, n):
    h = zlib.crc32(name.encode()) % 10000
    return [1000 + (h * 31 + i) % 30000 for i in range(n)]


def status(port):
    s, _, body = kvt.request(port, "GET", "/kvroute/status")
    assert s == 200
    return json.loads(body)["zones"]["kv"]


def ask(port, prompt, tenant=None, body_extra=None, raw=None, path="/v1/completions"):
    body = {"model": "kvroute-mock", "prompt": prompt, "max_tokens": 1}
    body.update(body_extra or {})
    hdrs = {"X-Tenant": tenant} if tenant is not None else {}
    s, h, data = kvt.request(port, "POST", path, raw if raw is not None else json.dumps(body),
                             hdrs)
    out = json.loads(data) if s == 200 else None
    cached = out["usage"]["prompt_tokens_details"]["cached_tokens"] if out else None
    return s, h, cached


def setup(stack):
    nats = stack.nats()
    w = stack.worker(engines=2, extra=["--speedup", "50", "--nats", nats.url,
                                       "--heartbeat-ms", "200"])
    servers = "\n".join("server 127.0.0.1:%d;" % p for p in w.ports)
    ng = stack.nginx(CONF % {"nats": nats.url, "servers": servers})
    kvt.wait_until(lambda: len([x for x in status(ng.port)["events"]["workers"]
                                if x["state"] == "live"]) == 2, what="workers live")
    return ng


def test_operator_salt_reaches_the_engine(stack):
    """salt= used to turn cache-aware routing off in events mode (the router
    salted its hashes, the engine did not): overlap was always 0."""
    ng = setup(stack)
    p = ids("salted", 160) + [1, 2, 3]
    s, h, cached = ask(ng.port, p, tenant="acme")
    assert s == 200 and cached == 0
    first = h["x-kvroute-worker"]

    # the engine's events carry the combined salt's hashes: the router finds them
    def found():
        s, h, cached = ask(ng.port, p, tenant="acme")
        assert s == 200
        return h["x-kvroute-worker"] == first and h["x-kvroute-overlap"] == "10" \
            and cached == 160
    kvt.wait_until(found, what="overlap under the operator's salt")
    # a body in a temp file (client_body_buffer_size 1k) is rewritten too
    big = ids("salted", 160) + list(range(5000, 5400))
    s, h, cached = ask(ng.port, big, tenant="acme")
    assert s == 200 and cached == 160 and h["x-kvroute-overlap"] == "10"
    assert ng.alerts() == []


def test_client_cannot_choose_another_tenants_salt(stack):
    """A client's body cache_salt used to replace the operator's salt, so a
    tenant could pick another's. Now it is combined with it: every way of
    naming tenant acme's value from another tenant (or none) misses."""
    ng = setup(stack)
    p = ids("secret", 160) + [1, 2, 3]
    s, _, _ = ask(ng.port, p, tenant="acme")
    kvt.wait_until(lambda: ask(ng.port, p, tenant="acme")[2] == 160, what="acme cached")
    acme_value = "4:acme"           # what the engine sees for tenant acme
    tries = [
        dict(tenant="evil", body_extra={"cache_salt": acme_value}),
        dict(tenant="evil", body_extra={"cache_salt": "acme"}),
        # no tenant header (the same as an empty one): "0:4:acme"
        dict(tenant=None, body_extra={"cache_salt": acme_value}),
        # an escaped key: engines unescape keys (another tenant: each try's
        # combined value must be new, or the try before it cached it)
        dict(tenant="evil2", raw='{"model":"kvroute-mock","max_tokens":1,"prompt":%s,'
             '"c\\u0061che_salt":"%s"}' % (json.dumps(p), acme_value)),
    ]
    for t in tries:
        s, h, cached = ask(ng.port, p, **t)
        assert s == 200, t
        assert cached == 0, t
        assert h["x-kvroute-overlap"] == "0", t
    # duplicates (Python's json keeps the last; every one is rewritten, see
    # t/unit/test_prompt_blocks.c): kvworker refuses duplicate keys outright
    s, _, _ = ask(ng.port, p, tenant="evil",
                  raw='{"model":"kvroute-mock","max_tokens":1,"prompt":%s,"cache_salt":"x",'
                  '"cache_salt":"%s"}' % (json.dumps(p), acme_value))
    assert s == 400
    # and the tenant itself, with a client salt of its own, is a new namespace
    s, h, cached = ask(ng.port, p, tenant="acme", body_extra={"cache_salt": "u1"})
    assert s == 200 and cached == 0
    # acme still shares with acme
    s, h, cached = ask(ng.port, p, tenant="acme")
    assert s == 200 and cached == 160
    # proxy_request_buffering off: kvroute reads the body before proxying
    # anyway, so it is rewritten all the same
    s, _, cached = ask(ng.port, p, tenant="evil3", path="/raw/v1/completions",
                       body_extra={"cache_salt": acme_value})
    assert s == 200 and cached == 0
    # a body that is not JSON is refused rather than sent with whatever
    # salt the engine might find in it
    s, _, _ = ask(ng.port, p, tenant="evil", raw='{"prompt": [1, 2,')
    assert s == 400
    assert "salt= cannot be applied" in open(ng.error_log).read()


def test_salt_applied_when_the_prompt_is_not_read(stack):
    """A prompt the router cannot read (here a text prompt with no tokenizer
    configured: routed by load) still reaches the engine under its tenant's
    salt. It used to go unsalted, so another tenant whose request also fell
    back could hit its cached blocks and learn the prompt from the cached
    token count."""
    ng = setup(stack)
    secret = "the quarterly numbers are " + "x" * 300
    holders = set()

    def acme_everywhere():
        s, h, cached = ask(ng.port, secret, tenant="acme")
        assert s == 200
        if cached >= 300:
            holders.add(h["x-kvroute-worker"])
        return len(holders) == 2
    # acme shares with acme, on both engines (load spreads its tries)
    kvt.wait_until(acme_everywhere, what="acme's prompt cached on both engines")
    # each try another tenant's, or none (the engine caches each try's own)
    for tenant in ("evil1", "evil2", None):
        s, _, cached = ask(ng.port, secret, tenant=tenant)
        assert s == 200 and cached == 0, tenant
    assert ng.alerts() == []
