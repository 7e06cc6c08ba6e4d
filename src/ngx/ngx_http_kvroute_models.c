
/*
 * Copyright (C) kvroute authors
 *
 * kvroute_models NAME ...: answers GET /v1/models (and /v1/models/{id}) for
 * the models of several kvroute upstreams at once, as an engine lists its
 * own, so that clients that ask which models exist see every model a
 * location serves ("kvroute_upstream A B ..." proxies a GET to the first
 * upstream alone). Each upstream's model= names are listed, and its lora=
 * names with their base (model='s first) as "parent", as vLLM lists
 * adapters; lora=* lists none.
 */


#include "ngx_http_kvroute.h"


static ngx_int_t ngx_http_kvroute_models_handler(ngx_http_request_t *r);
static size_t ngx_http_kvroute_models_size(ngx_array_t *refs);
static u_char *ngx_http_kvroute_models_list(u_char *p, ngx_array_t *models);
static u_char *ngx_http_kvroute_model_entry(u_char *b, u_char *id,
    size_t len, ngx_str_t *parent);
static ngx_int_t ngx_http_kvroute_models_find(ngx_array_t *refs,
    ngx_str_t *id, ngx_str_t **parent);
static ngx_uint_t ngx_http_kvroute_name_in(ngx_str_t *names, ngx_uint_t n,
    ngx_str_t *id);


char *
ngx_http_kvroute_models_directive(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf)
{
    ngx_http_kvroute_loc_conf_t *klcf = conf;

    ngx_str_t                         *value;
    ngx_uint_t                         i;
    ngx_http_core_loc_conf_t          *clcf;
    ngx_http_kvroute_upstream_ref_t   *ref, **refp;

    if (klcf->models) {
        return "is duplicate";
    }

    value = cf->args->elts;

    klcf->models = ngx_array_create(cf->pool, cf->args->nelts - 1,
                                    sizeof(ngx_http_kvroute_upstream_ref_t *));
    if (klcf->models == NULL) {
        return NGX_CONF_ERROR;
    }

    for (i = 1; i < cf->args->nelts; i++) {
        ref = ngx_http_kvroute_upstream_ref(cf, &value[i]);
        if (ref == NULL) {
            return NGX_CONF_ERROR;
        }

        ref->listed = 1;

        refp = ngx_array_push(klcf->models);
        if (refp == NULL) {
            return NGX_CONF_ERROR;
        }

        *refp = ref;
    }

    clcf = ngx_http_conf_get_module_loc_conf(cf, ngx_http_core_module);
    clcf->handler = ngx_http_kvroute_models_handler;

    return NGX_CONF_OK;
}


/*
 * ".../models" (or ".../models/"): the list; ".../models/ID": that model
 * (IDs may hold slashes, as Hugging Face names do), or 404 model_not_found.
 */

static ngx_int_t
ngx_http_kvroute_models_handler(ngx_http_request_t *r)
{
    u_char                       *p;
    size_t                        size;
    ngx_int_t                     rc;
    ngx_str_t                     id, body, *parent;
    ngx_http_kvroute_loc_conf_t  *klcf;

    if (!(r->method & (NGX_HTTP_GET|NGX_HTTP_HEAD))) {
        return NGX_HTTP_NOT_ALLOWED;
    }

    rc = ngx_http_discard_request_body(r);
    if (rc != NGX_OK) {
        return rc;
    }

    klcf = ngx_http_get_module_loc_conf(r, ngx_http_kvroute_module);

    ngx_str_null(&id);
    parent = NULL;

    p = ngx_strlcasestrn(r->uri.data, r->uri.data + r->uri.len,
                         (u_char *) "/models", sizeof("/models") - 2);

    if (p && (size_t) (r->uri.data + r->uri.len - p) > sizeof("/models/") - 1
        && p[sizeof("/models") - 1] == '/')
    {
        id.data = p + sizeof("/models/") - 1;
        id.len = r->uri.data + r->uri.len - id.data;
    }

    if (id.len == 0) {
        size = ngx_http_kvroute_models_size(klcf->models);

    } else if (ngx_http_kvroute_models_find(klcf->models, &id, &parent)
               == NGX_OK)
    {
        size = 128 + 6 * id.len + (parent ? 6 * parent->len : 0);

    } else {
        return ngx_http_kvroute_model_not_found(r);
    }

    body.data = ngx_pnalloc(r->pool, size);
    if (body.data == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    p = id.len ? ngx_http_kvroute_model_entry(body.data, id.data, id.len, parent)
               : ngx_http_kvroute_models_list(body.data, klcf->models);
    *p++ = '\n';
    body.len = p - body.data;

    return ngx_http_kvroute_send_json(r, NGX_HTTP_OK, &body);
}


/* {"object":"list","data":[...]}: every model=, then its lora= names */

static u_char *
ngx_http_kvroute_models_list(u_char *p, ngx_array_t *models)
{
    ngx_uint_t                         i, j;
    ngx_http_kvroute_srv_conf_t       *kcf;
    ngx_http_kvroute_upstream_ref_t  **refs;

    refs = models->elts;

    p = ngx_cpymem(p, "{\"object\":\"list\",\"data\":[",
                   sizeof("{\"object\":\"list\",\"data\":[") - 1);

    for (i = 0; i < models->nelts; i++) {
        kcf = refs[i]->conf;

        for (j = 0; j < kcf->nmodels; j++) {
            p = ngx_http_kvroute_model_entry(p, kcf->models[j].data,
                                             kcf->models[j].len, NULL);
            *p++ = ',';
        }

        for (j = 0; j < kcf->nloras; j++) {
            p = ngx_http_kvroute_model_entry(p, kcf->loras[j].data,
                                             kcf->loras[j].len,
                                             &kcf->models[0]);
            *p++ = ',';
        }
    }

    if (models->nelts) {
        p--;                        /* the last ',' */
    }

    return ngx_cpymem(p, "]}", 2);
}


static size_t
ngx_http_kvroute_models_size(ngx_array_t *models)
{
    size_t                             size;
    ngx_uint_t                         i, j;
    ngx_http_kvroute_srv_conf_t       *kcf;
    ngx_http_kvroute_upstream_ref_t  **refs;

    refs = models->elts;
    size = 64;

    for (i = 0; i < models->nelts; i++) {
        kcf = refs[i]->conf;
        size += 128 * kcf->nmodels + 6 * kcf->model.len;

        for (j = 0; j < kcf->nloras; j++) {
            size += 128 + 6 * (kcf->loras[j].len + kcf->models[0].len);
        }
    }

    return size;
}


/* {"id","object":"model","created","owned_by","parent"}: an adapter's
 * parent is its base model, as vLLM gives it; a base model's is null */

static u_char *
ngx_http_kvroute_model_entry(u_char *b, u_char *id, size_t len,
    ngx_str_t *parent)
{
    b = ngx_cpymem(b, "{\"id\":", sizeof("{\"id\":") - 1);
    b = ngx_http_kvroute_json_strn(b, id, len);
    b = ngx_sprintf(b, ",\"object\":\"model\",\"created\":%T,"
                       "\"owned_by\":\"kvroute\",\"parent\":", ngx_time());

    if (parent) {
        b = ngx_http_kvroute_json_strn(b, parent->data, parent->len);

    } else {
        b = ngx_cpymem(b, "null", 4);
    }

    *b++ = '}';

    return b;
}


static ngx_int_t
ngx_http_kvroute_models_find(ngx_array_t *models, ngx_str_t *id,
    ngx_str_t **parent)
{
    ngx_uint_t                         i;
    ngx_http_kvroute_srv_conf_t       *kcf;
    ngx_http_kvroute_upstream_ref_t  **refs;

    refs = models->elts;

    for (i = 0; i < models->nelts; i++) {
        kcf = refs[i]->conf;

        if (ngx_http_kvroute_name_in(kcf->models, kcf->nmodels, id)) {
            *parent = NULL;
            return NGX_OK;
        }

        if (ngx_http_kvroute_name_in(kcf->loras, kcf->nloras, id)) {
            *parent = &kcf->models[0];
            return NGX_OK;
        }
    }

    return NGX_DECLINED;
}


static ngx_uint_t
ngx_http_kvroute_name_in(ngx_str_t *names, ngx_uint_t n, ngx_str_t *id)
{
    ngx_uint_t  i;

    for (i = 0; i < n; i++) {
        if (names[i].len == id->len
            && ngx_strncmp(names[i].data, id->data, id->len) == 0)
        {
            return 1;
        }
    }

    return 0;
}
