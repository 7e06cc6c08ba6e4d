/* Approximate mode's memory, learned (kv_retain.h). */
#include "kv_retain.h"

/* lower edges from bucket 1: 1000 * 2^((b - 1) / 2) ms */
static const uint64_t edges[KV_RETAIN_BUCKETS] = {
    0, 1000, 1414, 2000, 2828, 4000, 5657, 8000, 11314, 16000, 22627,
    32000, 45255, 64000, 90510, 128000, 181019, 256000
};

int kv_retain_bucket(uint64_t age_ms)
{
    int b = KV_RETAIN_BUCKETS - 1;

    while (b > 0 && age_ms < edges[b]) {
        b--;
    }
    return b;
}

uint64_t kv_retain_edge_ms(int b)
{
    return b >= 0 && b < KV_RETAIN_BUCKETS ? edges[b] : 0;
}

void kv_retain_sample(kv_retain_t *r, uint64_t age_ms, uint64_t credited,
                      uint64_t cached)
{
    int      b;
    uint64_t right;

    if (credited == 0) {
        return;     /* nothing was believed: nothing to check */
    }
    b = kv_retain_bucket(age_ms);
    right = cached < credited ? cached : credited;
    __atomic_fetch_add(&r->right[b], right, __ATOMIC_RELAXED);
    __atomic_fetch_add(&r->wrong[b], credited - right, __ATOMIC_RELAXED);
    __atomic_fetch_add(&r->n[b], KV_RETAIN_ONE, __ATOMIC_RELAXED);
    __atomic_fetch_add(&r->samples, 1, __ATOMIC_RELAXED);
}

/* Takes away what decay removes, so adds that race with it are kept. */
static void decay_one(uint64_t *v, uint32_t keep_1024)
{
    uint64_t x = __atomic_load_n(v, __ATOMIC_RELAXED);
    uint64_t kept = x / 1024 * keep_1024 + x % 1024 * keep_1024 / 1024;

    if (x > kept) {
        __atomic_fetch_sub(v, x - kept, __ATOMIC_RELAXED);
    }
}

void kv_retain_decay(kv_retain_t *r, uint32_t keep_1024)
{
    int b;

    for (b = 0; b < KV_RETAIN_BUCKETS; b++) {
        decay_one(&r->right[b], keep_1024);
        decay_one(&r->wrong[b], keep_1024);
        decay_one(&r->n[b], keep_1024);
    }
}

uint64_t kv_retain_choose(const kv_retain_t *r, uint64_t cap_ms)
{
    int      b;
    uint64_t right, wrong;

    for (b = kv_retain_bucket(KV_RETAIN_FLOOR_MS); b < KV_RETAIN_BUCKETS; b++) {
        if (edges[b] >= cap_ms) {
            break;
        }
        if (__atomic_load_n(&r->n[b], __ATOMIC_RELAXED)
                < (uint64_t) KV_RETAIN_MIN_N * KV_RETAIN_ONE) {
            continue;   /* too few to say */
        }
        right = __atomic_load_n(&r->right[b], __ATOMIC_RELAXED);
        wrong = __atomic_load_n(&r->wrong[b], __ATOMIC_RELAXED);
        if (wrong * 100 > (right + wrong) * KV_RETAIN_STALE_PCT) {
            return edges[b];
        }
    }
    return cap_ms;
}

uint64_t kv_retain_step(uint64_t cur_ms, uint64_t choice_ms)
{
    uint64_t up;

    if (choice_ms <= cur_ms) {
        return choice_ms;
    }
    up = cur_ms / 32 > 250 ? cur_ms / 32 : 250;
    return cur_ms + up < choice_ms ? cur_ms + up : choice_ms;
}
