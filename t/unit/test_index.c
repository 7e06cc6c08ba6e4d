/* Prefix index (kv_index.h): every operation, then the concurrency contract
 * with a reader process over a shared mapping while the writer mutates. */
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kv_hash.h"
#include "kv_index.h"
#include "kvtest.h"

static char err[256];

static kv_index_t *make(size_t size, const kv_index_config_t *cfg)
{
    void       *region = calloc(1, size);
    kv_index_t *ix = kv_index_create(region, size, cfg, err, sizeof(err));

    if (ix == NULL) {
        fprintf(stderr, "  create: %s\n", err);
        abort();
    }
    return ix;
}

/* tokens hashes t[i] = base + i; seq as the router computes it. */
static void chain(uint64_t base, size_t n, uint64_t *tok, uint64_t *seq)
{
    size_t i;

    for (i = 0; i < n; i++) {
        tok[i] = base + i;
        seq[i] = i == 0 ? tok[0] : kv_hash_chain(seq[i - 1], tok[i]);
    }
}

static int store(kv_index_t *ix, uint64_t worker, uint32_t dp, int has_parent,
                 uint64_t parent, const uint64_t *engine, const uint64_t *tok, size_t n)
{
    kv_stored_block_t b[512];
    kv_event_t        ev;
    size_t            i;

    for (i = 0; i < n; i++) {
        b[i].block_hash = engine[i];
        b[i].tokens_hash = tok[i];
    }
    memset(&ev, 0, sizeof(ev));
    ev.worker_id = worker;
    ev.dp_rank = dp;
    ev.kind = KV_EVENT_STORED;
    ev.has_parent = has_parent;
    ev.parent_hash = parent;
    ev.blocks = b;
    ev.n_blocks = n;
    return kv_index_apply(ix, &ev, 1000, err, sizeof(err));
}

static void remove_hashes(kv_index_t *ix, uint64_t worker, uint32_t dp, const uint64_t *h,
                          size_t n)
{
    kv_event_t ev;

    memset(&ev, 0, sizeof(ev));
    ev.worker_id = worker;
    ev.dp_rank = dp;
    ev.kind = KV_EVENT_REMOVED;
    ev.hashes = h;
    ev.n_hashes = n;
    kv_index_apply(ix, &ev, 1000, err, sizeof(err));
}

/* The overlap of one slot, 0 if it is not in the answer. */
static uint32_t overlap(kv_index_t *ix, int slot, const uint64_t *seq, size_t n)
{
    kv_overlap_t out[64];
    size_t       k, i;

    k = kv_index_match(ix, seq, n, out, 64);
    for (i = 0; i < k; i++) {
        if ((int) out[i].slot == slot) {
            return out[i].blocks;
        }
    }
    return 0;
}

TEST(stored_kvworker_style)
{
    kv_index_t *ix = make(1 << 20, NULL);
    uint64_t    tok[8], seq[8];
    int         s;

    chain(100, 8, tok, seq);
    /* kvworker: block_hash is the sequence hash itself */
    CHECK(store(ix, 7, 0, 0, 0, seq, tok, 4) == 0);
    CHECK(store(ix, 7, 0, 1, seq[3], seq + 4, tok + 4, 4) == 0);
    s = kv_index_worker_find(ix, 7, 0);
    CHECK(s >= 0);
    CHECK_EQ_U64(overlap(ix, s, seq, 8), 8);
    CHECK_EQ_U64(overlap(ix, s, seq, 5), 5);
    CHECK_EQ_U64(kv_index_worker_blocks(ix, (uint32_t) s), 8);
    /* storing the same blocks again changes nothing */
    CHECK(store(ix, 7, 0, 0, 0, seq, tok, 4) == 0);
    CHECK_EQ_U64(kv_index_worker_blocks(ix, (uint32_t) s), 8);
    remove_hashes(ix, 7, 0, seq + 6, 2);
    CHECK_EQ_U64(overlap(ix, s, seq, 8), 6);
    CHECK_EQ_U64(kv_index_worker_blocks(ix, (uint32_t) s), 6);
    free(ix);
}

TEST(stored_dynamo_style)
{
    kv_index_t      *ix = make(1 << 20, NULL);
    uint64_t         tok[8], seq[8], eng[8];
    kv_index_stats_t st;
    size_t           i;
    int              s;

    chain(500, 8, tok, seq);
    for (i = 0; i < 8; i++) {
        eng[i] = 0xE000000000000000ULL + i * 977;   /* opaque engine ids */
    }
    CHECK(store(ix, 9, 2, 0, 0, eng, tok, 3) == 0);
    /* the parent is named by its engine hash */
    CHECK(store(ix, 9, 2, 1, eng[2], eng + 3, tok + 3, 5) == 0);
    s = kv_index_worker_find(ix, 9, 2);
    CHECK(s >= 0);
    CHECK_EQ_U64(overlap(ix, s, seq, 8), 8);
    /* removal by engine hash, from the tail */
    remove_hashes(ix, 9, 2, eng + 5, 3);
    CHECK_EQ_U64(overlap(ix, s, seq, 8), 5);
    CHECK_EQ_U64(kv_index_worker_blocks(ix, (uint32_t) s), 5);
    /* a removed engine hash is forgotten: removing it again is unknown */
    remove_hashes(ix, 9, 2, eng + 7, 1);
    kv_index_stats(ix, &st);
    CHECK_EQ_U64(st.removed, 3);
    CHECK_EQ_U64(st.unknown_remove, 1);
    /* a removed block is not a valid parent any more */
    CHECK(store(ix, 9, 2, 1, eng[7], eng, tok, 1) == -1);
    free(ix);
}

/* More opaque engine hashes than the engine map holds: old ones are
 * forgotten (their removals count as unknown), nothing slows down or hangs,
 * and the counts stay coherent. */
TEST(engine_map_overflow)
{
    kv_index_config_t cfg = { .max_workers = 64 };
    kv_index_t       *ix = make(kv_index_min_size(&cfg), &cfg);
    kv_index_stats_t  st;
    uint64_t          tok[1], seq[1], eng;
    int               i, s;

    for (i = 0; i < 5000; i++) {
        chain((uint64_t) i * 1000 + 7, 1, tok, seq);
        eng = 0xABC0000000000000ULL + (uint64_t) i;
        CHECK(store(ix, 4, 0, 0, 0, &eng, tok, 1) == 0);
    }
    for (i = 0; i < 5000; i++) {
        eng = 0xABC0000000000000ULL + (uint64_t) i;
        remove_hashes(ix, 4, 0, &eng, 1);
    }
    kv_index_stats(ix, &st);
    CHECK_EQ_U64(st.removed + st.unknown_remove, 5000);
    CHECK(st.removed > 0);
    s = kv_index_worker_find(ix, 4, 0);
    CHECK_EQ_U64(kv_index_worker_blocks(ix, (uint32_t) s), st.blocks);
    kv_index_worker_clear(ix, 4);
    kv_index_stats(ix, &st);
    CHECK_EQ_U64(st.blocks, 0);
    free(ix);
}

/* vLLM-style engine hashes, more held than the engine map can keep (but
 * fewer than the index can): a chain the engine removed must not match
 * afterwards. The map used to forget a live mapping when full, so the
 * removal of that block was unknown and it stayed indexed for good. */
TEST(engine_map_full_forgets_consistently)
{
    kv_index_config_t cfg = { .max_workers = 16 };
    kv_index_t       *ix = make(kv_index_min_size(&cfg), &cfg);
    kv_index_stats_t  st;
    uint64_t          tok[40][32], seq[40][32], eng[40][32], h[32];
    int               c, i, s, stale = 0;

    kv_index_stats(ix, &st);
    CHECK(st.capacity >= 8 * 32);           /* the index could hold what the engine holds */
    for (c = 0; c < 40; c++) {
        chain((uint64_t) (c + 1) << 24, 32, tok[c], seq[c]);
        for (i = 0; i < 32; i++) {
            eng[c][i] = seq[c][i] ^ 0x5555aaaa5555aaaaULL;
        }
        {
            kv_stored_block_t b[32];
            kv_event_t        ev = { .worker_id = 3, .kind = KV_EVENT_STORED, .blocks = b,
                                     .n_blocks = 32 };

            for (i = 0; i < 32; i++) {
                b[i].block_hash = eng[c][i];
                b[i].tokens_hash = tok[c][i];
            }
            CHECK(kv_index_apply(ix, &ev, 1000 + (uint64_t) c, err, sizeof(err)) == 0);
        }
        if (c >= 8) {
            /* the engine keeps its newest 8 chains (256 blocks), freeing
             * the oldest tail first, as vLLM does */
            for (i = 0; i < 32; i++) {
                h[i] = eng[c - 8][31 - i];
            }
            remove_hashes(ix, 3, 0, h, 32);
        }
    }
    s = kv_index_worker_find(ix, 3, 0);
    for (c = 0; c < 32; c++) {
        stale += overlap(ix, s, seq[c], 32) > 0;
    }
    CHECK_EQ_U64(stale, 0);
    kv_index_stats(ix, &st);
    CHECK_EQ_U64(kv_index_worker_blocks(ix, (uint32_t) s), st.blocks);
    CHECK(st.blocks <= 8 * 32);
    /* the newest chain is held whole */
    CHECK_EQ_U64(overlap(ix, s, seq[39], 32), 32);
    free(ix);
}

/* A zone fed by engine hashes (vLLM over ZMQ) gets an engine map as big
 * as its entries: blocks up to the stated capacity stay indexed, none
 * evicted for want of a mapping (the map was a quarter to a half of the
 * entries, and a full map now evicts from the index). */
TEST(engine_hashes_size_the_map)
{
    kv_index_config_t cfg = { .max_workers = 16, .engine_hashes = 1 };
    kv_index_t       *ix = make(4 << 20, &cfg);
    kv_index_stats_t  st;
    uint64_t          tok[32], seq[32], n = 0;
    int               c = 0, i;

    kv_index_stats(ix, &st);
    while (n + 32 <= st.capacity * 9 / 10) {
        kv_stored_block_t b[32];
        kv_event_t        ev = { .worker_id = 3, .kind = KV_EVENT_STORED, .blocks = b,
                                 .n_blocks = 32 };

        chain((uint64_t) (++c) << 24, 32, tok, seq);
        for (i = 0; i < 32; i++) {
            b[i].block_hash = seq[i] ^ 0x5555aaaa5555aaaaULL;
            b[i].tokens_hash = tok[i];
        }
        CHECK(kv_index_apply(ix, &ev, 1000, err, sizeof(err)) == 0);
        n += 32;
    }
    kv_index_stats(ix, &st);
    CHECK(n > 10000);
    CHECK_EQ_U64(st.evicted, 0);
    CHECK_EQ_U64(st.blocks, n);
    free(ix);
}

TEST(unknown_parent_dropped_whole)
{
    kv_index_t      *ix = make(1 << 20, NULL);
    uint64_t         tok[4], seq[4];
    kv_index_stats_t st;
    int              s;

    chain(42, 4, tok, seq);
    CHECK(store(ix, 1, 0, 1, 123456789, seq, tok, 4) == -1);
    CHECK(strstr(err, "parent") != NULL);
    kv_index_stats(ix, &st);
    CHECK_EQ_U64(st.unknown_parent, 1);
    CHECK_EQ_U64(st.blocks, 0);
    s = kv_index_worker_find(ix, 1, 0);
    CHECK(s < 0 || kv_index_worker_blocks(ix, (uint32_t) s) == 0);
    /* a parent held by another worker does not count */
    CHECK(store(ix, 2, 0, 0, 0, seq, tok, 2) == 0);
    CHECK(store(ix, 1, 0, 1, seq[1], seq + 2, tok + 2, 2) == -1);
    CHECK_EQ_U64(kv_index_match(ix, seq + 2, 2, (kv_overlap_t[4]) { 0 }, 4), 0);
    free(ix);
}

TEST(cleared_all_dp_ranks)
{
    kv_index_t      *ix = make(1 << 20, NULL);
    uint64_t         tok[4], seq[4];
    kv_event_t       ev;
    kv_index_stats_t st;
    int              a, b, c;

    chain(7, 4, tok, seq);
    CHECK(store(ix, 5, 0, 0, 0, seq, tok, 4) == 0);
    CHECK(store(ix, 5, 1, 0, 0, seq, tok, 4) == 0);
    CHECK(store(ix, 6, 0, 0, 0, seq, tok, 2) == 0);
    a = kv_index_worker_find(ix, 5, 0);
    b = kv_index_worker_find(ix, 5, 1);
    c = kv_index_worker_find(ix, 6, 0);
    CHECK(a >= 0 && b >= 0 && c >= 0 && a != b);
    memset(&ev, 0, sizeof(ev));
    ev.worker_id = 5;
    ev.kind = KV_EVENT_CLEARED;
    CHECK(kv_index_apply(ix, &ev, 1000, err, sizeof(err)) == 0);
    CHECK_EQ_U64(overlap(ix, a, seq, 4), 0);
    CHECK_EQ_U64(overlap(ix, b, seq, 4), 0);
    CHECK_EQ_U64(overlap(ix, c, seq, 4), 2);
    CHECK_EQ_U64(kv_index_worker_blocks(ix, (uint32_t) a), 0);
    CHECK_EQ_U64(kv_index_worker_blocks(ix, (uint32_t) b), 0);
    CHECK_EQ_U64(kv_index_worker_blocks(ix, (uint32_t) c), 2);
    /* slots stay */
    CHECK(kv_index_worker_find(ix, 5, 1) == b);
    kv_index_stats(ix, &st);
    CHECK_EQ_U64(st.blocks, 2);
    CHECK_EQ_U64(st.cleared, 1);
    free(ix);
}

TEST(worker_remove_frees_slot)
{
    kv_index_t      *ix = make(1 << 20, NULL);
    uint64_t         tok[4], seq[4], wid;
    uint32_t         dp;
    kv_index_stats_t st;
    int              a, b;

    chain(9, 4, tok, seq);
    CHECK(store(ix, 11, 3, 0, 0, seq, tok, 4) == 0);
    a = kv_index_worker_find(ix, 11, 3);
    CHECK(kv_index_worker_info(ix, (uint32_t) a, &wid, &dp) == 0);
    CHECK_EQ_U64(wid, 11);
    CHECK_EQ_U64(dp, 3);
    kv_index_worker_remove(ix, 11);
    CHECK(kv_index_worker_find(ix, 11, 3) < 0);
    CHECK(kv_index_worker_info(ix, (uint32_t) a, &wid, &dp) == -1);
    CHECK_EQ_U64(kv_index_match(ix, seq, 4, (kv_overlap_t[4]) { 0 }, 4), 0);
    /* the blocks go with the next reap (one pass for every removed slot) */
    CHECK_EQ_U64(kv_index_reap(ix), 1);
    CHECK_EQ_U64(kv_index_reap(ix), 0);
    kv_index_stats(ix, &st);
    CHECK_EQ_U64(st.blocks, 0);
    CHECK_EQ_U64(st.workers, 0);
    /* the slot is reused, empty */
    b = kv_index_worker_add(ix, 12, 0);
    CHECK(b == a);
    CHECK_EQ_U64(kv_index_worker_blocks(ix, (uint32_t) b), 0);
    free(ix);
}

/* Readers keep their own slot maps from the change log: each add and
 * removal is logged with its slot, in order; a reader too far behind (or
 * asking for fewer than changed) is told to read every slot. */
TEST(slot_changes_logged)
{
    kv_index_t *ix = make(1 << 20, NULL);
    uint64_t    since = 0, behind;
    uint32_t    out[64];
    int         a, b, c, n, i;

    CHECK(kv_index_slots_changed(ix, &since, out, 64) == 0);
    a = kv_index_worker_add(ix, 21, 0);
    b = kv_index_worker_add(ix, 22, 0);
    CHECK(kv_index_worker_add(ix, 21, 0) == a);         /* not a change */
    n = kv_index_slots_changed(ix, &since, out, 64);
    CHECK(n == 2);
    CHECK(out[0] == (uint32_t) a && out[1] == (uint32_t) b);
    CHECK(kv_index_slots_changed(ix, &since, out, 64) == 0);

    kv_index_worker_remove(ix, 21);
    kv_index_reap(ix);
    c = kv_index_worker_add(ix, 23, 0);                 /* a's slot again */
    CHECK(c == a);
    behind = since;
    CHECK(kv_index_slots_changed(ix, &behind, out, 1) == -1);   /* cap */
    n = kv_index_slots_changed(ix, &since, out, 64);
    CHECK(n == 2);
    CHECK(out[0] == (uint32_t) a && out[1] == (uint32_t) a);
    CHECK_EQ_U64(behind, since);

    /* 64 changes: the oldest may be overwritten, read every slot */
    behind = since;
    for (i = 0; i < 32; i++) {
        kv_index_worker_add(ix, 100 + (uint64_t) i, 0);
        kv_index_worker_remove(ix, 100 + (uint64_t) i);
        kv_index_reap(ix);
    }
    CHECK(kv_index_slots_changed(ix, &behind, out, 64) == -1);
    CHECK(kv_index_slots_changed(ix, &behind, out, 64) == 0);
    free(ix);
}

/* kv_index_worker_find keeps a per-thread hint of each worker's slot: it
 * must never answer from a stale hint (the worker gone, its slot reused),
 * nor mix up two indexes holding the same worker ids, at any fleet size. */
TEST(worker_find_hints_stay_right)
{
    kv_index_config_t cfg = { .max_workers = 4096 };
    kv_index_t       *a = make(kv_index_min_size(&cfg), &cfg);
    kv_index_t       *b = make(1 << 20, NULL);
    uint64_t          wid;
    uint32_t          dp, w;
    int               at, bad = 0;

    /* the same ids at other slots in b */
    CHECK(kv_index_worker_add(b, 999, 0) == 0);
    for (w = 1; w <= 3000; w++) {
        CHECK(kv_index_worker_add(a, w, 0) == (int) w - 1);
    }
    CHECK(kv_index_worker_add(b, 7, 0) == 1);
    for (int round = 0; round < 2; round++) {           /* cold, then hinted */
        for (w = 1; w <= 3000; w++) {
            bad += kv_index_worker_find(a, w, 0) != (int) w - 1;
            bad += kv_index_worker_find(a, w, 1) != -1;
        }
        CHECK(kv_index_worker_find(b, 7, 0) == 1);
        CHECK(kv_index_worker_find(b, 8, 0) == -1);
    }
    CHECK(bad == 0);
    /* worker 10 leaves, worker 5000 takes its slot: no answer from the hint */
    at = kv_index_worker_find(a, 10, 0);
    kv_index_worker_remove(a, 10);
    CHECK(kv_index_worker_find(a, 10, 0) == -1);
    kv_index_reap(a);
    CHECK(kv_index_worker_add(a, 5000, 0) == at);
    CHECK(kv_index_worker_find(a, 10, 0) == -1);
    CHECK(kv_index_worker_find(a, 5000, 0) == at);
    CHECK(kv_index_worker_info(a, (uint32_t) at, &wid, &dp) == 0 && wid == 5000);
    /* and 10 comes back elsewhere */
    at = kv_index_worker_add(a, 10, 0);
    CHECK(at == 3000);
    CHECK(kv_index_worker_find(a, 10, 0) == at);
    free(a);
    free(b);
}

TEST(worker_slots_run_out)
{
    kv_index_config_t cfg = { .max_workers = 2 };
    kv_index_t       *ix = make(kv_index_min_size(&cfg), &cfg);
    uint64_t          tok[1], seq[1];

    chain(1, 1, tok, seq);
    /* laid out: 2 + 16 spare (for retired slots), rounded up to a word */
    CHECK_EQ_U64(kv_index_max_workers(ix), 64);
    for (uint64_t w = 1; w <= 64; w++)
        CHECK(store(ix, w, 0, 0, 0, seq, tok, 1) == 0);
    CHECK(store(ix, 65, 0, 0, 0, seq, tok, 1) == -1);
    CHECK(strstr(err, "slot") != NULL);
    free(ix);
}

TEST(match_leading_run_per_worker)
{
    kv_index_t  *ix = make(1 << 20, NULL);
    uint64_t     seq[10] = { 11, 12, 13, 14, 15, 16, 17, 18, 19, 20 };
    kv_overlap_t out[8];
    size_t       k, i;
    int          a, b, c;

    a = kv_index_worker_add(ix, 1, 0);
    b = kv_index_worker_add(ix, 2, 0);
    c = kv_index_worker_add(ix, 3, 0);
    kv_index_record(ix, (uint32_t) a, seq, 10, 1000);
    kv_index_record(ix, (uint32_t) b, seq, 5, 1000);
    kv_index_record(ix, (uint32_t) c, seq, 3, 1000);
    kv_index_record(ix, (uint32_t) c, seq + 5, 5, 1000);   /* a hole at 3, 4 */
    k = kv_index_match(ix, seq, 10, out, 8);
    CHECK_EQ_U64(k, 3);
    for (i = 0; i < k; i++) {
        uint32_t want = (int) out[i].slot == a ? 10 : (int) out[i].slot == b ? 5 : 3;

        CHECK_EQ_U64(out[i].blocks, want);
    }
    /* a request whose first block nobody holds */
    CHECK_EQ_U64(kv_index_match(ix, seq + 3, 7, out, 8), 2);
    CHECK_EQ_U64(kv_index_match(ix, (uint64_t[1]) { 999 }, 1, out, 8), 0);
    CHECK_EQ_U64(kv_index_match(ix, seq, 0, out, 8), 0);
    /* cap bounds the answer */
    CHECK_EQ_U64(kv_index_match(ix, seq, 10, out, 1), 1);
    free(ix);
}

/* Once no worker holds block i, match stops: it may read 512 more hashes
 * (one batch of landings, prefetched before the first block is read;
 * kv_index.h; 16 for the walk), no further; the rest of the request lies on
 * a page that faults. */
TEST(match_exits_early)
{
    kv_index_t  *ix = make(1 << 20, NULL);
    long         pg = sysconf(_SC_PAGESIZE);
    size_t       len = 2 * (size_t) pg + 4096;
    char        *mem = mmap(NULL, len, PROT_READ | PROT_WRITE,
                            MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    uint64_t    *seq = (uint64_t *) (void *) (mem + len - pg) - 516;
    kv_overlap_t out[4];
    int          a;

    CHECK(mem != MAP_FAILED);
    for (int i = 0; i < 516; i++) {
        seq[i] = i ? kv_hash_chain(seq[i - 1], (uint64_t) i) : 50;
    }
    CHECK(mprotect(mem + len - pg, pg, PROT_NONE) == 0);
    a = kv_index_worker_add(ix, 1, 0);
    kv_index_record_at(ix, (uint32_t) a, seq, 0, 3, 1000);
    CHECK_EQ_U64(kv_index_match(ix, seq, 4096, out, 4), 1);
    CHECK_EQ_U64(out[0].blocks, 3);
    CHECK_EQ_U64(kv_index_match_walk(ix, seq + 496, 208, out, 4), 0);
    munmap(mem, len);
    free(ix);
}

TEST(eviction_when_full)
{
    kv_index_config_t cfg = { .max_workers = 64 };
    kv_index_t       *ix = make(kv_index_min_size(&cfg), &cfg);
    kv_index_stats_t  st;
    uint64_t          tok[16], seq[16];
    int               i, s;

    kv_index_stats(ix, &st);
    CHECK(st.capacity >= 512);
    for (i = 0; i < 400; i++) {
        chain((uint64_t) i << 20, 16, tok, seq);
        CHECK(store(ix, 1, 0, 0, 0, seq, tok, 16) == 0);
    }
    kv_index_stats(ix, &st);
    CHECK(st.evicted > 0);
    CHECK(st.blocks <= st.capacity);
    CHECK_EQ_U64(st.blocks + st.evicted, 400 * 16);
    s = kv_index_worker_find(ix, 1, 0);
    CHECK_EQ_U64(kv_index_worker_blocks(ix, (uint32_t) s), st.blocks);
    /* the latest chain is the most recently touched: it survives whole */
    CHECK_EQ_U64(overlap(ix, s, seq, 16), 16);
    free(ix);
}

/* A removed worker's slot is retired with a block count of 0 while its
 * entries wait for the reap: evicting them meanwhile must not count it
 * below zero (it wrapped to ~2^64). */
TEST(eviction_of_retired_slot_keeps_count)
{
    kv_index_config_t cfg = { .max_workers = 64 };
    kv_index_t       *ix = make(kv_index_min_size(&cfg), &cfg);
    kv_index_stats_t  st;
    uint64_t          tok[16], seq[16];
    int               i, s;

    chain(1 << 20, 16, tok, seq);
    CHECK(store(ix, 1, 0, 0, 0, seq, tok, 16) == 0);
    s = kv_index_worker_find(ix, 1, 0);
    kv_index_worker_remove(ix, 1);
    for (i = 2; i < 400; i++) {
        chain((uint64_t) i << 20, 16, tok, seq);
        CHECK(store(ix, 2, 0, 0, 0, seq, tok, 16) == 0);
    }
    kv_index_stats(ix, &st);
    CHECK(st.evicted > 16);
    CHECK_EQ_U64(kv_index_worker_blocks(ix, (uint32_t) s), 0);
    free(ix);
}

TEST(approximate_ttl_expire)
{
    kv_index_config_t cfg = { .approximate = 1, .ttl_ms = 1000 };
    kv_index_t       *ix = make(1 << 20, &cfg);
    kv_index_stats_t  st;
    uint64_t          seq[4] = { 21, 22, 23, 24 };
    int               a = kv_index_worker_add(ix, 1, 0);

    kv_index_record(ix, (uint32_t) a, seq, 2, 10000);
    kv_index_record(ix, (uint32_t) a, seq + 2, 2, 10800);
    CHECK_EQ_U64(overlap(ix, a, seq, 4), 4);
    kv_index_expire(ix, 10500);                 /* nothing old enough */
    CHECK_EQ_U64(overlap(ix, a, seq, 4), 4);
    kv_index_expire(ix, 11500);                 /* the first two are */
    kv_index_stats(ix, &st);
    CHECK_EQ_U64(st.expired, 2);
    CHECK_EQ_U64(overlap(ix, a, seq, 4), 0);
    CHECK_EQ_U64(overlap(ix, a, seq + 2, 2), 2);
    kv_index_expire(ix, 20000);
    kv_index_stats(ix, &st);
    CHECK_EQ_U64(st.blocks, 0);
    CHECK_EQ_U64(kv_index_worker_blocks(ix, (uint32_t) a), 0);
    free(ix);
}

/* the learned memory (kv_retain.h): a shorter TTL set at run time expires
 * what the configured one kept; ages are the last record's */
TEST(approximate_ttl_set_and_ages)
{
    kv_index_config_t cfg = { .approximate = 1, .ttl_ms = 120000 };
    kv_index_t       *ix = make(1 << 20, &cfg);
    uint64_t          seq[4] = { 31, 32, 33, 34 };
    int               a = kv_index_worker_add(ix, 1, 0);

    kv_index_record(ix, (uint32_t) a, seq, 4, 10000);
    kv_index_record(ix, (uint32_t) a, seq, 2, 14000);
    CHECK(kv_index_age(ix, 31, 15000) == 1000);
    CHECK(kv_index_age(ix, 34, 15000) == 5000);
    CHECK(kv_index_age(ix, 35, 15000) == -1);
    /* recorded by a process whose clock is a few ms ahead: fresh, not 49 days */
    CHECK(kv_index_age(ix, 31, 13995) == 0);
    kv_index_expire(ix, 15000);
    CHECK_EQ_U64(overlap(ix, a, seq, 4), 4);
    CHECK_EQ_U64(kv_index_ttl(ix), 120000);
    kv_index_set_ttl(ix, 3000);
    CHECK_EQ_U64(kv_index_ttl(ix), 3000);
    kv_index_expire(ix, 15500);                 /* within a second: no sweep */
    CHECK_EQ_U64(overlap(ix, a, seq, 4), 4);
    kv_index_expire(ix, 16000);
    CHECK_EQ_U64(overlap(ix, a, seq, 4), 2);
    free(ix);
}

TEST(approximate_prune_to_ratio)
{
    kv_index_config_t cfg = { .approximate = 1, .max_blocks = 100, .prune_ratio = 0.8 };
    kv_index_t       *ix = make(1 << 20, &cfg);
    kv_index_stats_t  st;
    uint64_t          seq[150];
    int               a = kv_index_worker_add(ix, 1, 0), i;

    for (i = 0; i < 150; i++) {
        seq[i] = 1000 + (uint64_t) i;
    }
    kv_index_record(ix, (uint32_t) a, seq, 100, 5000);
    kv_index_stats(ix, &st);
    CHECK_EQ_U64(st.blocks, 100);               /* at the cap: no prune yet */
    kv_index_record(ix, (uint32_t) a, seq + 100, 50, 6000);
    kv_index_stats(ix, &st);
    /* to the ratio: a block goes with the chain below it, so a little under */
    CHECK(st.blocks <= 80 && st.blocks >= 70);
    CHECK_EQ_U64(st.pruned, 150 - st.blocks);
    /* the older ones went first, and what is left of them is their prefix
     * (what a match can use), not blocks scattered along the chain */
    CHECK_EQ_U64(overlap(ix, a, seq + 100, 50), 50);
    CHECK_EQ_U64(overlap(ix, a, seq, 100), st.blocks - 50);
    free(ix);
}

TEST(open_on_reuse)
{
    size_t      size = 1 << 20;
    void       *region = calloc(1, size);
    kv_index_t *ix = kv_index_create(region, size, NULL, err, sizeof(err)), *again;
    uint64_t    tok[4], seq[4];
    int         s;

    chain(77, 4, tok, seq);
    CHECK(store(ix, 3, 0, 0, 0, seq, tok, 4) == 0);
    s = kv_index_worker_find(ix, 3, 0);
    again = kv_index_open(region, size);
    CHECK(again == ix);
    CHECK_EQ_U64(overlap(again, s, seq, 4), 4);
    CHECK(kv_index_open(region, size / 2) == NULL);
    memset(region, 0xA5, 64);
    CHECK(kv_index_open(region, size) == NULL);
    CHECK(kv_index_create(region, 1024, NULL, err, sizeof(err)) == NULL);
    CHECK(strstr(err, "minimum") != NULL);
    free(region);
}

/* --- concurrency ----------------------------------------------------------
 *
 * The writer stores whole chains for a worker (one event, no parent) and
 * removes them from the tail; a small region makes it evict too. Before a
 * chain is first stored for a worker it sets that bit in `ever` (shared).
 * The reader matches chain prefixes followed by blocks no one ever holds
 * and checks: each slot at most once, a known slot, overlap <= the chain
 * prefix asked, and overlap > 0 only for a (chain, worker) ever stored.
 */
#define CW        8         /* workers */
#define CCHAINS   256
#define CLEN      200       /* over 128: the reader takes the jump path, its long spans too */

typedef struct {
    _Atomic int         done;
    _Atomic uint32_t    ever[CCHAINS];  /* bit w: chain stored for worker w */
    _Atomic uint64_t    live_reads;     /* the reader's progress, while it runs */
    uint64_t            reads, bad;
} shared_t;

/* The writer's work: counts, not seconds, so a slow or busy machine runs
 * the same test (the deadline only ends a reader that never reads). */
#define WRITER_MIN_OPS    20000
#define WRITER_MIN_READS  20000
#define WRITER_DEADLINE_S 120

static void chain_seq(int c, uint64_t *tok, uint64_t *seq)
{
    chain(((uint64_t) c + 1) << 32, CLEN, tok, seq);
}

static int reader(kv_index_t *ix, shared_t *sh)
{
    uint64_t     tok[CLEN], seq[CLEN + 4];
    kv_overlap_t out[CW * 2];
    unsigned     r = 12345;
    size_t       k, i, j, m;
    uint64_t     bad = 0, reads = 0;

    while (!sh->done) {
        int      c = (int) ((r = r * 1103515245 + 12345) >> 8) % CCHAINS;
        uint32_t ever;

        chain_seq(c, tok, seq);
        m = 1 + (r >> 4) % CLEN;
        for (i = m; i < m + 4; i++) {
            seq[i] = 0xdead0000ULL + i;          /* never stored */
        }
        k = kv_index_match(ix, seq, m + 4, out, CW * 2);
        ever = atomic_load_explicit(&sh->ever[c], memory_order_acquire);
        for (i = 0; i < k; i++) {
            uint64_t wid;
            uint32_t dp;

            if (out[i].blocks == 0 || out[i].blocks > m || out[i].slot >= CW
                || !(ever >> out[i].slot & 1)
                || kv_index_worker_info(ix, out[i].slot, &wid, &dp) != 0 || wid != out[i].slot)
            {
                bad++;
            }
            for (j = 0; j < i; j++) {
                bad += out[j].slot == out[i].slot;
            }
        }
        reads++;
        atomic_store_explicit(&sh->live_reads, reads, memory_order_relaxed);
    }
    sh->reads = reads;
    sh->bad = bad;
    return bad != 0;
}

static void writer(kv_index_t *ix, shared_t *sh)
{
    static uint8_t held[CCHAINS][CW];           /* blocks stored, per chain and worker */
    uint64_t       tok[CLEN], seq[CLEN], now = 1;
    unsigned       r = 777;
    struct timespec t0, t;
    int            w;

    for (w = 0; w < CW; w++) {
        kv_index_worker_add(ix, (uint64_t) w, 0);    /* slot == worker id */
    }
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        int c = (int) ((r = r * 1103515245 + 12345) >> 8) % CCHAINS;

        w = (int) (r >> 3) % CW;
        chain_seq(c, tok, seq);
        if (held[c][w] == 0) {
            atomic_fetch_or_explicit(&sh->ever[c], 1u << w, memory_order_release);
            store(ix, (uint64_t) w, 0, 0, 0, seq, tok, CLEN);
            held[c][w] = CLEN;
        } else {
            int cut = (int) (r >> 12) % held[c][w];

            if ((r >> 20) % 4 == 0) {
                /* one block from the middle: a hole, the rest stays held */
                remove_hashes(ix, (uint64_t) w, 0, &seq[cut], 1);
                held[c][w] = (uint8_t) cut;
                continue;
            }
            /* tail first, as engines evict */
            for (int i = held[c][w] - 1; i >= cut; i--) {
                remove_hashes(ix, (uint64_t) w, 0, &seq[i], 1);
            }
            held[c][w] = (uint8_t) cut;
        }
        if ((now++ & 255) == 0 && now > WRITER_MIN_OPS) {
            kv_index_stats_t st;

            kv_index_stats(ix, &st);
            if (st.evicted > 0
                && atomic_load_explicit(&sh->live_reads, memory_order_relaxed) >= WRITER_MIN_READS)
            {
                break;
            }
            clock_gettime(CLOCK_MONOTONIC, &t);
            if (t.tv_sec - t0.tv_sec > WRITER_DEADLINE_S) {
                break;          /* the checks below fail and say why */
            }
        }
    }
}

#ifdef KVT_THREADS
/* Built by hand with -DKVT_THREADS -fsanitize=thread (docs/BENCHMARKS.md):
 * the same reader as a thread, so ThreadSanitizer sees both sides. */
#include <pthread.h>

static kv_index_t *t_ix;
static shared_t   *t_sh;

static void *reader_thread(void *arg)
{
    return (void *) (intptr_t) reader(t_ix, t_sh);
}
#endif

TEST(concurrent_reader_sees_consistent_overlaps)
{
    kv_index_config_t cfg = { .max_workers = 64 };
    size_t            size = kv_index_min_size(&cfg) * 4;
    char             *mem = mmap(NULL, size + 4096, PROT_READ | PROT_WRITE,
                                 MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    shared_t         *sh = (shared_t *) (void *) mem;
    kv_index_t       *ix;
    kv_index_stats_t  st;
    pid_t             pid;
    int               status = -1, i;

    CHECK(mem != MAP_FAILED);
    ix = kv_index_create(mem + 4096, size, &cfg, err, sizeof(err));
    CHECK(ix != NULL);
#ifdef KVT_THREADS
    {
        pthread_t th;
        void     *rc;

        t_ix = ix;
        t_sh = sh;
        pthread_create(&th, NULL, reader_thread, NULL);
        writer(ix, sh);
        sh->done = 1;
        pthread_join(th, &rc);
        status = rc == NULL ? 0 : 1 << 8;
        pid = 0;
        (void) pid;
        (void) i;
    }
#else
    pid = fork();
    if (pid == 0) {
        alarm(WRITER_DEADLINE_S + 60);          /* a hung reader fails the test */
        _exit(reader(ix, sh));
    }
    writer(ix, sh);
    sh->done = 1;
    for (i = 0; i < 1200 && waitpid(pid, &status, WNOHANG) == 0; i++) {
        usleep(50000);          /* polls the reader's exit, for up to 60 s */
    }
    if (i == 1200) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
    }
#endif
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    kv_index_stats(ix, &st);
    printf("  reader: %llu matches, %llu inconsistent; writer: %llu stored, %llu evicted\n",
           (unsigned long long) sh->reads, (unsigned long long) sh->bad,
           (unsigned long long) st.stored, (unsigned long long) st.evicted);
    CHECK(sh->reads > 0);
    CHECK(st.evicted > 0);
    munmap(mem, size + 4096);
}


/* --- the jump match against the walk (kv_index_match vs _match_walk) ---- */

#define D_DOCS  48
#define D_LEN   150

typedef struct {
    uint64_t    tok[D_DOCS][D_LEN];
    uint64_t    seq[D_DOCS][D_LEN];
    uint64_t    rng;
} docs_t;

static uint64_t d_rnd_u(uint64_t *rng)
{
    *rng ^= *rng << 13;
    *rng ^= *rng >> 7;
    *rng ^= *rng << 17;
    return *rng;
}

static uint64_t d_rnd(docs_t *d)
{
    return d_rnd_u(&d->rng);
}

/* Documents that share prefixes with earlier ones and branch at random
 * points; tokens from a tiny alphabet, so chains also meet again in
 * places, and roots 0..3 (keys 0 and 1 share an index key with 2 and 3). */
static void d_make(docs_t *d)
{
    int i, k, from, src;

    for (i = 0; i < D_DOCS; i++) {
        src = i ? (int) (d_rnd(d) % (uint64_t) i) : 0;
        from = i ? (int) (d_rnd(d) % D_LEN) : 0;
        for (k = 0; k < D_LEN; k++) {
            d->tok[i][k] = k < from ? d->tok[src][k] : d_rnd(d) % 4;
            d->seq[i][k] = k == 0 ? d->tok[i][0] : kv_hash_chain(d->seq[i][k - 1], d->tok[i][k]);
        }
    }
}

/* One query: both matches must give the same slots, blocks and order. */
static int d_same(kv_index_t *ix, const uint64_t *seq, size_t n, size_t cap)
{
    kv_overlap_t a[128], b[128];
    size_t       na, nb, i;

    na = kv_index_match(ix, seq, n, a, cap);
    nb = kv_index_match_walk(ix, seq, n, b, cap);
    if (na != nb) {
        fprintf(stderr, "  n %zu cap %zu: jump %zu entries, walk %zu\n", n, cap, na, nb);
        return 0;
    }
    for (i = 0; i < na; i++) {
        if (a[i].slot != b[i].slot || a[i].blocks != b[i].blocks) {
            fprintf(stderr, "  n %zu: entry %zu: jump slot %u blocks %u, walk slot %u blocks %u\n",
                    n, i, a[i].slot, a[i].blocks, b[i].slot, b[i].blocks);
            return 0;
        }
    }
    return 1;
}

/* Random stores (whole chains and continuations), removals anywhere in a
 * chain (holes), forgets, records with and without a known parent, worker
 * clears and removals, evictions in a small table, expiry; after each
 * step, queries of every kind compared with the walk. */
static void d_run(uint64_t seed, size_t size, uint32_t max_workers, int approximate,
                  int steps, uint64_t *checked, uint64_t *holes_seen, uint64_t *evicted,
                  uint64_t *jumped)
{
    kv_index_config_t cfg = { .max_workers = max_workers, .approximate = approximate,
                              .ttl_ms = 50, .max_blocks = 1 << 20 };
    kv_index_t       *ix = make(size ? size : kv_index_min_size(&cfg), &cfg);
    docs_t           *d = calloc(1, sizeof(*d));
    kv_index_stats_t  st;
    uint64_t          now = 1000, q[D_LEN], nw = max_workers < 90 ? max_workers : 90;
    int               step, k, bad = 0;

    d->rng = seed;
    d_make(d);
    for (step = 0; step < steps && !bad; step++) {
        uint64_t w = 1 + d_rnd(d) % nw, r = d_rnd(d) % 100;
        int      doc = (int) (d_rnd(d) % D_DOCS), from, len, slot;

        from = (int) (d_rnd(d) % D_LEN);
        len = 1 + (int) (d_rnd(d) % (D_LEN - from));
        now += d_rnd(d) % 3;
        if (r < 40) {
            /* a store continuing wherever (dropped if the parent is not held) */
            if (d_rnd(d) % 4 == 0) {
                from = 0;
            }
            store(ix, w, 0, from > 0, from > 0 ? d->seq[doc][from - 1] : 0,
                  &d->seq[doc][from], &d->tok[doc][from], (size_t) len);
        } else if (r < 62) {
            /* removals anywhere: one block, a run, or scattered blocks */
            uint64_t h[8];
            int      m = 1 + (int) (d_rnd(d) % 8);

            for (k = 0; k < m; k++) {
                h[k] = d->seq[doc][r % 2 ? (from + k) % D_LEN : (int) (d_rnd(d) % D_LEN)];
            }
            remove_hashes(ix, w, 0, h, (size_t) m);
        } else if (r < 77) {
            slot = kv_index_worker_add(ix, w, 0);
            if (slot >= 0) {
                kv_index_record_at(ix, (uint32_t) slot, d->seq[doc], (size_t) from,
                                   (size_t) (from + len), now);
            }
        } else if (r < 85) {
            slot = kv_index_worker_find(ix, w, 0);
            if (slot >= 0) {
                kv_index_forget(ix, (uint32_t) slot, &d->seq[doc][from], (size_t) len);
            }
        } else if (r < 87) {
            /* the old record late in a run: seq[0]'s parent unknown, the slot
             * may go lost (matches walk until it is cleared) */
            slot = kv_index_worker_add(ix, w, 0);
            if (slot >= 0 && step > steps * 3 / 4) {
                kv_index_record(ix, (uint32_t) slot, &d->seq[doc][from], (size_t) len, now);
            }
        } else if (r < 89) {
            kv_event_t ev = { .worker_id = w, .kind = KV_EVENT_CLEARED };

            kv_index_apply(ix, &ev, now, err, sizeof(err));
        } else if (r < 91) {
            kv_index_worker_remove(ix, w);
            if (d_rnd(d) % 2) {
                kv_index_reap(ix);
            }
        } else if (r < 93) {
            now += approximate ? 30 : 0;
            kv_index_expire(ix, now);
        } else {
            /* a burst: one worker stores a whole document */
            store(ix, w, 0, 0, 0, d->seq[doc], d->tok[doc], D_LEN);
        }
        kv_index_stats(ix, &st);
        *holes_seen += st.holes > 0;
        *jumped += st.lost_slots == 0;
        for (k = 0; k < 6 && !bad; k++) {
            int    dd = (int) (d_rnd(d) % D_DOCS), n = 1 + (int) (d_rnd(d) % D_LEN), j, cut;
            size_t cap = 1 + d_rnd(d) % 70;

            if (k == 0) {
                n = D_LEN;
            }
            if (!d_same(ix, d->seq[dd], (size_t) n, cap)) {
                bad = 1;
                break;
            }
            /* the same document diverging at a random block */
            memcpy(q, d->seq[dd], sizeof(q));
            cut = (int) (d_rnd(d) % D_LEN);
            for (j = cut; j < D_LEN; j++) {
                q[j] = kv_hash_chain(j ? q[j - 1] : 7, 1000 + d_rnd(d) % 2);
            }
            if (!d_same(ix, q, D_LEN, 128)) {
                bad = 1;
            }
            *checked += 2;
        }
    }
    if (bad) {
        fprintf(stderr, "  seed %llu size %zu workers %u approximate %d: differs at step %d\n",
                (unsigned long long) seed, size, max_workers, approximate, step);
    }
    CHECK(!bad);
    kv_index_stats(ix, &st);
    *evicted += st.evicted + st.pruned + st.expired;
    free(d);
    free(ix);
}

TEST(match_jump_equals_walk_randomized)
{
    uint64_t checked = 0, holes = 0, evicted = 0, jumped = 0, seed;

    for (seed = 1; seed <= 6; seed++) {
        d_run(seed, 8u << 20, 16, 0, 1500, &checked, &holes, &evicted, &jumped);   /* no eviction */
        d_run(seed * 77, 0, 16, 0, 1500, &checked, &holes, &evicted, &jumped);     /* smallest: evicts */
        d_run(seed * 131, 8u << 20, 100, 0, 800, &checked, &holes, &evicted, &jumped); /* 2 words, aliased kids */
        d_run(seed * 997, 0, 8, 1, 1500, &checked, &holes, &evicted, &jumped);     /* approximate, TTL */
    }
    printf("  %llu queries compared, %llu steps with holes listed, %llu with no slot lost "
           "(jumps taken), %llu blocks evicted/expired\n",
           (unsigned long long) checked, (unsigned long long) holes,
           (unsigned long long) jumped, (unsigned long long) evicted);
    CHECK(holes > 0);
    CHECK(jumped > 1000);
    CHECK(evicted > 0);
}

/* Entries are 32 bytes up to 128 slots, 40 (straddling cache lines) for
 * 129-192 and padded to 64 for 257-384, with the writer's kids words in a
 * side array moved along with them: the jump against the walk for each
 * size, in a table that evicts and one that does not. */
TEST(match_jump_equals_walk_every_entry_size)
{
    static const uint32_t workers[3] = { 40, 150, 300 };
    uint64_t checked = 0, holes = 0, evicted = 0, jumped = 0;
    int      c;

    for (c = 0; c < 3; c++) {
        d_run(4242 + c, 8u << 20, workers[c], 0, 600, &checked, &holes, &evicted, &jumped);
        d_run(5353 + c, 0, workers[c], 0, 600, &checked, &holes, &evicted, &jumped);
    }
    printf("  %llu queries compared, %llu blocks evicted\n", (unsigned long long) checked,
           (unsigned long long) evicted);
    CHECK(holes > 0);
    CHECK(evicted > 0);
}

/* Requests longer than one batch of landings (512 blocks; 256 with 4,096
 * slots, whose bitmaps fill the batch sooner), workers holding prefixes
 * that end anywhere, holes, clears: the jump (landings, quarter search,
 * walked spans) against the walk. */
TEST(match_jump_long_requests_equal_walk)
{
    static const uint32_t workers[2] = { 16, 4000 };
    enum { L = 1400 };
    static uint64_t tok[L], seq[L], q[L];
    uint64_t rng = 88172645463325252ULL, compared = 0;
    int      c, k, bad = 0;

    chain(1 << 20, L, tok, seq);
    for (c = 0; c < 2 && !bad; c++) {
        kv_index_config_t cfg = { .max_workers = workers[c] };
        kv_index_t       *ix = make(64u << 20, &cfg);

        for (k = 0; k < 400 && !bad; k++) {
            uint64_t w = 1 + d_rnd_u(&rng) % 12, r = d_rnd_u(&rng) % 10;
            size_t   len = 1 + d_rnd_u(&rng) % L, from, m, i;

            if (r < 6) {
                /* a prefix of random length, in events of up to 512 */
                for (from = 0; from < len; from += m) {
                    m = len - from < 512 ? len - from : 512;
                    store(ix, w, 0, from > 0, from ? seq[from - 1] : 0, &seq[from],
                          &tok[from], m);
                }
            } else if (r < 9) {
                remove_hashes(ix, w, 0, &seq[d_rnd_u(&rng) % L], 1);     /* a hole */
            } else {
                kv_event_t ev = { .worker_id = w, .kind = KV_EVENT_CLEARED };

                kv_index_apply(ix, &ev, 1000, err, sizeof(err));
            }
            for (i = 0; i < 3 && !bad; i++) {
                size_t n = i == 0 ? L : 33 + d_rnd_u(&rng) % (L - 33), j, cut;

                bad |= !d_same(ix, seq, n, 1 + d_rnd_u(&rng) % 128);
                memcpy(q, seq, sizeof(q));
                cut = d_rnd_u(&rng) % L;
                for (j = cut; j < L; j++) {
                    q[j] = kv_hash_chain(j ? q[j - 1] : 7, 5000 + j);
                }
                bad |= !d_same(ix, q, L, 128);
                compared += 2;
            }
        }
        free(ix);
    }
    printf("  %llu long queries compared\n", (unsigned long long) compared);
    CHECK(!bad);
}

/*
 * A zone smaller than what the fleet caches evicts all the time. Shared
 * documents, each stored to a different depth by a few workers, many
 * times what the index holds: an evicted block takes the chain below it
 * along (no match can use it), so no hole opens and matches keep jumping.
 * Evicting the block alone left each of its child's holders a hole, and
 * the table filled until every slot was lost.
 */
TEST(full_index_evicts_without_holes)
{
    kv_index_config_t cfg = { .max_workers = 8 };
    kv_index_t       *ix = make(kv_index_min_size(&cfg), &cfg);
    kv_index_stats_t  st;
    uint64_t          tok[64], seq[64], rng = 99;
    int               d, k;

    for (d = 0; d < 300; d++) {
        chain((uint64_t) (d + 1) << 24, 64, tok, seq);
        for (k = 0; k < 3; k++) {
            size_t n = 16 + d_rnd_u(&rng) % 49;

            CHECK(store(ix, 1 + d_rnd_u(&rng) % 8, 0, 0, 0, seq, tok, n) == 0);
        }
        CHECK(d_same(ix, seq, 64, 8));
    }
    kv_index_stats(ix, &st);
    CHECK(st.evicted > 10 * st.capacity);
    CHECK_EQ_U64(st.lost_slots, 0);
    CHECK(st.holes < 16);
    free(ix);
}

/* The hole table overflows: its slot is marked lost and matches walk. */
TEST(match_hole_table_overflow_walks)
{
    kv_index_config_t cfg = { .max_workers = 4 };
    kv_index_t       *ix = make(kv_index_min_size(&cfg), &cfg);
    kv_index_stats_t  st;
    uint64_t          tok[64], seq[64], h;
    int               i, s;

    /* 300 chains of 64 blocks, each with a hole at every odd block to 61:
     * the table (256 keys, 3/4 usable) cannot list them all, even as the
     * smallest table evicts the older chains (deepest blocks first) */
    for (i = 0; i < 300; i++) {
        int j;

        chain((uint64_t) (i + 1) << 24, 64, tok, seq);
        store(ix, 1, 0, 0, 0, seq, tok, 64);
        for (j = 1; j < 62; j += 2) {
            h = seq[j];
            remove_hashes(ix, 1, 0, &h, 1);
        }
    }
    kv_index_stats(ix, &st);
    CHECK(st.lost_slots == 1);
    s = kv_index_worker_find(ix, 1, 0);
    /* the last chain is held but its block 1 */
    CHECK_EQ_U64(overlap(ix, s, seq, 64), 1);
    CHECK(d_same(ix, seq, 64, 8));
    /* a Cleared event empties the slot: nothing lost any more */
    {
        kv_event_t ev = { .worker_id = 1, .kind = KV_EVENT_CLEARED };

        kv_index_apply(ix, &ev, 1000, err, sizeof(err));
    }
    kv_index_stats(ix, &st);
    CHECK_EQ_U64(st.lost_slots, 0);
    CHECK_EQ_U64(st.holes, 0);
    free(ix);
}

/* Holes are found where the jump would skip: a worker holding 0..99 but
 * block 40, and a worker filling it again. */
/* Engines drop whole conversations, head first or tail first. Each such
 * removal opens holes on the way (the blocks under the ones still held)
 * that close again once the chain is gone: they must leave the table, or
 * it fills and every match walks for good (one slot lost is enough). */
TEST(match_holes_retire_after_chain_removals)
{
    kv_index_config_t cfg = { .max_workers = 4 };
    kv_index_t       *ix = make(1 << 20, &cfg);
    kv_index_stats_t  st;
    uint64_t          tok[400][64], seq[400][64], h[64];
    int               r, i, s;

    for (r = 0; r < 400; r++) {
        chain((uint64_t) (r + 1) << 24, 64, tok[r], seq[r]);
        CHECK(store(ix, 1 + r % 4, 0, 0, 0, seq[r], tok[r], 64) == 0);
        if (r >= 40) {
            for (i = 0; i < 64; i++) {
                h[i] = seq[r - 40][r % 2 ? 63 - i : i];
            }
            remove_hashes(ix, 1 + (r - 40) % 4, 0, h, 64);
        }
    }
    kv_index_stats(ix, &st);
    CHECK_EQ_U64(st.evicted, 0);
    CHECK_EQ_U64(st.blocks, 40 * 64);
    CHECK_EQ_U64(st.lost_slots, 0);
    CHECK(st.holes < 64);
    for (r = 360; r < 400; r++) {
        s = kv_index_worker_find(ix, 1 + r % 4, 0);
        CHECK_EQ_U64(overlap(ix, s, seq[r], 64), 64);
        CHECK(d_same(ix, seq[r], 64, 8));
    }
    /* a hole that is one still is kept (and found) */
    remove_hashes(ix, 1 + 399 % 4, 0, &seq[399][20], 1);
    s = kv_index_worker_find(ix, 1 + 399 % 4, 0);
    CHECK_EQ_U64(overlap(ix, s, seq[399], 64), 20);
    CHECK(d_same(ix, seq[399], 64, 8));
    free(ix);
}

/*
 * Conversations that move: each document is removed whole by its owner,
 * deepest block first (as an engine evicts a finished conversation), and
 * stored by the next worker, while a second worker keeps a long prefix of
 * it. The owner lost every child before each block, so it has no hole
 * anywhere; a child count over all slots (the prefix holder's, the new
 * owner's) must not make one at every block of the document, or the hole
 * table fills, every slot goes lost and every match walks.
 */
TEST(match_moved_documents_leave_no_holes)
{
    enum { W = 64, DOCS = 48, LEN = 256, MOVES = 240 };
    kv_index_config_t cfg = { .max_workers = W };
    kv_index_t       *ix = make(16u << 20, &cfg);
    kv_index_stats_t  st;
    uint64_t         (*tok)[LEN] = calloc(DOCS, sizeof(*tok));
    uint64_t         (*seq)[LEN] = calloc(DOCS, sizeof(*seq));
    uint64_t          h[LEN], owner[DOCS];
    int               d, c, k, bad = 0;

    for (d = 0; d < DOCS; d++) {
        chain((uint64_t) (d + 1) << 32, LEN, tok[d], seq[d]);
        owner[d] = (uint64_t) d % W;
        CHECK(store(ix, owner[d], 0, 0, 0, seq[d], tok[d], LEN) == 0);
        /* a prefix held by another worker (a shared system prompt) */
        CHECK(store(ix, (owner[d] + W / 2) % W, 0, 0, 0, seq[d], tok[d], 200) == 0);
    }
    for (c = 0; c < MOVES; c++) {
        d = c % DOCS;
        for (k = 0; k < LEN; k++) {
            h[k] = seq[d][LEN - 1 - k];
        }
        remove_hashes(ix, owner[d], 0, h, LEN);
        owner[d] = (owner[d] + 1) % W;
        CHECK(store(ix, owner[d], 0, 0, 0, seq[d], tok[d], LEN) == 0);
    }
    kv_index_stats(ix, &st);
    printf("  %llu holes, %llu slots lost after %d moves\n", (unsigned long long) st.holes,
           (unsigned long long) st.lost_slots, MOVES);
    CHECK_EQ_U64(st.evicted, 0);
    CHECK_EQ_U64(st.lost_slots, 0);
    CHECK(st.holes < 64);
    for (d = 0; d < DOCS && !bad; d++) {
        CHECK_EQ_U64(overlap(ix, kv_index_worker_find(ix, owner[d], 0), seq[d], LEN), LEN);
        bad = !d_same(ix, seq[d], LEN, 64) || !d_same(ix, seq[d], 210, 64);
    }
    CHECK(!bad);
    /* a real hole is still made (and found): the owner drops one block */
    d = 5;
    remove_hashes(ix, owner[d], 0, &seq[d][100], 1);
    CHECK_EQ_U64(overlap(ix, kv_index_worker_find(ix, owner[d], 0), seq[d], LEN), 100);
    CHECK(d_same(ix, seq[d], LEN, 64));
    free(tok);
    free(seq);
    free(ix);
}

/* A slot lost to a full hole table is found again once its holes are gone
 * and the table has room, without a Cleared event. */
TEST(match_lost_slot_recovers)
{
    kv_index_config_t cfg = { .max_workers = 4 };
    kv_index_t       *ix = make(1 << 20, &cfg);
    kv_index_stats_t  st;
    uint64_t          tok[64], seq[64], h;
    int               i, s;

    /* 300 chains, each with a hole at block 10: more than the table lists */
    for (i = 0; i < 300; i++) {
        chain((uint64_t) (i + 1) << 24, 64, tok, seq);
        CHECK(store(ix, 1, 0, 0, 0, seq, tok, 64) == 0);
        h = seq[10];
        remove_hashes(ix, 1, 0, &h, 1);
    }
    kv_index_stats(ix, &st);
    CHECK_EQ_U64(st.lost_slots, 1);
    /* the engine drops them all (block 10 it dropped already) */
    for (i = 0; i < 300; i++) {
        uint64_t all[64];

        chain((uint64_t) (i + 1) << 24, 64, tok, all);
        remove_hashes(ix, 1, 0, all, 10);
        remove_hashes(ix, 1, 0, all + 11, 53);
    }
    /* and stores on */
    for (i = 0; i < 100; i++) {
        chain((uint64_t) (i + 1000) << 24, 64, tok, seq);
        CHECK(store(ix, 1, 0, 0, 0, seq, tok, 64) == 0);
    }
    kv_index_stats(ix, &st);
    CHECK_EQ_U64(st.lost_slots, 0);
    h = seq[30];
    remove_hashes(ix, 1, 0, &h, 1);
    s = kv_index_worker_find(ix, 1, 0);
    CHECK_EQ_U64(overlap(ix, s, seq, 64), 30);
    CHECK(d_same(ix, seq, 64, 8));
    free(ix);
}

TEST(match_jump_sees_holes)
{
    kv_index_t  *ix = make(1 << 22, NULL);
    uint64_t     tok[100], seq[100], h;
    int          a;

    chain(1 << 20, 100, tok, seq);
    store(ix, 1, 0, 0, 0, seq, tok, 100);
    a = kv_index_worker_find(ix, 1, 0);
    CHECK_EQ_U64(overlap(ix, a, seq, 100), 100);
    h = seq[40];
    remove_hashes(ix, 1, 0, &h, 1);
    CHECK_EQ_U64(overlap(ix, a, seq, 100), 40);
    /* the hole filled: the whole chain again, and no hole listed */
    store(ix, 1, 0, 1, seq[39], &seq[40], &tok[40], 1);
    CHECK_EQ_U64(overlap(ix, a, seq, 100), 100);
    {
        kv_index_stats_t st;

        kv_index_stats(ix, &st);
        CHECK_EQ_U64(st.holes, 0);
    }
    /* block 40's entry was freed and made again: it still knows block 41
     * is a child of worker 1, so losing it again lists the hole again */
    remove_hashes(ix, 1, 0, &h, 1);
    CHECK_EQ_U64(overlap(ix, a, seq, 100), 40);
    /* record_at after a held prefix, and over a gap */
    kv_index_record_at(ix, (uint32_t) a, seq, 0, 50, 1000);
    kv_index_forget(ix, (uint32_t) a, &seq[20], 1);
    CHECK_EQ_U64(overlap(ix, a, seq, 100), 20);
    kv_index_record_at(ix, (uint32_t) a, seq, 20, 21, 1000);
    CHECK_EQ_U64(overlap(ix, a, seq, 100), 100);
    free(ix);
}

/* The coarse pass (kv_index.c next_landing): landings at 16, 32, 64, 128,
 * then every 128 blocks, and 16 blocks apart only inside a long span some
 * slot stops in or the filter lists a key of. Many workers hold prefixes
 * ending at every position (inside long spans, just before and after a
 * coarse landing), with holes anywhere, one worker with a single hole in
 * an otherwise whole chain: the match against the walk for requests of
 * every length up to 700 blocks, and requests that leave the chain there. */
TEST(match_coarse_spans_equal_walk)
{
    enum { L = 700, NW = 40 };
    static const size_t edge[] = { 63, 64, 65, 127, 128, 129, 255, 256, 257, 383, 384, 385 };
    static uint64_t tok[L], seq[L], q[L];
    uint64_t rng = 0x2545F4914F6CDD1DULL, compared = 0, holes = 0;
    int      c, k, bad = 0;

    chain(3 << 20, L, tok, seq);
    for (c = 0; c < 2 && !bad; c++) {
        kv_index_config_t cfg = { .max_workers = c ? 200 : 48 };
        kv_index_t       *ix = make(32u << 20, &cfg);
        kv_index_stats_t  st;

        for (k = 0; k < 600 && !bad; k++) {
            uint64_t w = 1 + d_rnd_u(&rng) % NW, r = d_rnd_u(&rng) % 20;
            size_t   len, i, n, j, cut;

            len = r % 2 ? edge[d_rnd_u(&rng) % 12] + d_rnd_u(&rng) % 3 - 1
                        : 1 + d_rnd_u(&rng) % L;
            len = len > L ? L : len;
            if (r < 10) {
                /* a prefix ending at len, in events of up to 512 */
                for (i = 0; i < len; i += n) {
                    n = len - i < 512 ? len - i : 512;
                    store(ix, w, 0, i > 0, i ? seq[i - 1] : 0, &seq[i], &tok[i], n);
                }
            } else if (r < 15) {
                remove_hashes(ix, w, 0, &seq[len - 1], 1);       /* a hole, or the tail */
            } else if (r < 18) {
                /* worker 100: the whole chain with one hole, moved about */
                store(ix, 100, 0, 0, 0, seq, tok, 512);
                store(ix, 100, 0, 1, seq[511], &seq[512], &tok[512], L - 512);
                remove_hashes(ix, 100, 0, &seq[len - 1], 1);
            } else {
                kv_event_t ev = { .worker_id = w, .kind = KV_EVENT_CLEARED };

                kv_index_apply(ix, &ev, 1000, err, sizeof(err));
            }
            kv_index_stats(ix, &st);
            holes += st.holes > 0;
            for (i = 0; i < 4 && !bad; i++) {
                n = i == 0 ? L : i == 1 ? edge[d_rnd_u(&rng) % 12] : 33 + d_rnd_u(&rng) % (L - 33);
                bad |= !d_same(ix, seq, n, 1 + d_rnd_u(&rng) % 128);
                memcpy(q, seq, sizeof(q));
                cut = d_rnd_u(&rng) % L;
                for (j = cut; j < L; j++) {
                    q[j] = kv_hash_chain(j ? q[j - 1] : 7, 9000 + j);
                }
                bad |= !d_same(ix, q, n, 128);
                compared += 2;
            }
        }
        free(ix);
    }
    printf("  %llu queries compared, %llu steps with holes listed\n",
           (unsigned long long) compared, (unsigned long long) holes);
    CHECK(!bad);
    CHECK(holes > 100);
}

/* One worker holds 0..699; a hole at each position in turn, alone and
 * with a second worker stopping at each coarse landing's neighbours: the
 * overlap is the hole's position every time (a coarse span skipped over a
 * hole would report 700). */
TEST(match_coarse_spans_see_every_hole)
{
    enum { L = 700 };
    static uint64_t tok[L], seq[L];
    kv_index_t *ix = make(16u << 20, NULL);
    size_t      h;
    int         a, bad = 0;

    chain(5 << 20, L, tok, seq);
    for (h = 1; h < L && !bad; h++) {
        store(ix, 1, 0, 0, 0, seq, tok, 512);
        store(ix, 1, 0, 1, seq[511], &seq[512], &tok[512], L - 512);
        if (h % 7 == 0) {
            store(ix, 2, 0, 0, 0, seq, tok, h % 129 + 1);
        }
        a = kv_index_worker_find(ix, 1, 0);
        remove_hashes(ix, 1, 0, &seq[h], 1);
        if (overlap(ix, a, seq, L) != h || !d_same(ix, seq, L, 64)) {
            fprintf(stderr, "  hole at %zu: overlap %u\n", h, overlap(ix, a, seq, L));
            bad = 1;
        }
        remove_hashes(ix, 2, 0, seq, 1);        /* worker 2 starts over */
    }
    CHECK(!bad);
    free(ix);
}

/* The holey bitmap (kv_index.c holes_inc): a span whose alive slots have
 * no hole listed anywhere is skipped without reading the filter. So each
 * slot's count must follow its listings exactly: two slots listed at the
 * same key (the second listing joins an existing hole entry), one refilled
 * while the other is not, a slot with two holes refilling one, a slot
 * cleared while listed and holed again, and a hole of one slot while every
 * other alive slot has none. Each overlap is checked against the walk and
 * against the position of the hole. */
TEST(match_holes_listed_per_slot)
{
    enum { L = 300 };
    static uint64_t tok[L], seq[L];
    kv_index_t *ix = make(16u << 20, NULL);
    kv_event_t  clr = { .worker_id = 2, .kind = KV_EVENT_CLEARED };
    int         a, b, c;

    chain(7 << 20, L, tok, seq);
    store(ix, 1, 0, 0, 0, seq, tok, L);
    store(ix, 2, 0, 0, 0, seq, tok, L);
    store(ix, 3, 0, 0, 0, seq, tok, L);
    a = kv_index_worker_find(ix, 1, 0);
    b = kv_index_worker_find(ix, 2, 0);
    c = kv_index_worker_find(ix, 3, 0);
    /* b and c lose block 100: one hole key listing both */
    remove_hashes(ix, 2, 0, &seq[100], 1);
    remove_hashes(ix, 3, 0, &seq[100], 1);
    CHECK_EQ_U64(overlap(ix, b, seq, L), 100);
    CHECK_EQ_U64(overlap(ix, c, seq, L), 100);
    CHECK(d_same(ix, seq, L, 64));
    /* b refills: c is still listed there (its count must not be b's) */
    store(ix, 2, 0, 1, seq[99], &seq[100], &tok[100], 1);
    CHECK_EQ_U64(overlap(ix, b, seq, L), L);
    CHECK_EQ_U64(overlap(ix, c, seq, L), 100);
    CHECK(d_same(ix, seq, L, 64));
    /* c gets a second hole, refills the first: still one listed */
    remove_hashes(ix, 3, 0, &seq[200], 1);
    store(ix, 3, 0, 1, seq[99], &seq[100], &tok[100], 1);
    CHECK_EQ_U64(overlap(ix, c, seq, L), 200);
    CHECK(d_same(ix, seq, L, 64));
    store(ix, 3, 0, 1, seq[199], &seq[200], &tok[200], 1);
    CHECK_EQ_U64(overlap(ix, c, seq, L), L);
    CHECK(d_same(ix, seq, L, 64));
    /* b cleared while listed, then stored and holed again */
    remove_hashes(ix, 2, 0, &seq[150], 1);
    kv_index_apply(ix, &clr, 1000, err, sizeof(err));
    store(ix, 2, 0, 0, 0, seq, tok, L);
    CHECK_EQ_U64(overlap(ix, b, seq, L), L);
    remove_hashes(ix, 2, 0, &seq[250], 1);
    CHECK_EQ_U64(overlap(ix, b, seq, L), 250);
    CHECK_EQ_U64(overlap(ix, a, seq, L), L);
    CHECK(d_same(ix, seq, L, 64));
    /* a hole of a slot that is not alive there leaves the others' skip */
    remove_hashes(ix, 2, 0, &seq[10], 1);
    CHECK_EQ_U64(overlap(ix, b, seq, L), 10);
    CHECK_EQ_U64(overlap(ix, c, seq, L), L);
    CHECK(d_same(ix, seq, L, 64));
    free(ix);
}

/* split_long (kv_index.c): a long span listed in the filter for a few
 * keys is settled by reading them. Worker 1 holds the whole chain; worker
 * 3 stops at 10 but holds the rest, with holes inside the span 128..255
 * (listed keys worker 1 holds: the span is skipped); worker 2 holds the
 * whole chain with a hole at each of those listed positions in turn, and
 * at a second listed key after one worker 1 holds; then more keys listed
 * than are read (the span is landed in as before). */
TEST(match_long_span_listed_keys)
{
    enum { L = 300 };
    static uint64_t tok[L], seq[L];
    static const size_t at[] = { 129, 130, 160, 200, 254 };
    kv_index_t *ix = make(16u << 20, NULL);
    size_t      i, k, h;
    int         a, b, bad = 0;

    chain(9 << 20, L, tok, seq);
    store(ix, 1, 0, 0, 0, seq, tok, L);
    store(ix, 3, 0, 0, 0, seq, tok, L);
    remove_hashes(ix, 3, 0, &seq[10], 1);
    a = kv_index_worker_find(ix, 1, 0);
    for (k = 1; k <= 5 && !bad; k++) {
        /* worker 3's holes: the first k of at[] */
        remove_hashes(ix, 3, 0, &seq[at[k - 1]], 1);
        bad |= overlap(ix, a, seq, L) != L || !d_same(ix, seq, L, 64);
        for (i = 0; i < k && !bad; i++) {
            store(ix, 2, 0, 0, 0, seq, tok, L);
            b = kv_index_worker_find(ix, 2, 0);
            h = at[i];
            remove_hashes(ix, 2, 0, &seq[h], 1);
            if (overlap(ix, b, seq, L) != h || overlap(ix, a, seq, L) != L
                || !d_same(ix, seq, L, 64))
            {
                fprintf(stderr, "  %zu listed, worker 2's hole at %zu: overlap %u\n", k, h,
                        overlap(ix, b, seq, L));
                bad = 1;
            }
            /* a hole of worker 2 past a listed key both hold */
            store(ix, 2, 0, 1, seq[h - 1], &seq[h], &tok[h], 1);
            remove_hashes(ix, 2, 0, &seq[250], 1);
            if (overlap(ix, b, seq, L) != 250 || !d_same(ix, seq, L, 64)) {
                fprintf(stderr, "  %zu listed, worker 2's hole at 250: overlap %u\n", k,
                        overlap(ix, b, seq, L));
                bad = 1;
            }
            kv_event_t clr = { .worker_id = 2, .kind = KV_EVENT_CLEARED };

            kv_index_apply(ix, &clr, 1000, err, sizeof(err));
        }
    }
    CHECK(!bad);
    free(ix);
}

/*
 * Keys probe from the start of the cache line their hash names (32-byte
 * entries: two homes share a line). A table filled to just under its
 * eviction point (long probe runs that cross lines), then blocks removed
 * all over it (each last holder's removal shifts the rest of its run back)
 * and stored again: every worker's overlap on every chain is what a plain
 * model of who holds what says, for the jump and the walk alike.
 */
TEST(match_homes_at_line_starts)
{
    enum { W = 6, C = 16, MAXCH = 256 };
    kv_index_config_t cfg = { .max_workers = 64 };
    kv_index_t       *ix = make(kv_index_min_size(&cfg), &cfg);
    kv_index_stats_t  st;
    static uint64_t   tok[MAXCH][C], seq[MAXCH][C];
    static uint8_t    held[MAXCH][W][C];
    uint64_t          rs = 0x2545F4914F6CDD1DULL, checked = 0;
    size_t            nch, c, i, w, b, round;
    int               slot[W], bad = 0;

    kv_index_stats(ix, &st);
    nch = (st.capacity - 8) / C;
    CHECK(nch <= MAXCH);
    for (c = 0; c < nch; c++) {
        chain((uint64_t) (c + 1) << 32, C, tok[c], seq[c]);
        for (w = 0; w < W; w++) {
            rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17;
            b = w == c % W ? C : rs % (C + 1);      /* one holds it whole */
            if (b > 0) {
                store(ix, w + 1, 0, 0, 0, seq[c], tok[c], b);
            }
            for (i = 0; i < b; i++) {
                held[c][w][i] = 1;
            }
        }
    }
    for (w = 0; w < W; w++) {
        slot[w] = kv_index_worker_find(ix, w + 1, 0);
    }
    for (round = 0; round < 6 && !bad; round++) {
        /* removals anywhere (some the block's last holder: entries erased,
         * runs shifted back), then some blocks stored again */
        for (i = 0; i < nch * C / 3; i++) {
            rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17;
            c = rs % nch;
            w = (rs >> 20) % W;
            b = (rs >> 40) % C;
            if (held[c][w][b]) {
                remove_hashes(ix, w + 1, 0, &seq[c][b], 1);
                held[c][w][b] = 0;
            }
        }
        for (i = 0; i < nch * C / 4; i++) {
            rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17;
            c = rs % nch;
            w = (rs >> 20) % W;
            b = (rs >> 40) % C;
            if (!held[c][w][b] && (b == 0 || held[c][w][b - 1])) {
                store(ix, w + 1, 0, b > 0, b > 0 ? seq[c][b - 1] : 0, &seq[c][b], &tok[c][b], 1);
                held[c][w][b] = 1;
            }
        }
        for (c = 0; c < nch && !bad; c++) {
            for (w = 0; w < W; w++) {
                kv_overlap_t out[64];
                uint32_t     want = 0, got = 0, walked = 0;
                size_t       k, n;

                while (want < C && held[c][w][want]) {
                    want++;
                }
                n = kv_index_match_walk(ix, seq[c], C, out, 64);
                for (k = 0; k < n; k++) {
                    walked = (int) out[k].slot == slot[w] ? out[k].blocks : walked;
                }
                got = overlap(ix, slot[w], seq[c], C);
                checked++;
                if (got != want || walked != want) {
                    fprintf(stderr, "  round %zu chain %zu worker %zu: match %u walk %u, holds %u\n",
                            round, c, w, got, walked, want);
                    bad = 1;
                    break;
                }
            }
        }
    }
    kv_index_stats(ix, &st);
    CHECK_EQ_U64(st.evicted, 0);
    printf("  %llu overlaps checked against the model, %llu blocks held at the end\n",
           (unsigned long long) checked, (unsigned long long) st.blocks);
    CHECK(!bad);
    free(ix);
}

int main(void)
{
    RUN(stored_kvworker_style);
    RUN(stored_dynamo_style);
    RUN(engine_map_overflow);
    RUN(engine_map_full_forgets_consistently);
    RUN(engine_hashes_size_the_map);
    RUN(unknown_parent_dropped_whole);
    RUN(cleared_all_dp_ranks);
    RUN(worker_remove_frees_slot);
    RUN(slot_changes_logged);
    RUN(worker_find_hints_stay_right);
    RUN(worker_slots_run_out);
    RUN(match_leading_run_per_worker);
    RUN(match_exits_early);
    RUN(eviction_when_full);
    RUN(eviction_of_retired_slot_keeps_count);
    RUN(approximate_ttl_expire);
    RUN(approximate_ttl_set_and_ages);
    RUN(approximate_prune_to_ratio);
    RUN(open_on_reuse);
    RUN(match_jump_equals_walk_randomized);
    RUN(match_jump_equals_walk_every_entry_size);
    RUN(match_jump_long_requests_equal_walk);
    RUN(full_index_evicts_without_holes);
    RUN(match_hole_table_overflow_walks);
    RUN(match_holes_retire_after_chain_removals);
    RUN(match_moved_documents_leave_no_holes);
    RUN(match_lost_slot_recovers);
    RUN(match_jump_sees_holes);
    RUN(match_coarse_spans_equal_walk);
    RUN(match_coarse_spans_see_every_hole);
    RUN(match_holes_listed_per_slot);
    RUN(match_long_span_listed_keys);
    RUN(match_homes_at_line_starts);
    RUN(concurrent_reader_sees_consistent_overlaps);
    return kvt_done();
}
