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
 *   wait(s)     = queued_prefill_tokens(s) / prefill_rate(s)                  [ms]
 *   ttft(s)     = prefill_base(s) + wait(s) + uncached(s) / prefill_rate(s)    [ms]
 *   decode(s)   = output_tokens * decode_pace(s)                             [ms]
 *
 *   prefill_base and prefill_rate are the line of time to first byte against
 *   the tokens a server had to prefill, learned from its traffic (kv_load.h;
 *   queueing, batching and decode interference are in it), so a fixed part
 *   is not charged to every queued token; decode_pace likewise (ms per output
 *   token). A server with no sample takes the mean of those with one (per
 *   unit of weight); cfg's defaults stand in before any sample at all.
 *
 *   1. L: servers whose requests in flight per unit of weight are at most
 *      (1 + slack) * the mean + 1 (bounded load, so that decode load spreads
 *      nearly as evenly as least_conn's). E, in L: ttft(s) at most
 *      (1 + slack) * the best ttft in L + decode_pace(s) (estimates less than
 *      one output token's time apart are equal) + saved(s), the prefill
 *      time its cached prefix spares the request (cached tokens /
 *      prefill_rate(s)): a holder stays until its queue costs more than
 *      the work a spill would redo. C, in L: wait(s) at most the
 *      least wait in L + slack * the request's own prefill time there
 *      + decode_pace(s).
 *   2. Sticky: if some server in E holds part of the prompt, take the one
 *      with the longest cached prefix (ties: the session's home, then the
 *      lower ttft, then the fewer indexed blocks, then rendezvous).
 *      But if that longest prefix is held by two servers or more (a shared
 *      head, such as a system prompt: the request starts a conversation of
 *      its own there), only servers within the bounded-load capacity
 *      ceil((1 + slack) x (requests in flight + 1) x weight / total weight)
 *      take it (K, those of E or of the cold rule's Q within it): the
 *      longest cached prefix among K, or, if no server of K holds any of
 *      it, K's first in the spill order, which is then seeded with the head
 *      (kv_route.c, pick_shared). Only while the fleet runs about a
 *      request a server or less (requests in flight + 1 <= (1 + slack) x
 *      total weight); beyond, the sticky rule decides (L spreads the load).
 *   3. Spill: a server outside E holds the prefix (it is saturated): take the
 *      server of E with the fewest requests in flight per unit of weight,
 *      then the fewest indexed blocks per unit of weight (give or take one
 *      prompt's blocks), then the first in the prefix's rendezvous order
 *      (a hash of the first block with each server's id): a hot prefix
 *      grows onto one more server each time its set saturates, and the
 *      servers holding little are seeded first (kv_route.c, pick_spill).
 *   4. Session: nobody holds it and rq->session is set (a hash of the
 *      operator's session value, OpenAI's prompt_cache_key or user): the
 *      session's home, the first server of C in the session's rendezvous
 *      order (stateless: every router agrees, a restart forgets nothing; a
 *      saturated home is passed over for the next in the session's order,
 *      the same while it lasts). Warm from the session's earlier turns when
 *      the index lost them or never knew (approximate mode after an
 *      eviction, events mode after an event gap).
 *   5. Cold: otherwise (nobody holds any of it, so its prefill is the same
 *      work anywhere) least_conn's choice: the fewest requests in flight
 *      per unit of weight among the servers of Q, those of L whose wait is
 *      at most the least wait in L + the request's own prefill time there
 *      (ttft - wait), its tokens counted up to one engine step's (2,048,
 *      KV_ROUTE_STEP_TOKENS in kv_route.c), + decode_pace(s) (a queue that
 *      would more than double its time to first token, or hold a long
 *      prompt more than a step, is avoided; one a short prompt joins is
 *      not: engines batch queued prefills into one step). Ties: a server
 *      whose index holds nothing first (so an idle fleet's distinct
 *      prefixes do not pile onto one server by chance), then the first in
 *      the prefix's rendezvous order, blind to queues as least_conn is, so
 *      independent routers place a new prefix alike. The estimate does
 *      not rank cold servers otherwise:
 *      its per-server noise (learned lines of identical engines differ 2x)
 *      times the requests in flight outweighed a request more or less, and
 *      decode load spread worse than least_conn's (kv_route.c, pick_cold).
 *      Servers that decode nothing (a prefill pool, kv_prefill.h: every
 *      decode pace 0) keep round 2's rule, the lowest cost to everyone in
 *      C (pick_cold_cost): there the estimate is the whole story.

 * KV_ROUTE_DYNAMO: NVIDIA Dynamo's weighted sum of blocks (kv_score.h).
 *
 * Either way, a request that only one server can serve (rq->home: the
 * server that made the response it continues, which holds that response
 * and no other does) goes there whenever it is usable, busy or not:
 * anywhere else it would fail. When it is not usable (down, failed, tried)
 * the policy decides as if there were no home.
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
    uint64_t    tree_blocks;        /* blocks it holds: kv_route_tree_blocks() */
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
    double      since_sent;         /* ms since this router last sent it a request
                                       (< 0: never) */
    /* out: what the decision saw */
    int         busy;
    int         eligible;           /* in E (ttft) */
    double      ttft;               /* ms (ttft) or cost (dynamo) */
    double      wait;               /* ms of prefill queued ahead (ttft) */
    int         joinable;           /* ... and likely not started yet (ttft) */
    double      saved;              /* ms of prefill its cached prefix spares (ttft) */
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
    uint32_t            sequences;      /* n / best_of (x a batch's prompts): the
                                           server decodes this many (0 or 1: one) */
    uint64_t            batch_tokens;   /* a batch's other prompts: prefilled beside
                                           this one, whatever the server caches */
    uint32_t            prefill_only;   /* nothing decoded (an embedding, a score):
                                           no output tokens counted */
    uint64_t            home;           /* the id of the one server that can serve it
                                           (it made the response a Responses API
                                           request continues, kv_respmap.h); 0: none */
} kv_route_request_t;

#define KV_ROUTE_NONE  -1               /* no usable server */
#define KV_ROUTE_BUSY  -2               /* usable servers, all over a busy threshold */

typedef enum {
    KV_ROUTE_WHY_NONE = 0,
    KV_ROUTE_WHY_STICKY,                /* the longest cached prefix within the slack */
    KV_ROUTE_WHY_SPILL,                 /* its holders saturated: least loaded in E */
    KV_ROUTE_WHY_COLD,                  /* nobody holds it: least requests, rendezvous */
    KV_ROUTE_WHY_COST,                  /* dynamo: the lowest cost */
    KV_ROUTE_WHY_SESSION,               /* nobody known to hold it: the session's home */
    KV_ROUTE_WHY_SHARED,                /* a branch off a shared head, kept on a holder */
    KV_ROUTE_WHY_SEED,                  /* a branch off a shared head, seeding a server */
    KV_ROUTE_WHY_RESPONSE               /* rq->home: the server holding the response */
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

/* The prefill tokens queued at s as cfg weighs them: this router's count,
 * or with worker_load=max the larger of it and the worker's report. */
uint64_t kv_route_prefill_load(const kv_route_server_t *s, const kv_route_config_t *cfg);

/*
 * What to put in tree_blocks for server s (filled in but for tree_blocks):
 * the blocks the index holds for it (indexed), and, where the index learns
 * of a request's blocks only from the worker's events (index_lags: events
 * mode, where the engine reports them Stored after their prefill), the
 * blocks of the prompts sent to s that have not had their first byte yet
 * (its queued prefill tokens, in blocks, rounded up). The router knows it
 * sent those; approximate mode records them in its index at the decision,
 * and the pending index credits them as overlap, but without this the
 * rules that count blocks (spill, seed and the shared head's resident
 * bound, the cold and sticky ties) saw a server that had just been given a
 * prefix as empty until its prefill ended. (A response that is not
 * streamed counts as queued until it ends, so its prompt is counted twice
 * from its prefill to its end: one prompt per such request, too many
 * rather than none.)
 */
uint64_t kv_route_tree_blocks(uint64_t indexed, int index_lags, const kv_route_server_t *s,
                              const kv_route_config_t *cfg);

/* "sticky", "spill", "cold", "cost", "session", "shared", "seed", "response"
 * or "" */
const char *kv_route_why_name(kv_route_why_t why);

/*
 * 1 where the rule chose by every candidate's indexed blocks (tree_blocks):
 * spill and seed (pick_spill), and shared (pick_shared bounds a holder's
 * blocks against the other candidates'). A caller that filled tree_blocks
 * only for the prompt's holders must fill the others' and decide again for
 * these.
 */
int kv_route_why_reads_blocks(kv_route_why_t why);

#endif
