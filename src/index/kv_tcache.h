/*
 * A bounded cache in shared memory from text prefixes to the token ids they
 * encode to, for the turn-delta tokenizer (src/route/kv_turn.c): any nginx
 * worker process reads what any other stored.
 *
 * Layout over a region the caller gives (the kvroute zone in nginx): a
 * header, a set-associative table of (key, position) slots, and a ring of
 * entries written one after another. An entry is its key, the text it
 * stands for (compared in full on a hit, so a hash collision is a miss,
 * never wrong ids), the ids, and when it was written.
 *
 *   readers  never lock and never wait: they copy an entry with relaxed word
 *            loads and then check the ring's reclaim mark, which a writer
 *            moves past an entry BEFORE overwriting it (the seqlock pattern
 *            of kv_seqlock.h, per ring position): a moved mark is a miss.
 *   writers  take a try-lock (the writer's pid, taken over from a dead
 *            holder); a busy lock skips the insert, so no request ever
 *            waits on another process.
 *   bounds   the ring is the memory bound and evicts oldest-written first;
 *            an entry older than the TTL is a miss. A live conversation
 *            rewrites its prefix at every turn, so it stays (LRU by turn).
 */
#ifndef KV_TCACHE_H
#define KV_TCACHE_H

#include <stddef.h>
#include <stdint.h>

typedef struct kv_tcache kv_tcache_t;

typedef struct {
    uint64_t    lookups;        /* requests that probed */
    uint64_t    hits;
    uint64_t    misses;
    uint64_t    hit_tokens;     /* ids served from the cache */
    uint64_t    stored;
    uint64_t    skipped;        /* inserts skipped: lock busy or entry too large */
    uint64_t    evicted;        /* live entries overwritten by the ring */
    uint64_t    expired;        /* probes that found an entry past the TTL */
    uint64_t    bytes;          /* ring capacity */
    uint64_t    ttl_ms;
} kv_tcache_stats_t;

/* Smallest region kv_tcache_create accepts. */
size_t kv_tcache_min_size(void);

/* Lays a cache over mem[0..size) (8-aligned). NULL with err if too small. */
kv_tcache_t *kv_tcache_create(void *mem, size_t size, uint64_t ttl_ms, char *err,
                              size_t errlen);
/* The cache already laid over mem (a reused zone), or NULL. */
kv_tcache_t *kv_tcache_attach(void *mem, size_t size);
void kv_tcache_set_ttl(kv_tcache_t *c, uint64_t ttl_ms);

typedef struct {
    uint64_t    key;            /* hash of the prefix and its context */
    size_t      len;            /* prefix length in bytes */
} kv_tcache_probe_t;

/*
 * Tries probes in order; the first whose entry holds exactly text[0..len)
 * under its key is a hit: its ids are returned malloc'ed in *ids (count in
 * *nids) and its index is returned. -1: a miss (counted), -2: no memory.
 */
long kv_tcache_get(kv_tcache_t *c, const kv_tcache_probe_t *probes, size_t nprobes,
                   const char *text, uint64_t now_ms, uint32_t **ids, size_t *nids);

/* Stores text[0..len) -> ids[0..n) under key. 0 stored, 1 skipped. */
int kv_tcache_put(kv_tcache_t *c, uint64_t key, const char *text, size_t len,
                  const uint32_t *ids, size_t n, uint64_t now_ms);

void kv_tcache_stats(const kv_tcache_t *c, kv_tcache_stats_t *st);

#endif
