"""kvworker when NATS dies during its very first handshake (docs/PROTOCOL.md,
formerly a known limitation): cnats closes such a connection for good even
with RetryOnFailedConnect and unlimited reconnects, so the worker served
HTTP unannounced forever. It now builds a new connection and announces once
a real nats-server is back on the address.

The dying server is made deterministic: a socket on the NATS port accepts
the worker's connection, and either closes it at once, or sends INFO, reads
CONNECT + PING and closes before its PONG (the cut that nats-server dying
mid-handshake produces); then a real nats-server takes the port. The
literal race (nats-server killed while the worker connects) is also run a
few times."""
import os
import signal
import socket

import pytest

import kvnats
import kvt

P = "namespace.dynamo.component.backend"


def dying_server(port, send_info):
    """Accepts one connection on port, cuts it mid-handshake, stops listening."""
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", port))
    ls.listen(8)
    return ls


def cut(ls, port, send_info):
    ls.settimeout(30)
    c, _ = ls.accept()
    if send_info:
        c.sendall(('INFO {"server_id":"cut","version":"2.9.10","go":"go","host":"127.0.0.1",'
                   '"port":%d,"max_payload":1048576,"proto":1}\r\n' % port).encode())
        c.settimeout(10)
        got = b""
        while b"PING" not in got:           # CONNECT then PING: the client's half
            data = c.recv(4096)
            if not data:
                break
            got += data
    c.close()
    ls.close()


def announced(stack, port):
    """A real nats-server on port; waits for the worker's heartbeat there."""
    stack.nats(port=port)
    nc = kvnats.Nats(port)
    sid = nc.subscribe(P + ".kvroute.heartbeat")
    msgs = nc.wait(sid, timeout=30)
    return msgs[0].json()


@pytest.mark.parametrize("send_info", [False, True], ids=["accept-close", "cut-before-pong"])
def test_server_dies_during_first_handshake(stack, send_info):
    port = kvt.free_port()
    ls = dying_server(port, send_info)
    w = stack.worker(extra=["--speedup", "50", "--nats", "nats://127.0.0.1:%d" % port,
                            "--heartbeat-ms", "200"])
    cut(ls, port, send_info)
    hb = announced(stack, port)
    assert hb["address"] == "127.0.0.1:%d" % w.ports[0]
    # and it keeps working: events of a request reach NATS
    nc = kvnats.Nats(port)
    sid = nc.subscribe(P + ".kv-events")
    s, _, _, _ = kvt.post_json(w.ports[0], "/v1/completions",
                               {"model": "kvroute-mock", "prompt": list(range(40)),
                                "max_tokens": 1})
    assert s == 200
    nc.wait(sid, timeout=30)


def test_nats_killed_while_worker_connects(stack):
    """The literal race, a few times: whichever moment the kill lands in,
    the worker announces on the server that comes back."""
    for _ in range(3):
        port = kvt.free_port()
        nats = stack.nats(port=port)
        w = stack.worker(extra=["--speedup", "50", "--nats", nats.url, "--heartbeat-ms", "200"],
                         wait=False)
        os.kill(nats.pid, signal.SIGKILL)
        nats.wait()
        for q in w.ports:
            kvt.wait_port(q, proc=w, what="kvworker")
        hb = announced(stack, port)
        assert hb["address"] == "127.0.0.1:%d" % w.ports[0]
        kvt._kill(w)
