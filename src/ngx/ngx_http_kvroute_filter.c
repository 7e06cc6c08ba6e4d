
/*
 * Copyright (C) kvroute authors
 *
 * Response filters: the header filter adds X-KVRoute-Worker and
 * X-KVRoute-Overlap when kvroute_debug_headers is on; the body filter sees
 * the first response body byte, which for an LLM response is the first
 * token, and releases the attempt's prefill load there. (Headers are no
 * such signal: a streaming server sends them before the first token; nor
 * is a Responses API stream's first byte, which vLLM sends before the
 * engine runs: there the first event past its preamble, kv_preamble.h.)
 *
 * The body filter also runs the self-check (events mode): it scans the
 * response for usage's prompt_tokens and cached_tokens as it streams past
 * (kv_usage.h: a few bytes of state, no buffering) and at the end compares
 * the cached tokens the engine reported with those the index predicted for
 * the worker chosen, one sample in the registry (kv_selfcheck_sample); the
 * helper acts on a drift. In approximate mode the same scan feeds the
 * learned memory instead (kv_retain.h): what the server was credited with,
 * how old it was, and what its engine still had.
 *
 * For a Responses API request the body filter also reads the response's id
 * (kv_respid.h) and records which server made it (kv_respmap.h), so that a
 * request continuing it (previous_response_id) goes back there.
 *
 * With prefill= the header filter releases the prefill server's load: a
 * decode worker sends its header once the KV is in place; debug headers
 * then add X-KVRoute-Prefill-Worker (host:port or "local") and
 * X-KVRoute-Prefill-Reason (remote, short, none, busy).
 */


#include "ngx_http_kvroute.h"


static void ngx_http_kvroute_selfcheck_start(ngx_http_request_t *r,
    ngx_http_kvroute_ctx_t *ctx);
static void ngx_http_kvroute_selfcheck_end(ngx_http_request_t *r,
    ngx_http_kvroute_ctx_t *ctx);
static void ngx_http_kvroute_retain_sample(ngx_http_request_t *r,
    ngx_http_kvroute_ctx_t *ctx);
static void ngx_http_kvroute_respid_start(ngx_http_request_t *r,
    ngx_http_kvroute_ctx_t *ctx);
static void ngx_http_kvroute_respid_feed(ngx_http_kvroute_ctx_t *ctx,
    ngx_chain_t *in);
static ngx_int_t ngx_http_kvroute_header_filter(ngx_http_request_t *r);
static ngx_int_t ngx_http_kvroute_body_filter(ngx_http_request_t *r,
    ngx_chain_t *in);


static ngx_http_output_header_filter_pt  ngx_http_next_header_filter;
static ngx_http_output_body_filter_pt    ngx_http_next_body_filter;


ngx_int_t
ngx_http_kvroute_filter_init(ngx_conf_t *cf)
{
    ngx_http_next_header_filter = ngx_http_top_header_filter;
    ngx_http_top_header_filter = ngx_http_kvroute_header_filter;

    ngx_http_next_body_filter = ngx_http_top_body_filter;
    ngx_http_top_body_filter = ngx_http_kvroute_body_filter;

    return NGX_OK;
}


static ngx_int_t
ngx_http_kvroute_add_header(ngx_http_request_t *r, char *key, ngx_str_t *v)
{
    ngx_table_elt_t  *h;

    h = ngx_list_push(&r->headers_out.headers);
    if (h == NULL) {
        return NGX_ERROR;
    }

    h->hash = 1;
    h->key.data = (u_char *) key;
    h->key.len = ngx_strlen(key);
    h->value = *v;

    return NGX_OK;
}


/*
 * Worth scanning: a 200 from a primary server of an events-mode zone, for
 * a prompt routed whole by overlap (a fallback or a capped prompt has no
 * prediction to check); in approximate mode, one whose server was credited
 * with blocks whose age was noted (ttl_learn).
 */

static void
ngx_http_kvroute_selfcheck_start(ngx_http_request_t *r,
    ngx_http_kvroute_ctx_t *ctx)
{
    ngx_http_kvroute_srv_conf_t  *kcf = ctx->conf;

    ctx->usage_on = 0;
    if (kcf == NULL || kcf->zone == NULL
        || (kcf->zone->events_conf == NULL && ctx->credit_age_ms < 0)
        || r->headers_out.status != NGX_HTTP_OK
        || ctx->cand == NULL || ctx->nseq == 0
        || ctx->fallback != NGX_HTTP_KVROUTE_FB_NONE
        || ctx->chosen < kcf->peers
        || ctx->chosen >= kcf->peers + kcf->nprimary)
    {
        return;
    }

    kv_usage_init(&ctx->usage);
    ctx->usage_on = 1;
}


/*
 * The end of a response: one sample. The prediction is the index's overlap
 * for the chosen worker, in tokens, capped as engines cap their hits (the
 * last prompt token is always computed: at most (prompt - 1) / block_size
 * whole blocks). An engine that found more than the index knew is not
 * counted wrong when this router's own recent decisions (pending) explain
 * it: the events of the previous request may simply not have arrived yet.
 */

static void
ngx_http_kvroute_selfcheck_end(ngx_http_request_t *r,
    ngx_http_kvroute_ctx_t *ctx)
{
    uint64_t                      bs, maxb, idx, pend, predicted, cached;
    ngx_int_t                     i;
    ngx_uint_t                    k, j;
    kv_registry_t                *reg;
    kv_worker_rec_t               rec;
    ngx_http_kvroute_peer_t      *p;
    ngx_http_kvroute_srv_conf_t  *kcf = ctx->conf;

    ctx->usage_on = 0;
    kv_usage_end(&ctx->usage);

    if (ctx->usage.cached_tokens < 0
        || (uint64_t) ctx->usage.prompt_tokens != ctx->prompt_tokens)
    {
        /* no usage (a stream without include_usage, vLLM without
         * --enable-prompt-tokens-details), or not this prompt's (a batch
         * of prompts, another chat template): nothing to compare */
        return;
    }

    if (kcf->zone->sh->approximate) {
        ngx_http_kvroute_retain_sample(r, ctx);
        return;
    }

    p = ctx->chosen;
    k = p - kcf->peers;

    /* the record itself, not the balancer's cached miss: a miss is kept
     * for a second, and one registry read may give up under a busy writer */

    reg = kcf->zone->sh->registry;
    i = p->reg;

    if (i < 0 || kv_registry_read(reg, i, &rec) != 0
        || rec.worker_id != p->worker_id)
    {
        i = kv_registry_find(reg, p->worker_id, 0);
    }

    if (i < 0 || kv_registry_read(reg, i, &rec) != 0
        || rec.worker_id != p->worker_id || rec.state != KV_WORKER_LIVE)
    {
        return;
    }

    bs = kcf->block_size;
    maxb = ctx->prompt_tokens ? (ctx->prompt_tokens - 1) / bs : 0;
    /* the match's credit for the chosen server (none: it held nothing) */
    idx = 0;
    pend = 0;

    for (j = 0; j < ctx->ncand; j++) {
        if (ctx->cand[j].k == k) {
            idx = ngx_min(ctx->cand[j].overlap, maxb);
            pend = ngx_min(ngx_max(ctx->cand[j].overlap, ctx->cand[j].pending),
                           maxb);
            break;
        }
    }
    cached = (uint64_t) ctx->usage.cached_tokens;

    predicted = idx * bs;

    if (cached > predicted) {
        predicted = ngx_max(predicted, ngx_min(cached, pend * bs));
    }

    ngx_log_debug4(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                   "kvroute self-check: worker %uL predicted %uL cached %uL "
                   "of %uL tokens", p->worker_id, predicted, cached,
                   ctx->prompt_tokens);

    kv_selfcheck_sample(reg, (int) i, p->worker_id, predicted, cached);
}


/*
 * Approximate mode: what the server was credited with, beside what its
 * engine found cached, at the age the decision noted (kv_retain.h).
 */

static void
ngx_http_kvroute_retain_sample(ngx_http_request_t *r,
    ngx_http_kvroute_ctx_t *ctx)
{
    uint64_t                      bs, maxb, credited;
    ngx_http_kvroute_srv_conf_t  *kcf = ctx->conf;

    if (ctx->credit_age_ms < 0) {
        return;
    }

    bs = kcf->block_size;
    maxb = ctx->prompt_tokens ? (ctx->prompt_tokens - 1) / bs : 0;
    credited = ngx_min((uint64_t) ctx->chosen_overlap, maxb) * bs;

    ngx_log_debug4(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                   "kvroute retain: credited %uL cached %uL of %uL tokens, "
                   "age %L ms", credited, ctx->usage.cached_tokens,
                   ctx->prompt_tokens, ctx->credit_age_ms);

    kv_retain_sample(&kcf->zone->sh->retain, (uint64_t) ctx->credit_age_ms,
                     credited, (uint64_t) ctx->usage.cached_tokens);
}


/*
 * Worth reading the id of: a 200 from a primary server for a Responses API
 * request, with a response map in the zone. Each answer records its own
 * id, a continuation's too: the conversation goes on from the newest.
 */

static void
ngx_http_kvroute_respid_start(ngx_http_request_t *r,
    ngx_http_kvroute_ctx_t *ctx)
{
    ngx_http_kvroute_srv_conf_t  *kcf = ctx->conf;

    ctx->respid_on = 0;

    if (!ctx->responses || kcf == NULL || kcf->zone == NULL
        || kcf->zone->sh == NULL || kcf->zone->sh->responses == NULL
        || r->headers_out.status != NGX_HTTP_OK
        || ctx->chosen < kcf->peers
        || ctx->chosen >= kcf->peers + kcf->nprimary)
    {
        return;
    }

    if (ctx->respid == NULL) {
        ctx->respid = ngx_palloc(r->pool, sizeof(kv_respid_scan_t));
        if (ctx->respid == NULL) {
            return;                 /* routed by what it carries next time */
        }
    }

    kv_respid_init(ctx->respid);
    ctx->respid_on = 1;
}


static void
ngx_http_kvroute_respid_feed(ngx_http_kvroute_ctx_t *ctx, ngx_chain_t *in)
{
    int           rc;
    uint64_t      key;
    ngx_chain_t  *cl;

    for (cl = in; cl && ctx->respid_on; cl = cl->next) {
        if (!ngx_buf_in_memory(cl->buf)) {
            if (ngx_buf_size(cl->buf) > 0) {
                ctx->respid_on = 0;     /* in a temp file: not read back */
            }
            continue;
        }

        rc = kv_respid_feed(ctx->respid, (char *) cl->buf->pos,
                            cl->buf->last - cl->buf->pos);

        if (rc == 0) {
            continue;
        }

        ctx->respid_on = 0;

        if (rc == 1) {
            key = kv_body_session_key(ctx->respid->id, ctx->respid->len);
            (void) kv_respmap_put(ctx->conf->zone->sh->responses, key,
                                  ctx->chosen->worker_id);
            ngx_http_kvroute_share_response(ctx->conf->zone,
                                            ctx->chosen->worker_id, key);
        }
    }
}


static ngx_int_t
ngx_http_kvroute_header_filter(ngx_http_request_t *r)
{
    ngx_str_t                     v;
    ngx_http_kvroute_ctx_t       *ctx;
    ngx_http_kvroute_loc_conf_t  *klcf;

    if (r != r->main) {
        return ngx_http_next_header_filter(r);
    }

    ctx = ngx_http_get_module_ctx(r, ngx_http_kvroute_module);
    klcf = ngx_http_get_module_loc_conf(r, ngx_http_kvroute_module);

    if (ctx) {
        /* an error answer's times say nothing of how fast the server
         * prefills or decodes: a 400 for a prompt over the context comes
         * back in a few ms whatever its length */
        ctx->answered_ok = r->headers_out.status == NGX_HTTP_OK;
        kv_sse_count_init(&ctx->sse);

        ngx_http_kvroute_prefill_done(ctx);

        if (ctx->chosen) {
            ngx_http_kvroute_selfcheck_start(r, ctx);
            ngx_http_kvroute_respid_start(r, ctx);
        }
    }

    if (ctx == NULL || ctx->chosen == NULL || !klcf->debug_headers) {
        return ngx_http_next_header_filter(r);
    }

    if (ngx_http_kvroute_add_header(r, "X-KVRoute-Worker",
                                    &ctx->chosen->server)
        != NGX_OK)
    {
        return NGX_ERROR;
    }

    v.data = ngx_pnalloc(r->pool, NGX_INT32_LEN);
    if (v.data == NULL) {
        return NGX_ERROR;
    }

    v.len = ngx_sprintf(v.data, "%uD", ctx->chosen_overlap) - v.data;

    if (ngx_http_kvroute_add_header(r, "X-KVRoute-Overlap", &v) != NGX_OK) {
        return NGX_ERROR;
    }

    if (ctx->conf->prefill) {
        if (ctx->prefill_peer) {
            v = ctx->prefill_peer->server;

        } else {
            ngx_str_set(&v, "local");
        }

        if (ngx_http_kvroute_add_header(r, "X-KVRoute-Prefill-Worker", &v)
            != NGX_OK)
        {
            return NGX_ERROR;
        }

        v.data = (u_char *) kv_prefill_why_name(ctx->prefill_why);
        v.len = ngx_strlen(v.data);

        if (ngx_http_kvroute_add_header(r, "X-KVRoute-Prefill-Reason", &v)
            != NGX_OK)
        {
            return NGX_ERROR;
        }
    }

    return ngx_http_next_header_filter(r);
}


/* Whether buf (not empty) holds the response's first token, or is past it. */

static ngx_uint_t
ngx_http_kvroute_first_token(ngx_http_kvroute_ctx_t *ctx, ngx_buf_t *buf)
{
    if (!ctx->preamble || !ngx_buf_in_memory(buf)) {
        return 1;
    }

    return kv_preamble_feed(&ctx->first, (char *) buf->pos,
                            buf->last - buf->pos);
}


static ngx_int_t
ngx_http_kvroute_body_filter(ngx_http_request_t *r, ngx_chain_t *in)
{
    ngx_chain_t             *cl;
    ngx_http_kvroute_ctx_t  *ctx;

    if (r != r->main) {
        return ngx_http_next_body_filter(r, in);
    }

    ctx = ngx_http_get_module_ctx(r, ngx_http_kvroute_module);

    if (ctx && ctx->active && ctx->prefill_open) {
        for (cl = in; cl; cl = cl->next) {
            if (ngx_buf_size(cl->buf) > 0
                && ngx_http_kvroute_first_token(ctx, cl->buf))
            {
                ngx_http_kvroute_acct_prefill_done(ctx);
                break;
            }
        }
    }

    /* the events a stream passes on (with proxy_buffering off, as streams
     * are proxied, all of them before the upstream is finalized) */
    if (ctx && ctx->active && ctx->stream) {
        for (cl = in; cl; cl = cl->next) {
            if (ngx_buf_in_memory(cl->buf)) {
                kv_sse_count_feed(&ctx->sse, (char *) cl->buf->pos,
                                  cl->buf->last - cl->buf->pos);
            }
        }
    }

    if (ctx && ctx->respid_on) {
        ngx_http_kvroute_respid_feed(ctx, in);
    }

    if (ctx && ctx->usage_on) {
        for (cl = in; cl && ctx->usage_on; cl = cl->next) {
            if (ngx_buf_in_memory(cl->buf)) {
                kv_usage_feed(&ctx->usage, (char *) cl->buf->pos,
                              cl->buf->last - cl->buf->pos);

            } else if (ngx_buf_size(cl->buf) > 0) {
                /* buffered to a temp file: not read back for this */
                ctx->usage_on = 0;
                break;
            }

            if (cl->buf->last_buf) {
                ngx_http_kvroute_selfcheck_end(r, ctx);
            }
        }
    }

    return ngx_http_next_body_filter(r, in);
}
