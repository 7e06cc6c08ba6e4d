/*
 * Disaggregated serving's second half of the decision: once the decode
 * worker is chosen (kv_route_pick over the decode upstream), whether the
 * prompt is prefilled remotely, and on which prefill worker. Pure, like
 * kv_route.h: the nginx glue gathers the prefill servers' inputs (overlap
 * from the same index, prefill load from the same load table) and applies
 * the answer.
 *
 *   uncached_local = prompt_tokens - decode worker's cached overlap
 *
 *   1. Local, "short": uncached_local <= cfg.min_tokens. The decode worker
 *      holds (almost) the whole prompt, or what is left is short enough
 *      that prefilling it in place costs less than a transfer. This is
 *      Dynamo's conditional disaggregation (max_local_prefill_length) and
 *      the rule a decode kvworker applies itself (--disagg-min-tokens, 512
 *      by default there and here: nginx never names a prefill worker for a
 *      request the decode worker would prefill itself anyway).
 *   2. Otherwise the prefill servers are scored by kv_route_pick (the same
 *      core) with no decode term: a prefill worker decodes nothing, so its
 *      estimate is its time to first token alone, (queued prefill + its own
 *      uncached part) / prefill rate, with the bounded-load rule over its
 *      requests in flight and sticky prefix affinity. Weights, slack and
 *      busy thresholds are the prefill upstream's own kvroute parameters.
 *   3. Local, "none": no prefill server usable (down, failed, gone).
 *      Local, "busy": every usable one is over its busy threshold (the
 *      prefill pool is overloaded). Neither is ever a client error.
 */
#ifndef KV_PREFILL_H
#define KV_PREFILL_H

#include "kv_route.h"

#define KV_PREFILL_MIN_TOKENS   512     /* default cfg.min_tokens */

typedef struct {
    uint64_t    min_tokens;     /* uncached tokens at the decode worker up to
                                   this: prefill locally */
} kv_prefill_config_t;

void kv_prefill_config_init(kv_prefill_config_t *pc);

typedef enum {
    KV_PREFILL_REMOTE = 0,      /* out->route.pick names the prefill server */
    KV_PREFILL_LOCAL_SHORT,     /* little left to prefill at the decode worker */
    KV_PREFILL_LOCAL_NONE,      /* no usable prefill server */
    KV_PREFILL_LOCAL_BUSY       /* all usable prefill servers busy */
} kv_prefill_why_t;

typedef struct {
    kv_prefill_why_t    why;
    uint64_t            uncached_local;     /* at the decode worker */
    kv_route_result_t   route;              /* the prefill pick (REMOTE only) */
} kv_prefill_result_t;

/*
 * s[0..n): the prefill servers, as for kv_route_pick (their decode inputs
 * are ignored). decode_overlap: blocks the chosen decode worker is credited
 * with. cfg: the prefill upstream's routing config. Returns the index of
 * the chosen prefill server, or -1 for local prefill (out->why says why).
 */
int kv_prefill_pick(kv_route_server_t *s, size_t n, const kv_route_request_t *rq,
                    uint32_t decode_overlap, const kv_prefill_config_t *pc,
                    const kv_route_config_t *cfg, uint64_t rnd, kv_prefill_result_t *out);

/* "remote", "short", "none", "busy" */
const char *kv_prefill_why_name(kv_prefill_why_t why);

#endif
