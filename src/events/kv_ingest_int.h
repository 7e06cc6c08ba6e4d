/*
 * Internals shared by kv_ingest.c (NATS plumbing) and kv_ingest_sync.c
 * (per-worker consistency: event ids, buffering, dumps, timeouts).
 * Everything here runs with ing->mu held.
 */
#ifndef KV_INGEST_INT_H
#define KV_INGEST_INT_H

#include <pthread.h>

#include <nats/nats.h>

#include "kv_event.h"
#include "kv_ingest.h"

/* Events held back while a worker resyncs; blocks/hashes by offset into
 * the shared arrays so the buffer can grow. */
typedef struct {
    kv_event_t  ev;             /* blocks/hashes pointers unused here */
    size_t      off;            /* into blocks or hashes */
} kv_buf_event_t;

typedef struct {
    kv_buf_event_t      *ev;
    size_t               n, cap;
    kv_stored_block_t   *blocks;
    size_t               nb, capb;
    uint64_t            *hashes;
    size_t               nh, caph;
    int                  overflow;  /* events were dropped: resync again */
} kv_evbuf_t;

typedef struct {
    uint64_t    worker_id;
    uint32_t    dp_rank;
    uint32_t    state;          /* kv_worker_state_t */
    int         used;
    int         announced;      /* announced to THIS helper: resyncable */
    int         complete;       /* index holds its whole history: every event
                                   from 1 (or from a dump) applied, none refused */
    uint64_t    instance_id;
    uint64_t    last_applied;
    uint64_t    last_announced;
    uint64_t    last_seen_ms;
    uint64_t    interval_ms;
    uint64_t    behind_since_ms;
    int         need_resync;
    uint64_t    resync_after_ms;
    uint64_t    dump_seq;       /* in flight when state == RESYNCING */
    uint64_t    dump_deadline_ms;
    uint32_t    dump_next_chunk;
    uint64_t    dump_last_event_id; /* chunk 0's: every chunk must carry it */
    uint64_t    dump_floor;     /* last dump's last_event_id: ids up to it are old news */
    uint64_t    hb_applied;     /* last_applied when the previous heartbeat came */
    uint64_t    verified;       /* a dump applied whole, or events from 1: a real worker */
    uint64_t    sc_resync_ms;   /* when the self-check last resynced it (0: never) */
    kv_evbuf_t  buf;
} kv_wstate_t;

struct kv_ingest {
    kv_ingest_config_t  cfg;
    char               *strings;    /* owned copies of cfg strings */
    char                prefix[256];
    char                ev_subject[320];
    char                hb_subject[320];
    char                discover_subject[320];
    char                inbox[128];     /* dump replies: inbox.<seq> */
    kv_index_t         *ix;
    kv_registry_t      *reg;
    pthread_mutex_t     mu;
    int                 stopping;
    uint64_t            closed;         /* closed callbacks cnats has made */
    uint64_t            conns;          /* connections made (each will call it once) */
    int                 started;
    uint64_t            connect_retry_ms;   /* no connection: make one after */
    uint64_t            backoff_ms;
    pthread_cond_t      closed_cv;      /* closed or live_subs changed */
    int                 fetching;       /* the fetch thread is using ev_sub */
    pthread_t           fetcher;        /* JetStream pull loop */
    int                 has_fetcher;
    int                 live_subs;      /* subscriptions whose handler may still run */

    natsOptions        *opts;
    natsConnection     *nc;
    jsCtx              *js;
    natsSubscription   *ev_sub, *hb_sub, *dump_sub;
    natsSubscription   *ev_sub_pw, *hb_sub_pw;  /* per-worker subjects: <subject>.<id> */
    char                last_error[256];        /* last NATS error logged (once each) */
    uint64_t            last_error_ms;
    uint64_t            diag_at_ms;             /* next diagnosis while disconnected */
    uint64_t            conn_epoch;     /* bumped by (re)connect callbacks (atomic) */
    uint64_t            seen_epoch;     /* handled by tick */
    uint64_t            js_retry_ms;
    uint64_t            js_reconnects;  /* cnats' reconnect count when ev_sub was bound */
    natsStatistics     *stats;          /* scratch for reading that count */
    uint64_t            down_since_ms;  /* NATS not connected since (0: up) */

    kv_event_batch_t    batch;
    kv_stored_block_t  *scratch;        /* dump chunk -> stored events */
    size_t              scratch_cap;
    uint64_t            dump_counter;
    uint64_t            reap_at_ms;     /* next kv_index_reap of removed workers */
    uint32_t            max_workers;
    kv_wstate_t        *wk;             /* by registry record index */
};

void kv_ingest_log(kv_ingest_t *ing, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
int  kv_ingest_connected(kv_ingest_t *ing);

/* kv_ingest_sync.c. A message that came on a per-worker subject carries
 * that worker's id in *subject_worker (NULL on the shared subjects): any
 * event or heartbeat for another id in it is rejected. */
void kv_sync_events(kv_ingest_t *ing, const kv_event_batch_t *b, const uint64_t *subject_worker,
                    uint64_t now_ms);
void kv_sync_heartbeat(kv_ingest_t *ing, const char *buf, size_t len,
                       const uint64_t *subject_worker, uint64_t now_ms);
void kv_sync_dump_chunk(kv_ingest_t *ing, uint64_t seq, const char *buf, size_t len,
                        uint64_t now_ms);
/* connected: NATS is up now; reconnected: it came back since the last tick. */
void kv_sync_tick(kv_ingest_t *ing, uint64_t now_ms, int connected, int reconnected);
void kv_sync_free(kv_ingest_t *ing);


#endif
