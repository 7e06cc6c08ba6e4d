
/*
 * Copyright (C) kvroute authors
 *
 * Which primary servers a decision looks at. An upstream of up to
 * NGX_HTTP_KVROUTE_SCAN_ALL primaries is scored whole, as it always was.
 * A larger one is scored only on the servers that can win, so that a
 * decision costs the same at 8 servers as at 4,096:
 *
 *   - those the prefix index (or the pending index) credits with part of
 *     the prompt, found per matched worker slot through a worker id hash;
 *   - the first NGX_HTTP_KVROUTE_RING servers of the prompt's cold-placement
 *     ring (src/route/kv_ring.h): a function of the first block and the
 *     servers' ids alone, so every nginx instance offers the same ones for a
 *     prefix nobody holds yet;
 *   - with a session key, the first NGX_HTTP_KVROUTE_RING of the session's
 *     ring walk too;
 *   - the server that made the response a Responses API request continues
 *     (ctx->home), the only one that can serve it;
 *   - the NGX_HTTP_KVROUTE_LEAST least loaded that look usable, from the
 *     load table's least-loaded order (src/index/kv_load.h), which moves a
 *     server in O(1) whenever its requests change.
 *
 * Whoever the full scan would choose is among them, except that the
 * bounded-load rule of the ttft policy averages load over the candidates
 * instead of the fleet (the candidates are the least loaded, so the mean is
 * lower and the rule at most a little stricter) and a cold prefix's
 * rendezvous order (and a session's) covers the candidates rather than
 * every idle server, so in a large upstream a session's home is the same on
 * every instance only while their least-loaded few do not outrank the ring's.
 * Should none of them be usable, the attempt falls back to every primary.
 */


#include "ngx_http_kvroute.h"


#define NGX_HTTP_KVROUTE_MATCH_MAX     64
#define NGX_HTTP_KVROUTE_SLOT_CHANGES  64


static ngx_int_t ngx_http_kvroute_candidates_index(
    ngx_http_kvroute_srv_conf_t *kcf);
static void ngx_http_kvroute_candidates_overlaps(
    ngx_http_kvroute_srv_conf_t *kcf, kv_index_t *ix,
    ngx_http_kvroute_ctx_t *ctx, ngx_uint_t pending, ngx_uint_t cap);


static ngx_uint_t
ngx_http_kvroute_large(ngx_http_kvroute_srv_conf_t *kcf)
{
    return kcf->nprimary > NGX_HTTP_KVROUTE_SCAN_ALL;
}


/* Per worker process, once the peers are known: the maps and the ring. */

ngx_int_t
ngx_http_kvroute_candidates_init(ngx_cycle_t *cycle,
    ngx_http_kvroute_srv_conf_t *kcf)
{
    ngx_uint_t  k, size;

    kcf->nby_load = kv_load_capacity(kcf->zone->sh->load);

    kcf->by_load = ngx_palloc(cycle->pool, kcf->nby_load * sizeof(ngx_int_t));
    if (kcf->by_load == NULL) {
        return NGX_ERROR;
    }

    for (k = 0; k < kcf->nby_load; k++) {
        kcf->by_load[k] = -1;
    }

    for (k = 0; k < kcf->nprimary; k++) {
        if (kcf->peers[k].load >= 0
            && (ngx_uint_t) kcf->peers[k].load < kcf->nby_load)
        {
            kcf->by_load[kcf->peers[k].load] = k;
        }
    }

    for (size = 8; size < 2 * kcf->nprimary; size *= 2) { /* void */ }

    kcf->id_mask = size - 1;

    kcf->by_id = ngx_palloc(cycle->pool, size * sizeof(ngx_int_t));
    if (kcf->by_id == NULL) {
        return NGX_ERROR;
    }

    kcf->nslot_ids = kv_index_max_workers(kcf->zone->sh->index);

    kcf->slot_ids = ngx_pcalloc(cycle->pool,
                                kcf->nslot_ids * sizeof(uint64_t));
    if (kcf->slot_ids == NULL) {
        return NGX_ERROR;
    }

    kcf->ring = NULL;
    kcf->nring = 0;

    return ngx_http_kvroute_candidates_index(kcf);
}


static ngx_uint_t
ngx_http_kvroute_id_slot(ngx_http_kvroute_srv_conf_t *kcf, uint64_t id)
{
    id ^= id >> 33;
    id *= 0xff51afd7ed558ccdULL;
    id ^= id >> 33;

    return (ngx_uint_t) id & kcf->id_mask;
}


/* The primary whose worker id is id, or -1. */

ngx_int_t
ngx_http_kvroute_peer_by_id(ngx_http_kvroute_srv_conf_t *kcf, uint64_t id)
{
    ngx_uint_t  h, k;

    if (kcf->by_id == NULL) {
        return -1;
    }

    for (h = ngx_http_kvroute_id_slot(kcf, id);
         kcf->by_id[h];
         h = (h + 1) & kcf->id_mask)
    {
        k = kcf->by_id[h] - 1;

        if (kcf->peers[k].worker_id == id) {
            return k;
        }
    }

    return -1;
}


/*
 * The worker id hash and the ring, from the primaries' current ids (a
 * worker may announce an id of its own); the ring only for large upstreams,
 * on the process's heap (rebuilt whenever an id changes).
 */

static ngx_int_t
ngx_http_kvroute_candidates_index(ngx_http_kvroute_srv_conf_t *kcf)
{
    uint32_t    *w;
    uint64_t    *id;
    ngx_uint_t   k, h;

    for (h = 0; h <= kcf->id_mask; h++) {
        kcf->by_id[h] = 0;
    }

    kcf->slots_read = 0;

    for (k = 0; k < kcf->nprimary; k++) {
        kcf->peers[k].mapped_id = kcf->peers[k].worker_id;

        for (h = ngx_http_kvroute_id_slot(kcf, kcf->peers[k].worker_id);
             kcf->by_id[h];
             h = (h + 1) & kcf->id_mask)
        {
            /* void */
        }

        kcf->by_id[h] = k + 1;
    }

    if (!ngx_http_kvroute_large(kcf)) {
        return NGX_OK;
    }

    id = ngx_alloc(kcf->nprimary * (sizeof(uint64_t) + sizeof(uint32_t)),
                   ngx_cycle->log);
    if (id == NULL) {
        return NGX_ERROR;
    }

    w = (uint32_t *) (id + kcf->nprimary);

    for (k = 0; k < kcf->nprimary; k++) {
        id[k] = kcf->peers[k].worker_id;
        w[k] = kcf->peers[k].peer->weight;
    }

    if (kcf->ring) {
        ngx_free(kcf->ring);
    }

    kcf->nring = kv_ring_points(w, kcf->nprimary);

    kcf->ring = ngx_alloc(kcf->nring * sizeof(kv_ring_point_t), ngx_cycle->log);
    if (kcf->ring == NULL) {
        kcf->nring = 0;
        ngx_free(id);
        return NGX_ERROR;
    }

    kv_ring_build(kcf->ring, id, w, kcf->nprimary);

    ngx_free(id);

    return NGX_OK;
}


/*
 * Workers announce their ids; the maps follow. Small upstreams do this per
 * request (as they always did), large ones from the zone timer, where the
 * scan over every primary costs nothing to a request.
 */

void
ngx_http_kvroute_candidates_refresh(ngx_http_kvroute_srv_conf_t *kcf)
{
    ngx_uint_t        k, changed;
    kv_worker_rec_t   rec;

    if (kcf->peers == NULL || kcf->by_id == NULL) {
        return;
    }

    changed = 0;

    /* the status and the decision look records up too: compare with the
     * ids the maps were built from, not with the ids before this scan */

    for (k = 0; k < kcf->nprimary; k++) {
        (void) ngx_http_kvroute_peer_record(kcf->zone, &kcf->peers[k], &rec);

        changed |= kcf->peers[k].worker_id != kcf->peers[k].mapped_id;
    }

    if (changed) {
        (void) ngx_http_kvroute_candidates_index(kcf);
    }
}


/* Slot i of the index as this process maps it: the peers of the worker it
 * held lose it, the peers of the worker it holds now (rank 0) get it. */

static void
ngx_http_kvroute_candidates_slot(ngx_http_kvroute_srv_conf_t *kcf,
    kv_index_t *ix, uint32_t i)
{
    uint32_t    dp;
    uint64_t    wid, was;
    ngx_uint_t  h, k;

    if (kv_index_worker_info(ix, i, &wid, &dp) != 0 || dp != 0) {
        wid = 0;
    }

    was = kcf->slot_ids[i];

    if (wid == was) {
        return;
    }

    for (h = ngx_http_kvroute_id_slot(kcf, was);
         was && kcf->by_id[h];
         h = (h + 1) & kcf->id_mask)
    {
        k = kcf->by_id[h] - 1;

        if (kcf->peers[k].worker_id == was && kcf->peers[k].slot == (ngx_int_t) i) {
            kcf->peers[k].slot = -1;
        }
    }

    for (h = ngx_http_kvroute_id_slot(kcf, wid);
         wid && kcf->by_id[h];
         h = (h + 1) & kcf->id_mask)
    {
        k = kcf->by_id[h] - 1;

        if (kcf->peers[k].worker_id == wid) {
            kcf->peers[k].slot = i;
        }
    }

    kcf->slot_ids[i] = wid;
}


/*
 * Every primary's index slot (-1: the index holds nothing of it). The cold
 * rule reads every candidate's blocks, and most of a large fleet may be
 * absent from the index: a search over the slots per absent server would
 * cost servers x slots. So each process keeps a map, built in one pass over
 * the slots and then moved only by the slots the index logs as changed
 * (kv_index_slots_changed): while a fleet starts, a worker joins between
 * most decisions, and remapping every server each time cost a 4,096-server
 * upstream ~100 us on a cold decision ("Scale-out round 9"). Not throttled
 * by time: a server read as holding nothing while it holds would make
 * instances that saw the same events place a new prefix differently.
 */

void
ngx_http_kvroute_candidates_slots(ngx_http_kvroute_srv_conf_t *kcf,
    kv_index_t *ix)
{
    int         n;
    uint32_t    i, max, changed[NGX_HTTP_KVROUTE_SLOT_CHANGES];
    ngx_uint_t  k;

    if (kcf->by_id == NULL || kcf->slot_ids == NULL) {
        return;
    }

    max = ngx_min(kv_index_max_workers(ix), kcf->nslot_ids);

    if (!kcf->slots_read) {
        /* ids changed (or first use): from nothing */

        for (k = 0; k < kcf->nprimary; k++) {
            kcf->peers[k].slot = -1;
        }

        ngx_memzero(kcf->slot_ids, kcf->nslot_ids * sizeof(uint64_t));

        kcf->slots_gen = 0;
        kcf->slots_read = 1;
        n = -1;

    } else {
        n = kv_index_slots_changed(ix, &kcf->slots_gen, changed,
                                   NGX_HTTP_KVROUTE_SLOT_CHANGES);
    }

    if (n < 0) {
        (void) kv_index_slots_changed(ix, &kcf->slots_gen, changed, 0);

        for (i = 0; i < max; i++) {
            ngx_http_kvroute_candidates_slot(kcf, ix, i);
        }

        return;
    }

    while (n--) {
        if (changed[n] < max) {
            ngx_http_kvroute_candidates_slot(kcf, ix, changed[n]);
        }
    }
}


/* Raises the overlap (or pending) credit of the candidates ix names. */

static void
ngx_http_kvroute_candidates_overlaps(ngx_http_kvroute_srv_conf_t *kcf,
    kv_index_t *ix, ngx_http_kvroute_ctx_t *ctx, ngx_uint_t pending,
    ngx_uint_t cap)
{
    size_t                    i, n;
    uint32_t                  dp, *v;
    uint64_t                  wid;
    ngx_int_t                 k;
    ngx_uint_t                h, j;
    kv_overlap_t              ov[NGX_HTTP_KVROUTE_MATCH_MAX];
    ngx_http_kvroute_cand_t  *c;

    n = kv_index_match(ix, ctx->seq, ctx->nseq, ov, NGX_HTTP_KVROUTE_MATCH_MAX);

    for (i = 0; i < n; i++) {
        if (kv_index_worker_info(ix, ov[i].slot, &wid, &dp) != 0) {
            continue;
        }

        for (h = ngx_http_kvroute_id_slot(kcf, wid);
             kcf->by_id[h];
             h = (h + 1) & kcf->id_mask)
        {
            k = kcf->by_id[h] - 1;

            if (kcf->peers[k].worker_id != wid) {
                continue;
            }

            /* small upstreams list every primary in order: cand[k] is k */

            if (!ngx_http_kvroute_large(kcf)) {
                c = &ctx->cand[k];

            } else {
                for (j = 0; j < ctx->ncand && ctx->cand[j].k != (ngx_uint_t) k;
                     j++)
                {
                    /* void */
                }

                if (j == ctx->ncand) {
                    if (j == cap) {
                        continue;
                    }

                    ctx->cand[j].k = k;
                    ctx->cand[j].overlap = 0;
                    ctx->cand[j].pending = 0;
                    ctx->ncand++;
                }

                c = &ctx->cand[j];
            }

            v = pending ? &c->pending : &c->overlap;

            if (ov[i].blocks > *v) {
                *v = ov[i].blocks;
            }
        }
    }
}


/* Once per request: the primaries that hold part of the prompt (every
 * primary, in a small upstream), with their overlaps. */

void
ngx_http_kvroute_candidates_match(ngx_http_kvroute_srv_conf_t *kcf,
    ngx_http_kvroute_ctx_t *ctx, ngx_pool_t *pool, ngx_log_t *log)
{
    ngx_uint_t  k, cap;

    ctx->matched = 1;
    ctx->ncand = 0;

    cap = ngx_http_kvroute_large(kcf) ? 2 * NGX_HTTP_KVROUTE_MATCH_MAX
                                      : kcf->nprimary;

    ctx->cand = ngx_pcalloc(pool, ngx_max(cap, 1)
                                  * sizeof(ngx_http_kvroute_cand_t));
    if (ctx->cand == NULL) {
        return;
    }

    if (!ngx_http_kvroute_large(kcf)) {
        for (k = 0; k < kcf->nprimary; k++) {
            ctx->cand[k].k = k;
        }

        ctx->ncand = kcf->nprimary;
    }

    if (ctx->nseq == 0) {
        return;
    }

    if (!ngx_http_kvroute_large(kcf)) {
        /* refresh ids that workers announced before mapping index slots */
        ngx_http_kvroute_candidates_refresh(kcf);
    }

    ngx_http_kvroute_candidates_overlaps(kcf, kcf->zone->sh->index, ctx, 0,
                                         cap);

    /* the router's own recent decisions count too (events mode) */

    if (kcf->zone->sh->pending) {
        ngx_http_kvroute_candidates_overlaps(kcf, kcf->zone->sh->pending, ctx,
                                             1, cap);
    }

    /* a worker with another block size: none of its blocks can match */

    ngx_http_kvroute_block_size_check(kcf, ctx->cand, ctx->ncand, log);

    ngx_log_debug3(NGX_LOG_DEBUG_HTTP, log, 0,
                   "kvroute match: %uL tokens, %uz blocks, %ui candidates",
                   ctx->prompt_tokens, ctx->nseq, ctx->ncand);
}


static ngx_uint_t
ngx_http_kvroute_looks_usable(ngx_http_upstream_rr_peer_data_t *rrp,
    ngx_http_upstream_rr_peer_t *peer, ngx_uint_t k, time_t now)
{
    if (rrp
        && (rrp->tried[k / (8 * sizeof(uintptr_t))]
            & ((uintptr_t) 1 << k % (8 * sizeof(uintptr_t)))))
    {
        return 0;
    }

    return !peer->down
           && !(peer->max_fails && peer->fails >= peer->max_fails
                && now - peer->checked <= peer->fail_timeout)
           && !(peer->max_conns && peer->conns >= peer->max_conns);
}


static void
ngx_http_kvroute_add(ngx_http_kvroute_cand_t *list, ngx_uint_t *n,
    ngx_uint_t k)
{
    ngx_uint_t  j;

    for (j = 0; j < *n; j++) {
        if (list[j].k == k) {
            return;
        }
    }

    list[*n].k = k;
    list[*n].overlap = 0;
    list[*n].pending = 0;
    (*n)++;
}


/*
 * Per attempt: the servers to score. all: every primary (the fallback when
 * no candidate was usable). The usability read here, without the peers
 * lock, only steers which least-loaded servers are taken; the decision
 * checks it again under the lock.
 */

ngx_http_kvroute_cand_t *
ngx_http_kvroute_candidates(ngx_http_kvroute_srv_conf_t *kcf,
    ngx_http_kvroute_ctx_t *ctx, ngx_http_upstream_rr_peer_data_t *rrp,
    ngx_pool_t *pool, ngx_uint_t all, ngx_uint_t *n)
{
    time_t                    now;
    size_t                    m, i;
    uint32_t                  ring[NGX_HTTP_KVROUTE_RING];
    uint32_t                  least[4 * NGX_HTTP_KVROUTE_LEAST];
    ngx_int_t                 k;
    ngx_uint_t                j, taken, cap;
    ngx_http_kvroute_cand_t  *list;

    if (all || !ngx_http_kvroute_large(kcf)) {
        if (ctx && ctx->cand && ctx->ncand == kcf->nprimary) {
            *n = ctx->ncand;
            return ctx->cand;
        }

        /* every primary, with what the match found for them */

        list = ngx_pcalloc(pool, ngx_max(kcf->nprimary, 1)
                                 * sizeof(ngx_http_kvroute_cand_t));
        if (list == NULL) {
            return NULL;
        }

        for (j = 0; j < kcf->nprimary; j++) {
            list[j].k = j;
        }

        for (j = 0; ctx && ctx->cand && j < ctx->ncand; j++) {
            list[ctx->cand[j].k] = ctx->cand[j];
        }

        *n = kcf->nprimary;
        return list;
    }

    cap = (ctx ? ctx->ncand : 0) + 2 * NGX_HTTP_KVROUTE_RING
          + NGX_HTTP_KVROUTE_LEAST + 1;

    list = ngx_palloc(pool, cap * sizeof(ngx_http_kvroute_cand_t));
    if (list == NULL) {
        return NULL;
    }

    *n = 0;

    if (ctx && ctx->cand) {
        ngx_memcpy(list, ctx->cand, ctx->ncand * sizeof(ngx_http_kvroute_cand_t));
        *n = ctx->ncand;
    }

    /* where a cold prefix goes, the same on every instance */

    if (ctx && ctx->nseq) {
        m = kv_ring_walk(kcf->ring, kcf->nring, ctx->seq[0], ring,
                         NGX_HTTP_KVROUTE_RING);

        for (i = 0; i < m; i++) {
            ngx_http_kvroute_add(list, n, ring[i]);
        }
    }

    /* a session's first servers on the ring, alike on every instance (the
     * decision's own session order then ranks the candidates) */

    if (ctx && ctx->session) {
        m = kv_ring_walk(kcf->ring, kcf->nring, ctx->session, ring,
                         NGX_HTTP_KVROUTE_RING);

        for (i = 0; i < m; i++) {
            ngx_http_kvroute_add(list, n, ring[i]);
        }
    }

    if (ctx && ctx->home) {
        k = ngx_http_kvroute_peer_by_id(kcf, ctx->home);
        if (k >= 0) {
            ngx_http_kvroute_add(list, n, k);
        }
    }

    /* the least loaded that look usable */

    now = ngx_time();

    m = kv_load_least(kcf->zone->sh->load, (uint32_t) kcf->group, least,
                      4 * NGX_HTTP_KVROUTE_LEAST);

    for (i = 0, taken = 0; i < m && taken < NGX_HTTP_KVROUTE_LEAST; i++) {
        if (least[i] >= kcf->nby_load) {
            continue;
        }

        k = kcf->by_load[least[i]];

        if (k < 0
            || !ngx_http_kvroute_looks_usable(rrp, kcf->peers[k].peer, k, now))
        {
            continue;
        }

        ngx_http_kvroute_add(list, n, k);
        taken++;
    }

    return list;
}
