"""Ingestion through NATS outages and helper restarts: reconnect + resync
after nats-server is killed and restarted, and a JetStream durable
consumer replaying what was published while the ingester was down."""
import json
import time

import pytest

import kvingest
from kvfake import PREFIX, FakeWorker
from kvnats import Nats
import kvproto

ok, why = kvingest.available()
pytestmark = pytest.mark.skipif(not ok, reason="kvingest unavailable: %s" % why)

SUBJ = kvproto.events(PREFIX)


def test_nats_restart_reconnects_and_resyncs(stack):
    nats = stack.nats()
    port = nats.port
    ing = kvingest.Ingest(stack, nats.url, extra=["--stale-lag", "500"])
    w = FakeWorker(port, 77, interval_ms=500)
    ing.wait(lambda s: s["dumps"] >= 1, what="first resync")
    w.store([(1, 11), (2, 12)])
    ing.wait(lambda s: ing.worker(77, st=s)["blocks"] == 2, what="stored")

    nats.kill()
    nats.wait()
    ing.wait(lambda s: s["nats"] != "connected", what="disconnected")
    # down past the stale lag: the worker is stale (load-only), its blocks kept
    st = ing.wait(lambda s: ing.worker(77, st=s)["state"] == "stale", what="stale")
    assert ing.worker(77, st=st)["blocks"] == 2
    w.store([(3, 13)], parent=2, skip=True)     # published into the void
    w.store([(4, 14)], skip=True)
    stack.nats(port=port)
    w.connect(port)
    st = ing.wait(lambda s: s["nats"] == "connected" and s["connects"] >= 2
                  and ing.worker(77, st=s)["blocks"] == 4
                  and ing.worker(77, st=s)["last_event_applied"] == 3,
                  timeout=30, what="reconnected and resynced")
    assert st["disconnects"] >= 1 and st["dumps"] >= 2
    assert ing.match([14]) == {77: 1}
    w.close()


def test_nats_down_at_start(stack):
    port = kvingest.kvt.free_port()
    ing = kvingest.Ingest(stack, "nats://127.0.0.1:%d" % port)
    st = ing.stats()                            # answers while NATS is down
    assert st["nats"] != "connected"
    stack.nats(port=port)
    ing.wait(lambda s: s["nats"] == "connected", timeout=30, what="late connect")


def dynamo_event(wid, eid, bh, th):
    return ('{"worker_id":%d,"storage_tier":"device","event":{"event_id":%d,"data":{"stored":'
            '{"parent_hash":null,"start_position":null,"blocks":[{"block_hash":%d,'
            '"tokens_hash":%d,"mm_extra_info":null}]}},"dp_rank":0}}' % (wid, eid, bh, th))


def test_jetstream_durable_replays_missed_events(stack):
    nats = stack.nats(jetstream=True)
    js = ["--jetstream", "KVEVENTS", "--durable", "kvroute-test"]
    ing = kvingest.Ingest(stack, nats.url, extra=js)
    pub = Nats(nats.port)
    # the stream exists once the ingester has set it up: publish until an
    # event comes through
    ing.wait(lambda s: s["nats"] == "connected", what="connected")
    deadline = time.time() + 30
    while time.time() < deadline:
        pub.publish(SUBJ, dynamo_event(9, 1, 100, 1000))
        pub.flush()
        try:
            ing.wait(lambda s: s["events"] >= 1, timeout=0.5, what="first event")
            break
        except AssertionError:
            continue
    pub.publish(SUBJ, dynamo_event(9, 2, 200, 2000))
    pub.flush()
    ing.wait(lambda s: ing.worker(9, st=s) and ing.worker(9, st=s)["last_event_applied"] == 2,
             what="two events")
    ing.stop()

    # published while no ingester runs: the stream keeps them for the durable
    pub.publish(SUBJ, dynamo_event(9, 3, 300, 3000))
    pub.publish(SUBJ, dynamo_event(9, 4, 400, 4000))
    pub.flush()
    ing2 = kvingest.Ingest(stack, nats.url, extra=js, log="kvingest2.log")
    st = ing2.wait(lambda s: ing2.worker(9, st=s) is not None
                   and ing2.worker(9, st=s)["last_event_applied"] == 4,
                   timeout=30, what="replayed")
    assert ing2.match([3000]) == {9: 1} and ing2.match([4000]) == {9: 1}, json.dumps(st)
    assert ing2.match([1000]) == {}             # acked before: not delivered again
    assert st["duplicates"] == 0
    pub.close()


def test_user_password_and_token(stack):
    for server_args, good, bad in (
            (["--user", "kv", "--pass", "s3cret"], ["--user", "kv", "--password", "s3cret"],
             ["--user", "kv", "--password", "wrong"]),
            (["--auth", "tok3n"], ["--token", "tok3n"], ["--token", "nope"])):
        port = kvingest.kvt.free_port()
        p = stack.spawn([kvingest.kvt.NATS_SERVER, "-a", "127.0.0.1", "-p", str(port)]
                        + server_args, "nats-auth-%d.log" % port)
        kvingest.kvt.wait_port(port, proc=p)
        url = "nats://127.0.0.1:%d" % port
        ok_ing = kvingest.Ingest(stack, url, extra=good, log="good-%d.log" % port)
        bad_ing = kvingest.Ingest(stack, url, extra=bad, log="bad-%d.log" % port)
        ok_ing.wait(lambda s: s["nats"] == "connected", what="authenticated connect")
        # refused: the server closes the connection (then it retries, alive)
        bad_ing.wait(lambda s: s["nats"] == "closed", what="the bad credentials refused")
        assert bad_ing.stats()["connects"] == 0
