"""kvworker under hostile clients (docs/SECURITY.md, section 5): bounded headers,
idle and slow-header connections closed (long generations are not), accept
paused instead of spinning when out of file descriptors, dump requests only
answered to inboxes and rate-limited. Real kvworker, real nats-server."""
import json
import resource
import socket
import subprocess
import time

import kvt
from kvnats import Nats
import kvproto

P = kvproto.DEFAULT_PREFIX


def worker(stack, extra=(), preexec=None):
    port = kvt.free_port()
    argv = [kvt.os.path.join(kvt.BIN, "kvworker"), "--engine", "mock", "--port", str(port)]
    argv += list(extra)
    log = kvt.os.path.join(stack.dir, "worker-%d.log" % port)
    p = subprocess.Popen(argv, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                         preexec_fn=preexec, start_new_session=True, env=kvt.sanitizer_env())
    stack.procs.append(p)
    kvt._live.append(p)
    kvt.wait_port(port, proc=p, what="kvworker")
    p.port, p.log = port, log
    return p


def closed_by_peer(sock, timeout=15):
    sock.settimeout(timeout)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def test_huge_headers_refused(stack):
    w = worker(stack)
    s = socket.create_connection(("127.0.0.1", w.port))
    s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n")
    assert closed_by_peer(s)
    st, _, _ = kvt.request(w.port, "GET", "/v1/models")
    assert st == 200


def test_idle_and_slow_header_connections_closed(stack):
    w = worker(stack, ["--idle-timeout", "1"])
    idle = socket.create_connection(("127.0.0.1", w.port))
    slow = socket.create_connection(("127.0.0.1", w.port))
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    assert closed_by_peer(idle) and closed_by_peer(slow)


def test_idle_timeout_does_not_cut_long_generations(stack):
    w = worker(stack, ["--idle-timeout", "1", "--speedup", "0.2"])
    t0 = time.time()
    for stream in (False, True):
        st, _, body, _ = kvt.post_json(w.port, "/v1/completions",
                                       {"model": "kvroute-mock", "prompt": [1, 2, 3],
                                        "max_tokens": 100, "stream": stream}, timeout=120)
        assert st == 200, body
    if time.time() - t0 < 4:
        print("generations were faster than the idle timeout: nothing was proven")


def test_out_of_file_descriptors_pauses_accept(stack):
    def low_fds():
        resource.setrlimit(resource.RLIMIT_NOFILE, (40, 40))
    w = worker(stack, preexec=low_fds)
    conns = []
    for _ in range(80):
        try:
            conns.append(socket.create_connection(("127.0.0.1", w.port), timeout=2))
        except OSError:
            break
    kvt.wait_until(lambda: "pausing accepts" in open(w.log).read(), timeout=15,
                   what="accept paused")
    for c in conns:
        c.close()
    # once descriptors are free again it serves
    kvt.wait_until(lambda: kvt.request(w.port, "GET", "/v1/models")[0] == 200, timeout=15,
                   what="serving again")
    assert sum(1 for _ in open(w.log)) < 200


def test_dump_requests_only_to_inboxes_and_rate_limited(stack):
    nats = stack.nats()
    w = worker(stack, ["--nats", nats.url, "--worker-id", "77"])
    nc = Nats(nats.port)
    got = {"inbox": 0, "victim": 0}

    def count(key):
        def cb(s, r, p):
            got[key] += 1
        return cb
    nc.subscribe("_INBOX.evil.*", count("inbox"))
    nc.subscribe(kvproto.events(P), count("victim"))
    nc.flush()
    kvt.wait_until(lambda: kvt.request(w.port, "GET", "/v1/models")[0] == 200, what="worker")
    nc.publish(kvproto.dump(77, P), "{}", reply=kvproto.events(P))
    for i in range(400):
        nc.publish(kvproto.dump(77, P), "{}", reply="_INBOX.evil.%d" % i)
    nc.flush()
    kvt.wait_until(lambda: got["inbox"] >= 1, what="a dump answered")
    # the worker keeps answering routers: one more request later still works
    time.sleep(1.1)     # let the rate window pass (not a readiness wait)
    before = got["inbox"]
    nc.publish(kvproto.dump(77, P), "{}", reply="_INBOX.evil.last")
    nc.flush()
    kvt.wait_until(lambda: got["inbox"] > before, what="answered after the burst")
    assert got["victim"] == 0
    assert got["inbox"] < 400
    nc.close()
