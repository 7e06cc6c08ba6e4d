"""The suite's one NATS client (core protocol only: CONNECT, SUB, PUB, MSG,
PING/PONG) over a raw socket, so the suite needs no extra package and
events can come from something that is not kvworker.

A subscription either queues its messages (subscribe(subject) -> sid, then
messages/wait) or hands each one to a callback on the reader thread
(subscribe(subject, cb), cb(subject, reply, payload bytes)), which is how
FakeWorker (kvfake.py) answers request/reply."""
import json
import socket
import threading
import time


class Msg:
    def __init__(self, subject, reply, data):
        self.subject = subject
        self.reply = reply
        self.data = data

    def json(self):
        return json.loads(self.data)


class Nats:
    def __init__(self, port, host="127.0.0.1", timeout=5.0, name="kvt", user=None,
                 password=None):
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.settimeout(None)
        self.buf = b""
        self.lock = threading.Lock()            # one writer on the socket
        self.cond = threading.Condition()       # queues, callbacks, pongs
        self.queues = {}        # sid -> list of Msg
        self.callbacks = {}     # sid -> cb(subject, reply, payload)
        self.next_sid = 1
        self.pongs = 0
        self.closed = False
        self.errors = []        # -ERR lines (a permissions violation keeps the connection)
        info = self._line()
        if not info.startswith(b"INFO"):
            raise RuntimeError("not a NATS server: %r" % info[:80])
        connect = {"verbose": False, "pedantic": False, "name": name, "protocol": 1,
                   "echo": True}
        if user is not None:
            connect.update(user=user, **{"pass": password})
        self._send(b"CONNECT " + json.dumps(connect).encode() + b"\r\n")
        self.reader = threading.Thread(target=self._read_loop, daemon=True)
        self.reader.start()
        self.flush()
        if self.closed:         # refused (e.g. authorization): no PONG came
            raise RuntimeError("nats: %s" % ("; ".join(self.errors) or "connection closed"))

    def _send(self, data):
        with self.lock:
            self.sock.sendall(data)

    def _fill(self):
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            raise EOFError
        self.buf += chunk

    def _line(self):
        while b"\r\n" not in self.buf:
            self._fill()
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _read_loop(self):
        try:
            while not self.closed:
                line = self._line()
                if line.startswith(b"MSG "):
                    parts = line.split()
                    subject, sid = parts[1].decode(), int(parts[2])
                    reply = parts[3].decode() if len(parts) == 5 else None
                    n = int(parts[-1])
                    while len(self.buf) < n + 2:
                        self._fill()
                    data, self.buf = self.buf[:n], self.buf[n + 2:]
                    with self.cond:
                        cb = self.callbacks.get(sid)
                        if cb is None and sid in self.queues:
                            self.queues[sid].append(Msg(subject, reply, data))
                            self.cond.notify_all()
                    if cb is not None:
                        cb(subject, reply, data)
                elif line.startswith(b"PING"):
                    self._send(b"PONG\r\n")
                elif line.startswith(b"PONG"):
                    with self.cond:
                        self.pongs += 1
                        self.cond.notify_all()
                elif line.startswith(b"-ERR"):
                    # fatal errors are followed by the server closing the socket
                    with self.cond:
                        self.errors.append(line.decode(errors="replace"))
                        self.cond.notify_all()
        except (EOFError, OSError):
            pass
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def flush(self, timeout=5.0):
        """Round trip: every earlier SUB and PUB has reached the server."""
        with self.cond:
            want = self.pongs + 1
        self._send(b"PING\r\n")
        with self.cond:
            if not self.cond.wait_for(lambda: self.pongs >= want or self.closed, timeout):
                raise TimeoutError("no PONG from nats-server")

    def subscribe(self, subject, cb=None):
        with self.cond:
            sid = self.next_sid
            self.next_sid += 1
            if cb is None:
                self.queues[sid] = []
            else:
                self.callbacks[sid] = cb
        self._send(("SUB %s %d\r\n" % (subject, sid)).encode())
        if threading.current_thread() is not self.reader:     # a callback cannot wait
            self.flush()
        return sid

    def publish(self, subject, data, reply=None):
        if isinstance(data, (dict, list)):
            data = json.dumps(data, separators=(",", ":"))
        if isinstance(data, str):
            data = data.encode()
        head = "PUB %s %s%d\r\n" % (subject, (reply + " ") if reply else "", len(data))
        self._send(head.encode() + data + b"\r\n")

    def messages(self, sid):
        """Everything received on sid so far (the list keeps growing)."""
        with self.cond:
            return list(self.queues[sid])

    def wait(self, sid, pred=lambda msgs: len(msgs) > 0, timeout=30.0):
        """Waits until pred(messages so far); returns them."""
        deadline = time.time() + timeout
        with self.cond:
            while not pred(self.queues[sid]):
                left = deadline - time.time()
                if left <= 0:
                    raise TimeoutError("nats: condition not met within %.1fs" % timeout)
                self.cond.wait(left)
            return list(self.queues[sid])

    def request_all(self, subject, data, until, timeout=5.0):
        """Request with a fresh inbox; collects replies until until(replies)."""
        inbox = "_INBOX.kvt.%d.%d" % (id(self), self.next_sid)
        sid = self.subscribe(inbox)
        self.publish(subject, data, reply=inbox)
        return self.wait(sid, until, timeout)

    def close(self):
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass
