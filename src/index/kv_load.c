/*
 * Shared load table (see kv_load.h). Layout in the region:
 *
 *   header | server[max_servers] | row[max_rows] of int64 [max_servers][ACTIVE]
 *
 * All counters are __atomic words with relaxed ordering: they are independent
 * statistics, read approximately by routing, and only their eventual sums
 * matter. Row ownership is a CAS on the owner pid; -1 marks a row being
 * reaped so that no one claims it half-cleared.
 */
#include <string.h>

#include "kv_load.h"

#define KV_LOAD_MAGIC  0x6b766c6f61643033ULL   /* "kvload03": prefill base */
#define LEARN_WEIGHT   (1.0 / 16)
#define ROW_REAPING    ((int64_t) -1)

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
} server_t;

struct kv_load {
    uint64_t            magic;
    uint32_t            max_servers;
    uint32_t            max_rows;
    uint32_t            servers;
    uint64_t            reaped;
    /* followed by servers, then row owners, then row counters */
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

static server_t *servers_of(const kv_load_t *ld)
{
    return (server_t *) (void *) ((char *) ld + sizeof(kv_load_t));
}

static int64_t *owners_of(const kv_load_t *ld)
{
    return (int64_t *) (void *) (servers_of(ld) + ld->max_servers);
}

static int64_t *row_of(const kv_load_t *ld, int row)
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
    uint32_t  i, n = __atomic_load_n(&((kv_load_t *) ld)->servers, __ATOMIC_SEQ_CST);
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
    n = __atomic_load_n(&ld->servers, __ATOMIC_SEQ_CST);
    if (n == ld->max_servers || len >= KV_LOAD_NAME_MAX) {
        return -1;
    }
    s = &servers_of(ld)[n];
    memcpy(s->name, name, len);
    s->name[len] = '\0';
    s->len = (uint32_t) len;
    /* publish the name before the count that makes it visible */
    __atomic_store_n(&ld->servers, n + 1, __ATOMIC_RELEASE);
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
    return n;
}

uint64_t kv_load_reaped(const kv_load_t *ld)
{
    return __atomic_load_n(&((kv_load_t *) ld)->reaped, __ATOMIC_SEQ_CST);
}
