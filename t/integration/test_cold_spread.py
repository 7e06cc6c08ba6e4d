"""New prefixes on an idle fleet go to servers that hold nothing (issue 18,
docs/BENCHMARKS.md "Scale-out round 3"): three nginx instances on loopback,
one nats-server, four kvworker mock engines.

Among servers of equal cold cost the rendezvous hash of the prompt's first
block decides, so that independent instances agree; on its own it puts two
of four new prefixes on one engine about nine times in ten, leaving another
engine nothing to be sticky with for the conversations that follow. A
server whose index holds nothing now comes first: four new system prompts,
each sent through the next instance, land on the four engines, in events
mode (every instance reads the engines' KV events) and in approximate mode
with shared decisions (kvroute_share)."""
import pytest

import kvt
import test_multi_instance as multi
import test_share as share

ENGINES, ids, zone = multi.ENGINES, multi.ids, multi.zone


def indexed(port):
    return {x["server"]: x["indexed_blocks"] for x in zone(port)["upstreams"]["llm"]}


def idle(port):
    return all(x["active_requests"] == 0 for x in zone(port)["upstreams"]["llm"])


@pytest.mark.parametrize("mode", ["events", "approximate_share"])
def test_new_prefixes_spread_over_empty_servers(stack, mode):
    if mode == "events":
        _, _, w, ngs = multi.make_fleet(stack)
    else:
        _, w, ngs = share.make_fleet(stack)
    where = []
    for j in range(ENGINES):
        # every instance knows where the previous prefixes went and counts
        # nothing in flight, so each sees the same empty servers
        for ng in ngs:
            kvt.wait_until(lambda: {k for k, v in indexed(ng.port).items() if v} == set(where)
                           and idle(ng.port),
                           what="instance %d indexed the prefixes so far" % ng.port)
        # short prompts: every server's estimate is the same within an
        # output token's time, so the cold rule's tie-breaks decide
        where.append(share.complete(ngs[j % 3].port, ids("new-system-%d" % j, 64))[0])
    assert sorted(where) == sorted("127.0.0.1:%d" % p for p in w.ports), where
    for ng in ngs:
        assert ng.alerts() == []
