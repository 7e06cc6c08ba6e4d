/*
 * Two byte-level helpers every decoder needs: a growable array and a
 * big-endian integer read. Header-only so each layer may use them.
 */
#ifndef KV_BUF_H
#define KV_BUF_H

#include <stdint.h>
#include <stdlib.h>

/*
 * Grows *p (an array of *cap elements of `size` bytes) to hold at least
 * `need` elements, doubling from 16 so that appending stays amortised O(1).
 * Returns 0, or -1 on overflow or out of memory (then *p is unchanged).
 */
static inline int kv_grow(void **p, size_t *cap, size_t need, size_t size)
{
    size_t  n = *cap ? *cap : 16;
    void   *q;

    if (need <= *cap) {
        return 0;
    }
    while (n < need) {
        if (n > SIZE_MAX / 2) {
            return -1;
        }
        n *= 2;
    }
    if (size != 0 && n > SIZE_MAX / size) {
        return -1;
    }
    q = realloc(*p, n * size);
    if (q == NULL) {
        return -1;
    }
    *p = q;
    *cap = n;
    return 0;
}

/* The n-byte (n <= 8) big-endian unsigned integer at p. */
static inline uint64_t kv_be(const uint8_t *p, int n)
{
    uint64_t  v = 0;
    int       i;

    for (i = 0; i < n; i++) {
        v = v << 8 | p[i];
    }
    return v;
}

#endif
