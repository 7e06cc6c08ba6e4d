/* The KV block manager: prefix reuse, refcounts, eviction order, events. */
#include "kvtest.h"
#include "kv_hash.h"
#include "kvw_blocks.h"

#include <stdlib.h>

#define BS 4

/* Events the manager flushed, flattened. */
static kvw_event_t evs[256];
static int n_evs;

static void sink(void *ctx, const kvw_event_t *ev)
{
    if (n_evs < 256)
        evs[n_evs++] = *ev;
}

static void fill(uint32_t *t, size_t n, uint32_t base)
{
    for (size_t i = 0; i < n; i++)
        t[i] = base + (uint32_t)i;
}

/* A whole sequence: reserve, compute all, return the cached tokens at start. */
static size_t run_seq(kvw_blocks_t *bm, kvw_seq_blocks_t *s, const uint32_t *t, size_t n)
{
    size_t cached = kvw_blocks_acquire_prefix(bm, s, KV_HASH_SEED, t, n);
    if (kvw_blocks_reserve(bm, s, n) != 0)
        return (size_t)-1;
    kvw_blocks_commit(bm, s, t, n);
    return cached;
}

TEST(store_hashes_match_router)
{
    kvw_blocks_t *bm = kvw_blocks_new(8, BS);
    kvw_seq_blocks_t s = {0};
    uint32_t t[] = {11, 22, 33, 44, 55, 66, 77, 88, 99};

    n_evs = 0;
    kvw_blocks_set_sink(bm, sink, NULL);
    CHECK_EQ_U64(run_seq(bm, &s, t, 9), 0);
    CHECK_EQ_U64(s.n, 3);                   /* two full blocks and a partial one */
    kvw_blocks_flush(bm);
    CHECK_EQ_U64(n_evs, 1);                 /* one chain: one batched event */
    CHECK(evs[0].kind == KVW_EV_STORED);
    CHECK(!evs[0].has_parent);
    CHECK_EQ_U64(evs[0].n, 2);
    CHECK_EQ_U64(evs[0].hashes[0], 4117275816416024698ULL);
    CHECK_EQ_U64(evs[0].locals[1], 6081346995852963768ULL);
    CHECK_EQ_U64(evs[0].hashes[1], 5947898228081096063ULL);
    kvw_blocks_release(bm, &s);
    CHECK_EQ_U64(kvw_blocks_active(bm), 0);
    CHECK_EQ_U64(kvw_blocks_cached(bm), 2);     /* the partial block went back free */
    CHECK_EQ_U64(kvw_blocks_available(bm), 8);
    kvw_blocks_free(bm);
}

TEST(prefix_reuse_and_refcounts)
{
    kvw_blocks_t *bm = kvw_blocks_new(16, BS);
    kvw_seq_blocks_t a = {0}, b = {0};
    uint32_t t[12];

    fill(t, 12, 100);
    CHECK_EQ_U64(run_seq(bm, &a, t, 12), 0);
    /* the same prompt while a runs: the last block is never reused (one token must run) */
    CHECK_EQ_U64(run_seq(bm, &b, t, 12), 8);
    CHECK_EQ_U64(a.table[0], b.table[0]);
    CHECK_EQ_U64(a.table[1], b.table[1]);
    CHECK_EQ_U64(a.table[2], b.table[2]);   /* computed twice: b takes the cached copy */
    CHECK_EQ_U64(kvw_blocks_active(bm), 3);
    kvw_blocks_release(bm, &a);
    CHECK_EQ_U64(kvw_blocks_active(bm), 3); /* all still held by b */
    kvw_blocks_release(bm, &b);
    CHECK_EQ_U64(kvw_blocks_active(bm), 0);
    CHECK_EQ_U64(kvw_blocks_cached(bm), 3);
    CHECK_EQ_U64(kvw_blocks_available(bm), 16);
    CHECK_EQ_U64(kvw_blocks_stats(bm)->hit_tokens, 8);
    kvw_blocks_free(bm);
}

TEST(evicts_tail_of_finished_sequence_first)
{
    kvw_blocks_t *bm = kvw_blocks_new(4, BS);
    kvw_seq_blocks_t a = {0}, b = {0};
    uint32_t t[16], u[8];
    uint64_t seq[4];

    n_evs = 0;
    kvw_blocks_set_sink(bm, sink, NULL);
    fill(t, 16, 1);
    kv_hash_blocks(t, 16, BS, KV_HASH_SEED, NULL, seq);
    CHECK_EQ_U64(run_seq(bm, &a, t, 16), 0);
    kvw_blocks_release(bm, &a);
    CHECK_EQ_U64(kvw_blocks_cached(bm), 4);
    /* two new blocks: the two deepest blocks of the finished sequence go */
    fill(u, 8, 500);
    CHECK_EQ_U64(run_seq(bm, &b, u, 8), 0);
    CHECK(kvw_blocks_contains(bm, seq[0]));
    CHECK(kvw_blocks_contains(bm, seq[1]));
    CHECK(!kvw_blocks_contains(bm, seq[2]));
    CHECK(!kvw_blocks_contains(bm, seq[3]));
    kvw_blocks_flush(bm);
    /* stored(4), removed(seq3, seq2) interleaved with stores of u */
    int removed = 0;
    for (int i = 0; i < n_evs; i++)
        if (evs[i].kind == KVW_EV_REMOVED) {
            CHECK_EQ_U64(evs[i].hashes[0], seq[3]);
            removed += (int)evs[i].n;
        }
    CHECK_EQ_U64(removed, 2);
    kvw_blocks_release(bm, &b);
    kvw_blocks_free(bm);
}

/*
 * Two requests with one prompt admitted in the same step both compute its
 * blocks. The second must hold the cached copies: with private copies, the
 * cached ones were evicted once the first request ended, and the second's
 * next block was stored under a parent already removed (the router drops
 * such a store, and every later one of that request).
 */
TEST(concurrent_duplicates_keep_their_parents)
{
    kvw_blocks_t *bm = kvw_blocks_new(6, BS);
    kvw_seq_blocks_t a = {0}, b = {0}, c = {0};
    uint32_t t[16], u[16];
    uint64_t live[64];
    int n_live = 0;

    n_evs = 0;
    kvw_blocks_set_sink(bm, sink, NULL);
    fill(t, 16, 1);
    CHECK_EQ_U64(kvw_blocks_acquire_prefix(bm, &a, KV_HASH_SEED, t, 9), 0);
    CHECK_EQ_U64(kvw_blocks_acquire_prefix(bm, &b, KV_HASH_SEED, t, 9), 0);
    CHECK(kvw_blocks_reserve(bm, &a, 9) == 0 && kvw_blocks_reserve(bm, &b, 9) == 0);
    kvw_blocks_commit(bm, &a, t, 9);
    kvw_blocks_commit(bm, &b, t, 9);
    CHECK_EQ_U64(a.table[1], b.table[1]);
    kvw_blocks_release(bm, &a);
    /* another request takes all it can but the one block b needs next:
     * only held blocks survive */
    fill(u, 16, 900);
    CHECK(kvw_blocks_reserve(bm, &c, (size_t)(kvw_blocks_available(bm) - 1) * BS) == 0);
    kvw_blocks_commit(bm, &c, u, c.n * BS);
    /* b goes on past its prompt: its third block's parent must still be there */
    CHECK(kvw_blocks_reserve(bm, &b, 13) == 0);
    kvw_blocks_commit(bm, &b, t, 13);
    kvw_blocks_flush(bm);
    for (int i = 0; i < n_evs; i++) {
        kvw_event_t *e = &evs[i];
        if (e->kind == KVW_EV_STORED) {
            int found = !e->has_parent;
            for (int j = 0; j < n_live && !found; j++)
                found = live[j] == e->parent;
            CHECK(found);
            for (size_t k = 0; k < e->n && n_live < 64; k++)
                live[n_live++] = e->hashes[k];
        } else if (e->kind == KVW_EV_REMOVED) {
            for (size_t k = 0; k < e->n; k++)
                for (int j = 0; j < n_live; j++)
                    if (live[j] == e->hashes[k])
                        live[j] = live[--n_live];
        }
    }
    kvw_blocks_release(bm, &b);
    kvw_blocks_release(bm, &c);
    CHECK_EQ_U64(kvw_blocks_active(bm), 0);
    CHECK_EQ_U64(kvw_blocks_available(bm), 6);
    kvw_blocks_free(bm);
}

TEST(reserve_is_all_or_nothing)
{
    kvw_blocks_t *bm = kvw_blocks_new(4, BS);
    kvw_seq_blocks_t a = {0}, b = {0};
    uint32_t t[12];

    fill(t, 12, 7);
    CHECK_EQ_U64(run_seq(bm, &a, t, 12), 0);    /* 3 blocks held */
    CHECK_EQ_U64(kvw_blocks_available(bm), 1);
    CHECK(kvw_blocks_reserve(bm, &b, 8) != 0);  /* needs 2 */
    CHECK_EQ_U64(b.n, 0);
    CHECK_EQ_U64(kvw_blocks_available(bm), 1);
    CHECK(kvw_blocks_reserve(bm, &b, 4) == 0);
    kvw_blocks_release(bm, &b);
    kvw_blocks_release(bm, &a);
    kvw_blocks_free(bm);
}

TEST(partial_block_promoted_when_full)
{
    kvw_blocks_t *bm = kvw_blocks_new(8, BS);
    kvw_seq_blocks_t a = {0};
    uint32_t t[8];

    fill(t, 8, 40);
    kvw_blocks_acquire_prefix(bm, &a, KV_HASH_SEED, t, 6);
    CHECK(kvw_blocks_reserve(bm, &a, 6) == 0);
    kvw_blocks_commit(bm, &a, t, 6);
    CHECK_EQ_U64(kvw_blocks_cached(bm), 1);
    /* decode two more tokens into the same block: it becomes full and cached */
    CHECK(kvw_blocks_reserve(bm, &a, 8) == 0);
    CHECK_EQ_U64(a.n, 2);
    kvw_blocks_commit(bm, &a, t, 8);
    CHECK_EQ_U64(kvw_blocks_cached(bm), 2);
    kvw_blocks_release(bm, &a);
    kvw_blocks_free(bm);
}

TEST(batching_caps_and_kind_changes)
{
    kvw_blocks_t *bm = kvw_blocks_new(300, 1);
    kvw_seq_blocks_t a = {0};
    uint32_t t[201];

    n_evs = 0;
    kvw_blocks_set_sink(bm, sink, NULL);
    fill(t, 201, 9);
    run_seq(bm, &a, t, 201);
    kvw_blocks_flush(bm);
    CHECK_EQ_U64(n_evs, 2);                 /* 201 blocks: 128 + 73 */
    CHECK_EQ_U64(evs[0].n, 128);
    CHECK_EQ_U64(evs[1].n, 73);
    CHECK(evs[1].has_parent);
    CHECK_EQ_U64(evs[1].parent, evs[0].hashes[127]);
    kvw_blocks_release(bm, &a);
    kvw_blocks_free(bm);
}

TEST(dump_parents_first_and_clear)
{
    kvw_blocks_t *bm = kvw_blocks_new(16, BS);
    kvw_seq_blocks_t a = {0}, b = {0};
    uint32_t t[12], u[12];
    size_t n;

    fill(t, 12, 1);
    fill(u, 12, 1);
    u[5] = 999;         /* shares block 0 only */
    run_seq(bm, &a, t, 12);
    run_seq(bm, &b, u, 12);
    kvw_dump_block_t *d = kvw_blocks_dump(bm, &n);
    CHECK_EQ_U64(n, 5);
    for (size_t i = 0; i < n; i++) {
        if (!d[i].has_parent)
            continue;
        int seen = 0;
        for (size_t j = 0; j < i; j++)
            seen |= d[j].hash == d[i].parent;
        CHECK(seen);
    }
    free(d);
    n_evs = 0;
    kvw_blocks_set_sink(bm, sink, NULL);
    kvw_blocks_clear(bm);
    CHECK_EQ_U64(n_evs, 1);
    CHECK(evs[0].kind == KVW_EV_CLEARED);
    CHECK_EQ_U64(kvw_blocks_cached(bm), 0);
    kvw_blocks_release(bm, &a);
    kvw_blocks_release(bm, &b);
    CHECK_EQ_U64(kvw_blocks_available(bm), 16);
    kvw_blocks_free(bm);
}

int main(void)
{
    RUN(store_hashes_match_router);
    RUN(prefix_reuse_and_refcounts);
    RUN(evicts_tail_of_finished_sequence_first);
    RUN(concurrent_duplicates_keep_their_parents);
    RUN(reserve_is_all_or_nothing);
    RUN(partial_block_promoted_when_full);
    RUN(batching_caps_and_kind_changes);
    RUN(dump_parents_first_and_clear);
    return kvt_done();
}
