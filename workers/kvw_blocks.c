#include "kvw_blocks.h"

#include <stdlib.h>
#include <string.h>

#include "kv_hash.h"

#define NIL (-1)

typedef struct {
    uint64_t    hash;       /* sequence hash, when cached */
    uint64_t    local;
    uint64_t    parent;
    uint32_t    depth;      /* index in its sequence: orders dumps parent first */
    uint32_t    ref;
    int32_t     prev, next; /* LRU links, while cached and unreferenced */
    int32_t     hnext;      /* hash bucket chain */
    uint8_t     cached;     /* registered in the hash table */
    uint8_t     has_parent;
} block_t;

struct kvw_blocks {
    uint32_t            num_blocks, block_size;
    block_t            *b;
    uint32_t           *free_ids;
    uint32_t            n_free;
    int32_t            *buckets;
    uint64_t            mask;
    int32_t             lru_head, lru_tail;     /* head: oldest, evicted first */
    uint32_t            n_inactive, n_active, n_cached;
    kvw_event_sink_fn   sink;
    void               *sink_ctx;
    kvw_event_t         pend;
    int                 has_pend;
    kvw_blocks_stats_t  stats;
};

uint64_t kvw_blocks_seed(const char *cache_salt, const char *adapter)
{
    if (cache_salt)
        return kv_hash_seed(cache_salt, strlen(cache_salt));
    return adapter ? kv_hash_seed(adapter, strlen(adapter)) : KV_HASH_SEED;
}

kvw_blocks_t *kvw_blocks_new(uint32_t num_blocks, uint32_t block_size)
{
    kvw_blocks_t *bm = calloc(1, sizeof(*bm));
    uint64_t nb = 16;

    if (bm == NULL || num_blocks == 0 || block_size == 0) {
        free(bm);
        return NULL;
    }
    while (nb < 2ULL * num_blocks)
        nb <<= 1;
    bm->num_blocks = num_blocks;
    bm->block_size = block_size;
    bm->b = calloc(num_blocks, sizeof(block_t));
    bm->free_ids = malloc(num_blocks * sizeof(uint32_t));
    bm->buckets = malloc(nb * sizeof(int32_t));
    if (bm->b == NULL || bm->free_ids == NULL || bm->buckets == NULL) {
        kvw_blocks_free(bm);
        return NULL;
    }
    bm->mask = nb - 1;
    for (uint64_t i = 0; i < nb; i++)
        bm->buckets[i] = NIL;
    /* pop order 0, 1, 2...: block ids are handed out low first */
    for (uint32_t i = 0; i < num_blocks; i++)
        bm->free_ids[i] = num_blocks - 1 - i;
    bm->n_free = num_blocks;
    bm->lru_head = bm->lru_tail = NIL;
    return bm;
}

void kvw_blocks_free(kvw_blocks_t *bm)
{
    if (bm == NULL)
        return;
    free(bm->b);
    free(bm->free_ids);
    free(bm->buckets);
    free(bm);
}

void kvw_blocks_set_sink(kvw_blocks_t *bm, kvw_event_sink_fn fn, void *ctx)
{
    bm->sink = fn;
    bm->sink_ctx = ctx;
}

uint32_t kvw_blocks_block_size(const kvw_blocks_t *bm) { return bm->block_size; }
uint32_t kvw_blocks_total(const kvw_blocks_t *bm) { return bm->num_blocks; }
uint32_t kvw_blocks_available(const kvw_blocks_t *bm) { return bm->n_free + bm->n_inactive; }
uint32_t kvw_blocks_active(const kvw_blocks_t *bm) { return bm->n_active; }
uint32_t kvw_blocks_used(const kvw_blocks_t *bm) { return bm->n_active + bm->n_inactive; }
uint32_t kvw_blocks_cached(const kvw_blocks_t *bm) { return bm->n_cached; }
const kvw_blocks_stats_t *kvw_blocks_stats(const kvw_blocks_t *bm) { return &bm->stats; }

/* --- events: Dynamo-style batching ------------------------------------- */

void kvw_blocks_flush(kvw_blocks_t *bm)
{
    if (bm->has_pend && bm->sink)
        bm->sink(bm->sink_ctx, &bm->pend);
    bm->has_pend = 0;
}

static void start_pending(kvw_blocks_t *bm, kvw_ev_kind_t kind)
{
    kvw_blocks_flush(bm);
    bm->has_pend = 1;
    bm->pend.kind = kind;
    bm->pend.n = 0;
    bm->pend.has_parent = 0;
    bm->pend.parent = 0;
}

/* A store joins the pending one when it extends the same chain. */
static void emit_stored(kvw_blocks_t *bm, const block_t *blk)
{
    kvw_event_t *p = &bm->pend;
    int joins = bm->has_pend && p->kind == KVW_EV_STORED && p->n > 0
                && p->n < KVW_BATCH_MAX_BLOCKS && blk->has_parent
                && p->hashes[p->n - 1] == blk->parent;

    if (!joins) {
        start_pending(bm, KVW_EV_STORED);
        p->has_parent = blk->has_parent;
        p->parent = blk->parent;
    }
    p->hashes[p->n] = blk->hash;
    p->locals[p->n] = blk->local;
    p->n++;
}

static void emit_removed(kvw_blocks_t *bm, uint64_t hash)
{
    kvw_event_t *p = &bm->pend;

    if (!(bm->has_pend && p->kind == KVW_EV_REMOVED && p->n < KVW_BATCH_MAX_BLOCKS))
        start_pending(bm, KVW_EV_REMOVED);
    p->hashes[p->n++] = hash;
}

/* --- hash table and LRU ------------------------------------------------- */

static int32_t find(const kvw_blocks_t *bm, uint64_t hash)
{
    int32_t i = bm->buckets[hash & bm->mask];
    while (i != NIL && bm->b[i].hash != hash)
        i = bm->b[i].hnext;
    return i;
}

int kvw_blocks_contains(const kvw_blocks_t *bm, uint64_t hash)
{
    return find(bm, hash) != NIL;
}

static void table_insert(kvw_blocks_t *bm, uint32_t id)
{
    uint64_t slot = bm->b[id].hash & bm->mask;
    bm->b[id].hnext = bm->buckets[slot];
    bm->buckets[slot] = (int32_t)id;
    bm->b[id].cached = 1;
    bm->n_cached++;
}

static void table_remove(kvw_blocks_t *bm, uint32_t id)
{
    int32_t *pp = &bm->buckets[bm->b[id].hash & bm->mask];
    while (*pp != (int32_t)id)
        pp = &bm->b[*pp].hnext;
    *pp = bm->b[id].hnext;
    bm->b[id].cached = 0;
    bm->n_cached--;
}

static void lru_unlink(kvw_blocks_t *bm, uint32_t id)
{
    block_t *x = &bm->b[id];
    if (x->prev != NIL) bm->b[x->prev].next = x->next; else bm->lru_head = x->next;
    if (x->next != NIL) bm->b[x->next].prev = x->prev; else bm->lru_tail = x->prev;
    bm->n_inactive--;
}

static void lru_push(kvw_blocks_t *bm, uint32_t id)
{
    block_t *x = &bm->b[id];
    x->prev = bm->lru_tail;
    x->next = NIL;
    if (bm->lru_tail != NIL) bm->b[bm->lru_tail].next = (int32_t)id; else bm->lru_head = (int32_t)id;
    bm->lru_tail = (int32_t)id;
    bm->n_inactive++;
}

static void take_ref(kvw_blocks_t *bm, uint32_t id)
{
    if (bm->b[id].ref++ == 0) {
        if (bm->b[id].cached)
            lru_unlink(bm, id);
        bm->n_active++;
    }
}

/* One holder fewer: an unreferenced block is cached-inactive (LRU) or free. */
static void drop_ref(kvw_blocks_t *bm, uint32_t id)
{
    if (--bm->b[id].ref > 0)
        return;
    bm->n_active--;
    if (bm->b[id].cached)
        lru_push(bm, id);
    else
        bm->free_ids[bm->n_free++] = id;
}

/* A fresh block: from the free list, else evict the least recently used. */
static uint32_t take_new(kvw_blocks_t *bm)
{
    uint32_t id;

    if (bm->n_free > 0) {
        id = bm->free_ids[--bm->n_free];
    } else {
        id = (uint32_t)bm->lru_head;
        lru_unlink(bm, id);
        table_remove(bm, id);
        emit_removed(bm, bm->b[id].hash);
        bm->stats.evictions++;
    }
    memset(&bm->b[id], 0, sizeof(block_t));
    bm->b[id].prev = bm->b[id].next = bm->b[id].hnext = NIL;
    bm->b[id].ref = 1;
    bm->n_active++;
    return id;
}

/* --- sequences ---------------------------------------------------------- */

static int table_grow(kvw_seq_blocks_t *s, uint32_t need)
{
    if (need <= s->cap)
        return 0;
    uint32_t c = s->cap ? s->cap : 8;
    while (c < need)
        c *= 2;
    uint32_t *t = realloc(s->table, c * sizeof(uint32_t));
    if (t == NULL)
        return -1;
    s->table = t;
    s->cap = c;
    return 0;
}

/* Walks the cached prefix; calls take on each hit when acquiring. */
static uint32_t walk_prefix(kvw_blocks_t *bm, kvw_seq_blocks_t *s, uint64_t seed,
                            const uint32_t *tokens, size_t n, uint32_t *inactive)
{
    uint32_t bs = bm->block_size, hits = 0, idle = 0;
    size_t max = n > 0 ? (n - 1) / bs : 0;
    uint64_t prev = 0;

    for (size_t i = 0; i < max; i++) {
        uint64_t local = kv_hash_block(tokens + i * bs, bs, seed);
        uint64_t h = i == 0 ? local : kv_hash_chain(prev, local);
        int32_t id = find(bm, h);
        if (id == NIL)
            break;
        if (bm->b[id].ref == 0)
            idle++;
        if (s) {
            if (table_grow(s, s->n + 1))
                break;
            take_ref(bm, (uint32_t)id);
            s->table[s->n++] = (uint32_t)id;
            s->n_hashed = s->n;
            s->last_hash = h;
        }
        prev = h;
        hits++;
    }
    if (inactive)
        *inactive = idle;
    return hits;
}

uint32_t kvw_blocks_lookup(kvw_blocks_t *bm, uint64_t seed, const uint32_t *tokens,
                           size_t n, uint32_t *inactive)
{
    return walk_prefix(bm, NULL, seed, tokens, n, inactive);
}

size_t kvw_blocks_acquire_prefix(kvw_blocks_t *bm, kvw_seq_blocks_t *s, uint64_t seed,
                                 const uint32_t *tokens, size_t n)
{
    s->seed = seed;
    uint32_t hits = walk_prefix(bm, s, seed, tokens, n, NULL);
    size_t cached = (size_t)hits * bm->block_size;
    bm->stats.lookups_tokens += n;
    bm->stats.hit_tokens += cached;
    return cached;
}

size_t kvw_blocks_pin_prefix(kvw_blocks_t *bm, kvw_seq_blocks_t *s, uint64_t seed,
                             const uint32_t *tokens, size_t n)
{
    s->seed = seed;
    return (size_t)walk_prefix(bm, s, seed, tokens, n, NULL) * bm->block_size;
}

int kvw_blocks_reserve(kvw_blocks_t *bm, kvw_seq_blocks_t *s, size_t n_tokens)
{
    size_t want = (n_tokens + bm->block_size - 1) / bm->block_size;

    if (want <= s->n)
        return 0;
    if (want - s->n > kvw_blocks_available(bm) || table_grow(s, (uint32_t)want))
        return -1;
    while (s->n < want) {
        uint32_t id = take_new(bm);
        bm->b[id].depth = s->n;
        s->table[s->n++] = id;
    }
    return 0;
}

void kvw_blocks_commit(kvw_blocks_t *bm, kvw_seq_blocks_t *s, const uint32_t *tokens,
                       size_t n_computed)
{
    uint32_t bs = bm->block_size;
    size_t full = n_computed / bs;

    if (full > s->n)
        full = s->n;
    for (size_t i = s->n_hashed; i < full; i++) {
        uint64_t local = kv_hash_block(tokens + i * bs, bs, s->seed);
        uint64_t h = i == 0 ? local : kv_hash_chain(s->last_hash, local);
        block_t *x = &bm->b[s->table[i]];
        int32_t twin = find(bm, h);
        if (twin == NIL) {
            x->hash = h;
            x->local = local;
            x->parent = s->last_hash;
            x->has_parent = i > 0;
            x->depth = (uint32_t)i;
            table_insert(bm, s->table[i]);
            emit_stored(bm, x);
        } else {
            /*
             * Computed twice concurrently (two requests admitted in one step).
             * The cached copy holds the same KV: the sequence takes it and frees
             * its own. A private copy would leave the cached one unreferenced,
             * so evictable while this sequence runs, and its next block would be
             * stored under a parent the router was just told is gone.
             */
            take_ref(bm, (uint32_t)twin);
            drop_ref(bm, s->table[i]);
            s->table[i] = (uint32_t)twin;
        }
        s->last_hash = h;
        s->n_hashed = (uint32_t)i + 1;
    }
}

void kvw_blocks_release(kvw_blocks_t *bm, kvw_seq_blocks_t *s)
{
    for (uint32_t i = s->n; i-- > 0; )
        drop_ref(bm, s->table[i]);
    free(s->table);
    memset(s, 0, sizeof(*s));
}

void kvw_blocks_clear(kvw_blocks_t *bm)
{
    for (uint32_t id = 0; id < bm->num_blocks; id++) {
        if (!bm->b[id].cached)
            continue;
        table_remove(bm, id);
        if (bm->b[id].ref == 0) {
            lru_unlink(bm, id);
            bm->free_ids[bm->n_free++] = id;
        }
        /* a referenced block becomes private: dropped when released */
    }
    start_pending(bm, KVW_EV_CLEARED);
    kvw_blocks_flush(bm);
}

kvw_dump_block_t *kvw_blocks_dump(kvw_blocks_t *bm, size_t *n)
{
    kvw_blocks_flush(bm);
    /* counting sort by depth: parents (smaller depth) come first */
    uint32_t maxd = 0;
    for (uint32_t id = 0; id < bm->num_blocks; id++)
        if (bm->b[id].cached && bm->b[id].depth > maxd)
            maxd = bm->b[id].depth;
    size_t *start = calloc((size_t)maxd + 2, sizeof(size_t));
    kvw_dump_block_t *out = malloc((bm->n_cached ? bm->n_cached : 1) * sizeof(*out));
    if (start == NULL || out == NULL) {
        free(start);
        free(out);
        *n = 0;
        return NULL;
    }
    for (uint32_t id = 0; id < bm->num_blocks; id++)
        if (bm->b[id].cached)
            start[bm->b[id].depth + 1]++;
    for (uint32_t d = 1; d <= maxd + 1; d++)
        start[d] += start[d - 1];
    for (uint32_t id = 0; id < bm->num_blocks; id++) {
        const block_t *x = &bm->b[id];
        if (!x->cached)
            continue;
        kvw_dump_block_t *o = &out[start[x->depth]++];
        o->has_parent = x->has_parent;
        o->parent = x->parent;
        o->hash = x->hash;
        o->local = x->local;
    }
    free(start);
    *n = bm->n_cached;
    return out;
}
