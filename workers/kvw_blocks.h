/*
 * The KV block manager: a fixed pool of blocks with prefix caching, shared
 * by every engine kind (the mock only counts them; cpu and cuda also keep
 * the KV data at the same block ids).
 *
 * A block is free (never used or dropped), active (referenced by running
 * sequences) or cached-inactive (unreferenced but still holding a full,
 * hashed block that a later request may reuse). Inactive blocks sit on an
 * LRU list; a sequence's blocks are released tail first, so a finished
 * sequence's deepest blocks become the oldest and are evicted first, as
 * vLLM and Dynamo's mocker do.
 *
 * A full block is registered in the cache when its tokens have been
 * computed (kvw_blocks_commit): its block_hash is the router's sequence
 * hash (chained, seed 1337) and its tokens_hash the local hash (seed 1337,
 * or derived from the cache salt). Registration and eviction produce
 * Stored and Removed events, batched as docs/PROTOCOL.md says and handed
 * to a sink when flushed.
 */
#ifndef KVW_BLOCKS_H
#define KVW_BLOCKS_H

#include <stddef.h>
#include <stdint.h>

#define KVW_BATCH_MAX_BLOCKS 128

typedef enum { KVW_EV_STORED, KVW_EV_REMOVED, KVW_EV_CLEARED } kvw_ev_kind_t;

/* One flushed event: stored blocks form one chain under parent. */
typedef struct {
    kvw_ev_kind_t   kind;
    int             has_parent;
    uint64_t        parent;
    size_t          n;
    uint64_t        hashes[KVW_BATCH_MAX_BLOCKS];   /* block_hash (sequence hash) */
    uint64_t        locals[KVW_BATCH_MAX_BLOCKS];   /* tokens_hash; stored only */
} kvw_event_t;

typedef void (*kvw_event_sink_fn)(void *ctx, const kvw_event_t *ev);

typedef struct kvw_blocks kvw_blocks_t;

/* A sequence's hold on blocks: its block table and how much of it is cached. */
typedef struct {
    uint32_t   *table;      /* physical block ids, in order */
    uint32_t    n;          /* blocks in table */
    uint32_t    cap;
    uint32_t    n_hashed;   /* leading blocks that are registered in the cache or duplicates */
    uint64_t    last_hash;  /* sequence hash of block n_hashed - 1 */
    uint64_t    seed;       /* local hash seed (cache salt) */
} kvw_seq_blocks_t;

/* One cached block in a dump, parent before child. */
typedef struct {
    int         has_parent;
    uint64_t    parent, hash, local;
} kvw_dump_block_t;

typedef struct {
    uint64_t    lookups_tokens;     /* prompt tokens looked up on admission */
    uint64_t    hit_tokens;         /* of which served from the cache */
    uint64_t    evictions;
} kvw_blocks_stats_t;

/*
 * A request's local hash seed: its cache salt, else its LoRA adapter's name
 * (as vLLM keeps an adapter's blocks apart; the router hashes the same way),
 * else the base seed. adapter is NULL for the base model.
 */
uint64_t kvw_blocks_seed(const char *cache_salt, const char *adapter);

kvw_blocks_t *kvw_blocks_new(uint32_t num_blocks, uint32_t block_size);
void kvw_blocks_free(kvw_blocks_t *bm);

/* The sink receives flushed events; NULL drops them. */
void kvw_blocks_set_sink(kvw_blocks_t *bm, kvw_event_sink_fn fn, void *ctx);

uint32_t kvw_blocks_block_size(const kvw_blocks_t *bm);
uint32_t kvw_blocks_total(const kvw_blocks_t *bm);
/* Blocks that can be handed out now: free plus evictable. */
uint32_t kvw_blocks_available(const kvw_blocks_t *bm);
/* Blocks referenced by sequences. */
uint32_t kvw_blocks_active(const kvw_blocks_t *bm);
/* Blocks holding data: active plus cached-inactive. */
uint32_t kvw_blocks_used(const kvw_blocks_t *bm);
uint32_t kvw_blocks_cached(const kvw_blocks_t *bm);
const kvw_blocks_stats_t *kvw_blocks_stats(const kvw_blocks_t *bm);

/*
 * How many leading full blocks of tokens[0..n) are cached, never counting
 * the block holding the last token (one token must be computed to sample).
 * *inactive (may be NULL) gets how many of those are unreferenced, i.e.
 * would take capacity when reused.
 */
uint32_t kvw_blocks_lookup(kvw_blocks_t *bm, uint64_t seed, const uint32_t *tokens,
                           size_t n, uint32_t *inactive);

/*
 * Starts a sequence (s must be zeroed or released): references the cached
 * prefix as kvw_blocks_lookup counts it and returns the cached token count.
 * Counts the lookup in the hit-rate statistics.
 */
size_t kvw_blocks_acquire_prefix(kvw_blocks_t *bm, kvw_seq_blocks_t *s, uint64_t seed,
                                 const uint32_t *tokens, size_t n);

/*
 * The same without counting a lookup: a transfer's hold on blocks
 * (kvw_xfer.h), which is not a request's prefix hit.
 */
size_t kvw_blocks_pin_prefix(kvw_blocks_t *bm, kvw_seq_blocks_t *s, uint64_t seed,
                             const uint32_t *tokens, size_t n);

/*
 * Makes s's table cover n_tokens slots, taking new blocks (evicting cached
 * ones, LRU first) as needed. All or nothing: -1 if not enough blocks.
 */
int kvw_blocks_reserve(kvw_blocks_t *bm, kvw_seq_blocks_t *s, size_t n_tokens);

/*
 * tokens[0..n_computed) now have KV in s's blocks: registers every newly
 * full block in the cache (Stored events). A block whose hash is already
 * cached elsewhere stays private to s and is dropped on release.
 */
void kvw_blocks_commit(kvw_blocks_t *bm, kvw_seq_blocks_t *s, const uint32_t *tokens,
                       size_t n_computed);

/* Drops s's references, tail first; frees the table. */
void kvw_blocks_release(kvw_blocks_t *bm, kvw_seq_blocks_t *s);

/* Evicts every cached-inactive block and publishes Cleared (active ones stay). */
void kvw_blocks_clear(kvw_blocks_t *bm);

/* Hands the pending batch to the sink (end of a scheduler step). */
void kvw_blocks_flush(kvw_blocks_t *bm);

/*
 * A snapshot of every cached (registered) block, parents first. Flushes
 * first, so it reflects exactly the events handed to the sink. Caller frees.
 */
kvw_dump_block_t *kvw_blocks_dump(kvw_blocks_t *bm, size_t *n);

/* Is the block with this sequence hash cached? (tests) */
int kvw_blocks_contains(const kvw_blocks_t *bm, uint64_t hash);

#endif
