/* A branch off a shared head (kv_route.c, pick_shared): a request whose
 * longest cached prefix is held by two servers or more (a system prompt)
 * starts a conversation of its own, and goes to a holder only while the
 * holder is within the bounded-load capacity ceil((1 + slack) x (requests
 * in flight + 1) / servers); otherwise it seeds a new server by the spill
 * order. A continuation (its prefix held by one server) sticks as before
 * (issue 18, docs/BENCHMARKS.md "Routing round 7"). The rule acts only while
 * the fleet runs at most (1 + slack) requests a server, this one included
 * (issue 16, "Routing round 8"). A server whose indexed blocks are above
 * (1 + slack) x the candidates' mean + the branch's own takes no branch (the
 * resident bound, issue 18, "Scale-out round 6"). At block sizes 16, 32
 * and 64. */
#include "kvtest.h"
#include "route_fleet.h"
#include "kv_route.h"

#define BIG    64
#define HEAD   48                       /* blocks of the shared head */
#define BLOCKS 56                       /* the prompt: the head and its own 8 */
#define CONVERSATIONS 48
#define LIFE   40                       /* a conversation's own blocks over its turns */

static const uint32_t sizes[] = { 16, 32, 64 };

static void idle(kv_route_server_t *s, size_t n)
{
    route_fleet_idle(s, n, 5100, 37);
}

static void prompt(uint64_t *q, uint64_t head, uint64_t own)
{
    for (int k = 0; k < BLOCKS; k++) {
        q[k] = k < HEAD ? head * 1000003u + k : own * 7919u + k;
    }
}

/* 64 servers, the head held by two of them, each running one request,
 * the rest idle: the new branch goes to an idle server (a spill, seeding
 * it), the same one whatever the order the servers are listed in. On main
 * it stuck to a holder. */
TEST(branch_leaves_busy_holders_for_an_idle_server)
{
    for (size_t z = 0; z < sizeof(sizes) / sizeof(sizes[0]); z++) {
        uint32_t            bs = sizes[z];
        kv_route_config_t   cfg = route_fleet_config(bs);
        kv_route_server_t   s[BIG], t[BIG];
        kv_route_result_t   r;
        uint64_t            q[BLOCKS];
        kv_route_request_t  rq = { BLOCKS * bs, q, BLOCKS, 0, 0, 1, 0, 0, 0 };
        int                 a, b;

        prompt(q, 3, 1);
        idle(s, BIG);
        for (int i = 0; i < 2; i++) {
            s[i * 9].overlap_index = HEAD;
            s[i * 9].requests = 1;
            s[i * 9].tree_blocks = 400;
        }
        for (int i = 0; i < BIG; i++) {
            t[BIG - 1 - i] = s[i];
        }
        a = kv_route_pick(s, BIG, &rq, &cfg, 1, &r);
        CHECK(r.why == KV_ROUTE_WHY_SEED);
        CHECK_STR(kv_route_why_name(r.why), "seed");
        CHECK(a >= 0 && s[a].requests == 0 && s[a].overlap_index == 0);
        b = kv_route_pick(t, BIG, &rq, &cfg, 77, &r);
        CHECK(a >= 0 && b >= 0 && s[a].id == t[b].id);
    }
}

/* A seed goes to the server holding the fewest blocks, which the caller
 * must read for every candidate when kv_route_why_reads_blocks() says so:
 * nginx reads only the holders' counts before the first decision, and
 * once 'seed' was told apart from 'spill' it no longer read the others'
 * for seeds, so rendezvous alone placed them (64 engines: 11-13 engines
 * without a request against 2-5, docs/BENCHMARKS.md "Scale-out round
 * 5"). This drives the same two passes: the seed is the one server
 * holding nothing, whatever rendezvous says. */
TEST(seed_decided_again_with_every_server_blocks)
{
    for (size_t z = 0; z < sizeof(sizes) / sizeof(sizes[0]); z++) {
        uint32_t            bs = sizes[z];
        kv_route_config_t   cfg = route_fleet_config(bs);
        kv_route_server_t   s[BIG];
        kv_route_result_t   r;
        uint64_t            q[BLOCKS];
        kv_route_request_t  rq = { BLOCKS * bs, q, BLOCKS, 0, 0, 1, 0, 0, 0 };

        for (int empty = 30; empty < 34; empty++) {
            prompt(q, 8 + empty, 6);
            idle(s, BIG);
            for (int i = 0; i < 2; i++) {
                s[i * 9].overlap_index = HEAD;
                s[i * 9].requests = 1;
                s[i * 9].tree_blocks = 400;
            }
            kv_route_pick(s, BIG, &rq, &cfg, 1, &r);
            CHECK(r.why == KV_ROUTE_WHY_SEED);
            CHECK(kv_route_why_reads_blocks(r.why));
            for (int i = 0; i < BIG; i++) {
                if (s[i].overlap_index == 0) {
                    s[i].tree_blocks = i == empty ? 0 : 500;
                }
            }
            CHECK(kv_route_pick(s, BIG, &rq, &cfg, 1, &r) == empty);
            CHECK(r.why == KV_ROUTE_WHY_SEED);
        }
    }
    CHECK(kv_route_why_reads_blocks(KV_ROUTE_WHY_SPILL));
    CHECK(kv_route_why_reads_blocks(KV_ROUTE_WHY_SHARED));
    CHECK(!kv_route_why_reads_blocks(KV_ROUTE_WHY_STICKY));
    CHECK(!kv_route_why_reads_blocks(KV_ROUTE_WHY_COLD));
    CHECK(!kv_route_why_reads_blocks(KV_ROUTE_WHY_SESSION));
}

/* A holder with room (nothing in flight) takes the branch: the head is
 * reused while it costs no balance. */
TEST(branch_sticks_to_a_holder_with_room)
{
    for (size_t z = 0; z < sizeof(sizes) / sizeof(sizes[0]); z++) {
        uint32_t            bs = sizes[z];
        kv_route_config_t   cfg = route_fleet_config(bs);
        kv_route_server_t   s[BIG];
        kv_route_result_t   r;
        uint64_t            q[BLOCKS];
        kv_route_request_t  rq = { BLOCKS * bs, q, BLOCKS, 0, 0, 1, 0, 0, 0 };

        prompt(q, 4, 2);
        idle(s, BIG);
        s[5].overlap_index = HEAD;
        s[5].requests = 1;
        s[20].overlap_index = HEAD;     /* idle holder */
        CHECK(kv_route_pick(s, BIG, &rq, &cfg, 1, &r) == 20);
        CHECK(r.why == KV_ROUTE_WHY_SHARED);
        CHECK_STR(kv_route_why_name(r.why), "shared");
    }
}

/* A continuation: its conversation is held by one server (longer than the
 * head the others hold), which runs a request: it sticks, since moving it
 * would redo the whole conversation. */
TEST(continuation_sticks_though_its_server_is_busy)
{
    for (size_t z = 0; z < sizeof(sizes) / sizeof(sizes[0]); z++) {
        uint32_t            bs = sizes[z];
        kv_route_config_t   cfg = route_fleet_config(bs);
        kv_route_server_t   s[BIG];
        kv_route_result_t   r;
        uint64_t            q[BLOCKS];
        kv_route_request_t  rq = { BLOCKS * bs, q, BLOCKS, 0, 0, 1, 0, 0, 0 };

        prompt(q, 5, 3);
        idle(s, BIG);
        s[2].overlap_index = HEAD;
        s[2].requests = 1;
        s[11].overlap_index = BLOCKS - 2;
        s[11].requests = 1;
        CHECK(kv_route_pick(s, BIG, &rq, &cfg, 1, &r) == 11);
        CHECK(r.why == KV_ROUTE_WHY_STICKY);
    }
}

/* Under load (more than 1 + slack requests a server) the rule stands aside and the
 * sticky rule decides: 8 servers running 3 requests each, the head on two
 * of them; the branch sticks to a holder (main: the same holder, as a
 * "shared" decision within the capacity ceil(1.25 x 25 / 8) = 4). */
TEST(loaded_fleet_branch_sticks)
{
    for (size_t z = 0; z < sizeof(sizes) / sizeof(sizes[0]); z++) {
        uint32_t            bs = sizes[z];
        kv_route_config_t   cfg = route_fleet_config(bs);
        kv_route_server_t   s[8];
        kv_route_result_t   r;
        uint64_t            q[BLOCKS];
        kv_route_request_t  rq = { BLOCKS * bs, q, BLOCKS, 0, 0, 1, 0, 0, 0 };
        int                 a;

        prompt(q, 6, 4);
        idle(s, 8);
        for (int i = 0; i < 8; i++) {
            s[i].requests = 3;
        }
        s[1].overlap_index = HEAD;
        s[6].overlap_index = HEAD;
        a = kv_route_pick(s, 8, &rq, &cfg, 1, &r);
        CHECK(a == 1 || a == 6);
        CHECK(r.why == KV_ROUTE_WHY_STICKY);
    }
}

/*
 * Round 8: 8 servers at about two requests each, the head's two holders
 * running three with nothing queued (decoding). The capacity,
 * ceil(1.25 x 19 / 8) = 3, shut the holders out, and main seeded the head
 * on a server running two, redoing the 48-block head there for a 8-block
 * question that the holders' empty queues would have served at once (text's
 * and chat's lost hits, docs/BENCHMARKS.md "Routing round 8"). With more
 * than (1 + slack) requests a server in flight the rule stands aside: the
 * branch sticks to a holder (L's bound, 1.25 x 2.25 + 1, still admits it).
 */
TEST(loaded_fleet_branch_stays_on_a_busy_holder)
{
    for (size_t z = 0; z < sizeof(sizes) / sizeof(sizes[0]); z++) {
        uint32_t            bs = sizes[z];
        kv_route_config_t   cfg = route_fleet_config(bs);
        kv_route_server_t   s[8];
        kv_route_result_t   r;
        uint64_t            q[BLOCKS];
        kv_route_request_t  rq = { BLOCKS * bs, q, BLOCKS, 0, 0, 1, 0, 0, 0 };
        int                 a;

        prompt(q, 7, 5);
        idle(s, 8);
        for (int i = 0; i < 8; i++) {
            s[i].requests = 2;
            s[i].tree_blocks = 300;
        }
        s[1].overlap_index = HEAD;
        s[1].requests = 3;
        s[6].overlap_index = HEAD;
        s[6].requests = 3;
        a = kv_route_pick(s, 8, &rq, &cfg, 1, &r);
        CHECK(a == 1 || a == 6);
        CHECK(r.why == KV_ROUTE_WHY_STICKY);
        CHECK(r.overlap == HEAD);
    }
}

/* The boundary: 64 servers, 80 requests in flight (a request each, the
 * head's two holders and 14 others two): with this one, more than
 * (1 + slack) x 64 = 80, so the rule stands aside and the branch sticks to
 * a holder. Three servers fall idle (77 in flight, this one the 78th) and
 * it acts: the capacity, ceil(1.25 x 78 / 64) = 2, shuts the holders out
 * and the branch seeds an idle server. */
TEST(branch_seeds_only_near_a_request_a_server)
{
    for (size_t z = 0; z < sizeof(sizes) / sizeof(sizes[0]); z++) {
        uint32_t            bs = sizes[z];
        kv_route_config_t   cfg = route_fleet_config(bs);
        kv_route_server_t   s[BIG];
        kv_route_result_t   r;
        uint64_t            q[BLOCKS];
        kv_route_request_t  rq = { BLOCKS * bs, q, BLOCKS, 0, 0, 1, 0, 0, 0 };
        int                 a;

        prompt(q, 8, 6);
        idle(s, BIG);
        for (int i = 0; i < BIG; i++) {
            s[i].requests = i >= 48 && i < 62 ? 2 : 1;
        }
        s[3].overlap_index = HEAD;
        s[3].requests = 2;
        s[40].overlap_index = HEAD;
        s[40].requests = 2;
        a = kv_route_pick(s, BIG, &rq, &cfg, 1, &r);
        CHECK(a == 3 || a == 40);
        CHECK(r.why == KV_ROUTE_WHY_STICKY);

        s[17].requests = 0;
        s[29].requests = 0;
        s[33].requests = 0;
        a = kv_route_pick(s, BIG, &rq, &cfg, 1, &r);
        CHECK(a == 17 || a == 29 || a == 33);
        CHECK(r.why == KV_ROUTE_WHY_SEED);
    }
}

/*
 * New conversations over eight shared heads on 64 servers, arriving while
 * the earlier ones still run (each keeps one request in flight): every
 * head starts on two servers; each new branch goes to a holder with room
 * or seeds an idle server. While the capacity is one request (48
 * conversations: ceil(1.25 x 49 / 64) = 1) each runs on a server of its
 * own, where the sticky rule alone (main) put them on the heads' holders
 * up to L's bound (mean x 1.25 + 1) and left much of the fleet idle.
 */
TEST(new_conversations_cover_the_fleet)
{
    for (size_t z = 0; z < sizeof(sizes) / sizeof(sizes[0]); z++) {
        uint32_t            bs = sizes[z];
        kv_route_config_t   cfg = route_fleet_config(bs);
        kv_route_server_t   s[BIG];
        kv_route_result_t   r;
        uint64_t            q[BLOCKS], running[BIG] = { 0 }, blocks[BIG] = { 0 };
        int                 holds[8][BIG], used = 0;

        memset(holds, 0, sizeof(holds));
        for (int h = 0; h < 8; h++) {
            holds[h][h] = 1;            /* two copies: the head is shared */
            holds[h][h + 8] = 1;
            blocks[h] += HEAD;
            blocks[h + 8] += HEAD;
        }
        for (int c = 0; c < CONVERSATIONS; c++) {
            int h = c % 8, a;

            prompt(q, 10 + h, 100 + c);
            kv_route_request_t rq = { BLOCKS * bs, q, BLOCKS, 0, 0, 1, 0, 0, 0 };

            idle(s, BIG);
            for (int i = 0; i < BIG; i++) {
                s[i].requests = running[i];
                s[i].tree_blocks = blocks[i];
                s[i].overlap_index = holds[h][i] ? HEAD : 0;
            }
            a = kv_route_pick(s, BIG, &rq, &cfg, 1, &r);
            CHECK(a >= 0);
            if (a < 0) {
                return;
            }
            if (running[a] == 0) {
                used++;
            }
            running[a]++;
            blocks[a] += BLOCKS;
            holds[h][a] = 1;
        }
        CHECK(used == CONVERSATIONS);
    }
}

/*
 * The resident bound (issue 18, docs/BENCHMARKS.md "Scale-out round 6"): a
 * holder with room takes a branch only while the blocks it holds per unit
 * of weight are within (1 + slack) x the fleet's mean + the branch's own
 * blocks. Two idle holders, one far above the fleet's blocks: the other
 * takes the branch; both far above: it seeds a server holding the fewest
 * (within a prompt), the same one whatever the order the servers are listed
 * in (instances agree).
 */
TEST(branch_leaves_holders_far_above_the_fleets_blocks)
{
    for (size_t z = 0; z < sizeof(sizes) / sizeof(sizes[0]); z++) {
        uint32_t            bs = sizes[z];
        kv_route_config_t   cfg = route_fleet_config(bs);
        kv_route_server_t   s[BIG], t[BIG];
        kv_route_result_t   r;
        uint64_t            q[BLOCKS];
        kv_route_request_t  rq = { BLOCKS * bs, q, BLOCKS, 0, 0, 1, 0, 0, 0 };
        int                 a, b;

        prompt(q, 12, 7);
        idle(s, BIG);
        for (int i = 0; i < BIG; i++) {
            s[i].tree_blocks = 200 + 10 * (uint64_t) (i * 7 % 13);
        }
        s[4].overlap_index = HEAD;
        s[4].tree_blocks = 1000;        /* mean about 272: bound about 348 */
        s[30].overlap_index = HEAD;
        s[30].tree_blocks = 340;
        CHECK(kv_route_pick(s, BIG, &rq, &cfg, 1, &r) == 30);
        CHECK(r.why == KV_ROUTE_WHY_SHARED);

        s[30].tree_blocks = 900;
        a = kv_route_pick(s, BIG, &rq, &cfg, 1, &r);
        CHECK(r.why == KV_ROUTE_WHY_SEED);
        CHECK(a >= 0 && s[a].overlap_index == 0 && s[a].tree_blocks < 200 + BLOCKS);
        for (int i = 0; i < BIG; i++) {
            t[BIG - 1 - i] = s[i];
        }
        b = kv_route_pick(t, BIG, &rq, &cfg, 99, &r);
        CHECK(a >= 0 && b >= 0 && s[a].id == t[b].id);

        /* weights: blocks per unit of weight; a holder of weight 4 holding
         * 900 blocks holds 225 a unit, within the bound */
        s[30].weight = 4;
        CHECK(kv_route_pick(s, BIG, &rq, &cfg, 1, &r) == 30);
        CHECK(r.why == KV_ROUTE_WHY_SHARED);
    }
}

/*
 * Full caches (every engine's cache full, as in a real cluster): the
 * blocks are equal everywhere, every holder is within the bound and the
 * rule is the one before it: the idle holder takes the branch.
 */
TEST(full_caches_branch_sticks_to_a_holder)
{
    for (size_t z = 0; z < sizeof(sizes) / sizeof(sizes[0]); z++) {
        uint32_t            bs = sizes[z];
        kv_route_config_t   cfg = route_fleet_config(bs);
        kv_route_server_t   s[BIG];
        kv_route_result_t   r;
        uint64_t            q[BLOCKS];
        kv_route_request_t  rq = { BLOCKS * bs, q, BLOCKS, 0, 0, 1, 0, 0, 0 };

        prompt(q, 13, 8);
        idle(s, BIG);
        for (int i = 0; i < BIG; i++) {
            s[i].tree_blocks = 16384;
        }
        s[9].overlap_index = HEAD;
        s[9].requests = 1;
        s[41].overlap_index = HEAD;
        CHECK(kv_route_pick(s, BIG, &rq, &cfg, 1, &r) == 41);
        CHECK(r.why == KV_ROUTE_WHY_SHARED);
    }
}

/*
 * Conversations that arrive one at a time on an idle fleet (each done
 * before the next: no request in flight to tell the servers apart), over
 * eight heads each held by two servers; each conversation stores LIFE
 * blocks of its own over its turns. Without the resident bound every
 * branch goes to an idle holder, so the 16 first holders take all 192
 * conversations (12 each) and 48 servers none; with it a holder takes a
 * branch only while its blocks are within the bound, the others are
 * seeded, and no server ends far above the mean.
 */
TEST(idle_fleet_conversations_spread_by_blocks)
{
    for (size_t z = 0; z < sizeof(sizes) / sizeof(sizes[0]); z++) {
        uint32_t            bs = sizes[z];
        kv_route_config_t   cfg = route_fleet_config(bs);
        kv_route_server_t   s[BIG];
        kv_route_result_t   r;
        uint64_t            q[BLOCKS], blocks[BIG] = { 0 }, total = 0, most = 0;
        int                 holds[8][BIG], convs[BIG] = { 0 }, used = 0, seeds = 0;

        memset(holds, 0, sizeof(holds));
        for (int h = 0; h < 8; h++) {
            holds[h][h] = 1;
            holds[h][h + 8] = 1;
            blocks[h] += HEAD;
            blocks[h + 8] += HEAD;
            total += 2 * HEAD;
        }
        for (int c = 0; c < 192; c++) {
            int h = c % 8, a;

            prompt(q, 20 + h, 300 + c);
            kv_route_request_t rq = { BLOCKS * bs, q, BLOCKS, 0, 0, 1, 0, 0, 0 };

            idle(s, BIG);
            for (int i = 0; i < BIG; i++) {
                s[i].tree_blocks = blocks[i];
                s[i].overlap_index = holds[h][i] ? HEAD : 0;
            }
            a = kv_route_pick(s, BIG, &rq, &cfg, 1, &r);
            CHECK(a >= 0);
            if (a < 0) {
                return;
            }
            CHECK(blocks[a] <= 1.25 * (double) total / BIG + BLOCKS - HEAD);
            seeds += r.why == KV_ROUTE_WHY_SEED;
            used += convs[a]++ == 0;
            blocks[a] += (holds[h][a] ? 0 : HEAD) + LIFE;
            total += (holds[h][a] ? 0 : HEAD) + LIFE;
            holds[h][a] = 1;
        }
        for (int i = 0; i < BIG; i++) {
            most = blocks[i] > most ? blocks[i] : most;
        }
        CHECK(used > 32);
        CHECK(seeds > 0);
        CHECK(most <= 1.5 * (double) total / BIG);
    }
}

int main(void)
{
    RUN(branch_leaves_busy_holders_for_an_idle_server);
    RUN(seed_decided_again_with_every_server_blocks);
    RUN(branch_sticks_to_a_holder_with_room);
    RUN(continuation_sticks_though_its_server_is_busy);
    RUN(loaded_fleet_branch_sticks);
    RUN(loaded_fleet_branch_stays_on_a_busy_holder);
    RUN(branch_seeds_only_near_a_request_a_server);
    RUN(new_conversations_cover_the_fleet);
    RUN(branch_leaves_holders_far_above_the_fleets_blocks);
    RUN(full_caches_branch_sticks_to_a_holder);
    RUN(idle_fleet_conversations_spread_by_blocks);
    return kvt_done();
}
