
/*
 * Copyright (C) kvroute authors
 *
 * Disaggregated serving, the nginx side: "kvroute ... prefill=UPSTREAM" on
 * an upstream of decode workers. Each attempt, once the decode worker is
 * chosen (balancer.c), kv_prefill_pick (src/route/kv_prefill.c) decides
 * whether the prompt is prefilled remotely and by which server of the
 * prefill upstream; this file gathers that decision's inputs (overlap from
 * the same prefix index, load from the same load table, health from the
 * peers and the worker registry), accounts the prefill tokens to the
 * prefill server until the decode worker's response header arrives (the
 * decode worker sends it once the KV is in place), and tells the decode
 * worker with the request header
 *
 *     X-KVRoute-Prefill: host:port        (the prefill server's address)
 *
 * The module owns that header: it is removed from every request proxied
 * through a kvroute upstream, whoever set it (a client must never make a
 * decode worker pull from an address of its choosing), and inserted only
 * for a remote prefill. nginx builds the upstream request before any peer
 * is chosen, so neither proxy_set_header nor a variable could carry a
 * per-attempt choice: the head the proxy module built is rewritten here,
 * per attempt, from the copy it built first.
 */


#include "ngx_http_kvroute.h"


#define NGX_HTTP_KVROUTE_PREFILL_HEADER  "X-KVRoute-Prefill"


static ngx_int_t ngx_http_kvroute_prefill_client_header(ngx_http_request_t *r);
static void ngx_http_kvroute_prefill_match(ngx_http_request_t *r,
    ngx_http_kvroute_srv_conf_t *pkcf, ngx_http_kvroute_ctx_t *ctx);


/* Configuration: the prefill upstream must exist, be a kvroute upstream of
 * the same zone (one index and load table hold both pools), and not itself
 * name a prefill upstream. */

ngx_int_t
ngx_http_kvroute_prefill_resolve(ngx_conf_t *cf,
    ngx_http_upstream_srv_conf_t *us, ngx_http_kvroute_srv_conf_t *kcf)
{
    ngx_uint_t                       i;
    ngx_http_kvroute_srv_conf_t     *pkcf;
    ngx_http_upstream_srv_conf_t   **uscfp;
    ngx_http_upstream_main_conf_t   *umcf;

    if (kcf->prefill_name.len == 0) {
        return NGX_OK;
    }

    if (kcf->zone == NULL) {
        ngx_log_error(NGX_LOG_EMERG, cf->log, 0,
                      "kvroute: upstream \"%V\" has prefill=%V but no zone=; "
                      "both upstreams need the same kvroute zone",
                      &us->host, &kcf->prefill_name);
        return NGX_ERROR;
    }

    umcf = ngx_http_conf_get_module_main_conf(cf, ngx_http_upstream_module);
    uscfp = umcf->upstreams.elts;

    for (i = 0; i < umcf->upstreams.nelts; i++) {
        if (uscfp[i]->host.len == kcf->prefill_name.len
            && ngx_strncasecmp(uscfp[i]->host.data, kcf->prefill_name.data,
                               kcf->prefill_name.len) == 0
            && uscfp[i]->srv_conf)
        {
            break;
        }
    }

    if (i == umcf->upstreams.nelts) {
        ngx_log_error(NGX_LOG_EMERG, cf->log, 0,
                      "kvroute: upstream \"%V\" has prefill=%V, but there is "
                      "no upstream \"%V\"", &us->host, &kcf->prefill_name,
                      &kcf->prefill_name);
        return NGX_ERROR;
    }

    pkcf = ngx_http_conf_upstream_srv_conf(uscfp[i], ngx_http_kvroute_module);

    if (uscfp[i] == us) {
        ngx_log_error(NGX_LOG_EMERG, cf->log, 0,
                      "kvroute: upstream \"%V\" names itself in prefill=",
                      &us->host);
        return NGX_ERROR;
    }

    if (pkcf == NULL || pkcf->uscf != uscfp[i] || pkcf->zone != kcf->zone) {
        ngx_log_error(NGX_LOG_EMERG, cf->log, 0,
                      "kvroute: prefill=%V in upstream \"%V\": upstream "
                      "\"%V\" needs \"kvroute zone=%V\" (the same zone)",
                      &kcf->prefill_name, &us->host, &kcf->prefill_name,
                      &kcf->zone->name);
        return NGX_ERROR;
    }

    if (pkcf->prefill_name.len) {
        ngx_log_error(NGX_LOG_EMERG, cf->log, 0,
                      "kvroute: prefill=%V in upstream \"%V\": a prefill "
                      "upstream cannot have prefill= itself",
                      &kcf->prefill_name, &us->host);
        return NGX_ERROR;
    }

    kcf->prefill = pkcf;

    /* the transfer, ms per token: bytes x 8 / (Gb/s x 1e6) */
    kcf->prefill_cfg.xfer_ms_per_token =
        kcf->prefill_link_gbps > 0
        ? (double) kcf->prefill_kv_bytes * 8 / (kcf->prefill_link_gbps * 1e6)
        : 0;

    return NGX_OK;
}


/* A prefill server that can take work: up, not failed (if anything proxies
 * to it directly), counted in the load table, and, in events mode, known to
 * the registry and not gone: a decode worker pulls over the kvroute
 * transfer protocol, which only kvworkers speak, and kvworkers announce
 * themselves; one silent past the heartbeat timeout is dropped from the
 * registry, and requests then prefill locally instead of each paying a
 * failed connection. */

static ngx_uint_t
ngx_http_kvroute_prefill_usable(ngx_http_kvroute_srv_conf_t *pkcf,
    ngx_http_kvroute_peer_t *p, kv_route_server_t *s, time_t now)
{
    int                           i;
    kv_worker_rec_t               rec;
    ngx_http_upstream_rr_peer_t  *peer = p->peer;

    if (p->load < 0 || peer->down) {
        return 0;
    }

    if (peer->max_fails
        && peer->fails >= peer->max_fails
        && now - peer->checked <= peer->fail_timeout)
    {
        return 0;
    }

    if (pkcf->zone->events_conf == NULL) {
        return 1;
    }

    if (ngx_http_kvroute_peer_record(pkcf->zone, p, &rec) != NGX_OK) {

        /* peer_record skips the scan for a second after a miss; a prefill
         * server that just announced itself must not wait that long */

        i = kv_registry_find(pkcf->zone->sh->registry, p->worker_id, 0);

        if (i < 0 || kv_registry_read(pkcf->zone->sh->registry, i, &rec) != 0) {
            return 0;
        }

        p->reg = i;
        p->reg_miss = 0;
    }

    if (rec.state == KV_WORKER_GONE) {
        return 0;
    }

    s->trusted = rec.state == KV_WORKER_LIVE;
    s->reported = 1;
    s->reported_prefill_tokens = rec.load.active_prefill_tokens;
    s->reported_decode_blocks = rec.load.active_decode_blocks;

    return 1;
}


/*
 * The prefill half of the attempt's decision, after the decode worker was
 * chosen with res (its prefill tokens are zeroed for a remote prefill: the
 * decode worker then computes none); d: that decode worker's inputs as
 * kv_route_pick saw them (its queued prefill, requests, learned line: the
 * local side of conditional disaggregation). res NULL: a backup decode
 * server, which prefills locally.
 */

void
ngx_http_kvroute_prefill_choose(ngx_http_request_t *r,
    ngx_http_kvroute_ctx_t *ctx, kv_route_result_t *res,
    const kv_route_server_t *d)
{
    int                           pick;
    time_t                        now;
    ngx_uint_t                    i;
    kv_load_server_t              ls;
    kv_route_server_t            *s, small[16];
    kv_route_request_t            rq;
    kv_prefill_result_t           pr;
    ngx_http_kvroute_peer_t      *p;
    ngx_http_kvroute_srv_conf_t  *kcf = ctx->conf, *pkcf = kcf->prefill;
    ngx_http_upstream_rr_peers_t *peers;

    ngx_http_kvroute_prefill_close(ctx);

    ctx->prefill_peer = NULL;
    ctx->prefill_remote = 0;
    ctx->prefill_why = KV_PREFILL_LOCAL_NONE;
    ctx->prefill_remote_ms = 0;
    ctx->prefill_local_ms = 0;

    /* a request with nothing to decode (an embedding) has no decode side */

    if (res == NULL || pkcf == NULL || pkcf->peers == NULL
        || pkcf->nprimary == 0 || ctx->prefill_only)
    {
        return;
    }

    if (ctx->prefill_overlap == NULL) {
        ngx_http_kvroute_prefill_match(r, pkcf, ctx);
        if (ctx->prefill_overlap == NULL) {
            return;
        }
    }

    s = pkcf->nprimary <= 16 ? small
        : ngx_palloc(r->pool, pkcf->nprimary * sizeof(kv_route_server_t));
    if (s == NULL) {
        return;
    }

    now = ngx_time();
    peers = pkcf->uscf->peer.data;

    for (i = 0; i < pkcf->nprimary; i++) {
        p = &pkcf->peers[i];

        ngx_memzero(&s[i], sizeof(kv_route_server_t));

        s[i].id = p->worker_id;
        s[i].trusted = 1;
        s[i].overlap_index = ctx->prefill_overlap[i];
        s[i].overlap_pending = ctx->prefill_pending[i];

        if (p->load >= 0) {
            kv_load_get(kcf->zone->sh->load, p->load, &ls);
            s[i].prefill_tokens = ls.active[KV_LOAD_PREFILL_TOKENS];
            s[i].requests = ls.active[KV_LOAD_REQUESTS];
            s[i].prefill_rate = ls.prefill_rate;
            s[i].prefill_base = ls.prefill_base;
        }

        s[i].usable = ngx_http_kvroute_prefill_usable(pkcf, p, &s[i], now);
    }

    ngx_http_upstream_rr_peers_rlock(peers);

    for (i = 0; i < pkcf->nprimary; i++) {
        s[i].weight = pkcf->peers[i].peer->weight;
    }

    ngx_http_upstream_rr_peers_unlock(peers);

    ngx_memzero(&rq, sizeof(kv_route_request_t));   /* no session: prefill has none */
    rq.prompt_tokens = ctx->prompt_tokens;
    rq.seq = ctx->seq;
    rq.nseq = ctx->nseq;
    rq.max_tokens = ctx->max_tokens;
    rq.batch_tokens = ctx->batch_tokens;

    pick = kv_prefill_pick(s, pkcf->nprimary, &rq, d, &kcf->prefill_cfg,
                           &kcf->route, &pkcf->route,
                           (uint64_t) ngx_random() << 32 ^ ngx_random(), &pr);

    ctx->prefill_why = pr.why;
    ctx->prefill_remote_ms = pr.remote_ms;
    ctx->prefill_local_ms = pr.local_ttft_ms;

    ngx_log_debug6(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                   "kvroute prefill: %s, %uL tokens uncached at the decode "
                   "worker, pick %d, remote %.1f ms (transfer %.1f), "
                   "local %.1f ms", kv_prefill_why_name(pr.why),
                   pr.uncached_local, pick, pr.remote_ms, pr.xfer_ms,
                   pr.local_ms);

    if (pick < 0) {
        return;
    }

    p = &pkcf->peers[pick];

    ctx->prefill_peer = p;
    ctx->prefill_remote = 1;
    ctx->prefill_chosen_overlap = pr.route.overlap;

    /* the decode worker computes nothing of the prompt now */
    res->prefill_tokens = 0;

    /* the prefill server's load, until the decode worker's header */

    ctx->prefill_load = p->load;
    ctx->prefill_held = pr.route.prefill_tokens;
    ctx->prefill_queued = pr.route.queued_tokens;
    ctx->prefill_xfer_ms = pr.xfer_ms;
    ctx->prefill_open_ns = ngx_http_kvroute_now_ns();
    ctx->prefill_active = 1;

    kv_load_add(kcf->zone->sh->load, kcf->zone->row, p->load,
                KV_LOAD_PREFILL_TOKENS, ctx->prefill_held);
    kv_load_add(kcf->zone->sh->load, kcf->zone->row, p->load,
                KV_LOAD_REQUESTS, 1);
    kv_load_count(kcf->zone->sh->load, p->load, pr.route.overlap,
                  (uint32_t) (ctx->prompt_tokens / pkcf->block_size));

    ngx_http_kvroute_record(pkcf, ctx, p, &s[pick]);
}


/* The decode worker's response header: the KV is in place, the prefill
 * server's part is over. What it prefilled (queue included) over that time
 * is a sample of its prefill rate: the transfer included when no link is
 * configured (what a decode worker waits for), else less the transfer's
 * estimate, which the decision then adds itself. */

void
ngx_http_kvroute_prefill_done(ngx_http_kvroute_ctx_t *ctx)
{
    double                    ms;
    ngx_http_kvroute_zone_t  *zone = ctx->conf->zone;

    if (!ctx->prefill_active) {
        return;
    }

    ms = (double) (ngx_http_kvroute_now_ns() - ctx->prefill_open_ns) / 1e6;

    /* a sample the transfer estimate would make negative teaches nothing;
     * nor does an error answer's */
    if (ctx->answered_ok && ms > ctx->prefill_xfer_ms) {
        kv_load_learn_prefill(zone->sh->load, ctx->prefill_load,
                              (double) (ctx->prefill_queued
                                        + ctx->prefill_held),
                              ms - ctx->prefill_xfer_ms);
    }

    ngx_http_kvroute_prefill_close(ctx);
}


/* The attempt ended (or failed, or the request went away) first. */

void
ngx_http_kvroute_prefill_close(ngx_http_kvroute_ctx_t *ctx)
{
    ngx_http_kvroute_zone_t  *zone = ctx->conf->zone;

    if (!ctx->prefill_active) {
        return;
    }

    ctx->prefill_active = 0;

    kv_load_add(zone->sh->load, zone->row, ctx->prefill_load,
                KV_LOAD_PREFILL_TOKENS, -ctx->prefill_held);
    kv_load_add(zone->sh->load, zone->row, ctx->prefill_load,
                KV_LOAD_REQUESTS, -1);
}


/* Overlap per prefill primary, once per request, as the balancer's match
 * does for the decode servers. */

static void
ngx_http_kvroute_prefill_overlaps(ngx_http_kvroute_srv_conf_t *pkcf,
    kv_index_t *ix, ngx_http_kvroute_ctx_t *ctx, uint32_t *out)
{
    size_t        i, n;
    uint32_t      dp;
    uint64_t      wid;
    ngx_uint_t    k;
    kv_overlap_t  ov[64];

    n = kv_index_match(ix, ctx->seq, ctx->nseq, ov, 64);

    for (i = 0; i < n; i++) {
        if (kv_index_worker_info(ix, ov[i].slot, &wid, &dp) != 0) {
            continue;
        }

        for (k = 0; k < pkcf->nprimary; k++) {
            if (pkcf->peers[k].worker_id == wid && ov[i].blocks > out[k]) {
                out[k] = ov[i].blocks;
            }
        }
    }
}


static void
ngx_http_kvroute_prefill_match(ngx_http_request_t *r,
    ngx_http_kvroute_srv_conf_t *pkcf, ngx_http_kvroute_ctx_t *ctx)
{
    ngx_uint_t       k;
    kv_worker_rec_t  rec;

    ctx->prefill_overlap = ngx_pcalloc(r->pool,
                                       2 * pkcf->nprimary * sizeof(uint32_t));
    if (ctx->prefill_overlap == NULL) {
        return;
    }

    ctx->prefill_pending = ctx->prefill_overlap + pkcf->nprimary;

    if (ctx->nseq == 0) {
        return;
    }

    for (k = 0; k < pkcf->nprimary; k++) {
        (void) ngx_http_kvroute_peer_record(pkcf->zone, &pkcf->peers[k], &rec);
    }

    ngx_http_kvroute_prefill_overlaps(pkcf, pkcf->zone->sh->index, ctx,
                                      ctx->prefill_overlap);

    if (pkcf->zone->sh->pending) {
        ngx_http_kvroute_prefill_overlaps(pkcf, pkcf->zone->sh->pending, ctx,
                                          ctx->prefill_pending);
    }

    for (k = 0; k < pkcf->nprimary; k++) {
        if (!ngx_http_kvroute_block_size_ok(pkcf, &pkcf->peers[k],
                                            r->connection->log))
        {
            ctx->prefill_overlap[k] = 0;
            ctx->prefill_pending[k] = 0;
        }
    }
}




/* Whether the client sent X-KVRoute-Prefill (any case, any number). */

static ngx_int_t
ngx_http_kvroute_prefill_client_header(ngx_http_request_t *r)
{
    ngx_uint_t        i;
    ngx_list_part_t  *part;
    ngx_table_elt_t  *h;

    part = &r->headers_in.headers.part;
    h = part->elts;

    for (i = 0; /* void */; i++) {

        if (i >= part->nelts) {
            if (part->next == NULL) {
                return 0;
            }

            part = part->next;
            h = part->elts;
            i = 0;
        }

        if (h[i].key.len == sizeof(NGX_HTTP_KVROUTE_PREFILL_HEADER) - 1
            && ngx_strncasecmp(h[i].key.data,
                               (u_char *) NGX_HTTP_KVROUTE_PREFILL_HEADER,
                               h[i].key.len) == 0)
        {
            return 1;
        }
    }
}


/* One header line [p, end) (CRLF excluded) names X-KVRoute-Prefill. */

static ngx_uint_t
ngx_http_kvroute_prefill_line(u_char *p, u_char *end)
{
    size_t  n = sizeof(NGX_HTTP_KVROUTE_PREFILL_HEADER) - 1;

    while (end > p && (end[-1] == ' ' || end[-1] == '\t')) {
        end--;
    }

    if ((size_t) (end - p) <= n) {
        return 0;
    }

    if (ngx_strncasecmp(p, (u_char *) NGX_HTTP_KVROUTE_PREFILL_HEADER, n)
        != 0)
    {
        return 0;
    }

    p += n;

    while (p < end && (*p == ' ' || *p == '\t')) {
        p++;
    }

    return p < end && *p == ':';
}


/*
 * Per attempt, after the peer is chosen: the request head the proxy module
 * built, without any X-KVRoute-Prefill line, plus ours for a remote
 * prefill. Only an HTTP/1.x head in memory (proxy_pass) can be rewritten;
 * anything else keeps its head and prefills locally. NGX_ERROR: no memory
 * for a head that had to change.
 */

ngx_int_t
ngx_http_kvroute_prefill_header(ngx_http_kvroute_peer_data_t *pd)
{
    size_t                    len;
    u_char                   *p, *end, *line, *eol, *hdr_end, *d;
    ngx_buf_t                *b, *nb;
    ngx_str_t                *addr;
    ngx_chain_t              *cl;
    ngx_http_request_t       *r = pd->request;
    ngx_http_upstream_t      *u = r->upstream;
    ngx_http_kvroute_ctx_t   *ctx = pd->ctx;

    if (u == NULL || u->request_bufs == NULL) {
        goto local;
    }

    cl = u->request_bufs;

    if (pd->request_head == NULL) {

        /* first attempt: only touch heads that need it */

        if (!(ctx && ctx->conf->prefill)
            && !ngx_http_kvroute_prefill_client_header(r))
        {
            return NGX_OK;
        }

        b = cl->buf;

        if (b->in_file || b->pos == NULL || b->last <= b->pos) {
            goto unknown;
        }

        pd->request_head = ngx_calloc_buf(r->pool);
        if (pd->request_head == NULL) {
            return NGX_ERROR;
        }

        *pd->request_head = *b;
    }

    b = pd->request_head;

    /* the head ends at the first empty line; the request line says HTTP/1 */

    p = b->pos;
    end = b->last;

    eol = ngx_strlchr(p, end, LF);
    if (eol == NULL || eol - p < 12 || eol[-1] != CR
        || ngx_strncmp(eol - 10, " HTTP/1.", 8) != 0)
    {
        goto unknown;
    }

    hdr_end = NULL;

    for (line = eol + 1; line < end; line = eol + 1) {
        eol = ngx_strlchr(line, end, LF);
        if (eol == NULL || eol == line || eol[-1] != CR) {
            goto unknown;
        }

        if (eol - 1 == line) {
            hdr_end = line;         /* the empty line */
            break;
        }
    }

    if (hdr_end == NULL) {
        goto unknown;
    }

    addr = ctx && ctx->prefill_remote ? &ctx->prefill_peer->server : NULL;

    len = (end - p) + (addr ? sizeof(NGX_HTTP_KVROUTE_PREFILL_HEADER ": \r\n")
                              - 1 + addr->len
                            : 0);

    d = ngx_pnalloc(r->pool, len);
    if (d == NULL) {
        return NGX_ERROR;
    }

    nb = ngx_calloc_buf(r->pool);
    if (nb == NULL) {
        return NGX_ERROR;
    }

    *nb = *b;
    nb->start = d;
    nb->pos = d;

    /* the request line, then every header line but ours */

    eol = ngx_strlchr(p, end, LF);
    d = ngx_cpymem(d, p, eol + 1 - p);

    for (line = eol + 1; line < hdr_end; line = eol + 1) {
        eol = ngx_strlchr(line, end, LF);

        if (ngx_http_kvroute_prefill_line(line, eol - 1)) {
            ngx_log_debug0(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                           "kvroute: removed X-KVRoute-Prefill from the "
                           "proxied request");
            continue;
        }

        d = ngx_cpymem(d, line, eol + 1 - line);
    }

    if (addr) {
        d = ngx_cpymem(d, NGX_HTTP_KVROUTE_PREFILL_HEADER ": ",
                       sizeof(NGX_HTTP_KVROUTE_PREFILL_HEADER ": ") - 1);
        d = ngx_cpymem(d, addr->data, addr->len);
        *d++ = CR; *d++ = LF;
    }

    /* the empty line and whatever followed it in this buffer */

    d = ngx_cpymem(d, hdr_end, end - hdr_end);

    nb->last = d;
    nb->end = d;
    nb->temporary = 1;
    nb->memory = 0;
    nb->mmap = 0;
    nb->in_file = 0;
    nb->file = NULL;

    cl->buf = nb;

    return NGX_OK;

unknown:

    /* not a head this module can edit (not proxy_pass over HTTP/1.x):
     * nothing can be inserted, so the decode worker prefills itself */

    ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                  "kvroute: the proxied request's head is not HTTP/1.x in "
                  "memory; X-KVRoute-Prefill can be neither removed nor set "
                  "(use proxy_pass)");

local:

    if (ctx && ctx->prefill_remote) {
        ngx_http_kvroute_prefill_close(ctx);
        ctx->prefill_peer = NULL;
        ctx->prefill_remote = 0;
        ctx->prefill_why = KV_PREFILL_LOCAL_NONE;
    }

    return NGX_OK;
}
