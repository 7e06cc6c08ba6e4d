/* Shared load table: names, rows, release, reaping a dead process's load. */
#include <math.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>
#include "kvtest.h"
#include "kv_load.h"

static pid_t dead_pid;
static int alive_except_dead(pid_t pid) { return pid != dead_pid; }

TEST(names_and_counts)
{
    size_t     sz = kv_load_size(8, 4);
    void      *mem = calloc(1, sz);
    kv_load_t *ld = kv_load_init(mem, sz, 8, 4, 0);
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
    /* reuse keeps everything */
    CHECK(kv_load_init(mem, sz, 8, 4, 1) == ld);
    CHECK(kv_load_find(ld, "u/127.0.0.1:2", 13) == 1);
    kv_load_get(ld, 1, &s);
    CHECK(s.active[KV_LOAD_REQUESTS] == 1);
    free(mem);
}

TEST(dead_process_reaped)
{
    size_t     sz = kv_load_size(4, 4);
    void      *mem = calloc(1, sz);
    kv_load_t *ld = kv_load_init(mem, sz, 4, 4, 0);
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
    size_t     sz = kv_load_size(1, 1);
    void      *mem = calloc(1, sz);
    kv_load_t *ld = kv_load_init(mem, sz, 1, 1, 0);

    CHECK(kv_load_server(ld, "a", 1) == 0);
    CHECK(kv_load_server(ld, "b", 1) == -1);
    CHECK(kv_load_claim_row(ld, 1) == 0);
    CHECK(kv_load_claim_row(ld, 2) == -1);
    CHECK(kv_load_init(mem, sz - 1, 1, 1, 0) == NULL);
    free(mem);
}

/* Learned rates: the first sample is the mean, later ones move it by 1/16
 * of the way on numerator and denominator alike. */
TEST(learned_rates)
{
    size_t     sz = kv_load_size(4, 2);
    void      *mem = calloc(1, sz);
    kv_load_t *ld = kv_load_init(mem, sz, 4, 2, 0);
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

/* A time to first byte with a fixed part: the fit finds it, and the rate
 * is that of the tokens alone; tokens all alike leave the plain ratio. */
TEST(learned_prefill_line)
{
    size_t     sz = kv_load_size(4, 2);
    void      *mem = calloc(1, sz);
    kv_load_t *ld = kv_load_init(mem, sz, 4, 2, 0);
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
    return kvt_done();
}
