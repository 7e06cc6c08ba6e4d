/*
 * Per-worker consistency (docs/PROTOCOL.md, router side).
 *
 * For each (worker_id, dp_rank): events apply in event_id order; a
 * duplicate (id <= last applied) is dropped; a gap (id > last + 1) of a
 * worker that announced itself starts a resync: ask it for a dump, buffer
 * its events meanwhile, replace its blocks with the dump, then apply only
 * the buffered events after the dump's last_event_id. A worker that never
 * announced (Dynamo-published events) cannot be asked, so its events apply
 * as they come and gaps are only counted.
 *
 * Every function here runs with ing->mu held.
 */
#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_ingest_int.h"
#include "kv_jscan.h"
#include "kv_proto.h"

#define RESYNC_RETRY_MS 500

/*
 * Plausibility (docs/SECURITY.md). Anyone who can publish on the events
 * subject can send any event id; an id is believed only if it is within
 * AHEAD_MAX of what the worker itself announced (or we applied). Farther
 * ahead, applying it would make every later real event a "duplicate": it
 * is dropped and the worker resynced instead.
 */
#define AHEAD_MAX 65536
/* Reported load above these is a lie or a bug: clamped (tokens per worker
 * when it reports no capacity; queue lengths). */
#define LOAD_TOKENS_MAX (1ull << 26)
#define LOAD_QUEUE_MAX (1ull << 20)

/* --- worker table ------------------------------------------------------- */

static void start_resync(kv_ingest_t *ing, int i, uint64_t now_ms);
static void buf_free(kv_evbuf_t *b);

/*
 * Lifecycle (docs/SECURITY.md, "Worker lifecycle"). A worker's record and
 * index slots are freed when it leaves: a "leave" heartbeat, the same
 * address and rank announced under a new worker id, a record gone for
 * FORGET_AFTER timeouts, or capacity pressure. A full table never refuses
 * a newcomer: the record least likely to be a live worker goes.
 */
#define FORGET_TIMEOUTS 10

/* Frees record i and every index slot of its worker id (the index works
 * per worker id): the worker's other ranks lose their blocks and resync. */
static void worker_remove(kv_ingest_t *ing, int i, uint64_t now_ms, const char *why)
{
    kv_wstate_t *w = &ing->wk[i];
    uint64_t id = w->worker_id;
    if (ing->cfg.verbose) {
        kv_ingest_log(ing, "worker %" PRIu64 " rank %u removed: %s", id, w->dp_rank, why);
    }
    kv_index_worker_remove(ing->ix, id);
    buf_free(&w->buf);
    memset(w, 0, sizeof(*w));
    kv_registry_remove(ing->reg, i);
    kv_registry_status_add(ing->reg, KV_STATUS_OFF(removed), 1);
    for (uint32_t k = 0; k < ing->max_workers; k++) {
        kv_wstate_t *o = &ing->wk[k];
        if (!o->used || o->worker_id != id || o->state == KV_WORKER_GONE) {
            continue;
        }
        if (o->announced) {
            o->resync_after_ms = 0;
            start_resync(ing, (int)k, now_ms);
        } else {
            o->last_applied = 0;
            o->complete = 0;
        }
    }
}

/* Eviction order: gone first, then workers that never announced, then
 * announced ones never verified by a dump, then the rest; within a class,
 * the one heard from longest ago. A flood of invented ids (events or
 * heartbeats nobody answers dumps for) thus evicts itself, not the live
 * workers, and a worker restarted under a new id pushes out its old id. */
static int evict_class(const kv_wstate_t *w)
{
    if (w->state == KV_WORKER_GONE) {
        return 0;
    }
    if (!w->announced) {
        return 1;
    }
    return w->verified ? 3 : 2;
}

static int worker_evict(kv_ingest_t *ing, uint64_t now_ms)
{
    int best = -1;
    for (uint32_t k = 0; k < ing->max_workers; k++) {
        const kv_wstate_t *w = &ing->wk[k];
        if (!w->used) {
            continue;
        }
        if (best < 0 || evict_class(w) < evict_class(&ing->wk[best])
            || (evict_class(w) == evict_class(&ing->wk[best])
                && w->last_seen_ms < ing->wk[best].last_seen_ms))
        {
            best = (int)k;
        }
    }
    if (best >= 0) {
        worker_remove(ing, best, now_ms, "table full, evicted");
    }
    return best;
}

/* The private table mirrors the registry index for index; looking up
 * there avoids copying shared records on every event. */
static int worker_get(kv_ingest_t *ing, uint64_t worker_id, uint32_t dp_rank, uint64_t now_ms)
{
    for (uint32_t k = 0; k < ing->max_workers; k++) {
        const kv_wstate_t *o = &ing->wk[k];
        if (o->used && o->worker_id == worker_id && o->dp_rank == dp_rank) {
            return (int)k;
        }
    }
    int i = kv_registry_add(ing->reg, worker_id, dp_rank);
    if (i < 0 && worker_evict(ing, now_ms) >= 0) {
        i = kv_registry_add(ing->reg, worker_id, dp_rank);
    }
    if (i < 0) {
        return -1;
    }
    kv_wstate_t *w = &ing->wk[i];
    memset(w, 0, sizeof(*w));
    w->used = 1;
    w->worker_id = worker_id;
    w->dp_rank = dp_rank;
    w->state = KV_WORKER_LIVE;
    w->last_seen_ms = now_ms;
    return i;
}

/* Mirrors the private state into the shared record. */
static void publish(kv_ingest_t *ing, int i)
{
    kv_wstate_t *w = &ing->wk[i];
    kv_worker_rec_t *r = kv_registry_write_begin(ing->reg, i);
    r->state = w->state;
    r->announced = w->announced;
    r->instance_id = w->instance_id;
    r->last_event_applied = w->last_applied;
    r->last_event_announced = w->last_announced;
    r->last_seen_ms = w->last_seen_ms;
    r->interval_ms = w->interval_ms;
    kv_registry_write_end(ing->reg, i);
}

static void count(kv_ingest_t *ing, int i, size_t rec_off, size_t status_field, uint64_t n)
{
    kv_worker_rec_t *r = kv_registry_write_begin(ing->reg, i);
    *(uint64_t *)((char *)r + rec_off) += n;
    kv_registry_write_end(ing->reg, i);
    if (status_field != (size_t)-1) {
        kv_registry_status_add(ing->reg, status_field, n);
    }
}

#define COUNT(ing, i, rf, sf, n) count(ing, i, offsetof(kv_worker_rec_t, rf), KV_STATUS_OFF(sf), n)

/* --- buffer ------------------------------------------------------------- */

static void buf_reset(kv_evbuf_t *b)
{
    b->n = b->nb = b->nh = 0;
    b->overflow = 0;
}

static void buf_free(kv_evbuf_t *b)
{
    free(b->ev);
    free(b->blocks);
    free(b->hashes);
    memset(b, 0, sizeof(*b));
}

static int grow(void **p, size_t *cap, size_t need, size_t elem, size_t limit)
{
    if (need <= *cap) {
        return 0;
    }
    if (need > limit) {
        return -1;
    }
    size_t c = *cap ? *cap : 64;
    while (c < need) {
        c *= 2;
    }
    if (c > limit) {
        c = limit;
    }
    void *q = realloc(*p, c * elem);
    if (q == NULL) {
        return -1;
    }
    *p = q;
    *cap = c;
    return 0;
}

static void buf_push(kv_ingest_t *ing, int i, const kv_event_t *ev)
{
    kv_evbuf_t *b = &ing->wk[i].buf;
    if (b->overflow) {
        return;
    }
    size_t lim_ev = ing->cfg.buffer_events, lim_bl = ing->cfg.buffer_blocks;
    if (grow((void **)&b->ev, &b->cap, b->n + 1, sizeof(*b->ev), lim_ev) < 0
        || grow((void **)&b->blocks, &b->capb, b->nb + ev->n_blocks, sizeof(*b->blocks), lim_bl) < 0
        || grow((void **)&b->hashes, &b->caph, b->nh + ev->n_hashes, sizeof(*b->hashes), lim_bl)
               < 0)
    {
        buf_reset(b);
        b->overflow = 1;
        kv_registry_status_add(ing->reg, KV_STATUS_OFF(buffer_overflows), 1);
        return;
    }
    kv_buf_event_t *be = &b->ev[b->n++];
    be->ev = *ev;
    be->ev.blocks = NULL;
    be->ev.hashes = NULL;
    if (ev->kind == KV_EVENT_STORED) {
        be->off = b->nb;
        memcpy(b->blocks + b->nb, ev->blocks, ev->n_blocks * sizeof(*ev->blocks));
        b->nb += ev->n_blocks;
    } else if (ev->kind == KV_EVENT_REMOVED) {
        be->off = b->nh;
        memcpy(b->hashes + b->nh, ev->hashes, ev->n_hashes * sizeof(*ev->hashes));
        b->nh += ev->n_hashes;
    }
}

/* --- applying ----------------------------------------------------------- */

/* The index dropped blocks of worker_id on its word: tell cfg.on_drop. */
static void dropped(kv_ingest_t *ing, uint64_t worker_id, const uint64_t *seq, size_t n)
{
    if (ing->cfg.on_drop) {
        ing->cfg.on_drop(ing->cfg.on_drop_arg, worker_id, seq, n);
    }
}

static void clear_worker(kv_ingest_t *ing, uint64_t worker_id)
{
    kv_index_worker_clear(ing->ix, worker_id);
    dropped(ing, worker_id, NULL, 0);
}

/* A Removed event's sequence hashes, read before the index forgets the
 * engine's; NULL (tell "all") when nobody listens or memory is short. */
static uint64_t *removed_seqs(kv_ingest_t *ing, const kv_event_t *ev)
{
    if (ev->kind != KV_EVENT_REMOVED || !ing->cfg.on_drop || ev->n_hashes == 0) {
        return NULL;
    }
    uint64_t *seq = malloc(ev->n_hashes * sizeof(*seq));
    for (size_t k = 0; seq && k < ev->n_hashes; k++) {
        seq[k] = kv_index_seq_of(ing->ix, ev->worker_id, ev->dp_rank, ev->hashes[k]);
    }
    return seq;
}

static void apply_one(kv_ingest_t *ing, int i, const kv_event_t *ev, uint64_t now_ms)
{
    kv_wstate_t *w = &ing->wk[i];
    char err[160];
    uint64_t *rm = removed_seqs(ing, ev);
    if (ev->event_id == 1 && w->last_applied == 0) {
        w->complete = 1; /* seen from its very first event */
    }
    if (ev->kind == KV_EVENT_CLEARED || (ev->kind == KV_EVENT_REMOVED && rm == NULL)) {
        dropped(ing, ev->worker_id, NULL, 0);
    } else if (rm) {
        dropped(ing, ev->worker_id, rm, ev->n_hashes);
    }
    free(rm);
    if (kv_index_apply(ing->ix, ev, now_ms, err, sizeof(err)) != 0) {
        w->complete = 0;
        COUNT(ing, i, apply_errors, apply_errors, 1);
        if (ing->cfg.verbose > 1) {
            kv_ingest_log(ing, "worker %" PRIu64 " event %" PRIu64 ": %s", w->worker_id,
                          ev->event_id, err);
        }
    } else {
        uint64_t nb = ev->kind == KV_EVENT_STORED ? ev->n_blocks : ev->n_hashes;
        kv_worker_rec_t *r = kv_registry_write_begin(ing->reg, i);
        r->events++;
        if (ev->kind == KV_EVENT_STORED) {
            r->blocks_stored += nb;
        } else {
            r->blocks_removed += nb;
        }
        kv_registry_write_end(ing->reg, i);
        kv_registry_status_add(ing->reg, KV_STATUS_OFF(events), 1);
        kv_registry_status_add(ing->reg, KV_STATUS_OFF(blocks), nb);
        kv_registry_status_set(ing->reg, KV_STATUS_OFF(last_event_ms), now_ms);
    }
    if (ev->event_id > w->last_applied || ev->event_id == 1) {
        w->last_applied = ev->event_id;
    }
}

static void start_resync(kv_ingest_t *ing, int i, uint64_t now_ms)
{
    kv_wstate_t *w = &ing->wk[i];
    w->state = KV_WORKER_RESYNCING;
    w->need_resync = 1;
    w->dump_seq = 0;
    w->behind_since_ms = 0;
    if (!kv_ingest_connected(ing) || now_ms < w->resync_after_ms) {
        publish(ing, i);
        return; /* tick asks once possible */
    }
    char subj[320], reply[160], body[48];
    w->dump_seq = ++ing->dump_counter;
    snprintf(subj, sizeof(subj), "%s" KV_PROTO_DUMP "%" PRIu64, ing->prefix, w->worker_id);
    snprintf(reply, sizeof(reply), "%s.%" PRIu64, ing->inbox, w->dump_seq);
    snprintf(body, sizeof(body), "{\"dp_rank\":%u}", w->dp_rank);
    /* no flush: it would wait a round trip holding the mutex; cnats'
     * flusher thread sends buffered publishes at once */
    natsStatus s = natsConnection_PublishRequestString(ing->nc, subj, reply, body);
    if (s != NATS_OK) {
        w->dump_seq = 0;
        w->resync_after_ms = now_ms + RESYNC_RETRY_MS;
        publish(ing, i);
        return;
    }
    w->need_resync = 0;
    w->dump_next_chunk = 0;
    w->dump_deadline_ms = now_ms + ing->cfg.dump_timeout_ms;
    kv_registry_status_add(ing->reg, KV_STATUS_OFF(resyncs), 1);
    if (ing->cfg.verbose) {
        kv_ingest_log(ing, "resync worker %" PRIu64 " rank %u (dump %" PRIu64 ")", w->worker_id,
                      w->dp_rank, w->dump_seq);
    }
    publish(ing, i);
}

static void reject(kv_ingest_t *ing, const char *what, uint64_t worker_id, uint64_t id)
{
    kv_registry_status_add(ing->reg, KV_STATUS_OFF(rejected), 1);
    if (ing->cfg.verbose) {
        kv_ingest_log(ing, "worker %" PRIu64 ": %s (id %" PRIu64 ") rejected", worker_id, what, id);
    }
}

/* The highest event id this worker can plausibly have published. */
static uint64_t ahead_limit(const kv_wstate_t *w)
{
    uint64_t base = w->last_announced > w->dump_floor ? w->last_announced : w->dump_floor;
    if (!w->announced && w->last_applied > base) {
        base = w->last_applied;
    }
    return base + AHEAD_MAX;
}

static void handle_event(kv_ingest_t *ing, const kv_event_t *ev, uint64_t now_ms)
{
    int i = worker_get(ing, ev->worker_id, ev->dp_rank, now_ms);
    if (i < 0) {
        kv_registry_status_add(ing->reg, KV_STATUS_OFF(apply_errors), 1);
        return;
    }
    kv_wstate_t *w = &ing->wk[i];
    if (!w->announced) {
        w->last_seen_ms = now_ms;
    }
    if (w->state == KV_WORKER_GONE) {
        if (w->announced) {
            return; /* its next heartbeat resyncs it */
        }
        w->state = KV_WORKER_LIVE;
    }
    /* An unannounced worker's first event may carry any id (it ran before
     * we did); after that, and always for an announced one, an id far
     * ahead is a forgery or a broken publisher. */
    if ((w->announced || w->last_applied != 0) && ev->event_id > ahead_limit(w)) {
        reject(ing, "event far ahead of the announced id", w->worker_id, ev->event_id);
        if (w->announced && w->state != KV_WORKER_RESYNCING) {
            start_resync(ing, i, now_ms);
        }
        return;
    }
    if (w->state == KV_WORKER_RESYNCING) {
        buf_push(ing, i, ev);
        return;
    }
    if (ev->event_id <= w->last_applied) {
        if (ev->event_id == 1 && !w->announced) {
            /* an unannounced worker restarted: what we held is stale */
            clear_worker(ing, w->worker_id);
            w->last_applied = 0;
        } else if (!w->announced && w->last_applied > AHEAD_MAX
                   && ev->event_id < w->last_applied - AHEAD_MAX)
        {
            /* far behind what we applied: our id is the lie (or it restarted
             * without event 1); follow the worker, not the liar */
            reject(ing, "event id far behind the applied one: sequence reset", w->worker_id,
                   ev->event_id);
            w->last_applied = ev->event_id - 1;
            w->complete = 0;
        } else {
            COUNT(ing, i, duplicates, duplicates, 1);
            /* Core NATS delivers each event once, and ids up to the last
             * dump's are old news; a second event with an id we applied
             * from the stream means one of the two was forged: the dump
             * tells which. */
            if (w->announced && ev->event_id > w->dump_floor) {
                start_resync(ing, i, now_ms);
            }
            return;
        }
    }
    if (w->last_applied != 0 && ev->event_id > w->last_applied + 1) {
        w->complete = 0;
        COUNT(ing, i, gaps, gaps, 1);
        if (w->announced) {
            start_resync(ing, i, now_ms);
            buf_push(ing, i, ev);
            return;
        }
    }
    apply_one(ing, i, ev, now_ms);
    publish(ing, i);
}

void kv_sync_events(kv_ingest_t *ing, const kv_event_batch_t *b, const uint64_t *subject_worker,
                    uint64_t now_ms)
{
    if (subject_worker) {
        for (size_t k = 0; k < b->n_events; k++) {
            if (b->events[k].worker_id != *subject_worker) {
                /* published as one worker about another: with per-worker
                 * NATS permissions, exactly what a forger would have to do */
                reject(ing, "event for another worker on a per-worker subject",
                       b->events[k].worker_id, *subject_worker);
                return;
            }
        }
    }
    for (size_t k = 0; k < b->n_events; k++) {
        handle_event(ing, &b->events[k], now_ms);
    }
    uint64_t lag = b->has_envelope && b->published_at && now_ms > b->published_at
                       ? now_ms - b->published_at
                       : 0;
    kv_registry_status_set(ing->reg, KV_STATUS_OFF(last_event_lag_ms), lag);
}

/* After a whole dump: events buffered meanwhile, in order, past its id. */
static void replay_buffer(kv_ingest_t *ing, int i, uint64_t now_ms)
{
    kv_wstate_t *w = &ing->wk[i];
    kv_evbuf_t *b = &w->buf;
    if (b->overflow) {
        buf_reset(b);
        start_resync(ing, i, now_ms);
        return;
    }
    for (size_t k = 0; k < b->n; k++) {
        kv_event_t ev = b->ev[k].ev;
        if (ev.kind == KV_EVENT_STORED) {
            ev.blocks = b->blocks + b->ev[k].off;
        } else if (ev.kind == KV_EVENT_REMOVED) {
            ev.hashes = b->hashes + b->ev[k].off;
        }
        if (ev.event_id <= w->last_applied) {
            continue;
        }
        if (ev.event_id > w->last_applied + 1) {
            /* A gap the dump did not fill. Asking again would loop forever
             * on one forged event while the worker is idle; drop the rest
             * instead: if it was real, the next heartbeat shows us behind
             * and that resyncs. */
            COUNT(ing, i, gaps, gaps, 1);
            reject(ing, "buffered events past a gap after a dump", w->worker_id, ev.event_id);
            break;
        }
        apply_one(ing, i, &ev, now_ms);
    }
    buf_reset(b);
}

/* --- heartbeat ---------------------------------------------------------- */

/* Scans the JSON object in buf into *out (size bytes, zeroed first) by
 * fields: the mask of the fields it had (bit k: fields[k]), or -1 if it is
 * malformed. */
static int64_t scan_object(const char *buf, size_t len, const kv_jfield_t *fields, void *out,
                           size_t size)
{
    kv_jscan_t s;
    uint32_t seen = 0;

    memset(out, 0, size);
    kv_jscan_init(&s, buf, len);
    if (kv_jscan_fields(&s, fields, out, &seen) < 0) {
        return -1;
    }
    return seen;
}

typedef struct {
    uint64_t worker_id, instance_id, last_event_id, interval_ms, num_blocks;
    uint64_t dp_rank, block_size;
    int has_worker;
    char type[16];
    char address[KV_REGISTRY_ADDR_MAX];
    char model[KV_REGISTRY_MODEL_MAX];
    kv_worker_load_t load;
} heartbeat_t;

#define LOAD_U64(f) {#f, KV_JF_U64, offsetof(kv_worker_load_t, f), 0, NULL}
#define HB_U64(f) {#f, KV_JF_U64, offsetof(heartbeat_t, f), 0, NULL}
#define HB_STR(f) {#f, KV_JF_STRING, offsetof(heartbeat_t, f), sizeof(((heartbeat_t *)0)->f), NULL}

static const kv_jfield_t load_fields[] = {LOAD_U64(active_prefill_tokens),
                                          LOAD_U64(active_decode_blocks),
                                          LOAD_U64(kv_used_blocks),
                                          LOAD_U64(waiting),
                                          LOAD_U64(running),
                                          {NULL, 0, 0, 0, NULL}};

/* worker_id first: bit 0 of the seen mask says it was there. */
static const kv_jfield_t heartbeat_fields[] = {
    HB_U64(worker_id),
    HB_U64(dp_rank),
    HB_U64(instance_id),
    HB_U64(last_event_id),
    HB_U64(interval_ms),
    HB_U64(block_size),
    HB_U64(num_blocks),
    HB_STR(address),
    HB_STR(model),
    HB_STR(type),
    {"load", KV_JF_OBJECT, offsetof(heartbeat_t, load), 0, load_fields},
    {NULL, 0, 0, 0, NULL}};

static int parse_heartbeat(const char *buf, size_t len, heartbeat_t *h)
{
    int64_t seen = scan_object(buf, len, heartbeat_fields, h, sizeof(*h));

    if (seen < 0) {
        return -1;
    }
    h->has_worker = seen & 1;
    if (!h->has_worker || h->dp_rank > UINT32_MAX) {
        return -1;
    }
    return 0;
}

/* Reported load only ever adds to what nginx counts itself (the balancer
 * takes the larger); a forged or broken report must not make a worker
 * look infinitely busy: clamp to what its own capacity allows. */
static uint64_t clamp(uint64_t v, uint64_t max)
{
    return v > max ? max : v;
}

static void sanitize_load(heartbeat_t *h)
{
    kv_worker_load_t *l = &h->load;
    uint64_t blocks =
        h->num_blocks && h->num_blocks < LOAD_TOKENS_MAX ? h->num_blocks : LOAD_TOKENS_MAX;
    uint64_t bs = h->block_size && h->block_size <= 4096 ? h->block_size : 16;
    uint64_t tokens = clamp(blocks * bs, LOAD_TOKENS_MAX);
    l->active_decode_blocks = clamp(l->active_decode_blocks, blocks);
    l->kv_used_blocks = clamp(l->kv_used_blocks, blocks);
    /* prefill may queue beyond the KV pool, but not without bound */
    l->active_prefill_tokens = clamp(l->active_prefill_tokens, 4 * tokens);
    l->waiting = clamp(l->waiting, LOAD_QUEUE_MAX);
    l->running = clamp(l->running, LOAD_QUEUE_MAX);
}

void kv_sync_heartbeat(kv_ingest_t *ing, const char *buf, size_t len,
                       const uint64_t *subject_worker, uint64_t now_ms)
{
    heartbeat_t h;
    if (parse_heartbeat(buf, len, &h) < 0) {
        kv_registry_status_add(ing->reg, KV_STATUS_OFF(decode_errors), 1);
        return;
    }
    if (subject_worker && h.worker_id != *subject_worker) {
        reject(ing, "heartbeat for another worker on a per-worker subject", h.worker_id,
               *subject_worker);
        return;
    }
    kv_registry_status_add(ing->reg, KV_STATUS_OFF(heartbeats), 1);
    if (!strcmp(h.type, "leave")) {
        /* a worker shutting down: free its record and slots now */
        for (uint32_t k = 0; k < ing->max_workers; k++) {
            if (ing->wk[k].used && ing->wk[k].worker_id == h.worker_id
                && ing->wk[k].dp_rank == h.dp_rank)
            {
                worker_remove(ing, (int)k, now_ms, "left");
            }
        }
        return;
    }
    int i = worker_get(ing, h.worker_id, (uint32_t)h.dp_rank, now_ms);
    if (i < 0) {
        return;
    }
    kv_wstate_t *w = &ing->wk[i];
    int first = !w->announced;
    if (first && h.address[0]) {
        /* the same address and rank under a new worker id: the engine
         * restarted with a new identity (Dynamo's do); the old id is gone */
        kv_worker_rec_t o;
        for (uint32_t k = 0; k < ing->max_workers; k++) {
            if ((int)k != i && ing->wk[k].used && ing->wk[k].announced
                && ing->wk[k].dp_rank == h.dp_rank && ing->wk[k].worker_id != h.worker_id
                && kv_registry_read(ing->reg, (int)k, &o) == 0
                && strncmp(o.address, h.address, sizeof(o.address)) == 0)
            {
                worker_remove(ing, (int)k, now_ms, "its address announced by a new worker id");
            }
        }
    }
    int restarted = w->instance_id != 0 && h.instance_id != w->instance_id;
    /* Applied past what the worker says it published, one heartbeat after
     * we applied it: those events were never its own (forged). Events it
     * published since the previous heartbeat may legitimately be ahead,
     * hence the previous heartbeat's mark, not the current one. */
    int forged_ahead =
        !first && !restarted && w->state == KV_WORKER_LIVE && h.last_event_id < w->hb_applied;
    w->announced = 1;
    w->instance_id = h.instance_id;
    w->last_seen_ms = now_ms;
    w->interval_ms = h.interval_ms;
    w->last_announced = h.last_event_id;
    w->hb_applied = w->last_applied;
    sanitize_load(&h);

    kv_worker_rec_t *r = kv_registry_write_begin(ing->reg, i);
    memcpy(r->address, h.address, sizeof(r->address));
    memcpy(r->model, h.model, sizeof(r->model));
    r->block_size = (uint32_t)h.block_size;
    r->num_blocks = h.num_blocks;
    r->load = h.load;
    kv_registry_write_end(ing->reg, i);

    if (restarted) {
        w->last_applied = 0;
        w->hb_applied = 0;
        w->dump_floor = 0;
        w->complete = 0;
        buf_reset(&w->buf);
    }
    if (forged_ahead) {
        reject(ing, "applied events the worker never announced", w->worker_id, h.last_event_id);
        COUNT(ing, i, gaps, gaps, 1);
        start_resync(ing, i, now_ms);
        publish(ing, i);
        return;
    }
    /* A first announce from a worker whose every event we applied from
     * event 1 needs no dump: the index is already exact (the usual case
     * when the helper was up before the worker). */
    if (first && w->complete && w->state == KV_WORKER_LIVE && h.last_event_id <= w->last_applied) {
        first = 0;
    }
    if (first || restarted || w->state == KV_WORKER_GONE) {
        if (w->state != KV_WORKER_RESYNCING || restarted) {
            start_resync(ing, i, now_ms);
        }
    } else if (w->state == KV_WORKER_LIVE && h.last_event_id > w->last_applied) {
        if (w->behind_since_ms == 0) {
            w->behind_since_ms = now_ms;
        }
    } else {
        w->behind_since_ms = 0;
    }
    publish(ing, i);
}

/* --- dump --------------------------------------------------------------- */

typedef struct {
    uint64_t worker_id, dp_rank, instance_id, last_event_id, chunk, chunks;
    int seen_blocks;
} dump_head_t;

/* Applies a run of dumped blocks that chain parent -> child as one event. */
static void apply_run(kv_ingest_t *ing, int i, int has_parent, uint64_t parent, size_t n,
                      uint64_t now_ms)
{
    if (n == 0) {
        return;
    }
    kv_event_t ev;
    memset(&ev, 0, sizeof(ev));
    ev.worker_id = ing->wk[i].worker_id;
    ev.dp_rank = ing->wk[i].dp_rank;
    ev.kind = KV_EVENT_STORED;
    ev.has_parent = has_parent;
    ev.parent_hash = parent;
    ev.blocks = ing->scratch;
    ev.n_blocks = n;
    char err[160];
    if (kv_index_apply(ing->ix, &ev, now_ms, err, sizeof(err)) != 0) {
        COUNT(ing, i, apply_errors, apply_errors, 1);
    }
}

/* "blocks": [[parent|null, block_hash, tokens_hash], ...] */
static int dump_blocks(kv_ingest_t *ing, int i, kv_jscan_t *s, uint64_t now_ms)
{
    int run_has_parent = 0;
    uint64_t run_parent = 0;
    size_t n = 0;
    if (kv_jscan_expect(s, '[') < 0) {
        return -1;
    }
    if (kv_jscan_accept(s, ']')) {
        return 0;
    }
    do {
        uint64_t parent = 0, bh, th;
        int has_parent;
        if (kv_jscan_expect(s, '[') < 0) {
            return -1;
        }
        has_parent = !kv_jscan_null(s);
        if ((has_parent && kv_jscan_u64(s, &parent) < 0) || kv_jscan_expect(s, ',') < 0
            || kv_jscan_u64(s, &bh) < 0 || kv_jscan_expect(s, ',') < 0 || kv_jscan_u64(s, &th) < 0
            || kv_jscan_expect(s, ']') < 0)
        {
            return -1;
        }
        int extends = n > 0 && has_parent && parent == ing->scratch[n - 1].block_hash;
        if (!extends || n == ing->scratch_cap) {
            apply_run(ing, i, run_has_parent, run_parent, n, now_ms);
            n = 0;
            run_has_parent = has_parent;
            run_parent = parent;
        }
        ing->scratch[n].block_hash = bh;
        ing->scratch[n].tokens_hash = th;
        n++;
    } while (kv_jscan_accept(s, ','));
    if (kv_jscan_expect(s, ']') < 0) {
        return -1;
    }
    apply_run(ing, i, run_has_parent, run_parent, n, now_ms);
    return 0;
}

static void dump_failed(kv_ingest_t *ing, int i, uint64_t now_ms, const char *why)
{
    kv_wstate_t *w = &ing->wk[i];
    kv_registry_status_add(ing->reg, KV_STATUS_OFF(dump_failures), 1);
    if (ing->cfg.verbose) {
        kv_ingest_log(ing, "dump from worker %" PRIu64 " failed: %s", w->worker_id, why);
    }
    w->dump_seq = 0;
    w->need_resync = 1;
    w->resync_after_ms = now_ms + RESYNC_RETRY_MS;
    publish(ing, i);
}

/* Chunk 0 replaces what the index held; every rank of the worker goes,
 * since kv_index_worker_clear works per worker: the others resync too. */
static void dump_begin(kv_ingest_t *ing, int i, uint64_t now_ms)
{
    kv_wstate_t *w = &ing->wk[i];
    clear_worker(ing, w->worker_id);
    for (uint32_t k = 0; k < ing->max_workers; k++) {
        kv_wstate_t *o = &ing->wk[k];
        if ((int)k != i && o->used && o->worker_id == w->worker_id
            && o->state != KV_WORKER_RESYNCING && o->state != KV_WORKER_GONE)
        {
            if (o->announced) {
                start_resync(ing, (int)k, now_ms);
            } else {
                o->last_applied = 0;
                o->complete = 0;
            }
        }
    }
}

#define DUMP_U64(f) {#f, KV_JF_U64, offsetof(dump_head_t, f), 0, NULL}

/* "blocks" last: its bit in the seen mask says the chunk has blocks. */
#define DUMP_BLOCKS_FIELD 6
static const kv_jfield_t dump_head_fields[] = {DUMP_U64(worker_id),
                                               DUMP_U64(dp_rank),
                                               DUMP_U64(instance_id),
                                               DUMP_U64(last_event_id),
                                               DUMP_U64(chunk),
                                               DUMP_U64(chunks),
                                               {"blocks", KV_JF_SKIP, 0, 0, NULL},
                                               {NULL, 0, 0, 0, NULL}};

/* The head fields of a chunk, "blocks" skipped: 0, or -1 if malformed. */
static int dump_head(const char *buf, size_t len, dump_head_t *h)
{
    int64_t seen = scan_object(buf, len, dump_head_fields, h, sizeof(*h));

    if (seen < 0) {
        return -1;
    }
    h->seen_blocks = (seen >> DUMP_BLOCKS_FIELD) & 1;
    return h->seen_blocks ? 0 : -1;
}

/* Why a chunk cannot belong to the dump we asked worker i for, or NULL. */
static const char *dump_mismatch(const kv_wstate_t *w, const dump_head_t *h)
{
    if (h->worker_id != w->worker_id || h->dp_rank != w->dp_rank) {
        return "chunk for another worker";
    }
    if (h->chunk != w->dump_next_chunk || h->chunks == 0 || h->chunk >= h->chunks
        || h->chunks > (1u << 20))
    {
        return "chunk out of order";
    }
    if (w->instance_id && h->instance_id && h->instance_id != w->instance_id) {
        return "chunk from another instance";
    }
    if (h->last_event_id > w->last_announced + AHEAD_MAX) {
        return "last_event_id far ahead of the announced one";
    }
    if (h->chunk > 0 && h->last_event_id != w->dump_last_event_id) {
        return "last_event_id changed between chunks";
    }
    return NULL;
}

void kv_sync_dump_chunk(kv_ingest_t *ing, uint64_t seq, const char *buf, size_t len,
                        uint64_t now_ms)
{
    int i = -1;
    for (uint32_t k = 0; k < ing->max_workers; k++) {
        if (ing->wk[k].used && ing->wk[k].state == KV_WORKER_RESYNCING
            && ing->wk[k].dump_seq == seq)
        {
            i = (int)k;
            break;
        }
    }
    if (i < 0) {
        return; /* late reply to an abandoned dump */
    }
    kv_wstate_t *w = &ing->wk[i];

    /* Checked before anything is applied: a reply that is not the one we
     * asked for (a forger answering first, another worker's blocks) must
     * not touch the index. Two passes over the JSON; the first is cheap. */
    dump_head_t h;
    const char *why;
    if (dump_head(buf, len, &h) < 0) {
        why = "malformed chunk";
    } else {
        why = dump_mismatch(w, &h);
    }
    if (why != NULL) {
        /* ignored, not failed: a forger answering first must not make us
         * drop the real reply behind it; the deadline covers a real loss */
        reject(ing, why, w->worker_id, h.last_event_id);
        return;
    }
    if (w->dump_next_chunk == 0) {
        dump_begin(ing, i, now_ms);
        w->dump_last_event_id = h.last_event_id;
    }
    kv_jscan_t s;
    char key[48];
    int first = 1, r, rc = 0;
    kv_jscan_init(&s, buf, len);
    kv_jscan_expect(&s, '{');
    while (rc == 0 && (r = kv_jscan_key(&s, &first, key, sizeof(key))) == 1) {
        rc = !strcmp(key, "blocks") ? dump_blocks(ing, i, &s, now_ms) : kv_jscan_skip(&s);
    }
    if (rc < 0) {
        dump_failed(ing, i, now_ms, "malformed blocks");
        return;
    }
    if (++w->dump_next_chunk < h.chunks) {
        return;
    }
    /* whole: the index now reflects exactly events <= last_event_id */
    w->dump_seq = 0;
    w->state = KV_WORKER_LIVE;
    w->complete = 1;
    w->verified = 1;
    w->last_applied = h.last_event_id;
    w->dump_floor = h.last_event_id;
    w->hb_applied = h.last_event_id;
    w->behind_since_ms = 0;
    kv_registry_status_add(ing->reg, KV_STATUS_OFF(dumps), 1);
    kv_worker_rec_t *rec = kv_registry_write_begin(ing->reg, i);
    rec->resyncs++;
    kv_registry_write_end(ing->reg, i);
    replay_buffer(ing, i, now_ms);
    publish(ing, i);
}

/* --- tick --------------------------------------------------------------- */

static uint64_t timeout_of(const kv_ingest_t *ing, const kv_wstate_t *w)
{
    if (ing->cfg.heartbeat_timeout_ms) {
        return ing->cfg.heartbeat_timeout_ms;
    }
    uint64_t t = 3 * (w->interval_ms ? w->interval_ms : 1000);
    return t < 3000 ? 3000 : t;
}

/* NATS down longer than stale_lag_ms: nothing we hold can be trusted to be
 * current, so every worker is marked stale (the module routes those by
 * load only) until a resync (announced) or reconnection (the rest). */
static void mark_stale(kv_ingest_t *ing, uint64_t now_ms, int connected)
{
    if (!connected && ing->down_since_ms == 0) {
        ing->down_since_ms = now_ms;
    }
    int stale = !connected && now_ms > ing->down_since_ms + ing->cfg.stale_lag_ms;
    if (connected) {
        ing->down_since_ms = 0;
    }
    for (uint32_t i = 0; i < ing->max_workers; i++) {
        kv_wstate_t *w = &ing->wk[i];
        if (!w->used) {
            continue;
        }
        if (!connected) {
            w->complete = 0; /* core NATS drops what is published meanwhile */
        }
        if (stale && w->state == KV_WORKER_LIVE) {
            w->state = KV_WORKER_STALE;
            publish(ing, (int)i);
        } else if (connected && w->state == KV_WORKER_STALE && !w->announced) {
            w->state = KV_WORKER_LIVE;
            publish(ing, (int)i);
        }
    }
}

/*
 * The self-check (kv_registry.h): nginx workers compare what the index
 * predicted with what the engine reported. A drifting worker (events lost,
 * a forgery nothing else caught, a hash or block size mismatch) is resynced:
 * its dump is the truth. If it drifts again within SC_RESYNC_AGAIN_MS of a
 * self-check resync, a dump does not fix it (the engine's hashes are not
 * ours, or it lies about its blocks): it is routed by load alone until its
 * predictions agree again. Not resyncable (unannounced): load alone at once.
 */
#define SC_RESYNC_AGAIN_MS 60000

static void selfcheck(kv_ingest_t *ing, int i, uint64_t now_ms)
{
    kv_wstate_t *w = &ing->wk[i];
    kv_selfcheck_t sc;
    kv_selfcheck_read(ing->reg, i, &sc);
    kv_selfcheck_verdict_t v = kv_selfcheck_verdict(&sc);
    if (sc.worker_id != w->worker_id || v == KV_SELFCHECK_UNKNOWN) {
        return;
    }
    if (sc.load_only) {
        if (v == KV_SELFCHECK_OK) {
            kv_selfcheck_note(ing->reg, i, 0, 0, 0);
            kv_selfcheck_restart(ing->reg, i);
            kv_ingest_log(ing,
                          "self-check: worker %" PRIu64 " rank %u predictions agree "
                          "again: cache-aware routing restored",
                          w->worker_id, w->dp_rank);
        }
        return;
    }
    if (v != KV_SELFCHECK_DRIFT) {
        return;
    }
    if (w->state != KV_WORKER_LIVE) {
        kv_selfcheck_restart(ing->reg, i); /* a resync or timeout is already at work */
        return;
    }
    int again = w->sc_resync_ms && now_ms < w->sc_resync_ms + SC_RESYNC_AGAIN_MS;
    kv_selfcheck_restart(ing->reg, i);
    if (w->announced && !again) {
        kv_selfcheck_note(ing->reg, i, 1, 1, 0);
        kv_ingest_log(ing,
                      "self-check: worker %" PRIu64 " rank %u: the index's predictions "
                      "drift from its reported cached tokens (error %.2f over %" PRIu64
                      " responses): resync",
                      w->worker_id, w->dp_rank, sc.error_ppm / 1e6, sc.window);
        w->sc_resync_ms = now_ms;
        w->resync_after_ms = 0;
        start_resync(ing, i, now_ms);
        return;
    }
    kv_selfcheck_note(ing->reg, i, 1, 0, 1);
    kv_ingest_log(ing,
                  "self-check: worker %" PRIu64 " rank %u: predictions still drift "
                  "(error %.2f over %" PRIu64 " responses%s): routed by load until they "
                  "agree",
                  w->worker_id, w->dp_rank, sc.error_ppm / 1e6, sc.window,
                  w->announced ? ", after a resync" : ", not resyncable");
}

void kv_sync_tick(kv_ingest_t *ing, uint64_t now_ms, int connected, int reconnected)
{
    mark_stale(ing, now_ms, connected);
    for (uint32_t i = 0; i < ing->max_workers; i++) {
        if (ing->wk[i].used && ing->wk[i].state != KV_WORKER_GONE) {
            selfcheck(ing, (int)i, now_ms);
        }
    }
    if (now_ms >= ing->reap_at_ms) {
        /* removed workers' blocks: one pass a second at most, however many */
        kv_index_reap(ing->ix);
        ing->reap_at_ms = now_ms + 1000;
    }
    for (uint32_t i = 0; i < ing->max_workers; i++) {
        kv_wstate_t *w = &ing->wk[i];
        if (!w->used || !w->announced) {
            continue;
        }
        if (reconnected) {
            w->last_seen_ms = now_ms; /* silence while NATS was down proves nothing */
        }
        if (w->state == KV_WORKER_STALE && connected) {
            w->resync_after_ms = 0;
            start_resync(ing, (int)i, now_ms);
            continue;
        }
        if (w->state == KV_WORKER_GONE
            && now_ms > w->last_seen_ms + FORGET_TIMEOUTS * timeout_of(ing, w))
        {
            worker_remove(ing, (int)i, now_ms, "gone for long");
            continue;
        }
        if (connected && w->state != KV_WORKER_GONE
            && now_ms > w->last_seen_ms + timeout_of(ing, w))
        {
            /* its blocks and index slots go now; the record stays a while
             * (status shows it gone) unless the table needs it */
            kv_index_worker_remove(ing->ix, w->worker_id);
            dropped(ing, w->worker_id, NULL, 0);
            w->state = KV_WORKER_GONE;
            w->complete = 0;
            w->need_resync = 0;
            w->dump_seq = 0;
            buf_reset(&w->buf);
            kv_registry_status_add(ing->reg, KV_STATUS_OFF(timeouts), 1);
            if (ing->cfg.verbose) {
                kv_ingest_log(ing, "worker %" PRIu64 " silent: blocks dropped", w->worker_id);
            }
            publish(ing, (int)i);
            continue;
        }
        if (w->state == KV_WORKER_GONE) {
            continue;
        }
        if (reconnected) {
            /* core NATS lost whatever was published while we were away */
            w->resync_after_ms = 0;
            start_resync(ing, (int)i, now_ms);
            continue;
        }
        if (w->state == KV_WORKER_RESYNCING && w->dump_seq && now_ms > w->dump_deadline_ms) {
            dump_failed(ing, (int)i, now_ms, "timed out");
        }
        if (w->state == KV_WORKER_RESYNCING && w->need_resync && now_ms >= w->resync_after_ms) {
            start_resync(ing, (int)i, now_ms);
        }
        if (w->state == KV_WORKER_LIVE && w->behind_since_ms
            && now_ms > w->behind_since_ms + ing->cfg.stale_lag_ms)
        {
            if (w->last_announced > w->last_applied) {
                COUNT(ing, (int)i, gaps, gaps, 1);
                start_resync(ing, (int)i, now_ms);
            } else {
                w->behind_since_ms = 0;
            }
        }
    }
}

void kv_sync_free(kv_ingest_t *ing)
{
    for (uint32_t i = 0; i < ing->max_workers; i++) {
        buf_free(&ing->wk[i].buf);
    }
}
