"""Graceful reload and quit with prompts in the tokenization thread pool
(docs/SECURITY.md, section 4): `nginx -s reload` and `-s quit` used to drop every
request whose body (>= thread_threshold) was being tokenized in the pool:
the task held no timer, so the exiting worker thought it was idle. Real
nginx, nats-server, kvworker."""
import concurrent.futures
import json
import signal

import kvt
from kvpool import MAIN, setup, words


def threaded(ng):
    s, _, body = kvt.request(ng.port, "GET", "/kvroute/status")
    return json.loads(body)["zones"]["kv"]["threaded"]


def in_flight_through(stack, action):
    """6 large prompts posted to the one-thread pool, then action(ng) while
    most of them wait there; every request must get its response."""
    ng, conf = setup(stack)
    before = threaded(ng)
    big = [words(i, 120000) for i in range(6)]     # ~0.7 MB, ~0.25 s of tokenization each

    def post(text):
        return kvt.post_json(ng.port, "/v1/completions", {"prompt": text, "max_tokens": 1},
                             timeout=120)
    with concurrent.futures.ThreadPoolExecutor(6) as ex:
        futs = [ex.submit(post, t) for t in big]
        # all six posted to the pool (one thread: at most one done by now)
        kvt.wait_until(lambda: threaded(ng) >= before + 6, timeout=30, what="tasks posted")
        action(ng, conf)
        got = [f.result() for f in futs]
    assert [g[0] for g in got] == [200] * 6, [g[:1] for g in got]
    log = ng.log()
    assert "left in connection" not in log and "aborting" not in log
    return ng


def test_reload_keeps_requests_in_the_thread_pool(stack):
    ng = in_flight_through(stack, lambda ng, conf: ng.reload(conf, main_conf=MAIN))
    assert ng.alerts() == []


def test_quit_keeps_requests_in_the_thread_pool(stack):
    in_flight_through(stack, lambda ng, conf: ng.signal(signal.SIGQUIT))


ROWS_CONF = """
    kvroute_zone kv 16m;
    upstream llm {
        zone llm 64k;
        kvroute zone=kv;
        server 127.0.0.1:9;
        server 127.0.0.1:10;
    }
    server {
        listen 127.0.0.1:%(port)s;
        location = /kvroute/status { kvroute_status; }
    }
"""


def test_reload_of_many_worker_processes_gives_each_a_load_row(stack):
    """A row of the load table per worker process, so that one which dies
    gives its in-flight load back. A reload runs the old and new processes
    side by side: with 66 of each, a fixed cap of 128 rows left the last new
    ones without a row."""
    n = 66
    ng = stack.nginx(ROWS_CONF, workers=n)
    kvt.wait_until(lambda: len(ng.children()) >= n, timeout=60, what="worker processes")
    ng.reload(ROWS_CONF, workers=n, timeout=60)
    kvt.wait_until(lambda: kvt.request(ng.port, "GET", "/kvroute/status")[0] == 200,
                   timeout=30, what="status after reload")
    assert "no free load row" not in ng.log()
    assert ng.alerts() == []
