/*
 * An honest "ideal" for a fleet: the hit rate a load-bounded longest-prefix
 * oracle reaches on a trace with the fleet's real, finite caches, and beside
 * it the infinite single-cache bound. Offline and deterministic: requests are
 * taken one at a time in trace order, with no notion of time.
 *
 * Prompts are cut into engine blocks as kvbench replay builds them: trace hash
 * id j covers prompt tokens [j*TB, (j+1)*TB), tokens past the last id are the
 * request's own, and an engine block of B tokens is reusable when another
 * prompt has the same tokens up to its end. Only full engine blocks are cached
 * (as in vLLM and kvworker); a hit is counted in tokens: B per leading block
 * found in the cache.
 *
 * The oracle's rule, for each request r in trace order:
 *   1. For every engine e: c_e = the leading full blocks of r already in e's
 *      cache, u_e = r's prompt tokens - B*c_e (its uncached prefill work),
 *      W_e = the uncached prompt tokens assigned to e so far.
 *   2. e is eligible when W_e + u_e <= balance * (sum W + u_e) / N: after
 *      taking r, its prefill work is within `balance` of the fleet's mean.
 *      In a fleet of two speeds (slow_engines > 0: the last ones run at
 *      slow_factor x the others' speed) work is counted in time: e is
 *      eligible when (W_e + u_e) / s_e <= balance * (sum W + u_e) / sum s,
 *      s_e its speed (1 or slow_factor), so a slow engine's share of the
 *      work is its share of the speed.
 *   3. Among eligible engines pick the longest cached prefix (largest c_e),
 *      ties to the smallest W_e / s_e, then the lowest index. When no engine
 *      is eligible (a request larger than the slack, e.g. the first one),
 *      pick the smallest (W_e + u_e) / s_e (counted in "fallbacks").
 *   4. The chosen engine's cache is an LRU of cache_tokens / B blocks: r's
 *      full blocks are touched (hits) or inserted (misses) from the last to
 *      the first, so a prompt's head is fresher than its tail and eviction
 *      takes tails before heads, as vLLM frees blocks.
 * The ideal is the same walk with one engine and a cache that never evicts.
 *
 * With floor_speedup > 0 it also gives, for both, the mean TTFT floor of
 * kvb_floor.h: what each request's uncached part takes alone on an idle mock
 * engine. The ideal's floor holds for requests computed in arrival order; a
 * router that lets a later request compute a shared prefix first moves that
 * hit to the earlier one, which changes the mean by their two prompts'
 * different marginal cost. The any-order floor (kvb_floor_any_order_ms)
 * needs no order: it uses only the ideal's total hits, which no schedule
 * exceeds.
 */
#ifndef KVB_ORACLE_H
#define KVB_ORACLE_H

#include <stddef.h>
#include <stdint.h>

#include "kv_trace.h"

typedef struct {
    uint32_t    engines;
    uint64_t    cache_tokens;       /* per engine */
    uint32_t    block_size;         /* engine KV block, tokens */
    uint32_t    trace_block_size;   /* tokens per trace hash id */
    double      balance;            /* >= 1: the load bound of rule 2 */
    uint32_t    slow_engines;       /* the last ones run at slow_factor x speed */
    double      slow_factor;        /* (0, 1]: their speed against the others' */
    double      floor_speedup;      /* the engines' --speedup; 0: no floors */
    uint32_t    floor_budget;       /* the engines' --max-num-batched-tokens */
} kvb_oracle_opts_t;

typedef struct {
    uint64_t    prompt_tokens;      /* sum of input_length */
    uint64_t    oracle_cached;      /* tokens the oracle found cached */
    uint64_t    ideal_cached;       /* tokens one infinite cache found */
    uint64_t    fallbacks;          /* requests no engine was eligible for */
    uint64_t    evictions;          /* blocks evicted over the whole fleet */
    double      oracle_hit_rate, ideal_hit_rate;
    double      work_spread;        /* max / mean assigned uncached prompt tokens */
    double      oracle_floor_ms, ideal_floor_ms;    /* mean TTFT floors (kvb_floor.h) */
    double      any_order_floor_ms;
} kvb_oracle_result_t;

/* -1 with a reason in err on bad options or no memory. */
int kvb_oracle_run(const kv_trace_t *t, const kvb_oracle_opts_t *o, kvb_oracle_result_t *res,
                   char *err, size_t errlen);

#endif
