/*
 * Multi-turn chat sessions (see kv_synth_sessions.h).
 */
#include "kv_synth_sessions.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_rng.h"

static double rng_unit(rng_t *r)       /* (0, 1] */
{
    return ((double)(rng_next(r) >> 11) + 1.0) / 9007199254740992.0;
}

static uint32_t rng_between(rng_t *r, uint32_t lo, uint32_t hi)
{
    return lo + (uint32_t)rng_below(r, hi - lo + 1ull);
}

static double rng_exp(rng_t *r, double mean)
{
    return -mean * log(rng_unit(r));
}

void kv_sessions_knobs_default(kv_sessions_knobs_t *k)
{
    *k = (kv_sessions_knobs_t){
        .num_requests = 1000, .rate = 10, .seed = 1, .block_size = 16,
        .systems = 16, .system_tokens = 1024, .turns_min = 2, .turns_max = 6,
        .user_min = 64, .user_max = 512, .output_min = 64, .output_max = 384,
        .think_min_s = 10, .think_mean_s = 30, .think_max_s = 60,
    };
}

int kv_sessions_knobs_check(const kv_sessions_knobs_t *k, char *err, size_t errlen)
{
    const char *why = NULL;
    if (k->num_requests == 0 || k->num_requests > 100000000)
        why = "num-requests must be in [1, 1e8]";
    else if (!(k->rate > 0 && k->rate <= 1e6))
        why = "rate must be in (0, 1e6]";
    else if (k->block_size == 0 || k->block_size > 65536)
        why = "block-size must be in [1, 65536]";
    else if (k->systems == 0 || k->systems > 1000000)
        why = "systems must be in [1, 1e6]";
    else if (k->turns_min == 0 || k->turns_min > k->turns_max || k->turns_max > 1000)
        why = "turns must be MIN..MAX with 1 <= MIN <= MAX <= 1000";
    else if (k->user_min == 0 || k->user_min > k->user_max || k->user_max > 1u << 20)
        why = "user-tokens must be MIN..MAX with 1 <= MIN <= MAX <= 2^20";
    else if (k->output_min == 0 || k->output_min > k->output_max || k->output_max > 1u << 20)
        why = "output-tokens must be MIN..MAX with 1 <= MIN <= MAX <= 2^20";
    else if (k->system_tokens > 1u << 24)
        why = "system-tokens must be at most 2^24";
    else if (!(k->think_min_s >= 0 && k->think_min_s <= k->think_mean_s
               && k->think_mean_s <= k->think_max_s && k->think_max_s <= 1e6))
        why = "think times must be 0 <= MIN <= MEAN <= MAX <= 1e6 seconds";
    if (why == NULL)
        return 0;
    snprintf(err, errlen, "%s", why);
    return -1;
}

static uint32_t blocks_of(const kv_sessions_knobs_t *k, uint32_t tokens)
{
    return (tokens + k->block_size - 1) / k->block_size;
}

typedef struct {
    uint64_t    ts;
    size_t      idx;
} order_t;

static int by_time(const void *a, const void *b)
{
    const order_t *x = a, *y = b;
    if (x->ts != y->ts)
        return x->ts < y->ts ? -1 : 1;
    return x->idx < y->idx ? -1 : x->idx > y->idx;
}

int kv_sessions_generate(const kv_sessions_knobs_t *k, kv_trace_t *out)
{
    rng_t lens, starts, think;
    kv_trace_t all = {0};
    uint64_t *hist = NULL, msg = 0;
    size_t cap = 0;
    order_t *ord = NULL;
    double start = 0, mean_turns = (k->turns_min + k->turns_max) / 2.0;
    int rc = -1;

    rng_seed(&lens, k->seed, 1);
    rng_seed(&starts, k->seed, 2);
    rng_seed(&think, k->seed, 3);
    /* twice the requests wanted: sessions still running at the cut keep their early turns */
    while (all.n < 2 * k->num_requests) {
        uint32_t g = rng_between(&lens, 0, k->systems - 1);
        uint32_t turns = rng_between(&lens, k->turns_min, k->turns_max);
        size_t n = 0;
        double t = start;
        for (uint32_t j = 0; j < blocks_of(k, k->system_tokens); j++) {
            if (n == cap) {
                uint64_t *h = realloc(hist, (cap = cap ? cap * 2 : 1024) * sizeof(*h));
                if (h == NULL)
                    goto out;
                hist = h;
            }
            hist[n++] = ((uint64_t)(g + 1) << 32) | j;
        }
        for (uint32_t turn = 0; turn < turns; turn++) {
            uint32_t user = blocks_of(k, rng_between(&lens, k->user_min, k->user_max));
            uint32_t osl = rng_between(&lens, k->output_min, k->output_max);
            uint32_t reply = blocks_of(k, osl);
            if (n + user + reply > cap) {
                while (n + user + reply > cap)
                    cap = cap ? cap * 2 : 1024;
                uint64_t *h = realloc(hist, cap * sizeof(*h));
                if (h == NULL)
                    goto out;
                hist = h;
            }
            msg++;
            for (uint32_t j = 0; j < user; j++)
                hist[n++] = (1ull << 62) | (msg << 16) | j;
            if (n > UINT32_MAX / k->block_size
                || kv_trace_add(&all, (uint64_t)(t * 1000.0), (uint32_t)n * k->block_size, osl,
                                hist, (uint32_t)n))
                goto out;
            msg++;
            for (uint32_t j = 0; j < reply; j++)
                hist[n++] = (1ull << 62) | (msg << 16) | j;
            double gap = k->think_min_s + rng_exp(&think, k->think_mean_s - k->think_min_s);
            t += gap < k->think_max_s ? gap : k->think_max_s;
        }
        start += rng_exp(&starts, mean_turns / k->rate);
    }
    ord = malloc(all.n * sizeof(*ord));
    if (ord == NULL)
        goto out;
    for (size_t i = 0; i < all.n; i++)
        ord[i] = (order_t){ all.reqs[i].timestamp_ms, i };
    qsort(ord, all.n, sizeof(*ord), by_time);
    for (size_t i = 0; i < k->num_requests; i++) {
        const kv_trace_req_t *r = &all.reqs[ord[i].idx];
        if (kv_trace_add(out, r->timestamp_ms, r->input_length, r->output_length,
                         kv_trace_ids(&all, r), r->n_hash))
            goto out;
    }
    rc = 0;
out:
    free(ord);
    free(hist);
    kv_trace_free(&all);
    return rc;
}
