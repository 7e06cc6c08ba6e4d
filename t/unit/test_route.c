/* The routing decision (kv_route.c), driven with recorded overlap and load
 * at block sizes 16, 32 and 64. */
#include <math.h>
#include "kvtest.h"
#include "route_fleet.h"
#include "kv_route.h"

static const uint32_t sizes[] = { 16, 32, 64 };
static const uint64_t seq[12] = { 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112 };

static kv_route_config_t config(kv_route_policy_t policy, uint32_t bs)
{
    kv_route_config_t cfg;

    kv_route_config_init(&cfg);
    cfg.policy = policy;
    cfg.block_size = bs;
    cfg.decode_pace = 1e-9;     /* no floor under the slack unless a test sets one */
    return cfg;
}

static void idle(kv_route_server_t *s, size_t n)
{
    route_fleet_idle(s, n, 7000, 1);
}

static kv_route_request_t request(uint64_t blocks, uint32_t bs)
{
    kv_route_request_t rq = { blocks * bs, seq, blocks, 0, 0, 1, 0, 0, 0 };

    return rq;
}

/* Dynamo: holder of 10 of 12 blocks with X queued prefill tokens costs
 * X/bs + 2 + 2, an idle server 12 + 12: the holder wins below 20 blocks
 * of queue, whatever the block size. */
TEST(dynamo_threshold_scales_with_block_size)
{
    for (size_t k = 0; k < 3; k++) {
        uint32_t bs = sizes[k];
        kv_route_config_t cfg = config(KV_ROUTE_DYNAMO, bs);
        kv_route_request_t rq = request(12, bs);
        kv_route_server_t s[2];
        kv_route_result_t r;

        idle(s, 2);
        s[0].overlap_index = 10;
        s[0].prefill_tokens = 19 * bs;
        CHECK(kv_route_pick(s, 2, &rq, &cfg, 0, &r) == 0);
        CHECK(r.estimate == 19 + 4);
        CHECK_EQ_U64(r.prefill_tokens, 2 * bs);
        CHECK_EQ_U64(r.decode_blocks, 12);
        s[0].prefill_tokens = 21 * bs;
        CHECK(kv_route_pick(s, 2, &rq, &cfg, 0, &r) == 1);
        CHECK(r.estimate == 24);
        CHECK(r.why == KV_ROUTE_WHY_COST);
    }
}

TEST(dynamo_ties_go_to_the_smaller_tree)
{
    kv_route_config_t cfg = config(KV_ROUTE_DYNAMO, 16);
    kv_route_request_t rq = request(4, 16);
    kv_route_server_t s[2];
    kv_route_result_t r;

    for (uint64_t rnd = 0; rnd < 8; rnd++) {
        idle(s, 2);
        s[0].tree_blocks = 900;
        s[1].tree_blocks = 30;
        CHECK(kv_route_pick(s, 2, &rq, &cfg, rnd, &r) == 1);
    }
}

/* TTFT: holder of 10 of 12 blocks with Q queued tokens estimates
 * (Q + 2 bs) / rate, an idle server 12 bs / rate; the holder stays while
 * within the slack (1.25) plus the prefill its prefix spares (10 bs: a
 * spill redoes it, delaying what queues behind it there): Q <= 23 bs;
 * then the prefix spills. Without the credit it spilled past 13 bs. */
TEST(ttft_sticky_until_saturated)
{
    for (size_t k = 0; k < 3; k++) {
        uint32_t bs = sizes[k];
        kv_route_config_t cfg = config(KV_ROUTE_TTFT, bs);
        kv_route_request_t rq = request(12, bs);
        kv_route_server_t s[2];
        kv_route_result_t r;

        idle(s, 2);
        s[0].overlap_index = 10;
        s[0].requests = 1;
        s[0].prefill_tokens = 22 * bs;
        CHECK(kv_route_pick(s, 2, &rq, &cfg, 0, &r) == 0);
        CHECK(r.why == KV_ROUTE_WHY_STICKY);
        CHECK(fabs(r.estimate - 24.0 * bs / cfg.prefill_rate) < 1e-9);
        CHECK_EQ_U64(r.prefill_tokens, 2 * bs);
        CHECK_EQ_U64(r.queued_tokens, 22 * bs);
        s[0].prefill_tokens = 24 * bs;
        CHECK(kv_route_pick(s, 2, &rq, &cfg, 0, &r) == 1);
        CHECK(r.why == KV_ROUTE_WHY_SPILL);
        CHECK_EQ_U64(r.prefill_tokens, 12 * bs);
    }
}

TEST(ttft_longest_prefix_within_the_slack)
{
    kv_route_config_t cfg = config(KV_ROUTE_TTFT, 32);
    kv_route_request_t rq = request(12, 32);
    kv_route_server_t s[3];
    kv_route_result_t r;

    idle(s, 3);
    s[0].overlap_index = 6;
    s[1].overlap_index = 8;
    s[1].prefill_tokens = 3 * 32;       /* (3 + 4) vs (0 + 6) blocks: within 1.25 */
    CHECK(kv_route_pick(s, 3, &rq, &cfg, 0, &r) == 1);
    CHECK(r.overlap == 8);
}

TEST(ttft_learned_rate_counts)
{
    kv_route_config_t cfg = config(KV_ROUTE_TTFT, 64);
    kv_route_request_t rq = request(10, 64);
    kv_route_server_t s[2];
    kv_route_result_t r;

    idle(s, 2);
    s[0].overlap_index = 10;            /* fully cached, but a slow queue */
    s[0].prefill_tokens = 6400;
    s[0].prefill_rate = 10;             /* 640 ms */
    s[1].prefill_rate = 100;            /* 640 tokens at 100/ms: 6.4 ms */
    CHECK(kv_route_pick(s, 2, &rq, &cfg, 0, &r) == 1);
    CHECK(fabs(r.estimate - 6.4) < 1e-9);
    s[0].prefill_rate = 1000;           /* 6.4 ms too: the cache wins */
    CHECK(kv_route_pick(s, 2, &rq, &cfg, 0, &r) == 0);
    CHECK_EQ_U64(r.prefill_tokens, 0);
}

/* Two servers cache the same prefix: the one whose first token comes
 * sooner wins, whatever their learned decode paces. Output tokens x pace
 * used to break this tie: learned paces of identical engines differ by a
 * third (9-12 ms a token on Mooncake's conversation trace), which over a
 * few hundred output tokens outweighed any queue, so a new conversation
 * went behind a long prefill on the server that had learned the lowest
 * pace (docs/BENCHMARKS.md, "Routing round 12"). */
TEST(ttft_equal_prefix_goes_to_the_sooner_first_token)
{
    for (size_t k = 0; k < 3; k++) {
        uint32_t bs = sizes[k];
        kv_route_config_t cfg = config(KV_ROUTE_TTFT, bs);
        kv_route_request_t rq = request(12, bs);
        kv_route_server_t s[2];
        kv_route_result_t r;

        idle(s, 2);
        for (int i = 0; i < 2; i++) {
            s[i].overlap_index = 4;
            s[i].requests = 1;          /* past the shared head's gate */
        }
        s[0].decode_pace = 30;          /* 256 x 30 ms, nothing queued */
        s[1].decode_pace = 10;          /* 256 x 10 ms, 4 blocks queued */
        s[1].prefill_tokens = 4 * bs;
        CHECK(kv_route_pick(s, 2, &rq, &cfg, 0, &r) == 0);
        CHECK(r.why == KV_ROUTE_WHY_STICKY);
        s[0].prefill_tokens = 5 * bs;   /* now its queue is the longer */
        CHECK(kv_route_pick(s, 2, &rq, &cfg, 0, &r) == 1);
    }
}

/* Nobody holds the prefix: the fewest requests, then the rendezvous order
 * of its first block, the same whatever the order of the servers or the
 * random draw (independent routers agree). */
TEST(ttft_cold_rendezvous_agrees)
{
    kv_route_config_t cfg = config(KV_ROUTE_TTFT, 16);
    kv_route_server_t s[4], t[4];
    kv_route_result_t r;
    int seen[4] = { 0, 0, 0, 0 };

    for (uint64_t first = 1; first <= 64; first++) {
        uint64_t q[2] = { first * 7919, 5 };
        kv_route_request_t rq = { 32, q, 2, 0, 0, 1, 0, 0, 0 };
        int a, b;

        idle(s, 4);
        a = kv_route_pick(s, 4, &rq, &cfg, first, &r);
        CHECK(r.why == KV_ROUTE_WHY_COLD);
        for (int i = 0; i < 4; i++) {
            t[i] = s[3 - i];
        }
        b = kv_route_pick(t, 4, &rq, &cfg, first * 3, &r);
        CHECK(a >= 0 && b >= 0 && s[a].id == t[b].id);
        seen[a]++;
    }
    for (int i = 0; i < 4; i++) {
        CHECK(seen[i] > 4);             /* spread, not pinned */
    }

    {
        kv_route_request_t rq = request(2, 16);

        idle(s, 4);
        s[0].requests = s[1].requests = s[2].requests = 1;
        CHECK(kv_route_pick(s, 4, &rq, &cfg, 0, &r) == 3);
    }
}

/* A hot prefix whose holder saturated goes to the same next server every
 * time (rendezvous among the eligible), so its set stays small and warm. */
TEST(ttft_hot_prefix_spills_to_one_next_server)
{
    kv_route_config_t cfg = config(KV_ROUTE_TTFT, 64);
    kv_route_request_t rq = request(12, 64);
    kv_route_server_t s[6];
    kv_route_result_t r;
    int first = -1;

    for (uint64_t rnd = 0; rnd < 16; rnd++) {
        idle(s, 6);
        s[2].overlap_index = 12;
        s[2].prefill_tokens = 100000;
        kv_route_pick(s, 6, &rq, &cfg, rnd, &r);
        CHECK(r.why == KV_ROUTE_WHY_SPILL && r.pick != 2);
        if (first < 0) {
            first = r.pick;
        }
        CHECK(r.pick == first);
    }
    /* once that one holds it too, it is sticky there */
    idle(s, 6);
    s[2].overlap_index = 12;
    s[2].prefill_tokens = 100000;
    s[first].overlap_pending = 12;
    CHECK(kv_route_pick(s, 6, &rq, &cfg, 0, &r) == first);
    CHECK(r.why == KV_ROUTE_WHY_SHARED);        /* two hold it now: a shared head */
}

TEST(requests_bound_spreads_decode)
{
    kv_route_config_t cfg = config(KV_ROUTE_TTFT, 16);
    kv_route_request_t rq = request(4, 16);
    kv_route_server_t s[4];
    kv_route_result_t r;

    idle(s, 4);
    s[0].overlap_index = 4;             /* fully cached, but 12 requests decoding */
    s[0].requests = 12;
    s[1].requests = s[2].requests = s[3].requests = 2;
    CHECK(kv_route_pick(s, 4, &rq, &cfg, 0, &r) != 0);
    s[0].requests = 4;                  /* mean 2.5: 4 <= 1.25 * 2.5 + 1 */
    CHECK(kv_route_pick(s, 4, &rq, &cfg, 0, &r) == 0);
}

/* Estimates less than one output token's time apart are equal: a short
 * prompt goes to the server with fewer requests even if another has a
 * slightly shorter prefill queue. */
TEST(short_prompts_placed_by_load)
{
    kv_route_config_t cfg = config(KV_ROUTE_TTFT, 64);
    kv_route_request_t rq = request(4, 64);
    kv_route_server_t s[2];
    kv_route_result_t r;

    cfg.decode_pace = 20;               /* 160 tokens' worth at 8 tokens/ms */
    idle(s, 2);
    s[0].requests = 6;
    s[1].requests = 4;
    s[1].prefill_tokens = 128;          /* 384 vs 256 tokens: 16 ms apart */
    CHECK(kv_route_pick(s, 2, &rq, &cfg, 0, &r) == 1);
    CHECK(r.why == KV_ROUTE_WHY_COLD);
    s[1].prefill_tokens = 4096;         /* 544 ms apart: the queue counts */
    CHECK(kv_route_pick(s, 2, &rq, &cfg, 0, &r) == 0);
}

TEST(untrusted_index_pending_still_counts)
{
    for (int policy = 0; policy < 2; policy++) {
        kv_route_config_t cfg = config((kv_route_policy_t) policy, 16);
        kv_route_request_t rq = request(8, 16);
        kv_route_server_t s[2];
        kv_route_result_t r;

        idle(s, 2);
        s[0].overlap_index = 8;
        s[0].trusted = 0;
        s[1].overlap_index = 3;
        CHECK(kv_route_pick(s, 2, &rq, &cfg, 0, &r) == 1);
        CHECK(r.overlap == 3);
        s[0].overlap_pending = 6;
        CHECK(kv_route_pick(s, 2, &rq, &cfg, 0, &r) == 0);
        CHECK(r.overlap == 6);
    }
}

TEST(busy_and_none)
{
    for (int policy = 0; policy < 2; policy++) {
        kv_route_config_t cfg = config((kv_route_policy_t) policy, 16);
        kv_route_request_t rq = request(4, 16);
        kv_route_server_t s[2];
        kv_route_result_t r;

        cfg.busy_prefill_tokens = 1000;
        idle(s, 2);
        s[0].prefill_tokens = 1000;
        s[1].prefill_tokens = 5000;
        CHECK(kv_route_pick(s, 2, &rq, &cfg, 0, &r) == KV_ROUTE_BUSY);
        s[1].prefill_tokens = 999;
        CHECK(kv_route_pick(s, 2, &rq, &cfg, 0, &r) == 1);
        /* the worker's report counts only with worker_load=max */
        s[1].reported = 1;
        s[1].reported_prefill_tokens = 4000;
        CHECK(kv_route_pick(s, 2, &rq, &cfg, 0, &r) == 1);
        cfg.worker_load = KV_ROUTE_LOAD_MAX;
        CHECK(kv_route_pick(s, 2, &rq, &cfg, 0, &r) == KV_ROUTE_BUSY);
        s[0].usable = s[1].usable = 0;
        CHECK(kv_route_pick(s, 2, &rq, &cfg, 0, &r) == KV_ROUTE_NONE);
    }
}

TEST(the_attempt_adds)
{
    kv_route_config_t cfg = config(KV_ROUTE_TTFT, 32);
    kv_route_request_t rq = { 100, seq, 3, 0, 0, 1, 0, 0, 0 };
    kv_route_server_t s[1];
    kv_route_result_t r;

    idle(s, 1);
    s[0].overlap_index = 2;
    CHECK(kv_route_pick(s, 1, &rq, &cfg, 0, &r) == 0);
    CHECK_EQ_U64(r.prefill_tokens, 36);
    CHECK_EQ_U64(r.decode_blocks, 4);              /* 100 tokens: 4 blocks of 32 held */
    CHECK_EQ_U64(r.decode_tokens, cfg.max_tokens); /* none asked: the default */
    rq.max_tokens = 17;
    kv_route_pick(s, 1, &rq, &cfg, 0, &r);
    CHECK_EQ_U64(r.decode_tokens, 17);
    rq.sequences = 8;                               /* n: 8 sequences decoded */
    kv_route_pick(s, 1, &rq, &cfg, 0, &r);
    CHECK_EQ_U64(r.decode_tokens, 8 * 17);
    CHECK_EQ_U64(r.decode_blocks, 4);               /* the prompt's blocks are shared */
    CHECK_STR(kv_route_why_name(r.why), "sticky");
    rq.batch_tokens = 70;                           /* a batch's other prompts */
    kv_route_pick(s, 1, &rq, &cfg, 0, &r);
    CHECK_EQ_U64(r.prefill_tokens, 36 + 70);        /* prefilled wherever it goes */
    CHECK_EQ_U64(r.decode_blocks, 4 + 3);           /* and their blocks held */
    rq.prefill_only = 1;                            /* an embedding: nothing decoded */
    kv_route_pick(s, 1, &rq, &cfg, 0, &r);
    CHECK_EQ_U64(r.decode_tokens, 0);
    CHECK_EQ_U64(r.prefill_tokens, 36 + 70);
    rq.max_tokens = 0;
    kv_route_pick(s, 1, &rq, &cfg, 0, &r);
    CHECK_EQ_U64(r.decode_tokens, 0);               /* not the default either */
}

/* A batch's other prompts are prefilled wherever it goes, at each server's
 * own rate: each estimate grows by their tokens over that rate. */
TEST(batch_at_the_servers_rate)
{
    kv_route_config_t  cfg = config(KV_ROUTE_TTFT, 16);
    kv_route_request_t rq = { 64, seq, 4, 0, 0, 1, 0, 0, 0 };
    kv_route_server_t  s[2];
    kv_route_result_t  r;
    double             one[2];

    idle(s, 2);
    s[0].prefill_rate = 1;                          /* tokens/ms */
    s[1].prefill_rate = 4;
    s[1].overlap_index = 2;
    kv_route_pick(s, 2, &rq, &cfg, 0, &r);
    one[0] = s[0].ttft;
    one[1] = s[1].ttft;
    rq.batch_tokens = 64 * 31;                      /* 32 prompts */
    kv_route_pick(s, 2, &rq, &cfg, 0, &r);
    CHECK(fabs(s[0].ttft - one[0] - 64 * 31 / 1.0) < 1e-6);
    CHECK(fabs(s[1].ttft - one[1] - 64 * 31 / 4.0) < 1e-6);
    CHECK(fabs(s[1].saved - 32 / 4.0) < 1e-6);      /* its cached blocks: the first's */
}

/* No reuse anywhere: least_conn's choice, the fewest requests in flight
 * per unit of weight; the estimate only keeps a request off a queue that
 * would more than double its time to first token. Block sizes 16-64. */
TEST(no_reuse_fewest_requests)
{
    for (size_t k = 0; k < 3; k++) {
        uint32_t bs = sizes[k];
        kv_route_config_t cfg = config(KV_ROUTE_TTFT, bs);
        kv_route_request_t rq = request(256 / bs, bs);
        kv_route_server_t s[3];
        kv_route_result_t r;

        cfg.decode_pace = 30;
        idle(s, 3);
        for (int i = 0; i < 3; i++) {
            s[i].prefill_rate = 256.0 / 40;
            s[i].prefill_base = 160;
            s[i].decode_pace = 30;
            s[i].requests = 8;
        }
        s[0].requests = 9;
        s[2].prefill_tokens = 256;              /* one short prompt queued: 40 ms */
        /* fewer requests win over the idle queue */
        s[2].requests = 7;
        CHECK(kv_route_pick(s, 3, &rq, &cfg, 0, &r) == 2);
        CHECK(fabs(r.estimate - (160 + 80)) < 1e-9);
        CHECK(fabs(s[2].cold - 7) < 1e-9 && fabs(s[1].cold - 8) < 1e-9);
        /* a long queue (1,640 ms against an own prefill of 200) is not */
        s[2].prefill_tokens = 40 * 256;
        CHECK(kv_route_pick(s, 3, &rq, &cfg, 0, &r) == 1);
        /* weights: 16 requests on weight 2 are 8 per unit, fewer than 9 */
        s[2].prefill_tokens = 0;
        s[2].requests = 16;
        s[2].weight = 2;
        s[2].prefill_rate = 2 * 256.0 / 40;
        s[1].requests = 9;
        CHECK(kv_route_pick(s, 3, &rq, &cfg, 0, &r) == 2);
    }
}

/* The learned lines of identical engines differ by 2x and more (round 3:
 * base 45-225 ms); for a cold request that noise must not outweigh a
 * request in flight: the server with fewer requests wins whatever line it
 * learned. Round 2's cold cost (own time to first token + requests x own
 * prefill) sent it to the low-base server with more requests (1,430 ms
 * against 3,530), up to the load bound. */
TEST(no_reuse_line_noise_does_not_decide)
{
    for (size_t k = 0; k < 3; k++) {
        uint32_t bs = sizes[k];
        kv_route_config_t cfg = config(KV_ROUTE_TTFT, bs);
        kv_route_request_t rq = request(256 / bs, bs);
        kv_route_server_t s[2];
        kv_route_result_t r;

        cfg.decode_pace = 30;
        idle(s, 2);
        s[0].prefill_rate = 3;
        s[0].prefill_base = 45;
        s[0].requests = 10;
        s[1].prefill_rate = 2;
        s[1].prefill_base = 225;
        s[1].requests = 9;
        for (int i = 0; i < 2; i++) {
            s[i].decode_pace = 30;
        }
        CHECK(kv_route_pick(s, 2, &rq, &cfg, 0, &r) == 1);
        CHECK(r.why == KV_ROUTE_WHY_COLD);
        s[0].requests = 8;
        CHECK(kv_route_pick(s, 2, &rq, &cfg, 0, &r) == 0);
    }
}

/* n servers at the fleet's line as learned under load (base 150 ms,
 * 2.5 tokens/ms, 30 ms a token), each with `requests` in flight. */
static void loaded(kv_route_server_t *s, size_t n, uint64_t requests)
{
    idle(s, n);
    for (size_t i = 0; i < n; i++) {
        s[i].prefill_rate = 2.5;
        s[i].prefill_base = 150;
        s[i].decode_pace = 30;
        s[i].requests = requests;
    }
}

/* Two loaded() servers with 9 requests in flight each, the second with
 * one 256-token prompt queued (102 ms); both last sent a request
 * since_sent ms ago. */
static void tied_pair(kv_route_server_t *s, double since_sent)
{
    loaded(s, 2, 9);
    s[0].since_sent = since_sent;
    s[1].since_sent = since_sent;
    s[1].prefill_tokens = 256;
}

/* Equal requests in flight: a server with a prefill queued (sent there
 * just now, since_sent 0) before one with none, whatever the prefix (the
 * request may share its step, and fewer of its requests are decoding:
 * fewer streams stalled by a step of the request's own;
 * docs/BENCHMARKS.md, round 10: short-prompt ITL
 * -4..+2% against least_conn's where rendezvous alone was +5..+15%). The
 * opposite order, the estimate's (nothing queued first), sent each cold
 * request to a prefill step of its own: ITL +27% (round 4). Between two
 * servers both with or both without a queue the prefix's rendezvous order
 * decides, so over many first blocks both are chosen. */
TEST(no_reuse_ties_prefer_a_queued_prefill)
{
    for (size_t k = 0; k < 3; k++) {
        uint32_t bs = sizes[k];
        kv_route_config_t cfg = config(KV_ROUTE_TTFT, bs);
        kv_route_server_t s[2];
        kv_route_result_t r;
        int seen[2] = { 0, 0 }, both[2] = { 0, 0 };

        cfg.decode_pace = 30;
        for (uint64_t first = 1; first <= 64; first++) {
            uint64_t q[16] = { first * 7919 };
            kv_route_request_t rq = { 256, q, 256 / bs, 0, 0, 1, 0, 0, 0 };

            tied_pair(s, 0);
            CHECK(kv_route_pick(s, 2, &rq, &cfg, 0, &r) >= 0);
            CHECK(r.why == KV_ROUTE_WHY_COLD);
            seen[r.pick]++;
            s[0].prefill_tokens = 512;          /* both queued: rendezvous */
            CHECK(kv_route_pick(s, 2, &rq, &cfg, 0, &r) >= 0);
            both[r.pick]++;
            s[0].prefill_tokens = 0;            /* fewer requests still win */
            s[0].requests = 8;
            CHECK(kv_route_pick(s, 2, &rq, &cfg, 0, &r) == 0);
        }
        CHECK(seen[1] == 64);
        CHECK(both[0] > 8 && both[1] > 8);
    }
}

/* The queued prefill is joined only while it has likely not started: sent
 * there within the server's step time (its decode pace, 30 ms). Sent 45 ms
 * ago it is taken to be running, and the request would wait for its step
 * to end and then run one of its own, as on a server with nothing queued:
 * the rendezvous order decides, so both servers are chosen over many
 * prefixes (docs/BENCHMARKS.md, "Joining only a prefill not started": on
 * 16 engines joining every queue made short-prompt TTFT 1.09-1.12x
 * least_conn's). Sent 10 ms ago the queued server wins every time; a
 * server this router never sent to has no prefill of its to join. */
TEST(no_reuse_joins_only_a_prefill_not_started)
{
    for (size_t k = 0; k < 3; k++) {
        uint32_t bs = sizes[k];
        kv_route_config_t cfg = config(KV_ROUTE_TTFT, bs);
        kv_route_server_t s[2];
        kv_route_result_t r;
        int started[2] = { 0, 0 }, fresh[2] = { 0, 0 }, never[2] = { 0, 0 };

        cfg.decode_pace = 30;
        for (uint64_t first = 1; first <= 64; first++) {
            uint64_t q[16] = { first * 7919 };
            kv_route_request_t rq = { 256, q, 256 / bs, 0, 0, 1, 0, 0, 0 };

            tied_pair(s, 500);
            s[1].since_sent = 45;
            CHECK(kv_route_pick(s, 2, &rq, &cfg, 0, &r) >= 0);
            CHECK(r.why == KV_ROUTE_WHY_COLD);
            CHECK(!s[1].joinable);
            started[r.pick]++;
            s[1].since_sent = 10;
            CHECK(kv_route_pick(s, 2, &rq, &cfg, 0, &r) >= 0);
            CHECK(s[1].joinable);
            fresh[r.pick]++;
            s[1].since_sent = -1;
            CHECK(kv_route_pick(s, 2, &rq, &cfg, 0, &r) >= 0);
            never[r.pick]++;
        }
        CHECK(started[0] > 8 && started[1] > 8);
        CHECK(fresh[1] == 64);
        CHECK(never[0] > 8 && never[1] > 8);
    }
}

/* Short prompts at the fleet's line as learned under load (base 150 ms,
 * 2.5 tokens/ms: one 256-token prompt's own prefill is ~252 ms, its queue
 * ~102 ms, one step of 2,048 tokens ~819 ms): a queue up to one step above
 * the least (plus the step's base and a decode step) does not shut a
 * server with fewer requests in flight out (the engine batches the request
 * into a step with the queued prompts); a longer one does. Round 5b's
 * bound, the request's own prefill, shut out a server three short prompts
 * above the least, and 26-68 of 720 short requests went to a server with
 * more requests in flight than the least: ITL +5..+15% over least_conn's
 * against +3..+7% with a step (docs/BENCHMARKS.md, round 10). Round 3's
 * rule (C) sent it to an idle queue with 14 requests in flight ("Round
 * 3b"). */
TEST(no_reuse_joins_a_queue_within_one_step)
{
    for (size_t k = 0; k < 3; k++) {
        uint32_t bs = sizes[k];
        kv_route_config_t cfg = config(KV_ROUTE_TTFT, bs);
        kv_route_request_t rq = request(256 / bs, bs);
        kv_route_server_t s[3];
        kv_route_result_t r;

        cfg.decode_pace = 30;
        loaded(s, 3, 12);
        s[0].requests = 8;
        s[0].prefill_tokens = 256;
        s[1].requests = 14;
        CHECK(kv_route_pick(s, 3, &rq, &cfg, 0, &r) == 0);
        CHECK(r.why == KV_ROUTE_WHY_COLD);
        s[0].prefill_tokens = 768;              /* 307 ms: round 5b shut it out */
        CHECK(kv_route_pick(s, 3, &rq, &cfg, 0, &r) == 0);
        s[0].prefill_tokens = 2432;             /* 973 ms < 150 + 819 + 30 */
        CHECK(kv_route_pick(s, 3, &rq, &cfg, 0, &r) == 0);
        s[0].prefill_tokens = 2560;             /* 1,024 ms: the fewest of the rest */
        CHECK(kv_route_pick(s, 3, &rq, &cfg, 0, &r) == 2);
        CHECK(r.why == KV_ROUTE_WHY_COLD);
    }
}

/* A long cold prompt (20,480 tokens, ~1.7 s of its own prefill at 12
 * tokens/ms) with one server's queue empty and another with fewer requests
 * in flight but 1.5 s of prefill queued: the empty queue. Round 5's bound
 * (the request's whole own prefill) let it join the 1.5 s queue, so long
 * prompts waited behind one another while a queue stood empty (the
 * aggregated fleet's mean TTFT +29-31% against round 3's on bench-disagg's
 * mix, docs/BENCHMARKS.md "Round 5b"). A queue shorter than one engine
 * step's worth of tokens (2,048) ahead of the least is still joined: the
 * prompt's first chunk shares that step. */
TEST(no_reuse_long_prompt_avoids_a_long_queue)
{
    for (size_t k = 0; k < 3; k++) {
        uint32_t bs = sizes[k];
        kv_route_config_t cfg = config(KV_ROUTE_TTFT, bs);
        kv_route_request_t rq = request(20480 / bs, bs);
        kv_route_server_t s[2];
        kv_route_result_t r;

        cfg.decode_pace = 30;
        idle(s, 2);
        for (int i = 0; i < 2; i++) {
            s[i].prefill_rate = 12;
            s[i].prefill_base = 60;
            s[i].decode_pace = 30;
        }
        s[0].requests = 6;
        s[1].requests = 3;
        s[1].prefill_tokens = 18000;            /* 1,500 ms queued */
        CHECK(kv_route_pick(s, 2, &rq, &cfg, 0, &r) == 0);
        CHECK(r.why == KV_ROUTE_WHY_COLD);
        s[1].prefill_tokens = 1024;             /* 85 ms < 60 + 171 + 30 */
        CHECK(kv_route_pick(s, 2, &rq, &cfg, 0, &r) == 1);
        s[1].prefill_tokens = 4096;             /* 341 ms */
        CHECK(kv_route_pick(s, 2, &rq, &cfg, 0, &r) == 0);
    }
}

static int home_of(uint64_t session, kv_route_server_t *s, size_t n, uint32_t bs)
{
    kv_route_config_t cfg = config(KV_ROUTE_TTFT, bs);
    kv_route_request_t rq = request(4, bs);
    kv_route_result_t r;

    rq.session = session;
    kv_route_pick(s, n, &rq, &cfg, 0, &r);
    return r.why == KV_ROUTE_WHY_SESSION ? r.pick : -1;
}

/* A session with no known prefix goes to its home, the same whatever the
 * first block, the server order or the router; sessions spread. */
TEST(session_home_is_stable_and_spread)
{
    kv_route_server_t s[5], t[5];
    int seen[5] = { 0 };

    for (uint64_t session = 1; session <= 100; session++) {
        int a, b, c;

        idle(s, 5);
        a = home_of(session * 0x9e3779b97f4a7c15ULL, s, 5, 64);
        CHECK(a >= 0);
        for (int i = 0; i < 5; i++) {
            t[i] = s[4 - i];
        }
        b = home_of(session * 0x9e3779b97f4a7c15ULL, t, 5, 16);
        CHECK(b >= 0 && s[a].id == t[b].id);
        /* other load below saturation leaves it home */
        idle(s, 5);
        s[(a + 1) % 5].requests = 3;
        s[a].requests = 2;
        c = home_of(session * 0x9e3779b97f4a7c15ULL, s, 5, 32);
        CHECK(c == a);
        seen[a]++;
    }
    for (int i = 0; i < 5; i++) {
        CHECK(seen[i] >= 8);
    }
}

/* Saturated home: the next server in the session's order, the same every
 * time; back home once it is not saturated. */
TEST(session_saturated_home_passes_to_next)
{
    kv_route_server_t s[6];
    uint64_t session = 0xfeedULL;
    int home, next = -1;

    idle(s, 6);
    home = home_of(session, s, 6, 64);
    for (int k = 0; k < 8; k++) {
        idle(s, 6);
        s[home].requests = 20;          /* mean 3.3: above 1.25 x mean + 1 */
        int p = home_of(session, s, 6, 64);
        CHECK(p >= 0 && p != home);
        if (next < 0) {
            next = p;
        }
        CHECK(p == next);
    }
    idle(s, 6);
    for (int i = 0; i < 6; i++) {
        s[i].requests = 2;
    }
    s[home].requests = 3;               /* mean 2.2: 3 <= 1.25 x 2.2 + 1 */
    CHECK(home_of(session, s, 6, 64) == home);
}

/* The prefix index comes first: a longer cached prefix elsewhere beats the
 * home; an equal one goes home; a known prefix spill beats the session. */
TEST(session_after_the_prefix_index)
{
    for (size_t k = 0; k < 3; k++) {
        uint32_t bs = sizes[k];
        kv_route_config_t cfg = config(KV_ROUTE_TTFT, bs);
        kv_route_request_t rq = request(8, bs);
        kv_route_server_t s[4];
        kv_route_result_t r;
        int home, other;

        rq.session = 77;
        idle(s, 4);
        home = home_of(77, s, 4, bs);
        other = (home + 1) % 4;

        idle(s, 4);
        s[other].overlap_index = 3;
        s[home].overlap_index = 2;
        CHECK(kv_route_pick(s, 4, &rq, &cfg, 0, &r) == other);
        CHECK(r.why == KV_ROUTE_WHY_STICKY);

        s[home].overlap_index = 3;
        s[(home + 2) % 4].overlap_index = 3;
        CHECK(kv_route_pick(s, 4, &rq, &cfg, 0, &r) == home);
        CHECK(r.why == KV_ROUTE_WHY_SHARED);

        /* only a saturated server holds it: spill by the prefix, not home */
        idle(s, 4);
        s[other].overlap_index = 8;
        s[other].requests = 40;
        kv_route_pick(s, 4, &rq, &cfg, 0, &r);
        CHECK(r.why == KV_ROUTE_WHY_SPILL);
        CHECK_STR(kv_route_why_name(KV_ROUTE_WHY_SESSION), "session");
    }
}

/* Events mode after an event gap: the worker's index state is not trusted,
 * so nobody is known to hold the session's history; its home takes the
 * turn (warm there), not a cold placement elsewhere. */
TEST(session_warm_start_after_an_event_gap)
{
    kv_route_config_t cfg = config(KV_ROUTE_TTFT, 32);
    kv_route_request_t rq = request(8, 32);
    kv_route_server_t s[4];
    kv_route_result_t r;
    int home;

    idle(s, 4);
    home = home_of(4242, s, 4, 32);
    idle(s, 4);
    s[home].overlap_index = 8;
    s[home].trusted = 0;
    s[(home + 1) % 4].requests = 0;
    s[home].requests = 1;
    rq.session = 4242;
    CHECK(kv_route_pick(s, 4, &rq, &cfg, 0, &r) == home);
    CHECK(r.why == KV_ROUTE_WHY_SESSION && r.overlap == 0);
    rq.session = 0;
    kv_route_pick(s, 4, &rq, &cfg, 0, &r);
    CHECK(r.why == KV_ROUTE_WHY_COLD && r.pick != home);
}

/* A Responses API continuation goes to the one server holding the
 * response (rq.home), busy or loaded as it may be, in either policy; when
 * that server is not usable the policy decides as without a home. */
TEST(response_home_wins_while_usable)
{
    for (int policy = KV_ROUTE_TTFT; policy <= KV_ROUTE_DYNAMO; policy++) {
        kv_route_config_t  cfg = config((kv_route_policy_t) policy, 16);
        kv_route_request_t rq = request(4, 16);
        kv_route_server_t  s[3];
        kv_route_result_t  r;

        cfg.busy_prefill_tokens = 1000;
        idle(s, 3);
        s[0].overlap_index = 4;                 /* the prompt's holder */
        s[2].prefill_tokens = 5000;             /* the home: busy */
        s[2].requests = 9;
        rq.home = s[2].id;
        CHECK(kv_route_pick(s, 3, &rq, &cfg, 0, &r) == 2);
        CHECK(r.why == KV_ROUTE_WHY_RESPONSE);
        CHECK_STR(kv_route_why_name(r.why), "response");
        s[0].prefill_tokens = s[1].prefill_tokens = 5000;   /* every one busy */
        CHECK(kv_route_pick(s, 3, &rq, &cfg, 0, &r) == 2);
        s[0].prefill_tokens = s[1].prefill_tokens = 0;
        s[2].usable = 0;                        /* down: the policy decides */
        CHECK(kv_route_pick(s, 3, &rq, &cfg, 0, &r) == 0);
        CHECK(r.why != KV_ROUTE_WHY_RESPONSE);
        rq.home = 12345;                        /* not among the servers */
        s[2].usable = 1;
        CHECK(kv_route_pick(s, 3, &rq, &cfg, 0, &r) == 0);
    }
}

int main(void)
{
    RUN(response_home_wins_while_usable);
    RUN(session_warm_start_after_an_event_gap);
    RUN(dynamo_threshold_scales_with_block_size);
    RUN(dynamo_ties_go_to_the_smaller_tree);
    RUN(ttft_sticky_until_saturated);
    RUN(ttft_longest_prefix_within_the_slack);
    RUN(ttft_learned_rate_counts);
    RUN(ttft_equal_prefix_goes_to_the_sooner_first_token);
    RUN(ttft_cold_rendezvous_agrees);
    RUN(ttft_hot_prefix_spills_to_one_next_server);
    RUN(requests_bound_spreads_decode);
    RUN(short_prompts_placed_by_load);
    RUN(untrusted_index_pending_still_counts);
    RUN(busy_and_none);
    RUN(the_attempt_adds);
    RUN(batch_at_the_servers_rate);
    RUN(no_reuse_fewest_requests);
    RUN(no_reuse_line_noise_does_not_decide);
    RUN(no_reuse_joins_a_queue_within_one_step);
    RUN(no_reuse_ties_prefer_a_queued_prefill);
    RUN(no_reuse_joins_only_a_prefill_not_started);
    RUN(no_reuse_long_prompt_avoids_a_long_queue);
    RUN(session_home_is_stable_and_spread);
    RUN(session_saturated_home_passes_to_next);
    RUN(session_after_the_prefix_index);
    return kvt_done();
}
