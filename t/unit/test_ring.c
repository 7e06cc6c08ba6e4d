/* The cold-placement ring: distinct successors, independent of build order
 * (only ids matter), stable when a server leaves, weights respected. */
#include <stdlib.h>
#include "kvtest.h"
#include "kv_ring.h"

enum { N = 512 };

static kv_ring_point_t *ring(const uint64_t *id, const uint32_t *w, size_t n, size_t *npt)
{
    kv_ring_point_t *pt;

    *npt = kv_ring_points(w, n);
    pt = malloc(*npt * sizeof(*pt));
    kv_ring_build(pt, id, w, n);
    return pt;
}

TEST(walk_distinct_and_id_only)
{
    static uint64_t id[N], rid[N];
    static uint32_t w[N];
    kv_ring_point_t *a, *b;
    uint32_t         oa[8], ob[8];
    size_t           na, nb, i, j, key;

    for (i = 0; i < N; i++) {
        id[i] = 1000 + i * 7919;
        rid[N - 1 - i] = id[i];         /* the same fleet listed backwards */
        w[i] = 1;
    }
    a = ring(id, w, N, &na);
    b = ring(rid, w, N, &nb);
    CHECK(na == N * KV_RING_POINTS && nb == na);
    for (key = 0; key < 1000; key++) {
        CHECK(kv_ring_walk(a, na, key * 0x1234567ULL, oa, 8) == 8);
        CHECK(kv_ring_walk(b, nb, key * 0x1234567ULL, ob, 8) == 8);
        for (i = 0; i < 8; i++) {
            CHECK(id[oa[i]] == rid[ob[i]]);
            for (j = 0; j < i; j++) {
                CHECK(oa[i] != oa[j]);
            }
        }
    }
    CHECK(kv_ring_walk(a, na, 5, oa, 0) == 0);
    CHECK(kv_ring_walk(a, 0, 5, oa, 8) == 0);
    free(a);
    free(b);
}

/* A server leaving moves only the keys whose first successor it was. */
TEST(stable_when_one_leaves)
{
    static uint64_t id[N];
    static uint32_t w[N];
    kv_ring_point_t *a, *b;
    uint32_t         oa[1], ob[1];
    size_t           na, nb, i, moved = 0, key;

    for (i = 0; i < N; i++) {
        id[i] = 77 + i;
        w[i] = 1;
    }
    a = ring(id, w, N, &na);
    b = ring(id, w, N - 1, &nb);        /* the last one gone */
    for (key = 0; key < 20000; key++) {
        kv_ring_walk(a, na, key, oa, 1);
        kv_ring_walk(b, nb, key, ob, 1);
        if (oa[0] != ob[0]) {
            CHECK(oa[0] == N - 1);
            moved++;
        }
    }
    CHECK(moved < 20000 / 50);
    free(a);
    free(b);
}

TEST(weights)
{
    uint64_t         id[4] = { 1, 2, 3, 4 };
    uint32_t         w[4] = { 1, 1, 1, 4 }, o[1];
    size_t           npt, key, hits[4] = { 0 };
    kv_ring_point_t *pt = ring(id, w, 4, &npt);

    CHECK(npt == 7 * KV_RING_POINTS);
    for (key = 0; key < 70000; key++) {
        kv_ring_walk(pt, npt, key, o, 1);
        hits[o[0]]++;
    }
    CHECK(hits[3] > 2 * hits[0] && hits[3] > 2 * hits[1] && hits[3] > 2 * hits[2]);
    CHECK(kv_ring_walk(pt, npt, 9, o, 1) == 1);
    free(pt);
}

int main(void)
{
    RUN(walk_distinct_and_id_only);
    RUN(stable_when_one_leaves);
    RUN(weights);
    return kvt_done();
}
