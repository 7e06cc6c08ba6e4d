"""A KV event publisher written from vLLM's published schema
(vllm/distributed/kv_events.py, ZmqEventPublisher), over real libzmq sockets:

  PUB     multipart [topic, seq (8-byte big-endian, from 0), payload]
  ROUTER  replay: a request [identity, b"", start_seq (8 bytes BE)] gets one
          reply [identity, b"", seq, payload] per buffered message with
          seq >= start_seq, then [identity, b"", -1 (8 bytes BE, signed), b""]

payload = msgpack KVEventBatch in one of three forms (form=):
  "array"   vLLM 0.10: [ts, events, data_parallel_rank?], events tagged arrays
              ["BlockStored", block_hashes, parent_block_hash, token_ids,
               block_size, lora_id, medium, lora_name(, extra_keys, group_idx,
               kv_cache_spec_kind)]
              ["BlockRemoved", block_hashes, medium(, group_idx)]
              ["AllBlocksCleared"]
  "sglang"  SGLang (and vLLM 0.9): the same arrays without medium and what
            follows: ["BlockStored", ..., block_size, lora_id],
            ["BlockRemoved", block_hashes]
  "map"     newer vLLM (no msgspec array_like): {"ts", "events",
            "data_parallel_rank"}, events {"type": "BlockStored", ...} by
            name, fields left at their defaults omitted

A hybrid model's events name their KV cache group (group=(idx, kind)).

Block hashes are bytes (newer vLLM: SHA-256 of parent + tokens) or ints
(older vLLM: a signed 64-bit Python hash), as hash_kind says.

Also a small CLI for benchmarks: python vllm_pub.py --help.
"""
import argparse
import collections
import hashlib
import struct
import threading
import time

import msgpack
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class VllmPublisher:
    def __init__(self, port=None, replay_port=None, topic="", block_size=16,
                 hash_kind="bytes", buffer_steps=10000, dp_rank=None, replay=True,
                 form="array", replay_held=False, xpub=False):
        assert form in ("array", "sglang", "map")
        self.form = form
        self.ctx = zmq.Context()
        self.topic = topic.encode()
        self.block_size = block_size
        self.hash_kind = hash_kind
        self.dp_rank = dp_rank
        self.seq = 0
        self.buffer = collections.deque(maxlen=buffer_steps)
        self.lock = threading.Lock()
        self.replay_gate = threading.Event()     # clear it to hold replies back
        if not replay_held:                      # held from the start: set it to answer
            self.replay_gate.set()
        self.replay_requests = []
        self.pub = self.ctx.socket(zmq.XPUB if xpub else zmq.PUB)   # XPUB: wait_subscribed
        if xpub:
            self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)    # every subscriber's, not the first's
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 0)
        self.port = self._bind(self.pub, port)
        self.router = None
        self.replay_port = None
        self._stop = False
        self.thread = None
        if replay:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.setsockopt(zmq.SNDHWM, 0)
            self.replay_port = self._bind(self.router, replay_port)
            self.thread = threading.Thread(target=self._serve_replay, daemon=True)
            self.thread.start()

    def wait_subscribed(self, timeout=15.0):
        """(xpub=True) Returns once a subscriber's subscription has arrived:
        from then on nothing published is dropped for want of one."""
        if not self.pub.poll(int(timeout * 1000)):
            raise TimeoutError("no subscriber within %.1fs" % timeout)
        while self.pub.recv()[:1] != b"\x01":
            if not self.pub.poll(int(timeout * 1000)):
                raise TimeoutError("no subscriber within %.1fs" % timeout)

    @staticmethod
    def _bind(sock, port):
        if port:
            sock.bind("tcp://127.0.0.1:%d" % port)
            return port
        return sock.bind_to_random_port("tcp://127.0.0.1")

    @property
    def url(self):
        return "zmq://127.0.0.1:%d" % self.port

    @property
    def replay_url(self):
        return "zmq://127.0.0.1:%d" % self.replay_port

    # --- replay (vLLM's _service_replay) ------------------------------------

    def _serve_replay(self):
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        while not self._stop:
            if not poller.poll(50):
                continue
            frames = self.router.recv_multipart()
            if len(frames) != 3:
                continue
            ident, _, start = frames
            start = int.from_bytes(start, "big")
            self.replay_requests.append(start)
            self.replay_gate.wait()
            with self.lock:
                todo = [(s, p) for s, p in self.buffer if s >= start]
            for s, p in todo:
                self.router.send_multipart([ident, b"", s.to_bytes(8, "big"), p])
            self.router.send_multipart([ident, b"", END_SEQ, b""])

    # --- events ---------------------------------------------------------------

    def block_hash(self, parent, tokens):
        if self.hash_kind == "bytes":
            h = hashlib.sha256()
            h.update(parent if isinstance(parent, bytes) else b"\0" * 32)
            h.update(struct.pack("<%dI" % len(tokens), *tokens))
            return h.digest()
        d = hashlib.sha256(repr((parent, tuple(tokens))).encode()).digest()
        return int.from_bytes(d[:8], "big", signed=True)     # Python-hash-like, signed

    def chain(self, tokens, parent=None):
        """Engine hashes of tokens' full blocks, chained from parent."""
        out, bs = [], self.block_size
        for i in range(len(tokens) // bs):
            parent = self.block_hash(parent, tokens[i * bs:(i + 1) * bs])
            out.append(parent)
        return out

    def stored_event(self, tokens, parent=None, lora_id=None, medium="GPU", lora_name=None,
                     hashes=None, block_size=None, group=None, cache_salt=None):
        """cache_salt: vLLM's extra keys for a salted prompt's blocks, the
        salt in the first block's tuple (after the LoRA name), the others nil."""
        bs = block_size or self.block_size
        n = len(tokens) // bs
        tokens = tokens[:n * bs]
        hashes = hashes if hashes is not None else self.chain(tokens, parent)
        fields = [("block_hashes", hashes), ("parent_block_hash", parent),
                  ("token_ids", list(tokens)), ("block_size", bs), ("lora_id", lora_id)]
        extra = None
        if cache_salt is not None:
            extra = [tuple(([lora_name] if lora_name else []) + [cache_salt])] + [None] * (n - 1)
        if self.form != "sglang":
            fields.append(("medium", medium))
            if lora_name is not None or group is not None or extra or self.form == "map":
                fields.append(("lora_name", lora_name))     # vLLM 0.10 had none
            if group is not None or extra:
                fields.append(("extra_keys", extra))
            if group is not None:
                fields += [("group_idx", group[0]), ("kv_cache_spec_kind", group[1])]
        return self._event("BlockStored", fields), hashes

    def removed_event(self, hashes, medium="GPU", group=None):
        fields = [("block_hashes", list(hashes))]
        if self.form != "sglang":
            fields.append(("medium", medium))
            if group is not None:
                fields.append(("group_idx", group[0]))
        return self._event("BlockRemoved", fields)

    def cleared_event(self):
        return self._event("AllBlocksCleared", [])

    def _event(self, tag, fields):
        if self.form != "map":
            return [tag] + [v for _, v in fields]
        ev = {"type": tag}
        for k, v in fields:
            if v is not None or k in ("parent_block_hash", "lora_id", "medium", "lora_name"):
                ev[k] = v                   # msgspec omits only fields with defaults
        return ev

    def payload(self, events, ts=None):
        ts = time.time() if ts is None else ts
        if self.form == "map":
            batch = {"ts": ts, "events": events}
            if self.dp_rank is not None:
                batch["data_parallel_rank"] = self.dp_rank
        else:
            batch = [ts, events]
            if self.dp_rank is not None:
                batch.append(self.dp_rank)
        return msgpack.packb(batch, use_bin_type=True)

    def send(self, events, drop=False, ts=None):
        """Publishes one batch; drop=True keeps it in the replay buffer only
        (a message lost on the way). Returns its sequence number."""
        return self.send_payload(self.payload(events, ts), drop=drop)

    def send_payload(self, payload, drop=False):
        with self.lock:
            seq = self.seq
            self.seq += 1
            self.buffer.append((seq, payload))
        if not drop:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def resend(self, seq):
        """Publishes a batch of the buffer live again, as it was: the live copy
        of a message that a replay already gave (the two sockets keep no order
        between them)."""
        with self.lock:
            payload = dict(self.buffer)[seq]
        self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    def send_raw(self, frames):
        """Any frames at all (malformed input)."""
        self.pub.send_multipart(frames)

    def store(self, tokens, **kw):
        drop = kw.pop("drop", False)
        ev, hashes = self.stored_event(tokens, **kw)
        self.send([ev], drop=drop)
        return hashes

    def remove(self, hashes, medium="GPU", drop=False, group=None):
        self.send([self.removed_event(hashes, medium, group)], drop=drop)

    def clear(self):
        self.send([self.cleared_event()])

    def close(self):
        self._stop = True
        self.replay_gate.set()
        if self.thread:
            self.thread.join(2)
        self.pub.close(0)
        if self.router is not None:
            self.router.close(0)
        self.ctx.term()


def main():
    ap = argparse.ArgumentParser(description="vLLM-schema KV event publisher (benchmarks)")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--replay-port", type=int)
    ap.add_argument("--messages", type=int, default=10000)
    ap.add_argument("--blocks", type=int, default=64, help="blocks per BlockStored")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--wait", type=float, default=1.0, help="seconds for subscribers to join")
    a = ap.parse_args()
    p = VllmPublisher(port=a.port, replay_port=a.replay_port, block_size=a.block_size,
                      replay=a.replay_port is not None)
    time.sleep(a.wait)
    tok = 0
    t0 = time.time()
    for i in range(a.messages):
        toks = list(range(tok, tok + a.blocks * a.block_size))
        tok += len(toks)
        ev, _ = p.stored_event(toks, hashes=list(range(i * a.blocks + 1, (i + 1) * a.blocks + 1)))
        p.send([ev])
    print("published %d messages, %d blocks in %.3f s" % (a.messages, a.messages * a.blocks,
                                                          time.time() - t0))
    time.sleep(a.wait)
    p.close()


if __name__ == "__main__":
    main()
