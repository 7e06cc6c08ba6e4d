/*
 * The scheduler over a scripted backend, no network: chunked prefill, the
 * token budget, max_num_seqs, watermark admission, preemption of the newest
 * request, cancel, stop strings and EOS.
 */
#include "kvtest.h"
#include "kv_hash.h"
#include "kvw_sched.h"

#include <stdlib.h>

/* --- a backend that logs steps and "generates" the alphabet --------------- */

#define MAX_STEPS 512

typedef struct {
    kvw_backend_t   b;
    int             n_steps;
    uint32_t        step_n[MAX_STEPS];          /* sequences in the step */
    uint32_t        step_tokens[MAX_STEPS][8];  /* tokens per sequence */
    uint32_t        eos_at;                     /* position where EOS is sampled, 0: never */
    double          step_ms;                    /* simulated step time (with b.simulated) */
} tb_t;

static int tb_step(kvw_backend_t *b, kvw_step_seq_t *q, uint32_t n, double *ms)
{
    tb_t *t = (tb_t *)b;
    if (t->n_steps < MAX_STEPS) {
        t->step_n[t->n_steps] = n;
        for (uint32_t i = 0; i < n && i < 8; i++)
            t->step_tokens[t->n_steps][i] = q[i].n_tokens;
        t->n_steps++;
    }
    for (uint32_t i = 0; i < n; i++) {
        uint32_t pos = q[i].pos + q[i].n_tokens;
        q[i].next_token = t->eos_at && pos == t->eos_at ? 1 : 'a' + pos % 26;
    }
    *ms = t->step_ms;
    return 0;
}

static void tb_destroy(kvw_backend_t *b) { free(b); }

static tb_t *tb_new(uint32_t num_blocks, uint32_t block_size)
{
    tb_t *t = calloc(1, sizeof(*t));
    t->b.name = "test";
    t->b.vocab_size = 256;
    t->b.eos_token_id = 1;
    t->b.block_size = block_size;
    t->b.num_blocks = num_blocks;
    t->b.step = tb_step;
    t->b.destroy = tb_destroy;
    return t;
}

/* --- a front that records what the engine says ---------------------------- */

typedef struct {
    kvw_req_t       r;
    char            out[4096];
    size_t          len;
    int             done;
    kvw_finish_t    why;
} tr_t;

static void t_emit_text(kvw_req_t *r, const char *text, size_t len)
{
    tr_t *t = (tr_t *)r;
    memcpy(t->out + t->len, text, len);
    t->len += len;
}

static void t_emit(kvw_req_t *r, uint32_t tok, const char *text, size_t len)
{
    r->n_output++;
    t_emit_text(r, text, len);
}

static void t_finish(kvw_req_t *r, kvw_finish_t why)
{
    tr_t *t = (tr_t *)r;
    t->done = 1;
    t->why = why;
}

static const kvw_req_hooks_t hooks = { t_emit, t_emit_text, t_finish };

static uint32_t prompt_store[16][4096];

static void tr_init(tr_t *t, int slot, size_t n_prompt, uint32_t base, int max_tokens)
{
    memset(t, 0, sizeof(*t));
    for (size_t i = 0; i < n_prompt; i++)
        prompt_store[slot][i] = base + (uint32_t)i;
    t->r.prompt = prompt_store[slot];
    t->r.n_prompt = n_prompt;
    t->r.max_tokens = max_tokens;
    t->r.hooks = &hooks;
    t->r.model = "m";
}

static kvw_config_t cfg_with(int max_seqs, int max_batched, double watermark)
{
    kvw_config_t c;
    memset(&c, 0, sizeof(c));
    kvw_config_defaults(&c);
    c.max_num_seqs = max_seqs;
    c.max_num_batched_tokens = max_batched;
    c.watermark = watermark;
    return c;
}

static void run(struct event_base *base)
{
    event_base_dispatch(base);
}

/* A transfer's 3 full blocks of t's 50-token prompt, pinned and committed as
 * kvw_xfer_pull does, then handed to the scheduler with submit_pinned. */
static int submit_pulled(kvw_engine_t *e, tr_t *t, const uint32_t *first, uint64_t rng)
{
    kvw_blocks_t *bm = kvw_sched_blocks(e);
    kvw_seq_blocks_t pin = {0};

    kvw_blocks_pin_prefix(bm, &pin, KV_HASH_SEED, t->r.prompt, 50);
    if (kvw_blocks_reserve(bm, &pin, 48) != 0)
        return -1;
    kvw_blocks_commit(bm, &pin, t->r.prompt, 48);
    return kvw_sched_submit_pinned(e, &t->r, &pin, first, rng);
}

TEST(chunked_prefill_then_decode)
{
    struct event_base *base = event_base_new();
    kvw_config_t c = cfg_with(256, 64, 0);
    tb_t *tb = tb_new(64, 16);
    kvw_engine_t *e = kvw_sched_create(&c, base, 0, &tb->b);
    tr_t a;

    tr_init(&a, 0, 150, 1000, 3);
    CHECK(e->ops->submit(e, &a.r) == 0);
    run(base);
    CHECK(a.done && a.why == KVW_FINISH_LENGTH);
    CHECK_EQ_U64(a.r.n_output, 3);
    CHECK_EQ_U64(tb->n_steps, 5);           /* 64 + 64 + 22 (samples), then 2 decodes */
    CHECK_EQ_U64(tb->step_tokens[0][0], 64);
    CHECK_EQ_U64(tb->step_tokens[1][0], 64);
    CHECK_EQ_U64(tb->step_tokens[2][0], 22);
    CHECK_EQ_U64(tb->step_tokens[3][0], 1);
    CHECK_EQ_U64(a.len, 3);
    e->ops->destroy(e);
    event_base_free(base);
}

TEST(unchunked_prompt_over_budget_runs_alone)
{
    struct event_base *base = event_base_new();
    kvw_config_t c = cfg_with(256, 64, 0);
    tb_t *tb = tb_new(64, 16);
    kvw_engine_t *e = kvw_sched_create(&c, base, 0, &tb->b);
    tr_t a, b;

    c.enable_chunked_prefill = 0;
    tr_init(&a, 0, 10, 1, 2);
    tr_init(&b, 1, 150, 1000, 2);
    e->ops->submit(e, &a.r);
    e->ops->submit(e, &b.r);
    run(base);
    CHECK(a.done && b.done);
    CHECK_EQ_U64(tb->step_n[0], 1);             /* a alone: b does not fit beside it */
    int seen = 0;
    for (int i = 0; i < tb->n_steps; i++)
        seen |= tb->step_n[i] == 1 && tb->step_tokens[i][0] == 150;
    CHECK(seen);
    e->ops->destroy(e);
    event_base_free(base);
}

TEST(prefix_cache_hit_reported)
{
    struct event_base *base = event_base_new();
    kvw_config_t c = cfg_with(256, 8192, 0);
    tb_t *tb = tb_new(64, 16);
    kvw_engine_t *e = kvw_sched_create(&c, base, 0, &tb->b);
    tr_t a, b;

    tr_init(&a, 0, 40, 1, 2);
    e->ops->submit(e, &a.r);
    run(base);
    tr_init(&b, 1, 40, 1, 2);
    e->ops->submit(e, &b.r);
    run(base);
    CHECK_EQ_U64(a.r.cached_tokens, 0);
    CHECK_EQ_U64(b.r.cached_tokens, 32);
    CHECK_EQ_U64(tb->step_tokens[tb->n_steps - 2][0], 8);  /* only the uncached tail ran */
    e->ops->destroy(e);
    event_base_free(base);
}

TEST(max_num_seqs_and_budget)
{
    struct event_base *base = event_base_new();
    kvw_config_t c = cfg_with(2, 8192, 0);
    tb_t *tb = tb_new(64, 16);
    kvw_engine_t *e = kvw_sched_create(&c, base, 0, &tb->b);
    tr_t r[3];

    for (int i = 0; i < 3; i++) {
        tr_init(&r[i], i, 20, 100u * (uint32_t)(i + 1), 4);
        e->ops->submit(e, &r[i].r);
    }
    run(base);
    CHECK_EQ_U64(tb->step_n[0], 2);
    for (int i = 0; i < 3; i++)
        CHECK(r[i].done && r[i].r.n_output == 4);
    e->ops->destroy(e);
    event_base_free(base);
}

TEST(watermark_holds_back_admission)
{
    struct event_base *base = event_base_new();
    kvw_config_t c = cfg_with(256, 8192, 0.2);     /* 2 of 10 blocks kept free */
    tb_t *tb = tb_new(10, 4);
    kvw_engine_t *e = kvw_sched_create(&c, base, 0, &tb->b);
    tr_t a, b;

    tr_init(&a, 0, 28, 1, 2);       /* 7 blocks (+1 when decoding) */
    tr_init(&b, 1, 8, 500, 2);      /* 2 more would break the watermark */
    e->ops->submit(e, &a.r);
    e->ops->submit(e, &b.r);
    run(base);
    CHECK_EQ_U64(tb->step_n[0], 1);
    CHECK(a.done && b.done);
    CHECK_EQ_U64(b.r.n_output, 2);
    e->ops->destroy(e);
    event_base_free(base);
}

TEST(preempts_newest_when_blocks_run_out)
{
    struct event_base *base = event_base_new();
    kvw_config_t c = cfg_with(256, 8192, 0);
    tb_t *tb = tb_new(6, 4);
    kvw_engine_t *e = kvw_sched_create(&c, base, 0, &tb->b);
    kvw_sched_load_t l;
    tr_t a, b;

    tr_init(&a, 0, 7, 1, 10);       /* grows to 17 tokens: 5 blocks */
    tr_init(&b, 1, 7, 300, 10);
    e->ops->submit(e, &a.r);
    e->ops->submit(e, &b.r);
    run(base);
    kvw_sched_load(e, &l);
    CHECK(l.preemptions > 0);
    CHECK(a.done && a.why == KVW_FINISH_LENGTH && a.r.n_output == 10);
    CHECK(b.done && b.why == KVW_FINISH_LENGTH && b.r.n_output == 10);
    /* recompute after preemption produces the same text as an undisturbed run */
    CHECK(a.len == 10 && b.len == 10);
    CHECK(memcmp(a.out, "hijklmnopq", 10) == 0);
    CHECK(memcmp(b.out, "hijklmnopq", 10) == 0);
    CHECK_EQ_U64(kvw_blocks_active(kvw_sched_blocks(e)), 0);
    e->ops->destroy(e);
    event_base_free(base);
}

TEST(cancel_frees_blocks)
{
    struct event_base *base = event_base_new();
    kvw_config_t c = cfg_with(256, 8192, 0);
    tb_t *tb = tb_new(64, 16);
    kvw_engine_t *e = kvw_sched_create(&c, base, 0, &tb->b);
    tr_t a;

    tr_init(&a, 0, 100, 1, 1000);
    e->ops->submit(e, &a.r);
    event_base_loop(base, EVLOOP_ONCE);     /* admitted and prefilled */
    event_base_loop(base, EVLOOP_ONCE);
    CHECK(kvw_blocks_active(kvw_sched_blocks(e)) > 0);
    e->ops->cancel(e, &a.r);
    CHECK_EQ_U64(kvw_blocks_active(kvw_sched_blocks(e)), 0);
    run(base);
    CHECK(!a.done);
    e->ops->destroy(e);
    event_base_free(base);
}

TEST(stop_string_and_eos)
{
    struct event_base *base = event_base_new();
    kvw_config_t c = cfg_with(256, 8192, 0);
    tb_t *tb = tb_new(64, 16);
    kvw_engine_t *e = kvw_sched_create(&c, base, 0, &tb->b);
    char *stops[] = { "zz", "lmn" };
    tr_t a, b, d;

    tr_init(&a, 0, 7, 1, 50);       /* generates "hijklmn..." */
    a.r.stop = stops;
    a.r.n_stop = 2;
    e->ops->submit(e, &a.r);
    run(base);
    CHECK(a.done && a.why == KVW_FINISH_STOP);
    CHECK(a.len == 4 && memcmp(a.out, "hijk", 4) == 0);
    CHECK_EQ_U64(a.r.n_output, 7);

    tb->eos_at = 10;
    tr_init(&b, 1, 7, 1000, 50);
    e->ops->submit(e, &b.r);
    run(base);
    CHECK(b.done && b.why == KVW_FINISH_STOP);
    CHECK_EQ_U64(b.r.n_output, 4);

    tr_init(&d, 2, 7, 2000, 6);
    d.r.ignore_eos = 1;
    e->ops->submit(e, &d.r);
    run(base);
    CHECK(d.done && d.why == KVW_FINISH_LENGTH);
    CHECK_EQ_U64(d.r.n_output, 6);
    e->ops->destroy(e);
    event_base_free(base);
}

/* Stop strings are matched incrementally (KMP): megabyte-long stops, one
 * sharing a prefix with the output, cost nothing per token and the held-
 * back bytes are exactly those that could still begin a stop. */
TEST(long_stop_strings_match_incrementally)
{
    struct event_base *base = event_base_new();
    kvw_config_t c = cfg_with(256, 8192, 0);
    tb_t *tb = tb_new(64, 16);
    kvw_engine_t *e = kvw_sched_create(&c, base, 0, &tb->b);
    size_t big = 4u << 20;
    char *s1 = malloc(big + 1), *s2 = malloc(big + 1);
    memcpy(s1, "hijk", 4);
    memset(s1 + 4, 'x', big - 4);
    s1[big] = '\0';
    memset(s2, 'a', big);
    s2[big] = '\0';
    char *stops[] = { s1, s2, "klm", "hihij" };
    tr_t a;

    tr_init(&a, 0, 7, 1, 50);       /* generates "hijklmn..." */
    a.r.stop = stops;
    a.r.n_stop = 4;
    e->ops->submit(e, &a.r);
    run(base);
    CHECK(a.done && a.why == KVW_FINISH_STOP);
    CHECK(a.len == 3 && memcmp(a.out, "hij", 3) == 0);
    e->ops->destroy(e);
    event_base_free(base);
    free(s1);
    free(s2);
}

/*
 * A transfer's blocks (kvw_xfer.h): allocated, committed, handed to the
 * scheduler with submit_pinned. The request starts from them as its cached
 * prefix, and the pin is gone once it is admitted; a cancelled request
 * before admission lets go of them too.
 */
TEST(pinned_submit_uses_transferred_blocks)
{
    struct event_base *base = event_base_new();
    kvw_config_t c = cfg_with(256, 8192, 0);
    tb_t *tb = tb_new(64, 16);
    kvw_engine_t *e = kvw_sched_create(&c, base, 0, &tb->b);
    kvw_blocks_t *bm = kvw_sched_blocks(e);
    kvw_seq_blocks_t pin = {0};
    tr_t a, b;

    tr_init(&a, 0, 50, 7, 2);
    CHECK_EQ_U64(kvw_blocks_pin_prefix(bm, &pin, KV_HASH_SEED, a.r.prompt, 50), 0);
    CHECK(kvw_blocks_reserve(bm, &pin, 48) == 0);          /* the 3 full blocks */
    kvw_blocks_commit(bm, &pin, a.r.prompt, 48);
    CHECK_EQ_U64(kvw_blocks_active(bm), 3);
    CHECK(kvw_sched_submit_pinned(e, &a.r, &pin, NULL, 0) == 0);
    CHECK(pin.table == NULL);                               /* the scheduler owns it */
    run(base);
    CHECK(a.done && a.why == KVW_FINISH_LENGTH);
    CHECK_EQ_U64(a.r.cached_tokens, 48);
    CHECK_EQ_U64(tb->step_tokens[0][0], 2);                 /* only the tail ran */
    CHECK_EQ_U64(kvw_blocks_active(bm), 0);
    CHECK_EQ_U64(kvw_blocks_cached(bm), 3);

    /* cancelled while still waiting: the pin goes with it */
    tr_init(&b, 1, 50, 9000, 2);
    CHECK(submit_pulled(e, &b, NULL, 0) == 0);
    e->ops->cancel(e, &b.r);
    CHECK_EQ_U64(kvw_blocks_active(bm), 0);
    run(base);
    CHECK(!b.done);
    e->ops->destroy(e);
    event_base_free(base);
}

/*
 * Transfers can pin blocks into the watermark: three pulled requests hold
 * 9 of 10 blocks where the watermark keeps 2 free. Held to the watermark,
 * none was ever admitted and their pins were never let go (a decode worker
 * stalled for good); a pinned request needs only its tail block.
 */
TEST(pins_into_the_watermark_still_run)
{
    struct event_base *base = event_base_new();
    kvw_config_t c = cfg_with(256, 8192, 0.2);
    tb_t *tb = tb_new(10, 16);
    kvw_engine_t *e = kvw_sched_create(&c, base, 0, &tb->b);
    kvw_blocks_t *bm = kvw_sched_blocks(e);
    tr_t r[3];

    for (int i = 0; i < 3; i++) {
        tr_init(&r[i], i, 50, 100 + 1000 * (uint32_t)i, 2);
        CHECK(submit_pulled(e, &r[i], NULL, 0) == 0);
    }
    CHECK_EQ_U64(kvw_blocks_active(bm), 9);
    run(base);
    for (int i = 0; i < 3; i++)
        CHECK(r[i].done && r[i].why == KVW_FINISH_LENGTH && r[i].r.n_output == 2);
    CHECK_EQ_U64(kvw_blocks_active(bm), 0);
    e->ops->destroy(e);
    event_base_free(base);
}

/*
 * A pulled request (pinned) on a worker busy with a long chunked prefill,
 * behind another waiting prompt: it is admitted at the next step beside the
 * running prompt's chunk (which leaves it room) and ahead of the waiting
 * prompt, instead of waiting for both prefills. Budget 64: a's 300 tokens
 * run 64, then 62 beside b's 2 (its 48 transferred tokens cached), then 63
 * beside b's decode, which runs ahead of a's chunks from then on.
 */
TEST(pinned_request_not_held_behind_local_prefill)
{
    struct event_base *base = event_base_new();
    kvw_config_t c = cfg_with(256, 64, 0);
    tb_t *tb = tb_new(64, 16);
    kvw_engine_t *e = kvw_sched_create(&c, base, 0, &tb->b);
    tr_t a, b, w;

    tr_init(&a, 0, 300, 1000, 2);
    tr_init(&w, 1, 200, 5000, 2);
    tr_init(&b, 2, 50, 9000, 2);
    CHECK(e->ops->submit(e, &a.r) == 0);
    event_base_loop(base, EVLOOP_ONCE);             /* a's first chunk is under way */
    CHECK_EQ_U64(tb->n_steps, 1);
    CHECK(e->ops->submit(e, &w.r) == 0);
    CHECK(submit_pulled(e, &b, NULL, 0) == 0);
    run(base);
    CHECK(a.done && b.done && w.done);
    CHECK_EQ_U64(b.r.cached_tokens, 48);
    CHECK_EQ_U64(tb->step_tokens[0][0], 64);
    CHECK_EQ_U64(tb->step_n[1], 2);                 /* a's chunk and b's tail */
    CHECK_EQ_U64(tb->step_tokens[1][0], 62);
    CHECK_EQ_U64(tb->step_tokens[1][1], 2);
    CHECK_EQ_U64(tb->step_n[2], 2);                 /* b decodes first, beside a's chunk */
    CHECK_EQ_U64(tb->step_tokens[2][0], 1);
    CHECK_EQ_U64(tb->step_tokens[2][1], 63);
    e->ops->destroy(e);
    event_base_free(base);
}

/*
 * A pulled request whose first token came sampled from the prefill worker:
 * the client gets that token at the loop's next turn, while this engine is
 * still in the middle of a long step (2 s, so the order does not hang on
 * the host's speed), and not after the step that computes
 * its tail; that step then computes the tail and the given token (3 tokens:
 * 2 of the prompt's last partial block and the token) and samples the second
 * token, so the output is the one the engine itself would have produced
 * ('a' + position % 26: "yz" for a 50-token prompt). With max_tokens 1 the
 * given token ends the request before any step of its own; a given EOS
 * stops it.
 */
TEST(given_first_token_delivered_before_the_step)
{
    struct event_base *base = event_base_new();
    kvw_config_t c = cfg_with(256, 64, 0);
    tb_t *tb = tb_new(64, 16);
    kvw_engine_t *e;
    kvw_blocks_t *bm;
    tr_t a, b, one, eos;
    uint32_t y = 'a' + 50 % 26, stop = 1;

    tb->b.simulated = 1;
    tb->step_ms = 2000;     /* a's first step: far longer than the few calls below take */
    e = kvw_sched_create(&c, base, 0, &tb->b);
    bm = kvw_sched_blocks(e);
    tr_init(&a, 0, 300, 1000, 2);
    tr_init(&b, 1, 50, 9000, 2);
    tr_init(&one, 2, 50, 20000, 1);
    tr_init(&eos, 3, 50, 30000, 4);
    CHECK(e->ops->submit(e, &a.r) == 0);
    event_base_loop(base, EVLOOP_ONCE | EVLOOP_NONBLOCK);  /* a's first chunk is under way */
    CHECK_EQ_U64(tb->n_steps, 1);
    CHECK(submit_pulled(e, &b, &y, 77) == 0);
    CHECK(submit_pulled(e, &one, &y, 77) == 0);
    CHECK(submit_pulled(e, &eos, &stop, 77) == 0);
    CHECK_EQ_U64(b.r.n_output, 0);                  /* not from inside the submit */
    event_base_loop(base, EVLOOP_ONCE | EVLOOP_NONBLOCK);
    CHECK_EQ_U64(tb->n_steps, 1);                   /* the first step is still running */
    CHECK_EQ_U64(b.r.n_output, 1);
    CHECK(b.len == 1 && b.out[0] == 'y');
    CHECK(b.r.rng == 77);                           /* the sampler goes on from the given state */
    CHECK(!b.done);
    CHECK(one.done && one.why == KVW_FINISH_LENGTH && one.len == 1 && one.out[0] == 'y');
    CHECK(eos.done && eos.why == KVW_FINISH_STOP && eos.r.n_output == 1);
    tb->step_ms = 0;                                /* the rest at once */
    run(base);
    CHECK(a.done && b.done);
    CHECK(b.why == KVW_FINISH_LENGTH && b.len == 2 && memcmp(b.out, "yz", 2) == 0);
    CHECK_EQ_U64(b.r.cached_tokens, 48);
    CHECK_EQ_U64(tb->step_n[1], 2);                 /* a's chunk and b's tail with its token */
    CHECK_EQ_U64(tb->step_tokens[1][1], 3);
    CHECK_EQ_U64(kvw_blocks_active(bm), 0);
    e->ops->destroy(e);
    event_base_free(base);
}

TEST(too_long_prompt_refused)
{
    struct event_base *base = event_base_new();
    kvw_config_t c = cfg_with(256, 8192, 0);
    tb_t *tb = tb_new(4, 4);
    kvw_engine_t *e = kvw_sched_create(&c, base, 0, &tb->b);
    tr_t a;

    tr_init(&a, 0, 16, 1, 2);
    CHECK(e->ops->submit(e, &a.r) == KVW_SUBMIT_TOO_LONG);
    e->ops->destroy(e);
    event_base_free(base);
}

int main(void)
{
    RUN(chunked_prefill_then_decode);
    RUN(unchunked_prompt_over_budget_runs_alone);
    RUN(prefix_cache_hit_reported);
    RUN(max_num_seqs_and_budget);
    RUN(watermark_holds_back_admission);
    RUN(preempts_newest_when_blocks_run_out);
    RUN(cancel_frees_blocks);
    RUN(stop_string_and_eos);
    RUN(long_stop_strings_match_incrementally);
    RUN(too_long_prompt_refused);
    RUN(pinned_submit_uses_transferred_blocks);
    RUN(pins_into_the_watermark_still_run);
    RUN(pinned_request_not_held_behind_local_prefill);
    RUN(given_first_token_delivered_before_the_step);
    return kvt_done();
}
