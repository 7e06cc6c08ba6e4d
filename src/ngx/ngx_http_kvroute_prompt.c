
/*
 * Copyright (C) kvroute authors
 *
 * Prompt preparation: read the request body before proxying, turn it into
 * block hashes (src/route/kv_prompt.c), and keep the result in the request
 * context for the balancer.
 *
 * A precontent phase handler does this for locations that proxy_pass to a
 * kvroute upstream, the way the mirror module reads bodies, so that large
 * prompts can be tokenized in a thread pool instead of stalling the event
 * loop. The balancer's init_peer prepares synchronously when the handler
 * did not run (e.g. proxy_pass with variables).
 */


#include "ngx_http_kvroute.h"
#include "kv_prompt.h"


typedef struct {
    ngx_http_request_t        *request;
    ngx_http_kvroute_ctx_t    *ctx;
    kv_prompt_config_t         cfg;
    u_char                    *body;
    size_t                     len;
    u_char                    *salt;
    size_t                     salt_len;
    kv_prompt_t                result;
#if (NGX_THREADS)
    ngx_event_t                hold;    /* armed while the task is in the pool */
#endif
} ngx_http_kvroute_task_t;


static void ngx_http_kvroute_body_handler(ngx_http_request_t *r);
static void ngx_http_kvroute_cleanup(void *data);
static ngx_int_t ngx_http_kvroute_task_init(ngx_http_request_t *r,
    ngx_http_kvroute_ctx_t *ctx, ngx_http_kvroute_task_t *t);
static void ngx_http_kvroute_finish(ngx_http_kvroute_task_t *t);
#if (NGX_THREADS)
static void ngx_http_kvroute_thread_handler(void *data, ngx_log_t *log);
static void ngx_http_kvroute_thread_event_handler(ngx_event_t *ev);
static void ngx_http_kvroute_hold_handler(ngx_event_t *ev);
#endif


extern ngx_module_t  ngx_http_proxy_module;


/* The kvroute upstream a location proxies to, or NULL. */

ngx_http_kvroute_srv_conf_t *
ngx_http_kvroute_upstream_of(ngx_http_request_t *r)
{
    ngx_http_upstream_conf_t     *ucf;
    ngx_http_upstream_srv_conf_t *uscf;
    ngx_http_kvroute_srv_conf_t  *kcf;

    /* ngx_http_proxy_loc_conf_t starts with its ngx_http_upstream_conf_t */

    ucf = ngx_http_get_module_loc_conf(r, ngx_http_proxy_module);
    if (ucf == NULL || ucf->upstream == NULL) {
        return NULL;
    }

    uscf = ucf->upstream;

    if (uscf->srv_conf == NULL) {
        return NULL;
    }

    kcf = ngx_http_conf_upstream_srv_conf(uscf, ngx_http_kvroute_module);

    if (kcf == NULL || kcf->uscf != uscf || kcf->zone == NULL) {
        return NULL;
    }

    return kcf;
}


ngx_http_kvroute_ctx_t *
ngx_http_kvroute_get_ctx(ngx_http_request_t *r,
    ngx_http_kvroute_srv_conf_t *kcf)
{
    ngx_pool_cleanup_t      *cln;
    ngx_http_kvroute_ctx_t  *ctx;

    ctx = ngx_http_get_module_ctx(r, ngx_http_kvroute_module);
    if (ctx) {
        return ctx;
    }

    ctx = ngx_pcalloc(r->pool, sizeof(ngx_http_kvroute_ctx_t));
    if (ctx == NULL) {
        return NULL;
    }

    cln = ngx_pool_cleanup_add(r->pool, 0);
    if (cln == NULL) {
        return NULL;
    }

    /* the request's pool goes away on every path: release what is held */

    cln->handler = ngx_http_kvroute_cleanup;
    cln->data = ctx;

    ctx->conf = kcf;
    ctx->load = -1;
    ctx->t0_ns = ngx_http_kvroute_now_ns();

    ngx_http_set_ctx(r, ctx, ngx_http_kvroute_module);

    return ctx;
}


static void
ngx_http_kvroute_cleanup(void *data)
{
    ngx_http_kvroute_ctx_t  *ctx = data;

    ngx_http_kvroute_acct_close(ctx);

    if (ctx->seq) {
        ngx_free(ctx->seq);
        ctx->seq = NULL;
    }
}


ngx_int_t
ngx_http_kvroute_precontent(ngx_http_request_t *r)
{
    ngx_int_t                     rc;
    ngx_http_kvroute_ctx_t       *ctx;
    ngx_http_kvroute_srv_conf_t  *kcf;

    if (r != r->main || r->method != NGX_HTTP_POST) {
        return NGX_DECLINED;
    }

    kcf = ngx_http_kvroute_upstream_of(r);
    if (kcf == NULL) {
        return NGX_DECLINED;
    }

    ctx = ngx_http_get_module_ctx(r, ngx_http_kvroute_module);

    if (ctx) {
        if (ctx->status != NGX_HTTP_SERVICE_UNAVAILABLE) {
            return ctx->status;
        }

        /* every server is over its busy threshold: ask to come back */

        return ngx_http_kvroute_busy(r, kcf->retry_after);
    }

    ctx = ngx_http_kvroute_get_ctx(r, kcf);
    if (ctx == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    ctx->status = NGX_DONE;

    rc = ngx_http_read_client_request_body(r, ngx_http_kvroute_body_handler);
    if (rc >= NGX_HTTP_SPECIAL_RESPONSE) {
        return rc;
    }

    ngx_http_finalize_request(r, NGX_DONE);
    return NGX_DONE;
}


static void
ngx_http_kvroute_resume(ngx_http_request_t *r, ngx_http_kvroute_ctx_t *ctx)
{
    ctx->status = NGX_DECLINED;

    if ((ctx->fallback == NGX_HTTP_KVROUTE_FB_NONE
         || ctx->fallback == NGX_HTTP_KVROUTE_FB_PROMPT_CAPPED)
        && ngx_http_kvroute_all_busy(ctx->conf, r->pool))
    {
        ctx->fallback = NGX_HTTP_KVROUTE_FB_ALL_BUSY;
        ctx->status = NGX_HTTP_SERVICE_UNAVAILABLE;
        ngx_atomic_fetch_add(&ctx->conf->zone->sh->busy_rejects, 1);
    }

    r->preserve_body = 1;

    r->write_event_handler = ngx_http_core_run_phases;
    ngx_http_core_run_phases(r);
}


static void
ngx_http_kvroute_body_handler(ngx_http_request_t *r)
{
    ngx_http_kvroute_ctx_t   *ctx;
    ngx_http_kvroute_task_t   t, *tp;
#if (NGX_THREADS)
    ngx_thread_task_t        *task;
#endif

    ctx = ngx_http_get_module_ctx(r, ngx_http_kvroute_module);

    if (ngx_http_kvroute_task_init(r, ctx, &t) != NGX_OK) {
        ngx_http_kvroute_resume(r, ctx);
        return;
    }

#if (NGX_THREADS)

    if (ctx->conf->thread_pool && t.len >= ctx->conf->thread_threshold) {
        task = ngx_thread_task_alloc(r->pool, sizeof(ngx_http_kvroute_task_t));
        if (task == NULL) {
            goto inline_;
        }

        tp = task->ctx;
        *tp = t;

        task->handler = ngx_http_kvroute_thread_handler;
        task->event.handler = ngx_http_kvroute_thread_event_handler;
        task->event.data = tp;

        if (ngx_thread_task_post(ctx->conf->thread_pool, task) != NGX_OK) {
            goto inline_;
        }

        r->main->blocked++;
        r->aio = 1;

        /*
         * A gracefully exiting worker (reload, quit) stays while any
         * timer that is not cancelable is pending; nothing else tells it
         * a request waits on the pool, so the task holds one until done.
         */

        tp->hold.handler = ngx_http_kvroute_hold_handler;
        tp->hold.data = tp;
        tp->hold.log = r->connection->log;
        ngx_add_timer(&tp->hold, 60000);

        ngx_atomic_fetch_add(&ctx->conf->zone->sh->threaded, 1);

        return;
    }

inline_:

#endif

    tp = &t;
    kv_prompt_compute(&tp->cfg, (char *) tp->body, tp->len,
                      (char *) tp->salt, tp->salt_len, &tp->result);
    ngx_http_kvroute_finish(tp);
    ngx_http_kvroute_resume(r, ctx);
}


#if (NGX_THREADS)

static void
ngx_http_kvroute_thread_handler(void *data, ngx_log_t *log)
{
    ngx_http_kvroute_task_t  *t = data;

    kv_prompt_compute(&t->cfg, (char *) t->body, t->len, (char *) t->salt,
                      t->salt_len, &t->result);
}


static void
ngx_http_kvroute_thread_event_handler(ngx_event_t *ev)
{
    ngx_connection_t         *c;
    ngx_http_request_t       *r;
    ngx_http_kvroute_task_t  *t = ev->data;

    r = t->request;
    c = r->connection;

    if (t->hold.timer_set) {
        ngx_del_timer(&t->hold);
    }

    r->main->blocked--;
    r->aio = 0;

    ngx_http_kvroute_finish(t);

    if (r->done || c->destroyed) {
        return;
    }

    ngx_http_kvroute_resume(r, t->ctx);
    ngx_http_run_posted_requests(c);
}

#endif


#if (NGX_THREADS)

/* Tokenization still running after a minute: keep holding the worker. */

static void
ngx_http_kvroute_hold_handler(ngx_event_t *ev)
{
    ngx_add_timer(ev, 60000);
}

#endif


/* Synchronous preparation, for init_peer when the precontent phase did not
 * see the request. */

void
ngx_http_kvroute_prepare(ngx_http_request_t *r, ngx_http_kvroute_ctx_t *ctx)
{
    ngx_http_kvroute_task_t  t;

    if (ngx_http_kvroute_task_init(r, ctx, &t) != NGX_OK) {
        return;
    }

    kv_prompt_compute(&t.cfg, (char *) t.body, t.len, (char *) t.salt,
                      t.salt_len, &t.result);
    ngx_http_kvroute_finish(&t);
}


/*
 * Collects the body into one buffer (pointing into nginx's own when it is
 * one memory buffer) and the salt; on NGX_DECLINED the request falls back
 * with ctx->fallback set.
 */

static ngx_int_t
ngx_http_kvroute_task_init(ngx_http_request_t *r, ngx_http_kvroute_ctx_t *ctx,
    ngx_http_kvroute_task_t *t)
{
    u_char                       *p;
    size_t                        len;
    ssize_t                       n;
    ngx_buf_t                    *b;
    ngx_str_t                     salt;
    ngx_chain_t                  *cl;
    ngx_http_kvroute_srv_conf_t  *kcf = ctx->conf;

    ngx_memzero(t, sizeof(ngx_http_kvroute_task_t));

    /* the decision starts with the whole body in hand: reading it is the
     * client's time, not the router's */
    ctx->t0_ns = ngx_http_kvroute_now_ns();
    ctx->prepared = 1;

    t->request = r;
    t->ctx = ctx;
    t->cfg.tokenizer = kcf->tokenizer;
    t->cfg.chat = kcf->template;
    t->cfg.model = kcf->model.len ? (char *) kcf->model.data : NULL;
    t->cfg.block_size = kcf->block_size;
    t->cfg.max_tokenize = kcf->max_tokenize;

    /* the zone's turn cache: set before any task of this worker can use it */
    if (kcf->turn.cache == NULL && kcf->bounds && kcf->zone->sh->turns) {
        kcf->turn.bounds = kcf->bounds;
        kcf->turn.cache = kcf->zone->sh->turns;
    }

    t->cfg.turns = kcf->turn.cache ? &kcf->turn : NULL;

    if (r->request_body_no_buffering
        || (r->request_body && r->request_body->rest > 0))
    {
        ctx->fallback = NGX_HTTP_KVROUTE_FB_UNBUFFERED;
        return NGX_DECLINED;
    }

    if (r->request_body == NULL || r->request_body->bufs == NULL) {
        ctx->fallback = NGX_HTTP_KVROUTE_FB_NO_BODY;
        return NGX_DECLINED;
    }

    len = 0;
    for (cl = r->request_body->bufs; cl; cl = cl->next) {
        len += ngx_buf_size(cl->buf);
    }

    if (len == 0) {
        ctx->fallback = NGX_HTTP_KVROUTE_FB_NO_BODY;
        return NGX_DECLINED;
    }

    cl = r->request_body->bufs;
    b = cl->buf;

    if (ngx_buf_in_memory(b) && (size_t) (b->last - b->pos) == len) {
        t->body = b->pos;

    } else {
        t->body = ngx_pnalloc(r->pool, len);
        if (t->body == NULL) {
            ctx->fallback = NGX_HTTP_KVROUTE_FB_NO_MEMORY;
            return NGX_DECLINED;
        }

        p = t->body;

        for ( /* void */ ; cl; cl = cl->next) {
            b = cl->buf;

            if (b->in_file) {
                n = ngx_read_file(b->file, p, b->file_last - b->file_pos,
                                  b->file_pos);
                if (n != b->file_last - b->file_pos) {
                    ctx->fallback = NGX_HTTP_KVROUTE_FB_BODY_READ;
                    return NGX_DECLINED;
                }
                p += n;
                continue;
            }

            p = ngx_cpymem(p, b->pos, b->last - b->pos);
        }
    }

    t->len = len;

    if (kcf->salt) {
        if (ngx_http_complex_value(r, kcf->salt, &salt) == NGX_OK
            && salt.len)
        {
            t->salt = salt.data;
            t->salt_len = salt.len;
        }
    }

    return NGX_OK;
}


static void
ngx_http_kvroute_finish(ngx_http_kvroute_task_t *t)
{
    ngx_uint_t               i;
    ngx_http_kvroute_ctx_t  *ctx = t->ctx;

#define NGX_HTTP_KVROUTE_FB_FROM(name, str, prompt)  (int) (prompt),

    static const int  from[] = {
        NGX_HTTP_KVROUTE_FALLBACKS(NGX_HTTP_KVROUTE_FB_FROM)
    };

    ctx->fallback = NGX_HTTP_KVROUTE_FB_NO_PROMPT;

    for (i = 0; i < NGX_HTTP_KVROUTE_FB_N; i++) {
        if (from[i] == (int) t->result.status) {
            ctx->fallback = i;
            break;
        }
    }

    ctx->prompt_tokens = t->result.prompt_tokens;
    ctx->turn_cached_tokens = t->result.turn_cached_tokens;
    ctx->max_tokens = t->result.max_tokens > 0 ? t->result.max_tokens : 0;
    ctx->seq = t->result.seq;
    ctx->nseq = t->result.nseq;

    if (t->result.status != KV_PROMPT_OK) {
        ngx_log_error(NGX_LOG_INFO, t->request->connection->log, 0,
                      "kvroute: routing by load only: %s",
                      t->result.err);

    } else if (t->result.capped) {
        ctx->fallback = NGX_HTTP_KVROUTE_FB_PROMPT_CAPPED;
        ngx_log_error(NGX_LOG_INFO, t->request->connection->log, 0,
                      "kvroute: max_tokenize: %s, %uL tokens estimated",
                      t->result.err, t->result.estimated_tokens);
    }
}
