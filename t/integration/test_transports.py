"""The ways real clients send a body, through a real nginx to kvworker
engines: HTTP/2, chunked transfer coding arriving in pieces, `Expect:
100-continue` (curl sends it for large bodies), and bodies nginx keeps in
a temporary file. Each must be read whole and routed on its prompt (the
same prompt a second time finds its blocks on the server that has them),
and with salt= rewritten and proxied whole."""
import json
import shutil
import socket
import subprocess
import time
import zlib

import pytest

import kvt

CONF = """
    kvroute_zone kv 16m;
    upstream llm {
        zone llm 64k;
        kvroute zone=kv mode=approximate;
        %(servers)s
        keepalive 8;
    }
    upstream salted {
        zone salted 64k;
        kvroute zone=kv mode=approximate salt=$http_x_tenant;
        %(servers)s
    }
    server {
        listen 127.0.0.1:%%(port)s;
        listen 127.0.0.1:%(h2)d http2;
        client_body_buffer_size 8k;
        client_max_body_size 4m;
        kvroute_debug_headers on;
        location /v1/ {
            kvroute_upstream llm;
            proxy_pass http://llm;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_request_buffering off;    # kvroute reads the body whole anyway
        }
        location /salted/ {                 # the body rewritten with the salt
            kvroute_upstream salted;
            rewrite ^/salted(/.*)$ $1 break;
            proxy_pass http://salted;
        }
    }
"""


def body(tag, n):
    base = 1000 + zlib.crc32(tag.encode()) % 997
    return json.dumps({"model": "kvroute-mock", "max_tokens": 1,
                       "prompt": [base + (i * 7919) % 20000 for i in range(n)]}).encode()


@pytest.fixture
def front(stack):
    w = stack.worker(engines=2)
    h2 = kvt.free_port()
    ng = stack.nginx(CONF % {"servers": "\n".join("server 127.0.0.1:%d;" % p for p in w.ports),
                             "h2": h2})
    ng.h2 = h2
    return ng


def curl(url, data, *extra):
    if shutil.which("curl") is None:
        pytest.skip("curl not installed")
    r = subprocess.run(["curl", "-s", "-D", "-", "-o", "/dev/null", "-H",
                        "Content-Type: application/json", "--data-binary", "@-"] + list(extra)
                       + [url], input=data, capture_output=True, timeout=30)
    lines = r.stdout.decode().splitlines()
    status = [l for l in lines if l.startswith("HTTP/") and " 100" not in l]
    hdrs = dict(l.split(": ", 1) for l in lines if ": " in l)
    hdrs = {k.lower(): v for k, v in hdrs.items()}
    return int(status[-1].split()[1]), hdrs


def chunked(port, path, data, pieces=5):
    """POST data with Transfer-Encoding: chunked, in pieces written apart so
    that nginx reads the body over several events."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    try:
        s.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"X-Tenant: t1\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                  % path.encode())
        step = len(data) // pieces + 1
        for i in range(0, len(data), step):
            part = data[i:i + step]
            s.sendall(b"%x\r\n%s\r\n" % (len(part), part))
            time.sleep(0.02)
        s.sendall(b"0\r\n\r\n")
        resp = b""
        while True:
            got = s.recv(65536)
            if not got:
                break
            resp += got
    finally:
        s.close()
    head = resp.split(b"\r\n\r\n", 1)[0].decode().split("\r\n")
    hdrs = {k.lower(): v for k, v in (l.split(": ", 1) for l in head[1:])}
    return int(head[0].split()[1]), hdrs


@pytest.mark.parametrize("path", ["/v1/completions", "/salted/v1/completions"])
@pytest.mark.parametrize("size", [64, 30000])     # in memory; in a temporary file
def test_every_way_of_sending_a_body_is_routed_on_its_prompt(front, size, path):
    plain = "http://127.0.0.1:%d%s" % (front.port, path)
    h2 = "http://127.0.0.1:%d%s" % (front.h2, path)
    blocks = size // 16
    tenant = ("-H", "X-Tenant: t1")
    ways = {
        "content-length": lambda d: curl(plain, d, *tenant),
        "expect-100": lambda d: curl(plain, d, "-H", "Expect: 100-continue", *tenant),
        "chunked": lambda d: chunked(front.port, path, d),
        "http2": lambda d: curl(h2, d, "--http2-prior-knowledge", *tenant),
        "http2-chunked-client": lambda d: curl(h2, d, "--http2-prior-knowledge",
                                               "-H", "Transfer-Encoding: chunked", *tenant),
    }
    for name, send in ways.items():
        data = body(name + str(size) + path, size)
        s, h = send(data)
        assert s == 200, (name, h)
        first = h["x-kvroute-worker"]
        s, h = send(data)
        assert s == 200, (name, h)
        assert h["x-kvroute-worker"] == first, name
        assert int(h["x-kvroute-overlap"]) == blocks, (name, h)
    if size > 8192:
        assert "buffered to a temporary file" in front.log()
    assert front.alerts() == []
