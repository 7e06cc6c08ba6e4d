"""`make run`: the demo stack a newcomer starts first (tools/demo), run as the
Makefile runs it, and every command it prints run as printed (bash, curl)."""
import json
import os
import re
import signal
import socket
import subprocess

import pytest

import kvt

DEMO = os.path.join(kvt.TOP, "tools", "demo")

# `make run` starts the plain build; a sanitized module needs the sanitizer
# runtimes preloaded into nginx, which the demo does not do
pytestmark = pytest.mark.skipif(kvt.SANITIZE, reason="make run runs the plain build")
READY = "Press Ctrl-C to stop."


def at_a_terminal():
    """SIGINT as a terminal's shell leaves it. A test run started in the
    background (nohup make test &) ignores SIGINT, every child inherits that,
    and a shell cannot trap a signal ignored on entry."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Demo:
    def __init__(self, stack, disagg):
        self.port = kvt.free_ports(5, consecutive=True)[0]      # nginx, then 4 workers
        self.nats_port = kvt.free_port()
        self.dir = os.path.join(stack.dir, "run")
        self.out = os.path.join(stack.dir, "demo.out")
        argv = [DEMO, "--build", kvt.BUILD, "--port", str(self.port), "--run-dir", self.dir]
        env = dict(os.environ, NATS_PORT=str(self.nats_port))
        with open(self.out, "wb") as f:
            # its own process group, as a terminal gives it: Ctrl-C is a SIGINT to the group
            self.p = subprocess.Popen(argv + (["--disagg"] if disagg else []), stdout=f,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env=env, start_new_session=True, preexec_fn=at_a_terminal)
        stack.procs.append(self.p)

    def text(self):
        with open(self.out, errors="replace") as f:
            return f.read()

    def up(self):
        def ready():
            assert self.p.poll() is None, "the demo exited:\n" + self.text()
            return READY in self.text()
        kvt.wait_until(ready, timeout=120, what="the demo's banner")
        return self.text()

    def ctrl_c(self):
        os.killpg(self.p.pid, signal.SIGINT)
        return self.p.wait(timeout=60)


def commands(banner):
    """The shell commands the banner prints: a line starting with "curl",
    with the lines it continues with a backslash."""
    out, cur = [], None
    for line in banner.splitlines():
        s = line.strip()
        if cur is not None:
            cur += "\n" + s
        elif s.startswith("curl "):
            cur = s
        if cur is not None and not s.endswith("\\"):
            out.append(cur)
            cur = None
    return out


def sh(cmd):
    r = subprocess.run(["bash", "-c", "set -o pipefail; " + cmd], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, (cmd, r.stdout, r.stderr)
    return r.stdout


def headers(text):
    return {k.strip().lower(): v.strip() for k, v in
            (l.split(":", 1) for l in text.splitlines() if ":" in l)}


def listening(port):
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def stopped_clean(d, stack):
    rc = d.ctrl_c()
    assert rc == 0, d.text()
    assert "stopped. logs are in" in d.text(), d.text()
    for p in [d.port, d.nats_port] + list(range(d.port + 1, d.port + 5)):
        assert not listening(p), (p, d.text())
    with open(os.path.join(d.dir, "logs", "error.log"), errors="replace") as f:
        log = f.read()
    assert not re.search(r"\[(alert|emerg)\]|exited on signal", log), log[-3000:]


def test_make_run_serves_what_it_prints(stack):
    d = Demo(stack, disagg=False)
    banner = d.up()
    cmds = commands(banner)
    assert len(cmds) == 4, banner      # chat, streaming, the long prompt, status
    chat, stream, cached, status = cmds

    body = json.loads(sh(chat))
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]
    events = kvt.sse_events(sh(stream).encode())
    assert events and events[-1] == "[DONE]", events
    assert all(json.loads(e)["object"] == "chat.completion.chunk" for e in events[:-1])

    # the same long system prompt twice: the second request goes where the first was cached
    first = headers(sh(cached))
    second = headers(sh(cached))
    assert second["x-kvroute-worker"] == first["x-kvroute-worker"], (first, second)
    assert int(second["x-kvroute-overlap"]) > 0, second

    st = json.loads(sh(status))["zones"]["kv"]
    assert len(st["upstreams"]["llm"]) == 4, st
    # the workers' events reached the index through NATS, not only the router's guesses
    def indexed():
        z = json.loads(sh(status))["zones"]["kv"]
        return z["events"]["nats"] == "connected" and z["events"]["blocks"] > 0 \
            and z["index"]["blocks"] > 0
    kvt.wait_until(indexed, what="blocks indexed from the workers' events")
    stopped_clean(d, stack)


def test_make_run_disagg_pulls_long_prompts(stack):
    d = Demo(stack, disagg=True)
    banner = d.up()
    cmds = commands(banner)
    assert len(cmds) == 3, banner      # the long prompt, a short one, status
    long_, short, status = cmds

    h = headers(sh(long_))
    prefill_ports = {"127.0.0.1:%d" % (d.port + 1), "127.0.0.1:%d" % (d.port + 2)}
    assert h.get("x-kvroute-prefill-worker") in prefill_ports, h
    assert h.get("x-kvroute-prefilled-by") in prefill_ports, h
    # again: its decode worker holds the prompt now, prefilled in place
    h2 = headers(sh(long_))
    assert h2.get("x-kvroute-prefilled-by") == "local", h2
    assert headers(sh(short)).get("x-kvroute-prefilled-by") == "local"
    # a client cannot pick the prefill worker: a new long prompt, the header added
    forged = long_.replace("curl -si", "curl -si -H 'X-KVRoute-Prefill: 10.0.0.1:9'", 1)
    forged = forged.replace("careful assistant", "patient assistant")
    assert forged != long_
    h3 = headers(sh(forged))
    assert h3.get("x-kvroute-prefilled-by") in prefill_ports, h3

    st = json.loads(sh(status))
    assert st["zones"]["kv"]["upstreams"]["llm"] and st["zones"]["kv"]["upstreams"]["prefill"]
    stopped_clean(d, stack)


def test_make_run_refuses_a_taken_port(stack):
    """A port in use is named, with how to choose another; nothing is left running."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        taken = s.getsockname()[1]
        r = subprocess.run([DEMO, "--build", kvt.BUILD, "--port", str(taken),
                            "--run-dir", os.path.join(stack.dir, "run")],
                           capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, NATS_PORT=str(kvt.free_port())))
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "port %d on 127.0.0.1 is already in use" % taken in r.stderr, r.stderr
    assert "make run PORT=N" in r.stderr, r.stderr
