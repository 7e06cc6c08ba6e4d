
/*
 * Copyright (C) kvroute authors
 *
 * The kvroute balancer: the "kvroute" and "kvroute_worker_id" directives
 * and the upstream peer hooks. A request's prompt (prepared by
 * ngx_http_kvroute_prompt.c) is matched once against the shared prefix
 * index; every attempt then asks the routing decision
 * (src/route/kv_route.c) over the current shared load and takes its choice.
 * Servers keep their nginx meaning of weight, max_fails, fail_timeout,
 * max_conns, down and backup; backups are used, round-robin, only when no
 * primary is usable.
 */


#include "ngx_http_kvroute.h"
#include "kv_hash.h"
#include "kv_ingest.h"


static ngx_int_t ngx_http_kvroute_init_upstream(ngx_conf_t *cf,
    ngx_http_upstream_srv_conf_t *us);
static ngx_int_t ngx_http_kvroute_init_peer(ngx_http_request_t *r,
    ngx_http_upstream_srv_conf_t *us);
static ngx_int_t ngx_http_kvroute_get_peer(ngx_peer_connection_t *pc,
    void *data);
static ngx_int_t ngx_http_kvroute_choose_peer(ngx_peer_connection_t *pc,
    void *data);
static void ngx_http_kvroute_free_peer(ngx_peer_connection_t *pc,
    void *data, ngx_uint_t state);
static ngx_int_t ngx_http_kvroute_get_least_load(ngx_peer_connection_t *pc,
    ngx_http_upstream_rr_peer_data_t *rrp);
static ngx_uint_t ngx_http_kvroute_usable(ngx_http_upstream_rr_peer_data_t *rrp,
    ngx_http_upstream_rr_peer_t *peer, ngx_uint_t i, time_t now);
static void ngx_http_kvroute_cleanup_conf(void *data);
static ngx_uint_t ngx_http_kvroute_model_name(ngx_str_t *s);
static ngx_int_t ngx_http_kvroute_names(ngx_conf_t *cf, ngx_str_t *s,
    ngx_str_t *whole, ngx_str_t **names, ngx_uint_t *n);


static ngx_conf_enum_t  ngx_http_kvroute_modes[] = {
    { ngx_string("events"), 0 },
    { ngx_string("approximate"), 1 },
    { ngx_null_string, 0 }
};


static ngx_conf_enum_t  ngx_http_kvroute_chat_engines[] = {
    { ngx_string("vllm"), KV_CHAT_VLLM },
    { ngx_string("sglang"), KV_CHAT_SGLANG },
    { ngx_null_string, 0 }
};


static ngx_conf_enum_t  ngx_http_kvroute_policies[] = {
    { ngx_string("ttft"), KV_ROUTE_TTFT },
    { ngx_string("dynamo"), KV_ROUTE_DYNAMO },
    { ngx_null_string, 0 }
};


static ngx_conf_enum_t  ngx_http_kvroute_worker_loads[] = {
    { ngx_string("local"), KV_ROUTE_LOAD_LOCAL },
    { ngx_string("max"), KV_ROUTE_LOAD_MAX },
    { ngx_null_string, 0 }
};


/*
 * The parameters of "kvroute" that set one field of the srv conf, one
 * table (ngx_http_kvroute_param.c). Defaults are set in create_srv_conf
 * (ngx_http_kvroute_module.c).
 */

#define NGX_HTTP_KVROUTE_OFF(field)                                           \
    offsetof(ngx_http_kvroute_srv_conf_t, field)

static ngx_http_kvroute_param_t  ngx_http_kvroute_params[] = {
    { ngx_string("block_size="), NGX_HTTP_KVROUTE_P_UINT,
      NGX_HTTP_KVROUTE_OFF(block_size), 1, 65536, NULL },
    { ngx_string("slack="), NGX_HTTP_KVROUTE_P_DOUBLE,
      NGX_HTTP_KVROUTE_OFF(route.slack), 0, 100, NULL },
    { ngx_string("prefill_rate="), NGX_HTTP_KVROUTE_P_DOUBLE,
      NGX_HTTP_KVROUTE_OFF(route.prefill_rate), 0.001, 1e9, NULL },
    { ngx_string("decode_pace="), NGX_HTTP_KVROUTE_P_DOUBLE,
      NGX_HTTP_KVROUTE_OFF(route.decode_pace), 0, 1e6, NULL },
    { ngx_string("max_tokens="), NGX_HTTP_KVROUTE_P_U64,
      NGX_HTTP_KVROUTE_OFF(route.max_tokens), 1, 1e9, NULL },
    { ngx_string("overlap_weight="), NGX_HTTP_KVROUTE_P_DOUBLE,
      NGX_HTTP_KVROUTE_OFF(route.overlap_weight), 0, 1000, NULL },
    { ngx_string("temperature="), NGX_HTTP_KVROUTE_P_DOUBLE,
      NGX_HTTP_KVROUTE_OFF(route.temperature), 0, 100, NULL },
    { ngx_string("busy_prefill_tokens="), NGX_HTTP_KVROUTE_P_U64,
      NGX_HTTP_KVROUTE_OFF(route.busy_prefill_tokens), 0, 1e15, NULL },
    { ngx_string("busy_decode_blocks="), NGX_HTTP_KVROUTE_P_U64,
      NGX_HTTP_KVROUTE_OFF(route.busy_decode_blocks), 0, 1e15, NULL },
    { ngx_string("retry_after="), NGX_HTTP_KVROUTE_P_UINT,
      NGX_HTTP_KVROUTE_OFF(retry_after), 0, 86400, NULL },
    { ngx_string("thread_threshold="), NGX_HTTP_KVROUTE_P_SIZE,
      NGX_HTTP_KVROUTE_OFF(thread_threshold), 0, 1e15, NULL },
    { ngx_string("max_tokenize="), NGX_HTTP_KVROUTE_P_SIZE,
      NGX_HTTP_KVROUTE_OFF(max_tokenize), 0, 1e15, NULL },
    { ngx_string("tokenize_budget="), NGX_HTTP_KVROUTE_P_SIZE,
      NGX_HTTP_KVROUTE_OFF(tokenize_budget), 0, 1e15, NULL },
    { ngx_string("tokenize_wait="), NGX_HTTP_KVROUTE_P_MSEC,
      NGX_HTTP_KVROUTE_OFF(tokenize_wait), 0, 86400000, NULL },
    { ngx_string("prefill_min_tokens="), NGX_HTTP_KVROUTE_P_U64,
      NGX_HTTP_KVROUTE_OFF(prefill_cfg.min_tokens), 0, 1e15, NULL },
    { ngx_string("prefill_stall_weight="), NGX_HTTP_KVROUTE_P_DOUBLE,
      NGX_HTTP_KVROUTE_OFF(prefill_cfg.stall_weight), 0, 1e6, NULL },
    { ngx_string("prefill_margin="), NGX_HTTP_KVROUTE_P_DOUBLE,
      NGX_HTTP_KVROUTE_OFF(prefill_cfg.margin), 0, 1e6, NULL },
    { ngx_string("prefill_link_gbps="), NGX_HTTP_KVROUTE_P_DOUBLE,
      NGX_HTTP_KVROUTE_OFF(prefill_link_gbps), 0, 1e9, NULL },
    { ngx_string("prefill_kv_bytes="), NGX_HTTP_KVROUTE_P_U64,
      NGX_HTTP_KVROUTE_OFF(prefill_kv_bytes), 1, 1e12, NULL },
    { ngx_string("mode="), NGX_HTTP_KVROUTE_P_ENUM,
      NGX_HTTP_KVROUTE_OFF(mode), 0, 0, ngx_http_kvroute_modes },
    { ngx_string("chat_engine="), NGX_HTTP_KVROUTE_P_ENUM,
      NGX_HTTP_KVROUTE_OFF(chat_engine), 0, 0, ngx_http_kvroute_chat_engines },
    { ngx_string("policy="), NGX_HTTP_KVROUTE_P_ENUM,
      NGX_HTTP_KVROUTE_OFF(route.policy), 0, 0, ngx_http_kvroute_policies },
    { ngx_string("worker_load="), NGX_HTTP_KVROUTE_P_ENUM,
      NGX_HTTP_KVROUTE_OFF(route.worker_load), 0, 0,
      ngx_http_kvroute_worker_loads },
    { ngx_null_string, 0, 0, 0, 0, NULL }
};


/*
 * A parameter that must be a JSON object (the operator's default
 * chat_template_kwargs): checked now, kept NUL-terminated for the renderer.
 */
static ngx_int_t
ngx_http_kvroute_json_object(ngx_conf_t *cf, ngx_str_t *s, ngx_str_t *out)
{
    json_t        *j;
    json_error_t   jerr;

    j = json_loadb((char *) s->data, s->len, 0, &jerr);
    if (!json_is_object(j)) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "kvroute: chat_template_kwargs=%V is not a JSON "
                           "object%s%s", s, j ? "" : ": ", j ? "" : jerr.text);
        json_decref(j);
        return NGX_ERROR;
    }
    json_decref(j);

    out->data = ngx_pnalloc(cf->pool, s->len + 1);
    if (out->data == NULL) {
        return NGX_ERROR;
    }
    ngx_memcpy(out->data, s->data, s->len);
    out->data[s->len] = '\0';
    out->len = s->len;

    return NGX_OK;
}


static char *
ngx_http_kvroute_load_files(ngx_conf_t *cf, ngx_http_kvroute_srv_conf_t *kcf,
    ngx_str_t *tokenizer, ngx_str_t *template)
{
    char                 err[512];
    ngx_pool_cleanup_t  *cln;

    cln = ngx_pool_cleanup_add(cf->pool, 0);
    if (cln == NULL) {
        return NGX_CONF_ERROR;
    }

    cln->handler = ngx_http_kvroute_cleanup_conf;
    cln->data = kcf;

    if (tokenizer->len) {
        if (ngx_conf_full_name(cf->cycle, tokenizer, 1) != NGX_OK) {
            return NGX_CONF_ERROR;
        }

        kcf->tokenizer = kv_tokenizer_load((char *) tokenizer->data, err,
                                           sizeof(err));
        if (kcf->tokenizer == NULL) {
            ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                               "kvroute: tokenizer=%V: %s", tokenizer, err);
            return NGX_CONF_ERROR;
        }

        /* where a prompt may be cut for the zone's turn cache */
        kcf->bounds = kv_tok_bounds_new(kcf->tokenizer);
    }

    if (template->len) {
        if (ngx_conf_full_name(cf->cycle, template, 1) != NGX_OK) {
            return NGX_CONF_ERROR;
        }

        kcf->template = kv_chat_load((char *) template->data, NULL, err,
                                     sizeof(err));
        if (kcf->template == NULL) {
            ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                               "kvroute: chat_template=%V: %s", template, err);
            return NGX_CONF_ERROR;
        }
    }

    return NGX_CONF_OK;
}


static void
ngx_http_kvroute_cleanup_conf(void *data)
{
    ngx_http_kvroute_srv_conf_t  *kcf = data;

    if (kcf->bounds) {
        kv_tok_bounds_free(kcf->bounds);
        kcf->bounds = NULL;
    }

    if (kcf->tokenizer) {
        kv_tokenizer_free(kcf->tokenizer);
        kcf->tokenizer = NULL;
    }

    if (kcf->template) {
        kv_chat_free(kcf->template);
        kcf->template = NULL;
    }
}


/* A complex value compiled from s, for session= and salt=. */

static ngx_http_complex_value_t *
ngx_http_kvroute_complex_value(ngx_conf_t *cf, ngx_str_t *s)
{
    ngx_http_complex_value_t          *cv;
    ngx_http_compile_complex_value_t   ccv;

    cv = ngx_palloc(cf->pool, sizeof(ngx_http_complex_value_t));
    if (cv == NULL) {
        return NULL;
    }

    ngx_memzero(&ccv, sizeof(ngx_http_compile_complex_value_t));
    ccv.cf = cf;
    ccv.value = s;
    ccv.complex_value = cv;

    if (ngx_http_compile_complex_value(&ccv) != NGX_OK) {
        return NULL;
    }

    return cv;
}


char *
ngx_http_kvroute_directive(ngx_conf_t *cf, ngx_command_t *cmd, void *conf)
{
    ngx_http_kvroute_srv_conf_t *kcf = conf;

    ngx_int_t                            rc;
    ngx_str_t                           *value, s, tokenizer, template;
#if (NGX_THREADS)
    ngx_str_t                            pool;
#endif
    ngx_uint_t                           i;
    ngx_http_kvroute_srv_conf_t        **kp;
    ngx_http_upstream_srv_conf_t        *uscf;

    uscf = ngx_http_conf_get_module_srv_conf(cf, ngx_http_upstream_module);

    if (ngx_http_kvroute_check_order(cf, uscf) != NGX_OK) {
        return NGX_CONF_ERROR;
    }

    value = cf->args->elts;

    kcf->uscf = uscf;
    kcf->upstream_name = uscf->host;

    ngx_str_null(&tokenizer);
    ngx_str_null(&template);
#if (NGX_THREADS)
    ngx_str_set(&pool, "default");
#endif

    for (i = 1; i < cf->args->nelts; i++) {

        rc = ngx_http_kvroute_param_set(cf, "kvroute", ngx_http_kvroute_params,
                                        kcf, &value[i]);

        if (rc == NGX_ERROR) {
            return NGX_CONF_ERROR;
        }

        if (rc == NGX_OK) {
            continue;
        }

        if (ngx_http_kvroute_param_is(&value[i], "zone=", &s)) {
            kcf->zone = ngx_http_kvroute_zone_find(cf, &s);
            if (kcf->zone == NULL) {
                return NGX_CONF_ERROR;
            }
            continue;
        }

        if (ngx_http_kvroute_param_is(&value[i], "prefill=", &s)) {
            kcf->prefill_name = s;      /* resolved in init_upstream */
            continue;
        }

        if (ngx_http_kvroute_param_is(&value[i], "prefill_conditional=", &s))
        {
            if (s.len == 2 && ngx_strncmp(s.data, "on", 2) == 0) {
                kcf->prefill_cfg.conditional = 1;
            } else if (s.len == 3 && ngx_strncmp(s.data, "off", 3) == 0) {
                kcf->prefill_cfg.conditional = 0;
            } else {
                goto invalid;
            }
            continue;
        }

        if (ngx_http_kvroute_param_is(&value[i], "tokenizer=", &s)) {
            tokenizer = s;
            continue;
        }

        if (ngx_http_kvroute_param_is(&value[i], "chat_template=", &s)) {
            template = s;
            continue;
        }

        if (ngx_http_kvroute_param_is(&value[i], "chat_template_kwargs=", &s)) {
            if (ngx_http_kvroute_json_object(cf, &s, &kcf->chat_kwargs)
                != NGX_OK)
            {
                return NGX_CONF_ERROR;
            }
            continue;
        }

        if (ngx_http_kvroute_param_is(&value[i], "model=", &s)) {
            rc = ngx_http_kvroute_names(cf, &s, &kcf->model, &kcf->models,
                                        &kcf->nmodels);
            if (rc == NGX_ERROR) {
                return NGX_CONF_ERROR;
            }
            if (rc == NGX_DECLINED) {
                goto invalid;
            }
            continue;
        }

        if (ngx_http_kvroute_param_is(&value[i], "lora=", &s)) {
            if (ngx_http_kvroute_str_is(&s, "*")) {
                ngx_str_set(&kcf->lora, "*");
                continue;
            }
            rc = ngx_http_kvroute_names(cf, &s, &kcf->lora, &kcf->loras,
                                        &kcf->nloras);
            if (rc == NGX_ERROR) {
                return NGX_CONF_ERROR;
            }
            if (rc == NGX_DECLINED) {
                goto invalid;
            }
            continue;
        }

        if (ngx_http_kvroute_param_is(&value[i], "thread_pool=", &s)) {
#if (NGX_THREADS)
            pool = s;
            continue;
#else
            ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                               "\"%V\" needs nginx built with --with-threads",
                               &value[i]);
            return NGX_CONF_ERROR;
#endif
        }

        if (ngx_http_kvroute_param_is(&value[i], "session=", &s)) {
            if (ngx_http_kvroute_str_is(&s, "off")) {
                kcf->session_off = 1;
                continue;
            }

            kcf->session = ngx_http_kvroute_complex_value(cf, &s);
            if (kcf->session == NULL) {
                return NGX_CONF_ERROR;
            }
            continue;
        }

        if (ngx_http_kvroute_param_is(&value[i], "salt=", &s)) {
            kcf->salt = ngx_http_kvroute_complex_value(cf, &s);
            if (kcf->salt == NULL) {
                return NGX_CONF_ERROR;
            }
            continue;
        }

        goto invalid;
    }

    kcf->route.block_size = kcf->block_size;

    if (kcf->lora.len && kcf->model.len == 0) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "\"kvroute\": lora= needs model=, the base model "
                           "its adapters are served beside");
        return NGX_CONF_ERROR;
    }

    if (kcf->zone == NULL
        && (tokenizer.len || template.len || kcf->mode != -1))
    {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "\"kvroute\" needs zone=NAME for prefix-aware "
                           "routing (and a matching kvroute_zone)");
        return NGX_CONF_ERROR;
    }

    if (kcf->zone) {
        kp = ngx_array_push(&kcf->zone->upstreams);
        if (kp == NULL) {
            return NGX_CONF_ERROR;
        }
        *kp = kcf;

#if (NGX_THREADS)
        if (kcf->thread_threshold) {
            kcf->thread_pool = ngx_thread_pool_add(cf, &pool);
            if (kcf->thread_pool == NULL) {
                return NGX_CONF_ERROR;
            }
        }
#endif
    }

    if (ngx_http_kvroute_load_files(cf, kcf, &tokenizer, &template)
        != NGX_CONF_OK)
    {
        return NGX_CONF_ERROR;
    }

    uscf->peer.init_upstream = ngx_http_kvroute_init_upstream;

    uscf->flags = NGX_HTTP_UPSTREAM_CREATE
                  |NGX_HTTP_UPSTREAM_WEIGHT
                  |NGX_HTTP_UPSTREAM_MAX_CONNS
                  |NGX_HTTP_UPSTREAM_MAX_FAILS
                  |NGX_HTTP_UPSTREAM_FAIL_TIMEOUT
                  |NGX_HTTP_UPSTREAM_DOWN
                  |NGX_HTTP_UPSTREAM_BACKUP;

    return NGX_CONF_OK;

invalid:

    ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                       "invalid parameter \"%V\" in \"kvroute\"", &value[i]);
    return NGX_CONF_ERROR;
}


/* A model or adapter name: printable ASCII, as engines' names are (and so
 * listed by kvroute_models exactly), no "," (lora= separates with it) and
 * no "*" (lora=* means any). */

static ngx_uint_t
ngx_http_kvroute_model_name(ngx_str_t *s)
{
    ngx_uint_t  i;

    for (i = 0; i < s->len; i++) {
        if (s->data[i] <= ' ' || s->data[i] >= 0x7f || s->data[i] == ','
            || s->data[i] == '*')
        {
            return 0;
        }
    }

    return s->len > 0 && s->len < 128;
}


/* model=a,b or lora=a,b,c: kept whole (NUL-terminated) for kv_model_role
 * and split for kvroute_models; NGX_DECLINED on a name that is empty, too
 * long or holds what a name may not. */

static ngx_int_t
ngx_http_kvroute_names(ngx_conf_t *cf, ngx_str_t *s, ngx_str_t *whole,
    ngx_str_t **names, ngx_uint_t *n)
{
    u_char      *p, *comma, *end;
    ngx_str_t    name;
    const char  *c;

    if (ngx_http_kvroute_param_cstr(cf, s, &c) != NGX_CONF_OK) {
        return NGX_ERROR;
    }

    whole->data = (u_char *) c;
    whole->len = s->len;

    *names = ngx_palloc(cf->pool, (s->len / 2 + 1) * sizeof(ngx_str_t));
    if (*names == NULL) {
        return NGX_ERROR;
    }

    *n = 0;
    end = whole->data + whole->len;

    for (p = whole->data; p <= end; p = comma + 1) {
        comma = ngx_strlchr(p, end, ',');
        if (comma == NULL) {
            comma = end;
        }

        name.data = p;
        name.len = comma - p;

        if (!ngx_http_kvroute_model_name(&name)) {
            return NGX_DECLINED;
        }

        (*names)[(*n)++] = name;
    }

    return NGX_OK;
}


char *
ngx_http_kvroute_worker_id(ngx_conf_t *cf, ngx_command_t *cmd, void *conf)
{
    ngx_http_kvroute_srv_conf_t *kcf = conf;

    u_char                         *p;
    uint64_t                        id;
    ngx_str_t                      *value;
    ngx_http_kvroute_worker_map_t  *m;

    value = cf->args->elts;

    id = 0;

    for (p = value[1].data; p < value[1].data + value[1].len; p++) {
        if (*p < '0' || *p > '9' || id > (UINT64_MAX - 9) / 10) {
            ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                               "invalid worker id \"%V\": expected a decimal "
                               "u64", &value[1]);
            return NGX_CONF_ERROR;
        }
        id = id * 10 + (*p - '0');
    }

    if (value[1].len == 0 || value[2].len == 0) {
        return "has an empty argument";
    }

    m = ngx_array_push(&kcf->worker_ids);
    if (m == NULL) {
        return NGX_CONF_ERROR;
    }

    m->worker_id = id;
    m->address = value[2];

    return NGX_CONF_OK;
}


static ngx_int_t
ngx_http_kvroute_init_upstream(ngx_conf_t *cf, ngx_http_upstream_srv_conf_t *us)
{
    ngx_uint_t                      i, found;
    ngx_http_upstream_rr_peer_t    *peer;
    ngx_http_upstream_rr_peers_t   *peers;
    ngx_http_kvroute_srv_conf_t    *kcf;
    ngx_http_kvroute_worker_map_t  *m;

    if (ngx_http_upstream_init_round_robin(cf, us) != NGX_OK) {
        return NGX_ERROR;
    }

    us->peer.init = ngx_http_kvroute_init_peer;

    kcf = ngx_http_conf_upstream_srv_conf(us, ngx_http_kvroute_module);

    if (kcf->zone == NULL) {
        return NGX_OK;
    }

    if (kcf->zone->shm_zone == NULL) {
        return ngx_http_kvroute_zone_undeclared(cf, us, kcf->zone);
    }

    if (kcf->mode == 0 && kcf->zone->approximate) {
        ngx_log_error(NGX_LOG_EMERG, cf->log, 0,
                      "kvroute: upstream \"%V\" has mode=events but no "
                      "kvroute_events feeds zone \"%V\"", &us->host,
                      &kcf->zone->name);
        return NGX_ERROR;
    }

    if (kcf->mode == 1 && !kcf->zone->approximate) {
        ngx_log_error(NGX_LOG_EMERG, cf->log, 0,
                      "kvroute: upstream \"%V\" has mode=approximate but zone "
                      "\"%V\" is fed by kvroute_events; give it its own "
                      "kvroute_zone", &us->host, &kcf->zone->name);
        return NGX_ERROR;
    }

    if (ngx_http_kvroute_prefill_resolve(cf, us, kcf) != NGX_OK) {
        return NGX_ERROR;
    }

    /* every kvroute_worker_id must name a server of this upstream */

    m = kcf->worker_ids.elts;

    for (i = 0; i < kcf->worker_ids.nelts; i++) {
        found = 0;
        peers = us->peer.data;

        for ( /* void */ ; peers; peers = peers->next) {
            for (peer = peers->peer; peer; peer = peer->next) {
                if ((peer->server.len == m[i].address.len
                     && ngx_strncmp(peer->server.data, m[i].address.data,
                                    m[i].address.len) == 0)
                    || (peer->name.len == m[i].address.len
                        && ngx_strncmp(peer->name.data, m[i].address.data,
                                       m[i].address.len) == 0))
                {
                    found = 1;
                }
            }
        }

        if (!found) {
            ngx_log_error(NGX_LOG_EMERG, cf->log, 0,
                          "kvroute_worker_id %uL %V: no such server in "
                          "upstream \"%V\"", m[i].worker_id, &m[i].address,
                          &us->host);
            return NGX_ERROR;
        }
    }

    return NGX_OK;
}


static uint64_t
ngx_http_kvroute_peer_worker_id(ngx_http_kvroute_srv_conf_t *kcf,
    ngx_http_upstream_rr_peer_t *peer, ngx_uint_t *explicit_id)
{
    ngx_uint_t                      i;
    ngx_http_kvroute_worker_map_t  *m;

    m = kcf->worker_ids.elts;

    for (i = 0; i < kcf->worker_ids.nelts; i++) {
        if ((peer->server.len == m[i].address.len
             && ngx_strncmp(peer->server.data, m[i].address.data,
                            m[i].address.len) == 0)
            || (peer->name.len == m[i].address.len
                && ngx_strncmp(peer->name.data, m[i].address.data,
                               m[i].address.len) == 0))
        {
            *explicit_id = 1;
            return m[i].worker_id;
        }
    }

    *explicit_id = 0;

    return kv_hash_worker_id((char *) peer->server.data, peer->server.len);
}


/* Per worker process: the peers as this process sees them (the upstream
 * zone copies peers into shared memory after configuration). */

ngx_int_t
ngx_http_kvroute_init_worker_peers(ngx_cycle_t *cycle,
    ngx_http_kvroute_srv_conf_t *kcf)
{
    u_char                         name[KV_LOAD_NAME_MAX];
    size_t                         len;
    ngx_uint_t                     n, b, idx;
    ngx_http_kvroute_peer_t       *p;
    ngx_http_upstream_rr_peer_t   *peer;
    ngx_http_upstream_rr_peers_t  *peers, *primary;

    primary = kcf->uscf->peer.data;

    n = primary->number + (primary->next ? primary->next->number : 0);

    kcf->peers = ngx_pcalloc(cycle->pool, n * sizeof(ngx_http_kvroute_peer_t));
    if (kcf->peers == NULL) {
        return NGX_ERROR;
    }

    kcf->npeers = 0;
    kcf->nprimary = primary->number;

    for (peers = primary, b = 0; peers && b < 2; peers = peers->next, b++) {
        for (peer = peers->peer, idx = 0; peer; peer = peer->next, idx++) {
            p = &kcf->peers[kcf->npeers++];

            p->peer = peer;
            p->server = peer->server;
            p->backup = b;
            p->index = idx;
            p->worker_id = ngx_http_kvroute_peer_worker_id(kcf, peer,
                                                           &p->explicit_id);
            p->reg = -1;
            p->slot = -1;

            len = ngx_snprintf(name, sizeof(name), "%V/%V",
                               &kcf->upstream_name, &peer->server) - name;

            p->load = kv_load_find(kcf->zone->sh->load, (char *) name, len);
        }
    }

    return ngx_http_kvroute_candidates_init(cycle, kcf);
}


static ngx_int_t
ngx_http_kvroute_init_peer(ngx_http_request_t *r,
    ngx_http_upstream_srv_conf_t *us)
{
    ngx_http_kvroute_ctx_t        *ctx;
    ngx_http_kvroute_srv_conf_t   *kcf;
    ngx_http_kvroute_peer_data_t  *pd;
    const char                    *id;
    size_t                         n;

    kcf = ngx_http_conf_upstream_srv_conf(us, ngx_http_kvroute_module);

    pd = ngx_palloc(r->pool, sizeof(ngx_http_kvroute_peer_data_t));
    if (pd == NULL) {
        return NGX_ERROR;
    }

    r->upstream->peer.data = &pd->rrp;

    if (ngx_http_upstream_init_round_robin_peer(r, us) != NGX_OK) {
        return NGX_ERROR;
    }

    r->upstream->peer.get = ngx_http_kvroute_get_peer;
    r->upstream->peer.free = ngx_http_kvroute_free_peer;

    pd->request = r;
    pd->conf = kcf;
    pd->ctx = NULL;
    pd->request_head = NULL;

    if (kcf->zone == NULL || kcf->peers == NULL) {
        return NGX_OK;
    }

    ctx = ngx_http_kvroute_get_ctx(r, kcf);
    if (ctx == NULL) {
        return NGX_ERROR;
    }

    if (ctx->conf != kcf) {
        ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                      "kvroute: the location's kvroute_upstream is \"%V\" "
                      "but it proxies to \"%V\"",
                      &ctx->conf->upstream_name, &kcf->upstream_name);
        return NGX_ERROR;
    }

    pd->ctx = ctx;

    ngx_atomic_fetch_add(&kcf->zone->sh->requests, 1);

    if (!ctx->prepared) {
        ngx_log_debug0(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                       "kvroute init peer: preparing the prompt here");

        if (ngx_http_kvroute_prepare(r, ctx) != NGX_OK) {
            return NGX_ERROR;
        }
    }

    if (!ctx->matched) {
        ngx_http_kvroute_candidates_match(kcf, ctx, r->pool,
                                          r->connection->log);
    }

    /* GET /v1/responses/{id}, .../cancel: only the engine that made it
     * knows the response, as for previous_response_id */

    if (ctx->prev_response == 0) {
        n = kv_api_response_id((char *) r->uri.data, r->uri.len, &id);
        if (n) {
            ctx->prev_response = kv_body_session_key(id, n);
        }
    }

    return NGX_OK;
}


/*
 * The registry record of the worker behind server p (events zones only):
 * by the record seen last time, else by worker id, else by the address the
 * worker announced. A worker that announces an id of its own takes it over,
 * unless kvroute_worker_id fixed the id.
 */

ngx_int_t
ngx_http_kvroute_peer_record(ngx_http_kvroute_zone_t *zone,
    ngx_http_kvroute_peer_t *p, kv_worker_rec_t *rec)
{
    u_char          addr[KV_REGISTRY_ADDR_MAX];
    ngx_int_t       i;
    kv_registry_t  *reg;

    if (zone->events_conf == NULL) {
        return NGX_DECLINED;
    }

    reg = zone->sh->registry;

    if (p->reg >= 0 && kv_registry_read(reg, p->reg, rec) == 0
        && rec->worker_id == p->worker_id)
    {
        return NGX_OK;
    }

    /* a worker that never announced costs one scan a second, not one
     * per request */

    if (p->reg_miss && ngx_current_msec - p->reg_miss < 1000
        && kv_registry_records(reg) == p->reg_records)
    {
        return NGX_DECLINED;
    }

    i = kv_registry_find(reg, p->worker_id, 0);

    if (i >= 0 && kv_registry_read(reg, i, rec) == 0) {
        p->reg = i;
        return NGX_OK;
    }

    if (p->explicit_id || p->server.len >= sizeof(addr)) {
        p->reg_miss = ngx_current_msec;
        p->reg_records = kv_registry_records(reg);
        return NGX_DECLINED;
    }

    ngx_memcpy(addr, p->server.data, p->server.len);
    addr[p->server.len] = '\0';

    i = kv_registry_find_address(reg, (char *) addr, NULL, rec);

    if (i < 0 && p->peer->name.len < sizeof(addr)) {
        ngx_memcpy(addr, p->peer->name.data, p->peer->name.len);
        addr[p->peer->name.len] = '\0';
        i = kv_registry_find_address(reg, (char *) addr, NULL, rec);
    }

    if (i < 0) {
        p->reg_miss = ngx_current_msec;
        p->reg_records = kv_registry_records(reg);
        return NGX_DECLINED;
    }

    p->reg = i;
    p->reg_miss = 0;
    p->worker_id = rec->worker_id;

    return NGX_OK;
}


/* Whether p's slot still names p's worker (rank 0) in the index. */

static ngx_int_t
ngx_http_kvroute_slot_valid(kv_index_t *ix, ngx_http_kvroute_peer_t *p)
{
    uint32_t  dp;
    uint64_t  wid;

    return p->slot >= 0
           && kv_index_worker_info(ix, (uint32_t) p->slot, &wid, &dp) == 0
           && wid == p->worker_id && dp == 0;
}


/* Blocks the index holds for server p (the tie-break), by its slot. */

uint64_t
ngx_http_kvroute_tree_blocks(ngx_http_kvroute_srv_conf_t *kcf, kv_index_t *ix,
    ngx_http_kvroute_peer_t *p)
{
    if (!ngx_http_kvroute_slot_valid(ix, p)) {
        ngx_http_kvroute_candidates_slots(kcf, ix);

        if (!ngx_http_kvroute_slot_valid(ix, p)) {
            return 0;
        }
    }

    return kv_index_worker_blocks(ix, (uint32_t) p->slot);
}


/*
 * tree_blocks for server p, whose s has its load filled: the index's
 * count, and in events mode the prompts sent to p that its events cannot
 * have reported yet (kv_route_tree_blocks): approximate mode's index has
 * them from the decision on, so both modes count what the router sent.
 */

static uint64_t
ngx_http_kvroute_resident(ngx_http_kvroute_srv_conf_t *kcf,
    ngx_http_kvroute_peer_t *p, const kv_route_server_t *s)
{
    ngx_http_kvroute_sh_t  *sh = kcf->zone->sh;

    return kv_route_tree_blocks(ngx_http_kvroute_tree_blocks(kcf, sh->index, p),
                                !sh->approximate, s, &kcf->route);
}


/*
 * The decision's inputs for the candidates (candidates.c), read from shared
 * memory before the peers lock is taken (the registry's seqlock may spin);
 * usable and weight are filled under the lock.
 */

static void
ngx_http_kvroute_gather(ngx_http_kvroute_srv_conf_t *kcf,
    ngx_http_kvroute_cand_t *cand, ngx_uint_t n, kv_route_server_t *s)
{
    uint64_t                  now, now_us, lease;
    ngx_uint_t                i, cold;
    kv_worker_rec_t           rec;
    kv_load_server_t          ls;
    ngx_http_kvroute_peer_t  *p;
    ngx_http_kvroute_sh_t    *sh = kcf->zone->sh;

    cold = 1;
    now = kcf->route.worker_load == KV_ROUTE_LOAD_MAX ? kv_ingest_now_ms() : 0;
    now_us = ngx_http_kvroute_now_ns() / 1000;

    for (i = 0; i < n; i++) {
        p = &kcf->peers[cand[i].k];

        ngx_memzero(&s[i], sizeof(kv_route_server_t));

        s[i].id = p->worker_id;
        s[i].trusted = 1;
        s[i].overlap_index = cand[i].overlap;
        s[i].overlap_pending = cand[i].pending;
        s[i].since_sent = -1;

        if (p->load >= 0) {
            kv_load_get(sh->load, p->load, &ls);
            s[i].prefill_tokens = ls.active[KV_LOAD_PREFILL_TOKENS];
            s[i].decode_blocks = ls.active[KV_LOAD_DECODE_BLOCKS];
            s[i].decode_tokens = ls.active[KV_LOAD_DECODE_TOKENS];
            s[i].requests = ls.active[KV_LOAD_REQUESTS];
            s[i].prefill_rate = ls.prefill_rate;
            s[i].prefill_base = ls.prefill_base;
            s[i].decode_pace = ls.decode_pace;

            /* stamped by another process after now_us was read: just sent */
            if (ls.sent_us) {
                s[i].since_sent = ls.sent_us <= now_us
                                  ? (double) (now_us - ls.sent_us) / 1000 : 0;
            }
        }

        /*
         * a worker whose index state cannot be trusted (events lost, resync
         * under way, silent, NATS down) gets no credit for the index's
         * overlap; what it reports covers every router in front of it
         */

        if (ngx_http_kvroute_peer_record(kcf->zone, p, &rec) == NGX_OK) {
            s[i].trusted = rec.state == KV_WORKER_LIVE
                           && !kv_selfcheck_load_only(sh->registry, p->reg);
            s[i].reported = 1;
            s[i].reported_prefill_tokens = rec.load.active_prefill_tokens;
            s[i].reported_decode_blocks = rec.load.active_decode_blocks;

            /*
             * requests in flight too, for the bounded-load and cold rules:
             * what other nginx instances sent is in the worker's report
             * (a heartbeat old), not in this zone; a report older than
             * ten heartbeats (its lease) is not believed
             */

            lease = 10 * (rec.interval_ms ? rec.interval_ms : 1000);

            if (kcf->route.worker_load == KV_ROUTE_LOAD_MAX
                && now <= rec.last_seen_ms + lease
                && rec.load.running + rec.load.waiting > s[i].requests)
            {
                s[i].requests = rec.load.running + rec.load.waiting;
            }
        }

        /* the holders' blocks break dynamo's ties */

        if (s[i].overlap_index || s[i].overlap_pending) {
            s[i].tree_blocks = ngx_http_kvroute_resident(kcf, p, &s[i]);
            cold = 0;
        }
    }

    /*
     * ttft, a prompt nobody holds: every candidate's blocks, so that it goes
     * first to a server holding none (kv_route.c, colder); read only then,
     * as it costs a slot read per candidate (+12 us p50 per decision at 512
     * and 4,096 servers when read for every request, "Scale-out round 3")
     */

    if (cold && kcf->route.policy == KV_ROUTE_TTFT) {
        for (i = 0; i < n; i++) {
            s[i].tree_blocks = ngx_http_kvroute_resident(kcf,
                                                  &kcf->peers[cand[i].k], &s[i]);
        }
    }
}


static void
ngx_http_kvroute_request(ngx_http_kvroute_ctx_t *ctx, kv_route_request_t *rq)
{
    rq->prompt_tokens = ctx ? ctx->prompt_tokens : 0;
    rq->seq = ctx ? ctx->seq : NULL;
    rq->nseq = ctx ? ctx->nseq : 0;
    rq->max_tokens = ctx ? ctx->max_tokens : 0;
    rq->sequences = ctx ? ctx->sequences : 0;
    rq->batch_tokens = ctx ? ctx->batch_tokens : 0;
    rq->prefill_only = ctx ? ctx->prefill_only : 0;
    rq->session = ctx ? ctx->session : 0;
    rq->home = ctx ? ctx->home : 0;
}


/*
 * A Responses API request that continues a response goes back to the
 * server that made it, which alone stores it (kv_respmap.h): its worker
 * id, looked up once per request.
 */

static void
ngx_http_kvroute_home(ngx_http_kvroute_srv_conf_t *kcf,
    ngx_http_kvroute_ctx_t *ctx)
{
    kv_respmap_t  *map;

    if (ctx->home_read) {
        return;
    }

    ctx->home_read = 1;
    map = kcf->zone && kcf->zone->sh ? kcf->zone->sh->responses : NULL;

    if (ctx->prev_response && map) {
        ctx->home = kv_respmap_get(map, ctx->prev_response);
    }
}


/*
 * Up: what round-robin itself would not skip, this request's tries aside:
 * not down, not failed out (max_fails within fail_timeout), not at
 * max_conns. Called with the peers locked, or (all_busy) without: a stale
 * read there misjudges one request's 503, nothing more.
 */

static ngx_uint_t
ngx_http_kvroute_peer_up(ngx_http_upstream_rr_peer_t *peer, time_t now)
{
    if (peer->down) {
        return 0;
    }

    if (peer->max_fails
        && peer->fails >= peer->max_fails
        && now - peer->checked <= peer->fail_timeout)
    {
        return 0;
    }

    if (peer->max_conns && peer->conns >= peer->max_conns) {
        return 0;
    }

    return 1;
}


/*
 * True when every primary server that is up is over a busy threshold: the
 * precontent phase answers 503 then. A server failed out counts as not up,
 * as get_peer skips it: else one dead server (its load drained to 0) kept
 * the 503 from ever being answered while the others were driven past
 * their thresholds. The same decision as get_peer's, on
 * the same inputs; get_peer never fails for busy servers, so a request let
 * through here is served.
 */

ngx_int_t
ngx_http_kvroute_all_busy(ngx_http_kvroute_srv_conf_t *kcf, ngx_pool_t *pool)
{
    time_t                    now;
    ngx_uint_t                i, n;
    kv_route_server_t        *s;
    kv_route_request_t        rq;
    kv_route_result_t         res;
    ngx_http_kvroute_cand_t  *cand;

    if (kcf->route.busy_prefill_tokens == 0
        && kcf->route.busy_decode_blocks == 0)
    {
        return 0;
    }

    /* a large upstream: busy when its least loaded are */

    cand = ngx_http_kvroute_candidates(kcf, NULL, NULL, pool, 0, &n);
    if (cand == NULL || n == 0) {
        return 0;
    }

    s = ngx_palloc(pool, n * sizeof(kv_route_server_t));
    if (s == NULL) {
        return 0;
    }

    ngx_http_kvroute_gather(kcf, cand, n, s);

    now = ngx_time();

    for (i = 0; i < n; i++) {
        s[i].usable = ngx_http_kvroute_peer_up(kcf->peers[cand[i].k].peer, now)
                      && kcf->peers[cand[i].k].load >= 0;
        s[i].weight = kcf->peers[cand[i].k].peer->weight;
    }

    ngx_http_kvroute_request(NULL, &rq);

    (void) kv_route_pick(s, n, &rq, &kcf->route, 0, &res);

    return res.pick == KV_ROUTE_BUSY;
}


static ngx_uint_t
ngx_http_kvroute_usable(ngx_http_upstream_rr_peer_data_t *rrp,
    ngx_http_upstream_rr_peer_t *peer, ngx_uint_t i, time_t now)
{
    uintptr_t   m;
    ngx_uint_t  n;

    n = i / (8 * sizeof(uintptr_t));
    m = (uintptr_t) 1 << i % (8 * sizeof(uintptr_t));

    if (rrp->tried[n] & m) {
        return 0;
    }

    return ngx_http_kvroute_peer_up(peer, now);
}


/* Every attempt: choose, then set (or strip) X-KVRoute-Prefill on the
 * request it sends (ngx_http_kvroute_prefill.c). */

static ngx_int_t
ngx_http_kvroute_get_peer(ngx_peer_connection_t *pc, void *data)
{
    ngx_int_t                      rc;
    ngx_http_kvroute_peer_data_t  *pd = data;

    rc = ngx_http_kvroute_choose_peer(pc, data);

    if (rc == NGX_OK || rc == NGX_DONE) {
        if (ngx_http_kvroute_prefill_header(pd) != NGX_OK) {
            return NGX_ERROR;
        }
    }

    return rc;
}


/* 1 if some candidate is credited with the prompt's blocks: then the
 * gather read only the credited ones' block counts */

static ngx_uint_t
ngx_http_kvroute_some_credited(kv_route_server_t *s, ngx_uint_t n)
{
    ngx_uint_t  i;

    for (i = 0; i < n; i++) {
        if (s[i].overlap_index || s[i].overlap_pending) {
            return 1;
        }
    }

    return 0;
}


static ngx_int_t
ngx_http_kvroute_choose_peer(ngx_peer_connection_t *pc, void *data)
{
    ngx_http_kvroute_peer_data_t  *pd = data;

    time_t                          now;
    uint64_t                        rnd;
    ngx_int_t                       rc;
    ngx_uint_t                      i, k, n, all;
    kv_route_server_t              *s;
    ngx_http_kvroute_cand_t        *cand;
    kv_route_config_t               cfg;
    kv_route_request_t              rq;
    kv_route_result_t               res;
    ngx_http_kvroute_ctx_t         *ctx = pd->ctx;
    ngx_http_kvroute_peer_t        *p;
    ngx_http_kvroute_srv_conf_t    *kcf = pd->conf;
    ngx_http_upstream_rr_peer_t    *peer;
    ngx_http_upstream_rr_peers_t   *peers;

    if (ctx == NULL) {
        return ngx_http_kvroute_get_least_load(pc, &pd->rrp);
    }

    pc->cached = 0;
    pc->connection = NULL;

    peers = pd->rrp.peers;

    if (peers != kcf->uscf->peer.data) {
        /* already switched to the backups: plain round robin there */
        goto backup;
    }

    all = 0;

    ngx_http_kvroute_home(kcf, ctx);

again:

    cand = ngx_http_kvroute_candidates(kcf, ctx, &pd->rrp, pd->request->pool,
                                       all, &n);
    if (cand == NULL) {
        return NGX_ERROR;
    }

    s = ngx_palloc(pd->request->pool, ngx_max(n, 1) * sizeof(kv_route_server_t));
    if (s == NULL) {
        return NGX_ERROR;
    }

    /* everything from shared memory first, outside the peers lock */

    ngx_http_kvroute_gather(kcf, cand, n, s);
    ngx_http_kvroute_request(ctx, &rq);

    now = ngx_time();

    ngx_http_upstream_rr_peers_wlock(peers);

    for (i = 0; i < n; i++) {
        peer = kcf->peers[cand[i].k].peer;
        s[i].usable = ngx_http_kvroute_usable(&pd->rrp, peer, cand[i].k, now);
        s[i].weight = peer->weight;
    }

    cfg = kcf->route;
    rnd = (uint64_t) ngx_random() << 32 ^ ngx_random();

    (void) kv_route_pick(s, n, &rq, &cfg, rnd, &res);

    if (kv_route_why_reads_blocks(res.why)
        || (res.why == KV_ROUTE_WHY_COLD
            && ngx_http_kvroute_some_credited(s, n)))
    {
        /*
         * a spill or a seed goes to the server holding the fewest blocks
         * (kv_route.c, pick_spill), and a shared-head branch only to one
         * within the resident bound (pick_shared): the gather read only
         * the holders' block counts, so read the other candidates' and
         * decide again; only these rules pay for the reads; so does a
         * cold pick whose only holders the decision could not use (a
         * retry's tried peer, a server down, one whose index is not
         * trusted): the gather then read no one else's blocks either
         */

        for (i = 0; i < n; i++) {
            if (s[i].overlap_index == 0 && s[i].overlap_pending == 0) {
                s[i].tree_blocks = ngx_http_kvroute_resident(kcf,
                                       &kcf->peers[cand[i].k], &s[i]);
            }
        }

        (void) kv_route_pick(s, n, &rq, &cfg, rnd, &res);
    }

    if (res.pick == KV_ROUTE_BUSY) {
        /* the precontent check let it through: never fail for that */
        ngx_log_debug0(NGX_LOG_DEBUG_HTTP, pc->log, 0,
                       "kvroute get peer: all busy, ignoring thresholds");

        cfg.busy_prefill_tokens = 0;
        cfg.busy_decode_blocks = 0;
        (void) kv_route_pick(s, n, &rq, &cfg, ngx_random(), &res);
    }

    if (res.pick < 0 && !all && n < kcf->nprimary) {
        /* no candidate usable: every primary, this once */
        ngx_http_upstream_rr_peers_unlock(peers);
        all = 1;
        goto again;
    }

    if (res.pick < 0) {
        ngx_http_upstream_rr_peers_unlock(peers);

        ngx_log_debug0(NGX_LOG_DEBUG_HTTP, pc->log, 0,
                       "kvroute get peer: no usable primary, backups");
        goto backup;
    }

    k = cand[res.pick].k;

    p = &kcf->peers[k];
    peer = p->peer;

    if (now - peer->checked > peer->fail_timeout) {
        peer->checked = now;
    }

    pc->sockaddr = peer->sockaddr;
    pc->socklen = peer->socklen;
    pc->name = &peer->name;

    peer->conns++;
    pd->rrp.current = peer;
    pd->rrp.tried[k / (8 * sizeof(uintptr_t))]
        |= (uintptr_t) 1 << k % (8 * sizeof(uintptr_t));

    ngx_http_upstream_rr_peers_unlock(peers);

    ngx_log_debug6(NGX_LOG_DEBUG_HTTP, pc->log, 0,
                   "kvroute get peer: %V (%s), overlap %uD, estimate %.3f, "
                   "queued %uL, adds %uL prefill tokens",
                   &p->server, kv_route_why_name(res.why), res.overlap,
                   res.estimate, res.queued_tokens, res.prefill_tokens);

    if (kcf->prefill) {
        ngx_http_kvroute_prefill_choose(pd->request, ctx, &res,
                                        &s[res.pick]);
    }

    ngx_http_kvroute_acct_open(ctx, p, &res);
    ngx_http_kvroute_record(kcf, ctx, p, &s[res.pick]);

    return NGX_OK;

backup:

    rc = ngx_http_upstream_get_round_robin_peer(pc, &pd->rrp);

    if (rc == NGX_OK || rc == NGX_DONE) {
        if (kcf->prefill) {
            /* a backup decode server prefills itself */
            ngx_http_kvroute_prefill_choose(pd->request, ctx, NULL, NULL);
        }

        for (i = kcf->nprimary; i < kcf->npeers; i++) {
            if (kcf->peers[i].peer == pd->rrp.current) {
                ngx_http_kvroute_acct_open(ctx, &kcf->peers[i], NULL);
                break;
            }
        }
    }

    return rc;
}


static void
ngx_http_kvroute_free_peer(ngx_peer_connection_t *pc, void *data,
    ngx_uint_t state)
{
    ngx_http_kvroute_peer_data_t  *pd = data;

    ngx_log_debug1(NGX_LOG_DEBUG_HTTP, pc->log, 0,
                   "kvroute free peer: state %ui", state);

    if (pd->ctx) {
        /* not a response the client dropped: its tokens were asked for,
         * not made */
        if (!(state & NGX_PEER_FAILED) && !pd->request->connection->error) {
            ngx_http_kvroute_acct_learn_decode(pd->ctx);
        }

        ngx_http_kvroute_acct_close(pd->ctx);
    }

    ngx_http_upstream_free_round_robin_peer(pc, &pd->rrp, state);
}


/*
 * The chosen server will hold this prompt's blocks: the index itself in
 * approximate mode, the pending index in events mode. The whole prompt
 * goes into the pending index, the blocks its events already confirm too:
 * a match credits a server only with a run from the prompt's first block,
 * so guesses recorded past the confirmed part alone were never credited
 * (the next request sharing the longer prefix saw only the confirmed part
 * until the events came). The worker's own events still win: its Removed
 * and Cleared drop the pending guesses as well (events.c).
 *
 * In approximate mode with ttl_learn, it first notes how long ago the
 * deepest block credited to the chosen server was recorded: the response's
 * cached tokens then say whether the engine still had blocks that old
 * (kv_retain.h, ngx_http_kvroute_filter.c).
 */

void
ngx_http_kvroute_record(ngx_http_kvroute_srv_conf_t *kcf,
    ngx_http_kvroute_ctx_t *ctx, ngx_http_kvroute_peer_t *p,
    const kv_route_server_t *s)
{
    int                      slot, learn;
    size_t                   d;
    kv_index_t              *ix;
    ngx_http_kvroute_zone_t *zone = kcf->zone;

    ix = zone->sh->approximate ? zone->sh->index : zone->sh->pending;
    learn = ctx->conf == kcf && ctx->chosen == p;

    if (learn) {
        ctx->credit_age_ms = -1;
        learn = zone->ttl_learn && ix == zone->sh->index && s->overlap_index;
    }

    if (ix == NULL || ctx->nseq == 0) {
        return;
    }

    ngx_shmtx_lock(&zone->shpool->mutex);

    if (learn) {
        /* the deepest block credited, read before this record touches it */
        d = ngx_min((size_t) s->overlap_index, ctx->nseq) - 1;
        ctx->credit_age_ms = kv_index_age(ix, ctx->seq[d],
                                          (uint64_t) ngx_current_msec);
    }

    /*
     * The slot this process last mapped the server to, while the index
     * still holds the server there: kv_index_worker_add searches the slots
     * one by one (up to max_workers, 4,096 and more in a large fleet) and
     * would do so on every request, under the zone's mutex. The pending
     * index has slots of its own.
     */

    if (ix == zone->sh->index && ngx_http_kvroute_slot_valid(ix, p)) {
        slot = (int) p->slot;

    } else {
        slot = kv_index_worker_add(ix, p->worker_id, 0);

        if (ix == zone->sh->index) {
            p->slot = slot;
        }
    }

    if (slot >= 0) {
        kv_index_record_at(ix, slot, ctx->seq, 0, ctx->nseq,
                           (uint64_t) ngx_current_msec);
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);

    ngx_http_kvroute_share_push(zone, p->worker_id, ctx->seq, 0, ctx->nseq);
}


/*
 * Without zone=, kvroute balances by active requests alone: the fewest
 * per unit of weight, ties by position.
 */

static ngx_int_t
ngx_http_kvroute_get_least_load(ngx_peer_connection_t *pc,
    ngx_http_upstream_rr_peer_data_t *rrp)
{
    time_t                         now;
    ngx_int_t                      rc;
    ngx_uint_t                     i, p, n;
    ngx_http_upstream_rr_peer_t   *peer, *best;
    ngx_http_upstream_rr_peers_t  *peers;

    pc->cached = 0;
    pc->connection = NULL;

    now = ngx_time();
    peers = rrp->peers;

    ngx_http_upstream_rr_peers_wlock(peers);

    best = NULL;
    p = 0;

    for (peer = peers->peer, i = 0; peer; peer = peer->next, i++) {

        if (!ngx_http_kvroute_usable(rrp, peer, i, now)) {
            continue;
        }

        if (best == NULL
            || peer->conns * best->weight < best->conns * peer->weight)
        {
            best = peer;
            p = i;
        }
    }

    if (best == NULL) {
        goto failed;
    }

    if (now - best->checked > best->fail_timeout) {
        best->checked = now;
    }

    pc->sockaddr = best->sockaddr;
    pc->socklen = best->socklen;
    pc->name = &best->name;

    best->conns++;
    rrp->current = best;

    n = p / (8 * sizeof(uintptr_t));
    rrp->tried[n] |= (uintptr_t) 1 << p % (8 * sizeof(uintptr_t));

    ngx_http_upstream_rr_peers_unlock(peers);

    return NGX_OK;

failed:

    if (peers->next) {
        rrp->peers = peers->next;

        n = (rrp->peers->number + (8 * sizeof(uintptr_t) - 1))
                / (8 * sizeof(uintptr_t));

        for (i = 0; i < n; i++) {
            rrp->tried[i] = 0;
        }

        ngx_http_upstream_rr_peers_unlock(peers);

        rc = ngx_http_kvroute_get_least_load(pc, rrp);

        if (rc != NGX_BUSY) {
            return rc;
        }

        ngx_http_upstream_rr_peers_wlock(peers);
    }

    ngx_http_upstream_rr_peers_unlock(peers);

    pc->name = peers->name;

    return NGX_BUSY;
}
