/* Prefix index (kv_index.c): a match descheduled across a reap and a new
 * worker's add to the slot it read. White-box: the index is compiled in
 * here with a hook where a match has read its bits and not yet checked
 * the slots (KV_INDEX_TEST_MATCHED), and the hook runs the writer there,
 * as a helper process would while the reader sleeps. */
#include <stdint.h>

struct kv_index;
static void mid_match(struct kv_index *ix);
#define KV_INDEX_TEST_MATCHED(ix) mid_match((struct kv_index *) (ix))

#include "kv_index.c"
#include "kvtest.h"

static char     err[256];
static int      armed;          /* the next match runs the writer (once) */
static int      reuse;          /* it also reaps and adds new_worker */
static uint64_t old_worker, new_worker;

/* The old worker goes; with reuse, the reap frees its slot and a new
 * worker takes it. */
static void mid_match(struct kv_index *ix)
{
    if (!armed) {
        return;
    }
    armed = 0;
    kv_index_worker_remove(ix, old_worker);
    if (reuse) {
        kv_index_reap(ix);
        kv_index_worker_add(ix, new_worker, 0);
    }
}

static void chain(uint64_t base, size_t n, uint64_t *tok, uint64_t *seq)
{
    size_t i;

    for (i = 0; i < n; i++) {
        tok[i] = base + i;
        seq[i] = i == 0 ? tok[0] : kv_hash_chain(seq[i - 1], tok[i]);
    }
}

static int store(kv_index_t *ix, uint64_t worker, const uint64_t *tok, const uint64_t *seq,
                 size_t n)
{
    kv_stored_block_t b[128];
    kv_event_t        ev = { .worker_id = worker, .kind = KV_EVENT_STORED, .blocks = b,
                             .n_blocks = n };
    size_t            i;

    for (i = 0; i < n; i++) {
        b[i].block_hash = seq[i];
        b[i].tokens_hash = tok[i];
    }
    return kv_index_apply(ix, &ev, 1000, err, sizeof(err));
}

typedef size_t (*match_fn)(const kv_index_t *, const uint64_t *, size_t, kv_overlap_t *,
                           size_t);

/* Worker 1 holds n blocks; a match of them is interrupted by worker 1's
 * removal, a reap and worker 2's add, which takes worker 1's slot. Worker
 * 2 holds nothing: the match must credit its slot with no block. */
static void reused_mid_match(match_fn match, size_t n)
{
    static char  region[4 << 20] __attribute__((aligned(64)));
    uint64_t     tok[128], seq[128];
    kv_overlap_t out[16];
    kv_index_t  *ix = kv_index_create(region, sizeof(region), NULL, err, sizeof(err));
    size_t       k, i;
    int          slot;

    CHECK(ix != NULL);
    chain(5000, n, tok, seq);
    CHECK(store(ix, 1, tok, seq, n) == 0);
    slot = kv_index_worker_find(ix, 1, 0);
    k = match(ix, seq, n, out, 16);
    CHECK_EQ_U64(k, 1);
    CHECK_EQ_U64(out[0].blocks, n);

    old_worker = 1;
    new_worker = 2;
    reuse = 1;
    armed = 1;
    k = match(ix, seq, n, out, 16);
    CHECK(!armed);                                  /* the writer ran mid-match */
    CHECK_EQ_U64(kv_index_worker_find(ix, 2, 0), slot);   /* in the old slot */
    for (i = 0; i < k; i++) {
        CHECK(out[i].slot != (uint32_t) slot);      /* worker 2 holds nothing */
    }
    CHECK_EQ_U64(k, 0);
    /* and the next match agrees */
    CHECK_EQ_U64(match(ix, seq, n, out, 16), 0);
}

/* 8 blocks: the walk (kv_index_match hands short requests to it). */
TEST(reused_slot_walk)
{
    reused_mid_match(kv_index_match_walk, 8);
    reused_mid_match(kv_index_match, 8);
}

/* 100 blocks: the jump; the reap's gen bump came before the hook, so gen
 * alone does not see it. */
TEST(reused_slot_jump)
{
    reused_mid_match(kv_index_match, 100);
}

/* A removal with no reap leaves the slot retired: its blocks are dropped
 * from the answer, the other worker's stay. */
TEST(retired_mid_match)
{
    static char  region[4 << 20] __attribute__((aligned(64)));
    uint64_t     tok[64], seq[64];
    kv_overlap_t out[16];
    kv_index_t  *ix = kv_index_create(region, sizeof(region), NULL, err, sizeof(err));

    CHECK(ix != NULL);
    chain(7000, 40, tok, seq);
    CHECK(store(ix, 1, tok, seq, 40) == 0);
    CHECK(store(ix, 3, tok, seq, 20) == 0);
    old_worker = 1;
    reuse = 0;
    armed = 1;
    CHECK_EQ_U64(kv_index_match(ix, seq, 40, out, 16), 1);
    CHECK_EQ_U64(out[0].slot, kv_index_worker_find(ix, 3, 0));
    CHECK_EQ_U64(out[0].blocks, 20);
}

int main(void)
{
    RUN(reused_slot_walk);
    RUN(reused_slot_jump);
    RUN(retired_mid_match);
    return kvt_done();
}
