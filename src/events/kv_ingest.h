/*
 * Event ingestion: keeps a kv_index and a kv_registry in step with what
 * the workers publish over NATS (docs/PROTOCOL.md, router side; the names
 * are in src/core/kv_proto.h).
 *
 *   P.kv-events           KV events (Dynamo RouterEvent, JSON or msgpack)
 *   P.kvroute.heartbeat   announce / heartbeat: registry, timeouts, lag
 *   P.kvroute.discover    published after every (re)connect
 *   P.kvroute.dump.<id>   request/reply: a worker's whole state (resync)
 *
 * Threading: cnats delivers core-NATS messages on its own threads (one per
 * subscription) and, with JetStream, one thread of ours fetches from a
 * durable pull consumer; every handler, the fetcher and kv_ingest_tick take
 * one mutex (ing->mu) before touching the index or the registry, so the
 * index sees exactly one writer at a time. The caller must hold the
 * registry lease while the ingester runs.
 *
 * Pure C, no nginx: the nginx helper process and tools/kvingest host it.
 *
 * Hosting (the nginx helper):
 *   1. kv_index_open/kv_registry_open the zone (or _create on first start);
 *   2. kv_registry_lease_acquire(reg, getpid(), &gen) until it returns 0
 *      (the previous helper released it or died), polling every ~100 ms;
 *   3. kv_ingest_create (adopts the records a previous helper left: the
 *      index keeps its blocks, announced workers resync once connected),
 *      kv_ingest_start;
 *   4. every 50-250 ms: kv_ingest_tick; stop when the lease is no longer
 *      held (kv_registry_lease_held) or on quit/reload;
 *   5. kv_ingest_stop, kv_ingest_destroy, kv_registry_lease_release.
 *
 * Readers (nginx workers) use kv_registry_read/find_address for the
 * worker's state and load: route by the index only for state LIVE; STALE,
 * RESYNCING and GONE mean "load only" (docs/PROTOCOL.md).
 */
#ifndef KV_INGEST_H
#define KV_INGEST_H

#include <stddef.h>
#include <stdint.h>

#include "kv_index.h"
#include "kv_registry.h"

typedef struct kv_ingest kv_ingest_t;

typedef struct {
    const char *servers;            /* "nats://h:p[,nats://h:p...]" (required) */
    const char *prefix;             /* default "namespace.dynamo.component.backend" */
    const char *event_subject;      /* default prefix + ".kv-events" */
    const char *stream;             /* JetStream stream (NULL: core NATS) */
    const char *durable;            /* JetStream durable pull consumer (created if absent,
                                       with the stream if that is absent) */
    const char *user, *password;
    const char *token;
    const char *creds;              /* credentials file */
    const char *tls_ca, *tls_cert, *tls_key;
    int         tls;                /* require TLS */
    int         tls_no_verify;      /* skip server certificate verification */
    uint32_t    heartbeat_timeout_ms;   /* 0: 3 x announced interval, at least 3000 */
    uint32_t    stale_lag_ms;       /* applied behind announced this long: resync; default 1000 */
    uint32_t    dump_timeout_ms;    /* default 2000 */
    uint32_t    reconnect_wait_ms;  /* default 250 */
    uint32_t    buffer_events;      /* per worker while resyncing; default 4096 */
    uint32_t    buffer_blocks;      /* per worker while resyncing; default 262144 */
    int         per_worker_only;    /* accept events and heartbeats only on the per-worker
                                       subjects P.kv-events.<id>, P.kvroute.heartbeat.<id>
                                       (what NATS permissions can restrict to one worker;
                                       docs/SECURITY.md); 0: on the shared ones too */
    int         verbose;            /* log to stderr */
    int         test_exit_after_fetch;  /* tests only (kvingest): the process exits as
                                           soon as a JetStream fetch returns messages,
                                           before applying or acking them */
    int         test_drop_fetch_once;   /* tests only (kvingest): the first JetStream fetch
                                           that returns messages is discarded, neither
                                           applied nor acked (a fetch whose reply a NATS
                                           disconnect cut short) */
    /* Called (under the ingest's lock) after the index dropped blocks of a
     * worker on the worker's own word: a Removed event (the sequence
     * hashes), or n == 0 for all of them (Cleared, a resync, a worker
     * gone), so that guesses kept elsewhere (nginx's pending index) give
     * way to the worker's events. NULL: nobody is told. */
    void      (*on_drop)(void *arg, uint64_t worker_id, const uint64_t *seq, size_t n);
    void       *on_drop_arg;
} kv_ingest_config_t;

kv_ingest_t *kv_ingest_create(const kv_ingest_config_t *cfg, kv_index_t *ix,
                              kv_registry_t *reg, char *err, size_t errlen);
/* Connects in the background (retrying forever); never blocks on NATS. */
int  kv_ingest_start(kv_ingest_t *ing, char *err, size_t errlen);
/* Timeouts, resync retries, discover after (re)connect, JetStream setup.
 * Call every 50-250 ms with a monotonic-ish wall clock in ms. */
void kv_ingest_tick(kv_ingest_t *ing, uint64_t now_ms);
/* Disconnects and waits for cnats threads to stop delivering. */
void kv_ingest_stop(kv_ingest_t *ing);
void kv_ingest_destroy(kv_ingest_t *ing);

/* Copies a server list with any user:password@ or token@ replaced by
 * ***@, for logs. */
void kv_ingest_redact(const char *in, char *out, size_t n);

/* Milliseconds since the epoch (what heartbeats and envelopes carry). */
uint64_t kv_ingest_now_ms(void);

#endif
