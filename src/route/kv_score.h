/*
 * The routing decision: NVIDIA Dynamo's cost (reference: its
 * DefaultWorkerSelector), lower is better,
 *
 *   cost = overlap_weight * prefill_blocks + decode_blocks
 *   prefill_blocks = (active_prefill_tokens + max(0, prompt_tokens - overlap * block_size)) / block_size
 *   decode_blocks  = active_decode_blocks + prompt_blocks - overlap
 *
 * divided by the server's nginx weight (a weight-2 server counts its load
 * half). Dynamo subtracts the overlap with the worker's *active* sequences
 * in decode_blocks; we do not track those per sequence, so we assume the
 * cached overlap is shared (Dynamo's assume_kv_reuse, on by default).
 *
 * Temperature 0 takes the lowest cost, ties to the worker with fewer
 * indexed blocks, then to the lowest index after a caller-chosen rotation;
 * temperature T > 0 samples softmax(-(cost - min) / (max - min) / T).
 * A candidate over a busy threshold is skipped; if every usable one is
 * busy, kv_score_pick says so.
 */
#ifndef KV_SCORE_H
#define KV_SCORE_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    double      overlap_weight;         /* default 1.0 */
    double      temperature;            /* default 0 */
    uint32_t    block_size;
    uint64_t    busy_prefill_tokens;    /* 0: off */
    uint64_t    busy_decode_blocks;     /* 0: off */
} kv_score_config_t;

typedef struct {
    int         usable;                 /* not down, not failed, not tried */
    uint32_t    weight;                 /* >= 1 */
    uint32_t    overlap;                /* leading prompt blocks cached */
    uint64_t    tree_blocks;            /* blocks indexed for it (tie-break) */
    uint64_t    active_prefill_tokens;
    uint64_t    active_decode_blocks;
    double      cost;                   /* out */
    int         busy;                   /* out */
} kv_candidate_t;

#define KV_SCORE_NONE  -1               /* no usable candidate */
#define KV_SCORE_BUSY  -2               /* usable candidates, all busy */

/*
 * Scores c[0..n) for a prompt of prompt_tokens and returns the chosen
 * index, or KV_SCORE_NONE / KV_SCORE_BUSY. rnd is a uniform random u64
 * (sampling and the final tie-break).
 */
int kv_score_pick(kv_candidate_t *c, size_t n, uint64_t prompt_tokens,
                  const kv_score_config_t *cfg, uint64_t rnd);

#endif
