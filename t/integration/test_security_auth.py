"""Publisher authentication (docs/SECURITY.md, section 3): the documented
nats-server setup (conf/nats/per-worker-auth.conf) with per-worker users and
subject permissions, real kvworkers publishing on their per-worker subjects,
the router reading only those; forgeries from another worker's user are
refused by nats-server or by the router. NATS auth/TLS failures reach
error.log, and credentials in a URL never do."""
import json
import os
import subprocess

import pytest

import kvingest
import kvt
from kvnats import Nats
import kvproto

ok, why = kvingest.available()
pytestmark = pytest.mark.skipif(not ok, reason="kvingest unavailable: %s" % why)

P = kvproto.DEFAULT_PREFIX
CONF = os.path.join(os.path.dirname(__file__), "..", "..", "conf", "nats",
                    "per-worker-auth.conf")


def auth_nats(stack):
    port = kvt.free_port()
    with open(CONF) as f:
        text = f.read().replace("127.0.0.1:4222", "127.0.0.1:%d" % port)
    path = os.path.join(stack.dir, "nats-auth-%d.conf" % port)
    with open(path, "w") as f:
        f.write(text)
    p = stack.spawn([kvt.NATS_SERVER, "-c", path], "nats-auth-%d.log" % port)
    kvt.wait_port(port, proc=p, what="nats-server")
    p.port = port
    return p


def worker(stack, nats, wid):
    url = "nats://worker-%d:worker-%d-secret@127.0.0.1:%d" % (wid, wid, nats.port)
    return stack.worker(extra=["--speedup", "50", "--nats", url, "--worker-id", str(wid),
                               "--nats-subjects", "per-worker", "--heartbeat-ms", "200"])


def warm(port, prompt):
    s, _, body = kvt.request(port, "POST", "/v1/completions", json.dumps(
        {"model": "kvroute-mock", "prompt": prompt, "max_tokens": 1}).encode(),
        {"Content-Type": "application/json"})
    assert s == 200, body


NGINX = """
    kvroute_zone kv 16m;
    kvroute_events nats://127.0.0.1:%(nats)d zone=kv user=router password=router-secret
                   subjects=per-worker;
    upstream llm {
        zone llm 64k;
        kvroute zone=kv mode=events;
        %(servers)s
    }
    server {
        listen 127.0.0.1:%%(port)s;
        location /v1/ { kvroute_upstream llm; proxy_pass http://llm; kvroute_debug_headers on; }
        location = /kvroute/status { kvroute_status; }
    }
"""


def test_per_worker_users_route_end_to_end(stack):
    nats = auth_nats(stack)
    w1, w2 = worker(stack, nats, 101), worker(stack, nats, 102)
    servers = "server 127.0.0.1:%d;\nserver 127.0.0.1:%d;" % (w1.ports[0], w2.ports[0])
    ng = stack.nginx(NGINX % {"nats": nats.port, "servers": servers})

    def status():
        s, _, body = kvt.request(ng.port, "GET", "/kvroute/status")
        return json.loads(body)["zones"]["kv"]
    kvt.wait_until(lambda: sorted(x["worker_id"] for x in status()["events"]["workers"]
                                  if x["state"] == "live") == [101, 102],
                   what="both workers live through their own subjects")
    prompt = [2000 + i for i in range(320)]
    warm(w1.ports[0], prompt)
    a = "127.0.0.1:%d" % w1.ports[0]
    kvt.wait_until(lambda: status()["events"]["blocks"] >= 20, what="events indexed")

    # worker 101's events, read from its own subject, are in the index
    kvt.wait_until(lambda: [x["events"] for x in status()["events"]["workers"]
                            if x["worker_id"] == 101] >= [1], what="101's events applied")

    # and routing credits them (the first decision of an nginx process may
    # not yet map a server to an explicit --worker-id: a balancer matter)
    def routed():
        s, h, _, _ = kvt.post_json(ng.port, "/v1/completions",
                                   {"model": "kvroute-mock", "prompt": prompt + [3] * 16,
                                    "max_tokens": 1})
        return s == 200 and int(h["x-kvroute-overlap"]) >= 20
    kvt.wait_until(routed, what="routed by overlap")
    with open(nats.log) as f:
        assert "Permissions Violation" not in f.read()      # the setup needs nothing more
    assert ng.alerts() == []


def test_forgery_by_another_worker_is_refused(stack):
    nats = auth_nats(stack)
    ing = kvingest.Ingest(stack, "nats://127.0.0.1:%d" % nats.port,
                          extra=["--user", "router", "--password", "router-secret",
                                 "--per-worker-only"])
    w1 = worker(stack, nats, 101)
    ing.wait(lambda s: (ing.worker(101, st=s) or {}).get("state") == "live", what="101 live")
    warm(w1.ports[0], [5000 + i for i in range(64)])
    st = ing.wait(lambda s: ing.worker(101, st=s)["blocks"] == 4, what="101 indexed")
    events = ing.worker(101, st=st)["events"]

    evil = Nats(nats.port, user="worker-102", password="worker-102-secret")
    cleared = json.dumps({"worker_id": 101, "event": {"event_id": 2, "data": "cleared",
                                                      "dp_rank": 0}})
    # as worker 101, on the shared subject, as its heartbeat: refused by nats-server
    evil.publish(kvproto.events(P) + ".101", cleared)
    evil.publish(kvproto.events(P), cleared)
    evil.publish(kvproto.heartbeat(P) + ".101", {"type": "leave", "worker_id": 101})
    evil.subscribe(kvproto.dump(101, P), lambda s, r, p: None)
    evil.flush()
    kvt.wait_until(lambda: len(evil.errors) >= 4, what="nats-server refusals")
    assert all("Permissions Violation" in e for e in evil.errors), evil.errors
    # on its own subject but about worker 101: refused by the router
    evil.publish(kvproto.events(P) + ".102", cleared)
    evil.publish(kvproto.heartbeat(P) + ".102", {"type": "leave", "worker_id": 101})
    evil.flush()
    st = ing.wait(lambda s: s["rejected"] >= 2, what="router refusals")
    rec = ing.worker(101, st=st)
    assert rec["state"] == "live" and rec["blocks"] == 4 and rec["events"] == events
    # no user: no connection at all
    with pytest.raises(RuntimeError):
        Nats(nats.port)
    evil.close()


ERR_NGINX = """
    kvroute_zone kv 16m;
    kvroute_events %(url)s zone=kv %(extra)s;
    upstream llm {
        zone llm 64k;
        kvroute zone=kv mode=events;
        server 127.0.0.1:9;
    }
    server {
        listen 127.0.0.1:%%(port)s;
        location / { kvroute_upstream llm; proxy_pass http://llm; }
        location = /kvroute/status { kvroute_status; }
    }
"""


def error_log_shows(stack, url, extra, expect, absent=()):
    ng = stack.nginx(ERR_NGINX % {"url": url, "extra": extra})
    kvt.wait_until(lambda: any(e in ng.log() for e in expect), timeout=15,
                   what="%s in error.log" % (expect,))
    for a in absent:
        assert a not in ng.log()
    ng.stop()


def test_wrong_password_reaches_error_log_without_the_password(stack):
    nats = auth_nats(stack)
    error_log_shows(stack, "nats://router:not-the-secret@127.0.0.1:%d" % nats.port, "",
                    ["Authorization Violation", "authorization violation"],
                    absent=["not-the-secret"])


def make_cert(stack):
    key = os.path.join(stack.dir, "server.key")
    crt = os.path.join(stack.dir, "server.crt")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key,
                    "-out", crt, "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return crt, key


def tls_nats(stack):
    crt, key = make_cert(stack)
    port = kvt.free_port()
    p = stack.spawn([kvt.NATS_SERVER, "-a", "127.0.0.1", "-p", str(port), "--tls",
                     "--tlscert", crt, "--tlskey", key], "nats-tls-%d.log" % port)
    kvt.wait_port(port, proc=p, what="nats-server")
    return port, crt, key


def test_tls_only_server_and_untrusted_ca_reach_error_log(stack):
    port, crt, key = tls_nats(stack)
    # plain client, TLS-only server (cnats upgrades, then cannot verify)
    error_log_shows(stack, "nats://127.0.0.1:%d" % port, "", ["SSL handshake error"])
    # TLS client that does not trust the server's (self-signed) certificate
    error_log_shows(stack, "nats://127.0.0.1:%d" % port, "tls=on", ["self-signed certificate"])
    # and with the CA it connects
    ng = stack.nginx(ERR_NGINX % {"url": "nats://127.0.0.1:%d" % port,
                                  "extra": "tls=on tls_ca=%s" % crt})

    def nats_state():
        s, _, body = kvt.request(ng.port, "GET", "/kvroute/status")
        return json.loads(body)["zones"]["kv"]["events"]["nats"]
    kvt.wait_until(lambda: nats_state() == "connected", what="TLS connection")
    ng.stop()


def test_unreadable_tls_key_is_explained(stack):
    port, crt, key = tls_nats(stack)
    os.chmod(key, 0)
    if os.access(key, os.R_OK):
        pytest.skip("running as root: every file is readable")
    error_log_shows(stack, "nats://127.0.0.1:%d" % port,
                    "tls=on tls_ca=%s tls_cert=%s tls_key=%s" % (crt, crt, key),
                    ["cannot read tls_key"])
