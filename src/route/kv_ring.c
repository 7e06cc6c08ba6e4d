/* The cold-placement ring (see kv_ring.h). */
#include <stdlib.h>

#include "kv_hash.h"
#include "kv_ring.h"

static uint32_t points_of(uint32_t weight)
{
    weight = weight ? weight : 1;
    return KV_RING_POINTS * (weight < KV_RING_MAX_WEIGHT ? weight : KV_RING_MAX_WEIGHT);
}

size_t kv_ring_points(const uint32_t *weight, size_t n)
{
    size_t i, total = 0;

    for (i = 0; i < n; i++) {
        total += points_of(weight[i]);
    }
    return total;
}

static int by_hash(const void *a, const void *b)
{
    const kv_ring_point_t *x = a, *y = b;

    if (x->hash != y->hash) {
        return x->hash < y->hash ? -1 : 1;
    }
    return x->server < y->server ? -1 : x->server > y->server;
}

void kv_ring_build(kv_ring_point_t *pt, const uint64_t *id, const uint32_t *weight,
                   size_t n)
{
    size_t   i, m = 0;
    uint32_t v;

    for (i = 0; i < n; i++) {
        for (v = 0; v < points_of(weight[i]); v++) {
            pt[m].hash = kv_mix64(kv_mix64(id[i]) ^ (v + 1) * 0x9e3779b97f4a7c15ULL);
            pt[m].server = (uint32_t) i;
            m++;
        }
    }
    qsort(pt, m, sizeof(*pt), by_hash);
}

size_t kv_ring_walk(const kv_ring_point_t *pt, size_t npt, uint64_t key, uint32_t *out,
                    size_t k)
{
    size_t   lo = 0, hi = npt, i, j, n = 0, steps;
    uint64_t h = kv_mix64(key);

    if (npt == 0) {
        return 0;
    }
    while (lo < hi) {                   /* the first point at or after h */
        i = lo + (hi - lo) / 2;
        if (pt[i].hash < h) {
            lo = i + 1;
        } else {
            hi = i;
        }
    }
    for (steps = 0, i = lo % npt; steps < npt && n < k; steps++, i = (i + 1) % npt) {
        for (j = 0; j < n && out[j] != pt[i].server; j++) {
            /* void */
        }
        if (j == n) {
            out[n++] = pt[i].server;
        }
    }
    return n;
}
