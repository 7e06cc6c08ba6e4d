/*
 * Shared decisions between nginx instances (kv_share.h). The wire format,
 * little-endian, one NATS message:
 *
 *   header (32 bytes)
 *     0  "KVD1"          magic
 *     4  u16 version     1
 *     6  u16 flags       0 (receivers refuse others: a future format)
 *     8  u64 instance    the sender's id (nonzero)
 *    16  u16 records     decision records that follow
 *    18  u16 loads       load entries after them
 *    20  u32 lease_ms    the sender's refresh promise (informational)
 *    24  u64 sent_ms     the sender's clock (informational)
 *   decision record (16 + 8n bytes)
 *     u64 worker_id, u32 first, u32 n (1..29), n x u64 sequence hashes
 *   load entry (40 bytes)
 *     u64 server key, i64 prefill_tokens, decode_blocks, requests,
 *     decode_tokens (the kv_load active counters, in that order; 0..2^40)
 *
 * The message must be exactly that long; anything else is refused whole
 * and counted, never half applied.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <nats/nats.h>

#include <pthread.h>

#include "kv_hash.h"
#include "kv_clock.h"
#include "kv_proto.h"
#include "kv_share.h"

#define MAX_MSG     (KV_SHARE_HEADER + 64 * (16 + 8 * KV_SHARE_MAX_HASHES) + 256 * 40)
#define LOAD_PER_MSG 256
#define NC          KV_LOAD_ACTIVE

typedef struct {
    uint64_t    key;
    uint32_t    server;
} keymap_t;

typedef struct {
    uint64_t    id;             /* 0: free */
    uint64_t    last_ms;
    uint64_t    lease_ms;       /* ours, or the sender's if longer (at most a minute) */
    int64_t    *val;            /* [max_servers][NC] what it last said */
    uint64_t   *at;             /* [max_servers] when */
} inst_t;

struct kv_share {
    kv_share_config_t   cfg;
    char                subject[320];
    char               *servers;
    kv_dring_t         *ring;
    kv_dring_share_t   *st;
    kv_load_t          *ld;
    int                 row;
    uint32_t            max_servers;
    pthread_mutex_t     mu;

    keymap_t           *keys;       /* sorted by key */
    uint32_t            nkeys;      /* kv_load_servers when built */
    uint64_t           *key_of;     /* [max_servers] */

    inst_t              inst[KV_SHARE_INSTANCES];
    int64_t            *remote;     /* [max_servers][NC] sum over instances */
    int64_t            *sent;       /* [max_servers][NC] own load last published */
    uint64_t           *sent_at;    /* [max_servers] */

    uint64_t            next_ms;    /* next flush */
    kv_dring_rec_t      held;       /* popped, not yet sent */
    int                 has_held;
    unsigned char      *buf;

    natsOptions        *opts;
    natsConnection     *nc;
    natsSubscription   *sub;
};

/* --- little-endian fields --------------------------------------------- */

static void put16(unsigned char *p, uint16_t v) { p[0] = v; p[1] = v >> 8; }
static void put32(unsigned char *p, uint32_t v)
{
    put16(p, (uint16_t) v);
    put16(p + 2, (uint16_t) (v >> 16));
}
static void put64(unsigned char *p, uint64_t v)
{
    put32(p, (uint32_t) v);
    put32(p + 4, (uint32_t) (v >> 32));
}
static uint16_t get16(const unsigned char *p) { return (uint16_t) (p[0] | p[1] << 8); }
static uint32_t get32(const unsigned char *p)
{
    return (uint32_t) get16(p) | (uint32_t) get16(p + 2) << 16;
}
static uint64_t get64(const unsigned char *p)
{
    return (uint64_t) get32(p) | (uint64_t) get32(p + 4) << 32;
}

uint64_t kv_share_server_key(const char *name, size_t len)
{
    return kv_hash_worker_id(name, len);
}

/* --- server keys -------------------------------------------------------- */

static int key_cmp(const void *a, const void *b)
{
    uint64_t x = ((const keymap_t *) a)->key, y = ((const keymap_t *) b)->key;

    return x < y ? -1 : x > y;
}

/* The load table gains names only at configuration: rebuild when it grew. */
static void keys_refresh(kv_share_t *s)
{
    uint32_t    i, n = kv_load_servers(s->ld);
    const char *name;

    if (n == s->nkeys) {
        return;
    }
    for (i = 0; i < n; i++) {
        name = kv_load_server_name(s->ld, i);
        s->keys[i].key = kv_share_server_key(name, strlen(name));
        s->keys[i].server = i;
        s->key_of[i] = s->keys[i].key;
    }
    qsort(s->keys, n, sizeof(keymap_t), key_cmp);
    s->nkeys = n;
}

static int key_find(kv_share_t *s, uint64_t key)
{
    keymap_t  k = { key, 0 }, *f;

    f = bsearch(&k, s->keys, s->nkeys, sizeof(keymap_t), key_cmp);
    return f ? (int) f->server : -1;
}

/* --- remote load -------------------------------------------------------- */

/* Sets instance in's contribution to server to v[NC]. mu held. */
static void remote_set(kv_share_t *s, inst_t *in, uint32_t server, const int64_t *v)
{
    int64_t  *cur = &in->val[server * NC], d;
    uint32_t  c;

    for (c = 0; c < NC; c++) {
        d = v[c] - cur[c];
        if (d) {
            kv_load_add(s->ld, s->row, server, (kv_load_counter_t) c, d);
            s->remote[server * NC + c] += d;
            if (c == KV_LOAD_REQUESTS) {
                s->st->remote_requests += d;
            }
            cur[c] = v[c];
        }
    }
}

static inst_t *inst_get(kv_share_t *s, uint64_t id, uint64_t now_ms)
{
    inst_t   *in, *free_slot = NULL;
    uint32_t  i;

    for (i = 0; i < KV_SHARE_INSTANCES; i++) {
        in = &s->inst[i];
        if (in->id == id) {
            return in;
        }
        if (in->id == 0 && free_slot == NULL) {
            free_slot = in;
        }
    }
    if (free_slot == NULL) {
        return NULL;
    }
    in = free_slot;
    if (in->val == NULL) {
        in->val = calloc((size_t) s->max_servers * NC, sizeof(int64_t));
        in->at = calloc(s->max_servers, sizeof(uint64_t));
        if (in->val == NULL || in->at == NULL) {
            free(in->val);
            free(in->at);
            in->val = NULL;
            in->at = NULL;
            return NULL;
        }
    }
    in->id = id;
    in->last_ms = now_ms;
    s->st->instances++;
    return in;
}

/* Entries no message refreshed within the lease go; so do silent instances. */
static void expire(kv_share_t *s, uint64_t now_ms)
{
    static const int64_t zero[NC];
    uint32_t  i, k, c;
    inst_t   *in;
    int       live;

    for (i = 0; i < KV_SHARE_INSTANCES; i++) {
        in = &s->inst[i];
        if (in->id == 0) {
            continue;
        }
        live = 0;
        for (k = 0; k < s->max_servers; k++) {
            for (c = 0; c < NC && in->val[k * NC + c] == 0; c++) {
                /* void */
            }
            if (c == NC) {
                continue;
            }
            /* signed: the receiving thread may have stamped it after
             * the tick read now_ms (its clock a ms on) */
            if ((int64_t) (now_ms - in->at[k]) > (int64_t) in->lease_ms) {
                remote_set(s, in, k, zero);
                s->st->expired++;
            } else {
                live = 1;
            }
        }
        if (!live && (int64_t) (now_ms - in->last_ms) > (int64_t) in->lease_ms) {
            in->id = 0;
            s->st->instances--;
        }
    }
}

/* --- receive ------------------------------------------------------------ */

static int reject(kv_share_t *s)
{
    s->st->rejected++;
    return -1;
}

int kv_share_receive(kv_share_t *s, const void *msg, size_t len, uint64_t now_ms)
{
    const unsigned char *p = msg, *q, *end = p + len;
    uint64_t             id, seq[KV_SHARE_MAX_HASHES], wid;
    uint32_t             nrec, nload, i, k, n, first;
    int64_t              v[NC];
    int                  server;
    inst_t              *in;

    pthread_mutex_lock(&s->mu);

    /* the whole message is checked before anything is applied */
    if (len < KV_SHARE_HEADER || memcmp(p, KV_SHARE_MAGIC, 4) != 0
        || get16(p + 4) != KV_SHARE_VERSION || get16(p + 6) != 0)
    {
        goto bad;
    }
    id = get64(p + 8);
    nrec = get16(p + 16);
    nload = get16(p + 18);
    if (id == 0 || nrec > KV_SHARE_MAX_RECORDS || nload > KV_SHARE_MAX_LOAD) {
        goto bad;
    }
    q = p + KV_SHARE_HEADER;
    for (i = 0; i < nrec; i++) {
        if (end - q < 16) {
            goto bad;
        }
        first = get32(q + 8);
        n = get32(q + 12);
        if (n == 0 || n > KV_SHARE_MAX_HASHES || first > (1u << 24)
            || (size_t) (end - q) < 16 + 8 * (size_t) n)
        {
            goto bad;
        }
        q += 16 + 8 * (size_t) n;
    }
    if ((size_t) (end - q) != (size_t) nload * 40) {
        goto bad;
    }
    for (i = 0; i < nload; i++) {
        for (k = 0; k < NC; k++) {
            v[k] = (int64_t) get64(q + 40 * i + 8 + 8 * k);
            if (v[k] < 0 || v[k] > KV_SHARE_MAX_VALUE) {
                goto bad;
            }
        }
    }

    if (id == s->cfg.instance_id) {
        pthread_mutex_unlock(&s->mu);
        return 0;
    }

    in = inst_get(s, id, now_ms);
    if (in == NULL) {
        goto bad;   /* more instances than tracked: refused, counted */
    }
    in->last_ms = now_ms;
    in->lease_ms = get32(p + 20);
    in->lease_ms = in->lease_ms > 60000 ? 60000 : in->lease_ms;
    if (in->lease_ms < s->cfg.lease_ms) {
        in->lease_ms = s->cfg.lease_ms;     /* a sender that refreshes less often than
                                               we expire would flap */
    }
    s->st->messages_in++;

    q = p + KV_SHARE_HEADER;
    for (i = 0; i < nrec; i++) {
        wid = get64(q);
        first = get32(q + 8);
        n = get32(q + 12);
        for (k = 0; k < n; k++) {
            seq[k] = get64(q + 16 + 8 * k);
        }
        q += 16 + 8 * (size_t) n;
        if (first == KV_SHARE_RESPONSE) {
            if (n == 1 && s->cfg.on_response) {
                s->cfg.on_response(s->cfg.arg, wid, seq[0]);
            }
        } else if (s->cfg.on_blocks) {
            s->cfg.on_blocks(s->cfg.arg, wid, seq, first, n);
        }
        s->st->records_in++;
    }

    keys_refresh(s);
    for (i = 0; i < nload; i++, q += 40) {
        server = key_find(s, get64(q));
        if (server < 0) {
            continue;       /* a server this instance does not route to */
        }
        for (k = 0; k < NC; k++) {
            v[k] = (int64_t) get64(q + 8 + 8 * k);
        }
        remote_set(s, in, (uint32_t) server, v);
        in->at[server] = now_ms;
        s->st->load_in++;
    }

    pthread_mutex_unlock(&s->mu);
    return 0;

bad:
    reject(s);
    pthread_mutex_unlock(&s->mu);
    return -1;
}

/* --- publish ------------------------------------------------------------ */

static size_t put_record(unsigned char *p, const kv_dring_rec_t *r)
{
    uint32_t k;

    put64(p, r->worker_id);
    put32(p + 8, r->first);
    put32(p + 12, r->n);
    for (k = 0; k < r->n; k++) {
        put64(p + 16 + 8 * k, r->seq[k]);
    }
    return 16 + 8 * (size_t) r->n;
}

/* One message: up to max_records decisions, then the servers whose own
 * load changed (or, nonzero, was last sent a third of a lease ago). */
static size_t build(kv_share_t *s, uint64_t now_ms)
{
    unsigned char     *p = s->buf + KV_SHARE_HEADER;
    uint32_t           nrec = 0, nload = 0, i, c, changed, nonzero;
    kv_load_server_t   ls;
    int64_t            own[NC];

    while (nrec < s->cfg.max_records) {
        if (!s->has_held) {
            if (!kv_dring_pop(s->ring, &s->held)) {
                break;
            }
            s->has_held = 1;
        }
        if (s->held.n == 0 || s->held.n > KV_SHARE_MAX_HASHES) {
            s->has_held = 0;    /* never written whole: skip */
            continue;
        }
        p += put_record(p, &s->held);
        s->has_held = 0;
        nrec++;
    }

    keys_refresh(s);
    for (i = 0; i < s->nkeys && nload < LOAD_PER_MSG; i++) {
        kv_load_get(s->ld, i, &ls);
        changed = nonzero = 0;
        for (c = 0; c < NC; c++) {
            own[c] = ls.active[c] - s->remote[i * NC + c];
            if (own[c] < 0) {
                own[c] = 0;     /* a release racing the read */
            }
            changed |= own[c] != s->sent[i * NC + c];
            nonzero |= own[c] != 0;
        }
        if (!changed && !(nonzero && now_ms - s->sent_at[i] >= s->cfg.lease_ms / 3)) {
            continue;
        }
        put64(p, s->key_of[i]);
        for (c = 0; c < NC; c++) {
            put64(p + 8 + 8 * c, (uint64_t) own[c]);
            s->sent[i * NC + c] = own[c];
        }
        s->sent_at[i] = now_ms;
        p += 40;
        nload++;
    }

    if (nrec == 0 && nload == 0) {
        return 0;
    }

    memcpy(s->buf, KV_SHARE_MAGIC, 4);
    put16(s->buf + 4, KV_SHARE_VERSION);
    put16(s->buf + 6, 0);
    put64(s->buf + 8, s->cfg.instance_id);
    put16(s->buf + 16, (uint16_t) nrec);
    put16(s->buf + 18, (uint16_t) nload);
    put32(s->buf + 20, s->cfg.lease_ms);
    put64(s->buf + 24, now_ms);
    s->st->records_out += nrec;
    return (size_t) (p - s->buf);
}

void kv_share_tick(kv_share_t *s, uint64_t now_ms)
{
    size_t  len;
    int     up;

    pthread_mutex_lock(&s->mu);

    expire(s, now_ms);

    up = s->nc ? natsConnection_Status(s->nc) == NATS_CONN_STATUS_CONNECTED
               : s->cfg.publish != NULL;
    s->st->connected = up;

    if (now_ms < s->next_ms) {
        s->st->limited++;
    } else if (up) {
        len = build(s, now_ms);
        if (len) {
            if (s->nc) {
                natsConnection_Publish(s->nc, s->subject, s->buf, (int) len);
            } else {
                s->cfg.publish(s->cfg.publish_arg, s->buf, len);
            }
            s->st->messages_out++;
            s->next_ms = now_ms + s->cfg.interval_ms;
        }
    }

    pthread_mutex_unlock(&s->mu);
}

/* --- NATS --------------------------------------------------------------- */

static void on_msg(natsConnection *nc, natsSubscription *sub, natsMsg *m, void *arg)
{
    (void) nc;
    (void) sub;
    kv_share_receive(arg, natsMsg_GetData(m), (size_t) natsMsg_GetDataLength(m),
                     kv_clock_ms());
    natsMsg_Destroy(m);
}

kv_share_t *kv_share_create(const kv_share_config_t *cfg, kv_dring_t *ring,
                            kv_load_t *ld, int row, char *err, size_t errlen)
{
    kv_share_t *s;
    uint32_t    ms = kv_load_capacity(ld);

    if (cfg->instance_id == 0) {
        snprintf(err, errlen, "kv_share: instance id must be nonzero");
        return NULL;
    }
    s = calloc(1, sizeof(*s));
    if (s == NULL) {
        snprintf(err, errlen, "kv_share: out of memory");
        return NULL;
    }
    s->cfg = *cfg;
    if (s->cfg.lease_ms == 0) {
        s->cfg.lease_ms = 3000;
    }
    if (s->cfg.interval_ms == 0) {
        s->cfg.interval_ms = 20;
    }
    if (s->cfg.max_records == 0 || s->cfg.max_records > 64) {
        s->cfg.max_records = 64;     /* what MAX_MSG holds */
    }
    if (cfg->subject) {
        snprintf(s->subject, sizeof(s->subject), "%s", cfg->subject);
    } else {
        snprintf(s->subject, sizeof(s->subject), "%s" KV_PROTO_DECISIONS,
                 cfg->prefix ? cfg->prefix : KV_PROTO_DEFAULT_PREFIX);
    }
    s->ring = ring;
    s->st = kv_dring_share(ring);
    memset(s->st, 0, sizeof(*s->st));
    s->ld = ld;
    s->row = row;
    s->max_servers = ms;
    pthread_mutex_init(&s->mu, NULL);
    s->keys = calloc(ms ? ms : 1, sizeof(keymap_t));
    s->key_of = calloc(ms ? ms : 1, sizeof(uint64_t));
    s->remote = calloc((size_t) (ms ? ms : 1) * NC, sizeof(int64_t));
    s->sent = calloc((size_t) (ms ? ms : 1) * NC, sizeof(int64_t));
    s->sent_at = calloc(ms ? ms : 1, sizeof(uint64_t));
    s->buf = malloc(MAX_MSG);
    s->servers = cfg->servers ? strdup(cfg->servers) : NULL;
    if (s->keys == NULL || s->key_of == NULL || s->remote == NULL || s->sent == NULL
        || s->sent_at == NULL || s->buf == NULL || (cfg->servers && s->servers == NULL))
    {
        kv_share_destroy(s);
        snprintf(err, errlen, "kv_share: out of memory");
        return NULL;
    }
    return s;
}

/* A connected callback makes cnats' retried first connect return at once
 * (NATS_NOT_YET_CONNECTED) instead of blocking until NATS answers, which
 * stopped the process that runs every zone's helper; the tick reads the
 * connection's status itself. */
static void on_connected(natsConnection *nc, void *closure)
{
    (void) nc;
    (void) closure;
}

int kv_share_start(kv_share_t *s, char *err, size_t errlen)
{
    const char *urls[16];
    int         n = 0;
    char       *p, *save = NULL;
    natsStatus  st;

    if (s->servers == NULL) {
        return 0;
    }
    for (p = strtok_r(s->servers, ",", &save); p && n < 16; p = strtok_r(NULL, ",", &save)) {
        urls[n++] = p;
    }
    st = natsOptions_Create(&s->opts);
    if (st == NATS_OK) {
        natsOptions_SetName(s->opts, "kvroute-share");
        st = natsOptions_SetServers(s->opts, urls, n);
    }
    if (st == NATS_OK && s->cfg.user) {
        st = natsOptions_SetUserInfo(s->opts, s->cfg.user,
                                     s->cfg.password ? s->cfg.password : "");
    }
    if (st == NATS_OK && s->cfg.token) {
        st = natsOptions_SetToken(s->opts, s->cfg.token);
    }
    if (st == NATS_OK) {
        natsOptions_SetNoEcho(s->opts, true);
        natsOptions_SetRetryOnFailedConnect(s->opts, true, on_connected, NULL);
        natsOptions_SetMaxReconnect(s->opts, -1);
        natsOptions_SetReconnectWait(s->opts, 250);
        natsOptions_SetTimeout(s->opts, 2000);
        st = natsConnection_Connect(&s->nc, s->opts);
        if (st == NATS_NOT_YET_CONNECTED) {
            st = NATS_OK;
        }
    }
    if (st == NATS_OK) {
        st = natsConnection_Subscribe(&s->sub, s->nc, s->subject, on_msg, s);
    }
    if (st != NATS_OK) {
        snprintf(err, errlen, "kv_share: NATS: %s", natsStatus_GetText(st));
        return -1;
    }
    return 0;
}

void kv_share_destroy(kv_share_t *s)
{
    static const int64_t zero[NC];
    uint32_t i, k;

    if (s == NULL) {
        return;
    }
    if (s->sub) {
        natsSubscription_Unsubscribe(s->sub);
    }
    if (s->nc) {
        natsConnection_Close(s->nc);
    }
    pthread_mutex_lock(&s->mu);
    for (i = 0; i < KV_SHARE_INSTANCES; i++) {
        if (s->inst[i].id && s->remote) {
            for (k = 0; k < s->max_servers; k++) {
                remote_set(s, &s->inst[i], k, zero);
            }
        }
        free(s->inst[i].val);
        free(s->inst[i].at);
    }
    pthread_mutex_unlock(&s->mu);
    if (s->sub) {
        natsSubscription_Destroy(s->sub);
    }
    if (s->nc) {
        natsConnection_Destroy(s->nc);
    }
    if (s->opts) {
        natsOptions_Destroy(s->opts);
    }
    free(s->keys);
    free(s->key_of);
    free(s->remote);
    free(s->sent);
    free(s->sent_at);
    free(s->buf);
    free(s->servers);
    pthread_mutex_destroy(&s->mu);
    free(s);
}
