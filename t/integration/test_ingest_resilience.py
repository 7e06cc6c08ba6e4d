"""Ingestion through NATS outages and helper restarts: reconnect + resync
after nats-server is killed and restarted, and a JetStream durable
consumer replaying what was published while the ingester was down."""
import json
import socket
import threading
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


def first_event_through(ing, pub, event):
    """The stream exists once the ingester has set it up: publish until an
    event comes through."""
    ing.wait(lambda s: s["nats"] == "connected", what="connected")
    deadline = time.time() + 30
    while time.time() < deadline:
        pub.publish(SUBJ, event)
        pub.flush()
        try:
            ing.wait(lambda s: s["events"] >= 1, timeout=0.5, what="first event")
            return
        except AssertionError:
            continue
    raise AssertionError("no event came through")


def test_jetstream_batch_of_a_helper_gone_mid_batch_is_not_lost(stack):
    """A helper that fetched a batch and exited before applying it (a
    reload's old helper) leaves it unacknowledged; its successor's acks of
    later messages must not acknowledge it: it comes to the successor."""
    nats = stack.nats(jetstream=True)
    js = ["--jetstream", "KVEVENTS", "--durable", "kvroute-mid"]
    ing = kvingest.Ingest(stack, nats.url, extra=js)
    pub = Nats(nats.port)
    first_event_through(ing, pub, dynamo_event(9, 1, 100, 1000))
    ing.stop()

    pub.publish(SUBJ, dynamo_event(9, 2, 200, 2000))
    pub.publish(SUBJ, dynamo_event(9, 3, 300, 3000))
    pub.flush()
    gone = kvingest.Ingest(stack, nats.url, extra=js + ["--test-exit-after-fetch"],
                           log="kvingest-gone.log")
    assert gone.proc.wait(timeout=30) == 3          # fetched 2 and 3, applied nothing

    ing2 = kvingest.Ingest(stack, nats.url, extra=js, log="kvingest2.log")
    pub.publish(SUBJ, dynamo_event(9, 4, 400, 4000))
    pub.flush()
    st = ing2.wait(lambda s: ing2.worker(9, st=s) is not None
                   and ing2.worker(9, st=s)["last_event_applied"] == 4, what="event 4")
    ing2.wait(lambda s: ing2.match([2000]) == {9: 1} and ing2.match([3000]) == {9: 1},
              what="the gone helper's batch applied")
    st = ing2.stats()
    assert st["gaps"] == 0 and st["duplicates"] == 0, json.dumps(st)
    assert ing2.match([1000]) == {}                 # acked before: not delivered again
    pub.close()


def js_api(nc, what, body=""):
    return nc.request_all("$JS.API." + what, body, lambda m: len(m) > 0)[0]


def test_jetstream_ack_all_consumer_of_an_older_kvroute_is_made_explicit(stack):
    """A durable an older kvroute created acks all before the one acked;
    its ack policy cannot be changed in place: it is created again, from
    its ack floor, with explicit acks."""
    nats = stack.nats(jetstream=True)
    ing = kvingest.Ingest(stack, nats.url, extra=["--jetstream", "KVEVENTS",
                                                  "--durable", "another"])
    pub = Nats(nats.port)
    first_event_through(ing, pub, dynamo_event(9, 1, 100, 1000))     # makes the stream
    ing.stop()
    # the older kvroute's consumer (as it made it), which applied and acked event 1
    old = {"stream_name": "KVEVENTS",
           "config": {"durable_name": "kvroute-old", "ack_policy": "all",
                      "deliver_policy": "all", "filter_subject": SUBJ,
                      "max_ack_pending": 65536}}
    assert "error" not in js_api(pub, "CONSUMER.DURABLE.CREATE.KVEVENTS.kvroute-old",
                                 old).json()
    m = js_api(pub, "CONSUMER.MSG.NEXT.KVEVENTS.kvroute-old", {"batch": 1})
    assert b'"event_id":1' in m.data
    pub.publish(m.reply, "+ACK")
    pub.publish(SUBJ, dynamo_event(9, 2, 200, 2000))
    pub.flush()

    ing2 = kvingest.Ingest(stack, nats.url, extra=["--jetstream", "KVEVENTS",
                                                   "--durable", "kvroute-old"],
                           log="kvingest2.log")
    ing2.wait(lambda s: ing2.worker(9, st=s) is not None
              and ing2.worker(9, st=s)["last_event_applied"] == 2, what="event 2")
    assert ing2.match([2000]) == {9: 1} and ing2.match([1000]) == {}
    info = js_api(pub, "CONSUMER.INFO.KVEVENTS.kvroute-old").json()
    assert info["config"]["ack_policy"] == "explicit", info
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


def dynamo_removed(wid, eid, bh):
    return ('{"worker_id":%d,"event":{"event_id":%d,"data":{"removed":{"block_hashes":[%d]}},'
            '"dp_rank":0}}' % (wid, eid, bh))


class Relay:
    """A TCP relay to a local port whose connections can be cut at once: a
    network blip, the server staying up."""

    def __init__(self, port):
        self.to = port
        self.lsock = socket.socket()
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(16)
        self.port = self.lsock.getsockname()[1]
        self.socks = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                a, _ = self.lsock.accept()
            except OSError:
                return
            try:
                b = socket.create_connection(("127.0.0.1", self.to))
            except OSError:         # the server is down: the client retries
                a.close()
                continue
            with self.lock:
                self.socks += [a, b]
            threading.Thread(target=self._pump, args=(a, b), daemon=True).start()
            threading.Thread(target=self._pump, args=(b, a), daemon=True).start()

    @staticmethod
    def _pump(src, dst):
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        for sk in (src, dst):
            try:
                sk.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self):
        with self.lock:
            socks, self.socks = self.socks, []
        for sk in socks:
            try:
                sk.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sk.close()

    def close(self):
        self.lsock.close()
        self.cut()


@pytest.mark.parametrize("disconnect", ["server-restart", "network-blip"])
def test_jetstream_fetch_cut_by_a_disconnect_comes_again_in_order(stack, disconnect):
    """A fetch whose reply a NATS disconnect cut short leaves its messages
    delivered and unacknowledged in a helper that stays up. Once NATS is
    back they must come before anything newer: redelivered only after the
    ack wait, behind newer events, a worker without dumps (Dynamo) would
    lose them as duplicates."""
    nats = stack.nats(jetstream=True)
    port = nats.port
    relay = Relay(port)
    pub = Nats(port)
    stream = {"name": "KVEVENTS", "subjects": [SUBJ, SUBJ + ".*"], "storage": "file"}
    assert "error" not in js_api(pub, "STREAM.CREATE.KVEVENTS", stream).json()
    pub.publish(SUBJ, dynamo_event(9, 5, 100, 1000))    # stores A
    pub.publish(SUBJ, dynamo_event(9, 6, 200, 2000))    # stores B
    pub.flush()
    ing = kvingest.Ingest(stack, "nats://127.0.0.1:%d" % relay.port,
                          extra=["--jetstream", "KVEVENTS", "--durable", "kvroute-cut",
                                 "--test-drop-fetch-once"])
    deadline = time.time() + 30
    while "test: dropped a fetched batch of 2" not in ing.read_log():
        assert time.time() < deadline, ing.read_log()
        time.sleep(0.05)
    assert ing.stats()["events"] == 0
    pub.close()

    # the disconnect that cut the fetch
    if disconnect == "server-restart":
        nats.kill()
        nats.wait()
        ing.wait(lambda s: s["nats"] != "connected", what="disconnected")
        stack.nats(jetstream=True, port=port)   # same store: the consumer's state kept
    else:
        relay.cut()
    ing.wait(lambda s: s["nats"] == "connected" and s["disconnects"] >= 1
             and s["connects"] >= 2, what="reconnected")
    pub = Nats(port)
    pub.publish(SUBJ, dynamo_removed(9, 7, 100))        # removes A
    pub.flush()
    st = ing.wait(lambda s: ing.worker(9, st=s) is not None
                  and ing.worker(9, st=s)["last_event_applied"] == 7, what="event 7")
    w = ing.worker(9, st=st)
    assert ing.match([2000]) == {9: 1}, json.dumps(st)      # the cut batch's B came
    assert ing.match([1000]) == {}, json.dumps(st)          # A stored, then removed
    assert w["events"] == 3 and w["gaps"] == 0 and w["duplicates"] == 0, json.dumps(st)
    pub.close()
    relay.close()
