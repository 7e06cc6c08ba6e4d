/*
 * Multi-turn chat sessions as a Mooncake trace (kvsynth sessions). Shapes
 * real chat traffic: sessions start as a Poisson process; each opens with one
 * of a few shared system prompts; every turn resends the whole history (the
 * system prompt, each earlier user message and reply) plus a new user
 * message; the next turn comes after the user's think time, tens of seconds.
 *
 * A reply enters the history as new ids: the trace cannot know what the
 * engine generated, so what a later turn can reuse is its earlier prompt, as
 * on a server that does not cache decoded tokens. Lengths are multiples of
 * block_size, so every id covers exactly block_size tokens.
 *
 * Deterministic in the knobs (xoshiro256**, seeded by seed). Ids: system
 * prompt g block k = (g+1) << 32 | k; the blocks of message m = 1 << 62 |
 * m << 16 | k, so no two messages share one.
 */
#ifndef KV_SYNTH_SESSIONS_H
#define KV_SYNTH_SESSIONS_H

#include <stddef.h>
#include <stdint.h>

#include "kv_trace.h"

typedef struct {
    uint64_t    num_requests;       /* the first N requests by time are kept */
    double      rate;               /* mean requests per second (all sessions) */
    uint64_t    seed;
    uint32_t    block_size;         /* tokens per hash id */
    uint32_t    systems;            /* distinct system prompts */
    uint32_t    system_tokens;
    uint32_t    turns_min, turns_max;
    uint32_t    user_min, user_max; /* tokens of a user message */
    uint32_t    output_min, output_max;
    double      think_min_s, think_mean_s, think_max_s;  /* min + Exp(mean - min), capped */
} kv_sessions_knobs_t;

void kv_sessions_knobs_default(kv_sessions_knobs_t *k);
/* -1 with a reason when a knob is out of range. */
int  kv_sessions_knobs_check(const kv_sessions_knobs_t *k, char *err, size_t errlen);
/* Appends k->num_requests requests to out, in time order. -1 on no memory. */
int  kv_sessions_generate(const kv_sessions_knobs_t *k, kv_trace_t *out);

#endif
