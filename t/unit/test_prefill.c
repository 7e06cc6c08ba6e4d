/* The prefill half of a disaggregated decision (kv_prefill.c): local when
 * little is left to prefill, else the prefill server by overlap and prefill
 * load, never a failure when the prefill pool is down or busy. */
#include "kvtest.h"
#include "route_fleet.h"
#include "kv_prefill.h"

static const uint64_t seq[128] = { 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16 };

static void idle(kv_route_server_t *s, size_t n)
{
    route_fleet_idle(s, n, 9000, 1);
}

static kv_route_config_t config(uint32_t bs)
{
    return route_fleet_config(bs);
}

/* The chosen decode worker: idle, never measured, holding overlap blocks. */
static kv_route_server_t decoder(uint32_t overlap)
{
    kv_route_server_t d;

    memset(&d, 0, sizeof(d));
    d.usable = 1;
    d.weight = 1;
    d.trusted = 1;
    d.id = 100;
    d.overlap_index = overlap;
    return d;
}

static int pick(kv_route_server_t *s, size_t n, const kv_route_request_t *rq,
                uint32_t decode_overlap, const kv_prefill_config_t *pc,
                const kv_route_config_t *cfg, kv_prefill_result_t *r)
{
    kv_route_server_t d = decoder(decode_overlap);

    return kv_prefill_pick(s, n, rq, &d, pc, cfg, cfg, 0, r);
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
    pc.conditional = 0;             /* rule 1 alone (rule 4 below) */
    idle(s, 2);
    CHECK(pick(s, 2, &rq, 100, &pc, &cfg, &r) == -1);
    CHECK(r.why == KV_PREFILL_LOCAL_SHORT);
    CHECK_EQ_U64(r.uncached_local, 2048 - 100 * 16);
    CHECK(pick(s, 2, &rq, 96, &pc, &cfg, &r) == -1);
    CHECK_STR(kv_prefill_why_name(r.why), "short");

    CHECK(pick(s, 2, &rq, 90, &pc, &cfg, &r) >= 0);
    CHECK(r.why == KV_PREFILL_REMOTE);
    CHECK_STR(kv_prefill_why_name(r.why), "remote");

    /* the whole prompt cached at the decode worker */
    CHECK(pick(s, 2, &rq, 128, &pc, &cfg, &r) == -1);
    CHECK(r.why == KV_PREFILL_LOCAL_SHORT);
    CHECK_EQ_U64(r.uncached_local, 0);

    /* rule 4: holding 90 blocks, the decode worker computes 608 tokens
     * (76 ms) where an idle prefill server holding none computes 2048
     * (256 ms): local, faster */
    pc.conditional = 1;
    CHECK(pick(s, 2, &rq, 90, &pc, &cfg, &r) == -1);
    CHECK(r.why == KV_PREFILL_LOCAL_FASTER);
    pc.conditional = 0;

    /* a short prompt, nothing cached */
    rq = request(10, 16);
    CHECK(pick(s, 2, &rq, 0, &pc, &cfg, &r) == -1);
    CHECK(r.why == KV_PREFILL_LOCAL_SHORT);

    /* min_tokens 0: any uncached token goes remote */
    pc.min_tokens = 0;
    CHECK(pick(s, 2, &rq, 0, &pc, &cfg, &r) >= 0);
    CHECK(pick(s, 2, &rq, 10, &pc, &cfg, &r) == -1);
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
        CHECK(pick(s, 3, &rq, 0, &pc, &cfg, &r) == 2);
        CHECK(r.why == KV_PREFILL_REMOTE);
        CHECK_EQ_U64(r.route.overlap, 100);
        CHECK_EQ_U64(r.route.prefill_tokens, 28 * bs);
        CHECK_EQ_U64(r.route.decode_blocks, 0);
        CHECK_EQ_U64(r.route.decode_tokens, 0);

        /* an untrusted index state earns no credit */
        s[2].trusted = 0;
        s[1].overlap_index = 50;
        CHECK(pick(s, 3, &rq, 0, &pc, &cfg, &r) == 1);
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
    CHECK(pick(s, 2, &rq, 0, &pc, &cfg, &r) == 0);
    s[0].prefill_tokens = 4096;         /* 5120 vs 2048: s[1] */
    CHECK(pick(s, 2, &rq, 0, &pc, &cfg, &r) == 1);
    CHECK_EQ_U64(r.route.queued_tokens, 0);
    CHECK_EQ_U64(r.route.prefill_tokens, 2048);

    /* decode inputs are ignored: a prefill server's decode pace or output
     * length does not blur the estimates together */
    s[0].prefill_tokens = 1500;         /* 2524 vs 2048, inside the slack */
    s[0].decode_pace = 1000;
    s[1].decode_pace = 1000;
    CHECK(pick(s, 2, &rq, 0, &pc, &cfg, &r) == 0);
    s[0].prefill_tokens = 3000;         /* 4024 vs 2048, outside */
    CHECK(pick(s, 2, &rq, 0, &pc, &cfg, &r) == 1);
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
    CHECK(pick(s, 2, &rq, 0, &pc, &cfg, &r) == -1);
    CHECK(r.why == KV_PREFILL_LOCAL_NONE);
    CHECK_STR(kv_prefill_why_name(r.why), "none");

    CHECK(pick(s, 0, &rq, 0, &pc, &cfg, &r) == -1);
    CHECK(r.why == KV_PREFILL_LOCAL_NONE);

    idle(s, 2);
    cfg.busy_prefill_tokens = 8192;
    s[0].prefill_tokens = 9000;
    s[1].prefill_tokens = 8192;
    CHECK(pick(s, 2, &rq, 0, &pc, &cfg, &r) == -1);
    CHECK(r.why == KV_PREFILL_LOCAL_BUSY);
    CHECK_STR(kv_prefill_why_name(r.why), "busy");
    s[1].prefill_tokens = 100;
    CHECK(pick(s, 2, &rq, 0, &pc, &cfg, &r) == 1);
}

/* Rule 4: a queued prefill pool loses to an idle decode worker; the stall
 * its prefill imposes on the decode worker's requests, the margin and the
 * transfer move the line; off, the pool is used whenever usable.
 * 2048 tokens, rates 8 tokens/ms (the default): own prefill 256 ms; each
 * prefill server has 8192 queued (1024 ms): remote 1280 ms. */
TEST(conditional_local_when_faster)
{
    kv_route_server_t s[2], d;
    kv_route_config_t cfg = config(16);
    kv_prefill_config_t pc;
    kv_route_request_t rq = request(128, 16);
    kv_prefill_result_t r;

    kv_prefill_config_init(&pc);
    CHECK(pc.conditional == 1);
    CHECK(pc.stall_weight == KV_PREFILL_STALL_WEIGHT);
    CHECK(pc.margin == KV_PREFILL_MARGIN);
    CHECK(pc.xfer_ms_per_token == 0);

    idle(s, 2);
    s[0].prefill_tokens = 8192;
    s[1].prefill_tokens = 8192;
    d = decoder(0);
    CHECK(kv_prefill_pick(s, 2, &rq, &d, &pc, &cfg, &cfg, 0, &r) == -1);
    CHECK(r.why == KV_PREFILL_LOCAL_FASTER);
    CHECK_STR(kv_prefill_why_name(r.why), "faster");
    CHECK(r.route.pick == KV_ROUTE_NONE);
    CHECK(r.remote_ms > 1279.99 && r.remote_ms < 1280.01);
    CHECK(r.local_ms > 255.99 && r.local_ms < 256.01);

    pc.stall_weight = 0.1;
    /* 30 requests decoding there, weight 0.1: 256 + 0.1 x 30 x 256 = 1024,
     * x 1.25 = 1280, not below: remote; 29: 998.4 x 1.25 = 1248: local */
    d.requests = 30;
    CHECK(kv_prefill_pick(s, 2, &rq, &d, &pc, &cfg, &cfg, 0, &r) >= 0);
    CHECK(r.why == KV_PREFILL_REMOTE);
    CHECK(r.local_ms > 1023.99 && r.local_ms < 1024.01);
    /* the request's own TTFT estimate leaves the others' stall out */
    CHECK(r.local_ttft_ms > 255.99 && r.local_ttft_ms < 256.01);
    d.requests = 29;
    CHECK(kv_prefill_pick(s, 2, &rq, &d, &pc, &cfg, &cfg, 0, &r) == -1);
    CHECK(r.why == KV_PREFILL_LOCAL_FASTER);

    /* weight 0: the stall does not count */
    pc.stall_weight = 0;
    d.requests = 1000;
    CHECK(kv_prefill_pick(s, 2, &rq, &d, &pc, &cfg, &cfg, 0, &r) == -1);
    pc.stall_weight = 0.1;
    d.requests = 0;

    /* the margin: 256 x (1 + 4) = 1280, not below; 3.9: below */
    pc.margin = 4;
    CHECK(kv_prefill_pick(s, 2, &rq, &d, &pc, &cfg, &cfg, 0, &r) >= 0);
    pc.margin = 3.9;
    CHECK(kv_prefill_pick(s, 2, &rq, &d, &pc, &cfg, &cfg, 0, &r) == -1);
    pc.margin = KV_PREFILL_MARGIN;

    /* a decode worker with prefill queued is no better */
    d.prefill_tokens = 8192;
    CHECK(kv_prefill_pick(s, 2, &rq, &d, &pc, &cfg, &cfg, 0, &r) >= 0);
    CHECK(r.why == KV_PREFILL_REMOTE);
    d.prefill_tokens = 0;

    /* nor one whose own report shows it queued (other routers' requests),
     * with worker_load=max, as kv_route_pick weighed it; by default this
     * router's count alone */
    d.reported = 1;
    d.reported_prefill_tokens = 8192;
    CHECK(kv_prefill_pick(s, 2, &rq, &d, &pc, &cfg, &cfg, 0, &r) == -1);
    CHECK(r.local_ttft_ms > 255.99 && r.local_ttft_ms < 256.01);
    cfg.worker_load = KV_ROUTE_LOAD_MAX;
    CHECK(kv_prefill_pick(s, 2, &rq, &d, &pc, &cfg, &cfg, 0, &r) >= 0);
    CHECK(r.why == KV_PREFILL_REMOTE);
    CHECK(r.local_ttft_ms > 1279.99 && r.local_ttft_ms < 1280.01);
    cfg.worker_load = KV_ROUTE_LOAD_LOCAL;
    d.reported = 0;
    d.reported_prefill_tokens = 0;

    /* off: the pool whenever usable (round 1); no decode worker: the same */
    pc.conditional = 0;
    CHECK(kv_prefill_pick(s, 2, &rq, &d, &pc, &cfg, &cfg, 0, &r) >= 0);
    CHECK(r.why == KV_PREFILL_REMOTE);
    CHECK(r.remote_ms == 0 && r.local_ms == 0 && r.local_ttft_ms == 0);
    pc.conditional = 1;
    CHECK(kv_prefill_pick(s, 2, &rq, NULL, &pc, &cfg, &cfg, 0, &r) >= 0);
    CHECK(r.why == KV_PREFILL_REMOTE);

    /* an idle pool wins against an idle decode worker (the margin) ... */
    idle(s, 2);
    CHECK(kv_prefill_pick(s, 2, &rq, &d, &pc, &cfg, &cfg, 0, &r) >= 0);
    CHECK(r.why == KV_PREFILL_REMOTE);
    CHECK(r.remote_ms > 255.99 && r.remote_ms < 256.01);
    CHECK(r.xfer_ms == 0);
    /* ... unless the transfer costs more: 0.1 ms/token, 204.8 ms */
    pc.xfer_ms_per_token = 0.1;
    CHECK(kv_prefill_pick(s, 2, &rq, &d, &pc, &cfg, &cfg, 0, &r) == -1);
    CHECK(r.why == KV_PREFILL_LOCAL_FASTER);
    CHECK(r.xfer_ms > 204.79 && r.xfer_ms < 204.81);
    CHECK(r.remote_ms > 460.79 && r.remote_ms < 460.81);
    /* only what the decode worker lacks crosses the link: holding 64
     * blocks, 1024 tokens, 102.4 ms */
    d = decoder(64);
    CHECK(kv_prefill_pick(s, 2, &rq, &d, &pc, &cfg, &cfg, 0, &r) == -1);
    CHECK(r.xfer_ms > 102.39 && r.xfer_ms < 102.41);
}

/* The decode worker's line: its own once learned; before that the prefill
 * pool's mean measured server (same engines), before that the decode
 * upstream's prefill_rate. */
TEST(conditional_decode_line)
{
    kv_route_server_t s[2], d;
    kv_route_config_t cfg = config(16), dcfg = config(16);
    kv_prefill_config_t pc;
    kv_route_request_t rq = request(128, 16);
    kv_prefill_result_t r;

    kv_prefill_config_init(&pc);
    idle(s, 2);
    s[0].prefill_tokens = 8192;
    s[1].prefill_tokens = 8192;

    /* learned: 10 + 2048 / 32 = 74 ms */
    d = decoder(0);
    d.prefill_rate = 32;
    d.prefill_base = 10;
    CHECK(kv_prefill_pick(s, 2, &rq, &d, &pc, &dcfg, &cfg, 0, &r) == -1);
    CHECK(r.local_ms > 73.99 && r.local_ms < 74.01);

    /* unmeasured: the pool's mean, 24 tokens/ms, base 6: 6 + 2048 / 24 */
    d = decoder(0);
    s[0].prefill_rate = 16;
    s[0].prefill_base = 4;
    s[1].prefill_rate = 32;
    s[1].prefill_base = 8;
    CHECK(kv_prefill_pick(s, 2, &rq, &d, &pc, &dcfg, &cfg, 0, &r) == -1);
    CHECK(r.local_ms > 6 + 2048.0 / 24 - 0.01 && r.local_ms < 6 + 2048.0 / 24 + 0.01);

    /* nothing measured: the decode upstream's prefill_rate (2 tokens/ms:
     * 1024 ms, x 1.25 over the pool's 1280): remote */
    s[0].prefill_rate = s[1].prefill_rate = 0;
    s[0].prefill_base = s[1].prefill_base = 0;
    dcfg.prefill_rate = 2;
    CHECK(kv_prefill_pick(s, 2, &rq, &d, &pc, &dcfg, &cfg, 0, &r) >= 0);
    CHECK(r.local_ms > 1023.99 && r.local_ms < 1024.01);
    /* a weight-2 decode worker prefills twice as fast: 512 ms: local */
    d.weight = 2;
    CHECK(kv_prefill_pick(s, 2, &rq, &d, &pc, &dcfg, &cfg, 0, &r) == -1);
}

int main(void)
{
    RUN(short_uncached_part_stays_local);
    RUN(prefill_server_by_overlap);
    RUN(prefill_server_by_load);
    RUN(dead_or_busy_pool_is_local);
    RUN(conditional_local_when_faster);
    RUN(conditional_decode_line);
    return kvt_done();
}
