
/*
 * Copyright (C) kvroute authors
 *
 * Load accounting for one request attempt, in the zone's shared load
 * table: at selection the attempt adds its uncached prompt tokens (active
 * prefill), the KV blocks it will hold and the output tokens it asks for
 * (active decode) and one request;
 * the first response body byte releases the prefill tokens; the end of the
 * attempt (free_peer: success, upstream error, client abort, or at worst
 * the request pool's cleanup) releases the rest. The ctx flags make each
 * release happen exactly once per attempt. The first byte and a good end
 * also teach the table the server's prefill rate and decode pace (of
 * streamed responses only: one that is not streamed sends its first byte
 * with its last, so its prefill stays counted until then).
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
    ngx_http_kvroute_peer_t *p, const kv_route_result_t *res)
{
    int64_t                       bs;
    ngx_http_kvroute_zone_t      *zone = ctx->conf->zone;

    if (ctx->chosen == NULL) {
        ngx_http_kvroute_decision_time(ctx);
    }

    ctx->chosen = p;
    ctx->chosen_overlap = res ? res->overlap : 0;
    ctx->chosen_cost = res ? res->estimate : 0;
    ctx->why = res ? res->why : KV_ROUTE_WHY_NONE;

    if (p->load < 0) {
        return;
    }

    bs = ctx->conf->block_size;

    ctx->load = p->load;

    if (res) {
        ctx->prefill_tokens = res->prefill_tokens;
        ctx->decode_blocks = res->decode_blocks;
        ctx->decode_tokens = res->decode_tokens;
        ctx->queued_tokens = res->queued_tokens;

    } else {
        /* a backup server: nothing cached is known there */
        ctx->prefill_tokens = ctx->prompt_tokens + ctx->batch_tokens;
        ctx->decode_blocks = (ctx->prompt_tokens + bs - 1) / bs
                             + (ctx->batch_tokens + bs - 1) / bs;
        ctx->decode_tokens = ctx->prefill_only ? 0
                             : (ctx->max_tokens ? ctx->max_tokens
                                                : ctx->conf->route.max_tokens)
                               * (ctx->sequences > 1 ? ctx->sequences : 1);
        ctx->queued_tokens = 0;
    }

    ctx->active = 1;
    ctx->prefill_open = 1;
    ctx->open_ns = ngx_http_kvroute_now_ns();
    ctx->first_ns = 0;
    kv_preamble_init(&ctx->first);

    kv_load_add(zone->sh->load, zone->row, p->load, KV_LOAD_PREFILL_TOKENS,
                ctx->prefill_tokens);
    kv_load_add(zone->sh->load, zone->row, p->load, KV_LOAD_DECODE_BLOCKS,
                ctx->decode_blocks);
    kv_load_add(zone->sh->load, zone->row, p->load, KV_LOAD_DECODE_TOKENS,
                ctx->decode_tokens);
    kv_load_add(zone->sh->load, zone->row, p->load, KV_LOAD_REQUESTS, 1);
    kv_load_sent(zone->sh->load, p->load, ctx->open_ns / 1000);
    kv_load_count(zone->sh->load, p->load, ctx->chosen_overlap,
                  (uint32_t) (ctx->prompt_tokens / bs));
}


/*
 * The first byte: the prompt is prefilled. What the server prefilled since
 * the request was sent (its uncached tokens and what was queued ahead of
 * them), over that time, is one sample of its prefill rate.
 */

void
ngx_http_kvroute_acct_prefill_done(ngx_http_kvroute_ctx_t *ctx)
{
    ngx_http_kvroute_zone_t  *zone = ctx->conf->zone;

    if (!ctx->active || !ctx->prefill_open) {
        return;
    }

    ctx->prefill_open = 0;
    ctx->first_ns = ngx_http_kvroute_now_ns();

    kv_load_add(zone->sh->load, zone->row, ctx->load, KV_LOAD_PREFILL_TOKENS,
                -ctx->prefill_tokens);

    /* a response that is not streamed has its first byte with its last:
     * that time is no sample of the prefill rate; nor is a remote
     * prefill's first byte a sample of this server's */
    if (!ctx->stream || ctx->prefill_remote || !ctx->answered_ok) {
        return;
    }

    kv_load_learn_prefill(zone->sh->load, ctx->load,
                          (double) (ctx->queued_tokens + ctx->prefill_tokens),
                          (double) (ctx->first_ns - ctx->open_ns) / 1e6);
}


/* A response that ended well: its output tokens over its time after the
 * first byte are one sample of the server's decode pace (per sequence: n
 * sequences are decoded side by side, in the same steps). The tokens: those
 * asked for, or the stream's events if fewer (it stopped early: end of
 * sequence, a stop string; kv_sse.h). */

void
ngx_http_kvroute_acct_learn_decode(ngx_http_kvroute_ctx_t *ctx)
{
    uint64_t                  tokens, seqs, seen;
    ngx_http_kvroute_zone_t  *zone = ctx->conf->zone;

    seqs = ctx->sequences > 1 ? ctx->sequences : 1;
    tokens = ctx->decode_tokens / seqs;
    seen = ctx->sse.events / seqs;

    if (seen < tokens) {
        tokens = seen;
    }

    if (!ctx->active || !ctx->stream || !ctx->answered_ok || ctx->first_ns == 0
        || tokens <= 1)
    {
        return;
    }

    /* the first token came with the first byte */
    kv_load_learn_decode(zone->sh->load, ctx->load,
                         (double) (tokens - 1),
                         (double) (ngx_http_kvroute_now_ns() - ctx->first_ns)
                         / 1e6);
}


void
ngx_http_kvroute_acct_close(ngx_http_kvroute_ctx_t *ctx)
{
    ngx_http_kvroute_zone_t  *zone = ctx->conf->zone;

    /* the prefill server's part, if the decode header never came */
    ngx_http_kvroute_prefill_close(ctx);

    if (!ctx->active) {
        return;
    }

    ctx->active = 0;

    if (ctx->prefill_open) {
        /* no first byte: an error or an abort, nothing to learn */
        ctx->prefill_open = 0;
        kv_load_add(zone->sh->load, zone->row, ctx->load,
                    KV_LOAD_PREFILL_TOKENS, -ctx->prefill_tokens);
    }

    kv_load_add(zone->sh->load, zone->row, ctx->load, KV_LOAD_DECODE_BLOCKS,
                -ctx->decode_blocks);
    kv_load_add(zone->sh->load, zone->row, ctx->load, KV_LOAD_DECODE_TOKENS,
                -ctx->decode_tokens);
    kv_load_add(zone->sh->load, zone->row, ctx->load, KV_LOAD_REQUESTS, -1);
}
