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
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_ingest_int.h"
#include "kv_jscan.h"
#include "kv_proto.h"

#define RESYNC_RETRY_MS 500

/* --- worker table ------------------------------------------------------- */

/* The private table mirrors the registry index for index; looking up
 * there avoids copying shared records on every event. */
static int worker_get(kv_ingest_t *ing, uint64_t worker_id, uint32_t dp_rank)
{
    for (uint32_t k = 0; k < ing->max_workers; k++) {
        const kv_wstate_t *o = &ing->wk[k];
        if (o->used && o->worker_id == worker_id && o->dp_rank == dp_rank)
            return (int)k;
    }
    int i = kv_registry_add(ing->reg, worker_id, dp_rank);
    if (i < 0)
        return -1;
    kv_wstate_t *w = &ing->wk[i];
    memset(w, 0, sizeof(*w));
    w->used = 1;
    w->worker_id = worker_id;
    w->dp_rank = dp_rank;
    w->state = KV_WORKER_LIVE;
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
    if (status_field != (size_t)-1)
        kv_registry_status_add(ing->reg, status_field, n);
}

#define COUNT(ing, i, rf, sf, n) count(ing, i, offsetof(kv_worker_rec_t, rf), ST(sf), n)

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
    if (need <= *cap)
        return 0;
    if (need > limit)
        return -1;
    size_t c = *cap ? *cap : 64;
    while (c < need)
        c *= 2;
    if (c > limit)
        c = limit;
    void *q = realloc(*p, c * elem);
    if (q == NULL)
        return -1;
    *p = q;
    *cap = c;
    return 0;
}

static void buf_push(kv_ingest_t *ing, int i, const kv_event_t *ev)
{
    kv_evbuf_t *b = &ing->wk[i].buf;
    if (b->overflow)
        return;
    size_t lim_ev = ing->cfg.buffer_events, lim_bl = ing->cfg.buffer_blocks;
    if (grow((void **)&b->ev, &b->cap, b->n + 1, sizeof(*b->ev), lim_ev) < 0
        || grow((void **)&b->blocks, &b->capb, b->nb + ev->n_blocks, sizeof(*b->blocks),
                lim_bl) < 0
        || grow((void **)&b->hashes, &b->caph, b->nh + ev->n_hashes, sizeof(*b->hashes),
                lim_bl) < 0) {
        buf_reset(b);
        b->overflow = 1;
        kv_registry_status_add(ing->reg, ST(buffer_overflows), 1);
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
    if (ing->cfg.on_drop)
        ing->cfg.on_drop(ing->cfg.on_drop_arg, worker_id, seq, n);
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
    if (ev->kind != KV_EVENT_REMOVED || !ing->cfg.on_drop || ev->n_hashes == 0)
        return NULL;
    uint64_t *seq = malloc(ev->n_hashes * sizeof(*seq));
    for (size_t k = 0; seq && k < ev->n_hashes; k++)
        seq[k] = kv_index_seq_of(ing->ix, ev->worker_id, ev->dp_rank, ev->hashes[k]);
    return seq;
}

static void apply_one(kv_ingest_t *ing, int i, const kv_event_t *ev, uint64_t now_ms)
{
    kv_wstate_t *w = &ing->wk[i];
    char err[160];
    uint64_t *rm = removed_seqs(ing, ev);
    if (ev->event_id == 1 && w->last_applied == 0)
        w->complete = 1;            /* seen from its very first event */
    if (ev->kind == KV_EVENT_CLEARED || (ev->kind == KV_EVENT_REMOVED && rm == NULL))
        dropped(ing, ev->worker_id, NULL, 0);
    else if (rm)
        dropped(ing, ev->worker_id, rm, ev->n_hashes);
    free(rm);
    if (kv_index_apply(ing->ix, ev, now_ms, err, sizeof(err)) != 0) {
        w->complete = 0;
        COUNT(ing, i, apply_errors, apply_errors, 1);
        if (ing->cfg.verbose > 1)
            kv_ingest_log(ing, "worker %" PRIu64 " event %" PRIu64 ": %s", w->worker_id,
                          ev->event_id, err);
    } else {
        uint64_t nb = ev->kind == KV_EVENT_STORED ? ev->n_blocks : ev->n_hashes;
        kv_worker_rec_t *r = kv_registry_write_begin(ing->reg, i);
        r->events++;
        if (ev->kind == KV_EVENT_STORED)
            r->blocks_stored += nb;
        else
            r->blocks_removed += nb;
        kv_registry_write_end(ing->reg, i);
        kv_registry_status_add(ing->reg, ST(events), 1);
        kv_registry_status_add(ing->reg, ST(blocks), nb);
        kv_registry_status_set(ing->reg, ST(last_event_ms), now_ms);
    }
    if (ev->event_id > w->last_applied || ev->event_id == 1)
        w->last_applied = ev->event_id;
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
        return;                     /* tick asks once possible */
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
    kv_registry_status_add(ing->reg, ST(resyncs), 1);
    if (ing->cfg.verbose)
        kv_ingest_log(ing, "resync worker %" PRIu64 " rank %u (dump %" PRIu64 ")", w->worker_id,
                      w->dp_rank, w->dump_seq);
    publish(ing, i);
}

static void handle_event(kv_ingest_t *ing, const kv_event_t *ev, uint64_t now_ms)
{
    int i = worker_get(ing, ev->worker_id, ev->dp_rank);
    if (i < 0) {
        kv_registry_status_add(ing->reg, ST(apply_errors), 1);
        return;
    }
    kv_wstate_t *w = &ing->wk[i];
    if (!w->announced)
        w->last_seen_ms = now_ms;
    if (w->state == KV_WORKER_GONE) {
        if (w->announced)
            return;                 /* its next heartbeat resyncs it */
        w->state = KV_WORKER_LIVE;
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
        } else {
            COUNT(ing, i, duplicates, duplicates, 1);
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

void kv_sync_events(kv_ingest_t *ing, const kv_event_batch_t *b, uint64_t now_ms)
{
    for (size_t k = 0; k < b->n_events; k++)
        handle_event(ing, &b->events[k], now_ms);
    uint64_t lag = b->has_envelope && b->published_at && now_ms > b->published_at
                       ? now_ms - b->published_at : 0;
    kv_registry_status_set(ing->reg, ST(last_event_lag_ms), lag);
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
        if (ev.kind == KV_EVENT_STORED)
            ev.blocks = b->blocks + b->ev[k].off;
        else if (ev.kind == KV_EVENT_REMOVED)
            ev.hashes = b->hashes + b->ev[k].off;
        if (ev.event_id <= w->last_applied)
            continue;
        if (ev.event_id > w->last_applied + 1) {
            /* still missing some: keep the rest, ask again */
            COUNT(ing, i, gaps, gaps, 1);
            memmove(b->ev, b->ev + k, (b->n - k) * sizeof(*b->ev));
            b->n -= k;
            start_resync(ing, i, now_ms);
            return;
        }
        apply_one(ing, i, &ev, now_ms);
    }
    buf_reset(b);
}

/* --- heartbeat ---------------------------------------------------------- */

typedef struct {
    uint64_t            worker_id, instance_id, last_event_id, interval_ms, num_blocks;
    uint64_t            dp_rank, block_size;
    int                 has_worker;
    char                address[KV_REGISTRY_ADDR_MAX];
    char                model[KV_REGISTRY_MODEL_MAX];
    kv_worker_load_t    load;
} heartbeat_t;

static int parse_load(kv_jscan_t *s, kv_worker_load_t *l)
{
    char key[48];
    int first = 1, r;
    if (kv_jscan_expect(s, '{') < 0)
        return -1;
    while ((r = kv_jscan_key(s, &first, key, sizeof(key))) == 1) {
        uint64_t *f = !strcmp(key, "active_prefill_tokens") ? &l->active_prefill_tokens
                    : !strcmp(key, "active_decode_blocks")  ? &l->active_decode_blocks
                    : !strcmp(key, "kv_used_blocks")        ? &l->kv_used_blocks
                    : !strcmp(key, "waiting")               ? &l->waiting
                    : !strcmp(key, "running")               ? &l->running : NULL;
        if ((f ? kv_jscan_u64(s, f) : kv_jscan_skip(s)) < 0)
            return -1;
    }
    return r;
}

static int parse_heartbeat(const char *buf, size_t len, heartbeat_t *h)
{
    kv_jscan_t s;
    char key[48];
    int first = 1, r;
    memset(h, 0, sizeof(*h));
    kv_jscan_init(&s, buf, len);
    if (kv_jscan_expect(&s, '{') < 0)
        return -1;
    while ((r = kv_jscan_key(&s, &first, key, sizeof(key))) == 1) {
        int rc;
        if (!strcmp(key, "worker_id")) {
            rc = kv_jscan_u64(&s, &h->worker_id);
            h->has_worker = 1;
        } else if (!strcmp(key, "dp_rank")) rc = kv_jscan_u64(&s, &h->dp_rank);
        else if (!strcmp(key, "instance_id")) rc = kv_jscan_u64(&s, &h->instance_id);
        else if (!strcmp(key, "last_event_id")) rc = kv_jscan_u64(&s, &h->last_event_id);
        else if (!strcmp(key, "interval_ms")) rc = kv_jscan_u64(&s, &h->interval_ms);
        else if (!strcmp(key, "block_size")) rc = kv_jscan_u64(&s, &h->block_size);
        else if (!strcmp(key, "num_blocks")) rc = kv_jscan_u64(&s, &h->num_blocks);
        else if (!strcmp(key, "address")) rc = kv_jscan_string(&s, h->address, sizeof(h->address));
        else if (!strcmp(key, "model")) rc = kv_jscan_string(&s, h->model, sizeof(h->model));
        else if (!strcmp(key, "load")) rc = parse_load(&s, &h->load);
        else rc = kv_jscan_skip(&s);
        if (rc < 0)
            return -1;
    }
    if (r < 0 || !h->has_worker || h->dp_rank > UINT32_MAX)
        return -1;
    return 0;
}

void kv_sync_heartbeat(kv_ingest_t *ing, const char *buf, size_t len, uint64_t now_ms)
{
    heartbeat_t h;
    if (parse_heartbeat(buf, len, &h) < 0) {
        kv_registry_status_add(ing->reg, ST(decode_errors), 1);
        return;
    }
    kv_registry_status_add(ing->reg, ST(heartbeats), 1);
    int i = worker_get(ing, h.worker_id, (uint32_t)h.dp_rank);
    if (i < 0)
        return;
    kv_wstate_t *w = &ing->wk[i];
    int first = !w->announced;
    int restarted = w->instance_id != 0 && h.instance_id != w->instance_id;
    w->announced = 1;
    w->instance_id = h.instance_id;
    w->last_seen_ms = now_ms;
    w->interval_ms = h.interval_ms;
    w->last_announced = h.last_event_id;

    kv_worker_rec_t *r = kv_registry_write_begin(ing->reg, i);
    memcpy(r->address, h.address, sizeof(r->address));
    memcpy(r->model, h.model, sizeof(r->model));
    r->block_size = (uint32_t)h.block_size;
    r->num_blocks = h.num_blocks;
    r->load = h.load;
    kv_registry_write_end(ing->reg, i);

    if (restarted) {
        w->last_applied = 0;
        w->complete = 0;
        buf_reset(&w->buf);
    }
    /* A first announce from a worker whose every event we applied from
     * event 1 needs no dump: the index is already exact (the usual case
     * when the helper was up before the worker). */
    if (first && w->complete && w->state == KV_WORKER_LIVE
        && h.last_event_id <= w->last_applied)
        first = 0;
    if (first || restarted || w->state == KV_WORKER_GONE) {
        if (w->state != KV_WORKER_RESYNCING || restarted)
            start_resync(ing, i, now_ms);
    } else if (w->state == KV_WORKER_LIVE && h.last_event_id > w->last_applied) {
        if (w->behind_since_ms == 0)
            w->behind_since_ms = now_ms;
    } else {
        w->behind_since_ms = 0;
    }
    publish(ing, i);
}

/* --- dump --------------------------------------------------------------- */

typedef struct {
    uint64_t    worker_id, dp_rank, instance_id, last_event_id, chunk, chunks;
    int         seen_blocks;
} dump_head_t;

/* Applies a run of dumped blocks that chain parent -> child as one event. */
static void apply_run(kv_ingest_t *ing, int i, int has_parent, uint64_t parent, size_t n,
                      uint64_t now_ms)
{
    if (n == 0)
        return;
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
    if (kv_index_apply(ing->ix, &ev, now_ms, err, sizeof(err)) != 0)
        COUNT(ing, i, apply_errors, apply_errors, 1);
}

/* "blocks": [[parent|null, block_hash, tokens_hash], ...] */
static int dump_blocks(kv_ingest_t *ing, int i, kv_jscan_t *s, uint64_t now_ms)
{
    int run_has_parent = 0;
    uint64_t run_parent = 0;
    size_t n = 0;
    if (kv_jscan_expect(s, '[') < 0)
        return -1;
    if (kv_jscan_accept(s, ']'))
        return 0;
    do {
        uint64_t parent = 0, bh, th;
        int has_parent;
        if (kv_jscan_expect(s, '[') < 0)
            return -1;
        has_parent = !kv_jscan_null(s);
        if ((has_parent && kv_jscan_u64(s, &parent) < 0) || kv_jscan_expect(s, ',') < 0
            || kv_jscan_u64(s, &bh) < 0 || kv_jscan_expect(s, ',') < 0
            || kv_jscan_u64(s, &th) < 0 || kv_jscan_expect(s, ']') < 0)
            return -1;
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
    if (kv_jscan_expect(s, ']') < 0)
        return -1;
    apply_run(ing, i, run_has_parent, run_parent, n, now_ms);
    return 0;
}

static void dump_failed(kv_ingest_t *ing, int i, uint64_t now_ms, const char *why)
{
    kv_wstate_t *w = &ing->wk[i];
    kv_registry_status_add(ing->reg, ST(dump_failures), 1);
    if (ing->cfg.verbose)
        kv_ingest_log(ing, "dump from worker %" PRIu64 " failed: %s", w->worker_id, why);
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
            && o->state != KV_WORKER_RESYNCING && o->state != KV_WORKER_GONE) {
            if (o->announced)
                start_resync(ing, (int)k, now_ms);
            else {
                o->last_applied = 0;
                o->complete = 0;
            }
        }
    }
}

void kv_sync_dump_chunk(kv_ingest_t *ing, uint64_t seq, const char *buf, size_t len,
                        uint64_t now_ms)
{
    int i = -1;
    for (uint32_t k = 0; k < ing->max_workers; k++)
        if (ing->wk[k].used && ing->wk[k].state == KV_WORKER_RESYNCING
            && ing->wk[k].dump_seq == seq) {
            i = (int)k;
            break;
        }
    if (i < 0)
        return;                     /* late reply to an abandoned dump */
    kv_wstate_t *w = &ing->wk[i];

    dump_head_t h;
    memset(&h, 0, sizeof(h));
    kv_jscan_t s;
    char key[48];
    int first = 1, r;
    kv_jscan_init(&s, buf, len);
    if (kv_jscan_expect(&s, '{') < 0) {
        dump_failed(ing, i, now_ms, "not a JSON object");
        return;
    }
    /* the head fields come before "blocks" in kvworker's dumps, but do
     * not rely on it: blocks go in as they are read, checks follow */
    if (w->dump_next_chunk == 0)
        dump_begin(ing, i, now_ms);
    while ((r = kv_jscan_key(&s, &first, key, sizeof(key))) == 1) {
        int rc;
        if (!strcmp(key, "worker_id")) rc = kv_jscan_u64(&s, &h.worker_id);
        else if (!strcmp(key, "dp_rank")) rc = kv_jscan_u64(&s, &h.dp_rank);
        else if (!strcmp(key, "instance_id")) rc = kv_jscan_u64(&s, &h.instance_id);
        else if (!strcmp(key, "last_event_id")) rc = kv_jscan_u64(&s, &h.last_event_id);
        else if (!strcmp(key, "chunk")) rc = kv_jscan_u64(&s, &h.chunk);
        else if (!strcmp(key, "chunks")) rc = kv_jscan_u64(&s, &h.chunks);
        else if (!strcmp(key, "blocks")) {
            rc = dump_blocks(ing, i, &s, now_ms);
            h.seen_blocks = 1;
        } else rc = kv_jscan_skip(&s);
        if (rc < 0)
            break;
    }
    if (r != 0 || !h.seen_blocks) {
        dump_failed(ing, i, now_ms, "malformed chunk");
        return;
    }
    if (h.worker_id != w->worker_id || h.dp_rank != w->dp_rank || h.chunk != w->dump_next_chunk
        || h.chunks == 0 || h.chunk >= h.chunks) {
        dump_failed(ing, i, now_ms, "chunk out of order or for another worker");
        return;
    }
    if (h.instance_id)
        w->instance_id = h.instance_id;
    if (++w->dump_next_chunk < h.chunks)
        return;
    /* whole: the index now reflects exactly events <= last_event_id */
    w->dump_seq = 0;
    w->state = KV_WORKER_LIVE;
    w->complete = 1;
    w->last_applied = h.last_event_id;
    w->behind_since_ms = 0;
    kv_registry_status_add(ing->reg, ST(dumps), 1);
    kv_worker_rec_t *rec = kv_registry_write_begin(ing->reg, i);
    rec->resyncs++;
    kv_registry_write_end(ing->reg, i);
    replay_buffer(ing, i, now_ms);
    publish(ing, i);
}

/* --- tick --------------------------------------------------------------- */

static uint64_t timeout_of(const kv_ingest_t *ing, const kv_wstate_t *w)
{
    if (ing->cfg.heartbeat_timeout_ms)
        return ing->cfg.heartbeat_timeout_ms;
    uint64_t t = 3 * (w->interval_ms ? w->interval_ms : 1000);
    return t < 3000 ? 3000 : t;
}

/* NATS down longer than stale_lag_ms: nothing we hold can be trusted to be
 * current, so every worker is marked stale (the module routes those by
 * load only) until a resync (announced) or reconnection (the rest). */
static void mark_stale(kv_ingest_t *ing, uint64_t now_ms, int connected)
{
    if (!connected && ing->down_since_ms == 0)
        ing->down_since_ms = now_ms;
    int stale = !connected && now_ms > ing->down_since_ms + ing->cfg.stale_lag_ms;
    if (connected)
        ing->down_since_ms = 0;
    for (uint32_t i = 0; i < ing->max_workers; i++) {
        kv_wstate_t *w = &ing->wk[i];
        if (!w->used)
            continue;
        if (!connected)
            w->complete = 0;        /* core NATS drops what is published meanwhile */
        if (stale && w->state == KV_WORKER_LIVE) {
            w->state = KV_WORKER_STALE;
            publish(ing, (int)i);
        } else if (connected && w->state == KV_WORKER_STALE && !w->announced) {
            w->state = KV_WORKER_LIVE;
            publish(ing, (int)i);
        }
    }
}

void kv_sync_tick(kv_ingest_t *ing, uint64_t now_ms, int connected, int reconnected)
{
    mark_stale(ing, now_ms, connected);
    for (uint32_t i = 0; i < ing->max_workers; i++) {
        kv_wstate_t *w = &ing->wk[i];
        if (!w->used || !w->announced)
            continue;
        if (reconnected)
            w->last_seen_ms = now_ms;   /* silence while NATS was down proves nothing */
        if (w->state == KV_WORKER_STALE && connected) {
            w->resync_after_ms = 0;
            start_resync(ing, (int)i, now_ms);
            continue;
        }
        if (connected && w->state != KV_WORKER_GONE
            && now_ms > w->last_seen_ms + timeout_of(ing, w)) {
            clear_worker(ing, w->worker_id);
            w->state = KV_WORKER_GONE;
            w->complete = 0;
            w->need_resync = 0;
            w->dump_seq = 0;
            buf_reset(&w->buf);
            kv_registry_status_add(ing->reg, ST(timeouts), 1);
            if (ing->cfg.verbose)
                kv_ingest_log(ing, "worker %" PRIu64 " silent: blocks dropped", w->worker_id);
            publish(ing, (int)i);
            continue;
        }
        if (w->state == KV_WORKER_GONE)
            continue;
        if (reconnected) {
            /* core NATS lost whatever was published while we were away */
            w->resync_after_ms = 0;
            start_resync(ing, (int)i, now_ms);
            continue;
        }
        if (w->state == KV_WORKER_RESYNCING && w->dump_seq && now_ms > w->dump_deadline_ms)
            dump_failed(ing, (int)i, now_ms, "timed out");
        if (w->state == KV_WORKER_RESYNCING && w->need_resync && now_ms >= w->resync_after_ms)
            start_resync(ing, (int)i, now_ms);
        if (w->state == KV_WORKER_LIVE && w->behind_since_ms
            && now_ms > w->behind_since_ms + ing->cfg.stale_lag_ms) {
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
    for (uint32_t i = 0; i < ing->max_workers; i++)
        buf_free(&ing->wk[i].buf);
}
