/* kv_retain: approximate mode's memory follows what the engines kept. */
#include "kv_retain.h"
#include "kvtest.h"

#define CAP 120000

static void feed(kv_retain_t *r, uint64_t age_ms, int n, uint64_t credited, uint64_t cached)
{
    for (int i = 0; i < n; i++)
        kv_retain_sample(r, age_ms, credited, cached);
}

TEST(buckets_are_sqrt2_apart_from_one_second)
{
    CHECK(kv_retain_bucket(0) == 0);
    CHECK(kv_retain_bucket(999) == 0);
    CHECK(kv_retain_bucket(1000) == 1);
    CHECK(kv_retain_bucket(1999) == 2);
    CHECK(kv_retain_bucket(2000) == 3);
    CHECK(kv_retain_bucket(10000) == 7);
    CHECK(kv_retain_bucket(1ULL << 40) == KV_RETAIN_BUCKETS - 1);
    CHECK_EQ_U64(kv_retain_edge_ms(7), 8000);
    for (int b = 1; b < KV_RETAIN_BUCKETS; b++)
        CHECK(kv_retain_bucket(kv_retain_edge_ms(b)) == b);
}

/* nothing known, or every credited token found: the configured memory */
TEST(no_evidence_keeps_the_cap)
{
    kv_retain_t r = { 0 };

    CHECK_EQ_U64(kv_retain_choose(&r, CAP), CAP);
    feed(&r, 30000, 100, 640, 640);
    feed(&r, 90000, 100, 640, 700);     /* more than credited: still right */
    CHECK_EQ_U64(kv_retain_choose(&r, CAP), CAP);
    /* uncredited requests are no samples */
    feed(&r, 30000, 100, 0, 0);
    CHECK_EQ_U64(r.samples, 200);
}

/* an engine that keeps blocks ~10 s: the memory is cut where misses win */
TEST(evictions_cut_the_memory_at_the_youngest_stale_age)
{
    kv_retain_t r = { 0 };

    feed(&r, 3000, 50, 1024, 1024);
    feed(&r, 6000, 50, 1024, 1024);
    feed(&r, 9000, 50, 1024, 400);      /* 61 % gone: still worth crediting */
    feed(&r, 12000, 50, 1024, 64);
    feed(&r, 40000, 50, 1024, 0);
    CHECK_EQ_U64(kv_retain_choose(&r, CAP), 11314);
    /* a memory shorter than the evidence is never chosen above the cap */
    CHECK_EQ_U64(kv_retain_choose(&r, 10000), 10000);
}

/* a bucket is stale from three quarters gone, not from half */
TEST(stale_from_three_quarters)
{
    kv_retain_t r = { 0 };

    feed(&r, 9000, 40, 1000, 260);      /* 74 % gone */
    CHECK_EQ_U64(kv_retain_choose(&r, CAP), CAP);
    feed(&r, 9000, 40, 1000, 220);      /* now 76 % */
    CHECK_EQ_U64(kv_retain_choose(&r, CAP), 8000);
}

/* young misses (two prefills of one prefix in one step) never cut it
 * below the floor, and a bucket needs enough samples for a verdict */
TEST(young_or_few_misses_do_not_count)
{
    kv_retain_t r = { 0 };

    feed(&r, 500, 200, 1024, 0);
    feed(&r, 1500, 200, 1024, 0);
    feed(&r, 5000, KV_RETAIN_MIN_N - 1, 1024, 0);
    CHECK_EQ_U64(kv_retain_choose(&r, CAP), CAP);
    feed(&r, 5000, 1, 1024, 0);
    CHECK_EQ_U64(kv_retain_choose(&r, CAP), 4000);
    /* a cleared engine: every age wrong, the floor */
    feed(&r, 2100, 20, 1024, 0);
    CHECK_EQ_U64(kv_retain_choose(&r, CAP), KV_RETAIN_FLOOR_MS);
}

/* decay forgets old traffic: a stale verdict fades below the sample bound */
TEST(decay_forgets)
{
    kv_retain_t r = { 0 };
    int ticks = 0;

    feed(&r, 20000, 64, 1024, 0);
    CHECK_EQ_U64(kv_retain_choose(&r, CAP), 16000);
    while (kv_retain_choose(&r, CAP) != CAP && ticks < 10000) {
        kv_retain_decay(&r, 1019);
        ticks++;
    }
    /* 64 samples to 16 at 1019/1024 a tick: about 285 ticks */
    CHECK(ticks > 250 && ticks < 320);
    CHECK(r.samples == 64);
}

/* right and wrong decay alike: the verdict holds while samples are enough */
TEST(decay_keeps_the_verdict)
{
    kv_retain_t r = { 0 };

    feed(&r, 20000, 1000, 1000, 200);
    for (int i = 0; i < 100; i++)
        kv_retain_decay(&r, 1019);
    CHECK_EQ_U64(kv_retain_choose(&r, CAP), 16000);
    CHECK(r.wrong[kv_retain_bucket(20000)] > r.right[kv_retain_bucket(20000)]);
}

TEST(steps_down_at_once_up_slowly)
{
    CHECK_EQ_U64(kv_retain_step(CAP, 8000), 8000);
    CHECK_EQ_U64(kv_retain_step(8000, CAP), 8250);
    CHECK_EQ_U64(kv_retain_step(64000, CAP), 66000);
    CHECK_EQ_U64(kv_retain_step(119900, CAP), CAP);
    uint64_t t = 2000;
    int n = 0;
    while (t < CAP) {
        t = kv_retain_step(t, CAP);
        n++;
    }
    /* from the floor to 120 s: about a minute of half-second ticks */
    CHECK(n > 80 && n < 200);
}

int main(void)
{
    RUN(buckets_are_sqrt2_apart_from_one_second);
    RUN(no_evidence_keeps_the_cap);
    RUN(evictions_cut_the_memory_at_the_youngest_stale_age);
    RUN(stale_from_three_quarters);
    RUN(young_or_few_misses_do_not_count);
    RUN(decay_forgets);
    RUN(decay_keeps_the_verdict);
    RUN(steps_down_at_once_up_slowly);
    return kvt_done();
}
