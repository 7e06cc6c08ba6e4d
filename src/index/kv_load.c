/*
 * Shared load table (see kv_load.h). Layout in the region:
 *
 *   header | server[max_servers] | name hash[slots] | bucket heads
 *   [max_groups][KV_LOAD_BUCKETS] | row owners[max_rows]
 *   | row counters[max_rows] of int64 [max_servers][ACTIVE]
 *
 * All counters are __atomic words with relaxed ordering: they are independent
 * statistics, read approximately by routing, and only their eventual sums
 * matter. Row ownership is a CAS on the owner pid; -1 marks a row being
 * reaped so that no one claims it half-cleared. The bucket lists (the
 * least-loaded order) are the one structure under a lock: a spinlock word
 * holding its owner's pid, taken for O(1) list moves only.
 */
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include "kv_load.h"

#define KV_LOAD_MAGIC  0x6b766c6f61643035ULL   /* "kvload05": name hash, least-loaded order, prefill base, last send */
#define LEARN_WEIGHT   (1.0 / 16)
#define ROW_REAPING    ((int64_t) -1)
#define NIL            UINT32_MAX
#define EXACT_BUCKETS  48                      /* one bucket per request count below */
#define SPINS_CHECK    4096                    /* spins between looks at the holder */

typedef struct {
    char                name[KV_LOAD_NAME_MAX];
    uint32_t            len;
    int64_t             active[KV_LOAD_ACTIVE];
    uint64_t            requests_total;
    uint64_t            overlap_hits;
    uint64_t            overlap_blocks;
    uint64_t            prompt_blocks;
    double              prefill_tokens, prefill_ms;     /* learned means */
    double              prefill_tt, prefill_tm;         /* ... of tokens^2, tokens x ms */
    double              decode_tokens, decode_ms;
    uint64_t            sent_us;                /* kv_clock_us() of the last request sent */
    /* the least-loaded order, under the lock */
    uint32_t            group;                  /* NIL: not placed */
    uint32_t            weight;
    uint32_t            bucket;
    uint32_t            prev, next;             /* in its bucket's list */
} server_t;

typedef struct {
    uint32_t            head, tail;
} bucket_t;

struct kv_load {
    uint64_t            magic;
    uint32_t            max_servers;
    uint32_t            max_rows;
    uint32_t            max_groups;
    uint32_t            slots;                  /* name hash size, a power of two */
    uint32_t            servers;
    uint64_t            reaped;
    int64_t             lock;                   /* the order's holder pid; 0: free */
    uint64_t            rebuilds;               /* lists rebuilt after a holder died */
    /* followed by servers, the name hash, bucket heads, row owners, rows */
};

static double ratio(double num, double den)
{
    return num > 0 && den > 0 ? num / den : 0;
}

static double load_double(const double *x)
{
    double v;

    __atomic_load(x, &v, __ATOMIC_RELAXED);
    return v;
}

static uint32_t hash_slots(uint32_t max_servers)
{
    uint32_t n = 8;

    while (n < 2 * (uint64_t) max_servers) {
        n *= 2;
    }
    return n;
}

static server_t *servers_of(const kv_load_t *ld)
{
    return (server_t *) (void *) ((char *) ld + sizeof(kv_load_t));
}

static uint32_t *names_of(const kv_load_t *ld)
{
    return (uint32_t *) (void *) (servers_of(ld) + ld->max_servers);
}

static bucket_t *buckets_of(const kv_load_t *ld, uint32_t group)
{
    return (bucket_t *) (void *) (names_of(ld) + ld->slots)
           + (size_t) group * KV_LOAD_BUCKETS;
}

static int64_t *owners_of(const kv_load_t *ld)
{
    /* bucket_t is 8 bytes and slots even: owners stay 8-byte aligned */
    return (int64_t *) (void *) buckets_of(ld, ld->max_groups);
}

static int64_t *row_of(const kv_load_t *ld, int row)
{
    return owners_of(ld) + ld->max_rows
           + (size_t) row * ld->max_servers * KV_LOAD_ACTIVE;
}

size_t kv_load_size(uint32_t max_servers, uint32_t max_rows, uint32_t max_groups)
{
    return sizeof(kv_load_t) + (size_t) max_servers * sizeof(server_t)
           + (size_t) hash_slots(max_servers) * sizeof(uint32_t)
           + (size_t) max_groups * KV_LOAD_BUCKETS * sizeof(bucket_t)
           + (size_t) max_rows * sizeof(int64_t)
           + (size_t) max_rows * max_servers * KV_LOAD_ACTIVE * sizeof(int64_t);
}

kv_load_t *kv_load_init(void *region, size_t size, uint32_t max_servers,
                        uint32_t max_rows, uint32_t max_groups, int reuse)
{
    kv_load_t *ld = region;
    uint32_t   i;
    bucket_t  *b;

    if (size < kv_load_size(max_servers, max_rows, max_groups)) {
        return NULL;
    }
    if (reuse && ld->magic == KV_LOAD_MAGIC && ld->max_servers == max_servers
        && ld->max_rows == max_rows && ld->max_groups == max_groups)
    {
        return ld;
    }
    memset(region, 0, kv_load_size(max_servers, max_rows, max_groups));
    ld->max_servers = max_servers;
    ld->max_rows = max_rows;
    ld->max_groups = max_groups;
    ld->slots = hash_slots(max_servers);
    for (i = 0; i < max_servers; i++) {
        servers_of(ld)[i].group = NIL;
    }
    for (b = buckets_of(ld, 0); b < buckets_of(ld, max_groups); b++) {
        b->head = b->tail = NIL;
    }
    ld->magic = KV_LOAD_MAGIC;
    return ld;
}

uint32_t kv_load_capacity(const kv_load_t *ld)
{
    return ld->max_servers;
}

uint32_t kv_load_groups(const kv_load_t *ld)
{
    return ld->max_groups;
}

uint32_t kv_load_servers(const kv_load_t *ld)
{
    return __atomic_load_n(&((kv_load_t *) ld)->servers, __ATOMIC_ACQUIRE);
}

/* FNV-1a */
static uint32_t name_hash(const char *name, size_t len)
{
    uint64_t h = 0xcbf29ce484222325ULL;
    size_t   i;

    for (i = 0; i < len; i++) {
        h = (h ^ (unsigned char) name[i]) * 0x100000001b3ULL;
    }
    return (uint32_t) (h ^ (h >> 32));
}

/* Names are only ever added (by one writer), so a probe that meets an empty
 * slot has seen every name with this hash. */
int kv_load_find(const kv_load_t *ld, const char *name, size_t len)
{
    uint32_t  mask = ld->slots - 1, h = name_hash(name, len) & mask, v, k;
    server_t *s = servers_of(ld);

    for (k = 0; k < ld->slots; k++, h = (h + 1) & mask) {
        v = __atomic_load_n(&names_of(ld)[h], __ATOMIC_ACQUIRE);
        if (v == 0) {
            return -1;
        }
        if (s[v - 1].len == len && memcmp(s[v - 1].name, name, len) == 0) {
            return (int) (v - 1);
        }
    }
    return -1;
}

int kv_load_server(kv_load_t *ld, const char *name, size_t len)
{
    int       i = kv_load_find(ld, name, len);
    uint32_t  n, mask = ld->slots - 1, h;
    server_t *s;

    if (i >= 0) {
        return i;
    }
    n = __atomic_load_n(&ld->servers, __ATOMIC_SEQ_CST);
    if (n == ld->max_servers || len >= KV_LOAD_NAME_MAX) {
        return -1;
    }
    s = &servers_of(ld)[n];
    memcpy(s->name, name, len);
    s->name[len] = '\0';
    s->len = (uint32_t) len;
    /* publish the name before the count and the hash slot that make it
     * visible; the hash has twice the servers' slots, so one is free */
    __atomic_store_n(&ld->servers, n + 1, __ATOMIC_RELEASE);
    for (h = name_hash(name, len) & mask; names_of(ld)[h]; h = (h + 1) & mask) {
        /* void */
    }
    __atomic_store_n(&names_of(ld)[h], n + 1, __ATOMIC_RELEASE);
    return (int) n;
}

const char *kv_load_server_name(const kv_load_t *ld, uint32_t server)
{
    return servers_of(ld)[server].name;
}

int kv_load_claim_row(kv_load_t *ld, pid_t pid)
{
    int64_t *own = owners_of(ld);
    int64_t          expect;
    uint32_t         i;

    for (i = 0; i < ld->max_rows; i++) {
        if (__atomic_load_n(&own[i], __ATOMIC_SEQ_CST) == (int64_t) pid) {
            return (int) i;
        }
    }
    for (i = 0; i < ld->max_rows; i++) {
        expect = 0;
        if (__atomic_compare_exchange_n(&own[i], &expect, (int64_t) pid, 0, __ATOMIC_SEQ_CST,
                                        __ATOMIC_SEQ_CST))
        {
            return (int) i;
        }
    }
    return -1;
}

/* --- the least-loaded order ----------------------------------------------- */

static int ilog2(uint64_t x)
{
    int n = 0;

    while (x >>= 1) {
        n++;
    }
    return n;
}

static uint32_t bucket_of(int64_t requests, uint32_t weight)
{
    uint64_t r = requests > 0 ? (uint64_t) requests / (weight ? weight : 1) : 0;
    uint32_t b;

    if (r < EXACT_BUCKETS) {
        return (uint32_t) r;
    }
    b = EXACT_BUCKETS + (uint32_t) (ilog2(r) - ilog2(EXACT_BUCKETS));
    return b < KV_LOAD_BUCKETS ? b : KV_LOAD_BUCKETS - 1;
}

static void unlink_server(kv_load_t *ld, uint32_t i)
{
    server_t *s = servers_of(ld), *x = &s[i];
    bucket_t *b = &buckets_of(ld, x->group)[x->bucket];

    if (x->prev != NIL) {
        s[x->prev].next = x->next;
    } else {
        b->head = x->next;
    }
    if (x->next != NIL) {
        s[x->next].prev = x->prev;
    } else {
        b->tail = x->prev;
    }
    x->prev = x->next = NIL;
}

static void push_server(kv_load_t *ld, uint32_t i)
{
    server_t *s = servers_of(ld), *x = &s[i];
    bucket_t *b = &buckets_of(ld, x->group)[x->bucket];

    x->next = NIL;
    x->prev = b->tail;
    if (b->tail != NIL) {
        s[b->tail].next = i;
    } else {
        b->head = i;
    }
    b->tail = i;
}

/* Every list again from the counters: after a holder died mid-move. */
static void rebuild(kv_load_t *ld)
{
    uint32_t  i, n = __atomic_load_n(&ld->servers, __ATOMIC_ACQUIRE);
    server_t *s = servers_of(ld);
    bucket_t *b;

    for (b = buckets_of(ld, 0); b < buckets_of(ld, ld->max_groups); b++) {
        b->head = b->tail = NIL;
    }
    for (i = 0; i < n; i++) {
        if (s[i].group != NIL) {
            s[i].bucket = bucket_of(__atomic_load_n(&s[i].active[KV_LOAD_REQUESTS],
                                                    __ATOMIC_RELAXED), s[i].weight);
            push_server(ld, i);
        }
    }
    ld->rebuilds++;
}

static void order_lock(kv_load_t *ld)
{
    int64_t  me = (int64_t) getpid(), holder;
    unsigned spins = 0;

    for (;;) {
        holder = 0;
        if (__atomic_compare_exchange_n(&ld->lock, &holder, me, 0, __ATOMIC_ACQUIRE,
                                        __ATOMIC_RELAXED))
        {
            return;
        }
        if (++spins % SPINS_CHECK) {
            continue;
        }
        /* a holder that died (killed mid-move) would hold it for ever */
        if (holder > 0 && holder != me && kill((pid_t) holder, 0) != 0 && errno == ESRCH
            && __atomic_compare_exchange_n(&ld->lock, &holder, me, 0, __ATOMIC_ACQUIRE,
                                           __ATOMIC_RELAXED))
        {
            rebuild(ld);
            return;
        }
        sched_yield();
    }
}

static void order_unlock(kv_load_t *ld)
{
    __atomic_store_n(&ld->lock, 0, __ATOMIC_RELEASE);
}

/* Moves server i to the bucket its requests say, if it is placed. */
static void reorder(kv_load_t *ld, uint32_t i)
{
    server_t *x = &servers_of(ld)[i];
    uint32_t  b;

    if (__atomic_load_n(&x->group, __ATOMIC_RELAXED) == NIL) {
        return;
    }
    order_lock(ld);
    if (x->group != NIL) {
        b = bucket_of(__atomic_load_n(&x->active[KV_LOAD_REQUESTS], __ATOMIC_RELAXED),
                      x->weight);
        if (b != x->bucket) {
            unlink_server(ld, i);
            x->bucket = b;
            push_server(ld, i);
        }
    }
    order_unlock(ld);
}

void kv_load_place(kv_load_t *ld, uint32_t server, uint32_t group, uint32_t weight)
{
    server_t *x;

    if (server >= kv_load_servers(ld) || (group != NIL && group >= ld->max_groups)) {
        return;
    }
    x = &servers_of(ld)[server];
    order_lock(ld);
    if (x->group != NIL) {
        unlink_server(ld, server);
    }
    x->weight = weight ? weight : 1;
    if (group != NIL) {
        x->group = group;
        x->bucket = bucket_of(__atomic_load_n(&x->active[KV_LOAD_REQUESTS],
                                              __ATOMIC_RELAXED), x->weight);
        push_server(ld, server);
    }
    __atomic_store_n(&x->group, group, __ATOMIC_RELAXED);
    order_unlock(ld);
}

size_t kv_load_least(kv_load_t *ld, uint32_t group, uint32_t *out, size_t k)
{
    server_t *s = servers_of(ld);
    bucket_t *b;
    uint32_t  i;
    size_t    n = 0, j;

    if (group >= ld->max_groups || k == 0) {
        return 0;
    }
    b = buckets_of(ld, group);
    order_lock(ld);
    for (j = 0; j < KV_LOAD_BUCKETS && n < k; j++) {
        for (i = b[j].head; i != NIL && n < k; i = s[i].next) {
            out[n++] = i;
        }
    }
    order_unlock(ld);
    return n;
}

int kv_load_order_check(kv_load_t *ld)
{
    server_t *s = servers_of(ld);
    bucket_t *b;
    uint32_t  g, j, i, prev, n = kv_load_servers(ld), placed = 0, seen = 0;
    int       rc = 0;

    order_lock(ld);
    for (i = 0; i < n; i++) {
        if (s[i].group == NIL) {
            continue;
        }
        placed++;
        if (s[i].bucket != bucket_of(s[i].active[KV_LOAD_REQUESTS], s[i].weight)) {
            rc = -1;
        }
    }
    for (g = 0; g < ld->max_groups && rc == 0; g++) {
        b = buckets_of(ld, g);
        for (j = 0; j < KV_LOAD_BUCKETS && rc == 0; j++) {
            prev = NIL;
            for (i = b[j].head; i != NIL; prev = i, i = s[i].next) {
                if (i >= n || s[i].group != g || s[i].bucket != j || s[i].prev != prev
                    || ++seen > placed)
                {
                    rc = -2;
                    break;
                }
            }
            if (rc == 0 && b[j].tail != prev) {
                rc = -3;
            }
        }
    }
    if (rc == 0 && seen != placed) {
        rc = -4;
    }
    order_unlock(ld);
    return rc;
}

/* Moves whatever row still holds back out of the totals and zeroes it. */
static void drain_row(kv_load_t *ld, int row)
{
    int64_t *r = row_of(ld, row);
    server_t        *s = servers_of(ld);
    uint32_t         i, c;
    int64_t          v;

    for (i = 0; i < ld->max_servers; i++) {
        for (c = 0; c < KV_LOAD_ACTIVE; c++) {
            v = __atomic_exchange_n(&r[i * KV_LOAD_ACTIVE + c], 0, __ATOMIC_SEQ_CST);
            if (v) {
                __atomic_fetch_sub(&s[i].active[c], v, __ATOMIC_RELAXED);
                if (c == KV_LOAD_REQUESTS) {
                    reorder(ld, i);
                }
            }
        }
    }
}

void kv_load_release_row(kv_load_t *ld, int row)
{
    if (row < 0 || (uint32_t) row >= ld->max_rows) {
        return;
    }
    drain_row(ld, row);
    __atomic_store_n(&owners_of(ld)[row], 0, __ATOMIC_SEQ_CST);
}

void kv_load_add(kv_load_t *ld, int row, uint32_t server, kv_load_counter_t c,
                 int64_t delta)
{
    if (server >= ld->max_servers || delta == 0) {
        return;
    }
    __atomic_fetch_add(&servers_of(ld)[server].active[c], delta, __ATOMIC_RELAXED);
    if (row >= 0 && (uint32_t) row < ld->max_rows) {
        __atomic_fetch_add(&row_of(ld, row)[server * KV_LOAD_ACTIVE + c], delta, __ATOMIC_RELAXED);
    }
    if (c == KV_LOAD_REQUESTS) {
        reorder(ld, server);
    }
}

void kv_load_count(kv_load_t *ld, uint32_t server, uint32_t overlap, uint32_t prompt_blocks)
{
    server_t *s;

    if (server >= ld->max_servers) {
        return;
    }
    s = &servers_of(ld)[server];
    __atomic_fetch_add(&s->requests_total, 1, __ATOMIC_RELAXED);
    if (overlap) {
        __atomic_fetch_add(&s->overlap_hits, 1, __ATOMIC_RELAXED);
        __atomic_fetch_add(&s->overlap_blocks, overlap, __ATOMIC_RELAXED);
    }
    __atomic_fetch_add(&s->prompt_blocks, prompt_blocks, __ATOMIC_RELAXED);
}

void kv_load_sent(kv_load_t *ld, uint32_t server, uint64_t now_us)
{
    if (server < ld->max_servers) {
        __atomic_store_n(&servers_of(ld)[server].sent_us, now_us, __ATOMIC_RELAXED);
    }
}

/*
 * The prefill line ms = base + tokens / rate, by least squares over the
 * weighted means. A time to first byte has a part that does not grow with
 * the tokens (the engine's step under way, a step's fixed cost, the
 * network), and a rate through the origin would charge it to every queued
 * token: one short prompt queued ahead would look as costly as the
 * request's own. Without spread in the tokens (or a slope the samples do
 * not support) the line goes through the origin, as a plain ratio; the
 * base is at most 0.9 of the mean time, so the rate is at most ten times
 * the plain ratio.
 */
static void prefill_fit(double mx, double my, double xx, double xy,
                        double *rate, double *base)
{
    double var = xx - mx * mx, cov = xy - mx * my, slope, b;

    *rate = ratio(mx, my);
    *base = 0;
    if (!(*rate > 0) || !(var > 0.01 * mx * mx) || !(cov > 0)) {
        return;
    }
    slope = cov / var;
    b = my - slope * mx;
    if (b <= 0) {
        return;
    }
    if (b > 0.9 * my) {
        b = 0.9 * my;
    }
    *base = b;
    *rate = mx / (my - b);
}

void kv_load_get(const kv_load_t *ld, uint32_t server, kv_load_server_t *out)
{
    server_t *s = &servers_of(ld)[server];
    uint32_t  c;

    for (c = 0; c < KV_LOAD_ACTIVE; c++) {
        out->active[c] = __atomic_load_n(&s->active[c], __ATOMIC_RELAXED);
        if (out->active[c] < 0) {
            out->active[c] = 0;     /* transient, while a reap races a release */
        }
    }
    out->requests_total = __atomic_load_n(&s->requests_total, __ATOMIC_RELAXED);
    out->overlap_hits = __atomic_load_n(&s->overlap_hits, __ATOMIC_RELAXED);
    out->overlap_blocks = __atomic_load_n(&s->overlap_blocks, __ATOMIC_RELAXED);
    out->prompt_blocks = __atomic_load_n(&s->prompt_blocks, __ATOMIC_RELAXED);
    out->sent_us = __atomic_load_n(&s->sent_us, __ATOMIC_RELAXED);
    prefill_fit(load_double(&s->prefill_tokens), load_double(&s->prefill_ms),
                load_double(&s->prefill_tt), load_double(&s->prefill_tm),
                &out->prefill_rate, &out->prefill_base);
    out->decode_pace = ratio(load_double(&s->decode_ms), load_double(&s->decode_tokens));
}

/* the first sample is the mean; later ones move it by LEARN_WEIGHT */
static void learn(double *num, double *den, double n, double d)
{
    double m = load_double(num), e = load_double(den);

    if (e <= 0) {
        m = n;
        e = d;
    } else {
        m += (n - m) * LEARN_WEIGHT;
        e += (d - e) * LEARN_WEIGHT;
    }
    __atomic_store(num, &m, __ATOMIC_RELAXED);
    __atomic_store(den, &e, __ATOMIC_RELAXED);
}

void kv_load_learn_prefill(kv_load_t *ld, uint32_t server, double tokens, double ms)
{
    server_t *s;

    if (server >= ld->max_servers || !(tokens > 0) || !(ms > 0)) {
        return;
    }
    s = &servers_of(ld)[server];
    /* tokens^2 and tokens x ms first: a reader between the updates sees a
     * fit of slightly mixed samples, never a wrong scale */
    learn(&s->prefill_tt, &s->prefill_tm, tokens * tokens, tokens * ms);
    learn(&s->prefill_tokens, &s->prefill_ms, tokens, ms);
}

void kv_load_learn_decode(kv_load_t *ld, uint32_t server, double tokens, double ms)
{
    server_t *s;

    if (server >= ld->max_servers || !(tokens > 0) || !(ms > 0)) {
        return;
    }
    s = &servers_of(ld)[server];
    learn(&s->decode_ms, &s->decode_tokens, ms, tokens);
}

int kv_load_reap(kv_load_t *ld, int (*alive)(pid_t pid))
{
    int64_t *own = owners_of(ld);
    int64_t          pid;
    uint32_t         i;
    int              n = 0;

    for (i = 0; i < ld->max_rows; i++) {
        pid = __atomic_load_n(&own[i], __ATOMIC_SEQ_CST);
        if (pid <= 0 || alive((pid_t) pid)) {
            continue;
        }
        if (!__atomic_compare_exchange_n(&own[i], &pid, ROW_REAPING, 0, __ATOMIC_SEQ_CST,
                                         __ATOMIC_SEQ_CST))
        {
            continue;
        }
        drain_row(ld, (int) i);
        __atomic_store_n(&own[i], 0, __ATOMIC_SEQ_CST);
        __atomic_fetch_add(&ld->reaped, 1, __ATOMIC_SEQ_CST);
        n++;
    }
    if (n) {
        /* a process killed between a counter's change and its move left
         * that server in the wrong bucket */
        order_lock(ld);
        rebuild(ld);
        order_unlock(ld);
    }
    return n;
}

uint64_t kv_load_reaped(const kv_load_t *ld)
{
    return __atomic_load_n(&((kv_load_t *) ld)->reaped, __ATOMIC_SEQ_CST);
}
