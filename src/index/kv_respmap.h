/*
 * Which server made a response: a bounded map in shared memory from the key
 * of a Responses API response id to the worker id of the server that
 * answered it. A request that continues a response (`previous_response_id`)
 * must go back to that one engine: vLLM keeps responses in the process that
 * made them (its store, when turned on), and any other engine answers 404.
 *
 * Layout over a region the caller gives (the kvroute zone in nginx): a
 * header, then buckets of KV_RESPMAP_WAYS entries, newest first.
 *
 *   readers  never lock and never wait: they copy a bucket with relaxed word
 *            loads under its sequence count (kv_seqlock.h); a bucket that
 *            stays busy is a miss.
 *   writers  take a try-lock (kv_trylock.h); a busy lock skips the put, so
 *            no response waits on another process.
 *   bounds   a put goes to the front of its bucket and a full bucket drops
 *            its oldest: first in, first out per bucket. A response id is
 *            written once, when the response is made, so that is least
 *            recently made out first; a conversation that goes on writes a
 *            new id at every turn.
 */
#ifndef KV_RESPMAP_H
#define KV_RESPMAP_H

#include <stddef.h>
#include <stdint.h>

#define KV_RESPMAP_WAYS 7               /* a bucket is 128 bytes */

typedef struct kv_respmap kv_respmap_t;

typedef struct {
    uint64_t    capacity;       /* ids it can hold */
    uint64_t    stored;         /* puts done */
    uint64_t    skipped;        /* puts skipped: the lock was busy */
    uint64_t    hits;           /* lookups that found their id */
    uint64_t    misses;
} kv_respmap_stats_t;

/* Smallest region kv_respmap_create accepts. */
size_t kv_respmap_min_size(void);

/* Lays an empty map over mem[0..size) (8-aligned); NULL if too small. */
kv_respmap_t *kv_respmap_create(void *mem, size_t size);
/* The map already laid over mem (a reused zone), or NULL. */
kv_respmap_t *kv_respmap_attach(void *mem, size_t size);

/* key (nonzero) was made by worker (nonzero). 1: stored, 0: skipped. */
int kv_respmap_put(kv_respmap_t *m, uint64_t key, uint64_t worker);
/* The worker that made key; 0 when unknown. */
uint64_t kv_respmap_get(kv_respmap_t *m, uint64_t key);

void kv_respmap_stats(const kv_respmap_t *m, kv_respmap_stats_t *out);

#endif
