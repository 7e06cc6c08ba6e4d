/* kv_respmap: response id -> worker, bounded per bucket, first in first
 * out, shared by processes (a forked writer's puts are read here). */
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kv_respmap.h"
#include "kvtest.h"

/* keys whose high halves fall in one bucket of an n-bucket map */
static uint64_t same_bucket_key(int i)
{
    return (uint64_t) 1 << 32 | (uint64_t) (i + 1);
}

TEST(put_get_and_replace)
{
    static uint64_t mem[4096];
    kv_respmap_t   *m = kv_respmap_create(mem, sizeof(mem));
    kv_respmap_stats_t st;

    CHECK(m != NULL);
    CHECK(kv_respmap_get(m, 0x1234567890abcdefULL) == 0);
    CHECK(kv_respmap_put(m, 0x1234567890abcdefULL, 7) == 1);
    CHECK_EQ_U64(kv_respmap_get(m, 0x1234567890abcdefULL), 7);
    CHECK(kv_respmap_put(m, 0x1234567890abcdefULL, 9) == 1);
    CHECK_EQ_U64(kv_respmap_get(m, 0x1234567890abcdefULL), 9);
    CHECK(kv_respmap_put(m, 0, 9) == 0);
    CHECK(kv_respmap_put(m, 5, 0) == 0);
    kv_respmap_stats(m, &st);
    CHECK_EQ_U64(st.stored, 2);
    CHECK_EQ_U64(st.hits, 2);
    CHECK_EQ_U64(st.misses, 1);
    CHECK(st.capacity >= 100);
    /* laid over again (a reused zone): the same map */
    CHECK(kv_respmap_attach(mem, sizeof(mem)) == m);
    CHECK(kv_respmap_attach(mem, sizeof(mem) - 8) == NULL);
}

/* a full bucket drops its oldest; a key put again moves to the front */
TEST(bucket_drops_its_oldest)
{
    static uint64_t mem[4096];
    kv_respmap_t   *m = kv_respmap_create(mem, sizeof(mem));
    int             i;

    for (i = 0; i < KV_RESPMAP_WAYS; i++)
        CHECK(kv_respmap_put(m, same_bucket_key(i), 100 + i) == 1);
    CHECK(kv_respmap_put(m, same_bucket_key(0), 200) == 1);    /* to the front */
    CHECK(kv_respmap_put(m, same_bucket_key(KV_RESPMAP_WAYS), 300) == 1);
    CHECK(kv_respmap_get(m, same_bucket_key(1)) == 0);          /* the oldest, dropped */
    CHECK_EQ_U64(kv_respmap_get(m, same_bucket_key(0)), 200);
    for (i = 2; i < KV_RESPMAP_WAYS; i++)
        CHECK_EQ_U64(kv_respmap_get(m, same_bucket_key(i)), 100 + i);
    CHECK_EQ_U64(kv_respmap_get(m, same_bucket_key(KV_RESPMAP_WAYS)), 300);
}

TEST(too_small)
{
    static uint64_t mem[8];

    CHECK(kv_respmap_create(mem, sizeof(mem)) == NULL);
    CHECK(kv_respmap_create(NULL, 1 << 20) == NULL);
}

/* another process's puts are seen here; a lock left by a dead process is
 * taken over */
TEST(across_processes)
{
    size_t        size = 1 << 16;
    void         *mem = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                             -1, 0);
    kv_respmap_t *m = kv_respmap_create(mem, size);
    pid_t         pid;
    int           status, i;

    pid = fork();
    if (pid == 0) {
        for (i = 1; i <= 1000; i++)
            kv_respmap_put(m, (uint64_t) i * 0x9e3779b97f4a7c15ULL, (uint64_t) i);
        /* die holding the lock, as a killed writer would */
        __atomic_store_n((uint64_t *) ((char *) mem + 24),
                         (uint64_t) getpid() << 32 | 1, __ATOMIC_RELEASE);
        _exit(0);
    }
    CHECK(waitpid(pid, &status, 0) == pid);
    for (i = 1000; i > 1000 - 50; i--)
        CHECK_EQ_U64(kv_respmap_get(m, (uint64_t) i * 0x9e3779b97f4a7c15ULL), i);
    CHECK(kv_respmap_put(m, 42, 43) == 1);
    CHECK_EQ_U64(kv_respmap_get(m, 42), 43);
    munmap(mem, size);
}

int main(void)
{
    RUN(put_get_and_replace);
    RUN(bucket_drops_its_oldest);
    RUN(too_small);
    RUN(across_processes);
    return kvt_done();
}
