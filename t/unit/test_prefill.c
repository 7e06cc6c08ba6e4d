/* The prefill half of a disaggregated decision (kv_prefill.c): local when
 * little is left to prefill, else the prefill server by overlap and prefill
 * load, never a failure when the prefill pool is down or busy. */
#include "kvtest.h"
#include "kv_prefill.h"

static const uint64_t seq[128] = { 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16 };

static void idle(kv_route_server_t *s, size_t n)
{
    memset(s, 0, n * sizeof(*s));
    for (size_t i = 0; i < n; i++) {
        s[i].usable = 1;
        s[i].weight = 1;
        s[i].trusted = 1;
        s[i].id = 9000 + i;
    }
}

static kv_route_config_t config(uint32_t bs)
{
    kv_route_config_t cfg;

    kv_route_config_init(&cfg);
    cfg.block_size = bs;
    return cfg;
}

static kv_route_request_t request(uint64_t blocks, uint32_t bs)
{
    kv_route_request_t rq;

    memset(&rq, 0, sizeof(rq));
    rq.prompt_tokens = blocks * bs;
    rq.seq = seq;
    rq.nseq = blocks;
    rq.max_tokens = 512;
    return rq;
}

/* 128 blocks of 16 = 2048 tokens; the decode worker holds 100: 448 left,
 * under the 512-token default -> local; holding 90: 608 left -> remote;
 * holding 96: exactly 512 left -> local. */
TEST(short_uncached_part_stays_local)
{
    kv_route_server_t s[2];
    kv_route_config_t cfg = config(16);
    kv_prefill_config_t pc;
    kv_route_request_t rq = request(128, 16);
    kv_prefill_result_t r;

    kv_prefill_config_init(&pc);
    CHECK_EQ_U64(pc.min_tokens, 512);
    idle(s, 2);
    CHECK(kv_prefill_pick(s, 2, &rq, 100, &pc, &cfg, 0, &r) == -1);
    CHECK(r.why == KV_PREFILL_LOCAL_SHORT);
    CHECK_EQ_U64(r.uncached_local, 2048 - 100 * 16);
    CHECK(kv_prefill_pick(s, 2, &rq, 96, &pc, &cfg, 0, &r) == -1);
    CHECK_STR(kv_prefill_why_name(r.why), "short");

    CHECK(kv_prefill_pick(s, 2, &rq, 90, &pc, &cfg, 0, &r) >= 0);
    CHECK(r.why == KV_PREFILL_REMOTE);
    CHECK_STR(kv_prefill_why_name(r.why), "remote");

    /* the whole prompt cached at the decode worker */
    CHECK(kv_prefill_pick(s, 2, &rq, 128, &pc, &cfg, 0, &r) == -1);
    CHECK(r.why == KV_PREFILL_LOCAL_SHORT);
    CHECK_EQ_U64(r.uncached_local, 0);

    /* a short prompt, nothing cached */
    rq = request(10, 16);
    CHECK(kv_prefill_pick(s, 2, &rq, 0, &pc, &cfg, 0, &r) == -1);
    CHECK(r.why == KV_PREFILL_LOCAL_SHORT);

    /* min_tokens 0: any uncached token goes remote */
    pc.min_tokens = 0;
    CHECK(kv_prefill_pick(s, 2, &rq, 0, &pc, &cfg, 0, &r) >= 0);
    CHECK(kv_prefill_pick(s, 2, &rq, 10, &pc, &cfg, 0, &r) == -1);
}

/* The prefill server holding the prefix wins, and is charged only its own
 * uncached part; no decode load is charged to a prefill server. */
TEST(prefill_server_by_overlap)
{
    static const uint32_t sizes[] = { 16, 32, 64 };

    for (size_t k = 0; k < 3; k++) {
        uint32_t bs = sizes[k];
        kv_route_server_t s[3];
        kv_route_config_t cfg = config(bs);
        kv_prefill_config_t pc;
        kv_route_request_t rq = request(128, bs);
        kv_prefill_result_t r;

        kv_prefill_config_init(&pc);
        idle(s, 3);
        s[2].overlap_index = 100;
        CHECK(kv_prefill_pick(s, 3, &rq, 0, &pc, &cfg, 0, &r) == 2);
        CHECK(r.why == KV_PREFILL_REMOTE);
        CHECK_EQ_U64(r.route.overlap, 100);
        CHECK_EQ_U64(r.route.prefill_tokens, 28 * bs);
        CHECK_EQ_U64(r.route.decode_blocks, 0);
        CHECK_EQ_U64(r.route.decode_tokens, 0);

        /* an untrusted index state earns no credit */
        s[2].trusted = 0;
        s[1].overlap_index = 50;
        CHECK(kv_prefill_pick(s, 3, &rq, 0, &pc, &cfg, 0, &r) == 1);
    }
}

/* Prefill load moves the choice: a holder with a long prefill queue loses
 * to an idle one once its estimate is past the slack. */
TEST(prefill_server_by_load)
{
    kv_route_server_t s[2];
    kv_route_config_t cfg = config(16);
    kv_prefill_config_t pc;
    kv_route_request_t rq = request(128, 16);
    kv_prefill_result_t r;

    kv_prefill_config_init(&pc);
    idle(s, 2);
    s[0].overlap_index = 64;            /* 1024 tokens left at s[0], 2048 at s[1] */
    CHECK(kv_prefill_pick(s, 2, &rq, 0, &pc, &cfg, 0, &r) == 0);
    s[0].prefill_tokens = 4096;         /* 5120 vs 2048: s[1] */
    CHECK(kv_prefill_pick(s, 2, &rq, 0, &pc, &cfg, 0, &r) == 1);
    CHECK_EQ_U64(r.route.queued_tokens, 0);
    CHECK_EQ_U64(r.route.prefill_tokens, 2048);

    /* decode inputs are ignored: a prefill server's decode pace or output
     * length does not blur the estimates together */
    s[0].prefill_tokens = 1500;         /* 2524 vs 2048, inside the slack */
    s[0].decode_pace = 1000;
    s[1].decode_pace = 1000;
    CHECK(kv_prefill_pick(s, 2, &rq, 0, &pc, &cfg, 0, &r) == 0);
    s[0].prefill_tokens = 3000;         /* 4024 vs 2048, outside */
    CHECK(kv_prefill_pick(s, 2, &rq, 0, &pc, &cfg, 0, &r) == 1);
}

/* A prefill pool that is down or overloaded means local prefill. */
TEST(dead_or_busy_pool_is_local)
{
    kv_route_server_t s[2];
    kv_route_config_t cfg = config(16);
    kv_prefill_config_t pc;
    kv_route_request_t rq = request(128, 16);
    kv_prefill_result_t r;

    kv_prefill_config_init(&pc);
    idle(s, 2);
    s[0].usable = 0;
    s[1].usable = 0;
    CHECK(kv_prefill_pick(s, 2, &rq, 0, &pc, &cfg, 0, &r) == -1);
    CHECK(r.why == KV_PREFILL_LOCAL_NONE);
    CHECK_STR(kv_prefill_why_name(r.why), "none");

    CHECK(kv_prefill_pick(s, 0, &rq, 0, &pc, &cfg, 0, &r) == -1);
    CHECK(r.why == KV_PREFILL_LOCAL_NONE);

    idle(s, 2);
    cfg.busy_prefill_tokens = 8192;
    s[0].prefill_tokens = 9000;
    s[1].prefill_tokens = 8192;
    CHECK(kv_prefill_pick(s, 2, &rq, 0, &pc, &cfg, 0, &r) == -1);
    CHECK(r.why == KV_PREFILL_LOCAL_BUSY);
    CHECK_STR(kv_prefill_why_name(r.why), "busy");
    s[1].prefill_tokens = 100;
    CHECK(kv_prefill_pick(s, 2, &rq, 0, &pc, &cfg, 0, &r) == 1);
}

int main(void)
{
    RUN(short_uncached_part_stays_local);
    RUN(prefill_server_by_overlap);
    RUN(prefill_server_by_load);
    RUN(dead_or_busy_pool_is_local);
    return kvt_done();
}
