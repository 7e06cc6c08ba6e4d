
/*
 * Copyright (C) kvroute authors
 *
 * kvroute_zone: the shared memory all nginx worker processes route from.
 * The slab pool holds, in the order they are carved:
 *
 *   ngx_http_kvroute_sh_t   counters, histogram, pointers to the rest
 *   load table              in-flight load per server (src/index/kv_load.c)
 *   worker registry         workers and the helper's status, written by the
 *                           event helper (src/index/kv_registry.c)
 *   turn cache              turn_cache=SIZE (default an eighth of the zone,
 *                           at most 64m; 0: off): prompt prefixes -> token
 *                           ids, shared by the workers (src/index/kv_tcache.c)
 *   response map            responses=N (default 65536 ids, 128 bytes per 7;
 *                           0: off): Responses API response id -> the server
 *                           that made it (src/index/kv_respmap.c)
 *   pending index           events mode only: an eighth of what is left, the
 *                           router's recent decisions (approximate, short TTL)
 *   prefix index            whatever the zone has left (src/index/kv_index.c)
 *
 * In approximate mode (no events) there is no pending index and the prefix
 * index itself holds the router's decisions. The zone is reused across
 * reloads when its name and size stay the same, so the index and in-flight
 * load survive a reload.
 */


#include "ngx_http_kvroute.h"


#define NGX_HTTP_KVROUTE_MAGIC  0x6b76726f75746531ULL     /* "kvroute1" */


static ngx_int_t ngx_http_kvroute_init_zone(ngx_shm_zone_t *shm_zone,
    void *data);
static ngx_int_t ngx_http_kvroute_zone_index(ngx_http_kvroute_zone_t *zone,
    ngx_slab_pool_t *shpool, ngx_log_t *log);
static ngx_int_t ngx_http_kvroute_zone_registry(ngx_http_kvroute_zone_t *zone,
    ngx_slab_pool_t *shpool, ngx_log_t *log);
static void ngx_http_kvroute_zone_turns(ngx_http_kvroute_zone_t *zone,
    ngx_slab_pool_t *shpool, ngx_log_t *log);
static void ngx_http_kvroute_zone_responses(ngx_http_kvroute_zone_t *zone,
    ngx_slab_pool_t *shpool, ngx_log_t *log);
static size_t ngx_http_kvroute_resp_bytes(ngx_http_kvroute_zone_t *zone);
static ngx_int_t ngx_http_kvroute_register_servers(
    ngx_http_kvroute_zone_t *zone, ngx_log_t *log);
static int ngx_http_kvroute_pid_alive(pid_t pid);
static void ngx_http_kvroute_zone_learn_ttl(ngx_http_kvroute_zone_t *zone);


/*
 * The parameters of "kvroute_zone" (ngx_http_kvroute_param.c); defaults
 * are set where the zone conf is created (ngx_http_kvroute_zone_find).
 */

#define NGX_HTTP_KVROUTE_ZONE_OFF(field)                                      \
    offsetof(ngx_http_kvroute_zone_t, field)

static ngx_conf_enum_t  ngx_http_kvroute_on_off[] = {
    { ngx_string("off"), 0 },
    { ngx_string("on"), 1 },
    { ngx_null_string, 0 }
};


static ngx_http_kvroute_param_t  ngx_http_kvroute_zone_params[] = {
    { ngx_string("max_workers="), NGX_HTTP_KVROUTE_P_UINT,
      NGX_HTTP_KVROUTE_ZONE_OFF(max_workers), 1, 4096, NULL },
    /* the index ages blocks by ms mod 2^32, signed: up to 24.8 days */
    { ngx_string("ttl="), NGX_HTTP_KVROUTE_P_MSEC,
      NGX_HTTP_KVROUTE_ZONE_OFF(ttl), 1, 24 * 86400000.0, NULL },
    { ngx_string("ttl_learn="), NGX_HTTP_KVROUTE_P_ENUM,
      NGX_HTTP_KVROUTE_ZONE_OFF(ttl_learn), 0, 0, ngx_http_kvroute_on_off },
    { ngx_string("turn_cache="), NGX_HTTP_KVROUTE_P_SIZE,
      NGX_HTTP_KVROUTE_ZONE_OFF(turn_size), 0, 1e15, NULL },
    { ngx_string("turn_cache_ttl="), NGX_HTTP_KVROUTE_P_MSEC,
      NGX_HTTP_KVROUTE_ZONE_OFF(turn_ttl), 1, 1e15, NULL },
    { ngx_string("responses="), NGX_HTTP_KVROUTE_P_UINT,
      NGX_HTTP_KVROUTE_ZONE_OFF(responses), 0, 1e9, NULL },
    { ngx_null_string, 0, 0, 0, 0, NULL }
};


char *
ngx_http_kvroute_zone_directive(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf)
{
    ssize_t                    size;
    ngx_int_t                  rc;
    ngx_str_t                 *value;
    ngx_uint_t                 i;
    ngx_http_kvroute_zone_t   *zone;

    value = cf->args->elts;

    zone = ngx_http_kvroute_zone_find(cf, &value[1]);
    if (zone == NULL) {
        return NGX_CONF_ERROR;
    }

    if (zone->shm_zone) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "kvroute_zone \"%V\" is already declared in %V:%ui",
                           &value[1], &zone->decl_file, zone->decl_line);
        return NGX_CONF_ERROR;
    }

    zone->decl_file = cf->conf_file->file.name;
    zone->decl_line = cf->conf_file->line;

    size = ngx_parse_size(&value[2]);
    if (size == NGX_ERROR) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "invalid zone size \"%V\"", &value[2]);
        return NGX_CONF_ERROR;
    }

    for (i = 3; i < cf->args->nelts; i++) {

        rc = ngx_http_kvroute_param_set(cf, "kvroute_zone",
                                        ngx_http_kvroute_zone_params, zone,
                                        &value[i]);

        if (rc == NGX_ERROR) {
            return NGX_CONF_ERROR;
        }

        if (rc == NGX_DECLINED) {
            ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                               "invalid parameter \"%V\"", &value[i]);
            return NGX_CONF_ERROR;
        }
    }

    if (zone->turn_size != -1
        && zone->turn_size
        && (zone->turn_size > size / 2
            || (size_t) zone->turn_size < kv_tcache_min_size()))
    {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "invalid \"turn_cache=%z\": 0, or %uzk up to half "
                           "the zone", zone->turn_size,
                           kv_tcache_min_size() / 1024 + 1);
        return NGX_CONF_ERROR;
    }

    if (zone->responses == NGX_CONF_UNSET_UINT) {
        zone->resp_default = 1;
        zone->responses = 65536;
    }

    if (zone->turn_size == -1) {
        zone->turn_default = 1;
        zone->turn_size = ngx_min(size / 8, 64 * 1024 * 1024);
        if ((size_t) zone->turn_size < kv_tcache_min_size()) {
            zone->turn_size = 0;
        }
    }

    zone->size = size;

    zone->shm_zone = ngx_shared_memory_add(cf, &zone->name, size,
                                           &ngx_http_kvroute_module);
    if (zone->shm_zone == NULL) {
        return NGX_CONF_ERROR;
    }

    if (zone->shm_zone->data) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "kvroute_zone \"%V\" is already used", &value[1]);
        return NGX_CONF_ERROR;
    }

    zone->shm_zone->init = ngx_http_kvroute_init_zone;
    zone->shm_zone->data = zone;

    return NGX_CONF_OK;
}


/* The zone conf named name, created on first mention (kvroute may name a
 * zone before or after its kvroute_zone line). */

ngx_http_kvroute_zone_t *
ngx_http_kvroute_zone_find(ngx_conf_t *cf, ngx_str_t *name)
{
    ngx_uint_t                     i;
    ngx_http_kvroute_zone_t      **zones, *zone, **zp;
    ngx_http_kvroute_main_conf_t  *kmcf;

    kmcf = ngx_http_conf_get_module_main_conf(cf, ngx_http_kvroute_module);

    zones = kmcf->zones.elts;

    for (i = 0; i < kmcf->zones.nelts; i++) {
        if (zones[i]->name.len == name->len
            && ngx_strncmp(zones[i]->name.data, name->data, name->len) == 0)
        {
            return zones[i];
        }
    }

    zone = ngx_pcalloc(cf->pool, sizeof(ngx_http_kvroute_zone_t));
    if (zone == NULL) {
        return NULL;
    }

    zone->name = *name;
    zone->ref_file = cf->conf_file->file.name;
    zone->ref_line = cf->conf_file->line;
    zone->row = -1;
    zone->approximate = 1;
    zone->max_workers = 256;
    zone->ttl = 120000;
    zone->ttl_learn = 0;
    zone->turn_size = -1;
    zone->turn_ttl = 300000;
    zone->responses = NGX_CONF_UNSET_UINT;

    if (ngx_array_init(&zone->upstreams, cf->pool, 2,
                       sizeof(ngx_http_kvroute_srv_conf_t *))
        != NGX_OK)
    {
        return NULL;
    }

    zp = ngx_array_push(&kmcf->zones);
    if (zp == NULL) {
        return NULL;
    }

    *zp = zone;

    return zone;
}


/*
 * A load row per worker process, for a few generations across reloads (a
 * process without one cannot give its load back if it dies). Four
 * generations where rows are small; where many servers make them large,
 * as many as NGX_HTTP_KVROUTE_ROWS_BYTES holds, but never fewer than two
 * (a reload's old and new processes side by side): on a 96-core machine a
 * fixed cap of 128 rows left a reload's new processes rowless. An unset
 * worker_processes (the directive may follow the http block) is taken as
 * the most the budget holds, up to 128.
 */

static ngx_uint_t
ngx_http_kvroute_zone_rows(ngx_uint_t servers, ngx_uint_t workers)
{
    ngx_uint_t  rows, fit;

    fit = NGX_HTTP_KVROUTE_ROWS_BYTES
          / (servers * KV_LOAD_ACTIVE * sizeof(int64_t));

    if (workers == 0) {
        rows = ngx_min(fit, NGX_HTTP_KVROUTE_MAX_ROWS);

    } else {
        rows = 4 * workers + 8;

        if (rows > fit) {
            rows = ngx_max(fit, 2 * workers + 8);
        }
    }

    return ngx_max(16, rows);
}


/*
 * Once every upstream is configured (the module's init_main_conf): the load
 * table is sized for the servers of the upstreams that use the zone, with
 * room for a quarter more (a reload that adds a few servers keeps it), and
 * a zone too small for that, the registry and a minimal index fails the
 * configuration test with the size it needs.
 */

ngx_int_t
ngx_http_kvroute_zone_size(ngx_conf_t *cf, ngx_http_kvroute_zone_t *zone)
{
    size_t                          need, pages;
    ngx_uint_t                      i, servers;
    ngx_core_conf_t                *ccf;
    kv_index_config_t               icfg;
    ngx_http_upstream_rr_peers_t   *peers;
    ngx_http_kvroute_srv_conf_t   **kcfs;

    if (zone->shm_zone == NULL) {
        return NGX_OK;              /* init_upstream said so already */
    }

    kcfs = zone->upstreams.elts;
    servers = 0;

    for (i = 0; i < zone->upstreams.nelts; i++) {
        for (peers = kcfs[i]->uscf->peer.data; peers; peers = peers->next) {
            servers += peers->number;
        }
    }

    zone->load_servers = servers + servers / 4 + 16;
    zone->load_groups = 2 * zone->upstreams.nelts + 8;

    ccf = (ngx_core_conf_t *) ngx_get_conf(cf->cycle->conf_ctx, ngx_core_module);

    zone->load_rows = ngx_http_kvroute_zone_rows(zone->load_servers,
                          (ccf == NULL || ccf->worker_processes == NGX_CONF_UNSET)
                          ? 0 : (ngx_uint_t) ccf->worker_processes);

    ngx_memzero(&icfg, sizeof(icfg));
    icfg.max_workers = zone->max_workers;

    need = kv_load_size(zone->load_servers, zone->load_rows, zone->load_groups)
           + kv_registry_min_size(zone->max_workers)
           + 2 * (kv_index_min_size(&icfg) + ngx_pagesize)
           + 64 * ngx_pagesize
           + ngx_http_kvroute_share_size(zone);

    /* the slab pool's own page descriptors, and pages rounded up */
    pages = need / ngx_pagesize + 8;
    need = (pages + pages / 64 + 8) * ngx_pagesize;

    /* the default response map gives way to the servers, as a whole */

    if (zone->resp_default && zone->size < need + ngx_http_kvroute_resp_bytes(zone)) {
        zone->responses = 0;
    }

    need += ngx_http_kvroute_resp_bytes(zone);

    /*
     * an explicit turn_cache= must fit besides; the default one (an eighth
     * of the zone) gives way to the servers, down to none
     */

    if (zone->turn_default && zone->turn_size > 0
        && zone->size < need + (size_t) zone->turn_size)
    {
        zone->turn_size = zone->size > need ? zone->size - need : 0;

        if ((size_t) zone->turn_size < kv_tcache_min_size()) {
            zone->turn_size = 0;
        }
    }

    need += zone->turn_size > 0 ? (size_t) zone->turn_size : 0;

    if (zone->size < need) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "kvroute_zone \"%V\" is too small for its %ui "
                           "upstream servers: at least %uzk (declared in "
                           "%V:%ui)", &zone->name, servers, need / 1024 + 1,
                           &zone->decl_file, zone->decl_line);
        return NGX_ERROR;
    }

    return NGX_OK;
}


static ngx_int_t
ngx_http_kvroute_init_zone(ngx_shm_zone_t *shm_zone, void *data)
{
    ngx_http_kvroute_zone_t  *ozone = data;

    size_t                    size;
    ngx_slab_pool_t          *shpool;
    ngx_http_kvroute_sh_t    *sh;
    ngx_http_kvroute_zone_t  *zone;

    zone = shm_zone->data;
    shpool = (ngx_slab_pool_t *) shm_zone->shm.addr;

    if (ozone) {
        sh = ozone->sh;

        if (sh == NULL || sh->magic != NGX_HTTP_KVROUTE_MAGIC) {
            ngx_log_error(NGX_LOG_EMERG, shm_zone->shm.log, 0,
                          "kvroute_zone \"%V\": reused zone is not ours",
                          &zone->name);
            return NGX_ERROR;
        }

        zone->sh = sh;
        zone->shpool = shpool;

        /* the index is kept unless the mode changed across the reload */

        if (sh->approximate != zone->approximate
            || sh->max_workers != zone->max_workers)
        {
            ngx_log_error(NGX_LOG_NOTICE, shm_zone->shm.log, 0,
                          "kvroute_zone \"%V\": mode or max_workers changed, "
                          "index rebuilt", &zone->name);

            /* the registry is laid out once, with the zone */

            if (sh->registry
                && kv_registry_max_workers(sh->registry) < zone->max_workers)
            {
                ngx_log_error(NGX_LOG_WARN, shm_zone->shm.log, 0,
                              "kvroute_zone \"%V\": the worker registry keeps "
                              "its %uD records until the zone is recreated "
                              "(restart nginx or change the zone's size): "
                              "workers past them are not tracked",
                              &zone->name,
                              kv_registry_max_workers(sh->registry));
            }

            if (ngx_http_kvroute_zone_index(zone, shpool, shm_zone->shm.log)
                != NGX_OK)
            {
                return NGX_ERROR;
            }
        }

        if (sh->turns) {
            kv_tcache_set_ttl(sh->turns, zone->turn_ttl);
        }

        if (ngx_http_kvroute_resp_bytes(zone) != sh->resp_size) {
            ngx_log_error(NGX_LOG_NOTICE, shm_zone->shm.log, 0,
                          "kvroute_zone \"%V\": responses= changes when the "
                          "zone is recreated", &zone->name);
        }

        if ((size_t) zone->turn_size != sh->turn_size) {
            ngx_log_error(NGX_LOG_NOTICE, shm_zone->shm.log, 0,
                          "kvroute_zone \"%V\": turn_cache size changes "
                          "when the zone is recreated", &zone->name);
        }

        (void) ngx_http_kvroute_share_zone(zone, shpool, shm_zone->shm.log);

        return ngx_http_kvroute_register_servers(zone, shm_zone->shm.log);
    }

    sh = ngx_slab_calloc(shpool, sizeof(ngx_http_kvroute_sh_t));
    if (sh == NULL) {
        return NGX_ERROR;
    }

    shpool->data = sh;
    zone->sh = sh;
    zone->shpool = shpool;

    size = kv_load_size(zone->load_servers, zone->load_rows,
                        zone->load_groups);

    sh->load_region = ngx_slab_alloc(shpool, size);
    if (sh->load_region == NULL) {
        ngx_log_error(NGX_LOG_EMERG, shm_zone->shm.log, 0,
                      "kvroute_zone \"%V\": no room for the load table of "
                      "%ui servers (%uzk)", &zone->name, zone->load_servers,
                      size / 1024 + 1);
        return NGX_ERROR;
    }

    sh->load = kv_load_init(sh->load_region, size, zone->load_servers,
                            zone->load_rows, zone->load_groups, 0);

    if (ngx_http_kvroute_zone_registry(zone, shpool, shm_zone->shm.log)
        != NGX_OK)
    {
        return NGX_ERROR;
    }

    ngx_http_kvroute_zone_turns(zone, shpool, shm_zone->shm.log);
    ngx_http_kvroute_zone_responses(zone, shpool, shm_zone->shm.log);
    (void) ngx_http_kvroute_share_zone(zone, shpool, shm_zone->shm.log);

    if (ngx_http_kvroute_zone_index(zone, shpool, shm_zone->shm.log)
        != NGX_OK)
    {
        return NGX_ERROR;
    }

    sh->magic = NGX_HTTP_KVROUTE_MAGIC;

    return ngx_http_kvroute_register_servers(zone, shm_zone->shm.log);
}


/* The response map's bytes for responses=N ids; 0: off. */

static size_t
ngx_http_kvroute_resp_bytes(ngx_http_kvroute_zone_t *zone)
{
    size_t  size;

    if (zone->responses == 0) {
        return 0;
    }

    /* 128-byte buckets of KV_RESPMAP_WAYS ids, after a 64-byte header */
    size = 64 + (zone->responses + KV_RESPMAP_WAYS - 1) / KV_RESPMAP_WAYS * 128;

    return ngx_max(size, kv_respmap_min_size());
}


/* The response map, carved before the index; a zone without room for it
 * routes continued responses by what they carry (logged). */

static void
ngx_http_kvroute_zone_responses(ngx_http_kvroute_zone_t *zone,
    ngx_slab_pool_t *shpool, ngx_log_t *log)
{
    size_t                  size;
    ngx_http_kvroute_sh_t  *sh = zone->sh;

    size = ngx_http_kvroute_resp_bytes(zone);
    if (size == 0) {
        return;
    }

    sh->resp_region = ngx_slab_alloc(shpool, size);
    if (sh->resp_region == NULL) {
        ngx_log_error(NGX_LOG_WARN, log, 0, "kvroute_zone \"%V\": no room "
                      "for responses=%ui", &zone->name, zone->responses);
        return;
    }

    sh->resp_size = size;
    sh->responses = kv_respmap_create(sh->resp_region, size);
}


/* The worker registry the event helper writes: carved before the index,
 * which takes the rest. */

static ngx_int_t
ngx_http_kvroute_zone_registry(ngx_http_kvroute_zone_t *zone,
    ngx_slab_pool_t *shpool, ngx_log_t *log)
{
    char                    err[256];
    size_t                  size;
    ngx_http_kvroute_sh_t  *sh = zone->sh;

    size = kv_registry_min_size(zone->max_workers);

    sh->registry_region = ngx_slab_alloc(shpool, size);
    if (sh->registry_region == NULL) {
        ngx_log_error(NGX_LOG_EMERG, log, 0,
                      "kvroute_zone \"%V\": no room for the registry",
                      &zone->name);
        return NGX_ERROR;
    }

    sh->registry = kv_registry_create(sh->registry_region, size,
                                      zone->max_workers, err, sizeof(err));
    if (sh->registry == NULL) {
        ngx_log_error(NGX_LOG_EMERG, log, 0, "kvroute_zone \"%V\": %s",
                      &zone->name, err);
        return NGX_ERROR;
    }

    return NGX_OK;
}


/* The turn cache (turn_cache=): carved before the index, which takes the
 * rest; without room the zone works without it. */

static void
ngx_http_kvroute_zone_turns(ngx_http_kvroute_zone_t *zone,
    ngx_slab_pool_t *shpool, ngx_log_t *log)
{
    char                    err[256];
    ngx_http_kvroute_sh_t  *sh = zone->sh;

    if (zone->turn_size <= 0) {
        return;
    }

    sh->turn_region = ngx_slab_alloc(shpool, zone->turn_size);
    if (sh->turn_region == NULL) {
        ngx_log_error(NGX_LOG_WARN, log, 0, "kvroute_zone \"%V\": no room "
                      "for turn_cache=%z", &zone->name, zone->turn_size);
        return;
    }

    sh->turns = kv_tcache_create(sh->turn_region, zone->turn_size,
                                 zone->turn_ttl, err, sizeof(err));
    if (sh->turns == NULL) {
        ngx_log_error(NGX_LOG_WARN, log, 0, "kvroute_zone \"%V\": %s",
                      &zone->name, err);
        return;
    }

    sh->turn_size = zone->turn_size;
}


/* Lays the index out over the largest block the slab pool can give. */

static ngx_int_t
ngx_http_kvroute_zone_index(ngx_http_kvroute_zone_t *zone,
    ngx_slab_pool_t *shpool, ngx_log_t *log)
{
    char                    err[256];
    size_t                  size;
    kv_index_config_t       icfg;
    ngx_http_kvroute_sh_t  *sh = zone->sh;

    /*
     * events mode: a small second index, in approximate mode with a short
     * TTL, remembers where the router just sent each prompt. Events arrive
     * only once a worker has prefilled; until then, requests sharing a
     * prefix that is being computed would otherwise scatter (Dynamo counts
     * its active sequences for the same reason). An eighth of the zone.
     */

    if (!zone->approximate && sh->pending_region == NULL) {
        ngx_memzero(&icfg, sizeof(icfg));
        icfg.max_workers = zone->max_workers;
        size = ngx_max(shpool->pfree * ngx_pagesize / 8,
                       kv_index_min_size(&icfg) + ngx_pagesize);
        shpool->log_nomem = 0;          /* said below, with the remedy */
        sh->pending_region = ngx_slab_alloc(shpool, size);
        shpool->log_nomem = 1;
        sh->pending_size = sh->pending_region ? size : 0;

        if (sh->pending_region == NULL) {
            /* a zone laid out for approximate mode, reused by a reload
             * to events mode: its index took the room */
            ngx_log_error(NGX_LOG_WARN, log, 0, "kvroute_zone \"%V\": no room "
                          "for the pending index (the zone was laid out for "
                          "approximate mode): requests sharing a new prefix "
                          "may scatter until its events come; restart nginx "
                          "or change the zone's size to lay it out again",
                          &zone->name);
        }
    }

    if (!zone->approximate && sh->pending_region) {
        ngx_memzero(&icfg, sizeof(icfg));
        icfg.max_workers = zone->max_workers;
        icfg.approximate = 1;
        icfg.ttl_ms = NGX_HTTP_KVROUTE_PENDING_TTL;

        sh->pending = kv_index_create(sh->pending_region, sh->pending_size, &icfg,
                                      err, sizeof(err));
        if (sh->pending == NULL) {
            ngx_log_error(NGX_LOG_WARN, log, 0, "kvroute_zone \"%V\": no pending "
                          "index: %s", &zone->name, err);
        }

    } else {
        sh->pending = NULL;
    }

    if (sh->index_region == NULL) {
        size = shpool->pfree * ngx_pagesize;

        while (size > 4 * ngx_pagesize) {
            size -= 2 * ngx_pagesize;

            sh->index_region = ngx_slab_alloc(shpool, size);
            if (sh->index_region) {
                break;
            }
        }

        if (sh->index_region == NULL) {
            ngx_log_error(NGX_LOG_EMERG, log, 0,
                          "kvroute_zone \"%V\": no room for the index",
                          &zone->name);
            return NGX_ERROR;
        }

        sh->index_size = size;
    }

    ngx_memzero(&icfg, sizeof(icfg));
    icfg.max_workers = zone->max_workers;
    icfg.approximate = zone->approximate;
    icfg.ttl_ms = zone->ttl;
    icfg.engine_hashes = ngx_http_kvroute_events_zmq(zone->events_conf) != 0;

    sh->index = kv_index_create(sh->index_region, sh->index_size, &icfg,
                                err, sizeof(err));
    if (sh->index == NULL) {
        ngx_log_error(NGX_LOG_EMERG, log, 0,
                      "kvroute_zone \"%V\": %s", &zone->name, err);
        return NGX_ERROR;
    }

    sh->approximate = zone->approximate;
    sh->max_workers = zone->max_workers;

    return NGX_OK;
}


/*
 * Load is kept per "upstream/server" name so that a reload keeps the
 * counts of servers that stay; names are added here, in the master, the
 * only process that writes them. Each upstream's primaries (group 2u) and
 * backups (2u + 1) are placed in the least-loaded order with their weight;
 * servers of an older configuration are taken out of it first. A reused
 * table without room for the new servers fails the reload, keeping the
 * running configuration, rather than routing some servers without load.
 */

static ngx_int_t
ngx_http_kvroute_register_servers(ngx_http_kvroute_zone_t *zone,
    ngx_log_t *log)
{
    int                             k;
    u_char                          name[KV_LOAD_NAME_MAX];
    size_t                          len;
    uint32_t                        n;
    ngx_uint_t                      i, b;
    kv_load_t                      *ld = zone->sh->load;
    ngx_http_upstream_rr_peer_t    *peer;
    ngx_http_upstream_rr_peers_t   *peers;
    ngx_http_kvroute_srv_conf_t   **kcfs;

    for (n = 0; n < kv_load_servers(ld); n++) {
        kv_load_place(ld, n, UINT32_MAX, 1);
    }

    kcfs = zone->upstreams.elts;

    for (i = 0; i < zone->upstreams.nelts; i++) {
        peers = kcfs[i]->uscf->peer.data;
        kcfs[i]->group = 2 * i;

        for (b = 0; peers && b < 2; b++, peers = peers->next) {
            for (peer = peers->peer; peer; peer = peer->next) {
                len = ngx_snprintf(name, sizeof(name), "%V/%V",
                                   &kcfs[i]->upstream_name, &peer->server)
                      - name;

                k = kv_load_server(ld, (char *) name, len);

                if (k < 0 || 2 * i + b >= kv_load_groups(ld)) {
                    ngx_log_error(NGX_LOG_EMERG, log, 0,
                                  "kvroute_zone \"%V\": its load table (kept "
                                  "across the reload) has no room for \"%*s\"; "
                                  "change the zone's size to lay it out anew",
                                  &zone->name, len, name);
                    return NGX_ERROR;
                }

                if (!peer->down) {
                    kv_load_place(ld, k, 2 * i + b, peer->weight);
                }
            }
        }
    }

    return NGX_OK;
}


/* Events and blocks applied per second, over about the last second. */

static void
ngx_http_kvroute_zone_rates(ngx_http_kvroute_zone_t *zone)
{
    double               dt;
    uint64_t             now;
    kv_ingest_status_t   st;

    if (zone->events_conf == NULL) {
        return;
    }

    now = (uint64_t) ngx_current_msec;

    kv_registry_status(zone->sh->registry, &st);

    if (zone->rate_ms && now - zone->rate_ms < 900) {
        return;
    }

    if (zone->rate_ms) {
        dt = (double) (now - zone->rate_ms) / 1000;
        zone->events_per_s = (double) (st.events - zone->rate_events) / dt;
        zone->blocks_per_s = (double) (st.blocks - zone->rate_blocks) / dt;
    }

    zone->rate_ms = now;
    zone->rate_events = st.events;
    zone->rate_blocks = st.blocks;
}


/* Every half second in every worker: reclaim dead processes' load, follow
 * announced worker ids and, in approximate mode, expire the router's own
 * predictions. */

void
ngx_http_kvroute_zone_timer(ngx_http_kvroute_zone_t *zone)
{
    int                            n;
    ngx_uint_t                     i;
    ngx_http_kvroute_sh_t         *sh = zone->sh;
    ngx_http_kvroute_srv_conf_t  **kcfs;

    n = kv_load_reap(sh->load, ngx_http_kvroute_pid_alive);

    /* large upstreams follow the ids workers announce here, not per request */

    kcfs = zone->upstreams.elts;

    for (i = 0; i < zone->upstreams.nelts; i++) {
        if (kcfs[i]->nprimary > NGX_HTTP_KVROUTE_SCAN_ALL) {
            ngx_http_kvroute_candidates_refresh(kcfs[i]);
        }
    }

    ngx_http_kvroute_zone_rates(zone);

    if (n) {
        ngx_log_error(NGX_LOG_NOTICE, ngx_cycle->log, 0,
                      "kvroute_zone \"%V\": reclaimed the load of %d exited "
                      "process(es)", &zone->name, n);
    }

    /*
     * the slab pool's mutex lives in the zone (so it wakes waiters in other
     * processes) and nginx force-unlocks it when its holder dies
     */

    if ((sh->approximate || sh->pending) && ngx_shmtx_trylock(&zone->shpool->mutex)) {

        if (sh->approximate) {
            ngx_http_kvroute_zone_learn_ttl(zone);
        }

        kv_index_expire(sh->approximate ? sh->index : sh->pending,
                        (uint64_t) ngx_current_msec);
        ngx_shmtx_unlock(&zone->shpool->mutex);
    }
}


/*
 * Approximate mode: the memory the engines' answers support (kv_retain.h),
 * with ttl= as its cap; with ttl_learn=off, ttl= itself. Twice a second
 * for the zone, whichever process gets there first; under the zone's mutex.
 */

static void
ngx_http_kvroute_zone_learn_ttl(ngx_http_kvroute_zone_t *zone)
{
    uint64_t                cap, cur, next;
    ngx_http_kvroute_sh_t  *sh = zone->sh;

    cap = ngx_min(zone->ttl, (ngx_msec_t) 0xffffffff);

    if (!zone->ttl_learn) {
        kv_index_set_ttl(sh->index, (uint32_t) cap);
        return;
    }

    /* signed: another process may have stamped it from a clock cached
     * a little later than this one's */
    if (sh->retain_ms
        && (ngx_msec_int_t) (ngx_current_msec - sh->retain_ms) < 500)
    {
        return;
    }

    sh->retain_ms = ngx_current_msec;

    /* 1019/1024 a tick: a half-life of about 70 s */
    kv_retain_decay(&sh->retain, 1019);

    cur = kv_index_ttl(sh->index);
    next = kv_retain_step(ngx_min(cur, cap), kv_retain_choose(&sh->retain, cap));

    if (next != cur) {
        ngx_log_debug2(NGX_LOG_DEBUG_HTTP, ngx_cycle->log, 0,
                       "kvroute_zone: learned ttl %uL ms (was %uL)", next, cur);
        kv_index_set_ttl(sh->index, (uint32_t) next);
    }
}


static int
ngx_http_kvroute_pid_alive(pid_t pid)
{
    return kill(pid, 0) == 0 || ngx_errno != NGX_ESRCH;
}
