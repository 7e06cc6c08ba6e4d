/*
 * The scheduler engine: one KV block pool and a vLLM-style continuous
 * batching loop over any backend (kvw_backend.h). Each step takes the
 * running requests first (decode, or the next chunk of a prefill), then
 * admits waiting ones while blocks (less the watermark), the token budget
 * (max_num_batched_tokens) and max_num_seqs allow. When a running request
 * needs a block and none is left, the newest running request is preempted:
 * its blocks are released and it goes back to the front of the queue to be
 * recomputed (its cached prefix usually makes that cheap).
 *
 * A simulated backend (the mock) predicts each step's duration and the
 * scheduler delivers the step's tokens when that time has passed, on a
 * libevent timer; real backends have already spent it.
 */
#ifndef KVW_SCHED_H
#define KVW_SCHED_H

#include "kvw_backend.h"
#include "kvw_blocks.h"
#include "kvw_engine.h"

typedef struct {
    uint32_t    waiting, running;
    uint64_t    active_prefill_tokens;  /* prompt tokens not yet computed */
    uint32_t    active_decode_blocks;   /* blocks held by running requests */
    uint32_t    kv_used_blocks;         /* active + cached */
    uint32_t    kv_active_blocks;
    uint32_t    num_blocks, block_size;
    uint64_t    requests, finished, cancelled, preemptions, steps;
    uint64_t    prefill_steps;      /* steps that computed prompt tokens: each stalls
                                       the streams decoding beside it */
    uint64_t    prompt_tokens, generation_tokens, cached_tokens;
    uint64_t    prefix_query_tokens, prefix_hit_tokens;
    double      busy_ms;    /* sum of step times (simulated for mock): the engine's busy time */
    double      late_ms;    /* simulated steps too late to catch up: time the host took */
    double      first_token_ms;     /* sum of scheduled times to first token (kvw_sched.c) */
    uint64_t    first_tokens;
} kvw_sched_load_t;

/* Takes ownership of backend. */
kvw_engine_t *kvw_sched_create(const kvw_config_t *cfg, struct event_base *base, int index,
                               kvw_backend_t *backend);

kvw_blocks_t *kvw_sched_blocks(kvw_engine_t *e);
kvw_backend_t *kvw_sched_backend(kvw_engine_t *e);

/*
 * submit() for a request whose prompt blocks a transfer filled and
 * registered (kvw_xfer.h): the scheduler takes over pin, the transfer's
 * references on them, and drops it once admission has referenced the blocks
 * itself (or the request ends), so they cannot be evicted in between.
 * pin is released even when the submit fails. first (or NULL): the first
 * output token, sampled by the prefill worker with the request's own
 * parameters, and rng the sampler's state after it; it is delivered from
 * the event loop's next turn, ahead of any step.
 */
int kvw_sched_submit_pinned(kvw_engine_t *e, kvw_req_t *r, kvw_seq_blocks_t *pin,
                            const uint32_t *first, uint64_t rng);
void kvw_sched_load(kvw_engine_t *e, kvw_sched_load_t *out);

/* Called at the end of every step, after its KV events were flushed to the sink. */
/* called after each step and after each submit (the load changed) */
typedef void (*kvw_step_hook_fn)(void *ctx, kvw_engine_t *e);
void kvw_sched_set_step_hook(kvw_engine_t *e, kvw_step_hook_fn fn, void *ctx);

/* submit() result for a request that can never fit (prompt too long). */
#define KVW_SUBMIT_TOO_LONG (-2)

#endif
