
/*
 * Copyright (C) kvroute authors
 *
 * ngx_http_kvroute_module: KV-cache-aware upstream balancing for LLM
 * inference workers. This file holds the module definition, directives,
 * configuration and process hooks; the balancer, prompt preparation,
 * shared zone, filters, variables and status live in their own files.
 */


#include "ngx_http_kvroute.h"


static ngx_int_t ngx_http_kvroute_postconfiguration(ngx_conf_t *cf);
static char *ngx_http_kvroute_init_main_conf(ngx_conf_t *cf, void *conf);
static void *ngx_http_kvroute_create_main_conf(ngx_conf_t *cf);
static void *ngx_http_kvroute_create_srv_conf(ngx_conf_t *cf);
static void *ngx_http_kvroute_create_loc_conf(ngx_conf_t *cf);
static char *ngx_http_kvroute_merge_loc_conf(ngx_conf_t *cf, void *parent,
    void *child);
static ngx_int_t ngx_http_kvroute_init_process(ngx_cycle_t *cycle);
static void ngx_http_kvroute_exit_process(ngx_cycle_t *cycle);
static void ngx_http_kvroute_timer_handler(ngx_event_t *ev);


static ngx_command_t  ngx_http_kvroute_commands[] = {

    { ngx_string("kvroute_zone"),
      NGX_HTTP_MAIN_CONF|NGX_CONF_2MORE,
      ngx_http_kvroute_zone_directive,
      NGX_HTTP_MAIN_CONF_OFFSET,
      0,
      NULL },

    { ngx_string("kvroute"),
      NGX_HTTP_UPS_CONF|NGX_CONF_ANY,
      ngx_http_kvroute_directive,
      NGX_HTTP_SRV_CONF_OFFSET,
      0,
      NULL },

    { ngx_string("kvroute_events"),
      NGX_HTTP_MAIN_CONF|NGX_HTTP_UPS_CONF|NGX_CONF_1MORE,
      ngx_http_kvroute_events_directive,
      NGX_HTTP_SRV_CONF_OFFSET,
      0,
      NULL },

    { ngx_string("kvroute_share"),
      NGX_HTTP_MAIN_CONF|NGX_HTTP_UPS_CONF|NGX_CONF_1MORE,
      ngx_http_kvroute_share_directive,
      NGX_HTTP_SRV_CONF_OFFSET,
      0,
      NULL },

    { ngx_string("kvroute_worker_id"),
      NGX_HTTP_UPS_CONF|NGX_CONF_TAKE2,
      ngx_http_kvroute_worker_id,
      NGX_HTTP_SRV_CONF_OFFSET,
      0,
      NULL },

    { ngx_string("kvroute_upstream"),
      NGX_HTTP_LOC_CONF|NGX_HTTP_LIF_CONF|NGX_CONF_1MORE,
      ngx_http_kvroute_upstream_directive,
      NGX_HTTP_LOC_CONF_OFFSET,
      0,
      NULL },

    { ngx_string("kvroute_debug_headers"),
      NGX_HTTP_MAIN_CONF|NGX_HTTP_SRV_CONF|NGX_HTTP_LOC_CONF|NGX_CONF_FLAG,
      ngx_conf_set_flag_slot,
      NGX_HTTP_LOC_CONF_OFFSET,
      offsetof(ngx_http_kvroute_loc_conf_t, debug_headers),
      NULL },

    { ngx_string("kvroute_models"),
      NGX_HTTP_LOC_CONF|NGX_CONF_1MORE,
      ngx_http_kvroute_models_directive,
      NGX_HTTP_LOC_CONF_OFFSET,
      0,
      NULL },

    { ngx_string("kvroute_status"),
      NGX_HTTP_LOC_CONF|NGX_CONF_NOARGS|NGX_CONF_TAKE1,
      ngx_http_kvroute_status_directive,
      NGX_HTTP_LOC_CONF_OFFSET,
      0,
      NULL },

      ngx_null_command
};


static ngx_http_module_t  ngx_http_kvroute_module_ctx = {
    NULL,                                  /* preconfiguration */
    ngx_http_kvroute_postconfiguration,    /* postconfiguration */

    ngx_http_kvroute_create_main_conf,     /* create main configuration */
    ngx_http_kvroute_init_main_conf,       /* init main configuration */

    ngx_http_kvroute_create_srv_conf,      /* create server configuration */
    NULL,                                  /* merge server configuration */

    ngx_http_kvroute_create_loc_conf,      /* create location configuration */
    ngx_http_kvroute_merge_loc_conf        /* merge location configuration */
};


ngx_module_t  ngx_http_kvroute_module = {
    NGX_MODULE_V1,
    &ngx_http_kvroute_module_ctx,          /* module context */
    ngx_http_kvroute_commands,             /* module directives */
    NGX_HTTP_MODULE,                       /* module type */
    NULL,                                  /* init master */
    NULL,                                  /* init module */
    ngx_http_kvroute_init_process,         /* init process */
    NULL,                                  /* init thread */
    NULL,                                  /* exit thread */
    ngx_http_kvroute_exit_process,         /* exit process */
    NULL,                                  /* exit master */
    NGX_MODULE_V1_PADDING
};


#define NGX_HTTP_KVROUTE_FB_NAME(name, str, prompt)  str,

const char  *ngx_http_kvroute_fallback_names[] = {
    NGX_HTTP_KVROUTE_FALLBACKS(NGX_HTTP_KVROUTE_FB_NAME)
};


static ngx_event_t  ngx_http_kvroute_timer;


static ngx_int_t
ngx_http_kvroute_postconfiguration(ngx_conf_t *cf)
{
    ngx_http_handler_pt        *h;
    ngx_http_core_main_conf_t  *cmcf;

    cmcf = ngx_http_conf_get_module_main_conf(cf, ngx_http_core_module);

    h = ngx_array_push(&cmcf->phases[NGX_HTTP_PRECONTENT_PHASE].handlers);
    if (h == NULL) {
        return NGX_ERROR;
    }

    *h = ngx_http_kvroute_precontent;

    if (ngx_http_kvroute_add_variables(cf) != NGX_OK) {
        return NGX_ERROR;
    }

    return ngx_http_kvroute_filter_init(cf);
}


static void *
ngx_http_kvroute_create_main_conf(ngx_conf_t *cf)
{
    ngx_http_kvroute_main_conf_t  *kmcf;

    kmcf = ngx_pcalloc(cf->pool, sizeof(ngx_http_kvroute_main_conf_t));
    if (kmcf == NULL) {
        return NULL;
    }

    if (ngx_array_init(&kmcf->zones, cf->pool, 2,
                       sizeof(ngx_http_kvroute_zone_t *))
        != NGX_OK)
    {
        return NULL;
    }

    if (ngx_array_init(&kmcf->upstreams, cf->pool, 4,
                       sizeof(ngx_http_kvroute_upstream_ref_t *))
        != NGX_OK)
    {
        return NULL;
    }

    return kmcf;
}


/* After the upstream module has set every upstream up: size the zones
 * for their servers, and find the upstreams kvroute_upstream names. */

static char *
ngx_http_kvroute_init_main_conf(ngx_conf_t *cf, void *conf)
{
    ngx_http_kvroute_main_conf_t *kmcf = conf;

    ngx_uint_t                 i;
    ngx_http_kvroute_zone_t  **zones;

    zones = kmcf->zones.elts;

    for (i = 0; i < kmcf->zones.nelts; i++) {
        if (ngx_http_kvroute_zone_size(cf, zones[i]) != NGX_OK) {
            return NGX_CONF_ERROR;
        }
    }

    if (ngx_http_kvroute_upstream_resolve(cf, kmcf) != NGX_OK) {
        return NGX_CONF_ERROR;
    }

    return NGX_CONF_OK;
}


static void *
ngx_http_kvroute_create_srv_conf(ngx_conf_t *cf)
{
    ngx_http_kvroute_srv_conf_t  *kcf;

    kcf = ngx_pcalloc(cf->pool, sizeof(ngx_http_kvroute_srv_conf_t));
    if (kcf == NULL) {
        return NULL;
    }

    /*
     * set by ngx_pcalloc():
     *
     *     kcf->zone = NULL;
     *     kcf->tokenizer = NULL;
     *     kcf->template = NULL;
     *     kcf->peers = NULL;
     */

    kcf->block_size = 16;
    kcf->mode = -1;
    kcf->retry_after = 1;
    kcf->thread_threshold = 65536;
    kcf->max_tokenize = 4 * 1024 * 1024;
    kcf->tokenize_budget = 8 * 1024 * 1024;
    kcf->tokenize_wait = 10000;
    kv_route_config_init(&kcf->route);
    kv_prefill_config_init(&kcf->prefill_cfg);
    kcf->prefill_kv_bytes = 131072;     /* kvworker's default: Llama-3-8B fp16 */

    if (ngx_array_init(&kcf->worker_ids, cf->pool, 1,
                       sizeof(ngx_http_kvroute_worker_map_t))
        != NGX_OK)
    {
        return NULL;
    }

    return kcf;
}


static void *
ngx_http_kvroute_create_loc_conf(ngx_conf_t *cf)
{
    ngx_http_kvroute_loc_conf_t  *klcf;

    klcf = ngx_pcalloc(cf->pool, sizeof(ngx_http_kvroute_loc_conf_t));
    if (klcf == NULL) {
        return NULL;
    }

    /*
     * set by ngx_pcalloc():
     *
     *     klcf->status = 0;
     *     klcf->warned = 0;
     */

    klcf->debug_headers = NGX_CONF_UNSET;
    klcf->upstream = NGX_CONF_UNSET_PTR;

    return klcf;
}


static char *
ngx_http_kvroute_merge_loc_conf(ngx_conf_t *cf, void *parent, void *child)
{
    ngx_http_kvroute_loc_conf_t  *prev = parent;
    ngx_http_kvroute_loc_conf_t  *conf = child;

    ngx_http_core_loc_conf_t     *clcf;

    ngx_conf_merge_value(conf->debug_headers, prev->debug_headers, 0);

    /* kvroute_upstream goes with proxy_pass: into "if" and "limit_except"
     * blocks, not into nested locations */

    clcf = ngx_http_conf_get_module_loc_conf(cf, ngx_http_core_module);

    if (conf->upstream == NGX_CONF_UNSET_PTR) {
        conf->upstream = clcf->noname ? prev->upstream : NULL;
        conf->choices = clcf->noname ? prev->choices : NULL;

        if (conf->upstream == NGX_CONF_UNSET_PTR) {
            conf->upstream = NULL;
        }
    }

    return NGX_CONF_OK;
}


uint64_t
ngx_http_kvroute_now_ns(void)
{
    struct timespec  ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);

    return (uint64_t) ts.tv_sec * 1000000000 + (uint64_t) ts.tv_nsec;
}


static ngx_int_t
ngx_http_kvroute_init_process(ngx_cycle_t *cycle)
{
    ngx_uint_t                      i;
    ngx_http_kvroute_zone_t       **zones;
    ngx_http_kvroute_srv_conf_t   **kcfs;
    ngx_http_kvroute_main_conf_t   *kmcf;

    if (ngx_process != NGX_PROCESS_WORKER
        && ngx_process != NGX_PROCESS_SINGLE)
    {
        return NGX_OK;
    }

    kmcf = ngx_http_cycle_get_module_main_conf(cycle, ngx_http_kvroute_module);
    if (kmcf == NULL || kmcf->zones.nelts == 0) {
        return NGX_OK;
    }

    zones = kmcf->zones.elts;

    for (i = 0; i < kmcf->zones.nelts; i++) {
        ngx_uint_t  j;

        kcfs = zones[i]->upstreams.elts;

        for (j = 0; j < zones[i]->upstreams.nelts; j++) {
            if (ngx_http_kvroute_init_worker_peers(cycle, kcfs[j]) != NGX_OK) {
                return NGX_ERROR;
            }
        }
    }

    for (i = 0; i < kmcf->zones.nelts; i++) {
        if (ngx_http_kvroute_events_init_single(cycle, zones[i]) != NGX_OK) {
            return NGX_ERROR;
        }

        zones[i]->row = kv_load_claim_row(zones[i]->sh->load, ngx_pid);

        if (zones[i]->row < 0) {
            ngx_log_error(NGX_LOG_WARN, cycle->log, 0,
                          "kvroute: no free load row in zone \"%V\"; if this "
                          "process dies its load is not reclaimed",
                          &zones[i]->name);
        }
    }

    ngx_http_kvroute_timer.handler = ngx_http_kvroute_timer_handler;
    ngx_http_kvroute_timer.log = cycle->log;
    ngx_http_kvroute_timer.data = kmcf;
    ngx_http_kvroute_timer.cancelable = 1;

    ngx_add_timer(&ngx_http_kvroute_timer, 500);

    return NGX_OK;
}


static void
ngx_http_kvroute_timer_handler(ngx_event_t *ev)
{
    ngx_uint_t                     i;
    ngx_http_kvroute_zone_t      **zones;
    ngx_http_kvroute_main_conf_t  *kmcf = ev->data;

    zones = kmcf->zones.elts;

    for (i = 0; i < kmcf->zones.nelts; i++) {
        ngx_http_kvroute_zone_timer(zones[i]);
    }

    if (!ngx_exiting) {
        ngx_add_timer(ev, 500);
    }
}


static void
ngx_http_kvroute_exit_process(ngx_cycle_t *cycle)
{
    ngx_uint_t                      i;
    ngx_http_kvroute_zone_t       **zones;
    ngx_http_kvroute_main_conf_t   *kmcf;

    if (ngx_process != NGX_PROCESS_WORKER
        && ngx_process != NGX_PROCESS_SINGLE)
    {
        return;
    }

    kmcf = ngx_http_cycle_get_module_main_conf(cycle, ngx_http_kvroute_module);
    if (kmcf == NULL) {
        return;
    }

    /* requests still in flight at exit release their load here */

    zones = kmcf->zones.elts;

    for (i = 0; i < kmcf->zones.nelts; i++) {
        ngx_http_kvroute_events_exit_single(zones[i]);
        kv_load_release_row(zones[i]->sh->load, zones[i]->row);
    }
}
