
/*
 * Copyright (C) kvroute authors
 *
 * Response filters: the header filter adds X-KVRoute-Worker and
 * X-KVRoute-Overlap when kvroute_debug_headers is on; the body filter sees
 * the first response body byte, which for an LLM response is the first
 * token, and releases the attempt's prefill load there. (Headers are no
 * such signal: a streaming server sends them before the first token.)
 * With prefill= the header filter releases the prefill server's load: a
 * decode worker sends its header once the KV is in place; debug headers
 * then add X-KVRoute-Prefill-Worker (host:port or "local") and
 * X-KVRoute-Prefill-Reason (remote, short, none, busy).
 */


#include "ngx_http_kvroute.h"


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
        ngx_http_kvroute_prefill_done(ctx);
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
            if (ngx_buf_size(cl->buf) > 0) {
                ngx_http_kvroute_acct_prefill_done(ctx);
                break;
            }
        }
    }

    return ngx_http_next_body_filter(r, in);
}
