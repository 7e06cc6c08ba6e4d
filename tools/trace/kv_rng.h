/*
 * The trace tools' random numbers: xoshiro256** seeded through splitmix64,
 * one independent stream per (seed, stream) pair, so each knob of a
 * synthesized trace draws from its own stream and stays reproducible when
 * another knob changes how many numbers it takes.
 */
#ifndef KV_RNG_H
#define KV_RNG_H

#include <stdint.h>

typedef struct { uint64_t s[4]; } rng_t;

static inline uint64_t splitmix(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static inline void rng_seed(rng_t *r, uint64_t seed, uint64_t stream)
{
    uint64_t x = seed ^ (stream * 0xd1b54a32d192ed03ull);
    for (int i = 0; i < 4; i++)
        r->s[i] = splitmix(&x);
}

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static inline uint64_t rng_next(rng_t *r)
{
    uint64_t *s = r->s, out = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0], s[3] ^= s[1], s[1] ^= s[2], s[0] ^= s[3], s[2] ^= t, s[3] = rotl(s[3], 45);
    return out;
}

/* Uniform in [0, n), n > 0 (multiply-shift; the bias is below 2^-32 here). */
static inline uint64_t rng_below(rng_t *r, uint64_t n)
{
    return (uint64_t)(((unsigned __int128)rng_next(r) * n) >> 64);
}

#endif
