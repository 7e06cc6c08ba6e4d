/* Shared load table: names, rows, release, reaping a dead process's load. */
#include <signal.h>
#include <stdio.h>
#include <math.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>
#include "kvtest.h"
#include "kv_load.h"

static pid_t dead_pid;
static int alive_except_dead(pid_t pid) { return pid != dead_pid; }

TEST(names_and_counts)
{
    size_t     sz = kv_load_size(8, 4, 1);
    void      *mem = calloc(1, sz);
    kv_load_t *ld = kv_load_init(mem, sz, 8, 4, 1, 0);
    kv_load_server_t s;
    int        a, b, row;

    a = kv_load_server(ld, "u/127.0.0.1:1", 13);
    b = kv_load_server(ld, "u/127.0.0.1:2", 13);
    CHECK(a == 0 && b == 1);
    CHECK(kv_load_server(ld, "u/127.0.0.1:1", 13) == 0);
    row = kv_load_claim_row(ld, 100);
    CHECK(row == 0);
    CHECK(kv_load_claim_row(ld, 100) == 0);
    kv_load_add(ld, row, 1, KV_LOAD_PREFILL_TOKENS, 500);
    kv_load_add(ld, row, 1, KV_LOAD_REQUESTS, 1);
    kv_load_get(ld, 1, &s);
    CHECK(s.active[KV_LOAD_PREFILL_TOKENS] == 500 && s.active[KV_LOAD_REQUESTS] == 1);
    kv_load_add(ld, row, 1, KV_LOAD_PREFILL_TOKENS, -500);
    kv_load_get(ld, 1, &s);
    CHECK(s.active[KV_LOAD_PREFILL_TOKENS] == 0);
    /* the last send's time, for the router's "not started yet" */
    CHECK(s.sent_us == 0);
    kv_load_sent(ld, 1, 123456789);
    kv_load_sent(ld, 8, 1);                     /* out of range: ignored */
    kv_load_get(ld, 1, &s);
    CHECK(s.sent_us == 123456789);
    kv_load_get(ld, 0, &s);
    CHECK(s.sent_us == 0);
    /* reuse keeps everything */
    CHECK(kv_load_init(mem, sz, 8, 4, 1, 1) == ld);
    CHECK(kv_load_find(ld, "u/127.0.0.1:2", 13) == 1);
    kv_load_get(ld, 1, &s);
    CHECK(s.active[KV_LOAD_REQUESTS] == 1);
    free(mem);
}

TEST(dead_process_reaped)
{
    size_t     sz = kv_load_size(4, 4, 1);
    void      *mem = calloc(1, sz);
    kv_load_t *ld = kv_load_init(mem, sz, 4, 4, 1, 0);
    kv_load_server_t s;
    int        r1, r2;

    kv_load_server(ld, "a", 1);
    r1 = kv_load_claim_row(ld, 111);
    r2 = kv_load_claim_row(ld, 222);
    kv_load_add(ld, r1, 0, KV_LOAD_DECODE_BLOCKS, 40);
    kv_load_add(ld, r2, 0, KV_LOAD_DECODE_BLOCKS, 2);
    dead_pid = 111;
    CHECK(kv_load_reap(ld, alive_except_dead) == 1);
    kv_load_get(ld, 0, &s);
    CHECK(s.active[KV_LOAD_DECODE_BLOCKS] == 2);
    CHECK(kv_load_reaped(ld) == 1);
    CHECK(kv_load_claim_row(ld, 333) == r1);
    kv_load_release_row(ld, r2);
    kv_load_get(ld, 0, &s);
    CHECK(s.active[KV_LOAD_DECODE_BLOCKS] == 0);
    free(mem);
}

TEST(full_tables)
{
    size_t     sz = kv_load_size(1, 1, 1);
    void      *mem = calloc(1, sz);
    kv_load_t *ld = kv_load_init(mem, sz, 1, 1, 1, 0);

    CHECK(kv_load_server(ld, "a", 1) == 0);
    CHECK(kv_load_server(ld, "b", 1) == -1);
    CHECK(kv_load_claim_row(ld, 1) == 0);
    CHECK(kv_load_claim_row(ld, 2) == -1);
    CHECK(kv_load_init(mem, sz - 1, 1, 1, 1, 0) == NULL);
    free(mem);
}

/* Learned rates: the first sample is the mean, later ones move it by 1/16
 * of the way on numerator and denominator alike. */
TEST(learned_rates)
{
    size_t     sz = kv_load_size(4, 2, 1);
    void      *mem = calloc(1, sz);
    kv_load_t *ld = kv_load_init(mem, sz, 4, 2, 1, 0);
    kv_load_server_t s;
    int        a = kv_load_server(ld, "u/a", 3);

    kv_load_get(ld, a, &s);
    CHECK(s.prefill_rate == 0 && s.decode_pace == 0);
    kv_load_learn_prefill(ld, a, 1000, 10);
    kv_load_learn_decode(ld, a, 100, 2000);
    kv_load_learn_prefill(ld, a, 0, 10);        /* ignored */
    kv_load_learn_decode(ld, a, 10, -1);        /* ignored */
    kv_load_get(ld, a, &s);
    CHECK(s.prefill_rate == 100.0);
    CHECK(s.decode_pace == 20.0);
    kv_load_learn_prefill(ld, a, 1000 + 16 * 1000, 10);    /* tokens mean 2000 */
    kv_load_get(ld, a, &s);
    CHECK(s.prefill_rate == 200.0);
    kv_load_add(ld, -1, a, KV_LOAD_DECODE_TOKENS, 256);
    kv_load_get(ld, a, &s);
    CHECK(s.active[KV_LOAD_DECODE_TOKENS] == 256);
    free(mem);
}

/* The least-loaded order: servers come out by requests per weight, and
 * every change of requests moves them. */
TEST(least_order)
{
    size_t     sz = kv_load_size(8, 2, 2);
    void      *mem = calloc(1, sz);
    kv_load_t *ld = kv_load_init(mem, sz, 8, 2, 2, 0);
    uint32_t   out[8];
    char       name[16];
    int        i, row = kv_load_claim_row(ld, 1);

    for (i = 0; i < 6; i++) {
        CHECK(kv_load_server(ld, name, (size_t) snprintf(name, sizeof(name), "u/s%d", i)) == i);
        kv_load_place(ld, (uint32_t) i, i < 4 ? 0 : 1, i == 3 ? 2 : 1);
    }
    CHECK(kv_load_order_check(ld) == 0);
    CHECK(kv_load_least(ld, 0, out, 8) == 4);
    CHECK(kv_load_least(ld, 1, out, 8) == 2);
    CHECK(kv_load_least(ld, 5, out, 8) == 0);          /* no such group */

    kv_load_add(ld, row, 0, KV_LOAD_REQUESTS, 2);
    kv_load_add(ld, row, 1, KV_LOAD_REQUESTS, 1);
    kv_load_add(ld, row, 3, KV_LOAD_REQUESTS, 2);       /* weight 2: 1 per weight */
    CHECK(kv_load_order_check(ld) == 0);
    CHECK(kv_load_least(ld, 0, out, 1) == 1 && out[0] == 2);
    CHECK(kv_load_least(ld, 0, out, 4) == 4 && out[3] == 0);
    kv_load_add(ld, row, 0, KV_LOAD_REQUESTS, -2);
    CHECK(kv_load_least(ld, 0, out, 2) == 2 && out[0] == 2 && out[1] == 0);

    /* prefill tokens do not move anyone; a reaped row does */
    kv_load_add(ld, row, 2, KV_LOAD_PREFILL_TOKENS, 10000);
    CHECK(kv_load_least(ld, 0, out, 1) == 1 && out[0] == 2);
    kv_load_add(ld, row, 2, KV_LOAD_REQUESTS, 5);
    CHECK(kv_load_least(ld, 0, out, 1) == 1 && out[0] == 0);
    kv_load_release_row(ld, row);
    CHECK(kv_load_order_check(ld) == 0);

    /* moved to another group, then out of the order */
    kv_load_place(ld, 0, 1, 1);
    CHECK(kv_load_least(ld, 0, out, 8) == 3 && kv_load_least(ld, 1, out, 8) == 3);
    kv_load_place(ld, 0, UINT32_MAX, 1);
    CHECK(kv_load_least(ld, 1, out, 8) == 2);
    CHECK(kv_load_order_check(ld) == 0);
    free(mem);
}

/* Random changes over a large table against a brute-force scan: the least
 * server found is always one with the least load, and the lists stay whole. */
TEST(least_order_random)
{
    enum { N = 4096, G = 3 };
    size_t     sz = kv_load_size(N, 4, G);
    void      *mem = calloc(1, sz);
    kv_load_t *ld = kv_load_init(mem, sz, N, 4, G, 0);
    static int64_t req[N];
    uint32_t   out[4], best;
    uint64_t   x = 88172645463325252ULL;
    char       name[32];
    int        i, k, g, row = kv_load_claim_row(ld, 7);
    kv_load_server_t ls;

    for (i = 0; i < N; i++) {
        CHECK(kv_load_server(ld, name, (size_t) snprintf(name, sizeof(name), "llm/10.0.%d.%d:8000",
                                                          i / 256, i % 256)) == i);
        kv_load_place(ld, (uint32_t) i, (uint32_t) (i % G), 1);
    }
    CHECK(kv_load_servers(ld) == N && kv_load_capacity(ld) == N);
    CHECK(kv_load_find(ld, "llm/10.0.15.255:8000", 20) == N - 1);
    CHECK(kv_load_find(ld, "llm/10.0.16.0:8000", 18) == -1);
    for (k = 0; k < 200000; k++) {
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
        i = (int) (x % N);
        if (req[i] > 0 && (x >> 32) % 2) {
            req[i]--;
            kv_load_add(ld, row, (uint32_t) i, KV_LOAD_REQUESTS, -1);
        } else if (req[i] < 300) {
            req[i]++;
            kv_load_add(ld, row, (uint32_t) i, KV_LOAD_REQUESTS, 1);
        }
        if (k % 20000 == 0) {
            CHECK(kv_load_order_check(ld) == 0);
        }
    }
    for (g = 0; g < G; g++) {
        best = (uint32_t) g;
        for (i = g; i < N; i += G) {
            if (req[i] < req[best]) {
                best = (uint32_t) i;
            }
        }
        CHECK(kv_load_least(ld, (uint32_t) g, out, 4) == 4);
        kv_load_get(ld, out[0], &ls);
        CHECK(out[0] % G == (uint32_t) g);
        CHECK(ls.active[KV_LOAD_REQUESTS] == req[best] || req[best] >= 48);
    }
    CHECK(kv_load_order_check(ld) == 0);
    free(mem);
}

/* A reused table keeps names and order; another shape is laid out anew. */
TEST(reuse_and_shape)
{
    size_t     sz = kv_load_size(64, 2, 4);
    void      *mem = calloc(1, sz);
    kv_load_t *ld = kv_load_init(mem, sz, 64, 2, 4, 0);
    uint32_t   out[2];

    CHECK(kv_load_size(64, 2, 4) > kv_load_size(64, 2, 1));
    CHECK(kv_load_server(ld, "a", 1) == 0);
    kv_load_place(ld, 0, 3, 1);
    CHECK(kv_load_init(mem, sz, 64, 2, 4, 1) == ld);
    CHECK(kv_load_least(ld, 3, out, 2) == 1 && out[0] == 0);
    CHECK(kv_load_init(mem, sz, 32, 2, 4, 1) == ld);
    CHECK(kv_load_servers(ld) == 0 && kv_load_least(ld, 3, out, 2) == 0);
    free(mem);
}

/* A process killed while it moves servers (holding the order's lock, or
 * between a counter's change and its move) does not stop the others: the
 * next one to need the lock finds the holder dead and takes it, and the
 * reaping of the dead process's row rebuilds the lists from the counters. */
static int pid_alive(pid_t pid) { return kill(pid, 0) == 0; }

TEST(order_survives_a_killed_holder)
{
    enum { N = 256 };
    size_t     sz = kv_load_size(N, 2, 1);
    void      *mem = mmap(NULL, sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    kv_load_t *ld = kv_load_init(mem, sz, N, 2, 1, 0);
    uint32_t   out[4];
    char       name[16];
    int        i, row, round;
    pid_t      child;

    for (i = 0; i < N; i++) {
        kv_load_server(ld, name, (size_t) snprintf(name, sizeof(name), "u/%d", i));
        kv_load_place(ld, (uint32_t) i, 0, 1);
    }
    for (round = 0; round < 20; round++) {
        child = fork();
        if (child == 0) {
            row = kv_load_claim_row(ld, getpid());
            for (i = 0;; i = (i + 7) % N) {
                kv_load_add(ld, row, (uint32_t) i, KV_LOAD_REQUESTS, 1);
                kv_load_add(ld, row, (uint32_t) i, KV_LOAD_REQUESTS, -1);
            }
        }
        usleep(1000 + 500 * (useconds_t) round);
        kill(child, SIGKILL);
        waitpid(child, NULL, 0);
        CHECK(kv_load_least(ld, 0, out, 4) == 4);       /* the lock is not lost */
        CHECK(kv_load_reap(ld, pid_alive) <= 1);     /* 0: killed before it claimed one */
        CHECK(kv_load_order_check(ld) == 0);
    }
    munmap(mem, sz);
}

/* A time to first byte with a fixed part: the fit finds it, and the rate
 * is that of the tokens alone; tokens all alike leave the plain ratio. */
TEST(learned_prefill_line)
{
    size_t     sz = kv_load_size(4, 2, 1);
    void      *mem = calloc(1, sz);
    kv_load_t *ld = kv_load_init(mem, sz, 4, 2, 1, 0);
    kv_load_server_t s;
    int        a = kv_load_server(ld, "u/a", 3);
    int        b = kv_load_server(ld, "u/b", 3);

    for (int i = 0; i < 40; i++) {
        double t = i % 2 ? 1000 : 100;

        kv_load_learn_prefill(ld, a, t, 50 + t / 10);   /* base 50 ms, 10 tokens/ms */
        kv_load_learn_prefill(ld, b, 256, 200);
    }
    kv_load_get(ld, a, &s);
    CHECK(fabs(s.prefill_base - 50) < 1e-6);
    CHECK(fabs(s.prefill_rate - 10) < 1e-6);
    kv_load_get(ld, b, &s);
    CHECK(s.prefill_base == 0);
    CHECK(fabs(s.prefill_rate - 256.0 / 200) < 1e-9);
    free(mem);
}

int main(void)
{
    RUN(learned_prefill_line);
    RUN(names_and_counts);
    RUN(dead_process_reaped);
    RUN(full_tables);
    RUN(learned_rates);
    RUN(least_order);
    RUN(least_order_random);
    RUN(reuse_and_shape);
    RUN(order_survives_a_killed_holder);
    return kvt_done();
}
