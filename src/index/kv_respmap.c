/* Response id -> the worker that made it, in shared memory (kv_respmap.h). */
#include <string.h>

#include "kv_respmap.h"
#include "kv_seqlock.h"
#include "kv_trylock.h"

#define RM_MAGIC        0x6b767265736d7031ULL   /* "kvresmp1" */
#define RM_LOCK_STALE_S 10

typedef struct {
    uint64_t    key;            /* 0: empty */
    uint64_t    worker;
} entry_t;

typedef struct {
    kv_seqlock_t    seq;
    uint32_t        pad;
    entry_t         e[KV_RESPMAP_WAYS];
    uint64_t        pad2;
} bucket_t;

_Static_assert(sizeof(bucket_t) == 128, "a bucket is two cache lines");

struct kv_respmap {
    uint64_t    magic;
    uint64_t    size;
    uint64_t    nbuckets;
    uint64_t    lock;           /* the writer's (kv_trylock.h) */
    uint64_t    stored, skipped, hits, misses;
    bucket_t    b[];
};

size_t kv_respmap_min_size(void)
{
    return sizeof(kv_respmap_t) + 8 * sizeof(bucket_t);
}

kv_respmap_t *kv_respmap_create(void *mem, size_t size)
{
    kv_respmap_t *m = mem;

    if (mem == NULL || size < kv_respmap_min_size())
        return NULL;
    memset(m, 0, sizeof(*m));
    m->size = size;
    m->nbuckets = (size - sizeof(*m)) / sizeof(bucket_t);
    memset(m->b, 0, m->nbuckets * sizeof(bucket_t));
    __atomic_store_n(&m->magic, RM_MAGIC, __ATOMIC_RELEASE);
    return m;
}

kv_respmap_t *kv_respmap_attach(void *mem, size_t size)
{
    kv_respmap_t *m = mem;

    if (mem == NULL || size < kv_respmap_min_size()
        || __atomic_load_n(&m->magic, __ATOMIC_ACQUIRE) != RM_MAGIC || m->size != size)
    {
        return NULL;
    }
    return m;
}

static bucket_t *bucket_of(kv_respmap_t *m, uint64_t key)
{
    /* the key is a hash: its high half spread over the buckets */
    return &m->b[(key >> 32) * m->nbuckets >> 32];
}

static void bump(uint64_t *counter)
{
    __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED);
}

static void store_entry(entry_t *e, uint64_t key, uint64_t worker)
{
    __atomic_store_n(&e->key, key, __ATOMIC_RELAXED);
    __atomic_store_n(&e->worker, worker, __ATOMIC_RELAXED);
}

int kv_respmap_put(kv_respmap_t *m, uint64_t key, uint64_t worker)
{
    bucket_t *b;
    size_t    i, last;

    if (key == 0 || worker == 0)
        return 0;
    if (!kv_trylock(&m->lock, RM_LOCK_STALE_S)) {
        bump(&m->skipped);
        return 0;
    }
    b = bucket_of(m, key);
    /* the key's own entry, if there, is dropped from where it was; the
     * others move back one (the last one out when none is dropped) */
    for (last = 0; last < KV_RESPMAP_WAYS - 1 && b->e[last].key != key; last++) {
    }
    kv_seqlock_unstick(&b->seq);        /* a writer killed mid-write */
    kv_seqlock_write_begin(&b->seq);
    for (i = last; i > 0; i--)
        store_entry(&b->e[i], b->e[i - 1].key, b->e[i - 1].worker);
    store_entry(&b->e[0], key, worker);
    kv_seqlock_write_end(&b->seq);
    kv_unlock(&m->lock);
    bump(&m->stored);
    return 1;
}

uint64_t kv_respmap_get(kv_respmap_t *m, uint64_t key)
{
    bucket_t     *b;
    kv_seqread_t  rd = { 0, 0 };
    uint64_t      worker;
    size_t        i;

    if (key == 0)
        return 0;
    b = bucket_of(m, key);
    while (kv_seqlock_read_begin(&b->seq, &rd)) {
        worker = 0;
        for (i = 0; i < KV_RESPMAP_WAYS; i++) {
            if (__atomic_load_n(&b->e[i].key, __ATOMIC_RELAXED) == key) {
                worker = __atomic_load_n(&b->e[i].worker, __ATOMIC_RELAXED);
                break;
            }
        }
        if (kv_seqlock_read_end(&b->seq, &rd)) {
            bump(worker ? &m->hits : &m->misses);
            return worker;
        }
    }
    bump(&m->misses);
    return 0;
}

void kv_respmap_stats(const kv_respmap_t *m, kv_respmap_stats_t *out)
{
    out->capacity = m->nbuckets * KV_RESPMAP_WAYS;
    out->stored = __atomic_load_n(&m->stored, __ATOMIC_RELAXED);
    out->skipped = __atomic_load_n(&m->skipped, __ATOMIC_RELAXED);
    out->hits = __atomic_load_n(&m->hits, __ATOMIC_RELAXED);
    out->misses = __atomic_load_n(&m->misses, __ATOMIC_RELAXED);
}
