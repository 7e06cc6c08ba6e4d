/*
 * Approximate mode's memory, learned from the engines' own answers.
 *
 * Without KV events the router records each decision as if the chosen
 * server now caches the prompt, and believes it for the zone's `ttl`. How
 * long an engine really keeps a block depends on its pool and its traffic:
 * with a small pool it evicts in seconds, and a router that goes on
 * crediting evicted blocks sends requests to servers that must prefill them
 * again (docs/BENCHMARKS.md, "Held out: caches under pressure"). A response
 * says how many prompt tokens the engine found cached. Each one, set beside
 * what the router credited the server with and how long ago the router
 * last recorded the deepest credited block (its age), is a sample: the
 * credited tokens the engine had (right) or had not (wrong) at that age.
 *
 * Samples go into buckets by age, a factor of sqrt(2) apart from 1 s. The
 * memory to use is the lower edge of the youngest bucket, no younger than
 * KV_RETAIN_FLOOR_MS, where three quarters of the credited tokens were gone
 * (KV_RETAIN_STALE_PCT); the configured ttl where none is. Not half: a
 * credit still right a third of the time is worth more than a cold
 * placement, since the router sticks to it only where the prefill it saves
 * outweighs the holder's extra queue; at half, a hot prefix over small
 * pools lost 1.12-1.25x mean TTFT, at three quarters it was level
 * (docs/BENCHMARKS.md, "Approximate mode learns its memory"). Ages under
 * the floor are left out: a miss that young is more often two requests
 * prefilled together than an eviction. The
 * memory shrinks at once and grows back a few percent a tick, so samples
 * at older ages come back as it grows and the verdict can change with the
 * traffic; buckets decay, so old traffic stops counting.
 *
 * The counters are shared by every process (in the zone) and updated with
 * atomic adds; one process at a time decays them and chooses (the caller
 * holds the zone's mutex there). No allocation, no nginx.
 */
#ifndef KV_RETAIN_H
#define KV_RETAIN_H

#include <stdint.h>

#define KV_RETAIN_BUCKETS   18          /* [1 s, 1.41 s) ... [256 s, ...) and < 1 s */
#define KV_RETAIN_FLOOR_MS  2000        /* the youngest memory it chooses */
#define KV_RETAIN_MIN_N     16          /* samples a bucket needs for a verdict */
#define KV_RETAIN_STALE_PCT 75          /* credited tokens gone for a verdict, % */

typedef struct {
    uint64_t    right[KV_RETAIN_BUCKETS];   /* credited tokens the engine had */
    uint64_t    wrong[KV_RETAIN_BUCKETS];   /* credited tokens it had not */
    uint64_t    n[KV_RETAIN_BUCKETS];       /* samples, x KV_RETAIN_ONE */
    uint64_t    samples;                    /* ever, for the status */
} kv_retain_t;

#define KV_RETAIN_ONE       1024        /* n's fixed point, so decay keeps fractions */

/* The bucket of an age, and a bucket's lower edge in ms (0 for bucket 0). */
int      kv_retain_bucket(uint64_t age_ms);
uint64_t kv_retain_edge_ms(int b);

/* One response: the server was credited with `credited` prompt tokens whose
 * deepest block the router last recorded age_ms ago, and the engine found
 * `cached` of the prompt's tokens cached. Any process, any time. */
void kv_retain_sample(kv_retain_t *r, uint64_t age_ms, uint64_t credited,
                      uint64_t cached);

/* Every bucket times keep_1024 / 1024. One process at a time. */
void kv_retain_decay(kv_retain_t *r, uint32_t keep_1024);

/* The memory the samples support: at most cap_ms. */
uint64_t kv_retain_choose(const kv_retain_t *r, uint64_t cap_ms);

/* The next memory from the current one: down at once to the choice, up by
 * at most a 32nd (and 250 ms) a call. */
uint64_t kv_retain_step(uint64_t cur_ms, uint64_t choice_ms);

#endif
