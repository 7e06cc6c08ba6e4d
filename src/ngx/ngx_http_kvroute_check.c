
/*
 * Copyright (C) kvroute authors
 *
 * Misconfigurations kvroute catches instead of routing badly in silence:
 * a "keepalive" placed before "kvroute" (nginx would drop it), a zone=
 * with no kvroute_zone (said with the line that names it), and a worker
 * that announces another block size than the upstream's block_size= (its
 * cached blocks can never match ours: it is routed by load only, and said
 * so in the error log and the status).
 */


#include "ngx_http_kvroute.h"


/*
 * nginx's keepalive wraps the balancer named before it, so "keepalive N;"
 * before "kvroute" is silently lost when kvroute replaces the method. Its
 * configuration is private; the module is found by name (it may be left
 * out of a build) and the first member of its server configuration,
 * max_cached, has been set by "keepalive N;" since nginx 1.1.4.
 */

ngx_int_t
ngx_http_kvroute_check_order(ngx_conf_t *cf, ngx_http_upstream_srv_conf_t *uscf)
{
    ngx_uint_t    i, *max_cached;
    ngx_module_t  *m;

    if (uscf->peer.init_upstream == NULL) {
        return NGX_OK;
    }

    for (i = 0; cf->cycle->modules[i]; i++) {
        m = cf->cycle->modules[i];

        if (m->type != NGX_HTTP_MODULE
            || ngx_strcmp(m->name, "ngx_http_upstream_keepalive_module") != 0)
        {
            continue;
        }

        max_cached = uscf->srv_conf ? uscf->srv_conf[m->ctx_index] : NULL;

        if (max_cached && *max_cached) {
            ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                               "\"kvroute\" must come before \"keepalive\" in "
                               "upstream \"%V\": keepalive applies to the "
                               "balancing method named before it",
                               &uscf->host);
            return NGX_ERROR;
        }
    }

    ngx_conf_log_error(NGX_LOG_WARN, cf, 0, "load balancing method redefined");

    return NGX_OK;
}


/* A zone= (or kvroute_events zone=) naming no kvroute_zone: where. */

ngx_int_t
ngx_http_kvroute_zone_undeclared(ngx_conf_t *cf,
    ngx_http_upstream_srv_conf_t *us, ngx_http_kvroute_zone_t *zone)
{
    ngx_log_error(NGX_LOG_EMERG, cf->log, 0,
                  "kvroute: upstream \"%V\" uses zone=%V but there is no "
                  "\"kvroute_zone %V SIZE;\" in http{} (zone=%V in %V:%ui)",
                  &us->host, &zone->name, &zone->name, &zone->name,
                  &zone->ref_file, zone->ref_line);

    return NGX_ERROR;
}


/*
 * The block size the worker behind p announced (0: unknown, e.g. no
 * kvroute_events or a worker that does not announce).
 */

ngx_uint_t
ngx_http_kvroute_worker_block_size(ngx_http_kvroute_srv_conf_t *kcf,
    ngx_http_kvroute_peer_t *p)
{
    kv_worker_rec_t  rec;

    if (ngx_http_kvroute_peer_record(kcf->zone, p, &rec) != NGX_OK) {
        return 0;
    }

    return rec.block_size;
}


/*
 * Per request, after matching: a primary server whose worker announces a
 * block size other than ours gets no overlap credit (its blocks hash
 * differently; what the router's own pending decisions predict for it is
 * wrong too), so it competes on load alone. Each nginx worker process
 * logs it once per server and change of block size.
 */

ngx_int_t
ngx_http_kvroute_block_size_ok(ngx_http_kvroute_srv_conf_t *kcf,
    ngx_http_kvroute_peer_t *p, ngx_log_t *log)
{
    ngx_uint_t  bs;

    if (kcf->zone == NULL || kcf->zone->events_conf == NULL) {
        return 1;
    }

    bs = ngx_http_kvroute_worker_block_size(kcf, p);

    if (bs == 0 || bs == kcf->block_size) {
        return 1;
    }

    if (p->block_size_logged != bs) {
        p->block_size_logged = bs;

        ngx_log_error(NGX_LOG_ERR, log, 0,
                      "kvroute: server \"%V\" of upstream \"%V\" announces "
                      "block_size=%ui but kvroute has block_size=%ui: "
                      "routing it by load only until they agree",
                      &p->server, &kcf->upstream_name, bs,
                      kcf->block_size);
    }

    return 0;
}


void
ngx_http_kvroute_block_size_check(ngx_http_kvroute_srv_conf_t *kcf,
    ngx_http_kvroute_cand_t *cand, ngx_uint_t n, ngx_log_t *log)
{
    ngx_uint_t  j;

    for (j = 0; j < n; j++) {
        if (!ngx_http_kvroute_block_size_ok(kcf, &kcf->peers[cand[j].k], log)) {
            cand[j].overlap = 0;
            cand[j].pending = 0;
        }
    }
}
