/*
 * A 64-byte block of token ids converted two ids per SSE2 vector, against
 * kv_body.c's loop (one SWAR conversion an id): outputs compared on 2M random
 * blocks, then both timed on 1,024 ids (docs/BENCHMARKS.md, "Decision time for
 * 1,024 token ids: where the time goes"). gcc -O2 ids-pairs.c && taskset -c 0 ./a.out
 */
#include <emmintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}

static uint32_t swar_value(uint64_t x, unsigned n)
{
    x = (x - 0x3030303030303030ULL) << (8 * (8 - n));
    x = (x * 10 + (x >> 8)) & 0x00ff00ff00ff00ffULL;
    x = (x * 100 + (x >> 16)) & 0x0000ffff0000ffffULL;
    x = (x * 10000 + (x >> 32)) & 0xffffffffULL;
    return (uint32_t) x;
}
static void classify64(const char *p, uint64_t *dig, uint64_t *com, uint64_t *spc)
{
    const __m128i zero = _mm_set1_epi8('0'), nine = _mm_set1_epi8(9);
    const __m128i comma = _mm_set1_epi8(','), space = _mm_set1_epi8(' ');
    __m128i v, t; int i;
    *dig = *com = *spc = 0;
    for (i = 0; i < 4; i++) {
        v = _mm_loadu_si128((const __m128i *) (const void *) (p + 16 * i));
        t = _mm_sub_epi8(v, zero);
        *dig |= (uint64_t) (uint16_t) _mm_movemask_epi8(_mm_cmpeq_epi8(_mm_min_epu8(t, nine), t)) << (16 * i);
        *com |= (uint64_t) (uint16_t) _mm_movemask_epi8(_mm_cmpeq_epi8(v, comma)) << (16 * i);
        *spc |= (uint64_t) (uint16_t) _mm_movemask_epi8(_mm_cmpeq_epi8(v, space)) << (16 * i);
    }
}
static size_t ids_block(const char *p, uint32_t *ids, const char **last)
{
    uint64_t dig, com, spc, ok, starts, x; unsigned a, c; size_t k = 0;
    classify64(p, &dig, &com, &spc);
    ok = dig | com | spc;
    if (~ok) { ok = (1ULL << __builtin_ctzll(~ok)) - 1; dig &= ok; com &= ok; spc &= ok; }
    if ((com & com << 1) || (spc & ~(com << 1)) || (com & ~(dig << 1))) return 0;
    for (starts = dig & ~(dig << 1); com; com &= com - 1, starts &= starts - 1) {
        a = (unsigned) __builtin_ctzll(starts); c = (unsigned) __builtin_ctzll(com);
        if (c - a > 7) break;
        memcpy(&x, p + a, 8);
        ids[k++] = swar_value(x, c - a);
        *last = p + c;
    }
    return k;
}

/* variant: ids' digits gathered right-aligned into 8-byte lanes (load ending at
 * the comma, bytes before the id masked off), two ids converted per SSE2 vector */
static inline uint64_t digits_at(const char *p, unsigned a, unsigned c)
{
    uint64_t x, m = ~0ULL << (8 * (8 - (c - a)));
    memcpy(&x, p + c - 8, 8);
    return (x & m) - (0x3030303030303030ULL & m);
}
static size_t ids_block2(const char *p, uint32_t *ids, const char **last)
{
    uint64_t dig, com, spc, ok, starts, x0, x1; unsigned a, c; size_t k = 0; int two;
    const __m128i lo8 = _mm_set1_epi16(0x00ff), ten = _mm_set1_epi16(10);
    const __m128i hund = _mm_set1_epi32(0x00010064), tenk = _mm_set1_epi32(0x00012710);
    classify64(p, &dig, &com, &spc);
    ok = dig | com | spc;
    if (~ok) { ok = (1ULL << __builtin_ctzll(~ok)) - 1; dig &= ok; com &= ok; spc &= ok; }
    if ((com & com << 1) || (spc & ~(com << 1)) || (com & ~(dig << 1))) return 0;
    starts = dig & ~(dig << 1);
    while (com) {
        a = (unsigned) __builtin_ctzll(starts); c = (unsigned) __builtin_ctzll(com);
        if (c - a > 7) break;
        x0 = digits_at(p, a, c);
        *last = p + c;
        com &= com - 1; starts &= starts - 1;
        x1 = 0; two = 0;
        if (com) {
            a = (unsigned) __builtin_ctzll(starts); c = (unsigned) __builtin_ctzll(com);
            if (c - a <= 7) {
                x1 = digits_at(p, a, c);
                *last = p + c;
                com &= com - 1; starts &= starts - 1;
                two = 1;
            }
        }
        __m128i v = _mm_set_epi64x((long long) x1, (long long) x0);
        __m128i pr = _mm_add_epi16(_mm_mullo_epi16(_mm_and_si128(v, lo8), ten), _mm_srli_epi16(v, 8));
        __m128i qd = _mm_madd_epi16(pr, hund);
        __m128i q16 = _mm_packs_epi32(qd, qd);
        __m128i r = _mm_madd_epi16(q16, tenk);
        _mm_storel_epi64((__m128i *) (void *) (ids + k), r);
        k += 1 + two;
        if (!two) break;
    }
    return k;
}

static char buf[1 << 16];
int main(void)
{
    uint32_t o1[40], o2[40]; const char *l1, *l2; size_t n = 0;
    srand(1);
    /* random id text: 1-7 digits, commas, optional space */
    for (int t = 0; t < 2000000; t++) {
        char s[200]; size_t m = 8; memset(s, '[', 8);
        while (m < 180) { int d = 1 + rand() % 7; if (rand() % 50 == 0) d = 8; for (int j = 0; j < d; j++) s[m++] = '0' + rand() % 10; s[m++] = ','; if (rand() % 4 == 0) s[m++] = ' '; if (rand()%200==0) s[m++]='x'; }
        size_t k1 = ids_block(s + 8, o1, &l1), k2 = ids_block2(s + 8, o2, &l2);
        if (k1 != k2 || memcmp(o1, o2, k1 * 4) || (k1 && l1 != l2)) { printf("MISMATCH %zu %zu\n%.80s\n", k1, k2, s + 8); return 1; }
        n += k1;
    }
    printf("equal, %zu ids\n", n);
    /* speed: 1024 ids of 3-5 digits */
    size_t m = 8; memset(buf, '[', 8);
    for (int i = 1; i <= 1024; i++) m += sprintf(buf + m, "%s%d", i > 1 ? "," : "", (7 * 7919 + i * 31) % 30000 + 100);
    memcpy(buf + m, "]}                                                                                          ", 80);
    for (int v = 0; v < 2; v++) for (int rep = 0; rep < 3; rep++) {
        static uint32_t out[4096]; double best = 1e9;
        for (int r = 0; r < 20000; r++) {
            double t0 = now(); const char *p = buf + 8, *q; size_t k = 0;
            while (p + 72 < buf + m) { size_t got = v ? ids_block2(p, out + k, &q) : ids_block(p, out + k, &q); if (!got) break; k += got; p = q + 1; }
            double e = now() - t0; if (e < best) best = e;
        }
        printf("%s best %.2f us\n", v ? "block2" : "block ", best * 1e6);
    }
    return 0;
}
