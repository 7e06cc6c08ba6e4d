"""Forged NATS messages without publisher authentication (docs/SECURITY.md, section 1):
each attack from the adversarial pass, replayed with a real nats-server and
tools/kvingest, must cost the victim at most one resync (docs/SECURITY.md)."""
import json

import pytest

import kvingest
from kvfake import PREFIX, FakeWorker
from kvnats import Nats
import kvproto

ok, why = kvingest.available()
pytestmark = pytest.mark.skipif(not ok, reason="kvingest unavailable: %s" % why)

SUBJ = kvproto.events(PREFIX)
BIG = 9223372036854775807


def chain(base, n):
    return [(base + i, base * 7 + i + 1) for i in range(n)]


def live_worker(stack, wid=77, interval_ms=500):
    nats = stack.nats()
    ing = kvingest.Ingest(stack, nats.url, extra=["--stale-lag", "500"])
    ing.wait(lambda s: s["nats"] == "connected", what="connected")
    w = FakeWorker(nats.port, wid, interval_ms=interval_ms)
    ing.wait(lambda s: s["dumps"] >= 1, what="first resync")
    w.store(chain(1000, 3))
    ing.wait(lambda s: ing.worker(wid, st=s)["blocks"] == 3, what="stored")
    return nats, ing, w, Nats(nats.port)


def forged(wid, eid, data):
    return json.dumps({"worker_id": wid, "storage_tier": "device",
                       "event": {"event_id": eid, "data": data, "dp_rank": 0}})


def test_forged_cleared_far_ahead_is_rejected(stack):
    """The one-message attack: a `cleared` with event id 2^63-1 used to hide
    the worker until it restarted (every later event a "duplicate")."""
    nats, ing, w, evil = live_worker(stack)
    evil.publish(SUBJ, forged(77, BIG, "cleared"))
    evil.flush()
    st = ing.wait(lambda s: s["rejected"] >= 1, what="forged event rejected")
    assert ing.worker(77, st=st)["blocks"] == 3
    # the worker's real events keep applying
    # the index's block count moves while the event applies and its id is
    # recorded after it ends, so a status read between the two sees the new
    # blocks with the old id: wait for both
    w.store(chain(5000, 2))
    st = ing.wait(lambda s: ing.worker(77, st=s)["blocks"] == 5
                  and ing.worker(77, st=s)["last_event_applied"] == w.event_id
                  and ing.worker(77, st=s)["state"] == "live", what="real events after forgery")
    assert ing.match([5000 * 7 + 1]) == {77: 1}
    w.close()


def test_forged_next_id_is_undone_by_one_resync(stack):
    """A forgery with the plausible next id is applied (nothing can tell it
    from the real one without auth), but the real event with the same id
    then shows two events with one id: the worker is resynced and the index
    is exact again."""
    nats, ing, w, evil = live_worker(stack)
    dumps = ing.stats()["dumps"]
    evil.publish(SUBJ, forged(77, w.event_id + 1, "cleared"))
    evil.flush()
    ing.wait(lambda s: ing.worker(77, st=s)["blocks"] == 0, what="forged cleared applied")
    w.store(chain(6000, 2))                 # the real event with the same id
    st = ing.wait(lambda s: s["dumps"] > dumps and ing.worker(77, st=s)["blocks"] == 5
                  and ing.worker(77, st=s)["state"] == "live", timeout=10,
                  what="resynced to the truth")
    assert ing.match([1000 * 7 + 1]) == {77: 1} and ing.match([6000 * 7 + 1]) == {77: 1}
    w.close()


def test_forged_event_on_idle_worker_is_undone(stack):
    """A phantom block forged with the next id for a worker that publishes
    nothing more: heartbeats never announce that id, so within two heartbeat
    intervals the worker is resynced and the phantom is gone."""
    nats, ing, w, evil = live_worker(stack)
    evil.publish(SUBJ, forged(77, w.event_id + 1, {"stored": {
        "parent_hash": None, "start_position": None,
        "blocks": [{"block_hash": 424242, "tokens_hash": 4242, "mm_extra_info": None}]}}))
    evil.flush()
    ing.wait(lambda s: ing.match([4242]) == {77: 1}, what="phantom applied")
    st = ing.wait(lambda s: ing.match([4242]) == {} and ing.worker(77, st=s)["state"] == "live"
                  and ing.worker(77, st=s)["blocks"] == 3, timeout=10, what="phantom undone")
    assert st["rejected"] >= 1
    # and a forged gap (id + 3) buffered through the resync is dropped, not looped on
    evil.publish(SUBJ, forged(77, w.event_id + 3, "cleared"))
    evil.flush()
    st = ing.wait(lambda s: s["rejected"] >= 2 and ing.worker(77, st=s)["state"] == "live",
                  timeout=10, what="gap forgery dropped")
    assert ing.worker(77, st=st)["blocks"] == 3
    w.store(chain(7000, 1))
    ing.wait(lambda s: ing.worker(77, st=s)["blocks"] == 4, what="real event after")
    w.close()


def test_forged_dump_reply_is_ignored(stack):
    """Answering the helper's dump request first with last_event_id 2^62 (or
    another instance's or worker's chunk) used to freeze the worker; such
    replies are now ignored and the real reply behind them is applied."""
    nats = stack.nats()
    ing = kvingest.Ingest(stack, nats.url)
    ing.wait(lambda s: s["nats"] == "connected", what="connected")
    evil = Nats(nats.port)
    bad = [
        {"last_event_id": 1 << 62},
        {"instance_id": 12345},
        {"worker_id": 78},
    ]

    def answer(subject, reply, payload):
        for b in bad:
            msg = {"worker_id": 77, "dp_rank": 0, "instance_id": w.instance_id,
                   "last_event_id": 0, "block_size": 16, "chunk": 0, "chunks": 1,
                   "blocks": [[None, 999, 9999]]}
            msg.update(b)
            evil.publish(reply, msg)
        evil.publish(reply, "{broken")
    evil.subscribe(kvproto.dump(77, PREFIX), answer)
    evil.flush()
    w = FakeWorker(nats.port, 77, interval_ms=500, announce=False)
    w.answer_dumps = False              # the forger answers first
    w.heartbeat("announce")
    w.start_heartbeats()
    ing.wait(lambda s: s["rejected"] >= 4, what="forged replies rejected")
    assert ing.worker(77)["state"] == "resyncing"
    w.answer_dumps = True               # the real reply, on the retry
    ing.wait(lambda s: s["dumps"] >= 1 and ing.worker(77, st=s)["state"] == "live",
             timeout=10, what="real dump applied")
    assert ing.match([9999]) == {}
    w.store(chain(1000, 2))
    ing.wait(lambda s: ing.worker(77, st=s)["blocks"] == 2, what="events after the dump")
    w.close()


def test_forged_heartbeat_load_is_clamped(stack):
    """A heartbeat claiming absurd load is bounded by the worker's own
    capacity (num_blocks x block_size x 4 prefill tokens, 2^20 queued)."""
    nats, ing, w, evil = live_worker(stack)
    evil.publish(kvproto.heartbeat(PREFIX), {
        "type": "heartbeat", "worker_id": 77, "dp_rank": 0, "instance_id": w.instance_id,
        "address": w.address, "block_size": 16, "num_blocks": 1024,
        "last_event_id": w.event_id, "interval_ms": 500,
        "load": {"active_prefill_tokens": BIG, "running": BIG, "waiting": BIG}})
    evil.flush()
    st = ing.wait(lambda s: ing.worker(77, st=s)["running"] > 1, what="forged load seen")
    rec = ing.worker(77, st=st)
    assert rec["running"] <= 1 << 20
    assert rec["active_prefill_tokens"] <= 4 * 1024 * 16
    w.close()


def test_dp_rank_beyond_32_bits_rejected_like_a_heartbeat(stack):
    """An event's dp_rank used to be truncated to 32 bits (2^32 became rank
    0, another worker's slot) while a heartbeat with it was rejected."""
    nats = stack.nats()
    ing, pub = kvingest.start_ready(stack, nats)
    ev = {"worker_id": 99, "event": {"event_id": 1, "dp_rank": 1 << 32, "data": {"stored": {
        "parent_hash": None, "blocks": [{"block_hash": 1, "tokens_hash": 2}]}}}}
    pub.publish(SUBJ, json.dumps(ev))
    pub.publish(kvproto.heartbeat(PREFIX), {"worker_id": 99, "dp_rank": 1 << 32})
    pub.flush()
    st = ing.wait(lambda s: s["decode_errors"] >= 2, what="both rejected")
    assert st["workers"] == [] and ing.match([2]) == {}
    pub.close()
