/* Token sampling shared by the real engines (kvw_sample.h). */
#include <math.h>
#include <stdlib.h>

#include "kvw_sample.h"

typedef struct {
    float    p;
    uint32_t id;
} cand_t;

static int by_p_desc(const void *a, const void *b)
{
    float x = ((const cand_t *) a)->p, y = ((const cand_t *) b)->p;

    return x < y ? 1 : x > y ? -1 : (int) ((const cand_t *) a)->id - (int) ((const cand_t *) b)->id;
}

static double uniform(uint64_t *st)
{
    uint64_t x = *st ? *st : 0x9e3779b97f4a7c15ULL;

    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *st = x;
    return (double) ((x * 0x2545f4914f6cdd1dULL) >> 11) / 9007199254740992.0;
}

uint32_t kvw_sample(float *logits, uint32_t n, const kvw_sampling_t *s)
{
    uint32_t i, best = 0, k;
    float    max;
    double   sum = 0, r, acc;
    cand_t  *c;

    /* NaN logits (an overflow upstream) never win, as the CUDA argmax */
    while (best + 1 < n && isnan(logits[best])) best++;
    for (i = best + 1; i < n; i++) {
        if (logits[i] > logits[best]) best = i;
    }
    max = logits[best];
    /* an infinite logit leaves nothing to weigh: the greedy pick */
    if (s->temperature <= 1e-5f || s->rng == NULL || !isfinite(max)) {
        return best;
    }
    c = malloc(n * sizeof(cand_t));
    if (c == NULL) return best;
    for (i = 0; i < n; i++) {
        c[i].p = isnan(logits[i]) ? 0 : expf((logits[i] - max) / s->temperature);
        c[i].id = i;
    }
    qsort(c, n, sizeof(cand_t), by_p_desc);
    k = s->top_k > 0 && (uint32_t) s->top_k < n ? (uint32_t) s->top_k : n;
    for (i = 0; i < k; i++) sum += c[i].p;
    if (s->top_p > 0 && s->top_p < 1) {
        double cut = sum * s->top_p, run = 0;

        for (i = 0; i < k; i++) {
            run += c[i].p;
            if (run >= cut) { k = i + 1; break; }
        }
        for (sum = 0, i = 0; i < k; i++) sum += c[i].p;
    }
    r = uniform(s->rng) * sum;
    for (acc = 0, i = 0; i < k; i++) {
        acc += c[i].p;
        if (r < acc) break;
    }
    best = c[i < k ? i : k - 1].id;
    free(c);
    return best;
}
