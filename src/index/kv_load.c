/*
 * Shared load table (see kv_load.h). Layout in the region:
 *
 *   header | server[max_servers] | row[max_rows] of int64 [max_servers][ACTIVE]
 *
 * All counters are C11 atomics with relaxed ordering: they are independent
 * statistics, read approximately by routing, and only their eventual sums
 * matter. Row ownership is a CAS on the owner pid; -1 marks a row being
 * reaped so that no one claims it half-cleared.
 */
#include <stdatomic.h>
#include <string.h>

#include "kv_load.h"

#define KV_LOAD_MAGIC  0x6b766c6f61643032ULL   /* "kvload02": decode tokens, learned rates */
#define LEARN_WEIGHT   (1.0 / 16)
#define ROW_REAPING    ((int64_t) -1)

typedef struct {
    char                name[KV_LOAD_NAME_MAX];
    uint32_t            len;
    _Atomic int64_t     active[KV_LOAD_ACTIVE];
    _Atomic uint64_t    requests_total;
    _Atomic uint64_t    overlap_hits;
    _Atomic uint64_t    overlap_blocks;
    _Atomic uint64_t    prompt_blocks;
    _Atomic double      prefill_tokens, prefill_ms;     /* learned means */
    _Atomic double      decode_tokens, decode_ms;
} server_t;

struct kv_load {
    uint64_t            magic;
    uint32_t            max_servers;
    uint32_t            max_rows;
    _Atomic uint32_t    servers;
    _Atomic uint64_t    reaped;
    /* followed by servers, then row owners, then row counters */
};

static double ratio(double num, double den)
{
    return num > 0 && den > 0 ? num / den : 0;
}

static server_t *servers_of(const kv_load_t *ld)
{
    return (server_t *) (void *) ((char *) ld + sizeof(kv_load_t));
}

static _Atomic int64_t *owners_of(const kv_load_t *ld)
{
    return (_Atomic int64_t *) (void *) (servers_of(ld) + ld->max_servers);
}

static _Atomic int64_t *row_of(const kv_load_t *ld, int row)
{
    return owners_of(ld) + ld->max_rows
           + (size_t) row * ld->max_servers * KV_LOAD_ACTIVE;
}

size_t kv_load_size(uint32_t max_servers, uint32_t max_rows)
{
    return sizeof(kv_load_t) + (size_t) max_servers * sizeof(server_t)
           + (size_t) max_rows * sizeof(int64_t)
           + (size_t) max_rows * max_servers * KV_LOAD_ACTIVE * sizeof(int64_t);
}

kv_load_t *kv_load_init(void *region, size_t size, uint32_t max_servers,
                        uint32_t max_rows, int reuse)
{
    kv_load_t *ld = region;

    if (size < kv_load_size(max_servers, max_rows)) {
        return NULL;
    }
    if (reuse && ld->magic == KV_LOAD_MAGIC && ld->max_servers == max_servers
        && ld->max_rows == max_rows)
    {
        return ld;
    }
    memset(region, 0, kv_load_size(max_servers, max_rows));
    ld->max_servers = max_servers;
    ld->max_rows = max_rows;
    ld->magic = KV_LOAD_MAGIC;
    return ld;
}

int kv_load_find(const kv_load_t *ld, const char *name, size_t len)
{
    uint32_t  i, n = atomic_load(&((kv_load_t *) ld)->servers);
    server_t *s = servers_of(ld);

    for (i = 0; i < n; i++) {
        if (s[i].len == len && memcmp(s[i].name, name, len) == 0) {
            return (int) i;
        }
    }
    return -1;
}

int kv_load_server(kv_load_t *ld, const char *name, size_t len)
{
    int       i = kv_load_find(ld, name, len);
    uint32_t  n;
    server_t *s;

    if (i >= 0) {
        return i;
    }
    n = atomic_load(&ld->servers);
    if (n == ld->max_servers || len >= KV_LOAD_NAME_MAX) {
        return -1;
    }
    s = &servers_of(ld)[n];
    memcpy(s->name, name, len);
    s->name[len] = '\0';
    s->len = (uint32_t) len;
    /* publish the name before the count that makes it visible */
    atomic_store_explicit(&ld->servers, n + 1, memory_order_release);
    return (int) n;
}

uint32_t kv_load_servers(const kv_load_t *ld)
{
    return atomic_load_explicit(&((kv_load_t *) ld)->servers, memory_order_acquire);
}

const char *kv_load_server_name(const kv_load_t *ld, uint32_t server)
{
    return servers_of(ld)[server].name;
}

int kv_load_claim_row(kv_load_t *ld, pid_t pid)
{
    _Atomic int64_t *own = owners_of(ld);
    int64_t          expect;
    uint32_t         i;

    for (i = 0; i < ld->max_rows; i++) {
        if (atomic_load(&own[i]) == (int64_t) pid) {
            return (int) i;
        }
    }
    for (i = 0; i < ld->max_rows; i++) {
        expect = 0;
        if (atomic_compare_exchange_strong(&own[i], &expect, (int64_t) pid)) {
            return (int) i;
        }
    }
    return -1;
}

/* Moves whatever row still holds back out of the totals and zeroes it. */
static void drain_row(kv_load_t *ld, int row)
{
    _Atomic int64_t *r = row_of(ld, row);
    server_t        *s = servers_of(ld);
    uint32_t         i, c;
    int64_t          v;

    for (i = 0; i < ld->max_servers; i++) {
        for (c = 0; c < KV_LOAD_ACTIVE; c++) {
            v = atomic_exchange(&r[i * KV_LOAD_ACTIVE + c], 0);
            if (v) {
                atomic_fetch_sub_explicit(&s[i].active[c], v, memory_order_relaxed);
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
    atomic_store(&owners_of(ld)[row], 0);
}

void kv_load_add(kv_load_t *ld, int row, uint32_t server, kv_load_counter_t c,
                 int64_t delta)
{
    if (server >= ld->max_servers || delta == 0) {
        return;
    }
    atomic_fetch_add_explicit(&servers_of(ld)[server].active[c], delta,
                              memory_order_relaxed);
    if (row >= 0 && (uint32_t) row < ld->max_rows) {
        atomic_fetch_add_explicit(&row_of(ld, row)[server * KV_LOAD_ACTIVE + c],
                                  delta, memory_order_relaxed);
    }
}

void kv_load_count(kv_load_t *ld, uint32_t server, uint32_t overlap, uint32_t prompt_blocks)
{
    server_t *s;

    if (server >= ld->max_servers) {
        return;
    }
    s = &servers_of(ld)[server];
    atomic_fetch_add_explicit(&s->requests_total, 1, memory_order_relaxed);
    if (overlap) {
        atomic_fetch_add_explicit(&s->overlap_hits, 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&s->overlap_blocks, overlap, memory_order_relaxed);
    }
    atomic_fetch_add_explicit(&s->prompt_blocks, prompt_blocks, memory_order_relaxed);
}

void kv_load_get(const kv_load_t *ld, uint32_t server, kv_load_server_t *out)
{
    server_t *s = &servers_of(ld)[server];
    uint32_t  c;

    for (c = 0; c < KV_LOAD_ACTIVE; c++) {
        out->active[c] = atomic_load_explicit(&s->active[c], memory_order_relaxed);
        if (out->active[c] < 0) {
            out->active[c] = 0;     /* transient, while a reap races a release */
        }
    }
    out->requests_total = atomic_load_explicit(&s->requests_total, memory_order_relaxed);
    out->overlap_hits = atomic_load_explicit(&s->overlap_hits, memory_order_relaxed);
    out->overlap_blocks = atomic_load_explicit(&s->overlap_blocks, memory_order_relaxed);
    out->prompt_blocks = atomic_load_explicit(&s->prompt_blocks, memory_order_relaxed);
    out->prefill_rate = ratio(atomic_load_explicit(&s->prefill_tokens, memory_order_relaxed),
                              atomic_load_explicit(&s->prefill_ms, memory_order_relaxed));
    out->decode_pace = ratio(atomic_load_explicit(&s->decode_ms, memory_order_relaxed),
                             atomic_load_explicit(&s->decode_tokens, memory_order_relaxed));
}

static void learn(_Atomic double *num, _Atomic double *den, double n, double d)
{
    double m = atomic_load_explicit(num, memory_order_relaxed);
    double e = atomic_load_explicit(den, memory_order_relaxed);

    /* the first sample is the mean; later ones move it by LEARN_WEIGHT */
    if (e <= 0) {
        m = n;
        e = d;
    } else {
        m += (n - m) * LEARN_WEIGHT;
        e += (d - e) * LEARN_WEIGHT;
    }
    atomic_store_explicit(num, m, memory_order_relaxed);
    atomic_store_explicit(den, e, memory_order_relaxed);
}

void kv_load_learn_prefill(kv_load_t *ld, uint32_t server, double tokens, double ms)
{
    server_t *s;

    if (server >= ld->max_servers || !(tokens > 0) || !(ms > 0)) {
        return;
    }
    s = &servers_of(ld)[server];
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
    _Atomic int64_t *own = owners_of(ld);
    int64_t          pid;
    uint32_t         i;
    int              n = 0;

    for (i = 0; i < ld->max_rows; i++) {
        pid = atomic_load(&own[i]);
        if (pid <= 0 || alive((pid_t) pid)) {
            continue;
        }
        if (!atomic_compare_exchange_strong(&own[i], &pid, ROW_REAPING)) {
            continue;
        }
        drain_row(ld, (int) i);
        atomic_store(&own[i], 0);
        atomic_fetch_add(&ld->reaped, 1);
        n++;
    }
    return n;
}

uint64_t kv_load_reaped(const kv_load_t *ld)
{
    return atomic_load(&((kv_load_t *) ld)->reaped);
}
