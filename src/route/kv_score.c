/* Dynamo's routing cost and pick; the formula is in kv_score.h. */
#include <math.h>

#include "kv_score.h"

static void score_one(kv_candidate_t *c, uint64_t prompt_tokens,
                      const kv_score_config_t *cfg)
{
    double   bs = cfg->block_size ? cfg->block_size : 16;
    uint64_t cached = (uint64_t) c->overlap * (uint64_t) bs;
    uint64_t new_tokens = prompt_tokens > cached ? prompt_tokens - cached : 0;
    uint64_t prompt_blocks = prompt_tokens / (uint64_t) bs;
    uint64_t new_blocks = prompt_blocks > c->overlap ? prompt_blocks - c->overlap : 0;
    double   prefill, decode;

    prefill = (double) (c->active_prefill_tokens + new_tokens) / bs;
    decode = (double) (c->active_decode_blocks + new_blocks);
    c->cost = (cfg->overlap_weight * prefill + decode) / (c->weight ? c->weight : 1);

    c->busy = (cfg->busy_prefill_tokens
               && c->active_prefill_tokens >= cfg->busy_prefill_tokens)
              || (cfg->busy_decode_blocks
                  && c->active_decode_blocks >= cfg->busy_decode_blocks);
}

static int better(const kv_candidate_t *a, const kv_candidate_t *b)
{
    if (a->cost != b->cost) {
        return a->cost < b->cost;
    }
    return a->tree_blocks < b->tree_blocks;
}

/* Lowest cost; exact ties resolved by starting the scan at a random index. */
static int pick_min(const kv_candidate_t *c, size_t n, uint64_t rnd)
{
    size_t k, i, start = n ? (size_t) (rnd % n) : 0;
    int    best = -1;

    for (k = 0; k < n; k++) {
        i = (start + k) % n;
        if (!c[i].usable || c[i].busy) {
            continue;
        }
        if (best < 0 || better(&c[i], &c[best])) {
            best = (int) i;
        }
    }
    return best;
}

static int pick_softmax(const kv_candidate_t *c, size_t n, double t, uint64_t rnd)
{
    double lo = INFINITY, hi = -INFINITY, sum = 0, r;
    size_t i;
    int    last = -1;

    for (i = 0; i < n; i++) {
        if (c[i].usable && !c[i].busy) {
            lo = fmin(lo, c[i].cost);
            hi = fmax(hi, c[i].cost);
        }
    }
    if (!(hi > lo)) {
        return pick_min(c, n, rnd);
    }
    for (i = 0; i < n; i++) {
        if (c[i].usable && !c[i].busy) {
            sum += exp(-(c[i].cost - lo) / (hi - lo) / t);
        }
    }
    r = (double) (rnd >> 11) / 9007199254740992.0 * sum;
    for (i = 0; i < n; i++) {
        if (!c[i].usable || c[i].busy) {
            continue;
        }
        last = (int) i;
        r -= exp(-(c[i].cost - lo) / (hi - lo) / t);
        if (r < 0) {
            return (int) i;
        }
    }
    return last;
}

int kv_score_pick(kv_candidate_t *c, size_t n, uint64_t prompt_tokens,
                  const kv_score_config_t *cfg, uint64_t rnd)
{
    size_t i, usable = 0, busy = 0;

    for (i = 0; i < n; i++) {
        score_one(&c[i], prompt_tokens, cfg);
        if (c[i].usable) {
            usable++;
            busy += c[i].busy != 0;
        }
    }
    if (usable == 0) {
        return KV_SCORE_NONE;
    }
    if (busy == usable) {
        return KV_SCORE_BUSY;
    }
    if (cfg->temperature > 0) {
        return pick_softmax(c, n, cfg->temperature, rnd);
    }
    return pick_min(c, n, rnd);
}
