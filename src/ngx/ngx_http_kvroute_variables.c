
/*
 * Copyright (C) kvroute authors
 *
 * $kvroute_* variables, for access logs: what was decided and why.
 */


#include "ngx_http_kvroute.h"


typedef enum {
    NGX_HTTP_KVROUTE_VAR_WORKER = 0,
    NGX_HTTP_KVROUTE_VAR_OVERLAP,
    NGX_HTTP_KVROUTE_VAR_PROMPT_BLOCKS,
    NGX_HTTP_KVROUTE_VAR_PROMPT_TOKENS,
    NGX_HTTP_KVROUTE_VAR_DECISION_US,
    NGX_HTTP_KVROUTE_VAR_COST,
    NGX_HTTP_KVROUTE_VAR_TURN_CACHED,
    NGX_HTTP_KVROUTE_VAR_FALLBACK,
    NGX_HTTP_KVROUTE_VAR_WHY
} ngx_http_kvroute_var_e;


static ngx_int_t ngx_http_kvroute_variable(ngx_http_request_t *r,
    ngx_http_variable_value_t *v, uintptr_t data);


static ngx_http_variable_t  ngx_http_kvroute_vars[] = {

    { ngx_string("kvroute_worker"), NULL, ngx_http_kvroute_variable,
      NGX_HTTP_KVROUTE_VAR_WORKER, NGX_HTTP_VAR_NOCACHEABLE, 0 },

    { ngx_string("kvroute_overlap_blocks"), NULL, ngx_http_kvroute_variable,
      NGX_HTTP_KVROUTE_VAR_OVERLAP, NGX_HTTP_VAR_NOCACHEABLE, 0 },

    { ngx_string("kvroute_prompt_blocks"), NULL, ngx_http_kvroute_variable,
      NGX_HTTP_KVROUTE_VAR_PROMPT_BLOCKS, NGX_HTTP_VAR_NOCACHEABLE, 0 },

    { ngx_string("kvroute_prompt_tokens"), NULL, ngx_http_kvroute_variable,
      NGX_HTTP_KVROUTE_VAR_PROMPT_TOKENS, NGX_HTTP_VAR_NOCACHEABLE, 0 },

    { ngx_string("kvroute_decision_us"), NULL, ngx_http_kvroute_variable,
      NGX_HTTP_KVROUTE_VAR_DECISION_US, NGX_HTTP_VAR_NOCACHEABLE, 0 },

    { ngx_string("kvroute_cost"), NULL, ngx_http_kvroute_variable,
      NGX_HTTP_KVROUTE_VAR_COST, NGX_HTTP_VAR_NOCACHEABLE, 0 },

    { ngx_string("kvroute_turn_cached_tokens"), NULL,
      ngx_http_kvroute_variable, NGX_HTTP_KVROUTE_VAR_TURN_CACHED,
      NGX_HTTP_VAR_NOCACHEABLE, 0 },

    { ngx_string("kvroute_fallback"), NULL, ngx_http_kvroute_variable,
      NGX_HTTP_KVROUTE_VAR_FALLBACK, NGX_HTTP_VAR_NOCACHEABLE, 0 },

    { ngx_string("kvroute_why"), NULL, ngx_http_kvroute_variable,
      NGX_HTTP_KVROUTE_VAR_WHY, NGX_HTTP_VAR_NOCACHEABLE, 0 },

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
    const char              *s;
    ngx_http_kvroute_ctx_t  *ctx;

    ctx = ngx_http_get_module_ctx(r->main, ngx_http_kvroute_module);

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
