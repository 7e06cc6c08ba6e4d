/*
 * The prefix index: which workers hold which KV blocks, answering "how many
 * leading blocks of this request does each worker hold?".
 *
 * It lives entirely inside one caller-provided region of fixed size (an
 * nginx shared memory zone; plain memory in tests and tools), holds no
 * pointers (offsets only, so the region may be mapped at any address) and
 * never allocates after kv_index_create.
 *
 * Keys are the router's sequence hashes (kv_hash.h): seq(i) = chain of the
 * local hashes of blocks 0..i, so one key names one exact prefix. Stored
 * events carry the engine's opaque block_hash and the local tokens_hash;
 * the index keeps, per worker, engine hash -> sequence hash, to follow
 * parent links and to apply removals.
 *
 * Concurrency: exactly one writer at a time (the caller serialises writers;
 * in nginx the event helper process, or a shm mutex in approximate mode)
 * and any number of readers in other processes. Readers never block and
 * never see a torn entry; the scheme is described at the top of
 * kv_index.c.
 *
 * Workers are (worker_id, dp_rank) pairs, each given a slot < max_workers.
 */
#ifndef KV_INDEX_H
#define KV_INDEX_H

#include <stddef.h>
#include <stdint.h>

#include "kv_event.h"

typedef struct kv_index kv_index_t;

typedef struct {
    uint32_t    max_workers;    /* worker slots; default 256 when 0 */
    int         approximate;    /* entries expire; fed by kv_index_record */
    uint32_t    ttl_ms;         /* approximate: default 120000 */
    uint64_t    max_blocks;     /* approximate: cap, default 1 << 20 */
    double      prune_ratio;    /* approximate: prune to this share of the cap, default 0.8 */
    int         engine_hashes;  /* events name blocks by the engine's own hashes (vLLM,
                                   SGLang over ZMQ): every block held needs an engine
                                   map entry, so the map is sized like the entries */
} kv_index_config_t;

typedef struct {
    uint32_t    slot;
    uint32_t    blocks;         /* leading request blocks this slot holds */
} kv_overlap_t;

typedef struct {
    uint64_t    blocks;         /* distinct sequence hashes indexed */
    uint64_t    capacity;       /* blocks the region can hold */
    uint64_t    bytes;          /* region size */
    uint64_t    workers;        /* slots in use */
    uint64_t    stored;         /* blocks stored by events/records */
    uint64_t    removed;        /* blocks removed by events */
    uint64_t    cleared;        /* Cleared events and worker removals */
    uint64_t    evicted;        /* blocks dropped for lack of space (LRU) */
    uint64_t    expired;        /* approximate: TTL */
    uint64_t    pruned;         /* approximate: over the cap */
    uint64_t    unknown_parent; /* stores dropped: parent not indexed */
    uint64_t    unknown_remove; /* removals of hashes not indexed */
    uint64_t    holes;          /* keys in the hole table (kv_index.c) */
    uint64_t    lost_slots;     /* slots whose holes overflowed it: matches walk */
    uint64_t    ttl_ms;         /* approximate: the memory now (kv_index_set_ttl) */
    uint64_t    writer_died;    /* writers killed inside a call: the index was cleared */
} kv_index_stats_t;

/* The smallest region kv_index_create accepts for cfg. */
size_t kv_index_min_size(const kv_index_config_t *cfg);

/* Lays out a fresh index in region; NULL with a reason if it cannot. */
kv_index_t *kv_index_create(void *region, size_t size, const kv_index_config_t *cfg,
                            char *err, size_t errlen);

/* Re-opens an index kv_index_create laid out in region (an nginx reload
 * reusing the zone); NULL if the region holds no compatible index. */
kv_index_t *kv_index_open(void *region, size_t size);

/* --- writer ------------------------------------------------------------ */

/* The slot of (worker_id, dp_rank), creating it; -1 when all are taken. */
int  kv_index_worker_add(kv_index_t *ix, uint64_t worker_id, uint32_t dp_rank);
/* Cleared: drops every block of worker_id, all dp ranks; slots stay. */
void kv_index_worker_clear(kv_index_t *ix, uint64_t worker_id);
/* Drops worker_id's blocks and frees its slots. The slots are retired at
 * once (no reader credits them again) and their entries freed by the next
 * kv_index_reap, which kv_index_worker_add also calls when no slot is free. */
void kv_index_worker_remove(kv_index_t *ix, uint64_t worker_id);
/* Frees the entries of every retired slot in one pass; returns how many
 * slots it freed (0: nothing to do, cheap). */
int  kv_index_reap(kv_index_t *ix);

/* Applies one decoded event (adding the worker's slot if needed). Returns
 * 0, or -1 with a reason (e.g. a store whose parent is not indexed, which
 * is dropped whole, as Dynamo does). */
int  kv_index_apply(kv_index_t *ix, const kv_event_t *ev, uint64_t now_ms,
                    char *err, size_t errlen);

/* The sequence hash that worker's engine hash names (the hash itself when
 * the index keeps no mapping for it). Writer only: the map is the writer's. */
uint64_t kv_index_seq_of(kv_index_t *ix, uint64_t worker_id, uint32_t dp_rank,
                         uint64_t engine_hash);

/* Pending index: slot no longer holds these sequence hashes (its worker
 * said so in its own events, which win over the router's guesses). */
void kv_index_forget(kv_index_t *ix, uint32_t slot, const uint64_t *seq, size_t n);

/* Approximate mode: slot now holds the blocks with these sequence hashes
 * (the request it was just sent); they expire after ttl_ms. What seq[0]
 * chains onto is not known here: if slot did not hold it already, slot is
 * marked as possibly holding blocks past a hole no one can name, and every
 * match walks block by block until the slot is cleared. Prefer
 * kv_index_record_at. */
void kv_index_record(kv_index_t *ix, uint32_t slot, const uint64_t *seq, size_t n,
                     uint64_t now_ms);
/* The same for blocks seq[from..n) of a request seq[0..n): seq[from - 1]
 * is their parent (from 0: seq[0] is the request's first block). */
void kv_index_record_at(kv_index_t *ix, uint32_t slot, const uint64_t *seq, size_t from,
                        size_t n, uint64_t now_ms);
/* Approximate mode: drops expired entries and prunes to the cap. Cheap when
 * there is nothing to do; call it every few hundred milliseconds. */
void kv_index_expire(kv_index_t *ix, uint64_t now_ms);
/* Approximate mode: the memory kv_index_expire keeps (ms), changed at run
 * time by what the engines report (kv_retain.h). Writer only. */
void     kv_index_set_ttl(kv_index_t *ix, uint32_t ttl_ms);
uint32_t kv_index_ttl(const kv_index_t *ix);
/* How long ago (ms) key was last stored or recorded; -1 if absent. Writer
 * only: the touch time is the writer's, outside the entry's lock. */
int64_t  kv_index_age(const kv_index_t *ix, uint64_t key, uint64_t now_ms);

/* --- readers (any process, any time) ----------------------------------- */

/* For each slot holding at least the first block, how many leading blocks
 * of seq[0..n) it holds; up to cap entries in out, in the order they stop
 * (ties by slot), return the count. It stops at the first block no slot
 * holds (it reads at most 512 hashes of seq past that one, to prefetch
 * their entries). Requests over 32 blocks skip runs of blocks (16, 32, 64,
 * then 128 at a time; 16 inside a run where a held prefix ends) where no
 * held prefix ends and no block is a hole (see kv_index.c); the answer is
 * kv_index_match_walk's. seq must be a chain (seq[i] = the key of
 * blocks 0..i), as kv_hash computes it. */
size_t kv_index_match(const kv_index_t *ix, const uint64_t *seq, size_t n,
                      kv_overlap_t *out, size_t cap);
/* The same answer, reading every block's entry in turn (the reference the
 * jump is tested against; reads at most 16 hashes past the stop). */
size_t kv_index_match_walk(const kv_index_t *ix, const uint64_t *seq, size_t n,
                           kv_overlap_t *out, size_t cap);

int      kv_index_worker_find(const kv_index_t *ix, uint64_t worker_id, uint32_t dp_rank);
/* Slots that changed hands (a worker added or retired there) since change
 * *since, which it advances: their numbers in out (a slot may repeat), their
 * count, or -1 when more changed than it kept or than cap (read every slot).
 * Lets each reader keep its own map of slots to workers at the cost of what
 * changed, not of max_workers. Starts at 0 for a new index. */
int      kv_index_slots_changed(const kv_index_t *ix, uint64_t *since, uint32_t *out,
                                size_t cap);
/* worker_id and dp_rank of a slot in use: 0, or -1 for a free slot. */
int      kv_index_worker_info(const kv_index_t *ix, uint32_t slot, uint64_t *worker_id,
                              uint32_t *dp_rank);
uint64_t kv_index_worker_blocks(const kv_index_t *ix, uint32_t slot);
uint32_t kv_index_max_workers(const kv_index_t *ix);
void     kv_index_stats(const kv_index_t *ix, kv_index_stats_t *st);

#endif
