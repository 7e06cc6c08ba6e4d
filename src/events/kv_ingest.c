/*
 * Event ingestion: the NATS side (connection, subscriptions, JetStream).
 * The per-worker logic is in kv_ingest_sync.c.
 *
 * Serialisation: cnats calls each subscription's handler on that
 * subscription's delivery thread; every handler and kv_ingest_tick take
 * ing->mu, so index and registry writes never overlap. Connection
 * callbacks only touch atomic status words and the epoch counter, which
 * tick turns into discover + resync under the mutex.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kv_ingest_int.h"
#include "kv_proto.h"
#include "kv_signals.h"

#define MAX_SERVERS 16

uint64_t kv_ingest_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

void kv_ingest_log(kv_ingest_t *ing, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "kvingest: ");
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

void kv_ingest_redact(const char *in, char *out, size_t n)
{
    size_t o = 0;
    if (n == 0)
        return;
    for (const char *p = in; *p && o + 1 < n;) {
        const char *sep = strstr(p, "://");
        if (sep == NULL) {
            o += (size_t)snprintf(out + o, n - o, "%s", p);
            break;
        }
        sep += 3;
        while (p < sep && o + 1 < n)
            out[o++] = *p++;
        size_t auth = strcspn(p, ",/ ");
        const char *at = memrchr(p, '@', auth);
        if (at != NULL && o + 4 < n) {
            memcpy(out + o, "***", 3);  /* user:password@ or token@ */
            o += 3;
            p = at;
        }
    }
    out[o < n ? o : n - 1] = '\0';
}

/* Connection failures (wrong credentials, untrusted certificate, a server
 * that requires TLS) happen on cnats' threads while it retries: report
 * each distinct one once (and again a minute later if it persists), so
 * error.log says why we are not connected. ing->mu held. */
static int set_servers(kv_ingest_t *ing, natsOptions *o, char *err, size_t errlen);
static int set_auth_tls(kv_ingest_t *ing, natsOptions *o, char *err, size_t errlen);

/* cnats retrying in the background only ever says "No server available":
 * one synchronous attempt with the same options tells why (credentials,
 * certificate, TLS required). Called without ing->mu. */
static void diagnose(kv_ingest_t *ing, char *msg, size_t n)
{
    natsOptions *o = NULL;
    natsConnection *nc = NULL;
    char err[256];
    snprintf(msg, n, "not connected");
    if (natsOptions_Create(&o) != NATS_OK)
        return;
    if (set_servers(ing, o, err, sizeof(err)) < 0 || set_auth_tls(ing, o, err, sizeof(err)) < 0) {
        snprintf(msg, n, "%s", err);
    } else {
        natsOptions_SetName(o, "kvroute-ingest-diagnosis");
        natsOptions_SetAllowReconnect(o, false);
        natsOptions_SetTimeout(o, 2000);
        natsStatus s = natsConnection_Connect(&nc, o);
        const char *detail = nats_GetLastError(NULL);
        if (s == NATS_OK)
            snprintf(msg, n, "a direct connection works; the background one is retrying");
        else
            snprintf(msg, n, "%s%s%s", natsStatus_GetText(s), detail && detail[0] ? ": " : "",
                     detail ? detail : "");
        natsConnection_Destroy(nc);
    }
    natsOptions_Destroy(o);
}

static void log_nats_error(kv_ingest_t *ing, uint64_t now_ms)
{
    char urls[1024];
    if (ing->nc == NULL)
        return;
    if (kv_ingest_connected(ing)) {
        if (ing->last_error[0]) {
            kv_ingest_redact(ing->cfg.servers, urls, sizeof(urls));
            kv_ingest_log(ing, "NATS %s: connected", urls);
            ing->last_error[0] = '\0';
        }
        ing->diag_at_ms = now_ms + 2000;    /* a disconnection gets 2 s to heal */
        return;
    }
    if (now_ms < ing->diag_at_ms)
        return;
    ing->diag_at_ms = now_ms + 30000;
    char msg[256];
    pthread_mutex_unlock(&ing->mu);
    diagnose(ing, msg, sizeof(msg));
    pthread_mutex_lock(&ing->mu);
    if (strcmp(msg, ing->last_error) == 0 && now_ms < ing->last_error_ms + 60000)
        return;
    snprintf(ing->last_error, sizeof(ing->last_error), "%s", msg);
    ing->last_error_ms = now_ms;
    kv_ingest_redact(ing->cfg.servers, urls, sizeof(urls));
    kv_ingest_log(ing, "NATS %s: %s (retrying)", urls, msg);
}

/* Asynchronous errors cnats reports on its threads: a permissions
 * violation (publisher auth misconfigured), slow consumer. At most one
 * line a second. */
static void on_async_error(natsConnection *nc, natsSubscription *sub, natsStatus err,
                           void *closure)
{
    static uint64_t last_ms;
    uint64_t now = kv_ingest_now_ms();
    const char *txt = NULL;
    if (now < __atomic_load_n(&last_ms, __ATOMIC_RELAXED) + 1000)
        return;
    __atomic_store_n(&last_ms, now, __ATOMIC_RELAXED);
    natsConnection_GetLastError(nc, &txt);
    kv_ingest_log(closure, "NATS error: %s%s%s", natsStatus_GetText(err),
                  txt && txt[0] ? ": " : "", txt ? txt : "");
}

int kv_ingest_connected(kv_ingest_t *ing)
{
    return ing->nc != NULL && natsConnection_Status(ing->nc) == NATS_CONN_STATUS_CONNECTED;
}

/* --- config ------------------------------------------------------------- */

static const char *dup_opt(char **pool, const char *s)
{
    if (s == NULL)
        return NULL;
    size_t n = strlen(s) + 1;
    memcpy(*pool, s, n);
    *pool += n;
    return *pool - n;
}

static int copy_config(kv_ingest_t *ing, const kv_ingest_config_t *cfg)
{
    const char *const *f[] = {&cfg->servers, &cfg->prefix, &cfg->event_subject, &cfg->stream,
                              &cfg->durable, &cfg->user, &cfg->password, &cfg->token,
                              &cfg->creds, &cfg->tls_ca, &cfg->tls_cert, &cfg->tls_key};
    size_t total = 0;
    for (size_t k = 0; k < sizeof(f) / sizeof(f[0]); k++)
        total += *f[k] ? strlen(*f[k]) + 1 : 0;
    ing->strings = malloc(total + 1);
    if (ing->strings == NULL)
        return -1;
    char *pool = ing->strings;
    ing->cfg = *cfg;
    ing->cfg.servers = dup_opt(&pool, cfg->servers);
    ing->cfg.prefix = dup_opt(&pool, cfg->prefix);
    ing->cfg.event_subject = dup_opt(&pool, cfg->event_subject);
    ing->cfg.stream = dup_opt(&pool, cfg->stream);
    ing->cfg.durable = dup_opt(&pool, cfg->durable);
    ing->cfg.user = dup_opt(&pool, cfg->user);
    ing->cfg.password = dup_opt(&pool, cfg->password);
    ing->cfg.token = dup_opt(&pool, cfg->token);
    ing->cfg.creds = dup_opt(&pool, cfg->creds);
    ing->cfg.tls_ca = dup_opt(&pool, cfg->tls_ca);
    ing->cfg.tls_cert = dup_opt(&pool, cfg->tls_cert);
    ing->cfg.tls_key = dup_opt(&pool, cfg->tls_key);
    return 0;
}

static void defaults(kv_ingest_config_t *c)
{
    if (c->stale_lag_ms == 0)
        c->stale_lag_ms = 1000;
    if (c->dump_timeout_ms == 0)
        c->dump_timeout_ms = 2000;
    if (c->reconnect_wait_ms == 0)
        c->reconnect_wait_ms = 250;
    if (c->buffer_events == 0)
        c->buffer_events = 4096;
    if (c->buffer_blocks == 0)
        c->buffer_blocks = 262144;
    if (c->heartbeat_timeout_ms && c->heartbeat_timeout_ms < 3000)
        c->heartbeat_timeout_ms = 3000;
}

/* Records a previous helper left (nginx reload, respawn after a crash):
 * the index still holds their blocks, so keep them, but trust nothing an
 * announced worker had: resync it once connected. An unannounced worker
 * keeps its last event id, so duplicates are still caught. A worker that
 * never speaks again times out as usual. */
static void adopt(kv_ingest_t *ing, uint64_t now_ms)
{
    kv_worker_rec_t r;
    for (uint32_t i = 0; i < ing->max_workers; i++) {
        if (kv_registry_read(ing->reg, (int)i, &r) != 0)
            continue;
        kv_wstate_t *w = &ing->wk[i];
        w->used = 1;
        w->worker_id = r.worker_id;
        w->dp_rank = r.dp_rank;
        w->announced = r.announced;
        w->instance_id = r.instance_id;
        w->last_applied = r.last_event_applied;
        w->last_announced = r.last_event_announced;
        w->interval_ms = r.interval_ms;
        w->last_seen_ms = now_ms;
        w->state = r.announced ? KV_WORKER_RESYNCING : KV_WORKER_LIVE;
        w->need_resync = r.announced;
        kv_worker_rec_t *rec = kv_registry_write_begin(ing->reg, (int)i);
        rec->state = w->state;
        kv_registry_write_end(ing->reg, (int)i);
    }
}

kv_ingest_t *kv_ingest_create(const kv_ingest_config_t *cfg, kv_index_t *ix,
                              kv_registry_t *reg, char *err, size_t errlen)
{
    if (cfg == NULL || cfg->servers == NULL || cfg->servers[0] == '\0' || ix == NULL
        || reg == NULL) {
        snprintf(err, errlen, "kv_ingest: servers, index and registry are required");
        return NULL;
    }
    if ((cfg->stream == NULL) != (cfg->durable == NULL)) {
        snprintf(err, errlen, "kv_ingest: jetstream needs both a stream and a durable name");
        return NULL;
    }
    const char *prefix = cfg->prefix && cfg->prefix[0] ? cfg->prefix : KV_PROTO_DEFAULT_PREFIX;
    if (strlen(prefix) > 200 || (cfg->event_subject && strlen(cfg->event_subject) > 300)) {
        snprintf(err, errlen, "kv_ingest: subject prefix too long");
        return NULL;
    }
    kv_ingest_t *ing = calloc(1, sizeof(*ing));
    if (ing == NULL || copy_config(ing, cfg) < 0) {
        free(ing);
        snprintf(err, errlen, "kv_ingest: out of memory");
        return NULL;
    }
    defaults(&ing->cfg);
    ing->ix = ix;
    ing->reg = reg;
    snprintf(ing->prefix, sizeof(ing->prefix), "%s", prefix);
    if (ing->cfg.event_subject)
        snprintf(ing->ev_subject, sizeof(ing->ev_subject), "%s", ing->cfg.event_subject);
    else
        snprintf(ing->ev_subject, sizeof(ing->ev_subject), "%s" KV_PROTO_EVENTS, prefix);
    snprintf(ing->hb_subject, sizeof(ing->hb_subject), "%s" KV_PROTO_HEARTBEAT, prefix);
    snprintf(ing->discover_subject, sizeof(ing->discover_subject), "%s" KV_PROTO_DISCOVER,
             prefix);
    pthread_mutex_init(&ing->mu, NULL);
    pthread_cond_init(&ing->closed_cv, NULL);
    kv_event_batch_init(&ing->batch);
    ing->max_workers = kv_registry_max_workers(reg);
    ing->wk = calloc(ing->max_workers, sizeof(*ing->wk));
    ing->scratch_cap = 4096;
    ing->scratch = malloc(ing->scratch_cap * sizeof(*ing->scratch));
    if (ing->wk == NULL || ing->scratch == NULL
        || natsStatistics_Create(&ing->stats) != NATS_OK) {
        kv_ingest_destroy(ing);
        snprintf(err, errlen, "kv_ingest: out of memory");
        return NULL;
    }
    adopt(ing, kv_ingest_now_ms());
    return ing;
}

/* --- handlers ----------------------------------------------------------- */

/* Which subject form a message came on: 0 the shared subject base, 1 the
 * per-worker base.<id> (*id set), -1 anything else (a malformed suffix). */
static int subject_worker(const char *subj, const char *base, uint64_t *id)
{
    size_t n = strlen(base);
    if (subj == NULL || strncmp(subj, base, n) != 0)
        return -1;
    if (subj[n] == '\0')
        return 0;
    if (subj[n] != '.' || subj[n + 1] < '0' || subj[n + 1] > '9')
        return -1;
    char *end;
    *id = strtoull(subj + n + 1, &end, 10);
    return *end == '\0' ? 1 : -1;
}

/* One message of events; ing->mu held. */
static void apply_message(kv_ingest_t *ing, natsMsg *msg)
{
    char err[200];
    uint64_t now = kv_ingest_now_ms(), wid = 0;
    kv_registry_status_add(ing->reg, KV_STATUS_OFF(messages), 1);
    int form = subject_worker(natsMsg_GetSubject(msg), ing->ev_subject, &wid);
    if (form < 0 || (form == 0 && ing->cfg.per_worker_only)) {
        kv_registry_status_add(ing->reg, KV_STATUS_OFF(rejected), 1);
        return;
    }
    if (kv_event_decode(&ing->batch, natsMsg_GetData(msg), (size_t)natsMsg_GetDataLength(msg),
                        err, sizeof(err)) != 0) {
        kv_registry_status_add(ing->reg, KV_STATUS_OFF(decode_errors), 1);
        if (ing->cfg.verbose)
            kv_ingest_log(ing, "event dropped: %s", err);
    } else {
        kv_sync_events(ing, &ing->batch, form == 1 ? &wid : NULL, now);
    }
}

static void on_event(natsConnection *nc, natsSubscription *sub, natsMsg *msg, void *closure)
{
    kv_ingest_t *ing = closure;
    pthread_mutex_lock(&ing->mu);
    if (!ing->stopping && nc == ing->nc)
        apply_message(ing, msg);
    pthread_mutex_unlock(&ing->mu);
    natsMsg_Destroy(msg);
}

/* How many times cnats has reconnected this connection. It counts a
 * reconnect before the new connection delivers anything, so a message
 * fetched with the count unchanged since the bind came on the connection
 * the bind was made on. ing->mu held (ing->stats is shared). */
static uint64_t reconnects(kv_ingest_t *ing)
{
    uint64_t n = 0;
    if (ing->nc != NULL && natsConnection_GetStats(ing->nc, ing->stats) == NATS_OK)
        natsStatistics_GetCounts(ing->stats, NULL, NULL, NULL, NULL, &n);
    return n;
}

/* A subscription whose batches must not be applied: unbound meanwhile, or
 * bound before a reconnect. What the server sent before the disconnect may
 * have been lost on the wire (delivered, to the server), and what comes
 * after it would then skip it. Left unacknowledged, such a batch comes
 * again, in order, once tick has bound the consumer again. ing->mu held. */
static int stale_sub(kv_ingest_t *ing, natsSubscription *sub)
{
    return sub != ing->ev_sub || reconnects(ing) != ing->js_reconnects;
}

/*
 * JetStream: a pull consumer, fetched by this thread. (A push consumer
 * lets the server deliver into the void while no helper is bound, and
 * those messages come back only after the ack wait.) Each batch is applied
 * under ing->mu, then each applied message is acknowledged (explicit acks,
 * fire-and-forget publishes): applied events are never delivered again,
 * and a message fetched but never applied (a stop, a helper that exits
 * mid-batch, a fetch a disconnect cut) stays unacknowledged, so the next
 * bind gets it first (jetstream_consumer): the next helper's, or this
 * one's after a reconnect (kv_ingest_tick).
 */
static void *fetch_loop(void *arg)
{
    kv_ingest_t *ing = arg;
    for (;;) {
        pthread_mutex_lock(&ing->mu);
        if (ing->stopping) {
            pthread_mutex_unlock(&ing->mu);
            return NULL;
        }
        natsSubscription *sub = ing->ev_sub;
        if (sub != NULL && stale_sub(ing, sub))
            sub = NULL;         /* what it would fetch is not applied: wait for the bind */
        ing->fetching = sub != NULL;
        pthread_mutex_unlock(&ing->mu);
        if (sub == NULL) {
            usleep(50000);
            continue;
        }
        natsMsgList list = {0};
        jsErrCode jerr = 0;
        natsStatus s = natsSubscription_Fetch(&list, sub, 256, 200, &jerr);
        if (s == NATS_OK && list.Count > 0 && ing->cfg.test_exit_after_fetch)
            _exit(3);           /* tests: a helper gone between fetch and apply */
        int applied = 0, drop = 0;
        if (s == NATS_OK && list.Count > 0 && ing->cfg.test_drop_fetch_once) {
            ing->cfg.test_drop_fetch_once = 0;  /* tests: a fetch whose reply was cut */
            drop = 1;
            kv_ingest_log(ing, "test: dropped a fetched batch of %d", list.Count);
        }
        pthread_mutex_lock(&ing->mu);
        if (s == NATS_OK && list.Count > 0 && !drop && stale_sub(ing, sub)) {
            drop = 1;
            if (ing->cfg.verbose)
                kv_ingest_log(ing, "jetstream: %d messages fetched across a reconnect left "
                              "unacknowledged: they come again once bound", list.Count);
        }
        for (int k = 0; s == NATS_OK && !drop && k < list.Count && !ing->stopping; k++) {
            apply_message(ing, list.Msgs[k]);
            applied = k + 1;
        }
        pthread_mutex_unlock(&ing->mu);
        /* what was applied, no more: a batch cut short by a stop is the
         * next helper's */
        for (int k = 0; k < applied; k++)
            natsMsg_Ack(list.Msgs[k], NULL);
        natsMsgList_Destroy(&list);
        pthread_mutex_lock(&ing->mu);
        ing->fetching = 0;
        pthread_cond_broadcast(&ing->closed_cv);
        pthread_mutex_unlock(&ing->mu);
        if (s != NATS_OK && s != NATS_TIMEOUT)
            usleep(50000);      /* disconnected and the like: tick repairs */
    }
}

static void on_heartbeat(natsConnection *nc, natsSubscription *sub, natsMsg *msg, void *closure)
{
    kv_ingest_t *ing = closure;
    uint64_t wid = 0;
    int form = subject_worker(natsMsg_GetSubject(msg), ing->hb_subject, &wid);
    pthread_mutex_lock(&ing->mu);
    if (form < 0 || (form == 0 && ing->cfg.per_worker_only))
        kv_registry_status_add(ing->reg, KV_STATUS_OFF(rejected), 1);
    else if (!ing->stopping && nc == ing->nc)
        kv_sync_heartbeat(ing, natsMsg_GetData(msg), (size_t)natsMsg_GetDataLength(msg),
                          form == 1 ? &wid : NULL, kv_ingest_now_ms());
    pthread_mutex_unlock(&ing->mu);
    natsMsg_Destroy(msg);
}

static void on_dump(natsConnection *nc, natsSubscription *sub, natsMsg *msg, void *closure)
{
    kv_ingest_t *ing = closure;
    const char *subj = natsMsg_GetSubject(msg);
    const char *dot = strrchr(subj, '.');
    uint64_t seq = dot ? strtoull(dot + 1, NULL, 10) : 0;
    pthread_mutex_lock(&ing->mu);
    if (!ing->stopping && nc == ing->nc && seq)
        kv_sync_dump_chunk(ing, seq, natsMsg_GetData(msg), (size_t)natsMsg_GetDataLength(msg),
                           kv_ingest_now_ms());
    pthread_mutex_unlock(&ing->mu);
    natsMsg_Destroy(msg);
}

static void on_connected(natsConnection *nc, void *closure)
{
    kv_ingest_t *ing = closure;
    kv_registry_status_set(ing->reg, KV_STATUS_OFF(nats_state), KV_NATS_CONNECTED);
    kv_registry_status_add(ing->reg, KV_STATUS_OFF(connects), 1);
    __atomic_fetch_add(&ing->conn_epoch, 1, __ATOMIC_RELEASE);
}

static void on_disconnected(natsConnection *nc, void *closure)
{
    kv_ingest_t *ing = closure;
    kv_registry_status_set(ing->reg, KV_STATUS_OFF(nats_state), KV_NATS_RECONNECTING);
    kv_registry_status_add(ing->reg, KV_STATUS_OFF(disconnects), 1);
}

/* The last callback cnats makes for a connection: stop waits for it, so no
 * callback can run after the ingester is freed. */
static void on_closed(natsConnection *nc, void *closure)
{
    kv_ingest_t *ing = closure;
    kv_registry_status_set(ing->reg, KV_STATUS_OFF(nats_state), KV_NATS_CLOSED);
    pthread_mutex_lock(&ing->mu);
    ing->closed++;
    pthread_cond_signal(&ing->closed_cv);
    pthread_mutex_unlock(&ing->mu);
}

/* --- connection --------------------------------------------------------- */

static int set_servers(kv_ingest_t *ing, natsOptions *o, char *err, size_t errlen)
{
    char buf[1024];
    const char *urls[MAX_SERVERS];
    int n = 0;
    snprintf(buf, sizeof(buf), "%s", ing->cfg.servers);
    for (char *save = NULL, *tok = strtok_r(buf, ", ", &save); tok && n < MAX_SERVERS;
         tok = strtok_r(NULL, ", ", &save))
        urls[n++] = tok;
    if (n == 0 || natsOptions_SetServers(o, urls, n) != NATS_OK) {
        char safe[1024];
        kv_ingest_redact(ing->cfg.servers, safe, sizeof(safe));
        snprintf(err, errlen, "kv_ingest: bad server list '%s'", safe);
        return -1;
    }
    return 0;
}

/* TLS files are read by the helper, which runs as nginx's worker user:
 * say so plainly instead of cnats' bare "SSL Error". */
static int readable(const char *what, const char *path, char *err, size_t errlen)
{
    if (path == NULL || access(path, R_OK) == 0)
        return 0;
    snprintf(err, errlen, "kv_ingest: cannot read %s \"%s\": %s (the event helper runs as "
             "the nginx worker user, which must be able to read it)", what, path,
             strerror(errno));
    return -1;
}

static int set_auth_tls(kv_ingest_t *ing, natsOptions *o, char *err, size_t errlen)
{
    kv_ingest_config_t *c = &ing->cfg;
    natsStatus s = NATS_OK;
    if (readable("tls_ca", c->tls_ca, err, errlen) < 0
        || readable("tls_cert", c->tls_cert, err, errlen) < 0
        || readable("tls_key", c->tls_key, err, errlen) < 0
        || readable("creds", c->creds, err, errlen) < 0)
        return -1;
    if (c->user)
        s = natsOptions_SetUserInfo(o, c->user, c->password ? c->password : "");
    if (s == NATS_OK && c->token)
        s = natsOptions_SetToken(o, c->token);
    if (s == NATS_OK && c->creds)
        s = natsOptions_SetUserCredentialsFromFiles(o, c->creds, NULL);
    if (s == NATS_OK && (c->tls || c->tls_ca || c->tls_cert))
        s = natsOptions_SetSecure(o, true);
    if (s == NATS_OK && c->tls_ca)
        s = natsOptions_LoadCATrustedCertificates(o, c->tls_ca);
    if (s == NATS_OK && c->tls_cert)
        s = natsOptions_LoadCertificatesChain(o, c->tls_cert,
                                              c->tls_key ? c->tls_key : c->tls_cert);
    if (s == NATS_OK && c->tls_no_verify)
        s = natsOptions_SkipServerVerification(o, true);
    if (s != NATS_OK) {
        const char *detail = nats_GetLastError(NULL);
        snprintf(err, errlen, "kv_ingest: auth/TLS options: %s%s%s", natsStatus_GetText(s),
                 detail && detail[0] ? ": " : "", detail ? detail : "");
        return -1;
    }
    return 0;
}

/* cnats calls this after a subscription closed and its handler returned. */
static void on_sub_complete(void *closure)
{
    kv_ingest_t *ing = closure;
    pthread_mutex_lock(&ing->mu);
    ing->live_subs--;
    pthread_cond_signal(&ing->closed_cv);
    pthread_mutex_unlock(&ing->mu);
}

static void track(kv_ingest_t *ing, natsSubscription *sub)
{
    if (natsSubscription_SetOnCompleteCB(sub, on_sub_complete, ing) == NATS_OK)
        ing->live_subs++;       /* under mu, or before any delivery can start */
}

static natsStatus subscribe(kv_ingest_t *ing, natsSubscription **sub, const char *subj,
                            natsMsgHandler cb)
{
    natsStatus s = natsConnection_Subscribe(sub, ing->nc, subj, cb, ing);
    if (s == NATS_OK)       /* bursts of events must not be dropped as slow consumer */
        s = natsSubscription_SetPendingLimits(*sub, 1 << 20, 1 << 30);
    if (s == NATS_OK)
        track(ing, *sub);
    return s;
}

/* Core subscriptions missing on the current connection, made now. Made
 * before the connection is up, they are sent once it is; on a connection
 * cnats has closed they fail, and tick replaces the connection. */
static int subscribe_all(kv_ingest_t *ing)
{
    char dump_subj[160], hb_pw[330], ev_pw[330];
    natsStatus s = NATS_OK;
    int shared = !ing->cfg.per_worker_only;
    snprintf(dump_subj, sizeof(dump_subj), "%s.*", ing->inbox);
    snprintf(hb_pw, sizeof(hb_pw), "%s.*", ing->hb_subject);
    snprintf(ev_pw, sizeof(ev_pw), "%s.*", ing->ev_subject);
    if (shared && ing->hb_sub == NULL)
        s = subscribe(ing, &ing->hb_sub, ing->hb_subject, on_heartbeat);
    if (s == NATS_OK && ing->hb_sub_pw == NULL)
        s = subscribe(ing, &ing->hb_sub_pw, hb_pw, on_heartbeat);
    if (s == NATS_OK && ing->dump_sub == NULL)
        s = subscribe(ing, &ing->dump_sub, dump_subj, on_dump);
    if (s == NATS_OK && ing->cfg.stream == NULL && shared && ing->ev_sub == NULL)
        s = subscribe(ing, &ing->ev_sub, ing->ev_subject, on_event);
    if (s == NATS_OK && ing->cfg.stream == NULL && ing->ev_sub_pw == NULL)
        s = subscribe(ing, &ing->ev_sub_pw, ev_pw, on_event);
    if (s != NATS_OK) {
        if (ing->cfg.verbose)
            kv_ingest_log(ing, "subscribe: %s; retrying", natsStatus_GetText(s));
        return -1;
    }
    if (ing->cfg.verbose)
        kv_ingest_log(ing, "subscribed to %s and %s (%s)", ing->ev_subject, ing->hb_subject,
                      ing->cfg.stream ? "jetstream" : "core");
    return 0;
}

/* A new connection; it connects in the background (retrying forever). A
 * failure here (bad URL, TLS files) is retried by tick as well. */
static void connect_now(kv_ingest_t *ing, uint64_t now_ms)
{
    natsConnection *nc = NULL;
    kv_registry_status_set(ing->reg, KV_STATUS_OFF(nats_state), KV_NATS_CONNECTING);
    natsStatus s = natsConnection_Connect(&nc, ing->opts);
    if (s != NATS_OK && s != NATS_NOT_YET_CONNECTED) {
        char urls[1024];
        const char *detail = nats_GetLastError(NULL);
        kv_ingest_redact(ing->cfg.servers, urls, sizeof(urls));
        kv_ingest_log(ing, "NATS %s: connect: %s%s%s; retrying", urls, natsStatus_GetText(s),
                      detail && detail[0] ? ": " : "", detail ? detail : "");
        natsConnection_Destroy(nc);
        kv_registry_status_set(ing->reg, KV_STATUS_OFF(nats_state), KV_NATS_DOWN);
        ing->connect_retry_ms = now_ms + ing->backoff_ms;
        ing->backoff_ms = ing->backoff_ms * 2 > 30000 ? 30000 : ing->backoff_ms * 2;
        return;
    }
    ing->nc = nc;
    ing->conns++;                       /* each gets exactly one closed callback */
    if (s == NATS_OK)
        on_connected(nc, ing);          /* connected at once: no callback */
    subscribe_all(ing);
}

static int start(kv_ingest_t *ing, char *err, size_t errlen)
{
    natsStatus s = natsOptions_Create(&ing->opts);
    if (s != NATS_OK) {
        snprintf(err, errlen, "kv_ingest: natsOptions_Create: %s", natsStatus_GetText(s));
        return -1;
    }
    if (set_servers(ing, ing->opts, err, errlen) < 0
        || set_auth_tls(ing, ing->opts, err, errlen) < 0)
        goto fail;
    natsOptions_SetName(ing->opts, "kvroute-ingest");
    natsOptions_SetRetryOnFailedConnect(ing->opts, true, on_connected, ing);
    natsOptions_SetMaxReconnect(ing->opts, -1);
    natsOptions_SetReconnectWait(ing->opts, ing->cfg.reconnect_wait_ms);
    natsOptions_SetReconnectJitter(ing->opts, 100, 1000);
    natsOptions_SetTimeout(ing->opts, 2000);
    natsOptions_SetReconnectedCB(ing->opts, on_connected, ing);
    natsOptions_SetDisconnectedCB(ing->opts, on_disconnected, ing);
    natsOptions_SetClosedCB(ing->opts, on_closed, ing);
    natsOptions_SetErrorHandler(ing->opts, on_async_error, ing);
    natsOptions_SetMaxPendingMsgs(ing->opts, 1 << 20);

    natsInbox *inbox = NULL;
    natsInbox_Create(&inbox);
    snprintf(ing->inbox, sizeof(ing->inbox), "%s", inbox ? (const char *)inbox : "_INBOX.kvroute");
    natsInbox_Destroy(inbox);
    ing->backoff_ms = 1000;
    ing->diag_at_ms = kv_ingest_now_ms() + 2000;
    if (ing->cfg.stream) {
        if (pthread_create(&ing->fetcher, NULL, fetch_loop, ing) != 0) {
            snprintf(err, errlen, "kv_ingest: cannot start the JetStream fetch thread");
            goto fail;
        }
        ing->has_fetcher = 1;
    }
    pthread_mutex_lock(&ing->mu);
    ing->started = 1;
    connect_now(ing, kv_ingest_now_ms());
    pthread_mutex_unlock(&ing->mu);
    return 0;

fail:
    /* not started: destroy does not stop it, and nginx retries every 5 s
     * (each try's options, with a TLS context and its CA store, leaked) */
    natsOptions_Destroy(ing->opts);
    ing->opts = NULL;
    return -1;
}

/* cnats's threads must not take the host's signals. */
int kv_ingest_start(kv_ingest_t *ing, char *err, size_t errlen)
{
    sigset_t  old;
    int       rc;

    kv_signals_block(&old);
    rc = start(ing, err, errlen);
    kv_signals_restore(&old);
    return rc;
}

/*
 * The durable consumer, ready to bind: explicit acks, filtered on our
 * subject. A consumer that another helper left with messages delivered
 * and never acknowledged (it exited between a fetch and its acks, or its
 * pull request is still open), or that a disconnect left so under this
 * helper (a fetch cut short: jetstream_unbind), would redeliver them only
 * after the ack wait, behind the events we fetch meanwhile: out of order,
 * so dropped as duplicates. One created by an older kvroute acks all up to the one
 * acked (AckAll), and a consumer's ack policy cannot be changed in place.
 * Either is deleted and created again at its ack floor: everything not
 * acknowledged comes again, in order (what was applied but not acked is
 * dropped as a duplicate by its event id). 0, or -1 to retry.
 */
static int jetstream_consumer(kv_ingest_t *ing, const char *filter)
{
    jsErrCode jerr = 0;
    jsConsumerInfo *ci = NULL;
    uint64_t floor = 0;
    natsStatus s = js_GetConsumerInfo(&ci, ing->js, ing->cfg.stream, ing->cfg.durable, NULL,
                                      &jerr);
    if (s == NATS_OK) {
        const jsConsumerConfig *c = ci->Config;
        const char *why = c == NULL ? "no configuration"
                          : c->AckPolicy != js_AckExplicit ? "it acks all before the one acked"
                          : c->FilterSubject == NULL || strcmp(c->FilterSubject, filter) != 0
                              ? "another subject"
                          : ci->NumAckPending > 0 ? "messages delivered are unacknowledged"
                          : ci->NumWaiting > 0 ? "a pull request is still open"
                              : NULL;
        floor = ci->AckFloor.Stream;
        jsConsumerInfo_Destroy(ci);
        if (why == NULL)
            return 0;
        kv_ingest_log(ing, "jetstream consumer %s: %s: created again from stream seq %" PRIu64,
                      ing->cfg.durable, why, floor + 1);
        s = js_DeleteConsumer(ing->js, ing->cfg.stream, ing->cfg.durable, NULL, &jerr);
    }
    if (s != NATS_OK && s != NATS_NOT_FOUND)
        return -1;
    jsConsumerConfig cc;
    jsConsumerConfig_Init(&cc);
    cc.Durable = ing->cfg.durable;
    cc.AckPolicy = js_AckExplicit;      /* ack wait: the server's default (30 s) */
    cc.DeliverPolicy = floor ? js_DeliverByStartSequence : js_DeliverAll;
    cc.OptStartSeq = floor ? floor + 1 : 0;
    cc.MaxAckPending = 1 << 16;
    cc.FilterSubject = filter;
    s = js_AddConsumer(NULL, ing->js, ing->cfg.stream, &cc, NULL, &jerr);
    if (s != NATS_OK && ing->cfg.verbose)
        kv_ingest_log(ing, "jetstream consumer %s: %s (js error %d)", ing->cfg.durable,
                      natsStatus_GetText(s), (int)jerr);
    return s == NATS_OK ? 0 : -1;
}

/* Durable pull consumer on the stream (created if absent, with the stream
 * itself if that is absent): replays what was published while we were
 * away. Needs the server, so tick retries it until it works. */
static int jetstream_setup(kv_ingest_t *ing)
{
    jsErrCode jerr = 0;
    natsStatus s = NATS_OK;
    /* read first: a reconnect during the setup makes tick bind again */
    ing->js_reconnects = reconnects(ing);
    if (ing->js == NULL)
        s = natsConnection_JetStream(&ing->js, ing->nc, NULL);
    jsStreamInfo *si = NULL;
    if (s == NATS_OK)
        s = js_GetStreamInfo(&si, ing->js, ing->cfg.stream, NULL, &jerr);
    if (s == NATS_NOT_FOUND) {
        jsStreamConfig sc;
        char pw[330];
        snprintf(pw, sizeof(pw), "%s.*", ing->ev_subject);
        const char *subjects[2] = {pw, ing->ev_subject};
        jsStreamConfig_Init(&sc);
        sc.Name = ing->cfg.stream;
        sc.Subjects = subjects;
        sc.SubjectsLen = ing->cfg.per_worker_only ? 1 : 2;
        sc.Storage = js_FileStorage;
        /* bounded: the stream's default keeps every event for ever (acked
         * ones too, under limits retention), on the NATS server's disk;
         * an hour covers a restart, and an older gap is resynced by dump */
        sc.MaxAge = (int64_t) 3600 * 1000000000;
        sc.MaxBytes = (int64_t) 1 << 30;
        s = js_AddStream(&si, ing->js, &sc, NULL, &jerr);
    }
    jsStreamInfo_Destroy(si);
    /* one filter per consumer: the per-worker subjects when only those
     * are trusted, else the shared one (docs/SECURITY.md) */
    char pw[330];
    snprintf(pw, sizeof(pw), "%s.*", ing->ev_subject);
    const char *filter = ing->cfg.per_worker_only ? pw : ing->ev_subject;
    if (s == NATS_OK && jetstream_consumer(ing, filter) != 0)
        s = NATS_ERR;
    if (s == NATS_OK) {
        jsSubOptions so;
        jsSubOptions_Init(&so);
        so.Stream = ing->cfg.stream;
        so.Consumer = ing->cfg.durable;     /* bind: jetstream_consumer made it */
        s = js_PullSubscribe(&ing->ev_sub, ing->js, filter, ing->cfg.durable, NULL, &so, &jerr);
    }
    if (s != NATS_OK) {
        if (ing->cfg.verbose)
            kv_ingest_log(ing, "jetstream %s/%s: %s (js error %d); retrying", ing->cfg.stream,
                          ing->cfg.durable, natsStatus_GetText(s), (int)jerr);
        return -1;
    }
    if (ing->cfg.verbose)
        kv_ingest_log(ing, "jetstream consumer %s on %s bound", ing->cfg.durable, ing->cfg.stream);
    return 0;
}

/*
 * After a reconnect: a fetch the disconnect cut left its messages
 * delivered and unacknowledged, and the server would send them again only
 * after the ack wait (30 s), behind newer events, which a worker without
 * dumps could never make good. Binding again lets jetstream_consumer find
 * them (NumAckPending) and create the consumer again from its ack floor:
 * they come first, in order. Acks the disconnect lost show as pending
 * too; those messages come again and are dropped as duplicates. ing->mu
 * held; waits (at most a fetch's 200 ms) for the fetch thread to leave
 * the old subscription.
 */
static void jetstream_unbind(kv_ingest_t *ing)
{
    natsSubscription *sub = ing->ev_sub;
    ing->ev_sub = NULL;             /* the fetch thread takes no new turn on it */
    while (ing->fetching)
        pthread_cond_wait(&ing->closed_cv, &ing->mu);
    /* bound, not created by the subscribe: the consumer outlives it */
    natsSubscription_Unsubscribe(sub);
    natsSubscription_Destroy(sub);
    ing->js_retry_ms = 0;
    if (ing->cfg.verbose)
        kv_ingest_log(ing, "jetstream consumer %s: NATS reconnected: binding it again",
                      ing->cfg.durable);
}

static void teardown(kv_ingest_t *ing);

void kv_ingest_tick(kv_ingest_t *ing, uint64_t now_ms)
{
    pthread_mutex_lock(&ing->mu);
    if (ing->stopping || !ing->started) {
        pthread_mutex_unlock(&ing->mu);
        return;
    }
    if (ing->nc != NULL && natsConnection_IsClosed(ing->nc)) {
        /* cnats gave up on it (e.g. refused credentials): start over */
        pthread_mutex_unlock(&ing->mu);
        teardown(ing);
        pthread_mutex_lock(&ing->mu);
        ing->connect_retry_ms = now_ms + ing->backoff_ms;
        ing->backoff_ms = ing->backoff_ms * 2 > 30000 ? 30000 : ing->backoff_ms * 2;
    }
    if (ing->nc == NULL && !ing->stopping && now_ms >= ing->connect_retry_ms)
        connect_now(ing, now_ms);
    int shared = !ing->cfg.per_worker_only;
    if (ing->nc != NULL && ((shared && ing->hb_sub == NULL) || ing->hb_sub_pw == NULL
                            || ing->dump_sub == NULL
                            || (ing->cfg.stream == NULL
                                && ((shared && ing->ev_sub == NULL) || ing->ev_sub_pw == NULL))))
        subscribe_all(ing);
    log_nats_error(ing, now_ms);
    int connected = kv_ingest_connected(ing);
    if (connected)
        ing->backoff_ms = 1000;
    uint64_t epoch = __atomic_load_n(&ing->conn_epoch, __ATOMIC_ACQUIRE);
    int reconnected = 0;
    if (connected && epoch != ing->seen_epoch) {
        reconnected = ing->seen_epoch != 0;
        ing->seen_epoch = epoch;
        natsConnection_PublishString(ing->nc, ing->discover_subject, "{}");
        if (ing->cfg.verbose)
            kv_ingest_log(ing, "connected (epoch %" PRIu64 "): discover sent", epoch);
    }
    if (connected && ing->cfg.stream && ing->ev_sub != NULL
        && reconnects(ing) != ing->js_reconnects)
        jetstream_unbind(ing);
    if (connected && ing->cfg.stream && ing->ev_sub == NULL && now_ms >= ing->js_retry_ms
        && jetstream_setup(ing) < 0)
        ing->js_retry_ms = now_ms + 1000;
    kv_sync_tick(ing, now_ms, connected, reconnected);
    kv_registry_status_set(ing->reg, KV_STATUS_OFF(updated_ms), now_ms);
    pthread_mutex_unlock(&ing->mu);
}

static void unsubscribe(natsSubscription **sub)
{
    if (*sub == NULL)
        return;
    natsSubscription_Unsubscribe(*sub);
    natsSubscription_Destroy(*sub);
    *sub = NULL;
}

/* Closes the current connection and frees it once cnats has made its last
 * callback for it (closed, and every subscription's completion), so no
 * handler can run on freed objects. Called without ing->mu. */
static void teardown(kv_ingest_t *ing)
{
    pthread_mutex_lock(&ing->mu);
    natsConnection *nc = ing->nc;
    natsSubscription *subs[5] = {ing->ev_sub, ing->hb_sub, ing->dump_sub, ing->ev_sub_pw,
                                 ing->hb_sub_pw};
    jsCtx *js = ing->js;
    ing->nc = NULL;                 /* handlers for it now return at once */
    ing->ev_sub = ing->hb_sub = ing->dump_sub = ing->ev_sub_pw = ing->hb_sub_pw = NULL;
    ing->js = NULL;
    pthread_mutex_unlock(&ing->mu);
    if (nc == NULL)
        return;
    natsConnection_Close(nc);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 3;
    pthread_mutex_lock(&ing->mu);
    while (ing->closed < ing->conns || ing->live_subs > 0 || ing->fetching)
        if (pthread_cond_timedwait(&ing->closed_cv, &ing->mu, &until) != 0)
            break;
    pthread_mutex_unlock(&ing->mu);
    /* closed first: an unsubscribe would delete the durable consumer */
    for (int k = 0; k < 5; k++)
        unsubscribe(&subs[k]);
    if (js)
        jsCtx_Destroy(js);
    natsConnection_Destroy(nc);
}

void kv_ingest_stop(kv_ingest_t *ing)
{
    pthread_mutex_lock(&ing->mu);
    ing->stopping = 1;          /* handlers still in flight return at once */
    pthread_mutex_unlock(&ing->mu);
    if (ing->has_fetcher) {
        pthread_join(ing->fetcher, NULL);
        ing->has_fetcher = 0;
    }
    teardown(ing);
    if (ing->opts) {
        natsOptions_Destroy(ing->opts);
        ing->opts = NULL;
    }
    kv_registry_status_set(ing->reg, KV_STATUS_OFF(nats_state), KV_NATS_CLOSED);
}

void kv_ingest_destroy(kv_ingest_t *ing)
{
    if (ing == NULL)
        return;
    if (ing->started)
        kv_ingest_stop(ing);
    if (ing->wk)
        kv_sync_free(ing);
    kv_event_batch_free(&ing->batch);
    pthread_cond_destroy(&ing->closed_cv);
    pthread_mutex_destroy(&ing->mu);
    free(ing->wk);
    free(ing->scratch);
    natsStatistics_Destroy(ing->stats);
    free(ing->strings);
    free(ing);
}
