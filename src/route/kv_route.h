/*
 * The routing decision, whole: given one request and what is known about
 * each candidate server (its cached overlap from the index and from the
 * router's own recent decisions, whether its index state can be trusted,
 * the load this router counts and the load the worker reports, and what
 * the traffic taught about its speed), choose a server, or say that every
 * usable one is busy, and say what load the attempt adds. Pure: no nginx,
 * no shared memory; the nginx glue gathers the inputs and applies the
 * choice, and unit tests drive it with recorded inputs.
 *
 * Two policies (cfg.policy):
 *
 * KV_ROUTE_TTFT (default): estimated time to first token, Mooncake
 * Conductor style, with "sticky until saturated" prefix affinity.
 *
 *   uncached(s) = prompt_tokens - min(prompt_tokens, overlap(s) * block_size)
 *   ttft(s)     = prefill_base(s) + (queued_prefill_tokens(s) + uncached(s)) / prefill_rate(s)   [ms]
 *   decode(s)   = output_tokens * decode_pace(s)                             [ms]
 *
 *   prefill_rate is learned per server from traffic (prompt tokens it had to
 *   prefill per ms of time to first byte, queueing included, so decode
 *   interference and batching are in it); decode_pace likewise (ms per output
 *   token); cfg's defaults (times the nginx weight) stand in before any sample.
 *
 *   1. The eligible set E: servers whose requests in flight per unit of
 *      weight are at most (1 + slack) * the mean + 1 (a bounded-load rule,
 *      so that decode load spreads nearly as evenly as least_conn's), and
 *      whose ttft(s) is at most (1 + slack) * the best ttft among those
 *      + decode_pace(s) (estimates less than one output token's time apart
 *      are equal: short prompts are then placed by load, as least_conn).
 *   2. Sticky: if some server in E holds part of the prompt, take the one
 *      with the longest cached prefix (ties: the lower ttft + decode, then
 *      the fewer indexed blocks, then rendezvous).
 *   3. Spill: a server outside E holds the prefix (it is saturated): take the
 *      first server of E in the prefix's rendezvous order (a hash of the
 *      first block with each server's id), so a hot prefix grows onto a
 *      bounded, stable set of workers that stays warm.
 *   4. Cold: nobody holds it: among the servers of E with the fewest requests
 *      per weight, the first in rendezvous order, so that independent routers
 *      place a new prefix alike.
 *
 *   Sessions (rq->session, a hash of the request's session key: an operator's
 *   header, OpenAI's prompt_cache_key or user): the session's home is the
 *   first server of E in the session's rendezvous order (stateless, so every
 *   router agrees and a restart forgets nothing). It breaks ties of step 2
 *   (equal longest prefix: the home wins) and replaces step 4 (nobody is
 *   known to hold the prompt: the home takes it, warm from the session's
 *   earlier turns when the index lost them, or never knew, as in approximate
 *   mode after an eviction or after an event gap). The prefix index always
 *   comes first; a saturated home (outside E) is passed over for the next
 *   server in the session's order, which stays the same while it lasts.
 *
 *   ttft's prefill part is base(s) + tokens / rate(s): the learned line of
 *   time to first byte against tokens (kv_load.h), so a fixed per-request
 *   latency is not charged to every queued token.
 *
 * KV_ROUTE_DYNAMO: NVIDIA Dynamo's weighted sum of blocks (kv_score.h).
 *
 * The load a server is credited with is this router's own count; with
 * cfg.worker_load = KV_ROUTE_LOAD_MAX the larger of that and what the worker
 * reports (which covers every router in front of it but is up to a
 * heartbeat old).
 */
#ifndef KV_ROUTE_H
#define KV_ROUTE_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
    KV_ROUTE_TTFT = 0,
    KV_ROUTE_DYNAMO
} kv_route_policy_t;

typedef enum {
    KV_ROUTE_LOAD_LOCAL = 0,            /* this router's count only */
    KV_ROUTE_LOAD_MAX                   /* the larger of it and the worker's report */
} kv_route_load_t;

typedef struct {
    kv_route_policy_t   policy;
    uint32_t            block_size;             /* tokens per block, 16 when 0 */
    uint64_t            busy_prefill_tokens;    /* 0: off */
    uint64_t            busy_decode_blocks;     /* 0: off */
    kv_route_load_t     worker_load;
    /* ttft */
    double              slack;                  /* default 0.25 */
    double              prefill_rate;           /* tokens/ms before any sample; default 8 */
    double              decode_pace;            /* ms/token before any sample; default 20 */
    uint64_t            max_tokens;             /* output tokens when the request names none; 256 */
    /* dynamo */
    double              overlap_weight;         /* default 1 */
    double              temperature;            /* default 0 */
} kv_route_config_t;

/* Fills the defaults above. */
void kv_route_config_init(kv_route_config_t *cfg);

typedef struct {
    int         usable;             /* not down, failed, tried or at max_conns */
    uint32_t    weight;             /* nginx weight, >= 1 */
    uint64_t    id;                 /* stable per server (worker id): rendezvous */
    uint32_t    overlap_index;      /* leading blocks the index credits it with */
    uint32_t    overlap_pending;    /* ... the router's recent decisions credit it with */
    int         trusted;            /* the index follows its events (or approximate mode) */
    uint64_t    tree_blocks;        /* blocks indexed for it (a tie-break) */
    /* this router's count */
    uint64_t    prefill_tokens;     /* uncached prompt tokens before their first byte */
    uint64_t    decode_blocks;      /* blocks held by requests in flight */
    uint64_t    decode_tokens;      /* output tokens requested by requests in flight */
    uint64_t    requests;           /* requests in flight */
    /* the worker's report (all routers); reported = 0: none */
    int         reported;
    uint64_t    reported_prefill_tokens;
    uint64_t    reported_decode_blocks;
    /* learned from traffic; 0: no sample yet */
    double      prefill_rate;       /* tokens/ms */
    double      prefill_base;       /* ms that no token adds (0 until learned) */
    double      decode_pace;        /* ms/token */
    /* out: what the decision saw */
    int         busy;
    int         eligible;           /* in E (ttft) */
    double      ttft;               /* ms (ttft) or cost (dynamo) */
    double      wait;               /* ms of prefill queued ahead (ttft) */
    double      base;               /* ms of the base used (ttft) */
    double      cold;               /* cold cost, ms of everyone's latency (ttft) */
    double      decode_ms;
} kv_route_server_t;

typedef struct {
    uint64_t            prompt_tokens;
    const uint64_t     *seq;            /* block hashes, nseq of them */
    size_t              nseq;
    uint64_t            max_tokens;     /* 0: not given */
    uint64_t            session;        /* hash of the session key; 0: none */
} kv_route_request_t;

#define KV_ROUTE_NONE  -1               /* no usable server */
#define KV_ROUTE_BUSY  -2               /* usable servers, all over a busy threshold */

typedef enum {
    KV_ROUTE_WHY_NONE = 0,
    KV_ROUTE_WHY_STICKY,                /* the longest cached prefix within the slack */
    KV_ROUTE_WHY_SPILL,                 /* its holders saturated: rendezvous in E */
    KV_ROUTE_WHY_COLD,                  /* nobody holds it: least requests, rendezvous */
    KV_ROUTE_WHY_COST,                  /* dynamo: the lowest cost */
    KV_ROUTE_WHY_SESSION                /* nobody known to hold it: the session's home */
} kv_route_why_t;

typedef struct {
    int             pick;               /* index, KV_ROUTE_NONE or KV_ROUTE_BUSY */
    kv_route_why_t  why;
    uint32_t        overlap;            /* blocks credited at the pick */
    double          estimate;           /* ttft ms (ttft) or cost (dynamo) */
    /* what the attempt adds to the pick's load */
    uint64_t        prefill_tokens;     /* uncached prompt tokens */
    uint64_t        decode_blocks;      /* every prompt block, cached or not */
    uint64_t        decode_tokens;      /* output tokens it asks for */
    uint64_t        queued_tokens;      /* prefill queued ahead of it (learning) */
} kv_route_result_t;

/*
 * Chooses among s[0..n) for rq. rnd is a uniform random u64 (dynamo's
 * sampling and its tie rotation). Returns out->pick.
 */
int kv_route_pick(kv_route_server_t *s, size_t n, const kv_route_request_t *rq,
                  const kv_route_config_t *cfg, uint64_t rnd, kv_route_result_t *out);

/* The overlap a server is credited with: the index's when trusted, and the
 * router's recent decisions in any case. */
uint32_t kv_route_overlap(const kv_route_server_t *s);

/* "sticky", "spill", "cold", "cost", "session" or "" */
const char *kv_route_why_name(kv_route_why_t why);

#endif
