/* Routing cost, tie-breaks, temperature and busy thresholds. */
#include "kvtest.h"
#include "kv_score.h"

static kv_score_config_t cfg = { 1.0, 0.0, 16, 0, 0 };

TEST(overlap_wins_when_idle)
{
    kv_candidate_t c[3] = {
        { 1, 1, 0, 0, 0, 0, 0, 0 }, { 1, 1, 8, 8, 0, 0, 0, 0 }, { 1, 1, 2, 2, 0, 0, 0, 0 },
    };
    CHECK(kv_score_pick(c, 3, 160, &cfg, 0) == 1);
    /* 10 prompt blocks, 8 cached: prefill 2 blocks + decode 2 new blocks */
    CHECK(c[1].cost == 4.0);
    CHECK(c[0].cost == 20.0);
}

TEST(load_pushes_away)
{
    kv_candidate_t c[2] = {
        { 1, 1, 8, 8, 4096, 200, 0, 0 }, { 1, 1, 0, 0, 0, 0, 0, 0 },
    };
    CHECK(kv_score_pick(c, 2, 160, &cfg, 0) == 1);
}

TEST(weight_divides_cost)
{
    kv_candidate_t c[2] = {
        { 1, 1, 0, 0, 0, 30, 0, 0 }, { 1, 2, 0, 0, 0, 50, 0, 0 },
    };
    CHECK(kv_score_pick(c, 2, 16, &cfg, 0) == 1);
}

TEST(ties_go_to_smaller_tree_then_rotate)
{
    kv_candidate_t c[2] = { { 1, 1, 0, 9, 0, 0, 0, 0 }, { 1, 1, 0, 3, 0, 0, 0, 0 } };
    int seen[2] = { 0, 0 };
    uint64_t r;

    CHECK(kv_score_pick(c, 2, 32, &cfg, 0) == 1);
    c[0].tree_blocks = 3;
    for (r = 0; r < 8; r++) seen[kv_score_pick(c, 2, 32, &cfg, r)]++;
    CHECK(seen[0] > 0 && seen[1] > 0);
}

TEST(unusable_and_busy)
{
    kv_score_config_t busy = cfg;
    kv_candidate_t c[2] = { { 0, 1, 9, 0, 0, 0, 0, 0 }, { 1, 1, 0, 0, 100, 0, 0, 0 } };

    CHECK(kv_score_pick(c, 2, 16, &cfg, 0) == 1);
    busy.busy_prefill_tokens = 100;
    CHECK(kv_score_pick(c, 2, 16, &busy, 0) == KV_SCORE_BUSY);
    c[1].usable = 0;
    CHECK(kv_score_pick(c, 2, 16, &busy, 0) == KV_SCORE_NONE);
}

TEST(temperature_spreads)
{
    kv_score_config_t hot = cfg;
    kv_candidate_t c[2] = { { 1, 1, 10, 0, 0, 0, 0, 0 }, { 1, 1, 0, 0, 0, 0, 0, 0 } };
    int seen[2] = { 0, 0 }, i;
    uint64_t x = 88172645463325252ULL;

    hot.temperature = 1.0;
    for (i = 0; i < 2000; i++) {
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
        seen[kv_score_pick(c, 2, 160, &hot, x)]++;
    }
    /* p(best) = 1 / (1 + e^-1) = 0.731 */
    CHECK(seen[0] > 1300 && seen[0] < 1620);
    for (i = 0; i < 100; i++) CHECK(kv_score_pick(c, 2, 160, &cfg, (uint64_t) i) == 0);
}

int main(void)
{
    RUN(overlap_wins_when_idle);
    RUN(load_pushes_away);
    RUN(weight_divides_cost);
    RUN(ties_go_to_smaller_tree_then_rotate);
    RUN(unusable_and_busy);
    RUN(temperature_spreads);
    return kvt_done();
}
