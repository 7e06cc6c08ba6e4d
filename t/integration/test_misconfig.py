"""Misconfigurations kvroute catches, with real nginx (-t and
running), real nats-server and real kvworker engines."""
import json
import os
import re
import zlib

import kvt


def nginx_t(stack, http_conf):
    return stack.nginx_t(http_conf)


def line_of(conf, needle, nth=1):
    with open(conf) as f:
        lines = [i + 1 for i, l in enumerate(f) if needle in l]
    return lines[nth - 1]


def test_keepalive_before_kvroute_is_refused(stack):
    ok, out, conf = nginx_t(stack, """
        upstream llm {
            keepalive 8;
            kvroute;
            server 127.0.0.1:1;
        }""")
    assert not ok
    assert '"kvroute" must come before "keepalive" in upstream "llm"' in out
    assert "%s:%d" % (conf, line_of(conf, "kvroute;")) in out


def test_keepalive_after_kvroute_and_other_orders_pass(stack):
    ok, out, _ = nginx_t(stack, """
        kvroute_zone kv 8m;
        upstream a { zone a 64k; kvroute zone=kv; server 127.0.0.1:1; keepalive 8; }
        upstream b { least_conn; kvroute; server 127.0.0.1:1; }""")
    assert ok, out
    assert "load balancing method redefined" in out      # nginx's own warning, kept


def test_duplicate_zone_names_both_lines(stack):
    ok, out, conf = nginx_t(stack, """
        kvroute_zone kv 8m;
        kvroute_zone kv 16m;""")
    assert not ok
    first = line_of(conf, "kvroute_zone kv 8m")
    second = line_of(conf, "kvroute_zone kv 16m")
    assert 'kvroute_zone "kv" is already declared in %s:%d' % (conf, first) in out
    assert "in %s:%d" % (conf, second) in out


def test_undeclared_zone_names_the_line(stack):
    ok, out, conf = nginx_t(stack, """
        upstream llm {
            kvroute zone=nope;
            server 127.0.0.1:1;
        }""")
    assert not ok
    assert 'uses zone=nope but there is no "kvroute_zone nope SIZE;"' in out
    assert "(zone=nope in %s:%d)" % (conf, line_of(conf, "zone=nope")) in out


CONF = """
    kvroute_zone kv 16m;
    kvroute_events %(nats)s zone=kv heartbeat_timeout=30s;
    upstream mis {
        kvroute zone=kv mode=events block_size=16;
        server 127.0.0.1:%(a)d;
    }
    upstream ok {
        kvroute zone=kv mode=events block_size=16;
        server 127.0.0.1:%(b)d;
    }
    server {
        listen 127.0.0.1:%%(port)s;
        kvroute_debug_headers on;
        location /mis/v1/ { kvroute_upstream mis; proxy_pass http://mis/v1/; }
        location /ok/v1/ { kvroute_upstream ok; proxy_pass http://ok/v1/; }
        location = /kvroute/status { kvroute_status; }
    }
"""


def ids(name, n):
    h = zlib.crc32(name.encode()) % 10000
    return [1000 + (h * 31 + i) % 30000 for i in range(n)]


def test_block_size_mismatch_is_logged_shown_and_routed_by_load(stack):
    nats = stack.nats()
    hb = ["--nats", nats.url, "--heartbeat-ms", "200", "--speedup", "50"]
    a = stack.worker(extra=hb + ["--block-size", "32"])
    b = stack.worker(extra=hb)
    # one nginx worker process: the one that routes is the one whose status we read
    ng = stack.nginx(CONF % {"nats": nats.url, "a": a.ports[0], "b": b.ports[0]}, workers=1)

    def st():
        return json.loads(kvt.request(ng.port, "GET", "/kvroute/status")[2])["zones"]["kv"]

    kvt.wait_until(lambda: len([w for w in st()["events"]["workers"]
                                if w["state"] == "live"]) == 2, timeout=20,
                   what="both workers announced")
    # nginx looks a worker up again at most once a second after a miss
    kvt.wait_until(lambda: st()["upstreams"]["mis"][0]["block_size_mismatch"]
                   and st()["upstreams"]["ok"][0]["worker_block_size"] == 16, timeout=20,
                   what="both workers' block sizes seen")

    overlaps = {"mis": [], "ok": []}
    for up in ("mis", "ok"):
        for i in range(4):
            s, h, _, _ = kvt.post_json(ng.port, "/%s/v1/completions" % up,
                                       {"model": "kvroute-mock", "prompt": ids("same", 96),
                                        "max_tokens": 1})
            assert s == 200
            overlaps[up].append(int(h["x-kvroute-overlap"]))

    # the matching worker gets credit for the prefix it holds; the other
    # never does (without the check the router's own pending decisions
    # would give it credit, block hashes of the wrong size)
    assert max(overlaps["ok"][1:]) > 0, overlaps
    assert overlaps["mis"] == [0, 0, 0, 0], overlaps

    servers = {x["server"]: x for u in ("mis", "ok") for x in st()["upstreams"][u]}
    sa = servers["127.0.0.1:%d" % a.ports[0]]
    sb = servers["127.0.0.1:%d" % b.ports[0]]
    assert (sa["worker_block_size"], sa["block_size_mismatch"]) == (32, True)
    assert (sb["worker_block_size"], sb["block_size_mismatch"]) == (16, False)

    msgs = [l for l in ng.log().splitlines() if "announces block_size=32" in l]
    assert msgs and "[error]" in msgs[0], ng.log()[-2000:]
    assert re.search(r'server "127\.0\.0\.1:%d" of upstream "mis" announces block_size=32 '
                     r'but kvroute has block_size=16: routing it by load only'
                     % a.ports[0], msgs[0])
    # once per nginx worker process, not once per request
    assert len(msgs) == 1, msgs
    assert not ng.alerts()


def test_share_parameters_checked_by_nginx_t(stack):
    good = """
        kvroute_zone kv 8m;
        kvroute_share nats://127.0.0.1:1 zone=kv lease=2s interval=50ms batch=32 ring=4096;
        upstream llm { kvroute zone=kv; server 127.0.0.1:1; }"""
    ok, out, _ = nginx_t(stack, good)
    assert ok, out
    for bad, says in (("batch=65", "in [1, 64]"), ("ring=8", "in [16, 1048576]"),
                      ("lease=0", "time above 0"), ("interval=soon", "time above 0"),
                      ("colour=red", 'invalid parameter "colour=red"')):
        ok, out, _ = nginx_t(stack, good.replace("ring=4096", "ring=4096 " + bad))
        assert not ok, bad
        assert says in out, (bad, out)


def test_zone_ttl_within_what_the_index_can_age(stack):
    """The index ages blocks by ms mod 2^32, signed: a ttl of 2^31 ms (24.8
    days) or more read as negative, and every sweep dropped the whole index."""
    conf = """
        kvroute_zone kv 8m ttl=%s;
        upstream llm { kvroute zone=kv; server 127.0.0.1:1; }"""
    ok, out, _ = nginx_t(stack, conf % "24d")
    assert ok, out
    for bad in ("25d", "30d", "0"):
        ok, out, _ = nginx_t(stack, conf % bad)
        assert not ok, bad
        assert 'invalid parameter "ttl=%s"' % bad in out and "up to 2073600s" in out, out


def test_chat_template_kwargs_must_be_a_json_object(stack):
    conf = """
        kvroute_zone kv 8m;
        upstream llm { zone llm 64k; kvroute zone=kv %s; server 127.0.0.1:1; }"""
    # nginx reads braces as a block: the whole parameter is quoted
    ok, out, _ = nginx_t(stack, conf % """'chat_template_kwargs={"enable_thinking": false}'""")
    assert ok, out
    for bad in ("chat_template_kwargs=[1]", """'chat_template_kwargs={"a":'"""):
        ok, out, _ = nginx_t(stack, conf % bad)
        assert not ok, bad
        assert "is not a JSON object" in out, out
