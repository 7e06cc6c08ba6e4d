"""A tiny NATS client over a raw socket (CONNECT/PUB/SUB/MSG), for tests.

Publishes like any NATS client (so events come from something that is not
kvworker) and answers request/reply, which is all a test needs to act as a
worker: see FakeWorker in kvfake.py.
"""
import json
import socket
import threading
import time


class NatsRaw:
    def __init__(self, port, host="127.0.0.1", timeout=5.0, user=None, password=None):
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.settimeout(None)
        self.lock = threading.Lock()
        self.subs = {}          # sid -> callback(subject, reply, payload bytes)
        self.next_sid = 1
        self.closed = False
        self.buf = b""
        info = self._readline()
        if not info.startswith(b"INFO"):
            raise RuntimeError("not a NATS server: %r" % info[:80])
        self.errors = []        # -ERR lines from the server (e.g. permissions violations)
        self.pongs = 0
        self.cv = threading.Condition()
        auth = {"user": user, "pass": password} if user else {}
        connect = dict({"verbose": False, "pedantic": False, "name": "kvt-raw", "protocol": 1,
                        "echo": True}, **auth)
        self._send(b"CONNECT " + json.dumps(connect).encode() + b"\r\nPING\r\n")
        while True:
            line = self._readline()
            if line.startswith(b"PONG"):
                break
            if line.startswith(b"-ERR"):
                raise RuntimeError(line.decode())
        self.reader = threading.Thread(target=self._read_loop, daemon=True)
        self.reader.start()

    def _send(self, data):
        with self.lock:
            self.sock.sendall(data)

    def _fill(self):
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            raise EOFError
        self.buf += chunk

    def _readline(self):
        while b"\r\n" not in self.buf:
            self._fill()
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _read(self, n):
        while len(self.buf) < n + 2:
            self._fill()
        data, self.buf = self.buf[:n], self.buf[n + 2:]
        return data

    def _read_loop(self):
        try:
            while not self.closed:
                line = self._readline()
                if line.startswith(b"MSG"):
                    parts = line.split()
                    subject, sid = parts[1].decode(), int(parts[2])
                    reply = parts[3].decode() if len(parts) == 5 else None
                    payload = self._read(int(parts[-1]))
                    cb = self.subs.get(sid)
                    if cb:
                        cb(subject, reply, payload)
                elif line.startswith(b"PING"):
                    self._send(b"PONG\r\n")
                elif line.startswith(b"PONG"):
                    with self.cv:
                        self.pongs += 1
                        self.cv.notify_all()
                elif line.startswith(b"-ERR"):
                    self.errors.append(line.decode(errors="replace"))
        except (EOFError, OSError):
            pass

    def publish(self, subject, payload, reply=None):
        if isinstance(payload, (dict, list)):
            payload = json.dumps(payload, separators=(",", ":"))
        if isinstance(payload, str):
            payload = payload.encode()
        head = "PUB %s %s%d\r\n" % (subject, (reply + " ") if reply else "", len(payload))
        self._send(head.encode() + payload + b"\r\n")

    def subscribe(self, subject, cb):
        sid = self.next_sid
        self.next_sid += 1
        self.subs[sid] = cb
        self._send(("SUB %s %d\r\n" % (subject, sid)).encode())
        return sid

    def flush(self):
        """Round trip so every earlier PUB/SUB has reached the server."""
        # PING/PONG: the server answers after processing everything before
        # it, and needs no publish permission (unlike a round trip on an inbox)
        with self.cv:
            want = self.pongs + 1
        self._send(b"PING\r\n")
        with self.cv:
            self.cv.wait_for(lambda: self.pongs >= want, 5)

    def close(self):
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass
