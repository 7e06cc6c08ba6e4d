
/*
 * Copyright (C) kvroute authors
 *
 * ngx_http_kvroute_module: KV-cache-aware upstream balancing for LLM
 * inference workers. This first version registers the "kvroute" balancer
 * and picks the peer with the fewest active requests (weighted), breaking
 * ties round-robin; prefix-aware scoring builds on it.
 */


#include <ngx_config.h>
#include <ngx_core.h>
#include <ngx_http.h>


static ngx_int_t ngx_http_kvroute_init_upstream(ngx_conf_t *cf,
    ngx_http_upstream_srv_conf_t *us);
static ngx_int_t ngx_http_kvroute_init_peer(ngx_http_request_t *r,
    ngx_http_upstream_srv_conf_t *us);
static ngx_int_t ngx_http_kvroute_get_peer(ngx_peer_connection_t *pc,
    void *data);
static char *ngx_http_kvroute(ngx_conf_t *cf, ngx_command_t *cmd, void *conf);


static ngx_command_t  ngx_http_kvroute_commands[] = {

    { ngx_string("kvroute"),
      NGX_HTTP_UPS_CONF|NGX_CONF_NOARGS,
      ngx_http_kvroute,
      0,
      0,
      NULL },

      ngx_null_command
};


static ngx_http_module_t  ngx_http_kvroute_module_ctx = {
    NULL,                                  /* preconfiguration */
    NULL,                                  /* postconfiguration */

    NULL,                                  /* create main configuration */
    NULL,                                  /* init main configuration */

    NULL,                                  /* create server configuration */
    NULL,                                  /* merge server configuration */

    NULL,                                  /* create location configuration */
    NULL                                   /* merge location configuration */
};


ngx_module_t  ngx_http_kvroute_module = {
    NGX_MODULE_V1,
    &ngx_http_kvroute_module_ctx,          /* module context */
    ngx_http_kvroute_commands,             /* module directives */
    NGX_HTTP_MODULE,                       /* module type */
    NULL,                                  /* init master */
    NULL,                                  /* init module */
    NULL,                                  /* init process */
    NULL,                                  /* init thread */
    NULL,                                  /* exit thread */
    NULL,                                  /* exit process */
    NULL,                                  /* exit master */
    NGX_MODULE_V1_PADDING
};


static ngx_int_t
ngx_http_kvroute_init_upstream(ngx_conf_t *cf,
    ngx_http_upstream_srv_conf_t *us)
{
    if (ngx_http_upstream_init_round_robin(cf, us) != NGX_OK) {
        return NGX_ERROR;
    }

    us->peer.init = ngx_http_kvroute_init_peer;

    return NGX_OK;
}


static ngx_int_t
ngx_http_kvroute_init_peer(ngx_http_request_t *r,
    ngx_http_upstream_srv_conf_t *us)
{
    if (ngx_http_upstream_init_round_robin_peer(r, us) != NGX_OK) {
        return NGX_ERROR;
    }

    r->upstream->peer.get = ngx_http_kvroute_get_peer;

    return NGX_OK;
}


static ngx_uint_t
ngx_http_kvroute_peer_usable(ngx_http_upstream_rr_peer_data_t *rrp,
    ngx_http_upstream_rr_peer_t *peer, ngx_uint_t i, time_t now)
{
    uintptr_t   m;
    ngx_uint_t  n;

    n = i / (8 * sizeof(uintptr_t));
    m = (uintptr_t) 1 << i % (8 * sizeof(uintptr_t));

    if (rrp->tried[n] & m) {
        return 0;
    }

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


static ngx_int_t
ngx_http_kvroute_get_peer(ngx_peer_connection_t *pc, void *data)
{
    ngx_http_upstream_rr_peer_data_t  *rrp = data;

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

        if (!ngx_http_kvroute_peer_usable(rrp, peer, i, now)) {
            continue;
        }

        /* fewest active requests per unit of weight; ties by position */

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

        rc = ngx_http_kvroute_get_peer(pc, rrp);

        if (rc != NGX_BUSY) {
            return rc;
        }

        ngx_http_upstream_rr_peers_wlock(peers);
    }

    ngx_http_upstream_rr_peers_unlock(peers);

    pc->name = peers->name;

    return NGX_BUSY;
}


static char *
ngx_http_kvroute(ngx_conf_t *cf, ngx_command_t *cmd, void *conf)
{
    ngx_http_upstream_srv_conf_t  *uscf;

    uscf = ngx_http_conf_get_module_srv_conf(cf, ngx_http_upstream_module);

    if (uscf->peer.init_upstream) {
        ngx_conf_log_error(NGX_LOG_WARN, cf, 0,
                           "load balancing method redefined");
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
}
