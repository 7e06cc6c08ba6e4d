"""Prometheus output of kvroute_status and of kvworker: real nginx
with an events zone (real nats-server, real kvworker engines) and an
approximate zone, checked with prometheus_client's parser, an
OpenMetrics-style structure check (HELP and TYPE for every family, no family
interleaved with another, no duplicate sample) and, where it is installed,
`promtool check metrics`. The JSON status must stay valid JSON whatever a
worker announced as its address."""
import json
import math
import os
import shutil
import subprocess
import sys
import zlib

import pytest
from prometheus_client.parser import text_string_to_metric_families

import kvt

sys.path.insert(0, os.path.join(kvt.TOP, "t", "lib"))
from kvfake import FakeWorker  # noqa: E402

PROMTOOL = os.environ.get("KVROUTE_PROMTOOL") or shutil.which("promtool")

CONF = """
    kvroute_zone kv 16m;
    kvroute_zone approx 16m;
    kvroute_events %(nats)s zone=kv heartbeat_timeout=30s;
    upstream llm {
        kvroute zone=kv mode=events;
        %(servers)s
    }
    upstream other {
        kvroute zone=approx;
        %(servers)s
        server 127.0.0.1:9 backup;
    }
    server {
        listen 127.0.0.1:%%(port)s;
        location /v1/ { kvroute_upstream llm; proxy_pass http://llm; }
        location /other/v1/ { kvroute_upstream other; proxy_pass http://other/v1/; }
        location = /kvroute/status { kvroute_status; }
        location = /metrics { kvroute_status prometheus; }
        location = /status.json { kvroute_status json; }
    }
"""

HOSTILE = 'evil"host\\\x01\n:1'


def ids(name, n):
    h = zlib.crc32(name.encode()) % 10000
    return [1000 + (h * 31 + i) % 30000 for i in range(n)]


def structure_errors(text):
    """What OpenMetrics parsers reject and the Prometheus text format forbids:
    samples of a family not together, a family without HELP and TYPE (or with
    two), the same series twice."""
    errors, seen_families, series = [], set(), set()
    helps, types, current = {}, {}, None
    for line in text.splitlines():
        if not line:
            continue
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            name = line.split()[2]
            d = helps if line.startswith("# HELP ") else types
            if name in d:
                errors.append("second %s for %s" % (line[:6], name))
            d[name] = line.split(None, 3)[3] if len(line.split(None, 3)) > 3 else ""
            if name != current and name in seen_families:
                errors.append("family %s interleaved" % name)
            current = name
            seen_families.add(name)
            continue
        sample = line.split("{")[0].split(" ")[0]
        family = sample
        for suffix in ("_bucket", "_sum", "_count"):
            if sample.endswith(suffix) and types.get(sample[:-len(suffix)]) == "histogram":
                family = sample[:-len(suffix)]
        if family != current:
            errors.append("sample %s outside its family block (current %s)" % (sample, current))
        if family not in helps or family not in types:
            errors.append("no HELP/TYPE for %s" % family)
        key = line.rsplit(" ", 1)[0]
        if key in series:
            errors.append("duplicate series " + key)
        series.add(key)
    return errors


def check_prometheus(text):
    assert not structure_errors(text), structure_errors(text)[:10]
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for f in families.values():
        assert f.type != "unknown", f.name
        assert f.documentation, f.name
        for s in f.samples:
            assert not math.isnan(s.value), s
    if PROMTOOL:
        r = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True,
                           text=True)
        assert r.returncode == 0, r.stdout + r.stderr
    return families


@pytest.fixture
def running(stack):
    nats = stack.nats()
    w = stack.worker(engines=2, extra=["--speedup", "50", "--nats", nats.url,
                                       "--heartbeat-ms", "200"])
    servers = "\n".join("server 127.0.0.1:%d;" % p for p in w.ports)
    ng = stack.nginx(CONF % {"nats": nats.url, "servers": servers})

    def st():
        return json.loads(kvt.request(ng.port, "GET", "/kvroute/status")[2])["zones"]

    kvt.wait_until(lambda: len([x for x in st()["kv"]["events"]["workers"]
                                if x["state"] == "live"]) == 2, timeout=20,
                   what="workers announced")
    # a worker announcing an address that breaks naive writers
    fake = FakeWorker(nats.port, 4242, address=HOSTILE, interval_ms=200)
    stack.fake = fake
    kvt.wait_until(lambda: st()["kv"]["events"]["heartbeats"] >= 3, timeout=20,
                   what="heartbeats")
    for i in range(3):
        s = kvt.post_json(ng.port, "/v1/completions",
                          {"model": "kvroute-mock", "prompt": ids("p%d" % i, 64),
                           "max_tokens": 1})[0]
        assert s == 200
        s = kvt.post_json(ng.port, "/other/v1/completions",
                          {"model": "kvroute-mock", "prompt": ids("q%d" % i, 64),
                           "max_tokens": 1})[0]
        assert s == 200
    yield ng, w
    fake.stop_heartbeats()
    fake.close()


def test_status_prometheus_is_well_formed_and_complete(running):
    ng, w = running
    s, h, body = kvt.request(ng.port, "GET", "/metrics")
    assert s == 200 and h["content-type"].startswith("text/plain; version=0.0.4")
    text = body.decode()
    fam = check_prometheus(text)

    # the same with ?format=prometheus on the JSON location
    s, _, body2 = kvt.request(ng.port, "GET", "/kvroute/status?format=prometheus")
    assert s == 200 and not structure_errors(body2.decode())

    js = json.loads(kvt.request(ng.port, "GET", "/status.json")[2])["zones"]

    def value(name, **labels):
        for sm in fam[name].samples:
            if all(sm.labels.get(k) == v for k, v in labels.items()):
                return sm.value
        raise KeyError((name, labels))

    for zone in ("kv", "approx"):
        z = js[zone]
        assert value("kvroute_mode", zone=zone, mode=z["mode"]) == 1
        assert value("kvroute_requests", zone=zone) == z["requests"]
        assert value("kvroute_threaded", zone=zone) == z["threaded"]
        # (blocks change as events land: capacity does not)
        assert value("kvroute_index_capacity_blocks", zone=zone) == z["index"]["capacity"]
        assert value("kvroute_decision_seconds", zone=zone).__class__  # present
    assert value("kvroute_index_blocks", zone="approx") == js["approx"]["index"]["blocks"]
    assert "kvroute_pending_blocks" in fam and "pending" in js["kv"]
    assert value("kvroute_events_heartbeats", zone="kv") >= 3
    assert value("kvroute_events_nats", zone="kv", nats="connected") == 1

    # every server and worker field of the JSON has its family
    server = js["kv"]["upstreams"]["llm"][0]
    for key in server:
        assert any(n.startswith("kvroute_server") and key.replace("_", "") in
                   n.replace("_", "") for n in fam), key
    for wk in js["kv"]["events"]["workers"]:
        labels = {"zone": "kv", "worker_id": str(wk["worker_id"]),
                  "dp_rank": str(wk["dp_rank"])}
        assert value("kvroute_worker_block_size", **labels) == wk["block_size"]
        assert value("kvroute_worker_state", state=wk["state"], **labels) == 1
    backup = [x for x in js["approx"]["upstreams"]["other"] if x["backup"]]
    assert backup and value("kvroute_server_backup", upstream="other",
                            server=backup[0]["server"]) == 1


def test_status_json_survives_hostile_address(running):
    ng, w = running
    for path in ("/kvroute/status", "/status.json"):
        s, h, body = kvt.request(ng.port, "GET", path)
        assert s == 200 and h["content-type"] == "application/json"
        body.decode("ascii")                # every byte outside ASCII is escaped
        js = json.loads(body)
        addrs = [x["address"] for x in js["zones"]["kv"]["events"]["workers"]]
        # the quote survives, escaped (the ingestion may clean control bytes)
        fake = [a for a in addrs if "evil" in a]
        if fake:
            assert fake[0].startswith('evil"host')
    text = kvt.request(ng.port, "GET", "/metrics")[2].decode()
    check_prometheus(text)


def test_kvworker_metrics_are_well_formed(running):
    ng, w = running
    for port in w.ports:
        s, h, body = kvt.request(port, "GET", "/metrics")
        assert s == 200
        fam = check_prometheus(body.decode())
        assert fam["kvworker_kv_blocks"].type == "gauge"
        assert "kvworker_prefix_cache_hit_rate" not in fam
        assert "kvworker_kv_blocks_total" not in body.decode()


def test_status_format_argument_is_checked(stack):
    ok, out, _ = stack.nginx_t("server { listen 127.0.0.1:%(port)s; "
                               "location = /m { kvroute_status yaml; } }")
    assert not ok and 'invalid format "yaml" in "kvroute_status"' in out
    assert "nginx.conf:" in out
