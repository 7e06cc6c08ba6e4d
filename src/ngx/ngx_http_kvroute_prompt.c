
/*
 * Copyright (C) kvroute authors
 *
 * Prompt preparation: read the request body before proxying, turn it into
 * block hashes (src/route/kv_prompt.c), and keep the result in the request
 * context for the balancer.
 *
 * A precontent phase handler does this for locations with kvroute_upstream,
 * the way the mirror module reads bodies, so that large prompts can be
 * tokenized in a thread pool instead of stalling the event loop. The
 * balancer's init_peer prepares synchronously when the handler did not run
 * (a location without the directive).
 *
 * Large prompts wait in kvroute's own queue (one per upstream and worker
 * process) before nginx's thread pool, whose one FIFO queue let a 100 KB
 * prompt wait 37.5 s behind 80 concurrent 1 MB ones. The queue is ordered
 * shortest-first with aging, by one fixed key: arrival time plus 1 ms per
 * KB of body. A small prompt thus passes big ones that arrived shortly
 * before it, and no prompt is passed by one that arrived more than its
 * own size's worth of milliseconds after it (no starvation). Prompts go to
 * the pool while the bodies there total at most tokenize_budget (a body
 * larger than the whole budget goes alone), which bounds the memory that
 * tokenizing takes at once; one that waits longer than tokenize_wait is
 * routed by load without tokenizing (fallback "tokenize_wait").
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
    ngx_thread_task_t         *thread;
    ngx_queue_t                queue;   /* in conf->tq while not posted */
    ngx_msec_t                 key;     /* the queue's order */
    ngx_msec_t                 since;   /* queued at */
    ngx_event_t                hold;    /* armed while the task is in the pool */
    unsigned                   posted:1;    /* in the pool, budget charged */
    int                        cancelled;   /* the client went (atomic) */
    int                        skipped;     /* so the thread did nothing */
    int                        interrupted; /* so the tokenizer stopped early */
#endif
} ngx_http_kvroute_task_t;


/* the queue's aging: a body is ordered as if it came 1 ms per KB later */
#define NGX_HTTP_KVROUTE_TQ_AGE_SHIFT  10


static void ngx_http_kvroute_body_handler(ngx_http_request_t *r);
static void ngx_http_kvroute_cleanup(void *data);
static ngx_int_t ngx_http_kvroute_task_init(ngx_http_request_t *r,
    ngx_http_kvroute_ctx_t *ctx, ngx_http_kvroute_task_t *t);
static ngx_int_t ngx_http_kvroute_task_body(ngx_http_request_t *r,
    ngx_http_kvroute_ctx_t *ctx, ngx_http_kvroute_task_t *t);
static ngx_int_t ngx_http_kvroute_choose(ngx_http_request_t *r,
    ngx_http_kvroute_ctx_t *ctx, ngx_http_kvroute_task_t *t);
static void ngx_http_kvroute_task_config(ngx_http_request_t *r,
    ngx_http_kvroute_ctx_t *ctx, ngx_http_kvroute_task_t *t);
static ngx_int_t ngx_http_kvroute_task_salt(ngx_http_request_t *r,
    ngx_http_kvroute_ctx_t *ctx, ngx_http_kvroute_task_t *t);
static void ngx_http_kvroute_session_header(ngx_http_request_t *r,
    ngx_http_kvroute_ctx_t *ctx);
static void ngx_http_kvroute_finish(ngx_http_kvroute_task_t *t);
static ngx_int_t ngx_http_kvroute_salt_rewrite(ngx_http_kvroute_task_t *t);
#if (NGX_THREADS)
static void ngx_http_kvroute_thread_handler(void *data, ngx_log_t *log);
static void ngx_http_kvroute_thread_event_handler(ngx_event_t *ev);
static void ngx_http_kvroute_hold_handler(ngx_event_t *ev);
static void ngx_http_kvroute_pool_reading(ngx_http_request_t *r);
static void ngx_http_kvroute_tq_add(ngx_http_kvroute_srv_conf_t *kcf,
    ngx_http_kvroute_task_t *t);
static void ngx_http_kvroute_tq_pump(ngx_http_kvroute_srv_conf_t *kcf);
static void ngx_http_kvroute_tq_retry(ngx_event_t *ev);
static void ngx_http_kvroute_tq_unqueue(ngx_http_kvroute_task_t *t);
static void ngx_http_kvroute_tq_fallback(ngx_http_kvroute_task_t *t);
static void ngx_http_kvroute_task_release(ngx_http_kvroute_task_t *t);
static void ngx_http_kvroute_task_gone(ngx_http_kvroute_task_t *t);
#endif


/*
 * "kvroute_upstream NAME" names the kvroute upstream a location proxies to,
 * so that its body is read and its prompt prepared here, before the content
 * handler runs. nginx offers no public way to learn from a location which
 * upstream its proxy_pass (grpc_pass, ...) names: that lives in each
 * module's private location configuration. Locations without the directive
 * are still balanced, with the prompt prepared in init_peer.
 */

char *
ngx_http_kvroute_upstream_directive(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf)
{
    ngx_http_kvroute_loc_conf_t *klcf = conf;

    ngx_str_t                         *value;
    ngx_uint_t                         i;
    ngx_http_kvroute_upstream_ref_t   *ref, **choice;

    if (klcf->upstream != NGX_CONF_UNSET_PTR) {
        return "is duplicate";
    }

    value = cf->args->elts;

    if (cf->args->nelts > 2) {
        klcf->choices = ngx_array_create(cf->pool, cf->args->nelts - 1,
                                         sizeof(ngx_http_kvroute_upstream_ref_t *));
        if (klcf->choices == NULL) {
            return NGX_CONF_ERROR;
        }
    }

    for (i = 1; i < cf->args->nelts; i++) {
        ref = ngx_http_kvroute_upstream_ref(cf, &value[i]);
        if (ref == NULL) {
            return NGX_CONF_ERROR;
        }

        ref->several = klcf->choices ? 1 : 0;
        ref->last = (i == cf->args->nelts - 1);

        if (klcf->choices) {
            choice = ngx_array_push(klcf->choices);
            if (choice == NULL) {
                return NGX_CONF_ERROR;
            }

            *choice = ref;
        }

        if (i == 1) {
            klcf->upstream = ref;
        }
    }

    return NGX_CONF_OK;
}


/* A reference to the kvroute upstream NAME, resolved after the http
 * block (the upstream may come after the location). */

ngx_http_kvroute_upstream_ref_t *
ngx_http_kvroute_upstream_ref(ngx_conf_t *cf, ngx_str_t *name)
{
    ngx_http_kvroute_main_conf_t      *kmcf;
    ngx_http_kvroute_upstream_ref_t   *ref, **refp;

    kmcf = ngx_http_conf_get_module_main_conf(cf, ngx_http_kvroute_module);

    ref = ngx_pcalloc(cf->pool, sizeof(ngx_http_kvroute_upstream_ref_t));
    if (ref == NULL) {
        return NULL;
    }

    ref->name = *name;
    ref->file_name = cf->conf_file->file.name.data;
    ref->line = cf->conf_file->line;

    refp = ngx_array_push(&kmcf->upstreams);
    if (refp == NULL) {
        return NULL;
    }

    *refp = ref;

    return ref;
}


/* The configuration of the upstream block NAME, or NULL if there is none
 * or kvroute is not in it. */

ngx_http_kvroute_srv_conf_t *
ngx_http_kvroute_upstream_find(ngx_conf_t *cf, ngx_str_t *name)
{
    ngx_uint_t                       i;
    ngx_http_kvroute_srv_conf_t     *kcf;
    ngx_http_upstream_srv_conf_t   **uscfp;
    ngx_http_upstream_main_conf_t   *umcf;

    umcf = ngx_http_conf_get_module_main_conf(cf, ngx_http_upstream_module);
    uscfp = umcf->upstreams.elts;

    for (i = 0; i < umcf->upstreams.nelts; i++) {
        if (uscfp[i]->srv_conf == NULL
            || uscfp[i]->host.len != name->len
            || ngx_strncasecmp(uscfp[i]->host.data, name->data, name->len)
               != 0)
        {
            continue;
        }

        kcf = ngx_http_conf_upstream_srv_conf(uscfp[i],
                                              ngx_http_kvroute_module);

        return (kcf && kcf->uscf == uscfp[i]) ? kcf : NULL;
    }

    return NULL;
}


/* After the http block: every kvroute_upstream names an upstream block
 * with kvroute in it. */

ngx_int_t
ngx_http_kvroute_upstream_resolve(ngx_conf_t *cf,
    ngx_http_kvroute_main_conf_t *kmcf)
{
    ngx_uint_t                         i;
    ngx_http_kvroute_srv_conf_t       *kcf;
    ngx_http_kvroute_upstream_ref_t  **refs, *ref;

    refs = kmcf->upstreams.elts;

    for (i = 0; i < kmcf->upstreams.nelts; i++) {
        ref = refs[i];

        kcf = ngx_http_kvroute_upstream_find(cf, &ref->name);

        if (kcf == NULL) {
            ngx_log_error(NGX_LOG_EMERG, cf->log, 0,
                          "kvroute_upstream \"%V\": no upstream block of "
                          "that name has \"kvroute\" in %s:%ui",
                          &ref->name, ref->file_name, ref->line);
            return NGX_ERROR;
        }

        ref->conf = kcf;

        if (ref->listed && kcf->model.len == 0) {
            ngx_log_error(NGX_LOG_EMERG, cf->log, 0,
                          "kvroute_models \"%V\": its \"kvroute\" has no "
                          "model= to list in %s:%ui",
                          &ref->name, ref->file_name, ref->line);
            return NGX_ERROR;
        }

        if (!ref->several) {
            continue;
        }

        /* the body's model picks among several: each needs the body read
         * (a zone), and only the last may serve every name */

        if (kcf->zone == NULL) {
            ngx_log_error(NGX_LOG_EMERG, cf->log, 0,
                          "kvroute_upstream \"%V\": choosing by model needs "
                          "zone= in its \"kvroute\" in %s:%ui",
                          &ref->name, ref->file_name, ref->line);
            return NGX_ERROR;
        }

        if (kcf->model.len == 0 && !ref->last) {
            ngx_log_error(NGX_LOG_EMERG, cf->log, 0,
                          "kvroute_upstream \"%V\" has no model= and serves "
                          "every model: the upstreams after it would never "
                          "be chosen in %s:%ui",
                          &ref->name, ref->file_name, ref->line);
            return NGX_ERROR;
        }
    }

    return NGX_OK;
}


/* The kvroute upstream a location proxies to, when it has a zone (without
 * one it balances by load alone and reads no body), or NULL. */

ngx_http_kvroute_srv_conf_t *
ngx_http_kvroute_upstream_of(ngx_http_request_t *r)
{
    ngx_http_kvroute_loc_conf_t  *klcf;

    klcf = ngx_http_get_module_loc_conf(r, ngx_http_kvroute_module);

    if (klcf->upstream == NULL || klcf->upstream->conf->zone == NULL) {
        return NULL;
    }

    return klcf->upstream->conf;
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

    ctx->credit_age_ms = -1;

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
        if (ctx->no_model) {
            ngx_http_finalize_request(r, ngx_http_kvroute_model_not_found(r));
            return NGX_DONE;
        }

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

    ngx_log_debug1(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                   "kvroute precontent: reading the body for upstream \"%V\"",
                   &kcf->upstream_name);

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

    if (ctx->salt_status) {
        ctx->status = ctx->salt_status;

    } else if ((ctx->fallback == NGX_HTTP_KVROUTE_FB_NONE
         || ctx->fallback == NGX_HTTP_KVROUTE_FB_PROMPT_CAPPED
         || ctx->fallback == NGX_HTTP_KVROUTE_FB_TOKENIZE_WAIT)
        && ngx_http_kvroute_all_busy(ctx->conf, r->pool))
    {
        ctx->fallback = NGX_HTTP_KVROUTE_FB_ALL_BUSY;
        ctx->status = NGX_HTTP_SERVICE_UNAVAILABLE;
        ngx_atomic_fetch_add(&ctx->conf->zone->sh->busy_rejects, 1);
    }

    ngx_log_debug2(NGX_LOG_DEBUG_HTTP, r->connection->log, 0,
                   "kvroute precontent: fallback \"%s\", status %i",
                   ngx_http_kvroute_fallback_names[ctx->fallback],
                   ctx->status);

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

        /* salt= must reach the engine: a body that cannot be rewritten
         * (not buffered, unreadable) is not sent with the client's salt */

        if (ctx->conf->salt && ctx->fallback != NGX_HTTP_KVROUTE_FB_NO_BODY
            && !ctx->no_model
            && !ngx_http_kvroute_events_zmq(ctx->conf->zone->events_conf))
        {
            ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                          "kvroute: salt= cannot be applied to this body "
                          "(%s): refused", ngx_http_kvroute_fallback_names[
                                                            ctx->fallback]);
            ctx->salt_status = ctx->fallback == NGX_HTTP_KVROUTE_FB_UNBUFFERED
                               ? NGX_HTTP_BAD_REQUEST
                               : NGX_HTTP_INTERNAL_SERVER_ERROR;
        }

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
        tp->thread = task;

        task->handler = ngx_http_kvroute_thread_handler;
        task->event.handler = ngx_http_kvroute_thread_event_handler;
        task->event.data = tp;

        /* the request waits on the queue, then the pool, as on aio */
        r->main->blocked++;
        r->aio = 1;

        /*
         * A gracefully exiting worker (reload, quit) stays while any
         * timer that is not cancelable is pending; nothing else tells it
         * a request waits on the queue or the pool, so the task holds one
         * until done (in the queue, it is also the wait bound).
         */

        tp->hold.handler = ngx_http_kvroute_hold_handler;
        tp->hold.data = tp;
        tp->hold.log = r->connection->log;

        /*
         * A client that goes away while its prompt waits: the request is
         * terminated (nginx waits for the task before freeing it); a task
         * still in the queue is dropped at once, one not yet started in
         * the pool does nothing, and a running one stops tokenizing at its
         * next check. It is never routed, so it leaves nothing in the
         * pending index.
         */

        ctx->task = tp;
        r->read_event_handler = ngx_http_kvroute_pool_reading;

        ngx_atomic_fetch_add(&ctx->conf->zone->sh->threaded, 1);

        ngx_http_kvroute_tq_add(ctx->conf, tp);

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

    (void) ngx_atomic_fetch_add(&t->ctx->conf->tq_started, 1);

    if (__atomic_load_n(&t->cancelled, __ATOMIC_ACQUIRE)) {
        t->skipped = 1;
        return;
    }

    kv_tokenizer_cancel_on(&t->cancelled);

    kv_prompt_compute(&t->cfg, (char *) t->body, t->len, (char *) t->salt,
                      t->salt_len, &t->result);

    kv_tokenizer_cancel_on(NULL);

    /* an encode cut short fails as if out of memory; the result is
     * discarded either way */
    t->interrupted = __atomic_load_n(&t->cancelled, __ATOMIC_ACQUIRE)
                     && t->result.status == KV_PROMPT_NO_MEMORY;
}


/* While the task is in the pool: notice a client that closes. */

static void
ngx_http_kvroute_pool_reading(ngx_http_request_t *r)
{
    ngx_http_kvroute_ctx_t       *ctx;
    ngx_http_kvroute_task_t      *t;
    ngx_http_kvroute_srv_conf_t  *kcf;

    ctx = ngx_http_get_module_ctx(r, ngx_http_kvroute_module);
    t = ctx ? ctx->task : NULL;

    ngx_http_test_reading(r);

    if (t == NULL || !r->connection->error) {
        return;
    }

    if (t->posted) {
        __atomic_store_n(&t->cancelled, 1, __ATOMIC_RELEASE);
        return;
    }

    /* still in kvroute's queue: dropped now, its place goes to the next */

    kcf = t->ctx->conf;
    ngx_atomic_fetch_add(&kcf->zone->sh->threaded_cancelled, 1);

    ngx_http_kvroute_tq_unqueue(t);
    ngx_http_kvroute_task_gone(t);
    ngx_http_kvroute_tq_pump(kcf);
}


static void
ngx_http_kvroute_thread_event_handler(ngx_event_t *ev)
{
    ngx_connection_t             *c;
    ngx_http_request_t           *r;
    ngx_http_kvroute_task_t      *t = ev->data;
    ngx_http_kvroute_sh_t        *sh;
    ngx_http_kvroute_srv_conf_t  *kcf;

    r = t->request;
    c = r->connection;
    kcf = t->ctx->conf;
    sh = kcf->zone->sh;

    /* its share of the budget goes to the next in the queue first */

    kcf->tq_bytes -= t->len;
    (void) ngx_atomic_fetch_add(&sh->tokenize_bytes, - (ngx_atomic_int_t) t->len);

    if (t->skipped) {
        ngx_atomic_fetch_add(&sh->threaded_cancelled, 1);
    }

    if (t->interrupted) {
        ngx_atomic_fetch_add(&sh->tokenize_interrupted, 1);
    }

    ngx_http_kvroute_tq_pump(kcf);

    if (c->error || r->done) {
        ngx_http_kvroute_task_gone(t);
        return;
    }

    ngx_http_kvroute_task_release(t);

    ngx_http_kvroute_finish(t);
    ngx_http_kvroute_resume(r, t->ctx);
    ngx_http_run_posted_requests(c);
}


/* The request no longer waits on the task (done, dropped, fallen back). */

static void
ngx_http_kvroute_task_release(ngx_http_kvroute_task_t *t)
{
    ngx_http_request_t  *r = t->request;

    if (t->hold.timer_set) {
        ngx_del_timer(&t->hold);
    }

    r->main->blocked--;
    r->aio = 0;
    t->ctx->task = NULL;
    r->read_event_handler = ngx_http_block_reading;
}


/* Terminated meanwhile (the client went): finish as nginx's own thread
 * handlers do, with nothing routed. */

static void
ngx_http_kvroute_task_gone(ngx_http_kvroute_task_t *t)
{
    ngx_connection_t    *c;
    ngx_http_request_t  *r = t->request;

    c = r->connection;

    ngx_http_kvroute_task_release(t);
    kv_prompt_free(&t->result);

    if (r->done) {
        c->write->handler(c->write);

    } else {
        r->write_event_handler(r);
        ngx_http_run_posted_requests(c);
    }
}


static void
ngx_http_kvroute_tq_add(ngx_http_kvroute_srv_conf_t *kcf,
    ngx_http_kvroute_task_t *t)
{
    ngx_queue_t              *q;
    ngx_http_kvroute_task_t  *o;

    if (kcf->tq.next == NULL) {
        ngx_queue_init(&kcf->tq);
    }

    t->since = ngx_current_msec;
    t->key = t->since + (ngx_msec_t) (t->len >> NGX_HTTP_KVROUTE_TQ_AGE_SHIFT);

    /* after every key not above its own: FIFO among equals (keys are
     * fixed, so one sorted insertion keeps the order) */

    for (q = ngx_queue_last(&kcf->tq);
         q != ngx_queue_sentinel(&kcf->tq);
         q = ngx_queue_prev(q))
    {
        o = ngx_queue_data(q, ngx_http_kvroute_task_t, queue);

        if ((ngx_msec_int_t) (o->key - t->key) <= 0) {
            break;
        }
    }

    ngx_queue_insert_after(q, &t->queue);
    ngx_atomic_fetch_add(&kcf->zone->sh->tokenize_queued, 1);

    ngx_add_timer(&t->hold, kcf->tokenize_wait ? kcf->tokenize_wait : 60000);

    ngx_http_kvroute_tq_pump(kcf);
}


static void
ngx_http_kvroute_tq_unqueue(ngx_http_kvroute_task_t *t)
{
    ngx_queue_remove(&t->queue);
    (void) ngx_atomic_fetch_add(&t->ctx->conf->zone->sh->tokenize_queued, -1);
}


/*
 * Posts the queue's head while it fits the budget and no posted task is
 * still waiting for a thread: what waits in nginx's FIFO is out of the
 * queue's order, so at most one does (the thread count is not known here;
 * every completion pumps again, so the pool never idles with a queue).
 */

static void
ngx_http_kvroute_tq_pump(ngx_http_kvroute_srv_conf_t *kcf)
{
    ngx_queue_t              *q;
    ngx_atomic_uint_t         peak;
    ngx_http_kvroute_sh_t    *sh = kcf->zone->sh;
    ngx_http_kvroute_task_t  *t;

    while (kcf->tq.next && !ngx_queue_empty(&kcf->tq)) {
        q = ngx_queue_head(&kcf->tq);
        t = ngx_queue_data(q, ngx_http_kvroute_task_t, queue);

        if (kcf->tokenize_budget && kcf->tq_bytes
            && kcf->tq_bytes + t->len > kcf->tokenize_budget)
        {
            return;
        }

        if (kcf->tokenize_budget
            && kcf->tq_posted != ngx_atomic_fetch_add(&kcf->tq_started, 0))
        {
            /* a thread may be free once it has taken that one: look again
             * soon rather than at the next completion */

            if (!kcf->tq_retry.timer_set) {
                kcf->tq_retry.handler = ngx_http_kvroute_tq_retry;
                kcf->tq_retry.data = kcf;
                kcf->tq_retry.log = ngx_cycle->log;
                kcf->tq_retry.cancelable = 1;
                ngx_add_timer(&kcf->tq_retry, 5);
            }

            return;
        }

        ngx_http_kvroute_tq_unqueue(t);

        if (ngx_thread_task_post(kcf->thread_pool, t->thread) != NGX_OK) {

            /* the pool's own queue is full (max_queue): by load */

            ngx_http_kvroute_tq_fallback(t);
            continue;
        }

        t->posted = 1;
        kcf->tq_posted++;
        kcf->tq_bytes += t->len;
        ngx_atomic_fetch_add(&sh->tokenize_bytes, t->len);

        for (peak = sh->tokenize_bytes_peak;
             peak < kcf->tq_bytes
             && !ngx_atomic_cmp_set(&sh->tokenize_bytes_peak, peak,
                                    kcf->tq_bytes);
             peak = sh->tokenize_bytes_peak)
        {
            /* void */
        }

        if (t->hold.timer_set) {
            ngx_del_timer(&t->hold);
        }

        ngx_add_timer(&t->hold, 60000);
    }
}


/*
 * Waited past tokenize_wait (or the pool refused it): routed by load. The
 * body is still parsed, on the event loop (a fraction of tokenizing's
 * cost): token-id prompts route as usual, max_tokens, stream and session
 * are read, and salt= can still be written into the body.
 */

static void
ngx_http_kvroute_tq_fallback(ngx_http_kvroute_task_t *t)
{
    ngx_connection_t        *c;
    ngx_http_request_t      *r = t->request;
    ngx_http_kvroute_ctx_t  *ctx = t->ctx;

    c = r->connection;

    /*
     * terminated while queued without a read event to say so (a worker
     * shutting down past worker_shutdown_timeout): finish, do not proxy
     * a request nginx already gave up on
     */

    if (c->error || r->done) {
        ngx_http_kvroute_task_gone(t);
        return;
    }

    ngx_http_kvroute_task_release(t);

    t->cfg.tokenizer = NULL;
    t->cfg.chat = NULL;
    t->cfg.turns = NULL;

    kv_prompt_compute(&t->cfg, (char *) t->body, t->len, (char *) t->salt,
                      t->salt_len, &t->result);
    ngx_http_kvroute_finish(t);

    if (ctx->fallback == NGX_HTTP_KVROUTE_FB_NO_TOKENIZER
        || ctx->fallback == NGX_HTTP_KVROUTE_FB_NO_TEMPLATE)
    {
        ctx->fallback = NGX_HTTP_KVROUTE_FB_TOKENIZE_WAIT;
        ctx->prompt_tokens = t->len / 4;    /* estimated, as max_tokenize's */
    }

    ngx_log_error(NGX_LOG_INFO, c->log, 0,
                  "kvroute: prompt of %uz bytes waited %M ms for "
                  "tokenization: routing by load only", t->len,
                  (ngx_msec_t) (ngx_current_msec - t->since));

    ngx_http_kvroute_resume(r, ctx);
    ngx_http_run_posted_requests(c);
}

#endif


#if (NGX_THREADS)

static void
ngx_http_kvroute_tq_retry(ngx_event_t *ev)
{
    ngx_http_kvroute_tq_pump(ev->data);
}

#endif


#if (NGX_THREADS)

/* In the queue past tokenize_wait: by load. In the pool after a minute:
 * keep holding the worker. */

static void
ngx_http_kvroute_hold_handler(ngx_event_t *ev)
{
    ngx_http_kvroute_task_t      *t = ev->data;
    ngx_http_kvroute_srv_conf_t  *kcf = t->ctx->conf;

    if (t->posted || kcf->tokenize_wait == 0) {
        ngx_add_timer(ev, 60000);
        return;
    }

    ngx_http_kvroute_tq_unqueue(t);
    ngx_http_kvroute_tq_fallback(t);

    /* the head may have been the one that did not fit */
    ngx_http_kvroute_tq_pump(kcf);
}

#endif


/* Synchronous preparation, for init_peer when the precontent phase did not
 * see the request. */

ngx_int_t
ngx_http_kvroute_prepare(ngx_http_request_t *r, ngx_http_kvroute_ctx_t *ctx)
{
    ngx_http_kvroute_task_t       t;
    ngx_http_kvroute_loc_conf_t  *klcf;

    klcf = ngx_http_get_module_loc_conf(r, ngx_http_kvroute_module);

    if (klcf->upstream == NULL && !klcf->warned
        && r == r->main && r->method == NGX_HTTP_POST)
    {
        klcf->warned = 1;
        ngx_log_error(NGX_LOG_WARN, r->connection->log, 0,
                      "kvroute: a location without \"kvroute_upstream %V;\" "
                      "proxies to it: its prompts are prepared on the event "
                      "loop once the request to the server is built",
                      &ctx->conf->upstream_name);
    }

    if (ngx_http_kvroute_task_init(r, ctx, &t) != NGX_OK) {
        return NGX_OK;
    }

    /*
     * The request to the server is already built here: the body cannot be
     * rewritten, so the operator's salt cannot reach the engine. Sending
     * the client's own cache_salt instead would let it name another
     * tenant's: refuse.
     */

    if (t.cfg.salt_combine) {
        ngx_log_error(NGX_LOG_ERR, r->connection->log, 0,
                      "kvroute: salt= needs \"kvroute_upstream %V;\" in the "
                      "location (the body is rewritten before proxying): "
                      "refused", &ctx->conf->upstream_name);
        return NGX_ERROR;
    }

    kv_prompt_compute(&t.cfg, (char *) t.body, t.len, (char *) t.salt,
                      t.salt_len, &t.result);
    ngx_http_kvroute_finish(&t);

    return NGX_OK;
}


/*
 * The operator's session key (kvroute session=VALUE, e.g. a header), when
 * it is set and not empty; the body's prompt_cache_key and user come after
 * it (ngx_http_kvroute_finish). Read even when the body cannot be, so a
 * request routed by load alone still goes to its session's home.
 */

static void
ngx_http_kvroute_session_header(ngx_http_request_t *r,
    ngx_http_kvroute_ctx_t *ctx)
{
    ngx_str_t                     v;
    ngx_http_kvroute_srv_conf_t  *kcf = ctx->conf;

    if (kcf->session == NULL || kcf->session_off) {
        return;
    }

    if (ngx_http_complex_value(r, kcf->session, &v) == NGX_OK && v.len) {
        ctx->session = kv_body_session_key((char *) v.data, v.len);
    }
}


/*
 * Collects the body into one buffer (pointing into nginx's own when it is
 * one memory buffer), picks the upstream by the body's model when the
 * location lists several, and takes that upstream's settings and salt; on
 * NGX_DECLINED the request falls back with ctx->fallback set.
 */

static ngx_int_t
ngx_http_kvroute_task_init(ngx_http_request_t *r, ngx_http_kvroute_ctx_t *ctx,
    ngx_http_kvroute_task_t *t)
{
    ngx_int_t  rc;

    ngx_memzero(t, sizeof(ngx_http_kvroute_task_t));

    /* the decision starts with the whole body in hand: reading it is the
     * client's time, not the router's */
    ctx->t0_ns = ngx_http_kvroute_now_ns();
    ctx->prepared = 1;

    t->request = r;
    t->ctx = ctx;

    rc = ngx_http_kvroute_task_body(r, ctx, t);

    if (rc == NGX_OK) {
        rc = ngx_http_kvroute_choose(r, ctx, t);
    }

    ngx_http_kvroute_task_config(r, ctx, t);

    if (rc != NGX_OK) {
        return rc;
    }

    return ngx_http_kvroute_task_salt(r, ctx, t);
}


static ngx_int_t
ngx_http_kvroute_task_body(ngx_http_request_t *r, ngx_http_kvroute_ctx_t *ctx,
    ngx_http_kvroute_task_t *t)
{
    u_char       *p;
    size_t        len;
    ssize_t       n;
    ngx_buf_t    *b;
    ngx_chain_t  *cl;

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
        t->len = len;
        return NGX_OK;
    }

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

        /* a chunked body ends in an empty buffer with no memory at all */

        if (b->last != b->pos) {
            p = ngx_cpymem(p, b->pos, b->last - b->pos);
        }
    }

    t->len = len;

    return NGX_OK;
}


/*
 * "kvroute_upstream A B ...": the first upstream whose model= or lora=
 * serves the body's model (no model: the first listed), as an engine
 * fronting several models would pick one. A body that cannot be read stays
 * with the first, where it falls back as usual; a model none serves is
 * answered 404 model_not_found before anything is proxied.
 */

static ngx_int_t
ngx_http_kvroute_choose(ngx_http_request_t *r, ngx_http_kvroute_ctx_t *ctx,
    ngx_http_kvroute_task_t *t)
{
    char                               model[128];
    ngx_uint_t                         i;
    ngx_http_kvroute_srv_conf_t       *kcf;
    ngx_http_kvroute_loc_conf_t       *klcf;
    ngx_http_kvroute_upstream_ref_t  **refs;

    klcf = ngx_http_get_module_loc_conf(r, ngx_http_kvroute_module);

    /* only in the precontent phase (status NGX_DONE while the body is
     * read): in init_peer the upstream is already the one proxied to */

    if (klcf->choices == NULL || ctx->status != NGX_DONE) {
        return NGX_OK;
    }

    if (kv_body_model((char *) t->body, t->len, model, sizeof(model), NULL, 0)
        != 0)
    {
        return NGX_OK;
    }

    refs = klcf->choices->elts;

    for (i = 0; i < klcf->choices->nelts; i++) {
        kcf = refs[i]->conf;

        if (kv_model_role((char *) kcf->model.data, (char *) kcf->lora.data,
                          model)
            != KV_MODEL_OTHER)
        {
            ctx->conf = kcf;
            return NGX_OK;
        }
    }

    ngx_log_error(NGX_LOG_INFO, r->connection->log, 0,
                  "kvroute: no upstream of this location serves the "
                  "model \"%s\": 404", model);

    ctx->no_model = 1;
    ctx->fallback = NGX_HTTP_KVROUTE_FB_MODEL;
    ctx->salt_status = NGX_HTTP_NOT_FOUND;

    return NGX_DECLINED;
}


/* The chosen upstream's settings for kv_prompt, and the operator's
 * session key (read even when the body cannot be). */

static void
ngx_http_kvroute_task_config(ngx_http_request_t *r,
    ngx_http_kvroute_ctx_t *ctx, ngx_http_kvroute_task_t *t)
{
    ngx_http_kvroute_srv_conf_t  *kcf = ctx->conf;

    t->cfg.tokenizer = kcf->tokenizer;
    t->cfg.chat = kcf->template;
    t->cfg.chat_engine = (kv_chat_engine_t) kcf->chat_engine;
    t->cfg.chat_kwargs = kcf->chat_kwargs.len ? (char *) kcf->chat_kwargs.data
                                              : NULL;
    t->cfg.model = (char *) kcf->model.data;    /* C strings, or NULL */
    t->cfg.lora = (char *) kcf->lora.data;
    t->cfg.block_size = kcf->block_size;
    t->cfg.max_tokenize = kcf->max_tokenize;
    t->cfg.api = kv_api_of_path((char *) r->uri.data, r->uri.len);

    /* the zone's turn cache: set before any task of this worker can use it */
    if (kcf->turn.cache == NULL && kcf->bounds && kcf->zone->sh->turns) {
        kcf->turn.bounds = kcf->bounds;
        kcf->turn.cache = kcf->zone->sh->turns;
    }

    t->cfg.turns = kcf->turn.cache ? &kcf->turn : NULL;

    ngx_http_kvroute_session_header(r, ctx);
}


static ngx_int_t
ngx_http_kvroute_task_salt(ngx_http_request_t *r, ngx_http_kvroute_ctx_t *ctx,
    ngx_http_kvroute_task_t *t)
{
    ngx_str_t                     salt;
    ngx_http_kvroute_srv_conf_t  *kcf = ctx->conf;

    if (kcf->salt && ngx_http_kvroute_events_zmq(kcf->zone->events_conf)) {

        /* ZMQ (vLLM) events: salt= is the LoRA seed, used as it was */

        if (ngx_http_complex_value(r, kcf->salt, &salt) == NGX_OK
            && salt.len)
        {
            t->salt = salt.data;
            t->salt_len = salt.len;
        }

    } else if (kcf->salt) {

        /* combined with the client's, even when empty: "0:" + the
         * client's can never be another tenant's value */

        if (ngx_http_complex_value(r, kcf->salt, &salt) != NGX_OK) {
            ctx->fallback = NGX_HTTP_KVROUTE_FB_NO_MEMORY;
            return NGX_DECLINED;
        }

        t->salt = salt.data;
        t->salt_len = salt.len;
        t->cfg.salt_combine = 1;
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

    if (t->cfg.salt_combine) {
        if (!t->result.parsed || t->result.status == KV_PROMPT_NO_MEMORY
            || ((t->result.salt || t->result.n_salts)
                && ngx_http_kvroute_salt_rewrite(t) != NGX_OK))
        {
            /* the engine would read the client's salt: not sent */
            ngx_log_error(NGX_LOG_INFO, t->request->connection->log, 0,
                          "kvroute: salt= cannot be applied: %s",
                          t->result.parsed ? "out of memory" : t->result.err);
            ctx->salt_status = t->result.parsed
                               ? NGX_HTTP_INTERNAL_SERVER_ERROR
                               : NGX_HTTP_BAD_REQUEST;
        }

        free(t->result.salt);
        t->result.salt = NULL;
    }

    ctx->prompt_tokens = t->result.prompt_tokens;
    ctx->turn_cached_tokens = t->result.turn_cached_tokens;
    ctx->max_tokens = t->result.max_tokens > 0 ? t->result.max_tokens : 0;
    ctx->sequences = (uint32_t) t->result.sequences;
    ctx->batch_tokens = t->result.batch_tokens;
    ctx->prefill_only = t->result.prefill_only ? 1 : 0;
    ctx->preamble = t->result.preamble && t->result.stream ? 1 : 0;
    ctx->stream = t->result.stream ? 1 : 0;
    ctx->responses = t->result.preamble ? 1 : 0;
    ctx->prev_response = t->result.prev_response;

    /* the operator's session= value, when it has one, comes first */
    if (ctx->session == 0 && !ctx->conf->session_off) {
        ctx->session = t->result.session;
    }
    ctx->seq = t->result.seq;
    ctx->nseq = t->result.nseq;

    ngx_log_debug4(NGX_LOG_DEBUG_HTTP, t->request->connection->log, 0,
                   "kvroute prompt: %uz blocks, %uL tokens (%uL from the turn "
                   "cache), fallback \"%s\"", ctx->nseq, ctx->prompt_tokens,
                   ctx->turn_cached_tokens,
                   ngx_http_kvroute_fallback_names[ctx->fallback]);

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


/*
 * salt=: the proxied body carries the combined salt as its only cache_salt
 * value. Every top-level cache_salt member's value is replaced (an engine
 * may honour any duplicate; null when there is no salt at all), or one
 * member is inserted first; the body
 * becomes one memory buffer and Content-Length follows. Works for bodies
 * in memory and in temp files alike (t->body holds the whole body).
 */

static ngx_int_t
ngx_http_kvroute_salt_rewrite(ngx_http_kvroute_task_t *t)
{
    u_char               *p, *q;
    size_t                len, qlen, at, i;
    ngx_buf_t            *b;
    ngx_chain_t          *cl;
    kv_prompt_t          *res = &t->result;
    ngx_table_elt_t      *h;
    ngx_http_request_t   *r = t->request;
    ngx_uint_t            empty;

    static const char     key[] = "\"cache_salt\":";

    qlen = res->salt ? kv_prompt_json_string(res->salt, res->salt_len, NULL)
                     : sizeof("null") - 1;
    empty = 0;

    if (res->n_salts == 0) {
        for (p = t->body + res->obj_open; p < t->body + t->len; p++) {
            if (*p != ' ' && *p != '\t' && *p != '\r' && *p != '\n') {
                break;
            }
        }

        empty = p < t->body + t->len && *p == '}';
        len = t->len + sizeof(key) - 1 + qlen + (empty ? 0 : 1);

    } else {
        len = t->len;

        for (i = 0; i < res->n_salts; i++) {
            len = len - res->salt_len_raw[i] + qlen;
        }
    }

    b = ngx_create_temp_buf(r->pool, len);
    if (b == NULL) {
        return NGX_ERROR;
    }

    q = ngx_pnalloc(r->pool, qlen);
    if (q == NULL) {
        return NGX_ERROR;
    }

    if (res->salt) {
        (void) kv_prompt_json_string(res->salt, res->salt_len, (char *) q);

    } else {
        ngx_memcpy(q, "null", qlen);
    }

    p = b->pos;

    if (res->n_salts == 0) {
        p = ngx_cpymem(p, t->body, res->obj_open);
        p = ngx_cpymem(p, key, sizeof(key) - 1);
        p = ngx_cpymem(p, q, qlen);

        if (!empty) {
            *p++ = ',';
        }

        p = ngx_cpymem(p, t->body + res->obj_open, t->len - res->obj_open);

    } else {
        at = 0;

        for (i = 0; i < res->n_salts; i++) {
            p = ngx_cpymem(p, t->body + at, res->salt_off[i] - at);
            p = ngx_cpymem(p, q, qlen);
            at = res->salt_off[i] + res->salt_len_raw[i];
        }

        p = ngx_cpymem(p, t->body + at, t->len - at);
    }

    b->last = p;
    b->last_buf = 1;

    cl = ngx_alloc_chain_link(r->pool);
    if (cl == NULL) {
        return NGX_ERROR;
    }

    cl->buf = b;
    cl->next = NULL;

    r->request_body->bufs = cl;
    r->headers_in.content_length_n = len;

    h = r->headers_in.content_length;

    if (h) {
        h->value.data = ngx_pnalloc(r->pool, NGX_OFF_T_LEN);
        if (h->value.data == NULL) {
            return NGX_ERROR;
        }

        h->value.len = ngx_sprintf(h->value.data, "%O", (off_t) len)
                       - h->value.data;
    }

    return NGX_OK;
}
