/*
 * The floor under a request's time to first token on a fleet of mock
 * engines: the time its uncached prompt tokens take to compute alone on an
 * idle engine, with the mock's prefill model (workers/kvw_mock_model.c, the
 * polynomial; a --perf-profile engine is not modelled).
 *
 * Why it is a floor for any router: a request cannot find more of its prompt
 * cached than one infinite cache holding every earlier prompt would give it;
 * a step that computes its tokens also computes the other requests' chunks
 * and decodes (the mock's step time is their sum, and prefill(T) grows with
 * T); queueing, HTTP and tokenizing only add. The one way the same tokens
 * could take less is a different split into steps, so the floor is the best
 * split: m steps of u/m tokens each (equal parts minimise a convex cost), for
 * the m at or above the fewest steps the engine's token budget allows that
 * costs least.
 */
#ifndef KVB_FLOOR_H
#define KVB_FLOOR_H

#include <stdint.h>

/* Milliseconds (real, after dividing by the engine's --speedup) for a prompt
 * of `prompt` tokens of which `cached` were found cached. The engine computes
 * at least one token: at most (prompt - 1) / block_size blocks are hits, as in
 * kvworker. `budget` is --max-num-batched-tokens. */
double kvb_floor_ttft_ms(uint32_t prompt, uint64_t cached, uint32_t block_size,
                         uint32_t budget, double speedup);

/*
 * A floor under the mean TTFT of n requests that, together, computed at
 * least `computed` prompt tokens, whatever the order: each request takes at
 * least one step's fixed cost and every token its per-token cost (the square
 * term is dropped, which only lowers it). With `computed` = the prompt tokens
 * less the ideal's hits it holds for any router: for every block, the
 * requests holding it find it cached at most once less than their number (one
 * of them computed it), which is exactly what the ideal credits.
 */
double kvb_floor_any_order_ms(uint64_t computed, uint64_t n, double speedup);

#endif
