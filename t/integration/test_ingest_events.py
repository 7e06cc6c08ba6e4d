"""Event ingestion with a real nats-server and tools/kvingest: Dynamo-format
events from a publisher that is not kvworker, malformed input, duplicates,
gaps resynced through a dump, heartbeat timeouts."""
import pytest

import kvingest
from kvfake import PREFIX, FakeWorker
import kvproto

ok, why = kvingest.available()
pytestmark = pytest.mark.skipif(not ok, reason="kvingest unavailable: %s" % why)

SUBJ = kvproto.events(PREFIX)


def chain(base, n):
    """n blocks: (block_hash, tokens_hash) with distinct small values."""
    return [(base + i, base * 7 + i + 1) for i in range(n)]


def test_dynamo_events_unannounced(stack):
    nats = stack.nats()
    ing, pub = kvingest.start_ready(stack, nats)
    wid = 7587886123456789
    # Dynamo's exact JSON: one event, then a batch (array), signed older form
    pub.publish(SUBJ, '{"worker_id":%d,"storage_tier":"device","event":{"event_id":1,"data":'
                '{"stored":{"parent_hash":null,"start_position":null,"blocks":[{"block_hash":'
                '101,"tokens_hash":4117275816416024698,"mm_extra_info":null},{"block_hash":102,'
                '"tokens_hash":55,"mm_extra_info":null}]}},"dp_rank":0}}' % wid)
    pub.publish(SUBJ, '[{"worker_id":%d,"storage_tier":"device","event":{"event_id":2,"data":'
                '{"stored":{"parent_hash":102,"start_position":null,"blocks":[{"block_hash":103,'
                '"tokens_hash":56,"mm_extra_info":null}]}},"dp_rank":0}},'
                '{"worker_id":%d,"storage_tier":"host","event":{"event_id":3,"data":"cleared",'
                '"dp_rank":0}}]' % (wid, wid))
    pub.publish(SUBJ, "{not json")
    pub.publish(SUBJ, '{"worker_id":1}')
    pub.flush()
    st = ing.wait(lambda s: s["events"] >= 2 and s["decode_errors"] >= 2, what="events applied")
    w = ing.worker(wid, st=st)
    assert w["blocks"] == 3 and w["announced"] == 0 and w["state"] == "live"
    assert ing.match([4117275816416024698]) == {wid: 1}
    # duplicate dropped, then removal, then cleared
    pub.publish(SUBJ, '{"worker_id":%d,"event":{"event_id":2,"data":{"removed":'
                '{"block_hashes":[103]}},"dp_rank":0}}' % wid)
    pub.publish(SUBJ, '{"worker_id":%d,"event":{"event_id":3,"data":{"removed":'
                '{"block_hashes":[103]}},"dp_rank":0}}' % wid)
    pub.flush()
    st = ing.wait(lambda s: ing.worker(wid, st=s)["blocks"] == 2, what="removal")
    assert st["duplicates"] == 1
    pub.publish(SUBJ, '{"worker_id":%d,"event":{"event_id":4,"data":"cleared","dp_rank":0}}'
                % wid)
    pub.flush()
    ing.wait(lambda s: ing.worker(wid, st=s)["blocks"] == 0, what="cleared")
    final = ing.stop()
    assert final["decode_errors"] == 2
    pub.close()


def test_gap_resyncs_through_dump(stack):
    nats = stack.nats()
    ing = kvingest.Ingest(stack, nats.url)
    ing.wait(lambda s: s["nats"] == "connected", what="connected")
    w = FakeWorker(nats.port, 42, address="127.0.0.1:8001")
    # the announce makes the helper resync at once (empty dump)
    ing.wait(lambda s: s["dumps"] >= 1, what="first resync")
    w.store(chain(1000, 3))
    ing.wait(lambda s: ing.worker(42, st=s)["blocks"] == 3, what="stored")
    w.store(chain(2000, 4), skip=True)          # lost on the way
    w.store(chain(3000, 2))                     # gap: event 3 after 1
    st = ing.wait(lambda s: s["gaps"] >= 1 and s["dumps"] >= 2
                  and ing.worker(42, st=s)["blocks"] == 9, what="gap resynced")
    rec = ing.worker(42, st=st)
    assert rec["state"] == "live" and rec["last_event_applied"] == 3
    assert rec["address"] == "127.0.0.1:8001"
    assert ing.match([2000 * 7 + 1]) == {42: 1}
    # later events apply normally after the dump
    w.remove([3000, 3001])
    ing.wait(lambda s: ing.worker(42, st=s)["blocks"] == 7, what="removal after resync")
    w.close()


def test_heartbeat_timeout_drops_blocks(stack):
    nats = stack.nats()
    ing = kvingest.Ingest(stack, nats.url, extra=["--heartbeat-timeout", "3000"])
    w = FakeWorker(nats.port, 5, interval_ms=300)
    ing.wait(lambda s: s["dumps"] >= 1, what="first resync")
    w.store(chain(10, 5))
    ing.wait(lambda s: ing.worker(5, st=s)["blocks"] == 5, what="stored")
    w.stop_heartbeats()
    st = ing.wait(lambda s: ing.worker(5, st=s)["state"] == "gone", timeout=30, what="gone")
    assert ing.worker(5, st=st)["blocks"] == 0 and st["timeouts"] == 1
    # it comes back: a heartbeat brings a resync with its blocks
    w.start_heartbeats()
    ing.wait(lambda s: ing.worker(5, st=s)["state"] == "live"
             and ing.worker(5, st=s)["blocks"] == 5, what="back")
    w.close()
