/* Events mode against approximate mode (issue 16): the block counts the
 * rules read (tree_blocks: spill, seed, the shared head's resident bound,
 * the cold and sticky ties). Approximate mode's index records a prompt at
 * the decision; events mode's learns of it from the worker's Stored events,
 * after its prefill. kv_route_tree_blocks() adds the prompts sent and not
 * yet past their first byte, so both modes count what the router sent
 * (docs/BENCHMARKS.md "Routing round 11"). At block sizes 16, 32 and 64. */
#include "kvtest.h"
#include "route_fleet.h"
#include "kv_route.h"

#define N      8
#define HEAD   64                       /* blocks of the hot prefix */
#define OWN    8                        /* each request's own blocks */
#define BLOCKS (HEAD + OWN)

static const uint32_t sizes[] = { 16, 32, 64 };

/*
 * The start of the hot-prefix workload, as each mode's index sees it when
 * a new request for the hot prefix arrives (request 6 of the seed-16 trace):
 *   s0: held the prefix first and stored it (its events came), and a
 *       continuation (its own 8 blocks) is queued: 2 requests;
 *   s1..s3: were each sent the prefix (a spill and two seeds); their
 *       prefills are queued, so no event yet: 1 request each;
 *   s4: was sent a cold prompt of another prefix, queued: 1 request;
 *   s5..s7: idle, empty.
 * approx: 1 for approximate mode's inputs, 0 for events mode's, whose
 * tree_blocks the glue fills with kv_route_tree_blocks(index's count).
 */
static void start_of_run(kv_route_server_t *s, uint32_t bs, const kv_route_config_t *cfg,
                         int approx)
{
    uint64_t sent[N] = { HEAD + 2 * OWN, BLOCKS, BLOCKS, BLOCKS, BLOCKS, 0, 0, 0 };
    uint64_t indexed[N] = { HEAD + OWN, 0, 0, 0, 0, 0, 0, 0 };

    route_fleet_idle(s, N, 9100, 53);
    s[0].requests = 2;
    s[0].prefill_tokens = (uint64_t) OWN * bs;
    for (int i = 1; i <= 4; i++) {
        s[i].requests = 1;
        s[i].prefill_tokens = (uint64_t) BLOCKS * bs;
    }
    for (int i = 0; i < 4; i++) {
        if (approx) {
            s[i].overlap_index = HEAD;
        } else {
            s[i].overlap_index = indexed[i] ? HEAD : 0;
            s[i].overlap_pending = HEAD;
        }
    }
    for (int i = 0; i < N; i++) {
        s[i].tree_blocks = approx ? sent[i] : kv_route_tree_blocks(indexed[i], 1, &s[i], cfg);
    }
}

/* The new branch off the hot prefix: approximate mode sees four holders
 * each given a whole prompt and seeds an idle server; events mode, from
 * the same decisions, must decide alike. With the index's count alone
 * (main before this test) the three holders whose prefills were queued
 * looked empty, within the resident bound, and the branch was kept on
 * one of them ("shared"): the hot prefix stayed on four servers where
 * approximate mode grew it to five (seed 16: events spilled 17 requests
 * of other prefixes off its saturated holders, approximate 9). */
TEST(events_count_the_prompts_sent_as_approximate_does)
{
    for (size_t z = 0; z < sizeof(sizes) / sizeof(sizes[0]); z++) {
        uint32_t            bs = sizes[z];
        kv_route_config_t   cfg = route_fleet_config(bs);
        kv_route_server_t   a[N], e[N];
        kv_route_result_t   ra, re;
        uint64_t            q[BLOCKS];
        kv_route_request_t  rq = { BLOCKS * bs, q, BLOCKS, 0, 0, 1, 0, 0, 0 };

        for (int k = 0; k < BLOCKS; k++) {
            q[k] = k < HEAD ? 1000003u + k : 7919u * 6 + k;
        }
        start_of_run(a, bs, &cfg, 1);
        start_of_run(e, bs, &cfg, 0);
        for (int i = 1; i <= 4; i++) {
            CHECK_EQ_U64(e[i].tree_blocks, a[i].tree_blocks);
        }
        kv_route_pick(a, N, &rq, &cfg, 1, &ra);
        kv_route_pick(e, N, &rq, &cfg, 1, &re);
        CHECK(ra.why == KV_ROUTE_WHY_SEED && ra.pick >= 5);
        CHECK(re.why == ra.why);
        CHECK(re.pick == ra.pick);
    }
}

/* Only events mode adds, and only what has not had its first byte: the
 * queued prefill tokens in blocks, rounded up; with worker_load=max the
 * worker's report where larger (other routers' prompts are missing from
 * the index alike). */
TEST(tree_blocks_adds_the_queued_prefill)
{
    for (size_t z = 0; z < sizeof(sizes) / sizeof(sizes[0]); z++) {
        uint32_t            bs = sizes[z];
        kv_route_config_t   cfg = route_fleet_config(bs);
        kv_route_server_t   s[1];

        route_fleet_idle(s, 1, 1, 1);
        CHECK_EQ_U64(kv_route_tree_blocks(300, 1, &s[0], &cfg), 300);
        s[0].prefill_tokens = 5 * bs + 1;
        CHECK_EQ_U64(kv_route_tree_blocks(300, 0, &s[0], &cfg), 300);
        CHECK_EQ_U64(kv_route_tree_blocks(300, 1, &s[0], &cfg), 306);
        s[0].reported = 1;
        s[0].reported_prefill_tokens = 9 * bs;
        CHECK_EQ_U64(kv_route_tree_blocks(300, 1, &s[0], &cfg), 306);
        cfg.worker_load = KV_ROUTE_LOAD_MAX;
        CHECK_EQ_U64(kv_route_tree_blocks(300, 1, &s[0], &cfg), 309);
        CHECK_EQ_U64(kv_route_tree_blocks(300, 0, &s[0], &cfg), 300);
    }
}

int main(void)
{
    RUN(events_count_the_prompts_sent_as_approximate_does);
    RUN(tree_blocks_adds_the_queued_prefill);
    return kvt_done();
}
