"""kvworker --load-ms (docs/CONFIG.md, "Many nginx instances"): besides the
periodic heartbeat, an engine publishes one as soon as its load changed (a
request submitted, a step done), at most one per N ms, and the last change of
a window when the window ends; so routers in front of it see other routers'
requests without waiting for the next periodic heartbeat.

The periodic heartbeat here is ten minutes apart: every heartbeat after the
announce that these tests see is a load report."""
import http.client
import json
import threading

import kvnats
import kvproto
import kvt


def completion(port, prompt, max_tokens, out):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", "/v1/completions",
              body=json.dumps({"model": "kvroute-mock", "prompt": prompt,
                               "max_tokens": max_tokens}),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    out.append((r.status, r.read()))
    c.close()


def loads(sub, sid, port):
    """(type, waiting + running, active prefill tokens) of each heartbeat
    of the engine on port, in order."""
    out = []
    for m in sub.messages(sid):
        h = m.json()
        if h.get("address", "").endswith(":%d" % port):
            ld = h.get("load", {})
            out.append((h["type"], ld.get("waiting", 0) + ld.get("running", 0),
                        ld.get("active_prefill_tokens", 0)))
    return out


def test_load_change_published_before_the_heartbeat(stack):
    nats = stack.nats()
    sub = kvnats.Nats(nats.port)
    sid = sub.subscribe(kvproto.heartbeat())
    w = stack.worker(extra=["--nats", nats.url, "--heartbeat-ms", "600000",
                            "--load-ms", "20", "--speedup", "0.05"])
    port = w.ports[0]
    kvt.wait_until(lambda: any(t == "announce" for t, _, _ in loads(sub, sid, port)),
                   what="the engine's announce")
    done = []
    t = threading.Thread(target=completion, args=(port, list(range(100, 612)), 8, done))
    t.start()
    try:
        # the request in flight shows in a heartbeat while it runs
        kvt.wait_until(lambda: any(t_ == "heartbeat" and n >= 1
                                   for t_, n, _ in loads(sub, sid, port)),
                       timeout=60, what="a load report with the request in flight")
        assert not done, "the request ended before its load was reported"
    finally:
        t.join(120)
    assert done and done[0][0] == 200, done
    # and its end in a later one (the last change of a window is not lost)
    kvt.wait_until(lambda: loads(sub, sid, port)[-1][1:] == (0, 0),
                   timeout=60, what="a load report of the idle engine")
    sub.close()


def test_load_reports_are_rate_limited(stack):
    """Many requests at once: far fewer reports than load changes, and
    the engine's last report says idle."""
    nats = stack.nats()
    sub = kvnats.Nats(nats.port)
    sid = sub.subscribe(kvproto.heartbeat())
    w = stack.worker(extra=["--nats", nats.url, "--heartbeat-ms", "600000",
                            "--load-ms", "100000"])
    port = w.ports[0]
    kvt.wait_until(lambda: any(t == "announce" for t, _, _ in loads(sub, sid, port)),
                   what="the engine's announce")
    done = []
    threads = [threading.Thread(target=completion,
                                args=(port, list(range(200 + k, 300 + k)), 4, done))
               for k in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(done) == 16 and all(s == 200 for s, _ in done), done
    # 16 submits and their steps changed the load dozens of times; one window of
    # 100 s allows one report now and one (the trailing) when the window ends
    assert len([x for x in loads(sub, sid, port) if x[0] == "heartbeat"]) <= 1
    sub.close()
