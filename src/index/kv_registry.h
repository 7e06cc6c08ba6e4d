/*
 * The worker registry: what the event helper knows about each worker
 * (address, capacity, reported load, how far its events are applied) and
 * the helper's own status, for nginx workers to read.
 *
 * Like the index it lives in one caller-provided region of fixed size
 * (nginx shared memory next to the index; plain memory in tools), holds
 * offsets only and never allocates. There is one writer (the helper that
 * holds the lease) and any number of readers in other processes. Each
 * record has its own seqlock, so a reader copies a consistent record
 * without ever blocking the writer; status counters are single atomic
 * words.
 *
 * The writer lease (pid + generation, taken by CAS) keeps two helpers that
 * overlap during an nginx reload from both writing: the new one takes the
 * lease only once the old one has released it or its pid is dead.
 */
#ifndef KV_REGISTRY_H
#define KV_REGISTRY_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

typedef struct kv_registry kv_registry_t;

typedef enum {
    KV_WORKER_FREE = 0,     /* record unused */
    KV_WORKER_LIVE,         /* index follows its events */
    KV_WORKER_RESYNCING,    /* dump requested or arriving; events buffered */
    KV_WORKER_STALE,        /* index may be behind (gap, lag, NATS down) */
    KV_WORKER_GONE          /* silent past the timeout: blocks dropped */
} kv_worker_state_t;

typedef struct {
    uint64_t    active_prefill_tokens;
    uint64_t    active_decode_blocks;
    uint64_t    kv_used_blocks;
    uint64_t    waiting;
    uint64_t    running;
} kv_worker_load_t;

#define KV_REGISTRY_ADDR_MAX 64     /* host:port, NUL included */
#define KV_REGISTRY_MODEL_MAX 64

typedef struct {
    uint64_t    worker_id;
    uint32_t    dp_rank;
    uint32_t    state;              /* kv_worker_state_t */
    uint64_t    instance_id;        /* 0 until announced */
    int32_t     announced;          /* speaks the kvroute protocol (resyncable) */
    uint32_t    block_size;
    uint64_t    num_blocks;
    char        address[KV_REGISTRY_ADDR_MAX];
    char        model[KV_REGISTRY_MODEL_MAX];
    uint64_t    last_event_applied;
    uint64_t    last_event_announced;
    uint64_t    last_seen_ms;       /* last heartbeat (or event, unannounced) */
    uint64_t    interval_ms;        /* heartbeat interval it announced */
    kv_worker_load_t load;
    uint64_t    events;             /* events applied */
    uint64_t    blocks_stored;
    uint64_t    blocks_removed;
    uint64_t    gaps;
    uint64_t    resyncs;            /* dumps applied */
    uint64_t    duplicates;
    uint64_t    apply_errors;       /* events the index refused */
} kv_worker_rec_t;

typedef enum {
    KV_NATS_DOWN = 0,
    KV_NATS_CONNECTING,
    KV_NATS_CONNECTED,
    KV_NATS_RECONNECTING,
    KV_NATS_CLOSED
} kv_nats_state_t;

/* Helper status: totals; the module computes rates from two reads. */
typedef struct {
    uint64_t    nats_state;         /* kv_nats_state_t */
    uint64_t    connects;           /* successful (re)connects */
    uint64_t    disconnects;
    uint64_t    messages;           /* event messages received */
    uint64_t    events;             /* events applied */
    uint64_t    blocks;             /* blocks stored + removed by applied events */
    uint64_t    decode_errors;      /* malformed messages dropped */
    uint64_t    apply_errors;
    uint64_t    gaps;
    uint64_t    resyncs;            /* dumps requested */
    uint64_t    dumps;              /* dumps applied whole */
    uint64_t    dump_failures;      /* timeouts, bad chunks */
    uint64_t    duplicates;
    uint64_t    buffer_overflows;
    uint64_t    heartbeats;
    uint64_t    timeouts;           /* workers declared gone */
    uint64_t    last_event_lag_ms;  /* now - published (when known, else 0) */
    uint64_t    last_event_ms;      /* when the last event was applied */
    uint64_t    updated_ms;         /* last tick */
    /* ZMQ ingestion (kv_zmq.h) */
    uint64_t    zmq_publishers;     /* configured */
    uint64_t    zmq_connected;      /* reachable now */
    uint64_t    block_size_mismatch;    /* publishers whose engine block size differs */
    uint64_t    engine_restarts;    /* sequences that went back (worker cleared) */
    uint64_t    cleared_workers;    /* workers cleared: restarts, unrecoverable gaps */
    uint64_t    skipped_events;     /* unknown tags, a hybrid model's other groups */

    uint64_t    rejected;           /* implausible events, heartbeats, dump chunks */
    uint64_t    removed;            /* workers removed (gone, left, replaced, evicted) */
} kv_ingest_status_t;

#define KV_REGISTRY_STATUS_FIELDS (sizeof(kv_ingest_status_t) / sizeof(uint64_t))

size_t kv_registry_min_size(uint32_t max_workers);
/* Lays out an empty registry; max_workers 0 means 256. */
kv_registry_t *kv_registry_create(void *region, size_t size, uint32_t max_workers,
                                  char *err, size_t errlen);
/* Re-opens a registry laid out earlier in region (nginx reload). */
kv_registry_t *kv_registry_open(void *region, size_t size);
uint32_t kv_registry_max_workers(const kv_registry_t *reg);

/* --- lease -------------------------------------------------------------- */

/* Takes the writer lease for pid if it is free or its holder's pid is dead
 * (kill(pid, 0) fails with ESRCH). 0 with the new generation in *gen, or -1
 * while another live process holds it (retry later). */
int  kv_registry_lease_acquire(kv_registry_t *reg, pid_t pid, uint32_t *gen);
/* Still ours? (a helper checks before writing after a pause) */
int  kv_registry_lease_held(const kv_registry_t *reg, pid_t pid, uint32_t gen);
void kv_registry_lease_release(kv_registry_t *reg, pid_t pid, uint32_t gen);
/* Current holder (0 if none) and generation. */
pid_t kv_registry_lease_owner(const kv_registry_t *reg, uint32_t *gen);

/* --- writer (lease holder only) ------------------------------------------ */

/* Record index of (worker_id, dp_rank), creating it (state LIVE); -1 when full. */
int  kv_registry_add(kv_registry_t *reg, uint64_t worker_id, uint32_t dp_rank);
/* Opens record i for writing (readers retry meanwhile); write, then end. */
kv_worker_rec_t *kv_registry_write_begin(kv_registry_t *reg, int i);
void kv_registry_write_end(kv_registry_t *reg, int i);
/* Frees record i. */
void kv_registry_remove(kv_registry_t *reg, int i);

/* Status fields are single words: add to or set one by its offset. */
#define KV_STATUS_OFF(field) (offsetof(kv_ingest_status_t, field) / sizeof(uint64_t))
void kv_registry_status_add(kv_registry_t *reg, size_t field, uint64_t n);
void kv_registry_status_set(kv_registry_t *reg, size_t field, uint64_t v);

/* --- readers (any process) ---------------------------------------------- */

/* Consistent copy of record i: 0, or -1 if the record is free, or if a
 * writer held it for the whole of the reader's bounded spin (routing then
 * goes without the record rather than wait). */
int  kv_registry_read(const kv_registry_t *reg, int i, kv_worker_rec_t *out);
/* The same for readers that must not miss a used record (the status page):
 * a writer preempted inside its section (a loaded machine) is waited for,
 * yielding the CPU, for up to KV_REGISTRY_WAIT_MS; -1 only if the record
 * is free or the writer stays stuck (killed mid-write: the next helper
 * repairs it). */
#define KV_REGISTRY_WAIT_MS 100
int  kv_registry_read_wait(const kv_registry_t *reg, int i, kv_worker_rec_t *out);
int  kv_registry_find(const kv_registry_t *reg, uint64_t worker_id, uint32_t dp_rank);
/* Records ever used (the bound of every scan): grows when a new worker
 * announces itself into a never-used record. */
uint32_t kv_registry_records(const kv_registry_t *reg);
/* The first record (from *from, updated past it for iteration; may be NULL)
 * whose address equals addr; -1 if none. */
int  kv_registry_find_address(const kv_registry_t *reg, const char *addr, int *from,
                              kv_worker_rec_t *out);
void kv_registry_status(const kv_registry_t *reg, kv_ingest_status_t *out);

/* --- self-check: the index's prediction against the engine's report -------
 *
 * nginx workers compare, for each response, the prefix the index predicted
 * the worker had cached (tokens) with the `cached_tokens` the engine
 * reported, and record one sample here (any process, atomics only). The
 * helper reads the verdict each tick and resyncs a drifting worker, or
 * routes it by load alone (load_only) when a resync did not help, until
 * its predictions are right again. */

typedef struct {
    uint64_t    worker_id;          /* whose samples these are (reset by the writer) */
    uint64_t    samples;            /* responses compared */
    uint64_t    over;               /* engine had fewer cached tokens than predicted */
    uint64_t    under;              /* engine had more */
    uint64_t    predicted_tokens;   /* sums over samples */
    uint64_t    cached_tokens;
    uint64_t    error_ppm;          /* EWMA (1/8) of |p - c| / max(p, c), parts per million */
    uint64_t    window;             /* samples with p or c > 0 since the last verdict */
    uint64_t    drifts;             /* drifts found by the helper */
    uint64_t    resyncs;            /* resyncs the self-check asked for */
    uint64_t    load_only;          /* 1: routed by load until it recovers */
    uint64_t    recoveries;         /* load_only lifted */
} kv_selfcheck_t;

#define KV_SELFCHECK_MIN_SAMPLES    8       /* a verdict needs this many */
#define KV_SELFCHECK_DRIFT_PPM      500000  /* error EWMA at or above: drifting */
#define KV_SELFCHECK_OK_PPM         200000  /* below (after a reset): recovered */

typedef enum {
    KV_SELFCHECK_UNKNOWN = 0,       /* too few samples since the last reset */
    KV_SELFCHECK_OK,
    KV_SELFCHECK_DRIFT
} kv_selfcheck_verdict_t;

/* One response (any process): ignored unless record i is worker_id's. */
void kv_selfcheck_sample(kv_registry_t *reg, int i, uint64_t worker_id,
                         uint64_t predicted, uint64_t cached);
void kv_selfcheck_read(const kv_registry_t *reg, int i, kv_selfcheck_t *out);
kv_selfcheck_verdict_t kv_selfcheck_verdict(const kv_selfcheck_t *sc);
/* Writer: starts a new window (error and window to 0); counts stay. */
void kv_selfcheck_restart(kv_registry_t *reg, int i);
/* Writer: sets load_only (counting drifts/resyncs/recoveries by the change). */
void kv_selfcheck_note(kv_registry_t *reg, int i, int drift, int resync, int load_only);
/* Lock-free read of load_only for the balancer. */
int  kv_selfcheck_load_only(const kv_registry_t *reg, int i);

const char *kv_worker_state_name(uint32_t state);
const char *kv_nats_state_name(uint64_t state);

#endif
