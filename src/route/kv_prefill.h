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
 *   4. Local, "faster" (cfg.conditional): the two times to first token,
 *      estimated from the same learned lines and queues the router uses,
 *
 *        remote = ttft(prefill pick)                [kv_route's estimate]
 *               + xfer_ms_per_token x uncached_local      [the transfer]
 *        local  = base(d) + (queued(d) + uncached_local) / rate(d)
 *               + stall_weight x requests(d) x uncached_local / rate(d)
 *
 *      where d is the chosen decode worker, and the last term is the stall
 *      its prefill imposes on the requests d is decoding (each of them
 *      waits about as long as the prefill runs), weighed against this
 *      request's own time to first token: 0 counts only this request's
 *      TTFT, 1 counts a ms of everyone's decode stall as much. Local wins
 *      only when local x (1 + margin) < remote: a threshold that keeps
 *      noise in the estimates from flipping the decision, and leaves the
 *      operator's choice (disaggregation) in place unless it clearly costs.
 *      A decode worker the traffic has not measured (it has never
 *      prefilled) is taken to prefill like the prefill pool's mean measured
 *      server (same engines), else at cfg->prefill_rate.
 *      This is what lets the decode pool's idle prefill capacity count in a
 *      prefill-bound mix: a queued prefill pool loses to an idle decode
 *      worker, by as much as the stall is allowed to cost.
 */
#ifndef KV_PREFILL_H
#define KV_PREFILL_H

#include "kv_route.h"

#define KV_PREFILL_MIN_TOKENS   512     /* default cfg.min_tokens */
#define KV_PREFILL_STALL_WEIGHT 0.03    /* default cfg.stall_weight */
#define KV_PREFILL_MARGIN       0.25    /* default cfg.margin */

typedef struct {
    uint64_t    min_tokens;     /* uncached tokens at the decode worker up to
                                   this: prefill locally */
    int         conditional;    /* 1: rule 4 (default); 0: remote whenever
                                   a prefill server is usable */
    double      stall_weight;   /* rule 4's weight of the decode stall */
    double      margin;         /* rule 4: local x (1 + margin) < remote */
    double      xfer_ms_per_token;  /* the transfer; 0: in the prefill
                                       servers' learned line */
} kv_prefill_config_t;

void kv_prefill_config_init(kv_prefill_config_t *pc);

typedef enum {
    KV_PREFILL_REMOTE = 0,      /* out->route.pick names the prefill server */
    KV_PREFILL_LOCAL_SHORT,     /* little left to prefill at the decode worker */
    KV_PREFILL_LOCAL_NONE,      /* no usable prefill server */
    KV_PREFILL_LOCAL_BUSY,      /* all usable prefill servers busy */
    KV_PREFILL_LOCAL_FASTER     /* the decode worker's estimate wins (rule 4) */
} kv_prefill_why_t;

typedef struct {
    kv_prefill_why_t    why;
    uint64_t            uncached_local;     /* at the decode worker */
    double              remote_ms;          /* rule 4's estimates (0: not made) */
    double              local_ms;           /* ... local, the stall included */
    double              local_ttft_ms;      /* ... local, the stall left out: this
                                               request's own time to first token */
    double              xfer_ms;            /* the transfer's part of remote_ms */
    kv_route_result_t   route;              /* the prefill pick (REMOTE only) */
} kv_prefill_result_t;

/*
 * s[0..n): the prefill servers, as for kv_route_pick (their decode inputs
 * are ignored). d: the chosen decode worker as kv_route_pick saw it (its
 * overlap, queued prefill tokens, requests in flight, learned prefill
 * line); NULL: rule 4 is not applied. dcfg: the decode upstream's config
 * (its prefill_rate stands in for a decode worker nobody measured; NULL:
 * cfg's). cfg: the prefill upstream's routing config. Returns the index of
 * the chosen prefill server, or -1 for local prefill (out->why says why).
 */
int kv_prefill_pick(kv_route_server_t *s, size_t n, const kv_route_request_t *rq,
                    const kv_route_server_t *d, const kv_prefill_config_t *pc,
                    const kv_route_config_t *dcfg, const kv_route_config_t *cfg,
                    uint64_t rnd, kv_prefill_result_t *out);

/* "remote", "short", "none", "busy", "faster" */
const char *kv_prefill_why_name(kv_prefill_why_t why);

#endif
