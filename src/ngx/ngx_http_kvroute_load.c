
/*
 * Copyright (C) kvroute authors
 *
 * Load accounting for one request attempt, in the zone's shared load
 * table: at selection the attempt adds its uncached prompt tokens (active
 * prefill), the KV blocks it will hold (active decode) and one request;
 * the first response body byte releases the prefill tokens; the end of the
 * attempt (free_peer: success, upstream error, client abort, or at worst
 * the request pool's cleanup) releases the rest. The ctx flags make each
 * release happen exactly once per attempt.
 */


#include "ngx_http_kvroute.h"


static void
ngx_http_kvroute_decision_time(ngx_http_kvroute_ctx_t *ctx)
{
    uint64_t                 us;
    ngx_uint_t               b;
    ngx_http_kvroute_sh_t   *sh = ctx->conf->zone->sh;

    us = (ngx_http_kvroute_now_ns() - ctx->t0_ns) / 1000;
    ctx->decision_us = (ngx_msec_int_t) us;

    for (b = 0;
         b < NGX_HTTP_KVROUTE_HIST - 1 && us > ngx_http_kvroute_hist_le[b];
         b++)
    {
        /* void */
    }

    ngx_atomic_fetch_add(&sh->hist[b], 1);
    ngx_atomic_fetch_add(&sh->decision_us_sum, us);
    ngx_atomic_fetch_add(&sh->decisions, 1);
    ngx_atomic_fetch_add(&sh->fallbacks[ctx->fallback], 1);
}


void
ngx_http_kvroute_acct_open(ngx_http_kvroute_ctx_t *ctx,
    ngx_http_kvroute_peer_t *p, uint32_t overlap)
{
    int64_t                       cached, blocks, bs;
    ngx_http_kvroute_zone_t      *zone = ctx->conf->zone;

    if (ctx->chosen == NULL) {
        ngx_http_kvroute_decision_time(ctx);
    }

    ctx->chosen = p;
    ctx->chosen_overlap = overlap;

    if (p->load < 0) {
        return;
    }

    bs = ctx->conf->block_size;
    cached = (int64_t) overlap * bs;
    /* the request holds all its blocks while it runs, cached or not */
    blocks = ((int64_t) ctx->prompt_tokens + bs - 1) / bs;

    ctx->load = p->load;
    ctx->prefill_tokens = (int64_t) ctx->prompt_tokens > cached
                          ? (int64_t) ctx->prompt_tokens - cached : 0;
    ctx->decode_blocks = blocks > 0 ? blocks : 0;
    ctx->active = 1;
    ctx->prefill_open = 1;

    kv_load_add(zone->sh->load, zone->row, p->load, KV_LOAD_PREFILL_TOKENS,
                ctx->prefill_tokens);
    kv_load_add(zone->sh->load, zone->row, p->load, KV_LOAD_DECODE_BLOCKS,
                ctx->decode_blocks);
    kv_load_add(zone->sh->load, zone->row, p->load, KV_LOAD_REQUESTS, 1);
    kv_load_count(zone->sh->load, p->load, overlap,
                  (uint32_t) (ctx->prompt_tokens / bs));
}


void
ngx_http_kvroute_acct_prefill_done(ngx_http_kvroute_ctx_t *ctx)
{
    ngx_http_kvroute_zone_t  *zone = ctx->conf->zone;

    if (!ctx->active || !ctx->prefill_open) {
        return;
    }

    ctx->prefill_open = 0;

    kv_load_add(zone->sh->load, zone->row, ctx->load, KV_LOAD_PREFILL_TOKENS,
                -ctx->prefill_tokens);
}


void
ngx_http_kvroute_acct_close(ngx_http_kvroute_ctx_t *ctx)
{
    ngx_http_kvroute_zone_t  *zone = ctx->conf->zone;

    if (!ctx->active) {
        return;
    }

    ngx_http_kvroute_acct_prefill_done(ctx);

    ctx->active = 0;

    kv_load_add(zone->sh->load, zone->row, ctx->load, KV_LOAD_DECODE_BLOCKS,
                -ctx->decode_blocks);
    kv_load_add(zone->sh->load, zone->row, ctx->load, KV_LOAD_REQUESTS, -1);
}
