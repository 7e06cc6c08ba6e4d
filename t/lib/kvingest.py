"""Drives tools/kvingest (build/bin/kvingest) from tests: start it under a
kvt.Stack, ask for stats and prefix matches on its stdin, wait for states."""
import json
import os
import queue
import subprocess
import threading
import time

import kvt
import kvproto

BINARY = os.path.join(kvt.BIN, "kvingest")


def available():
    """(True, "") or (False, why): kvingest exits 3 when built before the
    index/decoder (src/core/kv_index.c, kv_event.c) were merged."""
    if not os.path.exists(BINARY):
        return False, "build/bin/kvingest not built"
    r = subprocess.run([BINARY], capture_output=True, text=True)
    if r.returncode == 3:
        return False, r.stderr.strip()
    return True, ""


def start_ready(stack, nats, extra=(), log="kvingest.log"):
    """Starts kvingest and returns (ingest, raw client) once its
    subscriptions are live: it publishes discover after subscribing, on the
    same connection, so seeing discover means the server has its SUBs."""
    from kvnats import Nats
    nc = Nats(nats.port)
    seen = threading.Event()
    nc.subscribe("*.*.*.*" + kvproto.DISCOVER, lambda s, r, p: seen.set())
    nc.flush()
    ing = Ingest(stack, nats.url, extra=extra, log=log)
    if not seen.wait(10):
        raise RuntimeError("kvingest never published discover; log:\n" + ing.read_log())
    return ing, nc


class Ingest:
    def __init__(self, stack, url, extra=(), log="kvingest.log"):
        argv = [BINARY, "--nats", url, "--stats-interval", "0", "-v"] + list(extra)
        self.log = os.path.join(stack.dir, log)
        err = open(self.log, "ab")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=err, start_new_session=True, cwd=stack.dir,
                                     env=kvt.sanitizer_env())
        err.close()
        stack.procs.append(self.proc)
        kvt._live.append(self.proc)
        self.lines = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line.decode())
        self.lines.put(None)

    def _ask(self, cmd, key, timeout=30.0):
        while not self.lines.empty():
            self.lines.get_nowait()
        self.proc.stdin.write((cmd + "\n").encode())
        self.proc.stdin.flush()
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.time()))
            except queue.Empty:
                break
            if line is None:
                raise RuntimeError("kvingest exited (%s); log:\n%s" % (self.proc.poll(),
                                                                      self.read_log()))
            obj = json.loads(line)
            if key in obj:
                return obj
        raise RuntimeError("kvingest did not answer %r" % cmd)

    def stats(self):
        return self._ask("stats", "ts_ms")

    def match(self, hashes):
        """{worker_id: blocks} for the sequence hashes given."""
        r = self._ask("match " + " ".join(str(h) for h in hashes), "match")
        return {m["worker_id"]: m["blocks"] for m in r["match"]}

    def worker(self, worker_id, dp_rank=0, st=None):
        st = st or self.stats()
        for w in st["workers"]:
            if w["worker_id"] == worker_id and w["dp_rank"] == dp_rank:
                return w
        return None

    def wait(self, pred, timeout=30.0, what="condition"):
        """Polls stats until pred(stats) is true; returns those stats."""
        deadline = time.time() + timeout
        st = None
        while time.time() < deadline:
            st = self.stats()
            if pred(st):
                return st
            time.sleep(0.05)
        raise AssertionError("timed out waiting for %s; last stats: %s\nlog:\n%s"
                             % (what, json.dumps(st), self.read_log()[-3000:]))

    def read_log(self):
        try:
            with open(self.log) as f:
                return f.read()
        except OSError:
            return ""

    def stop(self):
        """SIGTERM; returns the final stats line it prints."""
        self.proc.terminate()
        self.proc.wait(10)
        last = None
        while True:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                break
            if line is None:
                break
            last = json.loads(line)
        return last
