/* The spill rule (kv_route.c, pick_spill): when every server holding a
 * prefix is saturated, the request goes to the server of E with the fewest
 * requests in flight, then the fewest indexed blocks (give or take one
 * prompt's), then the prefix's rendezvous order, so hot prefixes spread over
 * the whole fleet rather than over the few servers each one's rendezvous
 * order ranks first (issue 18,
 * docs/BENCHMARKS.md "Scale-out round 4"). */
#include "kvtest.h"
#include "route_fleet.h"
#include "kv_route.h"

#define N      8
#define BIG    64
#define BLOCKS 64                       /* the prompt: 64 blocks of 16 tokens */

static void idle(kv_route_server_t *s, size_t n)
{
    route_fleet_idle(s, n, 7300, 29);
}

static kv_route_config_t config(void)
{
    return route_fleet_config(16);
}

/* s[i] holds the whole prompt and has so much prefill queued that its
 * estimate is far outside the slack of an idle server's: saturated. */
static void saturate(kv_route_server_t *s)
{
    s->overlap_index = BLOCKS;
    s->prefill_tokens = 8 * BLOCKS * 16;
}

/* The holder saturated, the others holding other prompts' blocks except
 * one: the spill goes to the one holding nothing, in any server order. */
TEST(spill_goes_to_the_server_holding_least)
{
    kv_route_config_t  cfg = config();
    kv_route_server_t  s[N], t[N];
    kv_route_result_t  r;
    uint64_t           q[BLOCKS];

    for (int k = 0; k < BLOCKS; k++) {
        q[k] = 0x5eed + k;
    }
    for (int empty = 1; empty < N; empty++) {
        kv_route_request_t rq = { BLOCKS * 16, q, BLOCKS, 0, 0, 1, 0, 0, 0 };
        int                a, b;

        idle(s, N);
        saturate(&s[0]);
        for (int i = 1; i < N; i++) {
            s[i].tree_blocks = i == empty ? 0 : 100 + i;
            t[N - 1 - i] = s[i];
        }
        t[N - 1] = s[0];
        a = kv_route_pick(s, N, &rq, &cfg, 1, &r);
        CHECK(r.why == KV_ROUTE_WHY_SPILL);
        CHECK(a == empty);
        b = kv_route_pick(t, N, &rq, &cfg, 99, &r);
        CHECK(b >= 0 && t[b].id == s[a].id);
    }
}

/* Fewer requests in flight come before fewer blocks: the spill is for
 * load, so a server with a request in flight is passed over for an idle
 * one, even one holding more. */
TEST(idle_server_before_emptier_busy_one)
{
    kv_route_config_t   cfg = config();
    kv_route_server_t   s[N];
    kv_route_result_t   r;
    uint64_t            q[BLOCKS];
    kv_route_request_t  rq = { BLOCKS * 16, q, BLOCKS, 0, 0, 1, 0, 0, 0 };

    for (int k = 0; k < BLOCKS; k++) {
        q[k] = 0xbead + k;
    }
    idle(s, N);
    saturate(&s[0]);
    for (int i = 1; i < N; i++) {
        s[i].tree_blocks = 500 + i;
        s[i].requests = 1;
    }
    s[3].tree_blocks = 0;               /* emptiest, but busy */
    s[5].requests = 0;                  /* idle, holding 505 */
    CHECK(kv_route_pick(s, N, &rq, &cfg, 1, &r) == 5);
    CHECK(r.why == KV_ROUTE_WHY_SPILL);
}

/* Blocks count per unit of weight: a server of weight 2 holding 300 blocks
 * holds less per unit than one of weight 1 holding 300, by more than one
 * prompt's blocks. */
TEST(blocks_per_unit_of_weight)
{
    kv_route_config_t   cfg = config();
    kv_route_server_t   s[3];
    kv_route_result_t   r;
    uint64_t            q[BLOCKS];
    kv_route_request_t  rq = { BLOCKS * 16, q, BLOCKS, 0, 0, 1, 0, 0, 0 };

    for (int k = 0; k < BLOCKS; k++) {
        q[k] = 0xfeed + k;
    }
    idle(s, 3);
    saturate(&s[0]);
    s[1].tree_blocks = 300;
    s[2].tree_blocks = 300;
    s[2].weight = 2;
    CHECK(kv_route_pick(s, 3, &rq, &cfg, 1, &r) == 2);
    CHECK(r.why == KV_ROUTE_WHY_SPILL);
}

/*
 * Eight hot prefixes over 64 servers, each spilling in turn: each spill
 * adds its target to the prefix's set (it then holds the prompt, and is
 * saturated by the time the prefix spills again). Every server joins some
 * set before any server joins a second one, whatever the hashes; the
 * rendezvous order alone left about a third of such a fleet in no set
 * (docs/BENCHMARKS.md, "Scale-out round 3").
 */
TEST(hot_prefixes_cover_the_fleet)
{
    kv_route_config_t  cfg = config();
    kv_route_server_t  s[BIG];
    kv_route_result_t  r;
    uint64_t           q[8][BLOCKS], blocks[BIG] = { 0 };
    int                member[8][BIG], sets[BIG] = { 0 };

    memset(member, 0, sizeof(member));
    for (int p = 0; p < 8; p++) {
        for (int k = 0; k < BLOCKS; k++) {
            q[p][k] = (uint64_t) (p + 1) * 1000003u + k;
        }
        member[p][p] = 1;               /* each prefix starts on one server */
        sets[p] = 1;
        blocks[p] = BLOCKS;
    }
    for (int round = 0; round < BIG - 8; round++) {
        int                 p = round % 8, a;
        kv_route_request_t  rq = { BLOCKS * 16, q[p], BLOCKS, 0, 0, 1, 0, 0, 0 };

        idle(s, BIG);
        for (int i = 0; i < BIG; i++) {
            s[i].tree_blocks = blocks[i];
            if (member[p][i]) {
                saturate(&s[i]);
            }
        }
        a = kv_route_pick(s, BIG, &rq, &cfg, 1, &r);
        CHECK(r.why == KV_ROUTE_WHY_SPILL);
        CHECK(a >= 0 && sets[a] == 0);
        if (a < 0) {
            return;
        }
        member[p][a] = 1;
        sets[a]++;
        blocks[a] += BLOCKS;
    }
    for (int i = 0; i < BIG; i++) {
        CHECK(sets[i] == 1);
    }
}

/* Prefixes spilling at once (several nginx instances, none of which has
 * heard of the others' spills yet) onto an idle fleet of empty servers go
 * to different ones, by each prefix's rendezvous order, not all to one;
 * and a server holding more than one prompt's blocks above the emptiest is
 * never chosen while those are idle. */
TEST(simultaneous_spills_of_distinct_prefixes_spread)
{
    kv_route_config_t  cfg = config();
    kv_route_server_t  s[16];
    kv_route_result_t  r;
    uint64_t           q[BLOCKS];
    int                hit[16] = { 0 }, distinct = 0;

    for (int p = 0; p < 8; p++) {
        kv_route_request_t rq = { BLOCKS * 16, q, BLOCKS, 0, 0, 1, 0, 0, 0 };
        int                a;

        for (int k = 0; k < BLOCKS; k++) {
            q[k] = (uint64_t) (p + 11) * 7777777u + k;
        }
        idle(s, 16);
        saturate(&s[0]);
        for (int i = 8; i < 16; i++) {
            s[i].tree_blocks = BLOCKS + 1;     /* more than a prompt above the empty */
        }
        a = kv_route_pick(s, 16, &rq, &cfg, 1, &r);
        CHECK(r.why == KV_ROUTE_WHY_SPILL);
        CHECK(a >= 1 && a < 8);
        if (a >= 0 && !hit[a]++) {
            distinct++;
        }
    }
    CHECK(distinct >= 3);
}

/* The set grows only while its members are saturated: once the spill's
 * target holds the prompt and has room, the next request sticks to it.
 * The fleet runs two requests a server, so the rule for a branch off a
 * shared head (kv_route.c, pick_shared; two servers now hold the prompt)
 * stands aside and the sticky rule decides (routing round 8; before it, a
 * "shared" decision within the bounded-load capacity, the same server). */
TEST(set_grows_only_when_saturated)
{
    kv_route_config_t   cfg = config();
    kv_route_server_t   s[N];
    kv_route_result_t   r;
    uint64_t            q[BLOCKS];
    kv_route_request_t  rq = { BLOCKS * 16, q, BLOCKS, 0, 0, 1, 0, 0, 0 };
    int                 a;

    for (int k = 0; k < BLOCKS; k++) {
        q[k] = 0xcafe + k;
    }
    idle(s, N);
    saturate(&s[0]);
    a = kv_route_pick(s, N, &rq, &cfg, 1, &r);
    CHECK(a > 0 && r.why == KV_ROUTE_WHY_SPILL);
    if (a <= 0) {
        return;
    }

    idle(s, N);
    for (int i = 0; i < N; i++) {
        s[i].requests = 2;
    }
    saturate(&s[0]);
    s[a].overlap_pending = BLOCKS;      /* the decision just made */
    CHECK(kv_route_pick(s, N, &rq, &cfg, 2, &r) == a);
    CHECK(r.why == KV_ROUTE_WHY_STICKY);
}

int main(void)
{
    RUN(spill_goes_to_the_server_holding_least);
    RUN(idle_server_before_emptier_busy_one);
    RUN(blocks_per_unit_of_weight);
    RUN(hot_prefixes_cover_the_fleet);
    RUN(simultaneous_spills_of_distinct_prefixes_spread);
    RUN(set_grows_only_when_saturated);
    return kvt_done();
}
