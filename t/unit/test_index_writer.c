/* Prefix index (kv_index.c): a writer killed in the middle of a write.
 * White-box: the index is compiled in here, with the seqlock's write_end
 * counted so that a forked writer can die exactly between write_begin and
 * write_end, as a helper killed by the OOM killer or a reload would. */
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kv_seqlock.h"

static int die_at;      /* the write_end to die at (0: never) */

static inline void test_write_end(kv_seqlock_t *l)
{
    if (die_at > 0 && --die_at == 0) {
        _exit(0);       /* the count stays odd */
    }
    kv_seqlock_write_end(l);
}
#define kv_seqlock_write_end(l) test_write_end(l)

#include "kv_index.c"
#include "kvtest.h"
#include "index_chain.h"

static int odd_locks(const kv_index_t *ix)
{
    uint64_t i;
    int      n = 0;

    for (i = 0; i < ix->cap; i++) {
        n += (int) (__atomic_load_n(&entry(ix, i)->lock, __ATOMIC_RELAXED) & 1);
    }
    return n;
}

static uint32_t walk_overlap(kv_index_t *ix, uint64_t worker, const uint64_t *seq, size_t n)
{
    kv_overlap_t out[16];
    size_t       k, i;
    int          slot = kv_index_worker_find(ix, worker, 0);

    k = kv_index_match_walk(ix, seq, n, out, 16);
    for (i = 0; i < k; i++) {
        if ((int) out[i].slot == slot) {
            return out[i].blocks;
        }
    }
    return 0;
}

/* The writer dies holding an entry's lock odd; a new writer takes the
 * region over (kv_index_open, as a reload's helper) and goes on. Before,
 * its first write to that entry made the count even while writing and odd
 * while idle: readers then skipped the entry for good and took half-done
 * writes as whole. */
TEST(writer_killed_mid_write)
{
    size_t      size = 1 << 20;
    void       *region = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                              -1, 0);
    kv_index_t *ix = kv_index_create(region, size, NULL, err, sizeof(err));
    uint64_t    tok[100], seq[100], bits[64];
    int64_t     at;
    pid_t       pid;
    int         status, k;

    chain(7000, 100, tok, seq);
    CHECK(store(ix, 1, tok, seq, 100) == 0);
    /* a second writer process stores a prefix of the same chain (every
     * entry it writes is one worker 1 holds) and dies in its 30th write */
    pid = fork();
    if (pid == 0) {
        die_at = 30;
        store(ix, 2, tok, seq, 60);
        _exit(1);
    }
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECK_EQ_U64(odd_locks(ix), 1);
    /* the next writer */
    ix = kv_index_open(region, size);
    CHECK(ix != NULL);
    for (k = 0; k < 3; k++) {
        CHECK(store(ix, 3, tok, seq, 60) == 0);
        CHECK(store(ix, 2, tok, seq, 60) == 0);
    }
    CHECK_EQ_U64(odd_locks(ix), 0);
    CHECK_EQ_U64(walk_overlap(ix, 3, seq, 100), 60);
    CHECK_EQ_U64(walk_overlap(ix, 2, seq, 100), 60);
    CHECK_EQ_U64(kv_index_worker_blocks(ix, (uint32_t) kv_index_worker_find(ix, 3, 0)), 60);
    /* and a write under way is seen as one again */
    at = find(ix, norm_key(seq[40]));
    CHECK(at >= 0);
    write_begin(entry(ix, (uint64_t) at));
    CHECK(read_holders(ix, norm_key(seq[40]), bits) == 0);
    write_end(entry(ix, (uint64_t) at));
    CHECK(read_holders(ix, norm_key(seq[40]), bits) == 1);
    munmap(region, size);
}

/* What the dead writer left cannot be trusted (a backward shift half
 * done, counts, holes): the index is cleared, its slots kept, and says so. */
TEST(writer_killed_clears_index)
{
    size_t           size = 1 << 20;
    void            *region = mmap(NULL, size, PROT_READ | PROT_WRITE,
                                   MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    kv_index_t      *ix = kv_index_create(region, size, NULL, err, sizeof(err));
    kv_index_stats_t st;
    uint64_t         tok[100], seq[100], h[50];
    pid_t            pid;
    int              status, i;

    chain(9000, 100, tok, seq);
    CHECK(store(ix, 1, tok, seq, 100) == 0);
    pid = fork();
    if (pid == 0) {
        kv_event_t ev = { .worker_id = 1, .kind = KV_EVENT_REMOVED, .hashes = h,
                          .n_hashes = 50 };

        for (i = 0; i < 50; i++) {
            h[i] = seq[i];
        }
        die_at = 20;
        kv_index_apply(ix, &ev, 1000, err, sizeof(err));
        _exit(1);
    }
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    /* found by the next writer call (stats is none) */
    kv_index_stats(ix, &st);
    CHECK_EQ_U64(st.writer_died, 0);
    chain(12000, 10, tok, seq);
    CHECK(store(ix, 2, tok, seq, 10) == 0);
    kv_index_stats(ix, &st);
    CHECK_EQ_U64(st.writer_died, 1);
    CHECK_EQ_U64(st.blocks, 10);
    CHECK_EQ_U64(st.holes, 0);
    CHECK_EQ_U64(st.lost_slots, 0);
    CHECK_EQ_U64(kv_index_worker_blocks(ix, (uint32_t) kv_index_worker_find(ix, 1, 0)), 0);
    CHECK(kv_index_worker_find(ix, 1, 0) >= 0);
    CHECK_EQ_U64(odd_locks(ix), 0);
    /* calls that end normally clear nothing */
    CHECK(store(ix, 2, tok, seq, 10) == 0);
    kv_index_stats(ix, &st);
    CHECK_EQ_U64(st.writer_died, 1);
    CHECK_EQ_U64(st.blocks, 10);
    munmap(region, size);
}

int main(void)
{
    RUN(writer_killed_mid_write);
    RUN(writer_killed_clears_index);
    return kvt_done();
}
