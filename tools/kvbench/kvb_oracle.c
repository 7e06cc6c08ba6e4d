/*
 * The load-bounded longest-prefix oracle and the infinite single-cache bound
 * (see kvb_oracle.h for the exact rule).
 */
#include "kvb_oracle.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_hash.h"
#include "kvb_floor.h"

#define NIL UINT32_MAX

/* One cached block: in its hash bucket's chain and in the LRU list. */
typedef struct {
    uint64_t    key;
    uint32_t    prev, next;     /* LRU: head is the most recent */
    uint32_t    hnext;
} node_t;

/*
 * An LRU set of block keys with a fixed capacity: nodes are preallocated,
 * a full cache reuses its least recent node. cap == 0 never happens here:
 * the infinite cache is one sized to hold every block of the trace.
 */
typedef struct {
    node_t     *node;
    uint32_t   *bucket;
    uint32_t    mask, cap, used;
    uint32_t    head, tail;
    uint64_t    evictions;
} lru_t;

static int lru_init(lru_t *c, uint32_t cap)
{
    uint32_t nb = 1;
    while (nb < cap * 2u && nb < (1u << 31))
        nb <<= 1;
    memset(c, 0, sizeof(*c));
    c->node = malloc((size_t)cap * sizeof(node_t));
    c->bucket = malloc((size_t)nb * sizeof(uint32_t));
    if (c->node == NULL || c->bucket == NULL)
        return -1;
    memset(c->bucket, 0xff, (size_t)nb * sizeof(uint32_t));
    c->mask = nb - 1;
    c->cap = cap;
    c->head = c->tail = NIL;
    return 0;
}

static void lru_free(lru_t *c)
{
    free(c->node);
    free(c->bucket);
}

static uint32_t slot_of(const lru_t *c, uint64_t key)
{
    return (uint32_t)((key ^ (key >> 29)) * 0x9e3779b97f4a7c15ull >> 33) & c->mask;
}

static uint32_t lru_find(const lru_t *c, uint64_t key)
{
    for (uint32_t i = c->bucket[slot_of(c, key)]; i != NIL; i = c->node[i].hnext)
        if (c->node[i].key == key)
            return i;
    return NIL;
}

static void unlink_lru(lru_t *c, uint32_t i)
{
    node_t *n = &c->node[i];
    if (n->prev != NIL) c->node[n->prev].next = n->next; else c->head = n->next;
    if (n->next != NIL) c->node[n->next].prev = n->prev; else c->tail = n->prev;
}

static void push_head(lru_t *c, uint32_t i)
{
    node_t *n = &c->node[i];
    n->prev = NIL;
    n->next = c->head;
    if (c->head != NIL)
        c->node[c->head].prev = i;
    c->head = i;
    if (c->tail == NIL)
        c->tail = i;
}

static void unlink_hash(lru_t *c, uint32_t i)
{
    uint32_t *p = &c->bucket[slot_of(c, c->node[i].key)];
    while (*p != i)
        p = &c->node[*p].hnext;
    *p = c->node[i].hnext;
}

/* Makes key the most recent entry, inserting it (and evicting) if absent. */
static void lru_touch(lru_t *c, uint64_t key)
{
    uint32_t i = lru_find(c, key);
    if (i != NIL) {
        unlink_lru(c, i);
        push_head(c, i);
        return;
    }
    if (c->used < c->cap) {
        i = c->used++;
    } else {
        i = c->tail;
        unlink_lru(c, i);
        unlink_hash(c, i);
        c->evictions++;
    }
    uint32_t s = slot_of(c, key);
    c->node[i].key = key;
    c->node[i].hnext = c->bucket[s];
    c->bucket[s] = i;
    push_head(c, i);
}

/*
 * The keys of request idx's full engine blocks: key k names the prompt's
 * tokens [0, (k+1)*B), i.e. the chain of the trace ids they span and where
 * the block ends inside the last one. Tokens past the trace's ids are the
 * request's own, so their keys carry idx.
 */
static uint32_t block_keys(const kv_trace_t *t, size_t idx, const kvb_oracle_opts_t *o,
                           uint64_t *keys)
{
    const kv_trace_req_t *r = &t->reqs[idx];
    const uint64_t *ids = kv_trace_ids(t, r);
    uint32_t nb = r->input_length / o->block_size;
    uint64_t chain = 0;
    uint32_t chained = 0;       /* ids folded into chain */

    for (uint32_t k = 0; k < nb; k++) {
        uint64_t end = (uint64_t)(k + 1) * o->block_size;      /* exclusive */
        uint64_t j = (end - 1) / o->trace_block_size;          /* id holding the last token */
        while (chained <= j) {
            uint64_t id = chained < r->n_hash ? ids[chained]
                          : kv_hash_chain(0x6f776eull, ((uint64_t)idx << 24) ^ chained);
            chain = kv_hash_chain(chain, id);
            chained++;
        }
        keys[k] = kv_hash_chain(chain, end - j * o->trace_block_size);
    }
    return nb;
}

static uint32_t cached_prefix(const lru_t *c, const uint64_t *keys, uint32_t n)
{
    uint32_t k = 0;
    while (k < n && lru_find(c, keys[k]) != NIL)
        k++;
    return k;
}

static void serve(lru_t *c, const uint64_t *keys, uint32_t n)
{
    for (uint32_t k = n; k-- > 0;)
        lru_touch(c, keys[k]);
}

/* Engine e's speed against the fleet's fastest (rule 2 of kvb_oracle.h). */
static double speed(const kvb_oracle_opts_t *o, uint32_t e)
{
    return e >= o->engines - o->slow_engines ? o->slow_factor : 1.0;
}

static double floor_ms(const kvb_oracle_opts_t *o, uint32_t len, uint64_t cached)
{
    return o->floor_speedup > 0
           ? kvb_floor_ttft_ms(len, cached, o->block_size, o->floor_budget, o->floor_speedup)
           : 0;
}

int kvb_oracle_run(const kv_trace_t *t, const kvb_oracle_opts_t *o, kvb_oracle_result_t *res,
                   char *err, size_t errlen)
{
    lru_t *eng = NULL, ideal = {0};
    uint64_t *keys = NULL, *work = NULL, *cost = NULL;
    uint32_t *have = NULL;
    uint64_t max_blocks = 0, all_blocks = 0;
    int rc = -1;

    memset(res, 0, sizeof(*res));
    if (o->engines == 0 || o->engines > 4096 || o->block_size == 0
        || o->trace_block_size == 0 || !(o->balance >= 1.0)
        || o->slow_engines > o->engines
        || (o->slow_engines > 0 && !(o->slow_factor > 0 && o->slow_factor <= 1))
        || (o->floor_speedup > 0 && o->floor_budget == 0)) {
        snprintf(err, errlen, "need 1 <= engines <= 4096, block sizes > 0, balance >= 1, "
                 "slow engines <= engines at a factor in (0, 1], and a token budget > 0 "
                 "with floors");
        return -1;
    }
    double speeds = 0;
    for (uint32_t e = 0; e < o->engines; e++)
        speeds += speed(o, e);
    uint64_t cap = o->cache_tokens / o->block_size;
    if (cap == 0 || cap >= (1u << 30)) {
        snprintf(err, errlen, "cache-tokens / block-size must be in [1, 2^30) blocks, got %llu",
                 (unsigned long long)cap);
        return -1;
    }
    for (size_t i = 0; i < t->n; i++) {
        uint64_t nb = t->reqs[i].input_length / o->block_size;
        max_blocks = nb > max_blocks ? nb : max_blocks;
        all_blocks += nb;
    }
    if (all_blocks >= (1u << 30)) {
        snprintf(err, errlen, "trace too large: %llu blocks", (unsigned long long)all_blocks);
        return -1;
    }
    eng = calloc(o->engines, sizeof(*eng));
    keys = malloc((max_blocks + 1) * sizeof(*keys));
    work = calloc(o->engines, sizeof(*work));
    cost = calloc(o->engines, sizeof(*cost));
    have = calloc(o->engines, sizeof(*have));
    if (!eng || !keys || !work || !cost || !have)
        goto nomem;
    for (uint32_t e = 0; e < o->engines; e++)
        if (lru_init(&eng[e], (uint32_t)cap))
            goto nomem;
    if (lru_init(&ideal, (uint32_t)(all_blocks ? all_blocks : 1)))
        goto nomem;

    for (size_t i = 0; i < t->n; i++) {
        uint32_t len = t->reqs[i].input_length;
        uint32_t n = block_keys(t, i, o, keys);
        uint64_t total = 0;

        res->prompt_tokens += len;
        uint64_t ideal_hit = (uint64_t)cached_prefix(&ideal, keys, n) * o->block_size;
        res->ideal_cached += ideal_hit;
        res->ideal_floor_ms += floor_ms(o, len, ideal_hit);
        serve(&ideal, keys, n);

        for (uint32_t e = 0; e < o->engines; e++) {
            have[e] = cached_prefix(&eng[e], keys, n);
            cost[e] = len - (uint64_t)have[e] * o->block_size;
            total += work[e];
        }
        uint32_t best = NIL, low = 0;
        for (uint32_t e = 0; e < o->engines; e++) {
            /* rule 2 without division: S * (W_e + u_e) <= balance * (sum W + u_e) * s_e,
             * S = sum s (= N with one speed: the same sums as before speeds) */
            int ok = speeds * (double)(work[e] + cost[e])
                     <= o->balance * (double)(total + cost[e]) * speed(o, e);
            if (ok && (best == NIL || have[e] > have[best]
                       || (have[e] == have[best]
                           && (double)work[e] * speed(o, best)
                              < (double)work[best] * speed(o, e))))
                best = e;
            if ((double)(work[e] + cost[e]) * speed(o, low)
                < (double)(work[low] + cost[low]) * speed(o, e))
                low = e;
        }
        if (best == NIL) {
            best = low;
            res->fallbacks++;
        }
        uint64_t oracle_hit = (uint64_t)have[best] * o->block_size;
        res->oracle_cached += oracle_hit;
        res->oracle_floor_ms += floor_ms(o, len, oracle_hit);
        work[best] += cost[best];
        serve(&eng[best], keys, n);
    }

    uint64_t sum = 0, max = 0;
    for (uint32_t e = 0; e < o->engines; e++) {
        sum += work[e];
        max = work[e] > max ? work[e] : max;
        res->evictions += eng[e].evictions;
    }
    res->work_spread = sum ? (double)max * o->engines / (double)sum : 1.0;
    if (t->n > 0 && o->floor_speedup > 0) {
        res->any_order_floor_ms = kvb_floor_any_order_ms(res->prompt_tokens - res->ideal_cached,
                                                         t->n, o->floor_speedup);
        res->oracle_floor_ms /= (double)t->n;
        res->ideal_floor_ms /= (double)t->n;
    }
    res->oracle_hit_rate = res->prompt_tokens
                           ? (double)res->oracle_cached / (double)res->prompt_tokens : 0;
    res->ideal_hit_rate = res->prompt_tokens
                          ? (double)res->ideal_cached / (double)res->prompt_tokens : 0;
    rc = 0;
    goto out;
nomem:
    snprintf(err, errlen, "out of memory");
out:
    if (eng)
        for (uint32_t e = 0; e < o->engines; e++)
            lru_free(&eng[e]);
    lru_free(&ideal);
    free(eng);
    free(keys);
    free(work);
    free(cost);
    free(have);
    return rc;
}
