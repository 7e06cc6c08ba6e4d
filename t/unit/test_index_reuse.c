/* Prefix index (kv_index.c): a match descheduled across a reap and a new
 * worker's add to the slot it read. White-box: the index is compiled in
 * here with a hook where a match has read its bits and not yet checked
 * the slots (KV_INDEX_TEST_MATCHED), and the hook runs the writer there,
 * as a helper process would while the reader sleeps. */
#include <pthread.h>
#include <sched.h>
#include <stdint.h>

struct kv_index;
static void mid_match(struct kv_index *ix);
#define KV_INDEX_TEST_MATCHED(ix) mid_match((struct kv_index *) (ix))

#include "kv_index.c"
#include "kvtest.h"
#include "index_chain.h"

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

/* --- slots churning under a reader thread --------------------------------
 * Also built by hand under ThreadSanitizer, which finds no race (every word
 * the reader reads of slots, the slot log and entries is an atomic):
 *   cc -std=gnu11 -O1 -g -fsanitize=thread -Wno-tsan -pthread -D_GNU_SOURCE \
 *      -Isrc/core -Isrc/index -It/unit t/unit/test_index_reuse.c \
 *      src/core/kv_hash.c -lxxhash -lm
 * Odd workers hold the chain, even ones nothing; a match during which no
 * slot changed hands must credit odd workers only. */

#define CHURN_ROUNDS 3000

typedef struct {
    kv_index_t *ix;
    uint64_t    seq[64];
    int         started;        /* atomic: the reader runs */
    int         done;           /* atomic: the writer finished */
    uint64_t    matches, checked, bad;
} churn_t;

static void *churn_reader(void *arg)
{
    churn_t     *c = arg;
    kv_overlap_t out[64];
    uint32_t     changed[64];
    uint64_t     since = 0, wid;
    uint32_t     dp;
    size_t       k, i, n;
    int          ch;

    __atomic_store_n(&c->started, 1, __ATOMIC_RELEASE);
    while (!__atomic_load_n(&c->done, __ATOMIC_ACQUIRE)) {
        kv_index_slots_changed(c->ix, &since, changed, 64);
        n = c->matches & 1 ? 40 : 8;
        k = kv_index_match(c->ix, c->seq, n, out, 64);
        for (i = 0; i < k; i++) {
            if (out[i].slot >= kv_index_max_workers(c->ix) || out[i].blocks > n) {
                c->bad++;
            }
        }
        for (i = 0; i < k; i++) {
            if (kv_index_worker_info(c->ix, out[i].slot, &wid, &dp) != 0) {
                out[i].slot = UINT32_MAX;   /* gone since: nothing to check */
                continue;
            }
            out[i].blocks = (uint32_t) wid;
        }
        ch = kv_index_slots_changed(c->ix, &since, changed, 64);
        for (i = 0; ch == 0 && i < k; i++) {
            if (out[i].slot != UINT32_MAX) {
                c->checked++;
                c->bad += out[i].blocks % 2 == 0;   /* an even worker credited */
            }
        }
        for (i = 0; ch > 0 && i < (size_t) ch; i++) {
            c->bad += changed[i] >= kv_index_max_workers(c->ix);
        }
        c->matches++;
    }
    return NULL;
}

TEST(slot_churn_under_reader)
{
    static char       region[4 << 20] __attribute__((aligned(64)));
    static churn_t    c;
    kv_index_config_t cfg = { .max_workers = 8 };
    uint64_t          tok[64];
    pthread_t         th;
    int               r;

    c.ix = kv_index_create(region, sizeof(region), &cfg, err, sizeof(err));
    CHECK(c.ix != NULL);
    chain(9000, 40, tok, c.seq);
    CHECK(pthread_create(&th, NULL, churn_reader, &c) == 0);
    while (!__atomic_load_n(&c.started, __ATOMIC_ACQUIRE)) {
        sched_yield();
    }
    for (r = 0; r < CHURN_ROUNDS; r++) {
        uint64_t odd = 2 * (uint64_t) r + 1;

        CHECK(store(c.ix, odd, tok, c.seq, r % 40 + 1) == 0);
        kv_index_worker_add(c.ix, odd + 1, 0);
        kv_index_worker_remove(c.ix, odd);
        kv_index_worker_remove(c.ix, odd + 1);
        if (r % 3 == 0) {
            kv_index_reap(c.ix);
        }
    }
    __atomic_store_n(&c.done, 1, __ATOMIC_RELEASE);
    CHECK(pthread_join(th, NULL) == 0);
    printf("  reader: %llu matches, %llu slots checked, %llu bad\n",
           (unsigned long long) c.matches, (unsigned long long) c.checked,
           (unsigned long long) c.bad);
    CHECK(c.matches > 0);
    CHECK_EQ_U64(c.bad, 0);
}

int main(void)
{
    RUN(reused_slot_walk);
    RUN(reused_slot_jump);
    RUN(retired_mid_match);
    RUN(slot_churn_under_reader);
    return kvt_done();
}
