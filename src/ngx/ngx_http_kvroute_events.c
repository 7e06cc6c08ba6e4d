
/*
 * Copyright (C) kvroute authors
 *
 * kvroute_events: the helper process that keeps a zone's prefix index in
 * step with the KV events workers publish over NATS (src/events/kv_ingest.c
 * does the work; this file hosts it in nginx).
 *
 * The helper lives in the cache manager process: a path registered with a
 * manager callback makes the nginx master start that process after
 * daemonizing, as its own child, restart it if it dies and replace it on
 * reload. The first callback takes the zone registry's writer lease (a
 * reload's new helper waits until the old one has exited) and starts the
 * ingester; every later one ticks it. With master_process off there is no
 * cache manager, so the single process runs the ingester on a timer.
 */


#include "ngx_http_kvroute.h"
#include "kv_ingest.h"

#include <pthread.h>


typedef struct {
    kv_ingest_config_t          cfg;
    ngx_http_kvroute_zone_t    *zone;
    ngx_path_t                 *path;
    kv_ingest_t                *ingest;
    uint32_t                    lease_gen;
    ngx_uint_t                  waiting_logged;
} ngx_http_kvroute_events_t;


static ngx_msec_t ngx_http_kvroute_events_manager(void *data);
static void ngx_http_kvroute_events_drop(void *arg, uint64_t worker_id,
    const uint64_t *seq, size_t n);
static void ngx_http_kvroute_events_single_timer(ngx_event_t *ev);


static char *
ngx_http_kvroute_events_str(ngx_conf_t *cf, ngx_str_t *s, const char **out)
{
    u_char  *p;

    p = ngx_pnalloc(cf->pool, s->len + 1);
    if (p == NULL) {
        return NGX_CONF_ERROR;
    }

    ngx_memcpy(p, s->data, s->len);
    p[s->len] = '\0';
    *out = (const char *) p;

    return NGX_CONF_OK;
}


static char *
ngx_http_kvroute_events_ms(ngx_conf_t *cf, ngx_str_t *v, ngx_str_t *s,
    uint32_t *out)
{
    ngx_msec_t  ms;

    ms = ngx_parse_time(s, 0);
    if (ms == (ngx_msec_t) NGX_ERROR || ms == 0) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "invalid \"%V\" in \"kvroute_events\"", v);
        return NGX_CONF_ERROR;
    }

    *out = (uint32_t) ms;

    return NGX_CONF_OK;
}


/*
 * kvroute_events nats://h:p[,...] [zone=NAME] [subject=S] [prefix=P]
 *     [jetstream=STREAM durable=NAME] [user=U password=P | token=T |
 *     creds=FILE] [tls=on] [tls_ca=F] [tls_cert=F] [tls_key=F]
 *     [tls_verify=off] [heartbeat_timeout=T] [stale_lag=T] [dump_timeout=T]
 *     [path=DIR];
 *
 * At http level it needs zone=; inside an upstream it feeds the zone of
 * that upstream's kvroute line, which must come first.
 */

char *
ngx_http_kvroute_events_directive(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf)
{
    ngx_str_t                     *value, s, name, path;
    ngx_uint_t                     i;
    ngx_http_kvroute_events_t     *ev;
    ngx_http_kvroute_srv_conf_t   *kcf;
    ngx_http_kvroute_zone_t       *zone;
    kv_ingest_config_t            *c;

    value = cf->args->elts;

    ev = ngx_pcalloc(cf->pool, sizeof(ngx_http_kvroute_events_t));
    if (ev == NULL) {
        return NGX_CONF_ERROR;
    }

    c = &ev->cfg;
    zone = NULL;
    ngx_str_null(&path);

    if (cf->cmd_type == NGX_HTTP_UPS_CONF) {
        kcf = conf;

        if (kcf->zone == NULL) {
            return "needs a preceding \"kvroute zone=NAME\" in this upstream";
        }

        zone = kcf->zone;
    }

    if (ngx_strncmp(value[1].data, "nats://", 7) != 0
        && ngx_strncmp(value[1].data, "tls://", 6) != 0)
    {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "invalid NATS URL \"%V\" in \"kvroute_events\": "
                           "expected nats://host:port[,...]", &value[1]);
        return NGX_CONF_ERROR;
    }

    if (ngx_http_kvroute_events_str(cf, &value[1], &c->servers)
        != NGX_CONF_OK)
    {
        return NGX_CONF_ERROR;
    }

#define KV_PARAM(lit)                                                       \
    (value[i].len > sizeof(lit) - 1                                         \
     && ngx_strncmp(value[i].data, lit, sizeof(lit) - 1) == 0               \
     && (s.data = value[i].data + sizeof(lit) - 1,                          \
         s.len = value[i].len - (sizeof(lit) - 1), 1))

#define KV_STR(lit, field)                                                  \
    if (KV_PARAM(lit)) {                                                    \
        if (ngx_http_kvroute_events_str(cf, &s, &c->field) != NGX_CONF_OK) { \
            return NGX_CONF_ERROR;                                          \
        }                                                                   \
        continue;                                                           \
    }

    for (i = 2; i < cf->args->nelts; i++) {

        if (KV_PARAM("zone=")) {
            if (cf->cmd_type == NGX_HTTP_UPS_CONF) {
                return "takes no zone= inside an upstream";
            }

            zone = ngx_http_kvroute_zone_find(cf, &s);
            if (zone == NULL) {
                return NGX_CONF_ERROR;
            }
            continue;
        }

        KV_STR("subject=", event_subject)
        KV_STR("prefix=", prefix)
        KV_STR("jetstream=", stream)
        KV_STR("durable=", durable)
        KV_STR("user=", user)
        KV_STR("password=", password)
        KV_STR("token=", token)
        KV_STR("creds=", creds)
        KV_STR("tls_ca=", tls_ca)
        KV_STR("tls_cert=", tls_cert)
        KV_STR("tls_key=", tls_key)

        if (KV_PARAM("tls=")) {
            c->tls = (s.len == 2 && ngx_strncmp(s.data, "on", 2) == 0);
            continue;
        }

        if (KV_PARAM("tls_verify=")) {
            c->tls_no_verify = (s.len == 3 && ngx_strncmp(s.data, "off", 3) == 0);
            continue;
        }

        if (KV_PARAM("heartbeat_timeout=")) {
            if (ngx_http_kvroute_events_ms(cf, &value[i], &s,
                                           &c->heartbeat_timeout_ms)
                != NGX_CONF_OK)
            {
                return NGX_CONF_ERROR;
            }
            continue;
        }

        if (KV_PARAM("stale_lag=")) {
            if (ngx_http_kvroute_events_ms(cf, &value[i], &s, &c->stale_lag_ms)
                != NGX_CONF_OK)
            {
                return NGX_CONF_ERROR;
            }
            continue;
        }

        if (KV_PARAM("dump_timeout=")) {
            if (ngx_http_kvroute_events_ms(cf, &value[i], &s,
                                           &c->dump_timeout_ms)
                != NGX_CONF_OK)
            {
                return NGX_CONF_ERROR;
            }
            continue;
        }

        if (KV_PARAM("path=")) {
            path = s;
            continue;
        }

        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "invalid parameter \"%V\" in \"kvroute_events\"",
                           &value[i]);
        return NGX_CONF_ERROR;
    }

#undef KV_STR
#undef KV_PARAM

    if (zone == NULL) {
        return "needs zone=NAME at http level";
    }

    if (zone->events_conf) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "zone \"%V\" already has a \"kvroute_events\"",
                           &zone->name);
        return NGX_CONF_ERROR;
    }

    if ((c->stream == NULL) != (c->durable == NULL)) {
        return "needs both jetstream=STREAM and durable=NAME, or neither";
    }

    if (c->token && (c->user || c->creds)) {
        return "takes one of user=/password=, token= or creds=";
    }

    ev->zone = zone;
    zone->events_conf = ev;
    zone->approximate = 0;

    /* the cache manager process exists when some path has a manager */

    ev->path = ngx_pcalloc(cf->pool, sizeof(ngx_path_t));
    if (ev->path == NULL) {
        return NGX_CONF_ERROR;
    }

    if (path.len == 0) {
        name.len = sizeof("kvroute_") - 1 + zone->name.len;
        name.data = ngx_pnalloc(cf->pool, name.len);
        if (name.data == NULL) {
            return NGX_CONF_ERROR;
        }
        ngx_sprintf(name.data, "kvroute_%V", &zone->name);
        path = name;
    }

    ev->path->name = path;

    if (ngx_conf_full_name(cf->cycle, &ev->path->name, 0) != NGX_OK) {
        return NGX_CONF_ERROR;
    }

    ev->path->manager = ngx_http_kvroute_events_manager;
    ev->path->data = ev;
    ev->path->conf_file = cf->conf_file->file.name.data;
    ev->path->line = cf->conf_file->line;

    if (ngx_add_path(cf, &ev->path) != NGX_OK) {
        return NGX_CONF_ERROR;
    }

    return NGX_CONF_OK;
}


/* Starts the ingester once this process holds the registry lease. */

static ngx_int_t
ngx_http_kvroute_events_start(ngx_http_kvroute_events_t *ev, ngx_log_t *log)
{
    char                    err[256];
    sigset_t                all, old;
    kv_registry_t          *reg = ev->zone->sh->registry;

    if (kv_registry_lease_acquire(reg, ngx_pid, &ev->lease_gen) != 0) {
        if (!ev->waiting_logged) {
            ngx_log_error(NGX_LOG_NOTICE, log, 0,
                          "kvroute_events \"%V\": waiting for the previous "
                          "helper (pid %P) to exit", &ev->zone->name,
                          kv_registry_lease_owner(reg, NULL));
            ev->waiting_logged = 1;
        }
        return NGX_AGAIN;
    }

    ev->cfg.on_drop = ngx_http_kvroute_events_drop;
    ev->cfg.on_drop_arg = ev->zone;

    ev->ingest = kv_ingest_create(&ev->cfg, ev->zone->sh->index, reg,
                                  err, sizeof(err));
    if (ev->ingest == NULL) {
        ngx_log_error(NGX_LOG_ALERT, log, 0, "kvroute_events \"%V\": %s",
                      &ev->zone->name, err);
        kv_registry_lease_release(reg, ngx_pid, ev->lease_gen);
        return NGX_ERROR;
    }

    /* cnats threads must not take nginx's signals: they inherit this mask */

    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);

    if (kv_ingest_start(ev->ingest, err, sizeof(err)) != 0) {
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        ngx_log_error(NGX_LOG_ALERT, log, 0, "kvroute_events \"%V\": %s",
                      &ev->zone->name, err);
        kv_ingest_destroy(ev->ingest);
        ev->ingest = NULL;
        kv_registry_lease_release(reg, ngx_pid, ev->lease_gen);
        return NGX_ERROR;
    }

    pthread_sigmask(SIG_SETMASK, &old, NULL);

    ngx_log_error(NGX_LOG_NOTICE, log, 0,
                  "kvroute_events \"%V\": helper pid %P ingesting from %s",
                  &ev->zone->name, ngx_pid, ev->cfg.servers);

    return NGX_OK;
}


static ngx_msec_t
ngx_http_kvroute_events_manager(void *data)
{
    ngx_http_kvroute_events_t  *ev = data;

    if (ev->ingest == NULL) {
        if (ngx_http_kvroute_events_start(ev, ngx_cycle->log) == NGX_ERROR) {
            return 5000;
        }

        if (ev->ingest == NULL) {
            return 50;
        }
    }

    if (!kv_registry_lease_held(ev->zone->sh->registry, ngx_pid,
                                ev->lease_gen))
    {
        ngx_log_error(NGX_LOG_ALERT, ngx_cycle->log, 0,
                      "kvroute_events \"%V\": lost the writer lease, "
                      "stopping", &ev->zone->name);
        kv_ingest_stop(ev->ingest);
        kv_ingest_destroy(ev->ingest);
        ev->ingest = NULL;
        return 1000;
    }

    kv_ingest_tick(ev->ingest, kv_ingest_now_ms());

    return 100;
}


/* master_process off: this process is the helper too. */

static ngx_event_t  ngx_http_kvroute_single_ev;


ngx_int_t
ngx_http_kvroute_events_init_single(ngx_cycle_t *cycle,
    ngx_http_kvroute_zone_t *zone)
{
    ngx_event_t  *t;

    if (ngx_process != NGX_PROCESS_SINGLE || zone->events_conf == NULL) {
        return NGX_OK;
    }

    /* one timer drives every zone's ingester (rarely more than one) */

    t = &ngx_http_kvroute_single_ev;

    if (t->handler == NULL) {
        t->handler = ngx_http_kvroute_events_single_timer;
        t->log = cycle->log;
        t->data = cycle;
        t->cancelable = 1;
        ngx_add_timer(t, 1);
    }

    return NGX_OK;
}


static void
ngx_http_kvroute_events_single_timer(ngx_event_t *t)
{
    ngx_msec_t                     n, next;
    ngx_uint_t                     i;
    ngx_http_kvroute_zone_t      **zones;
    ngx_http_kvroute_main_conf_t  *kmcf;

    kmcf = ngx_http_cycle_get_module_main_conf(ngx_cycle,
                                               ngx_http_kvroute_module);
    zones = kmcf->zones.elts;
    next = 1000;

    for (i = 0; i < kmcf->zones.nelts; i++) {
        if (zones[i]->events_conf) {
            n = ngx_http_kvroute_events_manager(zones[i]->events_conf);
            next = ngx_min(n, next);
        }
    }

    if (!ngx_exiting) {
        ngx_add_timer(t, next);
    }
}


void
ngx_http_kvroute_events_exit_single(ngx_http_kvroute_zone_t *zone)
{
    ngx_http_kvroute_events_t  *ev = zone->events_conf;

    if (ev == NULL || ev->ingest == NULL) {
        return;
    }

    kv_ingest_stop(ev->ingest);
    kv_ingest_destroy(ev->ingest);
    ev->ingest = NULL;
    kv_registry_lease_release(zone->sh->registry, ngx_pid, ev->lease_gen);
}


/*
 * A worker's own events win over the router's guesses: blocks it reports
 * Removed (or all of them: Cleared, a resync, gone) leave the pending index
 * too, instead of being credited to it until the pending TTL. Runs in the
 * helper, on a cnats thread; the slab mutex serialises it with the nginx
 * workers recording decisions.
 */

static void
ngx_http_kvroute_events_drop(void *arg, uint64_t worker_id,
    const uint64_t *seq, size_t n)
{
    int                       slot;
    kv_index_t               *ix;
    ngx_http_kvroute_zone_t  *zone = arg;

    ix = zone->sh->pending;

    if (ix == NULL) {
        return;
    }

    ngx_shmtx_lock(&zone->shpool->mutex);

    if (n == 0) {
        kv_index_worker_clear(ix, worker_id);

    } else {
        slot = kv_index_worker_find(ix, worker_id, 0);

        if (slot >= 0) {
            kv_index_forget(ix, (uint32_t) slot, seq, n);
        }
    }

    ngx_shmtx_unlock(&zone->shpool->mutex);
}
