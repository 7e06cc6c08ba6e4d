/*
 * The wire protocol's names, in one place for both ends: the ingester
 * (src/events) subscribes to what kvworker (workers/kvw_nats.c) publishes.
 * docs/PROTOCOL.md describes the messages.
 *
 * Subjects hang off a prefix "namespace.<ns>.component.<component>":
 *
 *   P.kv-events              KV events (Dynamo RouterEvent, JSON or msgpack)
 *   P.kvroute.heartbeat      announce / heartbeat (registry, timeouts, lag)
 *   P.kvroute.discover       the router asks every worker to announce
 *   P.kvroute.dump.<id>      request/reply: a worker's whole state (resync)
 *   P.kvroute.decisions      nginx instance to instance: routing decisions
 *                            and in-flight load (src/events/kv_share.c)
 *
 * Use: snprintf(subj, n, "%s" KV_PROTO_EVENTS, prefix).
 */
#ifndef KV_PROTO_H
#define KV_PROTO_H

#define KV_PROTO_PREFIX_FMT      "namespace.%s.component.%s"
#define KV_PROTO_DEFAULT_PREFIX  "namespace.dynamo.component.backend"

#define KV_PROTO_EVENTS          ".kv-events"
#define KV_PROTO_HEARTBEAT       ".kvroute.heartbeat"
#define KV_PROTO_DISCOVER        ".kvroute.discover"
#define KV_PROTO_DUMP            ".kvroute.dump."       /* + worker id, or "*" */
#define KV_PROTO_DECISIONS       ".kvroute.decisions"

/* The event data variants (RouterEvent "data"); readers also take them
 * with a capital first letter, as Dynamo's serde writes them. */
#define KV_PROTO_STORED          "stored"
#define KV_PROTO_REMOVED         "removed"
#define KV_PROTO_CLEARED         "cleared"

/* Heartbeat "type": the first after a (re)connect or discover, then ticks. */
#define KV_PROTO_ANNOUNCE        "announce"
#define KV_PROTO_TICK            "heartbeat"

#endif
