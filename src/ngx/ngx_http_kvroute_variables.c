
/*
 * Copyright (C) kvroute authors
 *
 * $kvroute_* variables, for access logs: what was decided and why.
 */


#include "ngx_http_kvroute.h"


/* $kvroute_NAME for each X(NAME, ID) */
#define NGX_HTTP_KVROUTE_VARIABLES(X)                                         \
    X(worker, WORKER)                                                         \
    X(overlap_blocks, OVERLAP)                                                \
    X(prompt_blocks, PROMPT_BLOCKS)                                           \
    X(prompt_tokens, PROMPT_TOKENS)                                           \
    X(decision_us, DECISION_US)                                               \
    X(cost, COST)                                                             \
    X(turn_cached_tokens, TURN_CACHED)                                        \
    X(fallback, FALLBACK)                                                     \
    X(why, WHY)                                                               \
    /* prefill= (disaggregated): the prefill server, or "local" */            \
    X(prefill_worker, PREFILL_WORKER)                                         \
    X(prefill_overlap_blocks, PREFILL_OVERLAP)                                \
    X(prefill_reason, PREFILL_REASON)                                         \
    /* conditional disaggregation's two TTFT estimates (ms), for checking  \
     * them against the response's $upstream_header_time */                \
    X(prefill_remote_ms, PREFILL_REMOTE_MS)                                   \
    X(prefill_local_ms, PREFILL_LOCAL_MS)                                     \
    /* the upstream chosen by model ("kvroute_upstream A B ...") */           \
    X(upstream, UPSTREAM)


#define NGX_HTTP_KVROUTE_VAR_ID(name, id)  NGX_HTTP_KVROUTE_VAR_##id,

typedef enum {
    NGX_HTTP_KVROUTE_VARIABLES(NGX_HTTP_KVROUTE_VAR_ID)
    NGX_HTTP_KVROUTE_VAR_N
} ngx_http_kvroute_var_e;


static ngx_int_t ngx_http_kvroute_variable(ngx_http_request_t *r,
    ngx_http_variable_value_t *v, uintptr_t data);
static ngx_int_t ngx_http_kvroute_upstream_variable(ngx_http_request_t *r,
    ngx_http_variable_value_t *v, ngx_http_kvroute_ctx_t *ctx);


#define NGX_HTTP_KVROUTE_VAR(name, id)                                        \
    { ngx_string("kvroute_" #name), NULL, ngx_http_kvroute_variable,          \
      NGX_HTTP_KVROUTE_VAR_##id, NGX_HTTP_VAR_NOCACHEABLE, 0 },

static ngx_http_variable_t  ngx_http_kvroute_vars[] = {
    NGX_HTTP_KVROUTE_VARIABLES(NGX_HTTP_KVROUTE_VAR)
    ngx_http_null_variable
};


ngx_int_t
ngx_http_kvroute_add_variables(ngx_conf_t *cf)
{
    ngx_http_variable_t  *var, *v;

    for (v = ngx_http_kvroute_vars; v->name.len; v++) {
        var = ngx_http_add_variable(cf, &v->name, v->flags);
        if (var == NULL) {
            return NGX_ERROR;
        }

        var->get_handler = v->get_handler;
        var->data = v->data;
    }

    return NGX_OK;
}


static ngx_int_t
ngx_http_kvroute_variable(ngx_http_request_t *r,
    ngx_http_variable_value_t *v, uintptr_t data)
{
    u_char                  *p;
    double                   d;
    const char              *s;
    ngx_http_kvroute_ctx_t  *ctx;

    ctx = ngx_http_get_module_ctx(r->main, ngx_http_kvroute_module);

    if (data == NGX_HTTP_KVROUTE_VAR_UPSTREAM) {
        return ngx_http_kvroute_upstream_variable(r, v, ctx);
    }

    if (ctx == NULL) {
        v->not_found = 1;
        return NGX_OK;
    }

    p = ngx_pnalloc(r->pool, NGX_INT64_LEN + 8);    /* "%.3f" too */
    if (p == NULL) {
        return NGX_ERROR;
    }

    v->data = p;

    switch (data) {

    case NGX_HTTP_KVROUTE_VAR_WORKER:
        if (ctx->chosen == NULL) {
            v->not_found = 1;
            return NGX_OK;
        }
        v->data = ctx->chosen->server.data;
        v->len = ctx->chosen->server.len;
        break;

    case NGX_HTTP_KVROUTE_VAR_OVERLAP:
        v->len = ngx_sprintf(p, "%uD", ctx->chosen_overlap) - p;
        break;

    case NGX_HTTP_KVROUTE_VAR_PROMPT_BLOCKS:
        v->len = ngx_sprintf(p, "%uz", ctx->nseq) - p;
        break;

    case NGX_HTTP_KVROUTE_VAR_PROMPT_TOKENS:
        v->len = ngx_sprintf(p, "%uL", ctx->prompt_tokens) - p;
        break;

    case NGX_HTTP_KVROUTE_VAR_DECISION_US:
        v->len = ngx_sprintf(p, "%M", ctx->decision_us) - p;
        break;

    case NGX_HTTP_KVROUTE_VAR_COST:
        if (ctx->chosen == NULL) {
            v->not_found = 1;
            return NGX_OK;
        }
        v->len = ngx_sprintf(p, "%.3f", ctx->chosen_cost) - p;
        break;

    case NGX_HTTP_KVROUTE_VAR_TURN_CACHED:
        v->len = ngx_sprintf(p, "%uL", ctx->turn_cached_tokens) - p;
        break;

    case NGX_HTTP_KVROUTE_VAR_WHY:
        s = kv_route_why_name(ctx->why);
        v->data = (u_char *) s;
        v->len = ngx_strlen(s);
        break;

    case NGX_HTTP_KVROUTE_VAR_PREFILL_WORKER:
        if (ctx->conf->prefill == NULL || ctx->chosen == NULL) {
            v->not_found = 1;
            return NGX_OK;
        }
        if (ctx->prefill_peer) {
            v->data = ctx->prefill_peer->server.data;
            v->len = ctx->prefill_peer->server.len;
        } else {
            v->data = (u_char *) "local";
            v->len = sizeof("local") - 1;
        }
        break;

    case NGX_HTTP_KVROUTE_VAR_PREFILL_OVERLAP:
        if (ctx->prefill_peer == NULL) {
            v->not_found = 1;
            return NGX_OK;
        }
        v->len = ngx_sprintf(p, "%uD", ctx->prefill_chosen_overlap) - p;
        break;

    case NGX_HTTP_KVROUTE_VAR_PREFILL_REASON:
        if (ctx->conf->prefill == NULL || ctx->chosen == NULL) {
            v->not_found = 1;
            return NGX_OK;
        }
        s = kv_prefill_why_name(ctx->prefill_why);
        v->data = (u_char *) s;
        v->len = ngx_strlen(s);
        break;

    case NGX_HTTP_KVROUTE_VAR_PREFILL_REMOTE_MS:
    case NGX_HTTP_KVROUTE_VAR_PREFILL_LOCAL_MS:
        d = data == NGX_HTTP_KVROUTE_VAR_PREFILL_REMOTE_MS
            ? ctx->prefill_remote_ms : ctx->prefill_local_ms;
        if (ctx->conf->prefill == NULL || ctx->chosen == NULL || d <= 0) {
            v->not_found = 1;
            return NGX_OK;
        }
        v->len = ngx_sprintf(p, "%.1f", d) - p;
        break;

    default: /* NGX_HTTP_KVROUTE_VAR_FALLBACK */
        s = ngx_http_kvroute_fallback_names[ctx->fallback];
        v->data = (u_char *) s;
        v->len = ngx_strlen(s);
        break;
    }

    v->valid = 1;
    v->no_cacheable = 1;
    v->not_found = 0;

    return NGX_OK;
}


/*
 * $kvroute_upstream: the upstream the body's model chose among the
 * location's kvroute_upstream names, for "proxy_pass http://$kvroute_upstream";
 * the first name for a request kvroute did not read (GET /v1/models, say).
 */

static ngx_int_t
ngx_http_kvroute_upstream_variable(ngx_http_request_t *r,
    ngx_http_variable_value_t *v, ngx_http_kvroute_ctx_t *ctx)
{
    ngx_str_t                    *name;
    ngx_http_kvroute_loc_conf_t  *klcf;

    klcf = ngx_http_get_module_loc_conf(r->main, ngx_http_kvroute_module);

    if (ctx) {
        name = &ctx->conf->upstream_name;

    } else if (klcf->upstream) {
        name = &klcf->upstream->name;

    } else {
        v->not_found = 1;
        return NGX_OK;
    }

    v->data = name->data;
    v->len = name->len;
    v->valid = 1;
    v->no_cacheable = 1;
    v->not_found = 0;

    return NGX_OK;
}
