
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
#include "kv_zmq.h"

#include <pthread.h>


/* One "kvroute_events zmq://..." line: a publisher, or a pattern that
 * names one per server of its upstream ($host, $port, $port+N). */
typedef struct {
    ngx_str_t                       endpoint;
    ngx_str_t                       replay;
    ngx_str_t                       server;     /* empty: the pattern form */
    ngx_str_t                       topic;
    ngx_http_upstream_srv_conf_t   *uscf;       /* the pattern's upstream */
} ngx_http_kvroute_zmq_line_t;


typedef struct {
    kv_ingest_config_t          cfg;
    ngx_http_kvroute_zone_t    *zone;
    ngx_path_t                 *path;
    kv_ingest_t                *ingest;
    uint32_t                    lease_gen;
    ngx_uint_t                  waiting_logged;

    /* ZMQ (vLLM / SGLang publishers) instead of NATS */
    ngx_uint_t                  zmq;
    ngx_array_t                 zmq_lines;  /* ngx_http_kvroute_zmq_line_t */
    ngx_msec_t                  replay_timeout;
    kv_zmq_t                   *zmq_ingest;
} ngx_http_kvroute_events_t;


static ngx_msec_t ngx_http_kvroute_events_manager(void *data);
static void ngx_http_kvroute_events_drop(void *arg, uint64_t worker_id,
    const uint64_t *seq, size_t n);
static void ngx_http_kvroute_events_single_timer(ngx_event_t *ev);
static char *ngx_http_kvroute_events_zmq_directive(ngx_conf_t *cf,
    ngx_http_kvroute_zone_t *zone, ngx_http_kvroute_events_t *ev);
static char *ngx_http_kvroute_events_add_path(ngx_conf_t *cf,
    ngx_http_kvroute_events_t *ev, ngx_str_t path);
static ngx_int_t ngx_http_kvroute_events_zmq_start(
    ngx_http_kvroute_events_t *ev, ngx_log_t *log);


/* the parameters of "kvroute_events" that set one field: NATS, into its
 * kv_ingest_config_t; ZMQ, the replay timeout */

#define NGX_HTTP_KVROUTE_EV_OFF(field)  offsetof(kv_ingest_config_t, field)

static ngx_http_kvroute_param_t  ngx_http_kvroute_events_params[] = {
    { ngx_string("heartbeat_timeout="), NGX_HTTP_KVROUTE_P_MS32,
      NGX_HTTP_KVROUTE_EV_OFF(heartbeat_timeout_ms), 1, UINT32_MAX, NULL },
    { ngx_string("stale_lag="), NGX_HTTP_KVROUTE_P_MS32,
      NGX_HTTP_KVROUTE_EV_OFF(stale_lag_ms), 1, UINT32_MAX, NULL },
    { ngx_string("dump_timeout="), NGX_HTTP_KVROUTE_P_MS32,
      NGX_HTTP_KVROUTE_EV_OFF(dump_timeout_ms), 1, UINT32_MAX, NULL },
    { ngx_null_string, 0, 0, 0, 0, NULL }
};

static ngx_http_kvroute_param_t  ngx_http_kvroute_zmq_params[] = {
    { ngx_string("replay_timeout="), NGX_HTTP_KVROUTE_P_MSEC, 0, 1, 1e15,
      NULL },
    { ngx_null_string, 0, 0, 0, 0, NULL }
};


/* zone=NAME: at http level only (inside an upstream, the zone is that
 * upstream's) */

static char *
ngx_http_kvroute_events_zone(ngx_conf_t *cf, ngx_str_t *name,
    ngx_http_kvroute_zone_t **zone)
{
    if (cf->cmd_type == NGX_HTTP_UPS_CONF) {
        return "takes no zone= inside an upstream";
    }

    *zone = ngx_http_kvroute_zone_find(cf, name);

    return *zone ? NGX_CONF_OK : NGX_CONF_ERROR;
}


/*
 * kvroute_events nats://h:p[,...] [zone=NAME] [subject=S] [prefix=P]
 *     [jetstream=STREAM durable=NAME] [user=U password=P | token=T |
 *     creds=FILE] [tls=on] [tls_ca=F] [tls_cert=F] [tls_key=F]
 *     [tls_verify=off] [heartbeat_timeout=T] [stale_lag=T] [dump_timeout=T]
 *     [subjects=per-worker|any] [path=DIR];
 *
 * At http level it needs zone=; inside an upstream it feeds the zone of
 * that upstream's kvroute line, which must come first.
 */

char *
ngx_http_kvroute_events_directive(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf)
{
    char                          *rv;
    ngx_int_t                      rc;
    ngx_str_t                     *value, s, path;
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

    if (ngx_http_kvroute_has_prefix(&value[1], "zmq://")
        || ngx_http_kvroute_has_prefix(&value[1], "tcp://")
        || ngx_http_kvroute_has_prefix(&value[1], "ipc://"))
    {
        return ngx_http_kvroute_events_zmq_directive(cf, zone, ev);
    }

    if (!ngx_http_kvroute_has_prefix(&value[1], "nats://")
        && !ngx_http_kvroute_has_prefix(&value[1], "tls://"))
    {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "invalid NATS URL \"%V\" in \"kvroute_events\": "
                           "expected nats://host:port[,...] (or zmq://host:port "
                           "for vLLM / SGLang publishers)", &value[1]);
        return NGX_CONF_ERROR;
    }

    if (ngx_http_kvroute_param_cstr(cf, &value[1], &c->servers)
        != NGX_CONF_OK)
    {
        return NGX_CONF_ERROR;
    }

#define KV_STR(lit, field)                                                  \
    if (ngx_http_kvroute_param_is(&value[i], lit, &s)) {                    \
        if (ngx_http_kvroute_param_cstr(cf, &s, &c->field) != NGX_CONF_OK) { \
            return NGX_CONF_ERROR;                                          \
        }                                                                   \
        continue;                                                           \
    }

    for (i = 2; i < cf->args->nelts; i++) {

        rc = ngx_http_kvroute_param_set(cf, "kvroute_events",
                                        ngx_http_kvroute_events_params, c,
                                        &value[i]);

        if (rc == NGX_ERROR) {
            return NGX_CONF_ERROR;
        }

        if (rc == NGX_OK) {
            continue;
        }

        if (ngx_http_kvroute_param_is(&value[i], "zone=", &s)) {
            rv = ngx_http_kvroute_events_zone(cf, &s, &zone);
            if (rv != NGX_CONF_OK) {
                return rv;
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

        if (ngx_http_kvroute_param_is(&value[i], "tls=", &s)) {
            c->tls = ngx_http_kvroute_str_is(&s, "on");
            continue;
        }

        if (ngx_http_kvroute_param_is(&value[i], "subjects=", &s)) {
            if (ngx_http_kvroute_str_is(&s, "per-worker")) {
                c->per_worker_only = 1;
            } else if (!ngx_http_kvroute_str_is(&s, "any")) {
                return "takes subjects=per-worker or subjects=any";
            }
            continue;
        }

        if (ngx_http_kvroute_param_is(&value[i], "tls_verify=", &s)) {
            c->tls_no_verify = ngx_http_kvroute_str_is(&s, "off");
            continue;
        }

        if (ngx_http_kvroute_param_is(&value[i], "path=", &s)) {
            path = s;
            continue;
        }

        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "invalid parameter \"%V\" in \"kvroute_events\"",
                           &value[i]);
        return NGX_CONF_ERROR;
    }

#undef KV_STR

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

    return ngx_http_kvroute_events_add_path(cf, ev, path);
}


static char *
ngx_http_kvroute_events_add_path(ngx_conf_t *cf, ngx_http_kvroute_events_t *ev,
    ngx_str_t path)
{
    return ngx_http_kvroute_manager_path(cf, "kvroute_", ev->zone, path,
                                         ngx_http_kvroute_events_manager, ev,
                                         &ev->path);
}


/*
 * The cache manager process exists when some path has a manager: each
 * helper (kvroute_events', kvroute_share's) adds one whose manager callback
 * is its loop, named PREFIX + the zone's name unless path= names it.
 */

char *
ngx_http_kvroute_manager_path(ngx_conf_t *cf, const char *prefix,
    ngx_http_kvroute_zone_t *zone, ngx_str_t path, ngx_path_manager_pt manager,
    void *data, ngx_path_t **pp)
{
    size_t       len;
    ngx_str_t    name;
    ngx_path_t  *p;

    p = ngx_pcalloc(cf->pool, sizeof(ngx_path_t));
    if (p == NULL) {
        return NGX_CONF_ERROR;
    }

    if (path.len == 0) {
        len = ngx_strlen(prefix);
        name.len = len + zone->name.len;
        name.data = ngx_pnalloc(cf->pool, name.len);
        if (name.data == NULL) {
            return NGX_CONF_ERROR;
        }
        ngx_sprintf(name.data, "%s%V", prefix, &zone->name);
        path = name;
    }

    p->name = path;

    if (ngx_conf_full_name(cf->cycle, &p->name, 0) != NGX_OK) {
        return NGX_CONF_ERROR;
    }

    p->manager = manager;
    p->data = data;
    p->conf_file = cf->conf_file->file.name.data;
    p->line = cf->conf_file->line;

    *pp = p;

    if (ngx_add_path(cf, pp) != NGX_OK) {
        return NGX_CONF_ERROR;
    }

    return NGX_CONF_OK;
}


/*
 * One helper at a time applies events to a zone: the registry lease says
 * which. A reload's new helper waits here until the old one has exited.
 */

static ngx_int_t
ngx_http_kvroute_events_take_lease(ngx_http_kvroute_events_t *ev,
    ngx_log_t *log)
{
    kv_registry_t  *reg = ev->zone->sh->registry;

    if (kv_registry_lease_acquire(reg, ngx_pid, &ev->lease_gen) == 0) {
        return NGX_OK;
    }

    if (!ev->waiting_logged) {
        ngx_log_error(NGX_LOG_NOTICE, log, 0,
                      "kvroute_events \"%V\": waiting for the previous "
                      "helper (pid %P) to exit", &ev->zone->name,
                      kv_registry_lease_owner(reg, NULL));
        ev->waiting_logged = 1;
    }

    return NGX_AGAIN;
}


/* A start that failed: say why and give the lease back. */

static ngx_int_t
ngx_http_kvroute_events_start_failed(ngx_http_kvroute_events_t *ev,
    ngx_log_t *log, const char *err)
{
    ngx_log_error(NGX_LOG_ALERT, log, 0, "kvroute_events \"%V\": %s",
                  &ev->zone->name, err);
    kv_registry_lease_release(ev->zone->sh->registry, ngx_pid, ev->lease_gen);

    return NGX_ERROR;
}


/* Starts the ingester once this process holds the registry lease. */

static ngx_int_t
ngx_http_kvroute_events_start(ngx_http_kvroute_events_t *ev, ngx_log_t *log)
{
    char                    err[256];
    kv_registry_t          *reg = ev->zone->sh->registry;

    if (ngx_http_kvroute_events_take_lease(ev, log) != NGX_OK) {
        return NGX_AGAIN;
    }

    ev->cfg.on_drop = ngx_http_kvroute_events_drop;
    ev->cfg.on_drop_arg = ev->zone;

    ev->ingest = kv_ingest_create(&ev->cfg, ev->zone->sh->index, reg,
                                  err, sizeof(err));
    if (ev->ingest == NULL) {
        return ngx_http_kvroute_events_start_failed(ev, log, err);
    }

    if (kv_ingest_start(ev->ingest, err, sizeof(err)) != 0) {
        kv_ingest_destroy(ev->ingest);
        ev->ingest = NULL;
        return ngx_http_kvroute_events_start_failed(ev, log, err);
    }

    /* credentials written in the URL never reach the log */
    kv_ingest_redact(ev->cfg.servers, err, sizeof(err));

    ngx_log_error(NGX_LOG_NOTICE, log, 0,
                  "kvroute_events \"%V\": helper pid %P ingesting from %s",
                  &ev->zone->name, ngx_pid, err);

    return NGX_OK;
}




/*
 * kvroute_events zmq://HOST:PORT [replay=zmq://HOST:PORT] [server=HOST:PORT]
 *     [topic=T] [replay_timeout=T] [zone=NAME] [path=DIR];
 *
 * One line per vLLM / SGLang publisher, naming the upstream server whose
 * engine it is. Inside an upstream, a line without server= is a pattern:
 * one publisher per server of that upstream, with $host and $port (or
 * $port+N, $port-N) in the URLs replaced by that server's (these are not
 * nginx variables: the helper substitutes them once, per server).
 */

static char *
ngx_http_kvroute_events_zmq_url(ngx_conf_t *cf, ngx_str_t *in, ngx_str_t *out)
{
    size_t   skip;
    u_char  *p;

    /* zmq:// is the operator's spelling; libzmq wants tcp:// */

    if (ngx_http_kvroute_has_prefix(in, "zmq://")) {
        skip = sizeof("zmq://") - 1;

    } else if (ngx_http_kvroute_has_prefix(in, "tcp://")
               || ngx_http_kvroute_has_prefix(in, "ipc://"))
    {
        skip = 0;

    } else {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "invalid ZMQ URL \"%V\" in \"kvroute_events\": "
                           "expected zmq://host:port", in);
        return NGX_CONF_ERROR;
    }

    out->len = in->len;
    out->data = ngx_pnalloc(cf->pool, in->len + 1);
    if (out->data == NULL) {
        return NGX_CONF_ERROR;
    }

    p = skip ? ngx_cpymem(out->data, "tcp://", skip) : out->data;
    ngx_memcpy(p, in->data + skip, in->len - skip);
    out->data[out->len] = '\0';

    return NGX_CONF_OK;
}


static char *
ngx_http_kvroute_events_zmq_directive(ngx_conf_t *cf,
    ngx_http_kvroute_zone_t *zone, ngx_http_kvroute_events_t *ev)
{
    char                          *rv;
    ngx_int_t                      rc;
    ngx_str_t                     *value, s, path;
    ngx_uint_t                     i;
    ngx_msec_t                     replay_timeout;
    ngx_http_kvroute_events_t     *cur;
    ngx_http_kvroute_zmq_line_t   *ln, line;

    value = cf->args->elts;
    ngx_memzero(&line, sizeof(line));
    ngx_str_null(&path);
    replay_timeout = 0;

    if (ngx_http_kvroute_events_zmq_url(cf, &value[1], &line.endpoint)
        != NGX_CONF_OK)
    {
        return NGX_CONF_ERROR;
    }

    for (i = 2; i < cf->args->nelts; i++) {

        /* replay_timeout=, into the local replay_timeout */

        rc = ngx_http_kvroute_param_set(cf, "kvroute_events",
                                        ngx_http_kvroute_zmq_params,
                                        &replay_timeout, &value[i]);

        if (rc == NGX_ERROR) {
            return NGX_CONF_ERROR;
        }

        if (rc == NGX_OK) {
            continue;
        }

        if (ngx_http_kvroute_param_is(&value[i], "zone=", &s)) {
            rv = ngx_http_kvroute_events_zone(cf, &s, &zone);
            if (rv != NGX_CONF_OK) {
                return rv;
            }
            continue;
        }

        if (ngx_http_kvroute_param_is(&value[i], "replay=", &s)) {
            if (ngx_http_kvroute_events_zmq_url(cf, &s, &line.replay)
                != NGX_CONF_OK)
            {
                return NGX_CONF_ERROR;
            }
            continue;
        }

        if (ngx_http_kvroute_param_is(&value[i], "server=", &s)) {
            if (s.len >= KV_REGISTRY_ADDR_MAX) {
                return "has a server= longer than 63 characters";
            }
            line.server = s;
            continue;
        }

        if (ngx_http_kvroute_param_is(&value[i], "topic=", &s)) {
            line.topic.data = ngx_pnalloc(cf->pool, s.len + 1);
            if (line.topic.data == NULL) {
                return NGX_CONF_ERROR;
            }
            ngx_memcpy(line.topic.data, s.data, s.len);
            line.topic.data[s.len] = '\0';
            line.topic.len = s.len;
            continue;
        }


        if (ngx_http_kvroute_param_is(&value[i], "path=", &s)) {
            path = s;
            continue;
        }

        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "invalid parameter \"%V\" in \"kvroute_events\" "
                           "(zmq)", &value[i]);
        return NGX_CONF_ERROR;
    }


    if (zone == NULL) {
        return "needs zone=NAME at http level";
    }

    if (line.server.len == 0) {
        if (cf->cmd_type != NGX_HTTP_UPS_CONF) {
            return "needs server=HOST:PORT at http level";
        }

        /* the pattern form: expanded per server when the helper starts */
        line.uscf = ngx_http_conf_get_module_srv_conf(cf,
                                                      ngx_http_upstream_module);
    }

    cur = zone->events_conf;

    if (cur && !cur->zmq) {
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "zone \"%V\" already takes events from NATS",
                           &zone->name);
        return NGX_CONF_ERROR;
    }

    if (cur == NULL) {
        cur = ev;
        cur->zmq = 1;
        cur->zone = zone;

        if (ngx_array_init(&cur->zmq_lines, cf->pool, 4,
                           sizeof(ngx_http_kvroute_zmq_line_t))
            != NGX_OK)
        {
            return NGX_CONF_ERROR;
        }

        zone->events_conf = cur;
        zone->approximate = 0;

        if (ngx_http_kvroute_events_add_path(cf, cur, path) != NGX_CONF_OK) {
            return NGX_CONF_ERROR;
        }
    }

    if (replay_timeout) {
        cur->replay_timeout = replay_timeout;
    }

    ln = ngx_array_push(&cur->zmq_lines);
    if (ln == NULL) {
        return NGX_CONF_ERROR;
    }

    *ln = line;

    return NGX_CONF_OK;
}


/* Replaces $host, $port, $port+N, $port-N in url by server's; NULL on a
 * bad placeholder or a server that is not host:port. */

static char *
ngx_http_kvroute_events_expand(ngx_pool_t *pool, ngx_str_t *url,
    ngx_str_t *server)
{
    u_char     *p, *end, *o, *out, *colon, *q;
    ngx_int_t   port, n;
    ngx_str_t   host;

    colon = NULL;

    for (p = server->data; p < server->data + server->len; p++) {
        if (*p == ':') {
            colon = p;      /* the last one: [::1]:8000 */
        }
    }

    if (colon == NULL) {
        return NULL;
    }

    host.data = server->data;
    host.len = colon - server->data;
    port = ngx_atoi(colon + 1, server->data + server->len - colon - 1);
    if (port == NGX_ERROR) {
        return NULL;
    }

    /* each placeholder ($host, $port: 5 bytes at least) grows by at most
     * server->len + 6 bytes */
    out = ngx_pnalloc(pool, url->len + (url->len / 5 + 1) * (server->len + 6) + 1);
    if (out == NULL) {
        return NULL;
    }

    o = out;
    p = url->data;
    end = url->data + url->len;

    while (p < end) {
        if (*p != '$') {
            *o++ = *p++;
            continue;
        }

        if (end - p >= 5 && ngx_strncmp(p, "$host", 5) == 0) {
            o = ngx_cpymem(o, host.data, host.len);
            p += 5;
            continue;
        }

        if (end - p < 5 || ngx_strncmp(p, "$port", 5) != 0) {
            return NULL;
        }

        p += 5;
        n = 0;

        if (p < end && (*p == '+' || *p == '-')) {
            for (q = p + 1; q < end && *q >= '0' && *q <= '9'; q++) {
                /* digits */
            }

            n = ngx_atoi(p + 1, q - p - 1);
            if (n == NGX_ERROR) {
                return NULL;
            }

            if (*p == '-') {
                n = -n;
            }

            p = q;
        }

        if (port + n <= 0 || port + n > 65535) {
            return NULL;
        }

        o = ngx_sprintf(o, "%i", port + n);
    }

    *o = '\0';

    return (char *) out;
}


static const char *
ngx_http_kvroute_events_cstr(ngx_pool_t *pool, ngx_str_t *s)
{
    u_char  *p;

    if (s->len == 0) {
        return NULL;
    }

    p = ngx_pnalloc(pool, s->len + 1);
    if (p == NULL) {
        return NULL;
    }

    ngx_memcpy(p, s->data, s->len);
    p[s->len] = '\0';

    return (const char *) p;
}


/*
 * The block size of the kvroute upstream of zone that lists server (the
 * router hashes that server's prompts with it, so its engine's events must
 * agree); 0: no upstream of the zone lists it.  Upstreams sharing a zone may
 * differ.
 */

static uint32_t
ngx_http_kvroute_events_block_size(ngx_http_kvroute_zone_t *zone,
    ngx_str_t *server)
{
    ngx_uint_t                       i, k;
    ngx_http_upstream_server_t      *us;
    ngx_http_kvroute_srv_conf_t     *kcf;
    ngx_http_upstream_srv_conf_t   **uscfp;
    ngx_http_upstream_main_conf_t   *umcf;

    umcf = ngx_http_cycle_get_module_main_conf(ngx_cycle,
                                               ngx_http_upstream_module);
    uscfp = umcf->upstreams.elts;

    for (i = 0; i < umcf->upstreams.nelts; i++) {
        kcf = ngx_http_conf_upstream_srv_conf(uscfp[i],
                                              ngx_http_kvroute_module);

        if (kcf == NULL || kcf->zone != zone || uscfp[i]->servers == NULL) {
            continue;
        }

        us = uscfp[i]->servers->elts;

        for (k = 0; k < uscfp[i]->servers->nelts; k++) {
            if (us[k].name.len == server->len
                && ngx_strncmp(us[k].name.data, server->data, server->len)
                   == 0)
            {
                return (uint32_t) kcf->block_size;
            }
        }
    }

    return 0;
}


static ngx_int_t
ngx_http_kvroute_events_zmq_start(ngx_http_kvroute_events_t *ev, ngx_log_t *log)
{
    char                            err[256];
    uint32_t                        bs;
    ngx_uint_t                      i, k;
    ngx_array_t                    *pubs;
    kv_zmq_config_t                 zc;
    kv_zmq_pub_config_t            *pc;
    ngx_http_upstream_server_t     *us;
    ngx_http_kvroute_zmq_line_t    *ln;
    ngx_http_kvroute_srv_conf_t    *kcf, **kcfs;
    ngx_pool_t                     *pool = ngx_cycle->pool;
    kv_registry_t                  *reg = ev->zone->sh->registry;

    pubs = ngx_array_create(pool, 8, sizeof(kv_zmq_pub_config_t));
    if (pubs == NULL) {
        return NGX_ERROR;
    }

    ln = ev->zmq_lines.elts;

    for (i = 0; i < ev->zmq_lines.nelts; i++) {

        if (ln[i].uscf == NULL) {
            pc = ngx_array_push(pubs);
            if (pc == NULL) {
                return NGX_ERROR;
            }
            pc->endpoint = (const char *) ln[i].endpoint.data;
            pc->replay = ngx_http_kvroute_events_cstr(pool, &ln[i].replay);
            pc->server = ngx_http_kvroute_events_cstr(pool, &ln[i].server);
            pc->topic = ngx_http_kvroute_events_cstr(pool, &ln[i].topic);
            pc->block_size = ngx_http_kvroute_events_block_size(ev->zone,
                                                                &ln[i].server);
            continue;
        }

        us = ln[i].uscf->servers->elts;
        kcf = ngx_http_conf_upstream_srv_conf(ln[i].uscf,
                                              ngx_http_kvroute_module);
        bs = kcf && kcf->zone == ev->zone ? (uint32_t) kcf->block_size : 0;

        for (k = 0; k < ln[i].uscf->servers->nelts; k++) {
            if (us[k].backup || us[k].name.len >= KV_REGISTRY_ADDR_MAX) {
                continue;
            }

            pc = ngx_array_push(pubs);
            if (pc == NULL) {
                return NGX_ERROR;
            }

            pc->endpoint = ngx_http_kvroute_events_expand(pool,
                                                          &ln[i].endpoint,
                                                          &us[k].name);
            pc->replay = ln[i].replay.len
                         ? ngx_http_kvroute_events_expand(pool, &ln[i].replay,
                                                          &us[k].name)
                         : NULL;
            pc->server = ngx_http_kvroute_events_cstr(pool, &us[k].name);
            pc->topic = ngx_http_kvroute_events_cstr(pool, &ln[i].topic);
            pc->block_size = bs;

            if (pc->endpoint == NULL || (ln[i].replay.len && pc->replay == NULL)) {
                ngx_log_error(NGX_LOG_ALERT, log, 0,
                              "kvroute_events \"%V\": cannot expand \"%V\" "
                              "for server \"%V\" (placeholders: $host, "
                              "$port, $port+N, $port-N)", &ev->zone->name,
                              &ln[i].endpoint, &us[k].name);
                return NGX_ERROR;
            }
        }
    }

    ngx_memzero(&zc, sizeof(zc));
    zc.pubs = pubs->elts;
    zc.n_pubs = pubs->nelts;
    zc.replay_timeout_ms = (uint32_t) ev->replay_timeout;
    zc.on_drop = ngx_http_kvroute_events_drop;
    zc.on_drop_arg = ev->zone;

    /* the block size for publishers whose server no upstream lists */

    kcfs = ev->zone->upstreams.elts;
    if (ev->zone->upstreams.nelts) {
        zc.block_size = (uint32_t) kcfs[0]->block_size;
    }

    if (ngx_http_kvroute_events_take_lease(ev, log) != NGX_OK) {
        return NGX_AGAIN;
    }

    ev->zmq_ingest = kv_zmq_create(&zc, ev->zone->sh->index, reg,
                                   err, sizeof(err));
    if (ev->zmq_ingest == NULL) {
        return ngx_http_kvroute_events_start_failed(ev, log, err);
    }

    if (kv_zmq_start(ev->zmq_ingest, err, sizeof(err)) != 0) {
        kv_zmq_destroy(ev->zmq_ingest);
        ev->zmq_ingest = NULL;
        return ngx_http_kvroute_events_start_failed(ev, log, err);
    }

    ngx_log_error(NGX_LOG_NOTICE, log, 0,
                  "kvroute_events \"%V\": helper pid %P ingesting from %ui "
                  "ZMQ publisher(s), block size %uD", &ev->zone->name, ngx_pid,
                  pubs->nelts, zc.block_size);

    return NGX_OK;
}


/* Another process took the zone's writer lease: this helper must stop. */

static ngx_int_t
ngx_http_kvroute_events_lease_lost(ngx_http_kvroute_events_t *ev)
{
    if (kv_registry_lease_held(ev->zone->sh->registry, ngx_pid,
                               ev->lease_gen))
    {
        return 0;
    }

    ngx_log_error(NGX_LOG_ALERT, ngx_cycle->log, 0,
                  "kvroute_events \"%V\": lost the writer lease, stopping",
                  &ev->zone->name);

    return 1;
}


static ngx_msec_t
ngx_http_kvroute_events_zmq_manager(ngx_http_kvroute_events_t *ev)
{
    if (ev->zmq_ingest == NULL) {
        if (ngx_http_kvroute_events_zmq_start(ev, ngx_cycle->log)
            == NGX_ERROR)
        {
            return 5000;
        }

        if (ev->zmq_ingest == NULL) {
            return 50;
        }
    }

    if (ngx_http_kvroute_events_lease_lost(ev)) {
        kv_zmq_destroy(ev->zmq_ingest);
        ev->zmq_ingest = NULL;
        return 1000;
    }

    kv_zmq_tick(ev->zmq_ingest, kv_ingest_now_ms());

    return 100;
}


static ngx_msec_t
ngx_http_kvroute_events_manager(void *data)
{
    ngx_http_kvroute_events_t  *ev = data;

    if (ev->zmq) {
        return ngx_http_kvroute_events_zmq_manager(ev);
    }

    if (ev->ingest == NULL) {
        if (ngx_http_kvroute_events_start(ev, ngx_cycle->log) == NGX_ERROR) {
            return 5000;
        }

        if (ev->ingest == NULL) {
            return 50;
        }
    }

    if (ngx_http_kvroute_events_lease_lost(ev)) {
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


/* ZMQ publishers (vLLM's events): salt= is the LoRA seed there, not a
 * cache salt (the events carry no cache_salt to match it). */

ngx_uint_t
ngx_http_kvroute_events_zmq(void *events_conf)
{
    ngx_http_kvroute_events_t  *ev = events_conf;

    return ev != NULL && ev->zmq;
}


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

    if (ev && ev->zmq_ingest) {
        kv_zmq_destroy(ev->zmq_ingest);
        ev->zmq_ingest = NULL;
        kv_registry_lease_release(zone->sh->registry, ngx_pid, ev->lease_gen);
        return;
    }

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
