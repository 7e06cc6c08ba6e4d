/*
 * Sampling on the device, pass 2, on the host (pass 1 is k_sample_cand in
 * kvw_cuda_kernels.cuh): from each chunk's largest p and sum of p, the
 * token kvw_sample (workers/kvw_sample.c) would pick from the full row with
 * the same RNG state, or -1 when the candidates cannot decide it.
 *
 * The candidates, merged in kvw_sample's order (p descending, id
 * ascending), are the row's true order up to the first chunk cut-off: a
 * chunk longer than KVC_SAMPLE_CANDS hides entries only after its last
 * candidate, so the merged list is exact up to the earliest such last
 * candidate (V entries). kvw_sample's walk (top-k, the top-p cut, the
 * uniform draw, the cumulative sum) is replayed over them; if it needs an
 * entry past V (a flat distribution, top_k beyond the candidates) the
 * answer is -1 with *rng untouched, and the caller copies the row and runs
 * kvw_sample itself. With no top_k the normaliser is the sum of the chunk
 * sums, which differs from kvw_sample's sorted-order sum in the last bits
 * of a double: a draw within ~1e-16 of a boundary can differ.
 */
#ifndef KVW_CUDA_SAMPLE_H
#define KVW_CUDA_SAMPLE_H

#include <stdint.h>
#include <stdlib.h>

typedef struct {
    float p;
    int   id;
} kvc_cand;

/* kvw_sample's order: p descending, then id ascending. */
static int kvc_cand_cmp(const void *a, const void *b)
{
    const kvc_cand *x = (const kvc_cand *) a, *y = (const kvc_cand *) b;

    return x->p < y->p ? 1 : x->p > y->p ? -1 : (x->id > y->id) - (x->id < y->id);
}

/* kvw_sample.c's uniform(), the same stream: one draw per sampled token. */
static double kvc_uniform(uint64_t *st)
{
    uint64_t x = *st ? *st : 0x9e3779b97f4a7c15ULL;

    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *st = x;
    return (double) ((x * 0x2545f4914f6cdd1dULL) >> 11) / 9007199254740992.0;
}

/*
 * One row: cp/ci are its nchunk * cands candidates (p < 0: none), sums its
 * nchunk chunk sums, chunk the entries per chunk; buf holds nchunk * cands.
 */
static int kvc_sample_pick(const float *cp, const int *ci, const double *sums, int nchunk,
                           int cands, int chunk, uint32_t vocab, const kvw_sampling_t *s,
                           kvc_cand *buf)
{
    int      n = 0, V, c, i, cut_c = -1;
    uint32_t k;
    double   sum = 0, r, acc;
    uint64_t saved;
    kvc_cand cut = {0, 0};

    for (c = 0; c < nchunk; c++) {
        int len = (int) vocab - c * chunk < chunk ? (int) vocab - c * chunk : chunk;

        for (i = 0; i < cands; i++) {
            if (cp[c * cands + i] >= 0) {
                buf[n].p = cp[c * cands + i];
                buf[n++].id = ci[c * cands + i];
            }
        }
        if (len > cands) {              /* a cut chunk: its last candidate bounds the exact part */
            kvc_cand last = {cp[c * cands + cands - 1], ci[c * cands + cands - 1]};

            if (cut_c < 0 || kvc_cand_cmp(&last, &cut) < 0) {
                cut = last;
                cut_c = c;
            }
        }
    }
    qsort(buf, (size_t) n, sizeof(kvc_cand), kvc_cand_cmp);
    V = n;
    if (cut_c >= 0) {
        for (i = 0; i < n; i++) {
            if (buf[i].id == cut.id) {
                V = i + 1;
                break;
            }
        }
    }
    k = s->top_k > 0 && (uint32_t) s->top_k < vocab ? (uint32_t) s->top_k : vocab;
    if (k == vocab) {
        for (c = 0; c < nchunk; c++) sum += sums[c];
    } else {
        if (k > (uint32_t) V) return -1;
        for (i = 0; i < (int) k; i++) sum += buf[i].p;
    }
    if (s->top_p > 0 && s->top_p < 1) {
        double lim = sum * s->top_p, run = 0;

        for (i = 0; i < (int) k; i++) {
            if (i >= V) return -1;
            run += buf[i].p;
            if (run >= lim) {
                k = (uint32_t) i + 1;
                break;
            }
        }
        for (sum = 0, i = 0; i < (int) k; i++) sum += buf[i].p;
    }
    saved = *s->rng;
    r = kvc_uniform(s->rng) * sum;
    for (acc = 0, i = 0; i < (int) k; i++) {
        if (i >= V) {
            *s->rng = saved;            /* the caller's kvw_sample draws it again */
            return -1;
        }
        acc += buf[i].p;
        if (r < acc) break;
    }
    return buf[i < (int) k ? i : (int) k - 1].id;
}

#endif
