"""kvroute_upstream NAME: the location names the kvroute upstream it proxies
to, so the precontent phase reads and prepares the prompt without reading
another module's private configuration (it used to cast the proxy module's
location conf). Real nginx and kvworker engines, approximate mode.

What shows the precontent phase ran: with salt= the body is rewritten before
proxying, and a body that cannot be parsed is refused with 400 there; where
the phase did not run, salt= refuses every request with 500."""
import json
import zlib

import kvt

CONF = """
    kvroute_zone kv 16m;
    upstream llm {
        zone llm 64k;
        kvroute zone=kv mode=approximate salt=$http_x_tenant;
        %(servers)s
        keepalive 8;
    }
    upstream other {
        zone other 64k;
        kvroute zone=kv mode=approximate;
        %(servers)s
    }
    server {
        listen 127.0.0.1:%%(port)s;
        kvroute_debug_headers on;
        location /named/ {
            kvroute_upstream llm;
            proxy_pass http://llm/;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }
        location /variable/ {
            kvroute_upstream llm;
            set $up llm;
            rewrite ^/variable(/.*)$ $1 break;
            proxy_pass http://$up;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }
        location /v1/ {                 # no kvroute_upstream
            proxy_pass http://llm;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }
        location /other/ {              # names one upstream, proxies to another
            kvroute_upstream llm;
            proxy_pass http://other/;
        }
        location /plain/ {              # no salt=: balanced all the same
            proxy_pass http://other/;
        }
        location /grpc/ {
            kvroute_upstream llm;
            grpc_pass grpc://llm;
        }
        location /if/ {
            if ($http_x_route) {
                rewrite ^/if(/.*)$ $1 break;
                kvroute_upstream llm;       # in "if", as proxy_pass may be
                proxy_pass http://llm;
            }
            return 404;
        }
        location /outer/ {
            kvroute_upstream llm;
            proxy_pass http://llm/;
            location /outer/inner/ {    # not inherited, as proxy_pass is not
                proxy_pass http://other/;
            }
        }
    }
"""


def ids(name, n):
    h = zlib.crc32(name.encode()) % 10000
    return [1000 + (h * 31 + i) % 30000 for i in range(n)]


def ask(port, path, prompt, tenant="acme", body_extra=None, raw=None):
    body = {"model": "kvroute-mock", "prompt": prompt, "max_tokens": 1}
    body.update(body_extra or {})
    s, h, data = kvt.request(port, "POST", path, raw if raw is not None else json.dumps(body),
                             {"X-Tenant": tenant})
    out = json.loads(data) if s == 200 else None
    cached = out["usage"]["prompt_tokens_details"]["cached_tokens"] if out else None
    return s, h, cached


def setup(stack):
    w = stack.worker(engines=2, extra=["--speedup", "50"])
    servers = "\n".join("server 127.0.0.1:%d;" % p for p in w.ports)
    return stack.nginx(CONF % {"servers": servers})


def test_directive_prepares_before_proxying(stack):
    """With the directive the body is rewritten before proxying, also where
    proxy_pass uses variables (the old cast found no upstream there): the
    operator's salt reaches the engine, a client's cannot replace it."""
    ng = setup(stack)
    for path in ("/named/v1/completions", "/variable/v1/completions"):
        p = ids(path, 160) + [1, 2, 3]
        s, h, cached = ask(ng.port, path, p)
        assert s == 200 and cached == 0, path
        kvt.wait_until(lambda: ask(ng.port, path, p)[2] == 160, what="acme cached " + path)
        # the engine sees "4:evil" + the client's value, never "4:acme"
        s, _, cached = ask(ng.port, path, p, tenant="evil", body_extra={"cache_salt": "4:acme"})
        assert s == 200 and cached == 0, path
        # a body that cannot be rewritten is refused by the precontent phase
        s, _, _ = ask(ng.port, path, p, raw='{"prompt": [1, 2,')
        assert s == 400, path
    assert ng.alerts() == []


def test_location_without_directive(stack):
    """Without the directive the balancer still routes (prompt prepared in
    init_peer), the error log says so once, and salt= refuses rather than
    send the client's own cache_salt."""
    ng = setup(stack)
    p = ids("plain", 40)
    for _ in range(3):
        s, h, _ = ask(ng.port, "/plain/v1/completions", p)
        assert s == 200
        assert "x-kvroute-worker" in h
    s, _, _ = ask(ng.port, "/v1/completions", p)
    assert s == 500
    log = ng.log()
    assert 'salt= needs "kvroute_upstream llm;" in the location' in log
    assert log.count('a location without "kvroute_upstream other;" proxies to it') <= ng.workers
    assert 'a location without "kvroute_upstream other;" proxies to it' in log
    assert ng.alerts() == []


def test_if_and_nested_locations(stack):
    """The directive goes where proxy_pass goes: inside "if"; a nested
    location does not inherit it (it proxies elsewhere here, which would
    otherwise fail as a mismatch)."""
    ng = setup(stack)
    p = ids("if", 40)
    s, _, _ = kvt.request(ng.port, "POST", "/if/v1/completions",
                          json.dumps({"model": "kvroute-mock", "prompt": p, "max_tokens": 1}),
                          {"X-Tenant": "acme", "X-Route": "1"})
    assert s == 200
    # a body that cannot be rewritten: refused before proxying
    s, _, _ = kvt.request(ng.port, "POST", "/if/v1/completions", '{"prompt": [1, 2,',
                          {"X-Tenant": "acme", "X-Route": "1"})
    assert s == 400
    s, _, _ = ask(ng.port, "/outer/inner/v1/completions", p)
    assert s == 200
    assert "kvroute_upstream is" not in ng.log()
    assert ng.alerts() == []


def test_directive_names_another_upstream(stack):
    ng = setup(stack)
    s, _, _ = ask(ng.port, "/other/v1/completions", ids("other", 40))
    assert s == 500
    assert 'the location\'s kvroute_upstream is "llm" but it proxies to "other"' in ng.log()
    assert ng.alerts() == []


def test_grpc_pass(stack):
    """The directive does not depend on the content module: under grpc_pass
    the precontent phase reads and checks the body too (kvworker speaks no
    HTTP/2, so a well-formed request ends in 502 after the balancer chose)."""
    ng = setup(stack)
    p = ids("grpc", 40)
    s, _, _ = ask(ng.port, "/grpc/x", p, raw='{"prompt": [1, 2,')
    assert s == 400
    s, _, _ = ask(ng.port, "/grpc/x", p)
    assert s == 502
    assert "kvroute_upstream is" not in ng.log()
    assert ng.alerts() == []


def nginx_t(stack, http_conf):
    return stack.nginx_t(http_conf)


def test_configuration_errors(stack):
    ok, out, conf = nginx_t(stack, """
        upstream rr { server 127.0.0.1:1; }
        server { listen 127.0.0.1:1; location / { kvroute_upstream rr; proxy_pass http://rr; } }
    """)
    assert not ok
    assert 'kvroute_upstream "rr": no upstream block of that name has "kvroute" in %s:' \
        % conf in out
    ok, out, _ = nginx_t(stack, """
        server { listen 127.0.0.1:1; location / { kvroute_upstream nope; } }
    """)
    assert not ok
    assert 'kvroute_upstream "nope": no upstream block' in out
    ok, out, _ = nginx_t(stack, """
        server { listen 127.0.0.1:1;
                 location / { kvroute_upstream u; kvroute_upstream u; proxy_pass http://u; } }
        upstream u { kvroute; server 127.0.0.1:1; }
    """)
    assert not ok
    assert '"kvroute_upstream" directive is duplicate' in out
    # the upstream may come after the location, and may be called "off"
    ok, out, _ = nginx_t(stack, """
        server { listen 127.0.0.1:1;
                 location / { kvroute_upstream off; proxy_pass http://off;
                              location /x/ { proxy_pass http://off; } } }
        kvroute_zone kv 8m;
        upstream off { zone u 64k; kvroute zone=kv; server 127.0.0.1:1; }
    """)
    assert ok, out
