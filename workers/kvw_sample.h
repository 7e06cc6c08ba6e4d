/* Sampling a next token from logits: greedy, temperature, top-k, top-p. */
#ifndef KVW_SAMPLE_H
#define KVW_SAMPLE_H

#include <stdint.h>

#include "kvw_backend.h"

/* Picks a token from logits[0..n) (modified in place); uses s->rng. */
uint32_t kvw_sample(float *logits, uint32_t n, const kvw_sampling_t *s);

#endif
