/*
 * The prefix index (kv_index.h) in one caller-provided region.
 *
 * Layout (offsets from the region start, no pointers):
 *
 *   header | worker slots [max_workers] | entries [cap] | sides [cap] |
 *   hole table | hole filter (bitmap, and its u16 counts) | engine map [map_cap]
 *
 * An entry is one sequence hash with the set of worker slots holding it, a
 * bitmap of `words` u64 (max_workers rounded up to 64), and the time it
 * was last stored or recorded (for eviction and approximate-mode TTL).
 * Entries hold only what readers read: with up to 128 slots one is 32
 * bytes, aligned, two to a cache line, so a reader's probe is one miss
 * (at 40 bytes, half the entries straddled two lines). The writer-only
 * side of entry i (its parent key, child key, kids word and child count:
 * 24 bytes) lives in a side array at the same index.
 * Entries form an open-addressing table with linear probing; removal
 * shifts the rest of the probe run back (no tombstones), so probe chains
 * only ever reflect the live load (at most 0.8; eviction keeps it there).
 * A key's probe starts at the first entry of the cache line its hash names
 * (home): with 32-byte entries a probe that passes its first entry then
 * stays in the line the reader prefetched, where one starting in a line's
 * second half crosses into the next line, a dependent miss. Lines crossed
 * per entry read at a load of 0.48: 0.23 before, 0.16 so (simulated); the
 * slowest 1 % of kvindex-bench's matches crossed 13 lines, the median 4
 * (docs/BENCHMARKS.md, round 7).
 *
 * Concurrency: one writer (the caller serialises writers: the event helper
 * process in nginx, or the slab mutex in approximate mode), readers in any
 * process, never blocking. Each entry has a sequence lock (kv_seqlock.h):
 * a reader copies key and bitmap between two reads of an even, unchanged
 * count, else retries. A seqlock rather than epochs because readers live
 * in other processes that may die at any moment (an epoch held by a dead
 * reader would block reclamation forever), and entries are never freed,
 * only rewritten in place, so a reader can never touch freed memory; the
 * retry loop is the whole price. Probe chains may change under a reader; a reader that
 * misses an entry moved by the writer sees a shorter overlap, which costs
 * a cache hit, never a wrong answer about an entry it did read. A reader
 * that finds a lock odd for KV_SEQLOCK_READ_TRIES rounds (a writer
 * descheduled or killed mid-write) treats that entry as absent rather than
 * wait. Being alone, the
 * writer updates locks, bitmaps and counters with plain atomic stores, not
 * locked read-modify-writes.
 *
 * Ordering, for a weakly ordered CPU (on x86 none of it costs an
 * instruction: stores stay in order there): every word a reader reads
 * without a lock is an atomic, and each publication pairs a writer's
 * release with a reader's acquire. Entries: the seqlock's fences. Holes:
 * the filter bit is set, then a release fence, before the change that
 * makes the hole (readers read the filter after the entries, behind an
 * acquire fence); a bit cleared comes after what ended the hole (a fence
 * in filter_bump). lost_slots and gen: raised (release) before the change
 * they warn of; lost_slots lowered only after a release fence
 * (holes_clear_mask, rebuild_lost, writer_died). Slots: in_use is stored
 * with release after the slot's worker, and a reap's count (rd.reaps,
 * release) before any slot it frees (settled). The slot change log: each
 * entry is a release store, so that a reader that copies an overwritten
 * entry sees the count that tells it so.
 *
 * Matching without reading every block (kv_index_match): a slot's overlap
 * is where its run of held blocks first breaks. Where a slot holds a block
 * but not its parent, the parent is a "hole" of that slot; the writer keeps
 * every hole in a small hole table (key -> slots), and readers see a bitmap
 * filter of its keys. A reader that knows every alive slot holds block p,
 * sees them all hold block q = p + 16 too, and finds none of the keys
 * between in the filter, knows they hold every block between (a slot
 * lacking one would have a hole at the last one it lacks) and skips them;
 * otherwise it searches where slots stop, reading the keys the filter
 * lists as extra landings (kv_index_match).
 *
 * To know, when slot s loses a block, whether s holds a child of it, each
 * entry's side lists the key of the entry chained onto it (`child`,
 * KID_KEYS of them: a chain's block has one), and the writer reads that
 * entry's bit for s: exact, so an engine that evicts a chain deepest block
 * first leaves no hole (a count over all slots made one at every block
 * while any other slot held the chain: the worker a conversation moved
 * to, or one holding its system prompt; the hole table filled and every
 * slot went lost). A key with more distinct children than that (a
 * branching point: a shared system prompt's end) falls back to its `kids`
 * word (slots that stored a child under it; a superset, one bit per slot
 * mod 32) until none of its children is held. `nkid` is the exact number
 * of (child, slot) pairs held under the key; for it and the list each side
 * also names the entry's parent key, so a block can count itself out of
 * its parent, and an entry that goes leaves its parent's list (keys, not
 * indexes: entries that move keep their place in it). An entry whose
 * children are held stays in the table when no slot holds it any more (a
 * "ghost": readers see no holder, as if absent), so the count is never
 * lost. A hole listed for s is dropped when s holds the key again (its
 * children become the entry's kids) or s is cleared; hole_gc drops, in
 * batches before the table fills, keys whose count fell to 0 and slots
 * that hold none of a key's listed children any more (one that lost a
 * child after the key); readers check `gen`, which each batch bumps, and
 * walk if it moved under them.
 * If the table is full all the same, the slot is marked lost and every
 * match walks until that slot is cleared or its holes are found again
 * (rebuild_lost, once the table has room); likewise a record whose first
 * block's parent is not named (kv_index_record).
 *
 * The engine map (engine block_hash -> sequence hash, per worker slot) is
 * used by the writer alone, for parent links and removals, and holds only
 * blocks whose engine hash differs from their sequence hash (kvworker and
 * Dynamo's mocker use the sequence hash itself and need no map entries).
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_hash.h"
#include "kv_index.h"
#include "kv_seqlock.h"

#define IX_MAGIC        0x6b76696478303130ULL   /* "kvidx010": sides list child keys */
#define KEY_EMPTY       0ULL
#define KEY_ROOT        1ULL                    /* side.parent: a chain's first block */
#define KID_KEYS        1                       /* side.child: child keys listed exactly */
#define KID_MANY        1ULL                    /* side.child[0]: more children than fit */
#define MAX_LOAD_NUM    4                       /* entries evicted above this fill: */
#define MAX_LOAD_DEN    5                       /* 4/5 */
#define MAX_LOAD        ((double) MAX_LOAD_NUM / MAX_LOAD_DEN)
#define EVICT_SAMPLE    32
#define MATCH_AHEAD     16                       /* hashes prefetched ahead (kv_index.h) */
#define JUMP            16                       /* match: blocks skipped per landing */
#define JUMP_BATCH      32                       /* match: landings read per round */
#define JUMP_BATCH_WORDS 1024                    /* match: bitmap words they may use */
#define INNER_AHEAD     48                       /* match: entries inside spans prefetched per batch */
#define COARSE_MAX      128                      /* match: the longest span landed over first */
#define FB_MAX          (JUMP_BATCH * JUMP)      /* match: keys between one batch's landings */
#define SLOT_LOG        64                       /* slot changes kept for readers' maps */
#define MAP_SAMPLE      8                        /* engine map: mappings weighed per room made */

#define SLOT_LIVE       1u                       /* slot_t.in_use: a worker's (0: free) */
#define SLOT_RETIRED    2u                       /* removed, entries freed by the next reap */

typedef struct {
    uint64_t            worker_id;
    uint32_t            dp_rank;
    uint32_t            in_use;
    uint64_t            blocks;
    uint64_t            lost;           /* a hole of this slot is not in the hole table */
} slot_t;

typedef struct {
    kv_seqlock_t        lock;
    uint32_t            touch;          /* ms, mod 2^32; writer only */
    uint64_t            key;
    uint64_t            bits[];         /* words */
} entry_t;

/* The writer-only side of an entry (side array, same index). */
typedef struct {
    uint64_t            parent;         /* parent's key; KEY_ROOT none, 0 not known */
    uint64_t            child[KID_KEYS];/* keys of the entries chained onto it (all of
                                         * them, first ones first, 0 after), or
                                         * child[0] KID_MANY: more than fit */
    uint32_t            nkid;           /* (child, slot) pairs held under it; saturates */
    uint32_t            kids;           /* slots (mod 32) that may hold a child */
} side_t;

typedef struct {
    uint64_t            key;            /* engine hash mixed with slot; 0 empty */
    uint64_t            engine;
    uint64_t            seq;
    uint32_t            slot;
    uint32_t            pad;
} map_t;

struct kv_index {
    uint64_t            magic;
    uint64_t            size;
    uint32_t            max_workers;
    uint32_t            words;
    uint32_t            approximate;
    uint32_t            engine_hashes;  /* kv_index_config_t's: the map sized as the entries */
    uint32_t            ttl_ms;
    uint64_t            max_blocks;
    double              prune_ratio;
    uint64_t            cap;            /* entries (power of two) */
    uint64_t            map_cap;        /* map entries (power of two) */
    uint64_t            entry_size;
    uint64_t            off_slots, off_entries, off_map;
    uint64_t            off_side;       /* side_t per entry (writer) */
    uint64_t            used;           /* entries in the table, ghosts too; writer */
    uint64_t            home_mask;      /* cap - 1, less the index bits within a line (home) */
    uint64_t            map_used;
    uint64_t            map_hand;       /* map_make_room's scan position */
    uint64_t            hand;           /* eviction scan position */
    uint64_t            last_expire;
    uint64_t            live;           /* entries some slot holds (used less ghosts) */
    uint64_t            workers;
    uint64_t            stored, removed, cleared, evicted, expired, pruned;
    uint64_t            unknown_parent, unknown_remove;
    uint64_t            off_holes, hole_cap, hole_size, hole_used;
    uint64_t            off_filter;     /* bitmap of 1 << filter_bits bits (readers) */
    uint64_t            off_counts;     /* u16 per filter bit: hole keys there (writer) */
    uint32_t            filter_bits;
    uint32_t            cap_bits;       /* log2(cap) */
    uint64_t            erases;         /* writer: entries moved or freed (stale indexes) */
    uint64_t            hole_kept;      /* hole keys left by the last hole_gc */
    uint64_t            hole_new;       /* hole keys added (or refused) since then */
    uint64_t            lost_ops;       /* blocks changed since the last rebuild_lost */
    uint64_t            writing;        /* a writer is inside a call (writer_enter) */
    uint64_t            writer_died;    /* calls found cut short: index cleared */
    uint64_t            slot_gen;       /* slot changes so far (a worker added or retired) */
    uint32_t            slot_log[SLOT_LOG]; /* slot of change g at g % SLOT_LOG */
    /* what every match reads, on a line of its own (the writer's hot
     * counters above change all the time; these seldom) */
    struct {
        uint64_t        lost_slots;     /* slots with lost set; readers walk while > 0 */
        uint64_t        gen;            /* bumped before holes are dropped or lost */
        uint64_t        reaps;          /* bumped by each reap: slots freed for reuse */
    } __attribute__((aligned(64))) rd;
};

/* --- layout -------------------------------------------------------------- */

static slot_t *slots(const kv_index_t *ix)
{
    return (slot_t *) (void *) ((char *) ix + ix->off_slots);
}

static entry_t *entry(const kv_index_t *ix, uint64_t i)
{
    return (entry_t *) (void *) ((char *) ix + ix->off_entries + i * ix->entry_size);
}

/* The side of entry i (writer only). */
static side_t *side(const kv_index_t *ix, uint64_t i)
{
    return (side_t *) (void *) ((char *) ix + ix->off_side) + i;
}

static map_t *map(const kv_index_t *ix)
{
    return (map_t *) (void *) ((char *) ix + ix->off_map);
}


static uint64_t *hole(const kv_index_t *ix, uint64_t i)
{
    return (uint64_t *) (void *) ((char *) ix + ix->off_holes + i * ix->hole_size);
}

static uint64_t *filter(const kv_index_t *ix)
{
    return (uint64_t *) (void *) ((char *) ix + ix->off_filter);
}

static uint16_t *counts(const kv_index_t *ix)
{
    return (uint16_t *) (void *) ((char *) ix + ix->off_counts);
}

/* The filter bit of a key: its low bits. Keys are XXH3 sequence hashes
 * (kv_hash.h), uniform in every bit, and small test keys differ there
 * too. A match takes one for each of its ~255 blocks between landings,
 * so the multiply and shift this was before cost 4-5 % of the match
 * (docs/BENCHMARKS.md, "Request path speed round 10"). */
static uint64_t filter_slot(const kv_index_t *ix, uint64_t key)
{
    return key & ((1ULL << ix->filter_bits) - 1);
}

/* Kids bitmaps are 32 bits per entry: slot s uses bit s % 32, so with
 * more than 32 slots a bit stands for several (a superset is safe: nkid
 * says whether any child is held at all). */
static uint32_t kid_bit(uint32_t slot)
{
    return 1u << (slot % 32);
}

/* key's entry chains onto the entry of sd: list it (once). */
static void child_add(side_t *sd, uint64_t key)
{
    uint32_t k;

    for (k = 0; k < KID_KEYS && sd->child[k] != key; k++) {
        if (sd->child[k] == KEY_EMPTY) {
            sd->child[k] = key;
            return;
        }
        if (sd->child[k] == KID_MANY) {
            return;
        }
    }
    if (k == KID_KEYS) {
        memset(sd->child, 0, sizeof(sd->child));
        sd->child[0] = KID_MANY;        /* from now on the kids superset says */
    }
}

/* key's entry goes (or chains onto another key after all): unlist it. */
static void child_del(side_t *sd, uint64_t key)
{
    uint32_t k;

    for (k = 0; k < KID_KEYS && sd->child[k] != KEY_EMPTY; k++) {
        if (sd->child[k] == key) {
            for (; k + 1 < KID_KEYS; k++) {
                sd->child[k] = sd->child[k + 1];
            }
            sd->child[KID_KEYS - 1] = KEY_EMPTY;
            return;
        }
    }
}

/* slot holds one block fewer. A retired slot's count was zeroed when it
 * was retired while its bits stay until the reap: an eviction or expiry
 * meanwhile must not take it below zero. */
static void lose_block(kv_index_t *ix, uint32_t slot)
{
    slot_t *s = &slots(ix)[slot];

    if (__atomic_load_n(&s->in_use, __ATOMIC_RELAXED) == SLOT_LIVE) {
        __atomic_store_n(&s->blocks, __atomic_load_n(&s->blocks, __ATOMIC_RELAXED) - 1,
                         __ATOMIC_RELAXED);
    }
}

static uint64_t mix(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

/* The entry a key's probe starts at: the start of the cache line its hash
 * names (home_mask clears the index bits of entries sharing a line: with
 * 32-byte entries the lowest one; none with 64 bytes or with sizes that
 * straddle lines). Writer and readers must agree on it. The top bits of
 * one multiply (Fibonacci hashing) rather than mix(): the keys are XXH3
 * hashes already, the multiply spreads the small ones tests use, and a
 * match computes a home for each of ~35 keys, twice for those it reads
 * (median match 1.055x, ingest 1.056x faster, docs/BENCHMARKS.md,
 * "Request path speed round 10"). */
static uint64_t home(const kv_index_t *ix, uint64_t key)
{
    return ((key * 0x9e3779b97f4a7c15ULL) >> (64 - ix->cap_bits)) & ix->home_mask;
}

static uint64_t norm_key(uint64_t k)
{
    /* 0 marks an empty slot (1 is kept reserved too) */
    return k < 2 ? k + 2 : k;
}

static uint32_t words_for(uint32_t max_workers)
{
    return (max_workers + 63) / 64;
}

/*
 * Slots actually laid out for max_workers: at least 16 more, rounded up to
 * a whole bitmap word (so often free). A removed worker's slot is retired
 * until the next reap (one pass over the table for all of them); the spare
 * slots let new workers in meanwhile, so a churn of worker ids through a
 * full registry costs one pass per ~16 ids, not one per id. The registry
 * keeps max_workers records, so at most max_workers slots are ever live.
 */
static uint32_t slots_for(uint32_t max_workers)
{
    uint32_t n = (max_workers + 16 + 63) / 64 * 64;
    return n > 4096 ? (max_workers > 4096 ? max_workers : 4096) : n;
}

static void defaults(kv_index_config_t *c, const kv_index_config_t *in)
{
    memset(c, 0, sizeof(*c));
    if (in) {
        *c = *in;
    }
    if (c->max_workers == 0) c->max_workers = 256;
    if (c->ttl_ms == 0) c->ttl_ms = 120000;
    if (c->max_blocks == 0) c->max_blocks = 1ULL << 20;
    if (c->prune_ratio <= 0 || c->prune_ratio >= 1) c->prune_ratio = 0.8;
}

/* 32 or 64 bytes where that costs little (entries then never straddle a
 * cache line: the table is 64-byte aligned); 40 and 48 (129-256 slots)
 * stay as they are rather than pay a third more memory or worse. */
static uint64_t entry_size(uint32_t words)
{
    uint64_t es = sizeof(entry_t) + (uint64_t) words * sizeof(uint64_t);

    return es <= 32 ? 32 : es > 48 && es <= 64 ? 64 : es;
}

/* The hole table holds up to 3/4 of hole_cap keys (u16 filter counters
 * cannot overflow while hole_cap <= 65536). */
static uint64_t hole_cap_for(uint64_t cap)
{
    uint64_t h = cap / 64;

    return h < 256 ? 256 : h > 65536 ? 65536 : h;
}

/* 32 filter bits per hole key the table can hold: a key that is no hole
 * looks like one (and is walked) about once in 40 while the table is full. */
static uint32_t filter_bits_for(uint64_t hole_cap)
{
    uint32_t b = 10;

    while (b < 20 && (1ULL << b) < 32 * hole_cap) {
        b++;
    }
    return b;
}

static uint64_t align64(uint64_t x)
{
    return (x + 63) & ~63ULL;
}

/* Bytes of entries, hole table and filter for cap entries. */
static uint64_t table_bytes(uint64_t cap, uint64_t es, uint32_t words)
{
    uint64_t h = hole_cap_for(cap);

    return align64(cap * es) + align64(cap * sizeof(side_t))
           + align64(h * (1 + (uint64_t) words) * sizeof(uint64_t))
           + align64((1ULL << filter_bits_for(h)) / 8)
           + align64((uint64_t) sizeof(uint16_t) << filter_bits_for(h));
}

size_t kv_index_min_size(const kv_index_config_t *in)
{
    kv_index_config_t c;

    defaults(&c, in);
    return sizeof(kv_index_t) + slots_for(c.max_workers) * sizeof(slot_t)
           + table_bytes(1024, entry_size(words_for(slots_for(c.max_workers))),
                         words_for(slots_for(c.max_workers)))
           + (c.engine_hashes ? 1024 : 256) * sizeof(map_t) + 128;
}

kv_index_t *kv_index_create(void *region, size_t size, const kv_index_config_t *in,
                            char *err, size_t errlen)
{
    kv_index_config_t c;
    kv_index_t       *ix = region;
    uint64_t          es, left, cap, mcap;

    defaults(&c, in);
    if (size < kv_index_min_size(&c)) {
        snprintf(err, errlen, "index region of %zu bytes is below the minimum %zu",
                 size, kv_index_min_size(&c));
        return NULL;
    }
    if (c.max_workers > 4096) {
        snprintf(err, errlen, "max_workers %u is above 4096", c.max_workers);
        return NULL;
    }
    c.max_workers = slots_for(c.max_workers);
    memset(ix, 0, sizeof(*ix));
    ix->words = words_for(c.max_workers);
    es = entry_size(ix->words);
    ix->off_slots = (sizeof(kv_index_t) + 63) & ~63ULL;
    ix->off_entries = (ix->off_slots + c.max_workers * sizeof(slot_t) + 63) & ~63ULL;
    left = size - ix->off_entries;

    /*
     * entries get ~7/8 of the room, the engine map the rest; both powers of
     * two. Fed by engine hashes, the map holds a mapping per block held and
     * forgets none while the block is indexed (map_make_room): a map under
     * the entries' size would cap the blocks held, so it gets as many.
     */
    for (cap = 1024;
         table_bytes(cap * 2, es, ix->words) + (c.engine_hashes ? cap * 2 : cap / 4)
                                               * sizeof(map_t) <= left;
         cap *= 2)
    {
        /* void */
    }
    for (mcap = 256;
         (mcap * 2) * sizeof(map_t) + table_bytes(cap, es, ix->words) <= left && mcap < cap;
         mcap *= 2)
    {
        /* void */
    }
    ix->cap = cap;
    ix->map_cap = mcap;
    ix->entry_size = es;
    ix->home_mask = (cap - 1) & ~(64 % es == 0 ? 64 / es - 1 : 0);
    ix->cap_bits = (uint32_t) __builtin_ctzll(cap);
    ix->hole_cap = hole_cap_for(cap);
    ix->hole_size = (1 + (uint64_t) ix->words) * sizeof(uint64_t);
    ix->filter_bits = filter_bits_for(ix->hole_cap);
    ix->off_side = ix->off_entries + align64(cap * es);
    ix->off_holes = ix->off_side + align64(cap * sizeof(side_t));
    ix->off_filter = ix->off_holes + align64(ix->hole_cap * ix->hole_size);
    ix->off_counts = ix->off_filter + align64((1ULL << ix->filter_bits) / 8);
    ix->off_map = ix->off_counts + align64((uint64_t) sizeof(uint16_t) << ix->filter_bits);
    ix->max_workers = c.max_workers;
    ix->approximate = c.approximate != 0;
    ix->engine_hashes = c.engine_hashes != 0;
    ix->ttl_ms = c.ttl_ms;
    ix->max_blocks = c.max_blocks < (uint64_t) (cap * MAX_LOAD) ? c.max_blocks
                                                                 : (uint64_t) (cap * MAX_LOAD);
    ix->prune_ratio = c.prune_ratio;
    ix->size = size;
    memset((char *) ix + ix->off_slots, 0, size - ix->off_slots);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    ix->magic = IX_MAGIC;
    return ix;
}

kv_index_t *kv_index_open(void *region, size_t size)
{
    kv_index_t *ix = region;

    if (ix->magic != IX_MAGIC || ix->size != size) {
        return NULL;
    }
    return ix;
}

/* --- entries ------------------------------------------------------------- */

/* The writer is alone (the caller serialises writers), so its updates of
 * the lock, the bitmaps and the counters are plain load + store of atomic
 * objects, never locked read-modify-write instructions. */
static void bump(uint64_t *x, int64_t d)
{
    __atomic_store_n(x, __atomic_load_n(x, __ATOMIC_RELAXED) + (uint64_t) d, __ATOMIC_RELAXED);
}

static void write_begin(entry_t *e)
{
    kv_seqlock_write_begin(&e->lock);
}

static void write_end(entry_t *e)
{
    kv_seqlock_write_end(&e->lock);
}

static void set_bits(entry_t *e, uint32_t w, uint64_t v)
{
    __atomic_store_n(&e->bits[w], v, __ATOMIC_RELAXED);
}

static uint64_t get_bits(const entry_t *e, uint32_t w)
{
    return __atomic_load_n(&e->bits[w], __ATOMIC_RELAXED);
}

static void prefetch(const void *p)
{
    /* inline asm on x86: gcc 12 dropped __builtin_prefetch here entirely */
#if defined(__x86_64__) || defined(__i386__)
    __asm__ volatile("prefetcht0 %0" : : "m"(*(const char *) p));
#else
    __builtin_prefetch(p);
#endif
}

/* The cache line(s) of the key's home entry: one, unless the entry
 * straddles two (sizes other than 32 and 64 bytes). A second prefetch of
 * a line already on its way is not free: it waits for a miss buffer. */
static void prefetch_key(const kv_index_t *ix, uint64_t key)
{
    const char *e = (const char *) entry(ix, home(ix, key));

    prefetch(e);
    if (((uintptr_t) e & 63) + ix->entry_size > 64) {
        prefetch(e + ix->entry_size - 1);
    }
}

/* The writer's view of a key's home: its entry and its side. A quarter of
 * the 24-byte sides straddle two lines, with the counts and the child
 * list (read when the next block of the run is stored) on the second:
 * that one is prefetched too, as prefetch_key does for entries. */
static void prefetch_key_w(const kv_index_t *ix, uint64_t key)
{
    const char *sd = (const char *) side(ix, home(ix, key));

    prefetch_key(ix, key);
    prefetch(sd);
    if (((uintptr_t) sd & 63) + sizeof(side_t) > 64) {
        prefetch(sd + sizeof(side_t) - 1);
    }
}

/* The entry holding key, or -1 (writer view; no locking needed). */
static int64_t find(const kv_index_t *ix, uint64_t key)
{
    uint64_t i, mask = ix->cap - 1, k;

    for (i = home(ix, key);; i = (i + 1) & mask) {
        k = __atomic_load_n(&entry(ix, i)->key, __ATOMIC_RELAXED);
        if (k == key) {
            return (int64_t) i;
        }
        if (k == KEY_EMPTY) {
            return -1;
        }
    }
}

static int test_bit(const entry_t *e, uint32_t slot)
{
    return (__atomic_load_n(&e->bits[slot / 64], __ATOMIC_RELAXED)
            >> (slot % 64)) & 1;
}

static int bits_empty(const kv_index_t *ix, const entry_t *e)
{
    uint32_t w;

    for (w = 0; w < ix->words; w++) {
        if (__atomic_load_n(&e->bits[w], __ATOMIC_RELAXED)) {
            return 0;
        }
    }
    return 1;
}

/* --- the hole table (writer only; readers see its filter) ----------------
 *
 * A hole of slot s is a key s does not hold while s holds a child of it
 * (the key chained one block further). The table maps such keys to the
 * slots that may have a hole there (a superset: a listed slot may have
 * none). The filter has one bit per bucket of keys, set while the table
 * holds a key of that bucket (the writer counts them), so a reader can tell
 * from one bit that a key is surely no hole of anyone. */

static int64_t hole_find(const kv_index_t *ix, uint64_t key)
{
    uint64_t mask = ix->hole_cap - 1, i, k;

    for (i = mix(key) & mask;; i = (i + 1) & mask) {
        k = hole(ix, i)[0];
        if (k == key) {
            return (int64_t) i;
        }
        if (k == KEY_EMPTY) {
            return -1;
        }
    }
}

/* The filter bit of a key is set while some hole key shares it. A bit set
 * is published by hole_add's fence, before the change that makes the
 * hole. A bit cleared is ordered after what ended the hole (the block
 * held again, its slot cleared; hole_gc bumps gen first): a reader that
 * skips a block for a clear bit must find it held if it reads it. Free on
 * x86 (stores stay in order there), needed on a weakly ordered CPU. */
static void filter_bump(kv_index_t *ix, uint64_t key, int d)
{
    uint64_t  b = filter_slot(ix, key), *f = &filter(ix)[b / 64];
    uint16_t *c = &counts(ix)[b];

    *c = (uint16_t) (*c + d);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    __atomic_store_n(f, *c ? *f | 1ULL << (b % 64) : *f & ~(1ULL << (b % 64)), __ATOMIC_RELAXED);
}

static int maybe_hole(const kv_index_t *ix, uint64_t key)
{
    uint64_t b = filter_slot(ix, key);

    return (__atomic_load_n(&filter(ix)[b / 64], __ATOMIC_RELAXED) >> (b % 64)) & 1;
}

/*
 * A match that jumped read lost_slots once, at its start, and the filter
 * after the entries. Both may change under it in ways its answer cannot
 * see: a slot marked lost meanwhile (a hole then goes unlisted), or a
 * hole dropped from the filter by hole_gc after the reader read the child
 * that made it one. So each such change first bumps gen (then a fence:
 * gen is visible before the change), and a match whose gen moved answers
 * with the walk instead (kv_index_match).
 */
static void bump_gen(kv_index_t *ix)
{
    /* release: a reader that reads the new gen at its start also sees
     * what came before (lost_slots raised, the child that went) */
    __atomic_store_n(&ix->rd.gen, __atomic_load_n(&ix->rd.gen, __ATOMIC_RELAXED) + 1,
                     __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_RELEASE);
}

static void mark_lost(kv_index_t *ix, uint32_t slot)
{
    slot_t *s = &slots(ix)[slot];

    if (!s->lost) {
        s->lost = 1;
        bump(&ix->rd.lost_slots, 1);
        /* readers see lost_slots (and gen) before the change that made
         * the hole */
        bump_gen(ix);
    }
}

static void hole_gc(kv_index_t *ix);

/* slot may now have a hole at key. Called before the change that makes
 * the hole is written, so a reader that sees the change sees the hole.
 * 0, or -1 when the table had no room (slot is lost). */
static int hole_add(kv_index_t *ix, uint64_t key, uint32_t slot)
{
    uint64_t mask = ix->hole_cap - 1, i, *h;
    int64_t  at = hole_find(ix, key);

    if (at >= 0) {
        h = hole(ix, (uint64_t) at);
        h[1 + slot / 64] |= 1ULL << (slot % 64);
        return 0;
    }
    /* stale keys go in batches: once as many keys came as the last batch
     * left (at least 1/16 of the table), so a sweep of the table costs
     * O(1) per key added, full or not */
    if (++ix->hole_new >= (ix->hole_kept > ix->hole_cap / 16 ? ix->hole_kept
                                                             : ix->hole_cap / 16))
    {
        hole_gc(ix);
    }
    if (ix->hole_used + 1 > ix->hole_cap * 3 / 4) {
        mark_lost(ix, slot);    /* readers fall back to the walk */
        return -1;
    }
    for (i = mix(key) & mask; hole(ix, i)[0] != KEY_EMPTY; i = (i + 1) & mask) {
        /* void: at most 3/4 full */
    }
    h = hole(ix, i);
    memset(h, 0, ix->hole_size);
    h[0] = key;
    h[1 + slot / 64] = 1ULL << (slot % 64);
    bump(&ix->hole_used, 1);
    filter_bump(ix, key, 1);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    return 0;
}

/* Deletes hole entry i by backward shift (writer only: entries may move). */
static void hole_del(kv_index_t *ix, uint64_t i)
{
    uint64_t mask = ix->hole_cap - 1, j = i, k, home;

    filter_bump(ix, hole(ix, i)[0], -1);
    bump(&ix->hole_used, -1);
    for (;;) {
        hole(ix, j)[0] = KEY_EMPTY;
        for (k = (j + 1) & mask;; k = (k + 1) & mask) {
            if (hole(ix, k)[0] == KEY_EMPTY) {
                return;
            }
            home = mix(hole(ix, k)[0]) & mask;
            if (j <= k ? (home <= j || home > k) : (home <= j && home > k)) {
                memcpy(hole(ix, j), hole(ix, k), ix->hole_size);
                j = k;
                break;
            }
        }
    }
}

static int hole_empty(const kv_index_t *ix, const uint64_t *h);
static int test_bit(const entry_t *e, uint32_t slot);

/* Keeps, of the slots hole h lists, those that may still hold a child of
 * its key (sd: the key's side): where the children are all listed, the
 * slots holding one of them; else all. 1 if none is left. */
static int hole_verify(kv_index_t *ix, uint64_t *h, const side_t *sd)
{
    int64_t  at[KID_KEYS];
    uint64_t held;
    uint32_t k, n = 0, w;

    if (sd->child[0] == KID_MANY) {
        return 0;
    }
    for (k = 0; k < KID_KEYS && sd->child[k] != KEY_EMPTY; k++) {
        if ((at[n] = find(ix, sd->child[k])) >= 0) {
            n++;
        }
    }
    for (w = 0; w < ix->words; w++) {
        for (held = 0, k = 0; k < n; k++) {
            held |= __atomic_load_n(&entry(ix, (uint64_t) at[k])->bits[w], __ATOMIC_RELAXED);
        }
        h[1 + w] &= held;
    }
    return hole_empty(ix, h);
}

/*
 * Drops every hole key that is a hole of no one any more: no slot holds a
 * child of it (its entry's nkid is 0, or it has no entry: an entry whose
 * children are held stays, as a ghost; or none of the slots listed holds
 * one of its children, where those are all listed: hole_verify). A slot
 * that lost a child after the key leaves such a hole. gen first, so a
 * match that read such a child before it went, and the filter after,
 * walks instead.
 */
static void hole_gc(kv_index_t *ix)
{
    uint64_t i, key;
    int64_t  at;
    int      bumped = 0;

    for (i = 0; i < ix->hole_cap; ) {
        key = hole(ix, i)[0];
        if (key != KEY_EMPTY) {
            at = find(ix, key);
            if (at < 0 || side(ix, (uint64_t) at)->nkid == 0
                || hole_verify(ix, hole(ix, i), side(ix, (uint64_t) at)))
            {
                if (!bumped) {
                    bump_gen(ix);
                    bumped = 1;
                }
                hole_del(ix, i);    /* a later entry may have moved into i: look again */
                continue;
            }
        }
        i++;
    }
    ix->hole_kept = ix->hole_used;
    ix->hole_new = 0;
}

static int hole_empty(const kv_index_t *ix, const uint64_t *h)
{
    uint32_t w;

    for (w = 0; w < ix->words; w++) {
        if (h[1 + w]) {
            return 0;
        }
    }
    return 1;
}

/* slot holds key again: no hole of slot there any more. 1 if it had one
 * listed (its children, if any, are then the entry's kids). */
static int hole_fill(kv_index_t *ix, uint64_t key, uint32_t slot)
{
    int64_t   at;
    uint64_t *h;

    if (ix->hole_used == 0 || !maybe_hole(ix, key)) {
        return 0;
    }
    at = hole_find(ix, key);
    if (at < 0) {
        return 0;
    }
    h = hole(ix, (uint64_t) at);
    if (!(h[1 + slot / 64] >> (slot % 64) & 1)) {
        return 0;
    }
    h[1 + slot / 64] &= ~(1ULL << (slot % 64));
    if (hole_empty(ix, h)) {
        hole_del(ix, (uint64_t) at);
    }
    return 1;
}

/* The slots in mask hold nothing any more: none has a hole. */
static void holes_clear_mask(kv_index_t *ix, const uint64_t mask[64])
{
    uint64_t  i, *h;
    uint32_t  w;

    for (i = 0; i < ix->hole_cap; ) {
        h = hole(ix, i);
        if (h[0] != KEY_EMPTY) {
            for (w = 0; w < ix->words && w < 64; w++) {
                h[1 + w] &= ~mask[w];
            }
            if (hole_empty(ix, h)) {
                hole_del(ix, i);    /* a later entry may have moved into i: look again */
                continue;
            }
        }
        i++;
    }
    /* the bits cleared and the holes dropped are visible before the
     * slots stop being lost: a match that reads lost_slots 0 (acquire)
     * and so jumps must not read a cleared bit as still set, with its
     * hole already gone (rebuild_lost and writer_died fence alike) */
    __atomic_thread_fence(__ATOMIC_RELEASE);
    for (i = 0; i < ix->max_workers; i++) {
        slot_t *s = &slots(ix)[i];

        if ((mask[i / 64] >> (i % 64) & 1) && s->lost) {
            s->lost = 0;
            bump(&ix->rd.lost_slots, -1);
        }
    }
}

/* Whether slot holds a child of the entry of sd: exact while its
 * children are all listed (a chain's blocks have one), else the kids
 * superset (a branching key: a shared system prompt's end). */
static int holds_kid(const kv_index_t *ix, const side_t *sd, uint32_t slot)
{
    uint32_t k;
    int64_t  at;

    if (sd->nkid == 0 || !(sd->kids & kid_bit(slot))) {
        return 0;                       /* kids: a superset, no lookup */
    }
    if (sd->child[0] == KID_MANY) {
        return 1;
    }
    for (k = 0; k < KID_KEYS && sd->child[k] != KEY_EMPTY; k++) {
        if ((at = find(ix, sd->child[k])) >= 0 && test_bit(entry(ix, (uint64_t) at), slot)) {
            return 1;
        }
    }
    return 0;
}

/* slot is about to lose entry i: if it holds a child of it, that is a
 * hole now (one that lost the children first, as an engine evicts a
 * chain, leaves none). */
static void note_loss(kv_index_t *ix, uint64_t i, uint32_t slot)
{
    if (holds_kid(ix, side(ix, i), slot)) {
        hole_add(ix, __atomic_load_n(&entry(ix, i)->key, __ATOMIC_RELAXED), slot);
    }
}

/* Copies entry from into the hole at to, under to's lock. */
static void move_entry(kv_index_t *ix, entry_t *to, const entry_t *from)
{
    uint32_t w;

    write_begin(to);
    __atomic_store_n(&to->key, __atomic_load_n(&from->key, __ATOMIC_RELAXED), __ATOMIC_RELAXED);
    for (w = 0; w < ix->words; w++) {
        set_bits(to, w, get_bits(from, w));
    }
    write_end(to);
    to->touch = from->touch;
}

/* Empties entry i, which no slot holds, by shifting the later members of
 * its probe run back (no tombstones, so probes and the load stay what the
 * live entries make them). A moved entry is written at its new place
 * before its old place is reused: a reader finds it at one or the other,
 * or, if it passed the new place just before the copy, misses it and sees
 * a shorter overlap. With unlink the entry leaves its parent's child list
 * here; without, the caller's kid_count on the parent unlists it (gone),
 * which finds the parent once for both. */
static void erase(kv_index_t *ix, uint64_t i, int unlink)
{
    uint64_t mask = ix->cap - 1, j = i, k, key, h;
    entry_t *e;
    uint32_t w;
    int64_t  at;

    /* it is its parent's child no more */
    if (unlink && side(ix, i)->parent >= 2 && (at = find(ix, side(ix, i)->parent)) >= 0) {
        child_del(side(ix, (uint64_t) at), __atomic_load_n(&entry(ix, i)->key, __ATOMIC_RELAXED));
    }
    for (;;) {
        for (k = (j + 1) & mask;; k = (k + 1) & mask) {
            key = __atomic_load_n(&entry(ix, k)->key, __ATOMIC_RELAXED);
            if (key == KEY_EMPTY) {
                goto empty;
            }
            h = home(ix, key);
            /* entry k may fill the hole at j unless its home lies in (j, k] */
            if (j <= k ? (h <= j || h > k) : (h <= j && h > k)) {
                break;
            }
        }
        move_entry(ix, entry(ix, j), entry(ix, k));
        *side(ix, j) = *side(ix, k);
        j = k;
    }
empty:
    memset(side(ix, j), 0, sizeof(side_t));
    ix->erases++;
    e = entry(ix, j);
    write_begin(e);
    for (w = 0; w < ix->words; w++) {
        set_bits(e, w, 0);
    }
    __atomic_store_n(&e->key, KEY_EMPTY, __ATOMIC_RELAXED);
    write_end(e);
    ix->used--;
}

/* Entry i lost its last holder: it goes, unless some slot holds a child
 * of it (it stays as a ghost, keeping the count; it goes with the last
 * child). 1 if it went (indexes may have moved); unlink: erase's. */
static int erase_if_unused(kv_index_t *ix, uint64_t i, int unlink)
{
    if (side(ix, i)->nkid == 0 && bits_empty(ix, entry(ix, i))) {
        erase(ix, i, unlink);
        return 1;
    }
    return 0;
}

/* d (child, slot) pairs came or went under key pk. At 0 no slot holds a
 * child of pk: nobody has a hole there (hole_gc drops the key later), no
 * slot is a kid, and a ghost pk goes (with erase set; indexes may move).
 * A saturated count stays (its holes are kept: safe). gone (0: none): a
 * child key that left pk first (erased without unlink, or chained onto
 * another key), unlisted here so that pk is looked up once for both. */
static void kid_count(kv_index_t *ix, uint64_t pk, int64_t d, int can_erase, uint64_t gone)
{
    int64_t at;
    side_t *sd;

    if (pk < 2 || (d == 0 && gone == KEY_EMPTY) || (at = find(ix, pk)) < 0) {
        return;
    }
    sd = side(ix, (uint64_t) at);
    if (gone != KEY_EMPTY) {
        child_del(sd, gone);
    }
    if (d == 0 || sd->nkid == UINT32_MAX) {
        return;
    }
    if (d > 0) {
        sd->nkid = (uint64_t) d >= UINT32_MAX - sd->nkid ? UINT32_MAX
                                                          : sd->nkid + (uint32_t) d;
        return;
    }
    sd->nkid = (uint64_t) -d >= sd->nkid ? 0 : sd->nkid - (uint32_t) -d;
    if (sd->nkid == 0) {
        sd->kids = 0;
        /* no child is held: the list starts again (each store lists its
         * key anew), so a key that branched may list exactly again */
        memset(sd->child, 0, sizeof(sd->child));
        if (can_erase) {
            erase_if_unused(ix, (uint64_t) at, 1);
        }
    }
}

/* Clears every holder of entry i (under its lock), giving back their
 * block counts; their number. */
static uint32_t clear_bits(kv_index_t *ix, uint64_t i, const uint64_t *mask)
{
    entry_t *e = entry(ix, i);
    uint32_t w, n = 0;
    uint64_t b;

    for (w = 0; w < ix->words; w++) {
        b = get_bits(e, w) & (mask ? (w < 64 ? mask[w] : 0) : ~0ULL);
        n += (uint32_t) __builtin_popcountll(b);
    }
    if (n == 0) {
        return 0;
    }
    write_begin(e);
    for (w = 0; w < ix->words; w++) {
        set_bits(e, w, get_bits(e, w) & ~(mask ? (w < 64 ? mask[w] : 0) : ~0ULL));
    }
    write_end(e);
    if (bits_empty(ix, e)) {
        bump(&ix->live, -1);
    }
    return n;
}

/* Drops every holder of entry i (eviction, expiry), giving back their
 * block counts; the entry goes, or stays as a ghost. */
static void drop(kv_index_t *ix, uint64_t i)
{
    entry_t *e = entry(ix, i);
    uint32_t w, n, sl;
    uint64_t b, pk = side(ix, i)->parent, key = __atomic_load_n(&e->key, __ATOMIC_RELAXED);

    for (w = 0; w < ix->words; w++) {
        b = __atomic_load_n(&e->bits[w], __ATOMIC_RELAXED);
        while (b) {
            sl = w * 64 + (uint32_t) __builtin_ctzll(b);
            note_loss(ix, i, sl);
            lose_block(ix, sl);
            b &= b - 1;
        }
    }
    n = clear_bits(ix, i, NULL);
    /* an erased entry leaves its parent's list in kid_count (one lookup) */
    kid_count(ix, pk, -(int64_t) n, 1, erase_if_unused(ix, i, 0) ? key : KEY_EMPTY);
}

#define CHAIN_MAX       1024                    /* evict_chain: blocks dropped below one */

/*
 * Drops entry i and the chain of single children below it, deepest first.
 * Once i goes for every slot, no block below it can count in a match (a
 * match counts leading blocks), and dropping i alone opened a hole for
 * each slot holding its child: a full index that evicts filled the hole
 * table until every match walked. The chain ends at a leaf, at a block
 * with more children than its side lists (those stay, and their holes
 * with them), or at CHAIN_MAX. The number of entries dropped.
 */
/* The one child key a side lists, or 0: none, or more than one. */
static uint64_t only_child(const side_t *sd)
{
    uint32_t k;

    if (sd->nkid == 0 || sd->child[0] == KID_MANY || sd->child[0] == KEY_EMPTY) {
        return 0;
    }
    for (k = 1; k < KID_KEYS; k++) {
        if (sd->child[k] != KEY_EMPTY) {
            return 0;
        }
    }
    return sd->child[0];
}

static uint64_t evict_chain(kv_index_t *ix, uint64_t i)
{
    uint64_t keys[CHAIN_MAX], n = 0, dropped = 0, child;
    int64_t  at = (int64_t) i;

    keys[n++] = __atomic_load_n(&entry(ix, i)->key, __ATOMIC_RELAXED);
    while (n < CHAIN_MAX && (child = only_child(side(ix, (uint64_t) at))) != 0
           && (at = find(ix, child)) >= 0)
    {
        keys[n++] = child;
    }
    while (n-- > 0) {
        /* a drop erases and shifts entries: look each one up again */
        if ((at = find(ix, keys[n])) >= 0 && !bits_empty(ix, entry(ix, (uint64_t) at))) {
            drop(ix, (uint64_t) at);
            dropped++;
        }
    }
    return dropped;
}

/* Least recently touched of a few held entries from the hand on (ghosts
 * are no candidates: they go with their last held child): approximate
 * LRU at constant cost per eviction. 0 if nothing was held. */
static int evict_one(kv_index_t *ix, uint64_t *counter, uint32_t now)
{
    uint64_t mask = ix->cap - 1, i, best = 0, k, n;
    uint32_t age, best_age = 0, tier, best_tier = 0;
    int      seen = 0, found = 0;

    for (i = ix->hand, n = 0; seen < EVICT_SAMPLE && n < ix->cap; i = (i + 1) & mask, n++) {
        k = __atomic_load_n(&entry(ix, i)->key, __ATOMIC_RELAXED);
        if (k < 2 || bits_empty(ix, entry(ix, i))) {
            continue;
        }
        seen++;
        /* signed: nginx processes' clocks differ by a few ms, so a touch
         * may lie slightly in the future of now */
        age = (int32_t) (now - entry(ix, i)->touch) > 0 ? now - entry(ix, i)->touch : 0;
        /*
         * Older by 64 ms steps first; within one, a block with no
         * child held under it, as engines evict a sequence deepest block
         * first. A chain's blocks come in one event, with one touch: LRU
         * alone dropped inner blocks as often as leaves, each opening a
         * hole for its holders, and a full index that evicts filled the
         * hole table until every match walked. (The prefix, what a match
         * needs, also goes last.)
         */
        tier = (age >> 6) * 2 + (side(ix, i)->nkid == 0);
        if (!found || tier > best_tier || (tier == best_tier && age > best_age)) {
            best = i;
            best_age = age;
            best_tier = tier;
            found = 1;
        }
    }
    ix->hand = i;
    if (found) {
        bump(counter, evict_chain(ix, best));
    }
    return found;
}

/* used + 1 > cap * MAX_LOAD, in integers: it runs for every block stored,
 * and the conversions to double showed in the ingest profile */
static int must_evict(const kv_index_t *ix)
{
    return ix->used > 0 && (ix->used + 1) * MAX_LOAD_DEN > ix->cap * MAX_LOAD_NUM;
}

/* The entry for key, created (with no holders, parent not known) if
 * absent: one probe. */
static uint64_t upsert(kv_index_t *ix, uint64_t key, uint32_t now)
{
    uint64_t mask = ix->cap - 1, i, k;
    entry_t *e;
    int      evicted = 0;

again:
    for (i = home(ix, key);; i = (i + 1) & mask) {
        k = __atomic_load_n(&entry(ix, i)->key, __ATOMIC_RELAXED);
        if (k == key) {
            return i;
        }
        if (k == KEY_EMPTY) {
            break;
        }
    }
    if (!evicted && must_evict(ix)) {
        /* eviction rewrites the table: probe again afterwards */
        while (must_evict(ix) && evict_one(ix, &ix->evicted, now)) {
            /* void */
        }
        evicted = 1;
        goto again;
    }
    e = entry(ix, i);
    write_begin(e);
    __atomic_store_n(&e->key, key, __ATOMIC_RELAXED);
    write_end(e);
    e->touch = now;
    memset(side(ix, i), 0, sizeof(side_t));
    ix->used++;
    return i;
}

/* slot now holds entry i (it did not). The hole it may have had there is
 * dropped after the bit is set: a reader that finds the filter clear then
 * finds the block held. */
static void set_holder(kv_index_t *ix, uint64_t i, uint32_t slot, uint32_t now)
{
    entry_t *e = entry(ix, i);

    e->touch = now;
    if (bits_empty(ix, e)) {
        bump(&ix->live, 1);
    }
    write_begin(e);
    set_bits(e, slot / 64, get_bits(e, slot / 64) | 1ULL << (slot % 64));
    write_end(e);
    if (hole_fill(ix, __atomic_load_n(&e->key, __ATOMIC_RELAXED), slot)) {
        side(ix, i)->kids |= kid_bit(slot);     /* the children it kept while away */
    }
    bump(&slots(ix)[slot].blocks, 1);
    bump(&ix->stored, 1);
    ix->lost_ops++;
}

/*
 * slot stores key, whose parent is pk (KEY_ROOT: none; 0: not known).
 * *pi is pk's entry while *seen is ix->erases (a cache across a run of
 * blocks; -1 to look). Returns key's entry, valid until ix->erases moves.
 *
 * An entry learns its parent once; from then on it is the one used (the
 * caller may not know it: kv_index_record), and the holders the entry had
 * then are counted under it. Before the block goes in, the parent's entry
 * lists slot among its kids (or, if slot does not hold the parent, lists
 * the parent as a hole of slot: before the bit a reader could see) and
 * counts the child, so an eviction while key is made room for cannot lose
 * the count (the parent stays, as a ghost if need be). A block whose
 * parent no one knows may open a hole no one can name: the slot is lost.
 */
static uint64_t store_block(kv_index_t *ix, uint32_t slot, uint64_t key, uint64_t pk,
                            int64_t *pi, uint64_t *seen, uint32_t now)
{
    int64_t  at;
    uint64_t i, erases, known, b;
    side_t  *sd;
    uint32_t w, held = 0;

    if (pk == 0) {
        at = find(ix, key);
        if (at >= 0 && side(ix, (uint64_t) at)->parent != 0) {
            *pi = -1;
            return store_block(ix, slot, key, side(ix, (uint64_t) at)->parent, pi, seen, now);
        }
        if (at < 0 || !test_bit(entry(ix, (uint64_t) at), slot)) {
            mark_lost(ix, slot);
        }
    }
    if (pk >= 2) {
        if (*pi < 0 || *seen != ix->erases) {
            *pi = find(ix, pk);
        }
        if (*pi < 0) {
            *pi = (int64_t) upsert(ix, pk, now);    /* a ghost: its child will be held */
        }
        sd = side(ix, (uint64_t) *pi);
        sd->kids |= kid_bit(slot);
        if (sd->nkid < UINT32_MAX) {
            sd->nkid++;
        }
        if (pk != key) {
            child_add(sd, key);         /* before slot holds it */
        }
        if (!test_bit(entry(ix, (uint64_t) *pi), slot)) {
            hole_add(ix, pk, slot);
        }
    }
    erases = ix->erases;
    i = upsert(ix, key, now);
    sd = side(ix, i);
    known = sd->parent;
    if (known == 0 && pk != 0 && pk != key) {
        sd->parent = pk;
        /* a new entry (the usual case) has no holders to count: no
         * popcount (a libgcc call without -mpopcnt) and no kid_count */
        for (w = 0; w < ix->words; w++) {
            b = get_bits(entry(ix, i), w);
            held += b ? (uint32_t) __builtin_popcountll(b) : 0;
        }
        if (held > 0) {
            kid_count(ix, pk, held, 0, KEY_EMPTY);
        }
    } else if (known != 0 && known != pk) {
        /* it chains onto another key (a 64-bit collision): unlist and
         * count it out there */
        kid_count(ix, pk, -1, 1, key);
        *pi = -1;
        return store_block(ix, slot, key, known, pi, seen, now);
    }
    if (!test_bit(entry(ix, i), slot)) {
        set_holder(ix, i, slot, now);
        return i;
    }
    /* slot held key already: the pair was counted, the reservation goes */
    entry(ix, i)->touch = now;
    if (pk >= 2) {
        sd = side(ix, (uint64_t) *pi);
        if (erases == ix->erases && sd->nkid > 1 && sd->nkid < UINT32_MAX) {
            sd->nkid--;                 /* pk's entry did not move (the usual case) */
        } else {
            kid_count(ix, pk, -1, 1, KEY_EMPTY);   /* may erase a ghost pk: look key up again */
            *pi = -1;
            i = (uint64_t) find(ix, key);
        }
    }
    return i;
}

/* slot no longer holds entry i. */
static void clear_holder(kv_index_t *ix, uint64_t i, uint32_t slot)
{
    entry_t *e = entry(ix, i);
    uint64_t pk = side(ix, i)->parent, key = __atomic_load_n(&e->key, __ATOMIC_RELAXED);

    if (!test_bit(e, slot)) {
        return;
    }
    note_loss(ix, i, slot);
    write_begin(e);
    set_bits(e, slot / 64, get_bits(e, slot / 64) & ~(1ULL << (slot % 64)));
    write_end(e);
    if (bits_empty(ix, e)) {
        bump(&ix->live, -1);
    }
    lose_block(ix, slot);
    ix->lost_ops++;
    /* an erased entry leaves its parent's list in kid_count (one lookup) */
    kid_count(ix, pk, -1, 1, erase_if_unused(ix, i, 0) ? key : KEY_EMPTY);
}

/*
 * A slot marked lost gets its holes back once the table has room: one pass
 * over the table lists, for each entry a lost slot holds, the parent the
 * slot lacks (every held entry names its parent: store_block). A slot that
 * holds an entry whose parent is not known (kv_index_record) stays lost,
 * as does one whose holes still do not fit. At most one pass per cap/4
 * blocks stored or removed, so it costs O(1) a block however often it
 * fails.
 */
static void rebuild_lost(kv_index_t *ix)
{
    uint64_t mask[64] = { 0 }, b, pk, i;
    uint32_t k, w, words = ix->words < 64 ? ix->words : 64, sl;
    int64_t  at;
    slot_t  *s = slots(ix);

    if (ix->rd.lost_slots == 0 || ix->lost_ops < ix->cap / 4) {
        return;
    }
    ix->lost_ops = 0;
    if (ix->hole_used > ix->hole_cap * 3 / 8) {
        hole_gc(ix);
        if (ix->hole_used > ix->hole_cap * 3 / 8) {
            return;
        }
    }
    for (k = 0; k < ix->max_workers && k < 64 * 64; k++) {
        if (s[k].lost) {
            mask[k / 64] |= 1ULL << (k % 64);
        }
    }
    for (i = 0; i < ix->cap; i++) {
        entry_t *e = entry(ix, i);

        if (__atomic_load_n(&e->key, __ATOMIC_RELAXED) < 2
            || (pk = side(ix, i)->parent) == KEY_ROOT)
        {
            continue;
        }
        at = -2;
        for (w = 0; w < words; w++) {
            for (b = get_bits(e, w) & mask[w]; b; b &= b - 1) {
                sl = w * 64 + (uint32_t) __builtin_ctzll(b);
                if (pk == 0) {
                    mask[w] &= ~(1ULL << (sl % 64));    /* a hole no one can name */
                    continue;
                }
                if (at == -2) {
                    at = find(ix, pk);
                }
                if ((at < 0 || !test_bit(entry(ix, (uint64_t) at), sl))
                    && hole_add(ix, pk, sl) < 0)
                {
                    mask[w] &= ~(1ULL << (sl % 64));    /* no room after all */
                }
            }
        }
    }
    /* the holes (filter bits) are visible before the walk ends */
    __atomic_thread_fence(__ATOMIC_RELEASE);
    for (k = 0; k < ix->max_workers && k < 64 * 64; k++) {
        if (mask[k / 64] >> (k % 64) & 1) {
            s[k].lost = 0;
            bump(&ix->rd.lost_slots, -1);
        }
    }
}

/* --- engine map (writer only) ------------------------------------------- */

static uint64_t map_key(uint32_t slot, uint64_t engine)
{
    return norm_key(mix(engine ^ ((uint64_t) slot << 48 | slot)));
}

static int64_t map_find(const kv_index_t *ix, uint32_t slot, uint64_t engine)
{
    uint64_t key = map_key(slot, engine), mask = ix->map_cap - 1, i, n;
    map_t   *m = map(ix);

    for (i = key & mask, n = 0; n < ix->map_cap; i = (i + 1) & mask, n++) {
        if (m[i].key == key && m[i].engine == engine && m[i].slot == slot) {
            return (int64_t) i;
        }
        if (m[i].key == KEY_EMPTY) {
            return -1;
        }
    }
    return -1;
}

/* Deletes map entry i by shifting later members of its probe run back, so
 * the map never holds tombstones and an absent key's probe stays short
 * (the map has no readers but the writer, so entries may move freely). */
static void map_del(kv_index_t *ix, uint64_t i)
{
    uint64_t mask = ix->map_cap - 1, j = i, k, home;
    map_t   *m = map(ix);

    ix->map_used--;
    for (;;) {
        m[j].key = KEY_EMPTY;
        for (k = (j + 1) & mask;; k = (k + 1) & mask) {
            if (m[k].key == KEY_EMPTY) {
                return;
            }
            home = m[k].key & mask;
            /* m[k] may fill the hole at j unless its home lies in (j, k] */
            if (j <= k ? (home <= j || home > k) : (home <= j && home > k)) {
                m[j] = m[k];
                j = k;
                break;
            }
        }
    }
}

/*
 * The map is full: room for one more. A mapping whose block its slot no
 * longer holds (the index evicted or expired it: the engine has not said
 * so yet) goes first; failing that, of a few from the hand on, the one
 * whose block was least recently stored, and that block leaves the index
 * for its slot too. A mapping is never forgotten while its block stays
 * indexed: the engine's removal of that block, unknown then, would leave
 * it matching for good.
 */
static void map_make_room(kv_index_t *ix, uint32_t now)
{
    uint64_t mask = ix->map_cap - 1, i = ix->map_hand & mask, n, best = 0;
    uint32_t age, best_age = 0, slot;
    int64_t  at;
    map_t   *m = map(ix);
    int      seen = 0, freed = 0;

    for (n = 0; seen < MAP_SAMPLE && n < ix->map_cap; ) {
        if (m[i].key == KEY_EMPTY) {
            i = (i + 1) & mask;
            n++;
            continue;
        }
        at = find(ix, norm_key(m[i].seq));
        if (at < 0 || !test_bit(entry(ix, (uint64_t) at), m[i].slot)) {
            map_del(ix, i);     /* a later mapping may have moved into i: look again */
            freed = 1;
            continue;
        }
        age = (int32_t) (now - entry(ix, (uint64_t) at)->touch) > 0
              ? now - entry(ix, (uint64_t) at)->touch : 0;
        if (!seen || age > best_age) {
            best = i;
            best_age = age;
        }
        seen++;
        i = (i + 1) & mask;
        n++;
    }
    ix->map_hand = i;
    if (freed || !seen) {
        return;
    }
    /* nothing deleted: best has not moved */
    slot = m[best].slot;
    at = find(ix, norm_key(m[best].seq));
    map_del(ix, best);
    if (at >= 0) {
        clear_holder(ix, (uint64_t) at, slot);
        bump(&ix->evicted, 1);
    }
}

static void map_put(kv_index_t *ix, uint32_t slot, uint64_t engine, uint64_t seq, uint32_t now)
{
    uint64_t key = map_key(slot, engine), mask = ix->map_cap - 1, i;
    map_t   *m = map(ix);
    int64_t  at = map_find(ix, slot, engine);

    if (at >= 0) {
        m[at].seq = seq;
        return;
    }
    if (ix->map_used + 1 > ix->map_cap * 3 / 4) {
        map_make_room(ix, now);
    }
    for (i = key & mask; m[i].key != KEY_EMPTY; i = (i + 1) & mask) {
        /* void: the map is at most 3/4 full, an empty slot is near */
    }
    m[i].key = key;
    m[i].engine = engine;
    m[i].seq = seq;
    m[i].slot = slot;
    ix->map_used++;
}

/* The sequence hash an engine hash names for slot (itself if unmapped). */
static uint64_t map_seq(kv_index_t *ix, uint32_t slot, uint64_t engine, int take)
{
    int64_t at = map_find(ix, slot, engine);
    map_t  *m = map(ix);
    uint64_t seq;

    if (at < 0) {
        return engine;
    }
    seq = m[at].seq;
    if (take) {
        map_del(ix, (uint64_t) at);
    }
    return seq;
}

/* --- workers ------------------------------------------------------------- */

/* Logs that slot k changed hands, for kv_index_slots_changed: the entry
 * first, then the count that publishes it. One writer at a time.
 *
 * The entry overwrites change g - SLOT_LOG's, which a reader may be
 * copying; the reader finds that out from the count it reads after its
 * copy (and an acquire fence), so the count of change g - 1 must be
 * visible before this entry is: a release store. x86 keeps stores in
 * order anyway (the same mov); a weakly ordered CPU may otherwise show
 * the new entry to a reader that still reads the old count, which then
 * takes change g's slot for change g - SLOT_LOG's. */
static void note_slot(kv_index_t *ix, uint32_t k)
{
    uint64_t g = __atomic_load_n(&ix->slot_gen, __ATOMIC_RELAXED) + 1;

    __atomic_store_n(&ix->slot_log[g % SLOT_LOG], k, __ATOMIC_RELEASE);
    __atomic_store_n(&ix->slot_gen, g, __ATOMIC_RELEASE);
}

int kv_index_slots_changed(const kv_index_t *ix, uint64_t *since, uint32_t *out,
                           size_t cap)
{
    uint64_t from = *since, g, c;
    size_t   n = 0;

    g = __atomic_load_n(&ix->slot_gen, __ATOMIC_ACQUIRE);
    *since = g;
    if (g == from) {
        return 0;
    }
    if (g < from || g - from >= SLOT_LOG || g - from > cap) {
        return -1;
    }
    for (c = from + 1; c <= g; c++) {
        out[n++] = __atomic_load_n(&ix->slot_log[c % SLOT_LOG], __ATOMIC_RELAXED);
    }
    /* the writer overwrites change c - SLOT_LOG just before it publishes
     * change c: what was read stands unless change from + 1 + SLOT_LOG may
     * have been under way meanwhile */
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (__atomic_load_n(&ix->slot_gen, __ATOMIC_RELAXED) - from >= SLOT_LOG) {
        return -1;
    }
    return (int) n;
}

/* Whether slot i is live and holds (worker_id, dp_rank). */
static int slot_holds(const kv_index_t *ix, uint32_t i, uint64_t worker_id, uint32_t dp_rank)
{
    slot_t *s = &slots(ix)[i];

    return __atomic_load_n(&s->in_use, __ATOMIC_ACQUIRE) == 1
           && __atomic_load_n(&s->worker_id, __ATOMIC_RELAXED) == worker_id
           && __atomic_load_n(&s->dp_rank, __ATOMIC_RELAXED) == dp_rank;
}

/*
 * Where each worker's slot was last found, per thread: the search reads
 * every slot up to the worker's (4,096 reads at the end of a full fleet,
 * ~2.3 us), and the helper looks a worker up for every event it applies.
 * A hint is taken only when its slot still holds that worker (the check
 * the search makes of each slot), so a stale or colliding hint is a miss,
 * never a wrong answer. Direct-mapped, 4 entries a slot of the largest
 * index the thread has used (24 KB at 256 slots, 384 KB at 4,096); freed
 * when the thread exits.
 */
typedef struct {
    const kv_index_t   *ix;
    uint64_t            worker_id;
    uint32_t            dp_rank;
    uint32_t            slot;
} hint_t;

static __thread hint_t *hints;
static __thread size_t  hints_mask;
static pthread_once_t   hints_once = PTHREAD_ONCE_INIT;
static pthread_key_t    hints_key;
static int              hints_keyed;

/* a thread's hints are freed when it exits (event threads come and go) */
static void hints_key_make(void)
{
    hints_keyed = pthread_key_create(&hints_key, free) == 0;
}

static hint_t *hint_of(const kv_index_t *ix, uint64_t worker_id, uint32_t dp_rank)
{
    size_t  want = 1024;
    uint64_t h;

    while (want < 4 * (size_t) ix->max_workers) {
        want *= 2;
    }
    if (hints == NULL || hints_mask + 1 < want) {
        hint_t *more = calloc(want, sizeof(hint_t));

        if (more == NULL) {
            return NULL;
        }
        free(hints);
        hints = more;
        hints_mask = want - 1;
        pthread_once(&hints_once, hints_key_make);
        if (hints_keyed) {
            pthread_setspecific(hints_key, more);
        }
    }
    h = (worker_id ^ (uint64_t) dp_rank << 40 ^ (uint64_t) (uintptr_t) ix) * 0x9e3779b97f4a7c15ULL;
    return &hints[(h >> 32) & hints_mask];
}

int kv_index_worker_find(const kv_index_t *ix, uint64_t worker_id, uint32_t dp_rank)
{
    hint_t  *hint = hint_of(ix, worker_id, dp_rank);
    uint32_t i;

    if (hint && hint->ix == ix && hint->worker_id == worker_id && hint->dp_rank == dp_rank
        && hint->slot < ix->max_workers && slot_holds(ix, hint->slot, worker_id, dp_rank))
    {
        return (int) hint->slot;
    }
    for (i = 0; i < ix->max_workers; i++) {
        if (slot_holds(ix, i, worker_id, dp_rank)) {
            if (hint) {
                hint->ix = ix;
                hint->worker_id = worker_id;
                hint->dp_rank = dp_rank;
                hint->slot = i;
            }
            return (int) i;
        }
    }
    return -1;
}

static int kv_index_free_slot(const kv_index_t *ix)
{
    slot_t  *s = slots(ix);
    uint32_t i;

    for (i = 0; i < ix->max_workers; i++) {
        if (!__atomic_load_n(&s[i].in_use, __ATOMIC_RELAXED)) {
            return (int) i;
        }
    }
    return -1;
}


static int reap(kv_index_t *ix);

static int worker_add(kv_index_t *ix, uint64_t worker_id, uint32_t dp_rank)
{
    slot_t  *s = slots(ix);
    int      at = kv_index_worker_find(ix, worker_id, dp_rank);
    uint32_t i;

    if (at >= 0) {
        return at;
    }
    if (kv_index_free_slot(ix) < 0) {
        reap(ix);
    }
    for (i = 0; i < ix->max_workers; i++) {
        if (!__atomic_load_n(&s[i].in_use, __ATOMIC_RELAXED)) {
            __atomic_store_n(&s[i].worker_id, worker_id, __ATOMIC_RELAXED);
            __atomic_store_n(&s[i].dp_rank, dp_rank, __ATOMIC_RELAXED);
            __atomic_store_n(&s[i].blocks, 0, __ATOMIC_RELAXED);
            __atomic_store_n(&s[i].in_use, 1, __ATOMIC_RELEASE);
            __atomic_fetch_add(&ix->workers, 1, __ATOMIC_SEQ_CST);
            note_slot(ix, i);
            return (int) i;
        }
    }
    return -1;
}

/* Drops every block of the slots in mask: two passes over the table (the
 * bits and counts, then the entries left unused: nothing moves in the
 * first, so it sees every entry once) and one over the engine map. */
static void clear_mask(kv_index_t *ix, const uint64_t mask[64])
{
    map_t   *m = map(ix);
    uint64_t i;
    uint32_t k, n;

    /* the slots lose their blocks in table order, not chain order, and
     * the holes that opens are listed nowhere: readers walk meanwhile
     * (holes_clear_mask ends it) */
    for (k = 0; k < ix->max_workers; k++) {
        if (mask[k / 64] >> (k % 64) & 1) {
            mark_lost(ix, k);
        }
    }
    for (i = 0; i < ix->cap; i++) {
        if (__atomic_load_n(&entry(ix, i)->key, __ATOMIC_RELAXED) >= 2
            && (n = clear_bits(ix, i, mask)) > 0)
        {
            kid_count(ix, side(ix, i)->parent, -(int64_t) n, 0, KEY_EMPTY);
        }
    }
    for (i = 0; i < ix->cap; i++) {
        if (__atomic_load_n(&entry(ix, i)->key, __ATOMIC_RELAXED) >= 2
            && erase_if_unused(ix, i, 1))
        {
            i--;            /* a later entry may have moved into i: look again */
        }
    }
    for (i = 0; i < ix->map_cap; ) {
        if (m[i].key != KEY_EMPTY && (mask[m[i].slot / 64] >> (m[i].slot % 64) & 1)) {
            map_del(ix, i);     /* a later entry may have moved into i: look again */
            continue;
        }
        i++;
    }
    holes_clear_mask(ix, mask);
}

/*
 * Cleared drops a worker's blocks at once (one pass over the table). A
 * removal is deferred instead: the slot is retired (in_use SLOT_RETIRED:
 * readers and lookups ignore it, its blocks count for nobody) and the
 * pass that frees its entries is shared by every slot retired meanwhile
 * (kv_index_reap). A churn of thousands of worker ids then costs one pass
 * per reap, not one per id.
 */

static void clear_slots(kv_index_t *ix, uint64_t worker_id, int release)
{
    slot_t  *s = slots(ix);
    uint64_t mask[64] = { 0 };
    uint32_t k, any = 0;

    for (k = 0; k < ix->max_workers; k++) {
        if (__atomic_load_n(&s[k].in_use, __ATOMIC_SEQ_CST) == SLOT_LIVE
            && __atomic_load_n(&s[k].worker_id, __ATOMIC_SEQ_CST) == worker_id)
        {
            mask[k / 64] |= 1ULL << (k % 64);
            any = 1;
        }
    }
    if (!any) {
        return;
    }
    if (!release) {
        clear_mask(ix, mask);
    }
    for (k = 0; k < ix->max_workers; k++) {
        if (mask[k / 64] >> (k % 64) & 1) {
            __atomic_store_n(&s[k].blocks, 0, __ATOMIC_SEQ_CST);
            if (release) {
                __atomic_store_n(&s[k].in_use, SLOT_RETIRED, __ATOMIC_RELEASE);
                __atomic_fetch_sub(&ix->workers, 1, __ATOMIC_SEQ_CST);
                note_slot(ix, k);
            }
        }
    }
    __atomic_fetch_add(&ix->cleared, 1, __ATOMIC_SEQ_CST);
}

static int reap(kv_index_t *ix)
{
    slot_t  *s = slots(ix);
    uint64_t mask[64] = { 0 };
    uint32_t k;
    int      n = 0;

    for (k = 0; k < ix->max_workers; k++) {
        if (__atomic_load_n(&s[k].in_use, __ATOMIC_SEQ_CST) == SLOT_RETIRED) {
            mask[k / 64] |= 1ULL << (k % 64);
            n++;
        }
    }
    if (n == 0) {
        return 0;
    }
    clear_mask(ix, mask);
    /* before the slots can be taken again: a match that read a bit of a
     * slot's old worker sees the count moved if it sees the new worker
     * live there (settled); release: one that reads the new count reads
     * the cleared bits */
    __atomic_store_n(&ix->rd.reaps, __atomic_load_n(&ix->rd.reaps, __ATOMIC_RELAXED) + 1,
                     __ATOMIC_RELEASE);
    for (k = 0; k < ix->max_workers; k++) {
        if (mask[k / 64] >> (k % 64) & 1) {
            __atomic_store_n(&s[k].in_use, 0, __ATOMIC_RELEASE);
        }
    }
    return n;
}

/* --- events -------------------------------------------------------------- */

/* Stored blocks are handled in groups: all sequence hashes of a group are
 * chained first and their home entries prefetched, so the group's cache
 * misses overlap instead of following one another. */
#define STORE_GROUP 32

/*
 * Room for n new entries before an event's blocks go in, so that the event
 * never evicts blocks it has just stored to make room for its later ones:
 * at equal ages (one millisecond's events) the sample's first entry goes,
 * which may be one of them, leaving a hole in the run the worker just
 * reported (where an event evicted itself used to depend on where its keys
 * happened to lie). Blocks already indexed need no room, so a full table
 * runs up to one event's blocks below its cap; upsert still evicts if an
 * event brings more new blocks than this made room for (over half the cap).
 */
static void make_room(kv_index_t *ix, uint64_t n, uint32_t now)
{
    double limit = (double) ix->cap * MAX_LOAD;

    if ((double) n > limit / 2) {
        n = (uint64_t) (limit / 2);
    }
    while (ix->used > 0 && (double) (ix->used + n) > limit
           && evict_one(ix, &ix->evicted, now))
    {
        /* void */
    }
}

static int apply_stored(kv_index_t *ix, int slot, const kv_event_t *ev, uint32_t now,
                        char *err, size_t errlen)
{
    uint64_t parent = 0, prev, seq[STORE_GROUP], seen = ix->erases, pk;
    int64_t  at = -1;
    size_t   i, j, m;

    make_room(ix, ev->n_blocks, now);
    seen = ix->erases;
    if (ev->has_parent) {
        parent = map_seq(ix, (uint32_t) slot, ev->parent_hash, 0);
        at = find(ix, norm_key(parent));
        if (at < 0 || !test_bit(entry(ix, (uint64_t) at), (uint32_t) slot)) {
            bump(&ix->unknown_parent, 1);
            snprintf(err, errlen, "parent %llu of a stored event is not indexed",
                     (unsigned long long) ev->parent_hash);
            return -1;
        }
    }
    prev = parent;
    for (i = 0; i < ev->n_blocks; i += m) {
        m = ev->n_blocks - i < STORE_GROUP ? ev->n_blocks - i : STORE_GROUP;
        for (j = 0; j < m; j++) {
            uint64_t t = ev->blocks[i + j].tokens_hash;

            seq[j] = (i + j == 0 && !ev->has_parent) ? t : kv_hash_chain(parent, t);
            parent = seq[j];
            prefetch_key_w(ix, norm_key(seq[j]));
        }
        for (j = 0; j < m; j++) {
            pk = i + j > 0 || ev->has_parent ? norm_key(prev) : KEY_ROOT;
            at = (int64_t) store_block(ix, (uint32_t) slot, norm_key(seq[j]), pk, &at, &seen,
                                       now);
            seen = ix->erases;
            prev = seq[j];
            if (ev->blocks[i + j].block_hash != seq[j]) {
                map_put(ix, (uint32_t) slot, ev->blocks[i + j].block_hash, seq[j], now);
            }
        }
    }
    return 0;
}

static void apply_removed(kv_index_t *ix, int slot, const kv_event_t *ev)
{
    int64_t at;
    size_t  i;

    for (i = 0; i < ev->n_hashes; i++) {
        uint64_t seq = map_seq(ix, (uint32_t) slot, ev->hashes[i], 1);

        at = find(ix, norm_key(seq));
        if (at < 0 || !test_bit(entry(ix, (uint64_t) at), (uint32_t) slot)) {
            bump(&ix->unknown_remove, 1);
            continue;
        }
        clear_holder(ix, (uint64_t) at, (uint32_t) slot);
        bump(&ix->removed, 1);
    }
}

static int apply_event(kv_index_t *ix, const kv_event_t *ev, uint64_t now_ms,
                       char *err, size_t errlen)
{
    int slot;

    if (ev->kind == KV_EVENT_CLEARED) {
        clear_slots(ix, ev->worker_id, 0);
        return 0;
    }
    slot = worker_add(ix, ev->worker_id, ev->dp_rank);
    if (slot < 0) {
        snprintf(err, errlen, "no free worker slot for worker %llu (max_workers %u)",
                 (unsigned long long) ev->worker_id, ix->max_workers);
        return -1;
    }
    if (ev->kind == KV_EVENT_STORED) {
        return apply_stored(ix, slot, ev, (uint32_t) now_ms, err, errlen);
    }
    if (ev->kind == KV_EVENT_REMOVED) {
        apply_removed(ix, slot, ev);
        return 0;
    }
    snprintf(err, errlen, "unknown event kind %d", (int) ev->kind);
    return -1;
}

/* --- the writer's calls ---------------------------------------------------
 *
 * A writer killed inside a call (the helper process, or an nginx worker
 * holding the slab mutex in approximate mode) may leave an entry's lock
 * odd, which the next writer's write_begin would make even for good:
 * readers would then take half-written entries as whole. Worse, it may
 * leave a backward shift half done (an entry twice, or none where its
 * probe run needs it), a count or a hole missing: nothing a new writer
 * can check short of rebuilding everything. So each call marks `writing`
 * while it runs (one writer at a time: the caller serialises them), and a
 * call that finds it set knows its predecessor died inside one: it makes
 * every lock even and clears the index (slots and their workers stay).
 * What the workers held is then learnt again from their events; in events
 * mode the self-check resyncs a worker whose cache hits the index misses.
 */
static void writer_died(kv_index_t *ix)
{
    uint64_t i;
    uint32_t w;
    slot_t  *s = slots(ix);

    bump(&ix->writer_died, 1);
    /* readers walk while it clears (the sentinel), and any match under
     * way when it started walks again (gen) */
    bump(&ix->rd.lost_slots, 1);
    bump_gen(ix);
    for (i = 0; i < ix->cap; i++) {
        entry_t *e = entry(ix, i);

        kv_seqlock_unstick(&e->lock);
        write_begin(e);
        for (w = 0; w < ix->words; w++) {
            set_bits(e, w, 0);
        }
        __atomic_store_n(&e->key, KEY_EMPTY, __ATOMIC_RELAXED);
        write_end(e);
    }
    memset(side(ix, 0), 0, ix->cap * sizeof(side_t));
    memset(hole(ix, 0), 0, ix->hole_cap * ix->hole_size);
    memset(counts(ix), 0, (sizeof(uint16_t) << ix->filter_bits));
    for (i = 0; i < (1ULL << ix->filter_bits) / 64; i++) {
        __atomic_store_n(&filter(ix)[i], 0, __ATOMIC_RELAXED);
    }
    memset(map(ix), 0, ix->map_cap * sizeof(map_t));
    for (i = 0; i < ix->max_workers; i++) {
        __atomic_store_n(&s[i].blocks, 0, __ATOMIC_RELAXED);
        s[i].lost = 0;
    }
    ix->used = 0;
    __atomic_store_n(&ix->live, 0, __ATOMIC_RELAXED);
    ix->hole_used = ix->hole_kept = ix->hole_new = 0;
    ix->map_used = ix->map_hand = 0;
    ix->hand = ix->lost_ops = 0;
    ix->erases++;
    bump(&ix->cleared, 1);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    __atomic_store_n(&ix->rd.lost_slots, 0, __ATOMIC_RELEASE);
}

static void writer_enter(kv_index_t *ix)
{
    if (ix->writing) {
        writer_died(ix);
    }
    ix->writing = 1;
}

/* Leaves a call; lost slots are looked at again here, between changes.
 * The test is made here: rebuild_lost zeroes its 512-byte slot mask on
 * entry, before its own test (~70 instructions a call, for every event). */
static void writer_leave(kv_index_t *ix)
{
    if (ix->rd.lost_slots != 0 && ix->lost_ops >= ix->cap / 4) {
        rebuild_lost(ix);
    }
    ix->writing = 0;
}

int kv_index_worker_add(kv_index_t *ix, uint64_t worker_id, uint32_t dp_rank)
{
    int slot = kv_index_worker_find(ix, worker_id, dp_rank);

    if (slot >= 0) {
        return slot;        /* nothing to write (the events' usual case) */
    }
    writer_enter(ix);
    slot = worker_add(ix, worker_id, dp_rank);
    writer_leave(ix);
    return slot;
}

void kv_index_worker_clear(kv_index_t *ix, uint64_t worker_id)
{
    writer_enter(ix);
    clear_slots(ix, worker_id, 0);
    writer_leave(ix);
}

void kv_index_worker_remove(kv_index_t *ix, uint64_t worker_id)
{
    writer_enter(ix);
    clear_slots(ix, worker_id, 1);
    writer_leave(ix);
}

int kv_index_reap(kv_index_t *ix)
{
    int n;

    writer_enter(ix);
    n = reap(ix);
    writer_leave(ix);
    return n;
}

int kv_index_apply(kv_index_t *ix, const kv_event_t *ev, uint64_t now_ms,
                   char *err, size_t errlen)
{
    int rc;

    writer_enter(ix);
    rc = apply_event(ix, ev, now_ms, err, errlen);
    writer_leave(ix);
    return rc;
}

uint64_t kv_index_seq_of(kv_index_t *ix, uint64_t worker_id, uint32_t dp_rank,
                         uint64_t engine_hash)
{
    int slot = kv_index_worker_find(ix, worker_id, dp_rank);

    return slot < 0 ? engine_hash : map_seq(ix, (uint32_t) slot, engine_hash, 0);
}

/* --- approximate mode and the pending index ------------------------------ */

static void forget(kv_index_t *ix, uint32_t slot, const uint64_t *seq, size_t n)
{
    int64_t at;
    size_t  i;

    if (slot >= ix->max_workers) {
        return;
    }
    for (i = 0; i < n; i++) {
        at = find(ix, norm_key(seq[i]));
        if (at >= 0) {
            clear_holder(ix, (uint64_t) at, slot);
        }
    }
}

void kv_index_forget(kv_index_t *ix, uint32_t slot, const uint64_t *seq, size_t n)
{
    writer_enter(ix);
    forget(ix, slot, seq, n);
    writer_leave(ix);
}

/* Records seq[0..n) for slot. parent: the key chained before seq[0], or
 * NULL when seq[0] is a chain root (root_known) or nothing is known of it:
 * then a first block slot did not hold may leave a hole nobody can name,
 * and the slot is marked lost (readers walk every block while it is). */
static void record_run(kv_index_t *ix, uint32_t slot, const uint64_t *seq, size_t n,
                       const uint64_t *parent, int root_known, uint64_t now_ms)
{
    uint64_t pk = parent ? norm_key(*parent) : root_known ? KEY_ROOT : 0, seen = ix->erases;
    int64_t  at = -1;
    size_t   i;

    if (slot >= ix->max_workers) {
        return;
    }
    for (i = 0; i < n; i++) {
        if (i + MATCH_AHEAD < n) {
            prefetch_key_w(ix, norm_key(seq[i + MATCH_AHEAD]));
        }
        at = (int64_t) store_block(ix, slot, norm_key(seq[i]), pk, &at, &seen,
                                   (uint32_t) now_ms);
        seen = ix->erases;
        pk = norm_key(seq[i]);
    }
    if (ix->approximate && ix->live > ix->max_blocks) {
        uint64_t target = (uint64_t) ((double) ix->max_blocks * ix->prune_ratio);

        while (ix->live > target && evict_one(ix, &ix->pruned, (uint32_t) now_ms)) {
            /* void */
        }
    }
}

void kv_index_record(kv_index_t *ix, uint32_t slot, const uint64_t *seq, size_t n,
                     uint64_t now_ms)
{
    writer_enter(ix);
    record_run(ix, slot, seq, n, NULL, 0, now_ms);
    writer_leave(ix);
}

void kv_index_record_at(kv_index_t *ix, uint32_t slot, const uint64_t *seq, size_t from,
                        size_t n, uint64_t now_ms)
{
    if (from < n) {
        writer_enter(ix);
        record_run(ix, slot, seq + from, n - from, from ? &seq[from - 1] : NULL, 1, now_ms);
        writer_leave(ix);
    }
}

static void expire(kv_index_t *ix, uint64_t now_ms)
{
    uint32_t now = (uint32_t) now_ms;
    uint64_t i;

    if (!ix->approximate || ix->used == 0) {
        return;
    }
    /* a full sweep at most every tenth of the TTL, and at most once a
     * second: a learned TTL of a few seconds (kv_retain.h) would otherwise
     * sweep the whole table every timer tick */
    if (ix->last_expire
        && now - (uint32_t) ix->last_expire < (ix->ttl_ms < 10000 ? 1000 : ix->ttl_ms / 10))
    {
        return;
    }
    ix->last_expire = now ? now : 1;
    for (i = 0; i < ix->cap; i++) {
        entry_t *e = entry(ix, i);

        if (__atomic_load_n(&e->key, __ATOMIC_RELAXED) >= 2
            && (int32_t) (now - e->touch) > (int32_t) ix->ttl_ms && !bits_empty(ix, e))
        {
            drop(ix, i);
            bump(&ix->expired, 1);
            i--;            /* a later entry may have moved into i: look again */
        }
    }
}

void kv_index_expire(kv_index_t *ix, uint64_t now_ms)
{
    if (!ix->approximate || ix->used == 0) {
        return;             /* the timer's usual case: nothing written */
    }
    writer_enter(ix);
    expire(ix, now_ms);
    writer_leave(ix);
}

void kv_index_set_ttl(kv_index_t *ix, uint32_t ttl_ms)
{
    __atomic_store_n(&ix->ttl_ms, ttl_ms ? ttl_ms : 1, __ATOMIC_RELAXED);
}

uint32_t kv_index_ttl(const kv_index_t *ix)
{
    return ix->ttl_ms;
}

int64_t kv_index_age(const kv_index_t *ix, uint64_t key, uint64_t now_ms)
{
    int64_t at = find(ix, norm_key(key)), age;

    if (at < 0) {
        return -1;
    }
    /* touch and now are ms mod 2^32: their difference is right for 24
     * days; signed, as the sweep's, since another nginx process's clock
     * (which recorded the touch) may be a few ms ahead of this one's: such
     * a block is fresh, not 49 days old (kv_retain's oldest bucket) */
    age = (int32_t) ((uint32_t) now_ms - entry(ix, (uint64_t) at)->touch);
    return age > 0 ? age : 0;
}

/* --- readers ------------------------------------------------------------- */

/* A consistent copy of the holders of key; 0 if absent. */
static int read_holders(const kv_index_t *ix, uint64_t key, uint64_t *bits)
{
    uint64_t mask = ix->cap - 1, i, k, n;
    uint32_t w;

    for (i = home(ix, key), n = 0; n < ix->cap; i = (i + 1) & mask, n++) {
        entry_t *e = entry(ix, i);

        kv_seqread_t rd = { 0, 0 };

        do {
            if (!kv_seqlock_read_begin(&e->lock, &rd)) {
                return 0;   /* a writer stalled or died inside its write: absent */
            }
            k = __atomic_load_n(&e->key, __ATOMIC_RELAXED);
            if (k == key) {
                for (w = 0; w < ix->words; w++) {
                    bits[w] = __atomic_load_n(&e->bits[w], __ATOMIC_RELAXED);
                }
            }
        } while (!kv_seqlock_read_end(&e->lock, &rd));
        if (k == key) {
            return 1;
        }
        if (k == KEY_EMPTY) {
            return 0;
        }
    }
    return 0;
}

/* Appends the alive slots that bits lacks (or all of them when bits is
 * NULL) as holding `blocks` leading blocks, then keeps in alive only those
 * bits has. 1 if any slot is still alive. */
static int step(uint64_t *alive, const uint64_t *bits, uint32_t words, uint32_t blocks,
                kv_overlap_t *out, size_t cap, size_t *found)
{
    uint64_t gone;
    uint32_t w;
    int      any = 0;

    for (w = 0; w < words; w++) {
        gone = bits ? alive[w] & ~bits[w] : alive[w];
        while (gone && *found < cap) {
            out[*found].slot = w * 64 + (uint32_t) __builtin_ctzll(gone);
            out[*found].blocks = blocks;
            (*found)++;
            gone &= gone - 1;
        }
        alive[w] = bits ? alive[w] & bits[w] : 0;
        any |= alive[w] != 0;
    }
    return any;
}

/* Tests run a writer here (a match descheduled after its reads). */
#ifndef KV_INDEX_TEST_MATCHED
#define KV_INDEX_TEST_MATCHED(ix)
#endif

#define MATCH_TRIES     4                        /* matches run again after a reap */

/* retired slots (removed workers awaiting kv_index_reap) hold nothing */
static size_t live_only(const kv_index_t *ix, kv_overlap_t *out, size_t n)
{
    size_t i, found = 0;

    KV_INDEX_TEST_MATCHED(ix);
    for (i = 0; i < n; i++) {
        if (__atomic_load_n(&slots(ix)[out[i].slot].in_use, __ATOMIC_RELAXED) == SLOT_LIVE) {
            out[found++] = out[i];
        }
    }
    return found;
}

/*
 * Whether the slots live_only kept still are the ones whose bits the match
 * read: no reap ran since its count was read (reaps0, before any bit). A
 * slot that a reap freed and a new worker took meanwhile is live again,
 * and live_only alone would credit the new worker with the old one's
 * blocks. A reap bumps the count before it frees any slot, so a match
 * that saw a slot taken again (its in_use, read before the fence) sees
 * the count moved. Slots are freed only by reaps: one count for all.
 */
static int settled(const kv_index_t *ix, uint64_t reaps0)
{
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    return __atomic_load_n(&ix->rd.reaps, __ATOMIC_RELAXED) == reaps0;
}

/* Walks blocks from..to (all of seq[0..from) held by the alive slots):
 * keeps in alive the slots holding each block, noting the others as
 * holding that many leading blocks; entries MATCH_AHEAD blocks on are
 * prefetched so misses overlap. 1 while any slot is alive. */
static int walk_span(const kv_index_t *ix, const uint64_t *seq, size_t from, size_t to,
                     uint64_t *alive, uint32_t words, kv_overlap_t *out, size_t cap,
                     size_t *found)
{
    uint64_t bits[64];
    size_t   i;

    for (i = from; i <= to; i++) {
        if (i + MATCH_AHEAD <= to) {
            prefetch_key(ix, norm_key(seq[i + MATCH_AHEAD]));
        }
        if (!read_holders(ix, norm_key(seq[i]), bits)) {
            memset(bits, 0, words * sizeof(uint64_t));
        }
        if (!step(alive, bits, words, (uint32_t) i, out, cap, found)) {
            return 0;
        }
    }
    return 1;
}

static size_t match_walk(const kv_index_t *ix, const uint64_t *seq, size_t n,
                         kv_overlap_t *out, size_t cap)
{
    uint64_t alive[64];
    uint32_t words = ix->words < 64 ? ix->words : 64;
    size_t   i, found = 0;

    if (n == 0) {
        return 0;
    }
    for (i = 1; i < n && i <= MATCH_AHEAD; i++) {
        prefetch_key(ix, norm_key(seq[i]));
    }
    if (!read_holders(ix, norm_key(seq[0]), alive)) {
        return 0;
    }
    /* walk until no worker holds the prefix: the answer is known there */
    if (walk_span(ix, seq, 1, n - 1, alive, words, out, cap, &found)) {
        step(alive, NULL, words, (uint32_t) n, out, cap, &found);
    }
    return live_only(ix, out, found);
}

size_t kv_index_match_walk(const kv_index_t *ix, const uint64_t *seq, size_t n,
                           kv_overlap_t *out, size_t cap)
{
    uint64_t reaps;
    size_t   found;
    int      tries;

    for (tries = 0; tries < MATCH_TRIES; tries++) {
        reaps = __atomic_load_n(&ix->rd.reaps, __ATOMIC_ACQUIRE);
        found = match_walk(ix, seq, n, out, cap);
        if (settled(ix, reaps)) {
            return found;
        }
    }
    return 0;   /* reaped under every try: credit no one (routed by load) */
}

/* 1 if the filter says some key of seq[from..to) may be a hole. Read after
 * the entries whose run it vouches for. */
static int any_hole(const kv_index_t *ix, const uint64_t *seq, size_t from, size_t to)
{
    int hit = 0;

    for (; from < to; from++) {
        hit |= maybe_hole(ix, norm_key(seq[from]));     /* no branch: loads overlap */
    }
    return hit;
}

/* The filter bit of each key of seq[from..to) into fb[0..to-from): pure
 * arithmetic, done while the landings' misses are in flight so that only
 * the filter loads are left for after them. */
static void filter_slots(const kv_index_t *ix, const uint64_t *seq, size_t from, size_t to,
                         uint32_t *fb)
{
    size_t i;

    for (i = from; i < to; i++) {
        fb[i - from] = (uint32_t) filter_slot(ix, norm_key(seq[i]));
    }
}

/* any_hole over filter bits filter_slots computed. */
static int any_hole_at(const kv_index_t *ix, const uint32_t *fb, size_t n)
{
    const uint64_t *f = filter(ix);
    uint64_t        hit = 0;
    size_t          i;

    for (i = 0; i < n; i++) {
        hit |= __atomic_load_n(&f[fb[i] / 64], __ATOMIC_RELAXED) >> (fb[i] % 64);
    }
    return (int) (hit & 1);
}

/*
 * Where each alive slot that lacks block q stops in p+1..q, when no key in
 * p+1..q-1 is a hole: then a slot holding block p holds a leading run of
 * p+1..q (lacking k while holding k+1 would make k a hole), so a search
 * finds its end: the three quarter points, then the blocks inside each
 * quarter where some slot stops. 6 entries instead of the walk's 16, in two
 * rounds of misses. at_q: the holders of block q, read before. Emits the
 * slots that stop, in the walk's order, and keeps the others in alive.
 *
 * The filter is read again after these entries: if it lists a hole now (a
 * writer moved), the slots emitted are withdrawn and it returns 0 (the
 * caller walks). With fetch_only it reads the quarter points and only
 * prefetches the blocks it would read next (no answer, alive unchanged).
 */
static int search_span(const kv_index_t *ix, const uint64_t *seq, size_t p, size_t q,
                       const uint64_t *at_q, uint64_t *alive, uint32_t words,
                       kv_overlap_t *out, size_t cap, size_t *found, int fetch_only)
{
    uint64_t has[4][64], cur[64], gone[64], bits[64], any;
    size_t   r[5], k, x, found0 = *found;
    uint32_t w;

    for (k = 0; k <= 4; k++) {
        r[k] = p + (q - p) * k / 4;
    }
    for (k = 1; k < 4; k++) {
        if (!read_holders(ix, norm_key(seq[r[k]]), has[k - 1])) {
            memset(has[k - 1], 0, words * sizeof(uint64_t));
        }
    }
    memcpy(has[3], at_q, words * sizeof(uint64_t));
    memcpy(cur, alive, words * sizeof(uint64_t));
    for (k = 1; k <= 4; k++) {
        for (w = 0, any = 0; w < words; w++) {
            gone[w] = cur[w] & ~has[k - 1][w];
            cur[w] &= has[k - 1][w];
            any |= gone[w];
        }
        if (!any) {
            continue;
        }
        /* some slots stop in r[k-1]+1..r[k] */
        for (x = r[k - 1] + 1; x < r[k]; x++) {
            prefetch_key(ix, norm_key(seq[x]));
        }
        if (fetch_only) {
            continue;
        }
        for (x = r[k - 1] + 1; x < r[k] && any; x++) {
            if (!read_holders(ix, norm_key(seq[x]), bits)) {
                memset(bits, 0, words * sizeof(uint64_t));
            }
            any = (uint64_t) step(gone, bits, words, (uint32_t) x, out, cap, found);
        }
        if (any) {
            step(gone, NULL, words, (uint32_t) r[k], out, cap, found);
        }
    }
    if (fetch_only) {
        return 1;
    }
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (any_hole(ix, seq, p + 1, q)) {
        *found = found0;
        return 0;
    }
    memcpy(alive, cur, words * sizeof(uint64_t));
    return 1;
}

/* walk_span with its first MATCH_AHEAD entries prefetched first. */
static int walk_from(const kv_index_t *ix, const uint64_t *seq, size_t from, size_t to,
                     uint64_t *alive, uint32_t words, kv_overlap_t *out, size_t cap,
                     size_t *found)
{
    size_t i;

    for (i = from; i <= to && i < from + MATCH_AHEAD; i++) {
        prefetch_key(ix, norm_key(seq[i]));
    }
    return walk_span(ix, seq, from, to, alive, words, out, cap, found);
}

static int fb_hit(const kv_index_t *ix, uint32_t b)
{
    return (__atomic_load_n(&filter(ix)[b / 64], __ATOMIC_RELAXED) >> (b % 64)) & 1;
}

/*
 * A span p+1..q some of whose keys the filter lists (fb: their filter
 * bits, fb[0] the key p+1's): each listed key h is read as if it were a
 * landing, and the pieces between (no listed key inside) are skipped or
 * searched as spans are. A slot lacking h stops at or before h (h a hole
 * of it or not), found by the search of the piece below h; a slot holding
 * both ends of a piece with no hole inside holds all of it. So a hole
 * costs one entry read, not the walk of its 15 neighbours. The pieces'
 * keys are read again from the filter after the listed entries: a key
 * listed meanwhile makes it walk, as does a span with over SPLIT_MAX listed
 * keys. at_q: the holders of q. 1 while any slot is alive.
 */
#define SPLIT_MAX 4

static int split_span(const kv_index_t *ix, const uint64_t *seq, size_t p, size_t q,
                      const uint32_t *fb, const uint64_t *at_q, uint64_t *alive,
                      uint32_t words, kv_overlap_t *out, size_t cap, size_t *found)
{
    uint64_t has[SPLIT_MAX + 1][64], d;
    size_t   at[SPLIT_MAX + 2], m = 0, i, k;
    uint32_t w;

    at[0] = p;
    for (i = p + 1; i < q; i++) {
        if (fb_hit(ix, fb[i - p - 1])) {
            if (m == SPLIT_MAX) {
                return walk_from(ix, seq, p + 1, q, alive, words, out, cap, found);
            }
            at[++m] = i;
        }
    }
    at[m + 1] = q;
    for (k = 1; k <= m; k++) {
        if (!read_holders(ix, norm_key(seq[at[k]]), has[k - 1])) {
            memset(has[k - 1], 0, words * sizeof(uint64_t));
        }
    }
    memcpy(has[m], at_q, words * sizeof(uint64_t));
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    for (k = 0; k <= m; k++) {
        if (any_hole_at(ix, &fb[at[k] - p], at[k + 1] - at[k] - 1)) {
            return walk_from(ix, seq, p + 1, q, alive, words, out, cap, found);
        }
    }
    for (k = 0; k <= m; k++) {
        for (w = 0, d = 0; w < words; w++) {
            d |= alive[w] & ~has[k][w];
        }
        if (!d) {
            continue;               /* every alive slot holds at[k]..at[k + 1] */
        }
        if (!search_span(ix, seq, at[k], at[k + 1], has[k], alive, words, out, cap, found, 0)) {
            return walk_from(ix, seq, at[k] + 1, q, alive, words, out, cap, found);
        }
        for (w = 0, d = 0; w < words; w++) {
            d |= alive[w];
        }
        if (!d) {
            return 0;
        }
    }
    return 1;
}

enum { SPAN_SKIP, SPAN_SEARCH, SPAN_SPLIT, SPAN_SPLIT_LONG };

/*
 * A long span p+1..q (a coarse one) whose keys the filter lists at the
 * nl positions at[] (read from fb in round 2, their entries prefetched),
 * every alive slot holding q: 1 if every alive slot holds each listed key
 * and the filter, read again after those entries, lists no other key of
 * the span; then every alive slot holds all of p+1..q (one lacking some
 * key would lack the last such k while holding k+1, so k would be a hole
 * listed, and every listed key is held). 0 otherwise: the caller lands in
 * the span every JUMP blocks as before. Most such spans are listed for a
 * key that is no alive slot's hole (the filter's false positives, another
 * worker's hole): one entry instead of a round of landings.
 */
static int split_long(const kv_index_t *ix, const uint64_t *seq, size_t p, size_t q,
                      const uint32_t *fb, const size_t *at, size_t nl, const uint64_t *alive,
                      uint32_t words)
{
    uint64_t has[64], d;
    size_t   i, k;
    uint32_t w;

    for (k = 0; k < nl; k++) {
        if (!read_holders(ix, norm_key(seq[at[k]]), has)) {
            return 0;
        }
        for (w = 0, d = 0; w < words; w++) {
            d |= alive[w] & ~has[w];
        }
        if (d) {
            return 0;
        }
    }
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    for (i = p + 1, k = 0; i < q; i++) {
        if (fb_hit(ix, fb[i - p - 1])) {
            if (k == nl || at[k] != i) {
                return 0;           /* listed meanwhile */
            }
            k++;
        }
    }
    return 1;
}

/*
 * The jump: from a position p that every alive slot holds (with all of
 * 0..p), land on q = p + JUMP. If no alive slot lacks q and no key in
 * p+1..q-1 may be a hole of anyone (the filter), every alive slot holds all
 * of p+1..q: one that lacked some k in there would have a hole at the last
 * such k (it holds k+1). So the blocks between are skipped. If some slots
 * lack q, search_span finds where each stops; if the filter lists keys
 * between, split_span reads them and treats the pieces between as spans
 * (the blocks are walked one by one, as kv_index_match_walk does, only
 * when over SPLIT_MAX keys are listed or the filter changed meanwhile).
 * Either way the answer and its order are the walk's.
 *
 * Memory is the cost (a miss per entry: 0.1-2 us alone on this VM, ~30 ns
 * each when a dozen or more are in flight), so the reads go in dependent
 * rounds whose misses overlap, per batch of up to JUMP_BATCH landings:
 * block 0, all landings and the first span's blocks at once (the filter
 * bits of the keys between are computed meanwhile); then, after a fence,
 * the filter bits, and every entry of each span to search (up to
 * INNER_AHEAD) or listed key to split on; then the answers, in order.
 * Which spans need work is decided with a superset of the alive slots
 * (alive at p, less those lacking each landing) and checked again against
 * the true set.
 *
 * The argument holds for a span of any length, so the first pass lands
 * over the request at 16, 32, 64, 128 and then every COARSE_MAX blocks
 * (next_landing): where every alive slot holds a long prefix (one worker
 * with the whole conversation, the usual case past the first blocks), 5
 * landings vouch for 256 blocks instead of 16. A long span that some alive
 * slot stops in, or whose keys the filter lists, is matched again by the
 * same rounds with landings every JUMP blocks (match_spans, not coarse),
 * its landings prefetched in round 2: one more round of misses, only for
 * the spans where an overlap ends.
 *
 * Under a concurrent writer, a hole is listed (filter first) before the
 * block that makes it is cleared, and the filter of a key is read after
 * the entries that bound its span: a skipped block was held when its
 * filter was read, as a walked block is when its entry is read.
 */

/* The next landing after q, at most end: JUMP blocks on, or, in a coarse
 * pass (the first, over the whole request), twice as far as q from the
 * start, up to COARSE_MAX (16, 32, 64, 128, 256, 384...): one entry then
 * vouches for a long run every alive slot holds, and only a coarse span
 * some slot stops in is landed in again every JUMP blocks. */
static size_t next_landing(size_t q, size_t end, int coarse)
{
    size_t step = JUMP;

    if (coarse && q >= JUMP) {
        step = q < COARSE_MAX ? q : COARSE_MAX;
    }
    return q + step < end ? q + step : end;
}

/*
 * The spans from p (every alive slot holds 0..p) to end, landing as
 * next_landing says, in batches of up to `batch` landings and FB_MAX keys
 * between. 1 if any slot is still alive at end (it holds 0..end), 0 if
 * none: the overlaps are in out either way. p == 0 also reads block 0.
 */
static int match_spans(const kv_index_t *ix, const uint64_t *seq, size_t p, size_t end,
                       int coarse, uint64_t *alive, uint32_t words, uint32_t batch,
                       kv_overlap_t *out, size_t cap, size_t *found)
{
    uint64_t sup[64], land[JUMP_BATCH_WORDS], d;
    uint32_t fb[FB_MAX], w, fetched;
    uint8_t  kind[JUMP_BATCH], inner[JUMP_BATCH], nlisted[JUMP_BATCH];
    size_t   lq[JUMP_BATCH], listed[JUMP_BATCH][SPLIT_MAX], q, i, j, nl, nq, from;

    for (; p < end; p = lq[nl - 1]) {
        /* round 1: the landings of this batch (with block 0 for the first),
         * and meanwhile the filter bits of the keys between */
        for (q = p, nl = 0; q < end && nl < batch; nl++) {
            nq = next_landing(q, end, coarse);
            if (nq - p - 1 > FB_MAX) {
                break;              /* nl > 0: a landing is at most COARSE_MAX on */
            }
            lq[nl] = q = nq;
            prefetch_key(ix, norm_key(seq[q]));
        }
        if (p == 0) {
            /* the first span's blocks too, before anything is known:
             * requests share their first blocks with more workers than
             * any later ones (a system prompt, a conversation's start),
             * so that span is the one most often searched; read now,
             * its search costs no round of misses of its own */
            for (i = 1; i < JUMP && i < lq[0]; i++) {
                prefetch_key(ix, norm_key(seq[i]));
            }
        }
        filter_slots(ix, seq, p + 1, q, fb);
        if (p == 0 && !read_holders(ix, norm_key(seq[0]), alive)) {
            return 0;
        }
        for (j = 0; j < nl; j++) {
            if (!read_holders(ix, norm_key(seq[lq[j]]), &land[j * words])) {
                memset(&land[j * words], 0, words * sizeof(uint64_t));
            }
        }
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        /* round 2: the filter bits between; what each span needs, and
         * prefetches of every entry that step reads (a searched span's
         * inner blocks all at once: one round of misses, not two; a long
         * span's landings every JUMP blocks) */
        memcpy(sup, alive, words * sizeof(uint64_t));
        for (j = 0, fetched = 0; j < nl; j++) {
            int live = 0, early;

            from = (j ? lq[j - 1] : p) + 1;
            q = lq[j];
            for (w = 0, d = 0; w < words; w++) {
                d |= sup[w] & ~land[j * words + w];
                sup[w] &= land[j * words + w];
                live |= sup[w] != 0;
            }
            kind[j] = any_hole_at(ix, &fb[from - p - 1], q - from) ? SPAN_SPLIT
                      : d ? SPAN_SEARCH : SPAN_SKIP;
            if (q - from >= JUMP) {
                /* a long span to land in again (round 4), or, if every
                 * alive slot may hold q and few keys are listed, to
                 * read those keys only (split_long) */
                inner[j] = 0;
                if (kind[j] == SPAN_SPLIT && !d) {
                    nlisted[j] = 0;
                    for (i = from; i < q && nlisted[j] <= SPLIT_MAX; i++) {
                        if (fb_hit(ix, fb[i - p - 1])) {
                            if (nlisted[j] < SPLIT_MAX) {
                                listed[j][nlisted[j]] = i;
                            }
                            nlisted[j]++;
                        }
                    }
                    if (nlisted[j] <= SPLIT_MAX) {
                        kind[j] = SPAN_SPLIT_LONG;
                        for (i = 0; i < nlisted[j]; i++) {
                            prefetch_key(ix, norm_key(seq[listed[j][i]]));
                        }
                    }
                }
                for (i = from - 1 + JUMP;
                     kind[j] != SPAN_SKIP && kind[j] != SPAN_SPLIT_LONG && i < q; i += JUMP)
                {
                    prefetch_key(ix, norm_key(seq[i]));
                }
            } else {
                early = p == 0 && j == 0;       /* prefetched in round 1 */
                inner[j] = kind[j] == SPAN_SEARCH
                           && (early || fetched + (q - from) <= INNER_AHEAD);
                for (i = from; inner[j] && !early && i < q; i++) {
                    prefetch_key(ix, norm_key(seq[i]));
                }
                fetched += inner[j] && !early ? (uint32_t) (q - from) : 0;
                for (i = from; kind[j] == SPAN_SPLIT && i < q; i++) {
                    if (fb_hit(ix, fb[i - p - 1])) {
                        prefetch_key(ix, norm_key(seq[i]));     /* split_span reads these */
                    }
                }
            }
            if (!live) {
                nl = j + 1;         /* no slot outlives this span */
                break;
            }
        }
        /* round 3, only for short spans past the prefetch budget: their
         * quarter points, to prefetch inside the quarters */
        memcpy(sup, alive, words * sizeof(uint64_t));
        for (j = 0; j < nl; j++) {
            from = (j ? lq[j - 1] : p) + 1;
            q = lq[j];
            if (kind[j] == SPAN_SEARCH && !inner[j] && q - from < JUMP) {
                search_span(ix, seq, from - 1, q, &land[j * words], sup, words, out, cap,
                            found, 1);
            }
            for (w = 0; w < words; w++) {
                sup[w] &= land[j * words + w];
            }
        }
        /* round 4: in order, with the true alive set */
        for (j = 0; j < nl; j++) {
            from = (j ? lq[j - 1] : p) + 1;
            q = lq[j];
            for (w = 0, d = 0; w < words; w++) {
                d |= alive[w] & ~land[j * words + w];
            }
            if (q - from >= JUMP) {
                if (kind[j] == SPAN_SKIP || (kind[j] == SPAN_SEARCH && !d)) {
                    continue;       /* all alive hold from..q */
                }
                if (kind[j] == SPAN_SPLIT_LONG && !d
                    && split_long(ix, seq, from - 1, q, &fb[from - p - 1], listed[j], nlisted[j],
                                  alive, words))
                {
                    continue;       /* all alive hold from..q and every listed key */
                }
                if (!match_spans(ix, seq, from - 1, q, 0, alive, words, batch, out, cap,
                                 found))
                {
                    return 0;
                }
                continue;
            }
            if (kind[j] == SPAN_SPLIT) {
                if (!split_span(ix, seq, from - 1, q, &fb[from - p - 1], &land[j * words], alive,
                                words, out, cap, found))
                {
                    return 0;
                }
                continue;
            }
            if (!d) {
                continue;           /* all alive hold from..q */
            }
            if (search_span(ix, seq, from - 1, q, &land[j * words], alive, words, out,
                            cap, found, 0))
            {
                for (w = 0, d = 0; w < words; w++) {
                    d |= alive[w];
                }
                if (!d) {
                    return 0;
                }
                continue;
            }
            /* a hole listed meanwhile: walk */
            if (!walk_from(ix, seq, from, q, alive, words, out, cap, found)) {
                return 0;
            }
        }
    }
    return 1;
}

size_t kv_index_match(const kv_index_t *ix, const uint64_t *seq, size_t n,
                      kv_overlap_t *out, size_t cap)
{
    uint64_t alive[64], gen, reaps;
    uint32_t words = ix->words < 64 ? ix->words : 64, batch;
    size_t   found = 0;

    if (n <= 2 * JUMP) {
        return kv_index_match_walk(ix, seq, n, out, cap);
    }
    reaps = __atomic_load_n(&ix->rd.reaps, __ATOMIC_ACQUIRE);
    gen = __atomic_load_n(&ix->rd.gen, __ATOMIC_ACQUIRE);
    if (__atomic_load_n(&ix->rd.lost_slots, __ATOMIC_ACQUIRE) != 0) {
        return kv_index_match_walk(ix, seq, n, out, cap);
    }
    batch = JUMP_BATCH_WORDS / words < JUMP_BATCH ? JUMP_BATCH_WORDS / words : JUMP_BATCH;
    prefetch_key(ix, norm_key(seq[0]));
    if (match_spans(ix, seq, 0, n - 1, 1, alive, words, batch, out, cap, &found)) {
        step(alive, NULL, words, (uint32_t) n, out, cap, &found);
    }
    /* a slot lost or a hole dropped while it ran: the jump's premise may
     * not have held (bump_gen) */
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (__atomic_load_n(&ix->rd.gen, __ATOMIC_RELAXED) != gen) {
        return kv_index_match_walk(ix, seq, n, out, cap);
    }
    found = live_only(ix, out, found);
    return settled(ix, reaps) ? found : kv_index_match_walk(ix, seq, n, out, cap);
}

int kv_index_worker_info(const kv_index_t *ix, uint32_t slot, uint64_t *worker_id,
                         uint32_t *dp_rank)
{
    slot_t *s;

    if (slot >= ix->max_workers) {
        return -1;
    }
    s = &slots(ix)[slot];
    if (__atomic_load_n(&s->in_use, __ATOMIC_ACQUIRE) != SLOT_LIVE) {
        return -1;          /* free, or retired (kv_index_reap) */
    }
    *worker_id = __atomic_load_n(&s->worker_id, __ATOMIC_RELAXED);
    *dp_rank = __atomic_load_n(&s->dp_rank, __ATOMIC_RELAXED);
    return 0;
}

uint64_t kv_index_worker_blocks(const kv_index_t *ix, uint32_t slot)
{
    return slot < ix->max_workers ? __atomic_load_n(&slots(ix)[slot].blocks, __ATOMIC_SEQ_CST) : 0;
}

uint32_t kv_index_max_workers(const kv_index_t *ix)
{
    return ix->max_workers;
}

void kv_index_stats(const kv_index_t *ix, kv_index_stats_t *st)
{
    kv_index_t *m = (kv_index_t *) ix;

    st->blocks = __atomic_load_n(&m->live, __ATOMIC_SEQ_CST);
    st->capacity = (uint64_t) ((double) ix->cap * MAX_LOAD);
    if (st->capacity > ix->map_cap * 3 / 4 && ix->engine_hashes) {
        st->capacity = ix->map_cap * 3 / 4;     /* a mapping per block (map_make_room) */
    }
    st->bytes = ix->size;
    st->workers = __atomic_load_n(&m->workers, __ATOMIC_SEQ_CST);
    st->stored = __atomic_load_n(&m->stored, __ATOMIC_SEQ_CST);
    st->removed = __atomic_load_n(&m->removed, __ATOMIC_SEQ_CST);
    st->cleared = __atomic_load_n(&m->cleared, __ATOMIC_SEQ_CST);
    st->evicted = __atomic_load_n(&m->evicted, __ATOMIC_SEQ_CST);
    st->expired = __atomic_load_n(&m->expired, __ATOMIC_SEQ_CST);
    st->pruned = __atomic_load_n(&m->pruned, __ATOMIC_SEQ_CST);
    st->unknown_parent = __atomic_load_n(&m->unknown_parent, __ATOMIC_SEQ_CST);
    st->unknown_remove = __atomic_load_n(&m->unknown_remove, __ATOMIC_SEQ_CST);
    st->holes = __atomic_load_n(&m->hole_used, __ATOMIC_SEQ_CST);
    st->lost_slots = __atomic_load_n(&m->rd.lost_slots, __ATOMIC_SEQ_CST);
    st->ttl_ms = __atomic_load_n(&m->ttl_ms, __ATOMIC_RELAXED);
    st->writer_died = __atomic_load_n(&m->writer_died, __ATOMIC_RELAXED);
}
