"""The wire protocol's subject names, read from src/core/kv_proto.h.

The C header is the one place the names are written (the ingester and
kvworker include it); tests read it too, so a renamed subject cannot
leave them testing the old one.
"""
import os
import re

_HEADER = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                       "..", "..", "src", "core", "kv_proto.h")


def _defines(path):
    out = {}
    with open(path) as f:
        for m in re.finditer(r'^#define\s+KV_PROTO_(\w+)\s+"([^"]*)"', f.read(), re.M):
            out[m.group(1)] = m.group(2)
    return out


_D = _defines(_HEADER)

DEFAULT_PREFIX = _D["DEFAULT_PREFIX"]   # namespace.dynamo.component.backend
EVENTS = _D["EVENTS"]                   # .kv-events
HEARTBEAT = _D["HEARTBEAT"]             # .kvroute.heartbeat
DISCOVER = _D["DISCOVER"]               # .kvroute.discover
DUMP = _D["DUMP"]                       # .kvroute.dump.  (+ worker id)


def events(prefix=DEFAULT_PREFIX):
    return prefix + EVENTS


def heartbeat(prefix=DEFAULT_PREFIX):
    return prefix + HEARTBEAT


def discover(prefix=DEFAULT_PREFIX):
    return prefix + DISCOVER


def dump(worker_id, prefix=DEFAULT_PREFIX):
    return "%s%s%s" % (prefix, DUMP, worker_id)
