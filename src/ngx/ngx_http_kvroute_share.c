
/*
 * Copyright (C) kvroute authors
 *
 * kvroute_share: decisions and in-flight load shared between nginx
 * instances over NATS (src/events/kv_share.c does the work; this file
 * hosts it in nginx).
 *
 * nginx worker processes never talk to NATS: ngx_http_kvroute_share_push
 * appends a decision's blocks to the zone's ring (src/index/kv_dring.c),
 * which drops and counts what does not fit. The helper, in the cache
 * manager process like kvroute_events' (a path with a manager callback),
 * claims the ring, drains it into batched messages and applies the other
 * instances' to this zone: their decisions into the approximate index (or
 * the pending index, in events mode), their load into the load table.
 */


#include "ngx_http_kvroute.h"
#include "kv_clock.h"
#include "kv_share.h"
#include "kv_ingest.h"

#include <sys/random.h>


#define NGX_HTTP_KVROUTE_SHARE_CHUNKS  4     /* ring records per decision */


typedef struct {
    kv_share_config_t           cfg;
    ngx_http_kvroute_zone_t    *zone;
    ngx_path_t                 *path;
    kv_share_t                 *share;
    ngx_uint_t                  ring;       /* records */
    ngx_uint_t                  batch;      /* records per message */
    ngx_uint_t                  failed;
} ngx_http_kvroute_share_conf_t;


#define NGX_HTTP_KVROUTE_SH_OFF(field)                                        \
    offsetof(ngx_http_kvroute_share_conf_t, field)

static ngx_http_kvroute_param_t  ngx_http_kvroute_share_params[] = {
    { ngx_string("lease="), NGX_HTTP_KVROUTE_P_MS32,
      NGX_HTTP_KVROUTE_SH_OFF(cfg.lease_ms), 1, 3600000, NULL },
    { ngx_string("interval="), NGX_HTTP_KVROUTE_P_MS32,
      NGX_HTTP_KVROUTE_SH_OFF(cfg.interval_ms), 1, 3600000, NULL },
    { ngx_string("batch="), NGX_HTTP_KVROUTE_P_UINT,
      NGX_HTTP_KVROUTE_SH_OFF(batch), 1, 64, NULL },
    { ngx_string("ring="), NGX_HTTP_KVROUTE_P_UINT,
      NGX_HTTP_KVROUTE_SH_OFF(ring), 16, 1048576, NULL },
    { ngx_null_string, 0, 0, 0, 0, NULL }
};


static ngx_msec_t ngx_http_kvroute_share_manager(void *data);


/*
 * kvroute_share nats://h:p[,...] [zone=NAME] [prefix=P] [subject=S]
 *     [lease=T] [interval=T] [batch=N] [ring=N] [user=U password=P |
 *     token=T] [path=DIR];
 */

char *
ngx_http_kvroute_share_directive(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf)
{
    ngx_str_t                       *value, s, path;
    ngx_int_t                        rc;
    ngx_uint_t                       i;
    ngx_http_kvroute_zone_t         *zone;
    ngx_http_kvroute_srv_conf_t     *kcf;
    ngx_http_kvroute_share_conf_t   *sc;

    value = cf->args->elts;
    zone = NULL;
    ngx_str_null(&path);

    sc = ngx_pcalloc(cf->pool, sizeof(ngx_http_kvroute_share_conf_t));
    if (sc == NULL) {
        return NGX_CONF_ERROR;
    }

    sc->ring = 1024;

    if (cf->cmd_type == NGX_HTTP_UPS_CONF) {
        kcf = conf;
        if (kcf->zone == NULL) {
            return "needs a preceding \"kvroute zone=NAME\" in this upstream";
        }
        zone = kcf->zone;
    }

    if (ngx_strncmp(value[1].data, "nats://", 7) != 0) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "invalid NATS URL \"%V\" in \"kvroute_share\": "
                           "expected nats://host:port[,...]", &value[1]);
        return NGX_CONF_ERROR;
    }

    if (ngx_http_kvroute_param_cstr(cf, &value[1], &sc->cfg.servers)
        != NGX_CONF_OK)
    {
        return NGX_CONF_ERROR;
    }

#define KV_STR(lit, field)                                                    \
    if (ngx_http_kvroute_param_is(&value[i], lit, &s)) {                      \
        if (ngx_http_kvroute_param_cstr(cf, &s, &sc->cfg.field)              \
            != NGX_CONF_OK)                                                   \
        {                                                                     \
            return NGX_CONF_ERROR;                                            \
        }                                                                     \
        continue;                                                             \
    }

    for (i = 2; i < cf->args->nelts; i++) {

        rc = ngx_http_kvroute_param_set(cf, "kvroute_share",
                                        ngx_http_kvroute_share_params, sc,
                                        &value[i]);
        if (rc == NGX_ERROR) {
            return NGX_CONF_ERROR;
        }

        if (rc == NGX_OK) {
            continue;
        }

        if (ngx_http_kvroute_param_is(&value[i], "zone=", &s)) {
            if (cf->cmd_type == NGX_HTTP_UPS_CONF) {
                return "takes no zone= inside an upstream";
            }
            zone = ngx_http_kvroute_zone_find(cf, &s);
            if (zone == NULL) {
                return NGX_CONF_ERROR;
            }
            continue;
        }

        KV_STR("prefix=", prefix)
        KV_STR("subject=", subject)
        KV_STR("user=", user)
        KV_STR("password=", password)
        KV_STR("token=", token)

        if (ngx_http_kvroute_param_is(&value[i], "path=", &s)) {
            path = s;
            continue;
        }

        goto invalid;
    }

#undef KV_STR

    if (sc->batch) {
        sc->cfg.max_records = (uint32_t) sc->batch;
    }

    if (zone == NULL) {
        return "needs zone=NAME at http level";
    }

    if (zone->share_conf) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "zone \"%V\" already has a \"kvroute_share\"",
                           &zone->name);
        return NGX_CONF_ERROR;
    }

    if (sc->cfg.token && sc->cfg.user) {
        return "takes one of user=/password= or token=";
    }

    sc->zone = zone;
    zone->share_conf = sc;

    /* the cache manager process hosts the helper: a path with a manager */

    return ngx_http_kvroute_manager_path(cf, "kvroute_share_", zone, path,
                                         ngx_http_kvroute_share_manager, sc,
                                         &sc->path);

invalid:

    ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                       "invalid parameter \"%V\" in \"kvroute_share\"",
                       &value[i]);
    return NGX_CONF_ERROR;
}


/* What the ring adds to the zone's size. */

size_t
ngx_http_kvroute_share_size(ngx_http_kvroute_zone_t *zone)
{
    ngx_http_kvroute_share_conf_t  *sc = zone->share_conf;

    return sc ? kv_dring_size((uint32_t) sc->ring) : 0;
}


/* The zone's ring, carved before the index (which takes the rest). */

ngx_int_t
ngx_http_kvroute_share_zone(ngx_http_kvroute_zone_t *zone,
    ngx_slab_pool_t *shpool, ngx_log_t *log)
{
    size_t                          size;
    ngx_http_kvroute_sh_t          *sh = zone->sh;
    ngx_http_kvroute_share_conf_t  *sc = zone->share_conf;

    if (sc == NULL) {
        sh->share = NULL;
        return NGX_OK;
    }

    size = kv_dring_size((uint32_t) sc->ring);

    if (sh->share_region && sh->share_size == size) {
        sh->share = kv_dring_init(sh->share_region, size, (uint32_t) sc->ring, 1);
        return NGX_OK;
    }

    sh->share_region = ngx_slab_alloc(shpool, size);
    if (sh->share_region == NULL) {
        /* a reload into a zone the index already fills */
        ngx_log_error(NGX_LOG_WARN, log, 0, "kvroute_zone \"%V\": no room for "
                      "kvroute_share's ring of %ui records (%uzk): decisions "
                      "are not shared until the zone is recreated",
                      &zone->name, sc->ring, size / 1024 + 1);
        sh->share = NULL;
        return NGX_OK;
    }

    sh->share_size = size;
    sh->share = kv_dring_init(sh->share_region, size, (uint32_t) sc->ring, 0);

    return NGX_OK;
}


/* A worker process: this decision's blocks, for the other instances. */

void
ngx_http_kvroute_share_push(ngx_http_kvroute_zone_t *zone, uint64_t worker_id,
    const uint64_t *seq, size_t from, size_t n)
{
    size_t          start, k, c;
    kv_dring_rec_t  rec;

    if (zone->sh->share == NULL || from >= n) {
        return;
    }

    /* chunks after the first repeat their parent as seq[0] */
    start = from ? from - 1 : 0;

    for (c = 0; c < NGX_HTTP_KVROUTE_SHARE_CHUNKS && start + 1 < n + (start == 0);
         c++)
    {
        k = ngx_min(n - start, (size_t) KV_DRING_HASHES);

        rec.worker_id = worker_id;
        rec.first = (uint32_t) start;
        rec.n = (uint32_t) k;
        ngx_memcpy(rec.seq, seq + start, k * sizeof(uint64_t));

        if (kv_dring_push(zone->sh->share, &rec) != 0) {
            return;     /* full: dropped, counted */
        }

        start += k - 1;

        if (start + 1 >= n) {
            break;
        }
    }
}


/* A worker process: which server made a Responses API response, for the
 * other instances (a response record, kv_share.h). */

void
ngx_http_kvroute_share_response(ngx_http_kvroute_zone_t *zone,
    uint64_t worker_id, uint64_t key)
{
    kv_dring_rec_t  rec;

    if (zone->sh->share == NULL) {
        return;
    }

    rec.worker_id = worker_id;
    rec.first = KV_SHARE_RESPONSE;
    rec.n = 1;
    rec.seq[0] = key;

    (void) kv_dring_push(zone->sh->share, &rec);    /* full: dropped, counted */
}


/* The helper, on a cnats thread: a response another instance passed on. */

static void
ngx_http_kvroute_share_resp(void *arg, uint64_t worker_id, uint64_t key)
{
    ngx_http_kvroute_zone_t  *zone = arg;

    if (zone->sh->responses) {
        (void) kv_respmap_put(zone->sh->responses, key, worker_id);
    }
}


/* The helper, on a cnats thread: another instance's decision. */

static void
ngx_http_kvroute_share_blocks(void *arg, uint64_t worker_id,
    const uint64_t *seq, uint32_t first, uint32_t n)
{
    int                       slot;
    kv_index_t               *ix;
    ngx_http_kvroute_zone_t  *zone = arg;

    ix = zone->sh->approximate ? zone->sh->index : zone->sh->pending;

    if (ix == NULL) {
        return;
    }

    ngx_shmtx_lock(&zone->shpool->mutex);

    slot = kv_index_worker_add(ix, worker_id, 0);
    if (slot >= 0) {
        kv_index_record_at(ix, slot, seq, first ? 1 : 0, n,
                           (uint64_t) ngx_current_msec);
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);
}


static int
ngx_http_kvroute_share_alive(int64_t pid)
{
    return kill((pid_t) pid, 0) == 0 || ngx_errno != NGX_ESRCH;
}


static uint64_t
ngx_http_kvroute_share_instance(void)
{
    uint64_t  id = 0;

    if (getrandom(&id, sizeof(id), 0) != (ssize_t) sizeof(id) || id == 0) {
        id = ((uint64_t) ngx_pid << 32) ^ (uint64_t) ngx_time()
             ^ (uint64_t) (uintptr_t) &id;
    }

    return id ? id : 1;
}


static ngx_msec_t
ngx_http_kvroute_share_manager(void *data)
{
    int                             row;
    char                            err[256];
    kv_dring_t                     *ring;
    ngx_http_kvroute_zone_t        *zone;
    ngx_http_kvroute_share_conf_t  *sc = data;

    zone = sc->zone;
    ring = zone->sh->share;

    if (ring == NULL) {
        return 5000;
    }

    if (sc->share == NULL) {
        /* one consumer: a reload's new helper waits for the old one */
        if (kv_dring_claim(ring, ngx_pid, ngx_http_kvroute_share_alive) != 0) {
            return 100;
        }

        /* other instances' load goes through a row of this process, so
         * that it leaves the totals with it if it dies */
        row = kv_load_claim_row(zone->sh->load, ngx_pid);
        if (row < 0) {
            if (!sc->failed++) {
                ngx_log_error(NGX_LOG_ALERT, ngx_cycle->log, 0,
                              "kvroute_share \"%V\": no free load row",
                              &zone->name);
            }
            kv_dring_unclaim(ring, ngx_pid);
            return 5000;
        }

        sc->cfg.instance_id = ngx_http_kvroute_share_instance();
        sc->cfg.on_blocks = ngx_http_kvroute_share_blocks;
        sc->cfg.on_response = ngx_http_kvroute_share_resp;
        sc->cfg.arg = zone;

        sc->share = kv_share_create(&sc->cfg, ring, zone->sh->load, row,
                                    err, sizeof(err));

        if (sc->share && kv_share_start(sc->share, err, sizeof(err)) != 0) {
            kv_share_destroy(sc->share);
            sc->share = NULL;
        }

        if (sc->share == NULL) {
            if (!sc->failed++) {
                ngx_log_error(NGX_LOG_ALERT, ngx_cycle->log, 0,
                              "kvroute_share \"%V\": %s", &zone->name, err);
            }
            kv_dring_unclaim(ring, ngx_pid);
            return 5000;
        }

        kv_ingest_redact(sc->cfg.servers, err, sizeof(err));

        ngx_log_error(NGX_LOG_NOTICE, ngx_cycle->log, 0,
                      "kvroute_share \"%V\": helper pid %P, instance %016uxL, "
                      "sharing over %s", &zone->name, ngx_pid,
                      sc->cfg.instance_id, err);
    }

    kv_share_tick(sc->share, kv_clock_ms());

    return sc->cfg.interval_ms ? ngx_min(sc->cfg.interval_ms, 100) : 20;
}
