"""A test stand-in for a worker speaking docs/PROTOCOL.md over NATS.

FakeWorker publishes KV events in Dynamo's exact RouterEvent JSON,
announces and heartbeats, and answers dump requests from what it holds,
so ingestion tests need no kvworker. Tests can make it lose events
(skip=True), stop heartbeating, or ignore dumps.
"""
import random
import threading
import time

from kvnats import Nats
import kvproto

PREFIX = kvproto.DEFAULT_PREFIX


class FakeWorker:
    def __init__(self, port, worker_id, dp_rank=0, address=None, announce=True,
                 interval_ms=1000, prefix=PREFIX):
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        # distinct per id: a router takes a new id at a known address and
        # rank for a restarted worker and drops the old id (docs/SECURITY.md)
        self.address = address or "127.0.0.9:%d" % (1 + worker_id % 65535)
        self.prefix = prefix
        self.instance_id = random.getrandbits(63) | 1
        self.interval_ms = interval_ms
        self.event_id = 0
        self.blocks = {}            # block_hash -> (parent or None, tokens_hash), insertion order
        self.lock = threading.Lock()
        self.answer_dumps = True
        self.dumps_served = 0
        self.beating = False
        self.connect(port)
        if announce:
            self.heartbeat("announce")
            self.start_heartbeats()

    def connect(self, port):
        """(Re)connects, e.g. after nats-server restarted."""
        self.nc = Nats(port)
        self.nc.subscribe(kvproto.dump(self.worker_id, self.prefix), self._on_dump)
        self.nc.subscribe(kvproto.discover(self.prefix),
                          lambda s, r, p: self.heartbeat("announce"))
        self.nc.flush()

    # --- events -----------------------------------------------------------
    def _event(self, data, skip=False):
        with self.lock:
            self.event_id += 1
            ev = {"worker_id": self.worker_id, "storage_tier": "device",
                  "event": {"event_id": self.event_id, "data": data, "dp_rank": self.dp_rank}}
        if not skip:
            self.nc.publish(kvproto.events(self.prefix), ev)
        return ev

    def store(self, chain, parent=None, skip=False):
        """chain: list of (block_hash, tokens_hash); parent: block_hash or None."""
        with self.lock:
            p = parent
            for bh, th in chain:
                self.blocks[bh] = (p, th)
                p = bh
        return self._event({"stored": {"parent_hash": parent, "start_position": None,
                                       "blocks": [{"block_hash": bh, "tokens_hash": th,
                                                   "mm_extra_info": None} for bh, th in chain]}},
                           skip)

    def remove(self, hashes, skip=False):
        with self.lock:
            for h in hashes:
                self.blocks.pop(h, None)
        return self._event({"removed": {"block_hashes": list(hashes)}}, skip)

    def clear(self, skip=False):
        with self.lock:
            self.blocks.clear()
        return self._event("cleared", skip)

    # --- heartbeat --------------------------------------------------------
    def heartbeat(self, kind="heartbeat"):
        self.nc.publish(kvproto.heartbeat(self.prefix), {
            "type": kind, "worker_id": self.worker_id, "dp_rank": self.dp_rank,
            "instance_id": self.instance_id, "address": self.address, "model": "fake",
            "block_size": 16, "num_blocks": 1024, "last_event_id": self.event_id,
            "interval_ms": self.interval_ms, "ts_ms": int(time.time() * 1000),
            "load": {"active_prefill_tokens": 0, "active_decode_blocks": 0,
                     "kv_used_blocks": len(self.blocks), "waiting": 0, "running": 1,
                     "max_num_batched_tokens": 8192, "max_num_seqs": 256}})

    def leave(self):
        """Deregisters, as kvworker does on a graceful shutdown."""
        self.beating = False
        self.heartbeat("leave")
        self.nc.flush()

    def start_heartbeats(self):
        if self.beating:
            return
        self.beating = True

        def loop():
            while self.beating:
                time.sleep(self.interval_ms / 1000.0)
                if self.beating:
                    try:
                        self.heartbeat()
                    except OSError:
                        pass        # NATS down: keep beating, a test may reconnect
        threading.Thread(target=loop, daemon=True).start()

    def stop_heartbeats(self):
        self.beating = False

    # --- dump -------------------------------------------------------------
    def _on_dump(self, subject, reply, payload):
        if not self.answer_dumps or not reply:
            return
        with self.lock:
            items = [[p, bh, th] for bh, (p, th) in self.blocks.items()]
            last = self.event_id
        chunks = [items[i:i + 4096] for i in range(0, len(items), 4096)] or [[]]
        for n, c in enumerate(chunks):
            self.nc.publish(reply, {"worker_id": self.worker_id, "dp_rank": self.dp_rank,
                                    "instance_id": self.instance_id, "last_event_id": last,
                                    "block_size": 16, "chunk": n, "chunks": len(chunks),
                                    "blocks": c})
        self.dumps_served += 1

    def close(self):
        self.beating = False
        self.nc.close()
