/* ZMQ ingestion of vLLM / SGLang KV events (see kv_zmq.h). */
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <zmq.h>

#include "kv_buf.h"
#include "kv_hash.h"
#include "kv_signals.h"
#include "kv_vllm_event.h"
#include "kv_zmq.h"

#define END_SEQ         UINT64_MAX      /* replay's end marker: -1 as i64 */
#define NO_REPLAY_MS    5000            /* after a failed replay, clear on gaps */
#define DRAIN_MAX       4096            /* messages per socket per poll round */
#define HOLD_BYTES_MAX  (256u << 20)    /* live payload bytes held during a replay */

/* A live message held while a replay runs. */
typedef struct {
    uint64_t    seq;
    size_t      len;
    uint8_t    *data;
} held_t;

/* engine hash -> tiers holding it (bit per kv_tier_t); open addressing,
 * mask 0 marks an empty slot. */
typedef struct {
    uint64_t    key;
    uint64_t    mask;
} tslot_t;

typedef struct {
    tslot_t    *s;
    size_t      cap, n;     /* cap a power of two */
} tmap_t;

/* Messages applied that are remembered by sequence number and fingerprint.
 * The SUB socket and the replay socket are two connections with no order
 * between them: a message the replay gave can still come live afterwards,
 * and its number is then behind ours. Only a few can be in flight. */
#define RECENT 64

typedef struct {
    kv_zmq_pub_config_t cfg;
    uint64_t    worker_id;
    int         reg;
    void       *sub, *rep, *mon;
    int         mon_id;
    int         connected, ever_connected;
    int         adopted;        /* the previous helper's stream, not yet connected */
    int         have_seq;
    uint64_t    last_seq;
    uint64_t    recent_seq[RECENT];     /* the last messages applied, at seq % RECENT */
    uint64_t    recent_fp[RECENT];      /* and their fingerprints (0: none) */
    int         replaying;
    int         verify;         /* this replay must start with last_seq's message */
    int         rewind;         /* the stream was another's: this replay ignored,
                                   then one from 0 */
    uint64_t    replay_from;
    uint64_t    replay_deadline_ms;
    uint64_t    no_replay_until_ms;
    held_t     *held;
    size_t      n_held, cap_held, held_bytes;
    uint32_t    engine_bs;
    int         mismatch;
    int         sole;           /* the only publisher for its server */
    int         group_set;      /* a hybrid model's prefix group is known */
    uint32_t    group;
    tmap_t      tiers;
    tmap_t      salts;          /* engine hash -> seed of a salted prompt's blocks */
    uint64_t    last_ts_ms;
    kv_zmq_pub_stats_t st;
} zpub_t;

/* Fingerprint of the message applied at seq (0: unknown, or not one of the
 * last RECENT). */
static uint64_t fp_at(const zpub_t *p, uint64_t seq)
{
    return p->recent_seq[seq % RECENT] == seq ? p->recent_fp[seq % RECENT] : 0;
}

static void remember(zpub_t *p, uint64_t seq, uint64_t fp)
{
    p->recent_seq[seq % RECENT] = seq;
    p->recent_fp[seq % RECENT] = fp;
}

struct kv_zmq {
    kv_zmq_config_t     cfg;
    zpub_t             *p;
    size_t              n;
    kv_index_t         *ix;
    kv_registry_t      *reg;
    void               *ctx;
    pthread_t           thread;
    int                 running;
    volatile int        stopping;
    kv_vllm_batch_t     batch;
    kv_stored_block_t  *blocks;
    size_t              cap_blocks;
    uint64_t           *rm;
    size_t              cap_rm;
    uint64_t           *rm_seq;         /* their sequence hashes, for on_drop */
    size_t              cap_rm_seq;
};

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t) ts.tv_sec * 1000 + (uint64_t) ts.tv_nsec / 1000000;
}

static void zlog(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static void zlog(const char *fmt, ...)
{
    va_list ap;

    va_start(ap, fmt);
    fputs("kvroute zmq: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

static char *dupstr(const char *s)
{
    return s ? strdup(s) : NULL;
}

/* --- tier map -------------------------------------------------------------- */

static size_t tslot(const tmap_t *m, uint64_t key)
{
    uint64_t h = key * 0x9E3779B97F4A7C15ULL;
    return (size_t) (h >> 17) & (m->cap - 1);
}

static uint64_t tmap_get(const tmap_t *m, uint64_t key)
{
    size_t i;

    if (m->cap == 0) {
        return 0;
    }
    for (i = tslot(m, key); m->s[i].mask; i = (i + 1) & (m->cap - 1)) {
        if (m->s[i].key == key) {
            return m->s[i].mask;
        }
    }
    return 0;
}

static int tmap_put(tmap_t *m, uint64_t key, uint64_t mask);

static int tmap_grow(tmap_t *m)
{
    tmap_t  old = *m, nm;
    size_t  i;

    nm.cap = old.cap ? old.cap * 2 : 1024;
    nm.n = 0;
    nm.s = calloc(nm.cap, sizeof(tslot_t));
    if (nm.s == NULL) {
        return -1;
    }
    *m = nm;
    for (i = 0; i < old.cap; i++) {
        if (old.s[i].mask) {
            tmap_put(m, old.s[i].key, old.s[i].mask);
        }
    }
    free(old.s);
    return 0;
}

/* Sets key's mask; mask 0 deletes (backward-shift, no tombstones). */
static int tmap_put(tmap_t *m, uint64_t key, uint64_t mask)
{
    size_t i, j, k;

    if (mask && (m->n + 1) * 4 > m->cap * 3 && tmap_grow(m) != 0) {
        return -1;
    }
    if (m->cap == 0) {
        return 0;
    }
    for (i = tslot(m, key); m->s[i].mask; i = (i + 1) & (m->cap - 1)) {
        if (m->s[i].key == key) {
            break;
        }
    }
    if (mask) {
        if (m->s[i].mask == 0) {
            m->n++;
        }
        m->s[i].key = key;
        m->s[i].mask = mask;
        return 0;
    }
    if (m->s[i].mask == 0) {
        return 0;
    }
    m->n--;
    m->s[i].mask = 0;
    for (j = (i + 1) & (m->cap - 1); m->s[j].mask; j = (j + 1) & (m->cap - 1)) {
        k = tslot(m, m->s[j].key);
        /* move j back into the hole at i unless its home lies in (i, j] */
        if ((j > i && (k <= i || k > j)) || (j < i && (k <= i && k > j))) {
            m->s[i] = m->s[j];
            m->s[j].mask = 0;
            i = j;
        }
    }
    return 0;
}

static void tmap_clear(tmap_t *m)
{
    free(m->s);
    memset(m, 0, sizeof(*m));
}

/* --- registry -------------------------------------------------------------- */

static void reg_update(kv_zmq_t *z, zpub_t *p, uint64_t now)
{
    kv_worker_rec_t *r;
    uint32_t         state;

    if (p->reg < 0) {
        return;
    }
    state = p->connected && !p->replaying && !p->mismatch ? KV_WORKER_LIVE : KV_WORKER_STALE;
    r = kv_registry_write_begin(z->reg, p->reg);
    r->state = state;
    r->block_size = p->engine_bs;
    /* messages applied in sequence: last seq + 1 (0: none yet), which a
     * reload's new helper adopts */
    r->last_event_applied = p->have_seq ? p->last_seq + 1 : 0;
    r->last_event_announced = r->last_event_applied;
    /* a ZMQ publisher announces no instance: the record keeps the
     * fingerprint of the message at last seq instead, so that a reload's
     * new helper can tell the stream it adopts from a restarted engine's */
    r->instance_id = p->have_seq ? fp_at(p, p->last_seq) : 0;
    r->last_seen_ms = now;
    r->events = p->st.events;
    r->gaps = p->st.gaps;
    r->resyncs = p->st.replays;
    r->apply_errors = p->st.apply_errors;
    kv_registry_write_end(z->reg, p->reg);
}

static void status_counts(kv_zmq_t *z);

/* --- applying ------------------------------------------------------------ */

/* Tells cfg.on_drop that the engine dropped these blocks (n 0: all). */
static void dropped(kv_zmq_t *z, zpub_t *p, const uint64_t *seq, size_t n)
{
    if (z->cfg.on_drop) {
        z->cfg.on_drop(z->cfg.on_drop_arg, p->worker_id, seq, n);
    }
}

static void clear_worker(kv_zmq_t *z, zpub_t *p, const char *why)
{
    dropped(z, p, NULL, 0);
    kv_index_worker_clear(z->ix, p->worker_id);
    tmap_clear(&p->tiers);
    tmap_clear(&p->salts);
    p->group_set = 0;           /* a restarted engine may serve another model */
    kv_registry_status_add(z->reg, KV_STATUS_OFF(cleared_workers), 1);
    if (z->cfg.sink) {
        z->cfg.sink(z->cfg.sink_arg, (size_t) (p - z->p), NULL);
    }
    zlog("%s (%s): blocks cleared: %s", p->cfg.server, p->cfg.endpoint, why);
}

static void event_head(kv_event_t *ev, const zpub_t *p, uint32_t dp, kv_event_kind_t kind)
{
    memset(ev, 0, sizeof(*ev));
    ev->worker_id = p->worker_id;
    ev->dp_rank = dp;
    ev->event_id = p->last_seq;
    ev->kind = kind;
}

/*
 * The local-hash seed of a stored event's blocks. vLLM names a request's
 * cache_salt only in the extra keys of its prompt's first block, but every
 * block after it is salted too (the router seeds all of a salted prompt's
 * blocks): a salted first block gives the salt's seed, a block whose parent
 * was salted the parent's, any other block its LoRA adapter's.
 */
static uint64_t chain_seed(zpub_t *p, const kv_vllm_event_t *e)
{
    uint64_t seed;

    if (kv_vllm_salted(e)) {
        return kv_hash_seed(e->salt, e->salt_len);
    }
    if (e->has_parent && (seed = tmap_get(&p->salts, e->parent)) != 0) {
        return seed;
    }
    return kv_vllm_lora_seed(e);
}

/* One decoded event into the index; a failure counts in the publisher's
 * apply_errors and in the zone's, which the status page shows. */
static int apply_event(kv_zmq_t *z, zpub_t *p, kv_event_t *ev, uint64_t now)
{
    char err[128];

    if (kv_index_apply(z->ix, ev, now, err, sizeof(err)) == 0) {
        return 0;
    }
    p->st.apply_errors++;
    kv_registry_status_add(z->reg, KV_STATUS_OFF(apply_errors), 1);
    return -1;
}

/* The block size the router hashes this publisher's server with; 0: any. */
static uint32_t router_bs(const kv_zmq_t *z, const zpub_t *p)
{
    return p->cfg.block_size ? p->cfg.block_size : z->cfg.block_size;
}

static void apply_stored(kv_zmq_t *z, zpub_t *p, const kv_vllm_event_t *e, uint32_t dp,
                         uint64_t now)
{
    kv_event_t  ev;
    uint64_t    seed, bit = 1ULL << e->tier, m;
    size_t      i;
    int         salted;

    if (p->engine_bs != e->block_size) {
        p->engine_bs = e->block_size;
        p->mismatch = router_bs(z, p) && router_bs(z, p) != e->block_size;
        if (p->mismatch) {
            zlog("%s (%s): BLOCK SIZE MISMATCH: the engine uses %u-token blocks, kvroute "
                 "is configured for %u; its events are ignored and it is routed by load "
                 "only until they agree", p->cfg.server, p->cfg.endpoint, e->block_size,
                 router_bs(z, p));
        }
        status_counts(z);
    }
    if (p->mismatch) {
        p->st.apply_errors++;
        return;
    }

    if (e->n_tokens == 0) {
        /* no token ids (e.g. a block offloaded to another tier): only blocks
         * already indexed can be credited to this tier */
        for (i = 0; i < e->n_hashes; i++) {
            m = tmap_get(&p->tiers, e->hashes[i]);
            if (m) {
                tmap_put(&p->tiers, e->hashes[i], m | bit);
            } else {
                p->st.unresolved++;
            }
        }
        return;
    }

    if (kv_grow((void **) &z->blocks, &z->cap_blocks, e->n_hashes, sizeof(kv_stored_block_t)) != 0) {
        p->st.apply_errors++;
        return;
    }
    seed = chain_seed(p, e);
    salted = seed != kv_vllm_lora_seed(e);
    for (i = 0; i < e->n_hashes; i++) {
        z->blocks[i].block_hash = e->hashes[i];
        z->blocks[i].tokens_hash = kv_hash_block(e->tokens + i * e->block_size,
                                                 e->block_size, seed);
        if (salted) {
            tmap_put(&p->salts, e->hashes[i], seed);    /* for its children */
        }
    }
    event_head(&ev, p, dp, KV_EVENT_STORED);
    ev.has_parent = e->has_parent;
    ev.parent_hash = e->parent;
    ev.blocks = z->blocks;
    ev.n_blocks = e->n_hashes;
    if (apply_event(z, p, &ev, now) != 0) {
        return;
    }
    for (i = 0; i < e->n_hashes; i++) {
        tmap_put(&p->tiers, e->hashes[i], tmap_get(&p->tiers, e->hashes[i]) | bit);
    }
    kv_registry_status_add(z->reg, KV_STATUS_OFF(blocks), e->n_hashes);
}

static void apply_removed(kv_zmq_t *z, zpub_t *p, const kv_vllm_event_t *e, uint32_t dp,
                          uint64_t now)
{
    kv_event_t  ev;
    uint64_t    bit = 1ULL << e->tier, m;
    size_t      i, n = 0;

    if (kv_grow((void **) &z->rm, &z->cap_rm, e->n_hashes, sizeof(uint64_t)) != 0) {
        p->st.apply_errors++;
        return;
    }
    for (i = 0; i < e->n_hashes; i++) {
        m = tmap_get(&p->tiers, e->hashes[i]);
        if (m & ~bit) {
            tmap_put(&p->tiers, e->hashes[i], m & ~bit);    /* another tier holds it */
            continue;
        }
        tmap_put(&p->tiers, e->hashes[i], 0);
        tmap_put(&p->salts, e->hashes[i], 0);
        z->rm[n++] = e->hashes[i];
    }
    if (n == 0) {
        return;
    }
    if (z->cfg.on_drop) {
        /* the sequence hashes, read before the index forgets the engine's */
        if (kv_grow((void **) &z->rm_seq, &z->cap_rm_seq, n, sizeof(uint64_t)) != 0) {
            dropped(z, p, NULL, 0);
        } else {
            for (i = 0; i < n; i++) {
                z->rm_seq[i] = kv_index_seq_of(z->ix, p->worker_id, dp, z->rm[i]);
            }
            dropped(z, p, z->rm_seq, n);
        }
    }
    event_head(&ev, p, dp, KV_EVENT_REMOVED);
    ev.hashes = z->rm;
    ev.n_hashes = n;
    if (apply_event(z, p, &ev, now) != 0) {
        return;
    }
    kv_registry_status_add(z->reg, KV_STATUS_OFF(blocks), n);
}

/*
 * Hybrid models (full attention beside sliding-window or mamba layers)
 * publish each KV cache group's blocks with its group_idx, often under the
 * same block hashes. Only a group that keeps every block of a prefix says
 * how much of a prompt an engine can reuse; a sliding-window group drops
 * blocks that left its window while the prefix is still cached. So kv_zmq
 * keeps the first full-attention group a publisher names and drops the
 * events of its other groups (counted in other_groups). Events without a
 * group_idx, and every event until a publisher names such a group, are
 * applied as they come.
 */
/* Drops other groups' events from b (so the sink sees what was applied);
 * returns how many. */
static size_t keep_prefix_group(zpub_t *p, kv_vllm_batch_t *b)
{
    size_t i, kept = 0, dropped;

    for (i = 0; i < b->n_events && !p->group_set; i++) {
        if (b->events[i].kind == KV_VLLM_STORED && b->events[i].has_group
            && kv_vllm_full_attention(&b->events[i]))
        {
            p->group_set = 1;
            p->group = b->events[i].group_idx;
            zlog("%s (%s): hybrid KV cache: indexing group %u (%.*s), the other groups' "
                 "events are dropped", p->cfg.server, p->cfg.endpoint, p->group,
                 (int) b->events[i].spec_kind_len, b->events[i].spec_kind);
        }
    }
    if (!p->group_set) {
        return 0;
    }
    for (i = 0; i < b->n_events; i++) {
        if (b->events[i].has_group && b->events[i].group_idx != p->group) {
            p->st.other_groups++;
            continue;
        }
        b->events[kept++] = b->events[i];
    }
    dropped = b->n_events - kept;
    b->n_events = kept;
    return dropped;
}

/* Which message a sequence number named: a restarted engine reuses the
 * numbers, but not its batches' bytes (the batch's ts at least differs). */
static uint64_t payload_fp(const void *buf, size_t len)
{
    uint64_t h = kv_hash_seed((const char *) buf, len);    /* XXH3-64 of the bytes + 1337 */

    return h ? h : 1;
}

/* Decodes and applies one message whose place in the sequence is right. */
static void apply(kv_zmq_t *z, zpub_t *p, uint64_t seq, const void *buf, size_t len,
                  uint64_t now)
{
    kv_vllm_batch_t *b = &z->batch;
    size_t           i, skipped;
    uint32_t         dp;
    uint64_t         ts;
    char             err[160];

    p->have_seq = 1;
    p->last_seq = seq;
    remember(p, seq, payload_fp(buf, len));
    kv_registry_status_add(z->reg, KV_STATUS_OFF(messages), 1);

    if (kv_vllm_decode(b, buf, len, err, sizeof(err)) != 0) {
        p->st.malformed++;
        kv_registry_status_add(z->reg, KV_STATUS_OFF(decode_errors), 1);
        if (p->st.malformed <= 10 || z->cfg.verbose) {
            zlog("%s (%s): malformed message seq %llu skipped: %s", p->cfg.server,
                 p->cfg.endpoint, (unsigned long long) seq, err);
        }
        return;
    }
    skipped = keep_prefix_group(p, b) + b->unknown;
    if (skipped) {
        kv_registry_status_add(z->reg, KV_STATUS_OFF(skipped_events), skipped);
    }
    /* A publisher that is its server's only one is that engine whatever
     * rank it names: vLLM's data parallelism with a port per rank (its
     * external load balancing) sends rank k from the engine behind its own
     * server, and routing reads a server's rank 0. Several publishers for
     * one server (a rank per port behind one HTTP port) keep their ranks
     * apart. */
    dp = b->has_dp_rank && !p->sole ? b->dp_rank : 0;
    for (i = 0; i < b->n_events; i++) {
        const kv_vllm_event_t *e = &b->events[i];

        switch (e->kind) {
        case KV_VLLM_STORED:
            apply_stored(z, p, e, dp, now);
            break;
        case KV_VLLM_REMOVED:
            apply_removed(z, p, e, dp, now);
            break;
        case KV_VLLM_CLEARED:
            dropped(z, p, NULL, 0);
            kv_index_worker_clear(z->ix, p->worker_id);
            tmap_clear(&p->tiers);
            tmap_clear(&p->salts);
            break;
        }
    }
    p->st.events += b->n_events;
    kv_registry_status_add(z->reg, KV_STATUS_OFF(events), b->n_events);
    if (b->ts > 0 && b->ts < 1e12) {       /* seconds; NaN and nonsense skipped */
        ts = (uint64_t) (b->ts * 1000.0);
        kv_registry_status_set(z->reg, KV_STATUS_OFF(last_event_lag_ms), now > ts ? now - ts : 0);
    }
    kv_registry_status_set(z->reg, KV_STATUS_OFF(last_event_ms), now);
    if (z->cfg.sink) {
        z->cfg.sink(z->cfg.sink_arg, (size_t) (p - z->p), b);
    }
}

/* --- sequence, replay ------------------------------------------------------ */

static int hold(kv_zmq_t *z, zpub_t *p, uint64_t seq, const void *buf, size_t len)
{
    held_t *h;

    if (p->n_held >= z->cfg.hold_messages || p->held_bytes + len > HOLD_BYTES_MAX
        || kv_grow((void **) &p->held, &p->cap_held, p->n_held + 1, sizeof(held_t)) != 0)
    {
        return -1;
    }
    h = &p->held[p->n_held];
    h->data = malloc(len ? len : 1);
    if (h->data == NULL) {
        return -1;
    }
    memcpy(h->data, buf, len);
    h->len = len;
    h->seq = seq;
    p->n_held++;
    p->held_bytes += len;
    return 0;
}

static int can_replay(const zpub_t *p, uint64_t now)
{
    return p->rep != NULL && now >= p->no_replay_until_ms;
}

/*
 * Asks the publisher's replay socket for what we lack. A stream we follow
 * is asked from its last applied seq, not the next one: the first reply
 * must be that very message (same fingerprint), which proves the publisher
 * is the process whose stream the index holds. A restarted engine numbers
 * from 0 again and may be past our seq by the time we reach it; its
 * message at our seq is another batch (on_replay).
 */
static int start_replay(kv_zmq_t *z, zpub_t *p, uint64_t now)
{
    uint8_t  be[8];
    uint64_t from = p->have_seq ? p->last_seq : 0, v = from;
    int      i;

    for (i = 7; i >= 0; i--) {
        be[i] = (uint8_t) v;
        v >>= 8;
    }
    /* [empty delimiter, start seq]: the ROUTER sees [id, "", seq], as from REQ */
    if (zmq_send(p->rep, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0
        || zmq_send(p->rep, be, 8, ZMQ_DONTWAIT) < 0)
    {
        zlog("%s (%s): replay request failed: %s", p->cfg.server, p->cfg.replay,
             zmq_strerror(errno));
        return -1;
    }
    p->replaying = 1;
    p->verify = p->have_seq;
    p->replay_from = from;
    p->replay_deadline_ms = now + z->cfg.replay_timeout_ms;
    p->st.replays++;
    kv_registry_status_add(z->reg, KV_STATUS_OFF(resyncs), 1);
    if (z->cfg.verbose) {
        zlog("%s: replay from %llu", p->cfg.server, (unsigned long long) (from));
    }
    return 0;
}

static void on_message(kv_zmq_t *z, zpub_t *p, uint64_t seq, const void *buf, size_t len,
                       uint64_t now);

/* The message at seq is one applied lately, byte for byte. A restarted
 * engine's message at an old number is another batch (its timestamp, at
 * least, differs). */
static int applied_already(const zpub_t *p, uint64_t seq, const void *buf, size_t len)
{
    uint64_t fp = fp_at(p, seq);

    return fp != 0 && fp == payload_fp(buf, len);
}

/* Where seq stands against what was applied: apply, replay or clear. */
static void sequence(kv_zmq_t *z, zpub_t *p, uint64_t seq, const void *buf, size_t len,
                     uint64_t now)
{
    if (!p->have_seq) {
        if (seq != 0 && can_replay(p, now) && start_replay(z, p, now) == 0) {
            hold(z, p, seq, buf, len);
            return;
        }
        apply(z, p, seq, buf, len, now);
        return;
    }
    if (seq == p->last_seq + 1) {
        apply(z, p, seq, buf, len, now);
        return;
    }
    if (seq <= p->last_seq && applied_already(p, seq, buf, len)) {
        return;     /* the live copy of a message the replay gave: seen */
    }
    if (seq <= p->last_seq) {
        p->st.restarts++;
        kv_registry_status_add(z->reg, KV_STATUS_OFF(engine_restarts), 1);
        clear_worker(z, p, "sequence restarted (engine restart)");
        p->have_seq = 0;
        sequence(z, p, seq, buf, len, now);
        return;
    }
    p->st.gaps++;
    kv_registry_status_add(z->reg, KV_STATUS_OFF(gaps), 1);
    zlog("%s (%s): gap: seq %llu after %llu", p->cfg.server, p->cfg.endpoint,
         (unsigned long long) seq, (unsigned long long) p->last_seq);
    if (can_replay(p, now) && start_replay(z, p, now) == 0) {
        hold(z, p, seq, buf, len);
        return;
    }
    clear_worker(z, p, "events lost and no replay");
    apply(z, p, seq, buf, len, now);
}

/* Applies the held live messages (some may start another replay); those
 * the replay already gave are skipped. */
static void release_held(kv_zmq_t *z, zpub_t *p, uint64_t from, uint64_t now)
{
    held_t  *h = p->held;
    size_t   n = p->n_held, i;

    p->held = NULL;
    p->n_held = p->cap_held = p->held_bytes = 0;
    for (i = 0; i < n; i++) {
        if (!(p->have_seq && h[i].seq >= from && h[i].seq <= p->last_seq)) {
            on_message(z, p, h[i].seq, h[i].data, h[i].len, now);
        }
        free(h[i].data);
    }
    free(h);
}

static void replay_failed(kv_zmq_t *z, zpub_t *p, const char *why, uint64_t now)
{
    p->st.replay_failures++;
    kv_registry_status_add(z->reg, KV_STATUS_OFF(dump_failures), 1);
    p->replaying = 0;
    p->verify = p->rewind = 0;
    p->no_replay_until_ms = now + NO_REPLAY_MS;
    clear_worker(z, p, why);
    /* go on from the first held message, whatever came before */
    p->have_seq = 0;
    if (p->rep) {
        /* drop replies that may still come for the abandoned request */
        int linger = 0;
        zmq_setsockopt(p->rep, ZMQ_LINGER, &linger, sizeof(linger));
        zmq_close(p->rep);
        p->rep = zmq_socket(z->ctx, ZMQ_DEALER);
        if (p->rep) {
            zmq_setsockopt(p->rep, ZMQ_LINGER, &linger, sizeof(linger));
            if (zmq_connect(p->rep, p->cfg.replay) != 0) {
                zmq_close(p->rep);
                p->rep = NULL;
            }
        }
    }
    release_held(z, p, UINT64_MAX, now);
}

static void on_message(kv_zmq_t *z, zpub_t *p, uint64_t seq, const void *buf, size_t len,
                       uint64_t now)
{
    p->st.messages++;
    if (p->replaying) {
        if (hold(z, p, seq, buf, len) != 0) {
            kv_registry_status_add(z->reg, KV_STATUS_OFF(buffer_overflows), 1);
            replay_failed(z, p, "too many live messages held during a replay", now);
            on_message(z, p, seq, buf, len, now);
        }
        return;
    }
    sequence(z, p, seq, buf, len, now);
}

/*
 * The publisher is not (or cannot be shown to be) the process whose stream
 * the index follows: its blocks go, and the stream is learnt again from
 * the start of the publisher's buffer once this replay has ended.
 */
static void stream_replaced(kv_zmq_t *z, zpub_t *p, int restarted, const char *why)
{
    if (restarted) {
        p->st.restarts++;
        kv_registry_status_add(z->reg, KV_STATUS_OFF(engine_restarts), 1);
    } else {
        p->st.gaps++;
    }
    clear_worker(z, p, why);
    p->have_seq = 0;
    p->verify = 0;
    p->rewind = 1;
}

/* The first reply to a replay from last_seq: our message, or another's. */
static void verify_stream(kv_zmq_t *z, zpub_t *p, uint64_t seq, const void *buf, size_t len)
{
    p->verify = 0;
    if (seq == p->last_seq && (fp_at(p, seq) == 0 || applied_already(p, seq, buf, len))) {
        return;     /* the same process: the replay goes on from here */
    }
    if (seq > p->last_seq) {
        stream_replaced(z, p, 0, "replay does not reach back far enough");
    } else {
        stream_replaced(z, p, 1, "the replay's message at our last seq is another "
                        "(engine restart)");
    }
}

/* One reply of the replay socket: [seq, payload], seq -1 at the end. */
static void on_replay(kv_zmq_t *z, zpub_t *p, uint64_t seq, const void *buf, size_t len,
                      uint64_t now)
{
    if (!p->replaying) {
        return;     /* late reply to an abandoned request */
    }
    if (seq == END_SEQ && p->verify) {
        /* nothing from our last seq on: the same process would still
         * hold the message it sent last (its buffer drops the oldest) */
        stream_replaced(z, p, 1, "the replay has nothing from our last seq on "
                        "(engine restart)");
    }
    if (seq == END_SEQ && p->rewind) {
        p->rewind = 0;
        if (start_replay(z, p, now) != 0) {
            replay_failed(z, p, "replay request failed", now);
        }
        return;
    }
    if (seq == END_SEQ) {
        p->replaying = 0;
        kv_registry_status_add(z->reg, KV_STATUS_OFF(dumps), 1);
        if (z->cfg.verbose) {
            zlog("%s: replay done at %llu", p->cfg.server, (unsigned long long) p->last_seq);
        }
        release_held(z, p, p->replay_from, now);
        return;
    }
    /* a replay that makes progress is not timed out */
    p->replay_deadline_ms = now + z->cfg.replay_timeout_ms;
    if (p->rewind) {
        return;     /* another process's tail: the replay from 0 gives it again */
    }
    if (p->verify) {
        verify_stream(z, p, seq, buf, len);
        if (p->rewind) {
            return;
        }
    }
    if (p->have_seq && seq <= p->last_seq) {
        return;     /* already applied */
    }
    if (p->have_seq && seq != p->last_seq + 1) {
        /* the publisher's buffer no longer reaches back to what we lack */
        p->st.gaps++;
        clear_worker(z, p, "replay does not reach back far enough");
    }
    apply(z, p, seq, buf, len, now);
}

void kv_zmq_feed(kv_zmq_t *z, size_t i, uint64_t seq, const void *payload, size_t len,
                 uint64_t now)
{
    if (i < z->n) {
        on_message(z, &z->p[i], seq, payload, len, now);
        reg_update(z, &z->p[i], now);
    }
}

void kv_zmq_pub_stats(kv_zmq_t *z, size_t i, kv_zmq_pub_stats_t *out)
{
    zpub_t *p = &z->p[i];

    *out = p->st;
    out->connected = p->connected;
    out->replaying = p->replaying;
    out->have_seq = p->have_seq;
    out->last_seq = p->last_seq;
    out->engine_block_size = p->engine_bs;
    out->block_size_mismatch = p->mismatch;
}

/* --- sockets ----------------------------------------------------------------- */

/* Receives one multipart message: up to max frames into f (the rest
 * dropped); the frame count, or -1 when nothing is waiting. */
static int recv_multi(void *s, zmq_msg_t *f, int max)
{
    int       n = 0, more;
    size_t    sz = sizeof(more);
    zmq_msg_t extra;

    for (;;) {
        zmq_msg_t *m = n < max ? &f[n] : &extra;

        zmq_msg_init(m);
        if (zmq_msg_recv(m, s, n == 0 ? ZMQ_DONTWAIT : 0) < 0) {
            zmq_msg_close(m);
            return n == 0 ? -1 : n;
        }
        n++;
        more = 0;
        zmq_getsockopt(s, ZMQ_RCVMORE, &more, &sz);
        if (m == &extra) {
            zmq_msg_close(m);
        }
        if (!more) {
            return n;
        }
    }
}

static void close_frames(zmq_msg_t *f, int n)
{
    int i;

    for (i = 0; i < n && i < 4; i++) {
        zmq_msg_close(&f[i]);
    }
}

static int drain_monitor(kv_zmq_t *z, zpub_t *p, uint64_t now);

static void drain_sub(kv_zmq_t *z, zpub_t *p, uint64_t now)
{
    zmq_msg_t f[4];
    uint64_t  seq;
    int       n, k;

    for (k = 0; k < DRAIN_MAX; k++) {
        n = recv_multi(p->sub, f, 4);
        if (n < 0) {
            break;
        }
        /* A message of a new connection comes after its connect event
         * (libzmq's I/O thread queues both, in that order): a reconnect
         * is known before that connection's first message is taken. */
        drain_monitor(z, p, now);
        if (n != 3 || kv_vllm_seq(zmq_msg_data(&f[1]), zmq_msg_size(&f[1]), &seq) != 0) {
            p->st.malformed++;
            kv_registry_status_add(z->reg, KV_STATUS_OFF(decode_errors), 1);
            if (p->st.malformed <= 10) {
                zlog("%s (%s): malformed message of %d frames skipped (expected topic, "
                     "8-byte seq, payload)", p->cfg.server, p->cfg.endpoint, n);
            }
        } else {
            on_message(z, p, seq, zmq_msg_data(&f[2]), zmq_msg_size(&f[2]), now);
        }
        close_frames(f, n);
    }
}

static void drain_replay(kv_zmq_t *z, zpub_t *p, uint64_t now)
{
    zmq_msg_t f[4];
    uint64_t  seq;
    int       n, k, at;

    for (k = 0; k < DRAIN_MAX && p->rep; k++) {
        n = recv_multi(p->rep, f, 4);
        if (n < 0) {
            break;
        }
        /* [empty, seq, payload] (or without the delimiter) */
        at = n >= 3 && zmq_msg_size(&f[0]) == 0 ? 1 : 0;
        if (n - at != 2 || kv_vllm_seq(zmq_msg_data(&f[at]), zmq_msg_size(&f[at]), &seq) != 0) {
            p->st.malformed++;
            kv_registry_status_add(z->reg, KV_STATUS_OFF(decode_errors), 1);
        } else {
            on_replay(z, p, seq, zmq_msg_data(&f[at + 1]), zmq_msg_size(&f[at + 1]), now);
        }
        close_frames(f, n);
        if (p->rep == NULL) {
            break;
        }
    }
}

/* Publishers connected and mismatched; "nats" in the status says whether
 * every publisher (connected), some (reconnecting) or none is reachable. */
static void status_counts(kv_zmq_t *z)
{
    size_t i, up = 0, mism = 0;

    for (i = 0; i < z->n; i++) {
        up += z->p[i].connected;
        mism += z->p[i].mismatch;
    }
    kv_registry_status_set(z->reg, KV_STATUS_OFF(zmq_connected), up);
    kv_registry_status_set(z->reg, KV_STATUS_OFF(block_size_mismatch), mism);
    kv_registry_status_set(z->reg, KV_STATUS_OFF(nats_state),
                           up == z->n ? KV_NATS_CONNECTED
                           : up ? KV_NATS_RECONNECTING : KV_NATS_CONNECTING);
}

/*
 * Connected again after a time we were not listening (a disconnect, or the
 * previous helper's): the publisher may be the same process (a network
 * blip) or a restarted engine, which may even be past our seq already.
 * A replay tells (start_replay). Without one, after a disconnect (which
 * the engine's exit causes) the blocks go: a blip then costs hits, a
 * restart never leaves blocks the engine no longer has. A reload's first
 * connect saw no disconnect: there the first message judges (sequence():
 * the next seq goes on, anything else clears), so that a reload does not
 * cost every such worker its blocks.
 */
static void reconnected(kv_zmq_t *z, zpub_t *p, int adopted, uint64_t now)
{
    if (!p->have_seq || p->replaying) {
        return;     /* nothing to vouch for, or a replay verifies already */
    }
    if (can_replay(p, now) && start_replay(z, p, now) == 0) {
        return;
    }
    if (adopted) {
        return;
    }
    clear_worker(z, p, "reconnected, and no replay to tell a restart from a blip");
    p->have_seq = 0;
}

/* Monitor events; returns how many. */
static int drain_monitor(kv_zmq_t *z, zpub_t *p, uint64_t now)
{
    zmq_msg_t f[4];
    uint16_t  event;
    int       n, seen = 0;

    while ((n = recv_multi(p->mon, f, 4)) >= 0) {
        seen++;
        if (n >= 1 && zmq_msg_size(&f[0]) >= 2) {
            memcpy(&event, zmq_msg_data(&f[0]), 2);
            if (event == ZMQ_EVENT_CONNECTED && !p->connected) {
                p->connected = 1;
                kv_registry_status_add(z->reg, KV_STATUS_OFF(connects), 1);
                zlog("%s: connected to %s", p->cfg.server, p->cfg.endpoint);
                if (p->ever_connected) {
                    reconnected(z, p, p->adopted, now);
                }
                p->ever_connected = 1;
                p->adopted = 0;
            } else if (event == ZMQ_EVENT_DISCONNECTED && p->connected) {
                p->connected = 0;
                kv_registry_status_add(z->reg, KV_STATUS_OFF(disconnects), 1);
                zlog("%s: lost %s: routed by load only until it is back", p->cfg.server,
                     p->cfg.endpoint);
            }
        }
        close_frames(f, n);
    }
    if (seen) {
        status_counts(z);
    }
    return seen;
}

/* A socket that drops nothing queued (no high-water mark), lingers not at
 * close and reconnects every 100 ms at first. */
static void *zsocket(kv_zmq_t *z, int type, char *err, size_t errlen)
{
    int   zero = 0, ivl = 100;
    void *s;

    s = zmq_socket(z->ctx, type);
    if (s == NULL) {
        snprintf(err, errlen, "zmq_socket: %s", zmq_strerror(errno));
        return NULL;
    }
    zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof(zero));
    zmq_setsockopt(s, ZMQ_RCVHWM, &zero, sizeof(zero));
    zmq_setsockopt(s, ZMQ_RECONNECT_IVL, &ivl, sizeof(ivl));
    return s;
}

static int open_pub(kv_zmq_t *z, zpub_t *p, size_t i, char *err, size_t errlen)
{
    char addr[64];
    int  ivl_max = 2000, hb = 1000, hb_to = 3000;

    p->sub = zsocket(z, ZMQ_SUB, err, errlen);
    p->mon_id = (int) i;
    if (p->sub == NULL) {
        return -1;
    }
    zmq_setsockopt(p->sub, ZMQ_RECONNECT_IVL_MAX, &ivl_max, sizeof(ivl_max));
    zmq_setsockopt(p->sub, ZMQ_HEARTBEAT_IVL, &hb, sizeof(hb));
    zmq_setsockopt(p->sub, ZMQ_HEARTBEAT_TIMEOUT, &hb_to, sizeof(hb_to));
    zmq_setsockopt(p->sub, ZMQ_SUBSCRIBE, p->cfg.topic ? p->cfg.topic : "",
                   p->cfg.topic ? strlen(p->cfg.topic) : 0);

    snprintf(addr, sizeof(addr), "inproc://kvroute-zmq-mon-%p-%zu", (void *) z, i);
    if (zmq_socket_monitor(p->sub, addr, ZMQ_EVENT_CONNECTED | ZMQ_EVENT_DISCONNECTED) != 0
        || (p->mon = zmq_socket(z->ctx, ZMQ_PAIR)) == NULL
        || zmq_connect(p->mon, addr) != 0)
    {
        snprintf(err, errlen, "zmq monitor: %s", zmq_strerror(errno));
        return -1;
    }
    if (zmq_connect(p->sub, p->cfg.endpoint) != 0) {
        snprintf(err, errlen, "%s: %s", p->cfg.endpoint, zmq_strerror(errno));
        return -1;
    }
    if (p->cfg.replay) {
        p->rep = zsocket(z, ZMQ_DEALER, err, errlen);
        if (p->rep == NULL) {
            return -1;
        }
        if (zmq_connect(p->rep, p->cfg.replay) != 0) {
            snprintf(err, errlen, "%s: %s", p->cfg.replay, zmq_strerror(errno));
            return -1;
        }
    }
    return 0;
}

static void *run(void *arg)
{
    kv_zmq_t       *z = arg;
    zmq_pollitem_t *items;
    size_t          i, k, n;
    uint64_t        now, last_reg = 0;

    items = calloc(z->n * 3, sizeof(*items));
    if (items == NULL) {
        zlog("out of memory");
        return NULL;
    }
    while (!z->stopping) {
        for (i = 0, n = 0; i < z->n; i++) {
            zpub_t *p = &z->p[i];

            items[n++] = (zmq_pollitem_t) { p->sub, 0, ZMQ_POLLIN, 0 };
            items[n++] = (zmq_pollitem_t) { p->mon, 0, ZMQ_POLLIN, 0 };
            if (p->rep) {
                items[n++] = (zmq_pollitem_t) { p->rep, 0, ZMQ_POLLIN, 0 };
            }
        }
        if (zmq_poll(items, (int) n, 100) < 0 && errno != EINTR) {
            if (errno == ETERM) {
                break;
            }
        }
        now = now_ms();
        for (i = 0, k = 0; i < z->n; i++) {
            zpub_t *p = &z->p[i];
            int     busy = 0;

            if (items[k++].revents & ZMQ_POLLIN) {
                drain_sub(z, p, now);
                busy = 1;
            }
            if (items[k++].revents & ZMQ_POLLIN) {
                drain_monitor(z, p, now);
                busy = 1;
            }
            if (p->rep && k < n && items[k].socket == p->rep) {
                if (items[k].revents & ZMQ_POLLIN) {
                    drain_replay(z, p, now);
                    busy = 1;
                }
                k++;
            }
            if (p->replaying && now >= p->replay_deadline_ms) {
                zlog("%s (%s): replay timed out", p->cfg.server, p->cfg.replay);
                replay_failed(z, p, "replay timed out", now);
                busy = 1;
            }
            if (busy) {
                reg_update(z, p, now);
            }
        }
        if (now - last_reg >= 500) {
            for (i = 0; i < z->n; i++) {
                reg_update(z, &z->p[i], now);
            }
            status_counts(z);
            last_reg = now;
        }
    }
    free(items);
    return NULL;
}

/* --- lifecycle -------------------------------------------------------------- */

/*
 * The registry record of p's worker, and what the index holds for it. After
 * an nginx reload the previous helper's record says up to which sequence
 * number the index is right for this publisher: that is kept, and a replay
 * from there is asked for as soon as the publisher is reached (so nothing
 * published during the handover is lost). Only the tier map is gone, so a
 * device-tier removal of a block another tier holds drops it (under-credit,
 * never a phantom). Anything else (no record, another address, nothing
 * applied) starts clean: blocks cleared, a replay from 0 refills what the
 * publisher's buffer still holds.
 */
static void adopt(kv_zmq_t *z, zpub_t *p, const char *server)
{
    kv_worker_rec_t  old, *r;
    int              i;

    i = kv_registry_find(z->reg, p->worker_id, 0);
    if (i >= 0 && kv_registry_read(z->reg, i, &old) == 0
        && strncmp(old.address, server, sizeof(old.address)) == 0
        && old.last_event_applied > 0)
    {
        p->have_seq = 1;
        p->last_seq = old.last_event_applied - 1;
        remember(p, p->last_seq, old.instance_id);     /* 0: a registry older than that */
        p->ever_connected = 1;      /* the first connect asks for a catch-up replay */
        p->adopted = 1;
        p->engine_bs = old.block_size;
        p->mismatch = router_bs(z, p) && p->engine_bs && p->engine_bs != router_bs(z, p);
        p->st.events = old.events;
        p->st.gaps = old.gaps;
        p->st.replays = old.resyncs;
        p->st.apply_errors = old.apply_errors;
        zlog("%s: adopted from the previous helper at seq %llu", server,
             (unsigned long long) p->last_seq);
    } else {
        kv_index_worker_clear(z->ix, p->worker_id);
    }
    p->reg = kv_registry_add(z->reg, p->worker_id, 0);
    if (p->reg >= 0) {
        r = kv_registry_write_begin(z->reg, p->reg);
        snprintf(r->address, sizeof(r->address), "%s", server);
        r->state = KV_WORKER_STALE;
        r->block_size = p->engine_bs;
        r->last_seen_ms = now_ms();
        kv_registry_write_end(z->reg, p->reg);
    }
}

/* Which publishers are the only one for their server (once, at start). */
static void mark_sole(kv_zmq_t *z)
{
    size_t i, j;

    for (i = 0; i < z->n; i++) {
        z->p[i].sole = 1;
        for (j = 0; j < z->n && z->p[i].sole; j++) {
            z->p[i].sole = j == i || z->p[j].worker_id != z->p[i].worker_id;
        }
    }
}

kv_zmq_t *kv_zmq_create(const kv_zmq_config_t *cfg, kv_index_t *ix, kv_registry_t *reg,
                        char *err, size_t errlen)
{
    kv_zmq_t        *z;
    size_t           i;

    if (cfg->n_pubs == 0) {
        snprintf(err, errlen, "no ZMQ publishers");
        return NULL;
    }
    z = calloc(1, sizeof(*z));
    if (z == NULL || (z->p = calloc(cfg->n_pubs, sizeof(zpub_t))) == NULL) {
        free(z);
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    z->cfg = *cfg;
    z->cfg.pubs = NULL;
    if (z->cfg.replay_timeout_ms == 0) {
        z->cfg.replay_timeout_ms = 2000;
    }
    if (z->cfg.hold_messages == 0) {
        z->cfg.hold_messages = 100000;
    }
    z->n = cfg->n_pubs;
    z->ix = ix;
    z->reg = reg;
    kv_vllm_batch_init(&z->batch);

    for (i = 0; i < z->n; i++) {
        zpub_t                    *p = &z->p[i];
        const kv_zmq_pub_config_t *c = &cfg->pubs[i];

        if (c->endpoint == NULL || c->server == NULL
            || strlen(c->server) >= KV_REGISTRY_ADDR_MAX)
        {
            snprintf(err, errlen, "publisher %zu: needs an endpoint and a server", i);
            kv_zmq_destroy(z);
            return NULL;
        }
        p->cfg.endpoint = dupstr(c->endpoint);
        p->cfg.replay = dupstr(c->replay);
        p->cfg.server = dupstr(c->server);
        p->cfg.topic = dupstr(c->topic);
        p->cfg.block_size = c->block_size;
        p->worker_id = kv_hash_worker_id(c->server, strlen(c->server));
        adopt(z, p, c->server);
    }
    mark_sole(z);
    kv_registry_status_set(reg, KV_STATUS_OFF(zmq_publishers), z->n);
    return z;
}

static int start(kv_zmq_t *z, char *err, size_t errlen)
{
    size_t i;

    z->ctx = zmq_ctx_new();
    if (z->ctx == NULL) {
        snprintf(err, errlen, "zmq_ctx_new: %s", zmq_strerror(errno));
        return -1;
    }
    for (i = 0; i < z->n; i++) {
        if (open_pub(z, &z->p[i], i, err, errlen) != 0) {
            return -1;
        }
    }
    if (pthread_create(&z->thread, NULL, run, z) != 0) {
        snprintf(err, errlen, "pthread_create failed");
        return -1;
    }
    pthread_setname_np(z->thread, "kvroute-zmq");     /* top -H, benchmarks */
    z->running = 1;
    return 0;
}

/* libzmq's threads (and ours) must not take the host's signals. */
int kv_zmq_start(kv_zmq_t *z, char *err, size_t errlen)
{
    sigset_t  old;
    int       rc;

    kv_signals_block(&old);
    rc = start(z, err, errlen);
    kv_signals_restore(&old);
    return rc;
}

void kv_zmq_tick(kv_zmq_t *z, uint64_t now)
{
    kv_registry_status_set(z->reg, KV_STATUS_OFF(updated_ms), now);
}

void kv_zmq_stop(kv_zmq_t *z)
{
    if (z->running) {
        z->stopping = 1;
        pthread_join(z->thread, NULL);
        z->running = 0;
    }
}

void kv_zmq_destroy(kv_zmq_t *z)
{
    size_t i, k;

    if (z == NULL) {
        return;
    }
    kv_zmq_stop(z);
    for (i = 0; i < z->n; i++) {
        zpub_t *p = &z->p[i];

        if (p->sub) {
            zmq_socket_monitor(p->sub, NULL, 0);
            zmq_close(p->sub);
        }
        if (p->mon) zmq_close(p->mon);
        if (p->rep) zmq_close(p->rep);
        for (k = 0; k < p->n_held; k++) {
            free(p->held[k].data);
        }
        free(p->held);
        tmap_clear(&p->tiers);
        tmap_clear(&p->salts);
        free((char *) p->cfg.endpoint);
        free((char *) p->cfg.replay);
        free((char *) p->cfg.server);
        free((char *) p->cfg.topic);
    }
    if (z->ctx) {
        zmq_ctx_term(z->ctx);
    }
    kv_vllm_batch_free(&z->batch);
    free(z->blocks);
    free(z->rm);
    free(z->rm_seq);
    free(z->p);
    free(z);
}
