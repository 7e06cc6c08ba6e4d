#include "kvw_nats.h"
#include "kv_clock.h"
#include "kv_hash.h"
#include "kv_proto.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include <event2/buffer.h>
#include <jansson.h>
#include <nats/nats.h>
#include <xxhash.h>

#include "kvw_blocks.h"
#include "kvw_sched.h"

#define DUMP_CHUNK 4096

/* Per engine: its identity and its event stream. */
typedef struct {
    struct kvw_nats    *k;
    kvw_engine_t       *e;
    uint64_t            last_event_id;
    struct evbuffer    *pending;        /* rendered events of this step, comma-separated */
    int                 n_pending;
    char                address[300];
    char                subj_events[330], subj_heartbeat[330];
    natsSubscription   *sub_dump;       /* P.kvroute.dump.<its id>: only its own */
    uint64_t            dump_window_ms; /* rate limit: start of the current second */
    int                 dumps_in_window;
    /* --load-ms: the load last published, when, and the timer that
     * publishes a change made within load_ms of it */
    uint64_t            sent_ms, sent_prefill;
    uint32_t            sent_waiting, sent_running;
    struct event       *load_timer;
} pub_t;

/* A dump is the whole cache (megabytes), and anyone who can publish can
 * ask for one: not to any subject, nor as often as asked. Replies go
 * only to inbox subjects, and at most DUMPS_PER_S per second per engine
 * (several routers resyncing at once after a restart fit; a router whose
 * request is dropped times out and asks again). */
#define DUMPS_PER_S 8

/* Work handed from cnats threads to the loop. */
typedef struct job {
    struct job *next;
    int         kind;                   /* JOB_ANNOUNCE, JOB_DUMP, JOB_RENEW */
    char       *subject, *reply;
    char       *data;
} job_t;

enum { JOB_ANNOUNCE, JOB_DUMP, JOB_RENEW };

struct kvw_nats {
    const kvw_config_t *cfg;
    natsConnection     *nc;
    natsOptions        *opts;
    natsSubscription   *sub_discover;
    pub_t              *pubs;
    int                 n;
    uint64_t            instance_id;
    char                prefix[256];
    struct event       *wake, *heartbeat;
    pthread_mutex_t     lock;
    job_t              *jobs, *jobs_tail;
    uint64_t            publish_errors;
    uint64_t            dumps_refused;
    int                 queued_dumps;   /* under lock */
    int                 stopping;       /* under lock: closed is ours, not a failure */
    struct event       *renew;          /* a new connection after cnats gave up */
    int                 renew_ms;       /* its backoff */
    uint64_t            renewals;
};

static natsStatus nats_connect(struct kvw_nats *k);
static void report_load(pub_t *p);

uint64_t kvw_worker_id_for(const char *host, int port)
{
    char buf[300];
    int n = snprintf(buf, sizeof(buf), "%s:%d", host, port);
    /* the same id the router assumes for an unannounced server (kv_hash.h) */
    return kv_hash_worker_id(buf, (size_t)n);
}

void kvw_nats_redact(const char *url, char *out, size_t n)
{
    const char *sep = strstr(url, "://");
    const char *host = sep ? sep + 3 : url;
    const char *at = strrchr(host, '@');
    if (at == NULL)
        snprintf(out, n, "%s", url);
    else
        snprintf(out, n, "%.*s***%s", (int)(host - url), url, at);
}

static uint64_t random_id(void)
{
    uint64_t v = 0;
    if (getrandom(&v, sizeof(v), 0) != (ssize_t)sizeof(v)) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        v = XXH3_64bits(&ts, sizeof(ts)) ^ (uint64_t)getpid();
    }
    v &= 0x7fffffffffffffffULL;
    return v ? v : 1;
}

static void publish(struct kvw_nats *k, const char *subj, struct evbuffer *b)
{
    size_t len = evbuffer_get_length(b);
    const char *data = (const char *)evbuffer_pullup(b, -1);
    if (natsConnection_Publish(k->nc, subj, data, (int)len) != NATS_OK)
        k->publish_errors++;    /* the event_ids stay spent: routers see the gap */
}

/* --- from cnats threads --------------------------------------------------- */

static void queue_job(struct kvw_nats *k, job_t *j)
{
    pthread_mutex_lock(&k->lock);
    if (k->jobs_tail) k->jobs_tail->next = j; else k->jobs = j;
    k->jobs_tail = j;
    pthread_mutex_unlock(&k->lock);
    event_active(k->wake, EV_READ, 0);
}

static void on_discover(natsConnection *nc, natsSubscription *sub, natsMsg *msg, void *arg)
{
    job_t *j = calloc(1, sizeof(*j));
    if (j) {
        j->kind = JOB_ANNOUNCE;
        queue_job(arg, j);
    }
    natsMsg_Destroy(msg);
}

static void on_dump(natsConnection *nc, natsSubscription *sub, natsMsg *msg, void *arg)
{
    job_t *j = calloc(1, sizeof(*j));
    const char *reply = natsMsg_GetReply(msg);

    struct kvw_nats *k = arg;
    int full;
    pthread_mutex_lock(&k->lock);
    full = k->queued_dumps >= 64;       /* a flood of requests must not queue without bound */
    if (!full)
        k->queued_dumps++;
    pthread_mutex_unlock(&k->lock);
    if (j && reply && !full) {
        j->kind = JOB_DUMP;
        j->subject = strdup(natsMsg_GetSubject(msg));
        j->reply = strdup(reply);
        j->data = strndup(natsMsg_GetData(msg) ? natsMsg_GetData(msg) : "",
                          (size_t)natsMsg_GetDataLength(msg));
        queue_job(arg, j);
    } else {
        if (!full) {
            pthread_mutex_lock(&k->lock);
            k->queued_dumps--;
            pthread_mutex_unlock(&k->lock);
        }
        free(j);
    }
    natsMsg_Destroy(msg);
}

/*
 * cnats closes a connection whose very first handshake was cut (the server
 * accepted, then died before its PONG), even with RetryOnFailedConnect and
 * unlimited reconnects: its reconnect loop stops after that one attempt.
 * Nothing would ever reconnect, so the worker would serve HTTP unannounced
 * for good (docs/PROTOCOL.md). A close we did not ask for makes the loop
 * build a new connection.
 */
static void on_closed(natsConnection *nc, void *arg)
{
    struct kvw_nats *k = arg;
    int stopping;

    pthread_mutex_lock(&k->lock);
    stopping = k->stopping;
    pthread_mutex_unlock(&k->lock);
    if (stopping)
        return;
    job_t *j = calloc(1, sizeof(*j));
    if (j) {
        j->kind = JOB_RENEW;
        queue_job(arg, j);
    }
}

static void on_connected(natsConnection *nc, void *arg)
{
    job_t *j = calloc(1, sizeof(*j));
    if (j) {
        j->kind = JOB_ANNOUNCE;
        queue_job(arg, j);
    }
}

/* --- on the loop ------------------------------------------------------------ */

static void render_event(pub_t *p, const kvw_event_t *ev)
{
    struct evbuffer *b = p->pending;

    if (p->n_pending++ > 0)
        evbuffer_add(b, ",", 1);
    evbuffer_add_printf(b, "{\"worker_id\":%" PRIu64 ",\"storage_tier\":\"device\","
                        "\"event\":{\"event_id\":%" PRIu64 ",\"data\":",
                        p->e->worker_id, ++p->last_event_id);
    if (ev->kind == KVW_EV_CLEARED) {
        evbuffer_add_printf(b, "\"" KV_PROTO_CLEARED "\"");
    } else if (ev->kind == KVW_EV_REMOVED) {
        evbuffer_add_printf(b, "{\"" KV_PROTO_REMOVED "\":{\"block_hashes\":[");
        for (size_t i = 0; i < ev->n; i++)
            evbuffer_add_printf(b, "%s%" PRIu64, i ? "," : "", ev->hashes[i]);
        evbuffer_add_printf(b, "]}}");
    } else {
        if (ev->has_parent)
            evbuffer_add_printf(b, "{\"" KV_PROTO_STORED "\":{\"parent_hash\":%" PRIu64,
                                ev->parent);
        else
            evbuffer_add_printf(b, "{\"" KV_PROTO_STORED "\":{\"parent_hash\":null");
        evbuffer_add_printf(b, ",\"start_position\":null,\"blocks\":[");
        for (size_t i = 0; i < ev->n; i++)
            evbuffer_add_printf(b, "%s{\"block_hash\":%" PRIu64 ",\"tokens_hash\":%" PRIu64
                                ",\"mm_extra_info\":null}", i ? "," : "",
                                ev->hashes[i], ev->locals[i]);
        evbuffer_add_printf(b, "]}}");
    }
    evbuffer_add_printf(b, ",\"dp_rank\":0}}");
}

static void on_event(void *ctx, const kvw_event_t *ev)
{
    render_event(ctx, ev);
}

/* One message per step: the event alone, or a JSON array of them. */
static void publish_pending(pub_t *p)
{
    if (p->n_pending == 0)
        return;
    if (p->n_pending > 1) {
        evbuffer_prepend(p->pending, "[", 1);
        evbuffer_add(p->pending, "]", 1);
    }
    publish(p->k, p->subj_events, p->pending);
    evbuffer_drain(p->pending, evbuffer_get_length(p->pending));
    p->n_pending = 0;
}

static void on_step(void *ctx, kvw_engine_t *e)
{
    publish_pending(ctx);
    report_load(ctx);
}

static void send_heartbeat(pub_t *p, const char *type)
{
    struct kvw_nats *k = p->k;
    kvw_sched_load_t l;
    struct timespec ts;
    struct evbuffer *b;

    if (p->e->unhealthy)
        return;             /* a lost engine goes silent: routers expire it and stop sending */
    b = evbuffer_new();
    publish_pending(p);     /* last_event_id must name only published events */
    kvw_sched_load(p->e, &l);
    clock_gettime(CLOCK_REALTIME, &ts);
    json_t *model = json_string(k->cfg->model);
    char *model_s = json_dumps(model, JSON_ENCODE_ANY);
    evbuffer_add_printf(b, "{\"type\":\"%s\",\"worker_id\":%" PRIu64 ",\"dp_rank\":0,"
                        "\"instance_id\":%" PRIu64 ",\"address\":\"%s\",\"model\":%s,"
                        "\"block_size\":%u,\"num_blocks\":%u,\"last_event_id\":%" PRIu64 ","
                        "\"interval_ms\":%d,\"ts_ms\":%" PRIu64 ",\"load\":{"
                        "\"active_prefill_tokens\":%" PRIu64 ",\"active_decode_blocks\":%u,"
                        "\"kv_used_blocks\":%u,\"waiting\":%u,\"running\":%u,"
                        "\"max_num_batched_tokens\":%d,\"max_num_seqs\":%d}}",
                        type, p->e->worker_id, k->instance_id, p->address,
                        model_s ? model_s : "\"\"", l.block_size, l.num_blocks,
                        p->last_event_id, k->cfg->heartbeat_ms,
                        (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000,
                        l.active_prefill_tokens, l.active_decode_blocks, l.kv_used_blocks,
                        l.waiting, l.running, k->cfg->max_num_batched_tokens,
                        k->cfg->max_num_seqs);
    free(model_s);
    json_decref(model);
    publish(k, p->subj_heartbeat, b);
    evbuffer_free(b);
    p->sent_ms = kv_clock_ms();
    p->sent_prefill = l.active_prefill_tokens;
    p->sent_waiting = l.waiting;
    p->sent_running = l.running;
}

/*
 * --load-ms: a heartbeat as soon as an engine's load changed, at most one
 * per load_ms, and the last change within that window when it ends.
 * Routers in front of the same engine see only their own requests in
 * flight; with worker_load=max the rest comes from the worker's report,
 * which the periodic heartbeat leaves up to a whole interval old
 * (docs/BENCHMARKS.md, "Scale-out round 4").
 */
static void report_load(pub_t *p)
{
    kvw_sched_load_t l;
    uint64_t now, due;

    if (p->k->cfg->load_ms <= 0 || p->load_timer == NULL || p->e->unhealthy)
        return;
    kvw_sched_load(p->e, &l);
    if (l.active_prefill_tokens == p->sent_prefill && l.waiting == p->sent_waiting
        && l.running == p->sent_running)
        return;
    now = kv_clock_ms();
    due = p->sent_ms + (uint64_t)p->k->cfg->load_ms;
    if (now >= due) {
        send_heartbeat(p, KV_PROTO_TICK);
    } else if (!evtimer_pending(p->load_timer, NULL)) {
        struct timeval tv = { (time_t)((due - now) / 1000),
                              (suseconds_t)((due - now) % 1000) * 1000 };
        evtimer_add(p->load_timer, &tv);
    }
}

static void on_load_timer(evutil_socket_t fd, short what, void *arg)
{
    report_load(arg);
}

static void on_heartbeat(evutil_socket_t fd, short what, void *arg)
{
    struct kvw_nats *k = arg;
    for (int i = 0; i < k->n; i++)
        send_heartbeat(&k->pubs[i], KV_PROTO_TICK);
}

static pub_t *pub_for_subject(struct kvw_nats *k, const char *subject)
{
    const char *dot = strrchr(subject, '.');
    char *end;

    if (dot == NULL)
        return NULL;
    uint64_t id = strtoull(dot + 1, &end, 10);
    if (*end != '\0')
        return NULL;
    for (int i = 0; i < k->n; i++)
        if (k->pubs[i].e->worker_id == id)
            return &k->pubs[i];
    return NULL;
}

/* One consistent snapshot, published in chunks before the loop moves on. */
static void answer_dump(struct kvw_nats *k, job_t *j)
{
    pub_t *p = pub_for_subject(k, j->subject);
    json_t *req = json_loads(j->data, 0, NULL);
    json_t *rank = json_object_get(req, "dp_rank");
    int ok = p != NULL && (rank == NULL || json_integer_value(rank) == 0);

    json_decref(req);
    if (!ok || strncmp(j->reply, "_INBOX.", 7) != 0)
        return;
    uint64_t now = kv_clock_ms();
    if (now >= p->dump_window_ms + 1000) {
        p->dump_window_ms = now;
        p->dumps_in_window = 0;
    }
    if (++p->dumps_in_window > DUMPS_PER_S) {
        k->dumps_refused++;
        return;
    }
    size_t n = 0;
    kvw_dump_block_t *blocks = kvw_blocks_dump(kvw_sched_blocks(p->e), &n);
    publish_pending(p);
    if (blocks == NULL)
        return;
    size_t chunks = n ? (n + DUMP_CHUNK - 1) / DUMP_CHUNK : 1;
    struct evbuffer *b = evbuffer_new();
    for (size_t c = 0; c < chunks; c++) {
        evbuffer_add_printf(b, "{\"worker_id\":%" PRIu64 ",\"dp_rank\":0,\"instance_id\":%"
                            PRIu64 ",\"last_event_id\":%" PRIu64 ",\"block_size\":%u,"
                            "\"chunk\":%zu,\"chunks\":%zu,\"blocks\":[",
                            p->e->worker_id, k->instance_id, p->last_event_id,
                            kvw_blocks_block_size(kvw_sched_blocks(p->e)), c, chunks);
        for (size_t i = c * DUMP_CHUNK; i < n && i < (c + 1) * DUMP_CHUNK; i++) {
            const kvw_dump_block_t *d = &blocks[i];
            if (i > c * DUMP_CHUNK)
                evbuffer_add(b, ",", 1);
            if (d->has_parent)
                evbuffer_add_printf(b, "[%" PRIu64 ",%" PRIu64 ",%" PRIu64 "]",
                                    d->parent, d->hash, d->local);
            else
                evbuffer_add_printf(b, "[null,%" PRIu64 ",%" PRIu64 "]", d->hash, d->local);
        }
        evbuffer_add_printf(b, "]}");
        publish(k, j->reply, b);
        evbuffer_drain(b, evbuffer_get_length(b));
    }
    evbuffer_free(b);
    free(blocks);
}

static void on_wake(evutil_socket_t fd, short what, void *arg)
{
    struct kvw_nats *k = arg;

    pthread_mutex_lock(&k->lock);
    job_t *j = k->jobs;
    k->jobs = k->jobs_tail = NULL;
    pthread_mutex_unlock(&k->lock);
    while (j) {
        job_t *next = j->next;
        if (j->kind == JOB_ANNOUNCE) {
            for (int i = 0; i < k->n; i++)
                send_heartbeat(&k->pubs[i], KV_PROTO_ANNOUNCE);
        } else if (j->kind == JOB_RENEW) {
            if (!evtimer_pending(k->renew, NULL)) {
                struct timeval tv = { k->renew_ms / 1000, (k->renew_ms % 1000) * 1000 };
                evtimer_add(k->renew, &tv);
            }
        } else {
            answer_dump(k, j);
            pthread_mutex_lock(&k->lock);
            k->queued_dumps--;
            pthread_mutex_unlock(&k->lock);
        }
        free(j->subject);
        free(j->reply);
        free(j->data);
        free(j);
        j = next;
    }
}

/* The connection and its subscriptions (k->nc may be connecting still). */
static natsStatus nats_connect(struct kvw_nats *k)
{
    char subj[320];
    natsStatus s = natsConnection_Connect(&k->nc, k->opts);

    if (s == NATS_NOT_YET_CONNECTED)
        s = NATS_OK;                /* cnats keeps trying in the background */
    if (s != NATS_OK)
        return s;
    snprintf(subj, sizeof(subj), "%s" KV_PROTO_DISCOVER, k->prefix);
    s = natsConnection_Subscribe(&k->sub_discover, k->nc, subj, on_discover, k);
    /* one dump subscription per engine, on its own id: a worker whose NATS
     * user may subscribe only to its own dump subject can do so */
    for (int i = 0; s == NATS_OK && i < k->n; i++) {
        snprintf(subj, sizeof(subj), "%s" KV_PROTO_DUMP "%" PRIu64, k->prefix,
                 k->pubs[i].e->worker_id);
        s = natsConnection_Subscribe(&k->pubs[i].sub_dump, k->nc, subj, on_dump, k);
    }
    return s;
}

static void nats_drop(struct kvw_nats *k)
{
    if (k->sub_discover)
        natsSubscription_Destroy(k->sub_discover);
    k->sub_discover = NULL;
    for (int i = 0; i < k->n; i++) {
        if (k->pubs[i].sub_dump)
            natsSubscription_Destroy(k->pubs[i].sub_dump);
        k->pubs[i].sub_dump = NULL;
    }
    if (k->nc)
        natsConnection_Destroy(k->nc);
    k->nc = NULL;
}

/* A new connection after the current pause. */
static void renew_later(struct kvw_nats *k, natsStatus s)
{
    fprintf(stderr, "kvworker: nats: %s (retrying)\n", natsStatus_GetText(s));
    nats_drop(k);
    struct timeval tv = { k->renew_ms / 1000, (k->renew_ms % 1000) * 1000 };
    evtimer_add(k->renew, &tv);
}

/* cnats closed the connection by itself: a new one, with a doubling pause
 * (250 ms to 5 s) while it keeps failing at once. Events of the meantime
 * are lost to routers as with any disconnection: they resync on announce. */
static void on_renew(evutil_socket_t fd, short what, void *arg)
{
    struct kvw_nats *k = arg;
    natsStatus s;

    nats_drop(k);
    k->renewals++;
    s = nats_connect(k);
    if (s == NATS_OK && k->nc && natsConnection_Status(k->nc) == NATS_CONN_STATUS_CONNECTED) {
        k->renew_ms = 250;
        on_connected(k->nc, k);
        return;
    }
    if (s != NATS_OK)
        renew_later(k, s);
    k->renew_ms = k->renew_ms >= 2500 ? 5000 : k->renew_ms * 2;
}

kvw_nats_t *kvw_nats_start(const kvw_config_t *cfg, struct event_base *base,
                           kvw_engine_t **engines, int n, char *err, size_t errlen)
{
    struct kvw_nats *k = calloc(1, sizeof(*k));
    natsStatus s;

    if (k == NULL || (k->pubs = calloc((size_t)n, sizeof(pub_t))) == NULL) {
        free(k);
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    k->cfg = cfg;
    k->n = n;
    k->instance_id = random_id();
    pthread_mutex_init(&k->lock, NULL);
    snprintf(k->prefix, sizeof(k->prefix), KV_PROTO_PREFIX_FMT, cfg->ns, cfg->component);
    for (int i = 0; i < n; i++) {
        pub_t *p = &k->pubs[i];
        p->k = k;
        p->e = engines[i];
        /* per-worker subjects let NATS permissions hold each worker to its
         * own (docs/SECURITY.md); shared ones are what Dynamo's routers read */
        if (cfg->nats_per_worker) {
            snprintf(p->subj_events, sizeof(p->subj_events), "%s" KV_PROTO_EVENTS ".%" PRIu64,
                     k->prefix, engines[i]->worker_id);
            snprintf(p->subj_heartbeat, sizeof(p->subj_heartbeat),
                     "%s" KV_PROTO_HEARTBEAT ".%" PRIu64, k->prefix, engines[i]->worker_id);
        } else {
            snprintf(p->subj_events, sizeof(p->subj_events), "%s" KV_PROTO_EVENTS, k->prefix);
            snprintf(p->subj_heartbeat, sizeof(p->subj_heartbeat), "%s" KV_PROTO_HEARTBEAT,
                     k->prefix);
        }
        p->pending = evbuffer_new();
        snprintf(p->address, sizeof(p->address), "%s:%d", cfg->host, engines[i]->port);
        kvw_blocks_set_sink(kvw_sched_blocks(engines[i]), on_event, p);
        kvw_sched_set_step_hook(engines[i], on_step, p);
        if (cfg->load_ms > 0)
            p->load_timer = evtimer_new(base, on_load_timer, p);
    }
    k->wake = event_new(base, -1, 0, on_wake, k);
    k->renew = evtimer_new(base, on_renew, k);
    k->renew_ms = 250;
    k->heartbeat = event_new(base, -1, EV_PERSIST, on_heartbeat, k);

    /* reconnect forever; a failed first connect keeps retrying in the background */
    if ((s = natsOptions_Create(&k->opts)) != NATS_OK
        || (s = natsOptions_SetURL(k->opts, cfg->nats_url)) != NATS_OK
        || (s = natsOptions_SetMaxReconnect(k->opts, -1)) != NATS_OK
        || (s = natsOptions_SetReconnectWait(k->opts, 250)) != NATS_OK
        || (s = natsOptions_SetReconnectBufSize(k->opts, 32 * 1024 * 1024)) != NATS_OK
        || (s = natsOptions_SetRetryOnFailedConnect(k->opts, true, on_connected, k)) != NATS_OK
        || (s = natsOptions_SetReconnectedCB(k->opts, on_connected, k)) != NATS_OK
        || (s = natsOptions_SetClosedCB(k->opts, on_closed, k)) != NATS_OK) {
        snprintf(err, errlen, "nats options: %s", natsStatus_GetText(s));
        kvw_nats_stop(k);
        return NULL;
    }
    s = nats_connect(k);
    if (s == NATS_CONNECTION_CLOSED) {
        /* the first handshake was cut within the connect call itself (the
         * server accepted and closed at once): as on_closed, a new
         * connection after a pause, not a worker that exits */
        renew_later(k, s);
        s = NATS_OK;
    }
    if (s != NATS_OK) {
        char safe[512];
        kvw_nats_redact(cfg->nats_url, safe, sizeof(safe));
        snprintf(err, errlen, "nats %s: %s", safe, natsStatus_GetText(s));
        kvw_nats_stop(k);
        return NULL;
    }
    if (k->nc && natsConnection_Status(k->nc) == NATS_CONN_STATUS_CONNECTED)
        on_connected(k->nc, k);     /* the first announce */
    struct timeval tv = { cfg->heartbeat_ms / 1000, (cfg->heartbeat_ms % 1000) * 1000 };
    event_add(k->heartbeat, &tv);
    return k;
}

void kvw_nats_stop(kvw_nats_t *k)
{
    if (k == NULL)
        return;
    pthread_mutex_lock(&k->lock);
    k->stopping = 1;
    pthread_mutex_unlock(&k->lock);
    if (k->renew)
        event_free(k->renew);
    k->renew = NULL;
    if (k->sub_discover)
        natsSubscription_Destroy(k->sub_discover);
    for (int i = 0; i < k->n; i++)
        if (k->pubs[i].sub_dump)
            natsSubscription_Destroy(k->pubs[i].sub_dump);
    if (k->nc) {
        /* "leave" lets routers free our record and index slots now rather
         * than after the heartbeat timeout (docs/PROTOCOL.md) */
        for (int i = 0; i < k->n; i++)
            if (k->pubs[i].e)
                send_heartbeat(&k->pubs[i], "leave");
        natsConnection_FlushTimeout(k->nc, 500);
        natsConnection_Close(k->nc);
        natsConnection_Destroy(k->nc);
    }
    if (k->opts)
        natsOptions_Destroy(k->opts);
    for (int i = 0; i < k->n; i++) {
        if (k->pubs[i].e) {
            kvw_blocks_set_sink(kvw_sched_blocks(k->pubs[i].e), NULL, NULL);
            kvw_sched_set_step_hook(k->pubs[i].e, NULL, NULL);
        }
        if (k->pubs[i].pending)
            evbuffer_free(k->pubs[i].pending);
        if (k->pubs[i].load_timer)
            event_free(k->pubs[i].load_timer);
    }
    /* jobs queued by cnats threads: those threads are gone after Destroy */
    while (k->jobs) {
        job_t *j = k->jobs;
        k->jobs = j->next;
        free(j->subject);
        free(j->reply);
        free(j->data);
        free(j);
    }
    if (k->wake)
        event_free(k->wake);
    if (k->heartbeat)
        event_free(k->heartbeat);
    pthread_mutex_destroy(&k->lock);
    free(k->pubs);
    free(k);
}
