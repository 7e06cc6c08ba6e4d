/*
 * The worker side of docs/PROTOCOL.md over cnats: KV events, announce and
 * heartbeat, discover, dump. One connection serves every engine of the
 * process; each engine has its own worker_id and event_id sequence.
 *
 * cnats runs its callbacks on its own threads; they only queue work and
 * wake the event loop, where everything else happens, so engine state is
 * touched from one thread only.
 *
 * NATS down at start or later: HTTP keeps serving and cnats reconnects
 * forever. Events published while disconnected go to cnats's reconnect
 * buffer; if one cannot be buffered its event_id is spent anyway, so
 * routers see the gap (next event, or last_event_id in the next
 * heartbeat) and resync through a dump. After every reconnect each engine
 * announces itself at once. We do not publish `cleared` then: the cache
 * was not reset, and a dump restores the router's view exactly, where a
 * `cleared` would throw away everything still valid.
 */
#ifndef KVW_NATS_H
#define KVW_NATS_H

#include <event2/event.h>

#include "kvw_engine.h"

typedef struct kvw_nats kvw_nats_t;

/* engines must be scheduler engines (kvw_sched.h) with worker_id set. */
kvw_nats_t *kvw_nats_start(const kvw_config_t *cfg, struct event_base *base,
                           kvw_engine_t **engines, int n, char *err, size_t errlen);
void kvw_nats_stop(kvw_nats_t *k);

/* The default worker id: a stable 63-bit non-zero hash of "host:port". */
uint64_t kvw_worker_id_for(const char *host, int port);
/* A NATS URL with user:password@ or token@ replaced by ***@, for logs. */
void kvw_nats_redact(const char *url, char *out, size_t n);

#endif
