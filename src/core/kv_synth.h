/*
 * Trace synthesis (after NVIDIA Dynamo's data generator): learn the prefix
 * structure of a Mooncake hash trace, then sample new requests with knobs.
 *
 * The hash ids of all requests form a prefix tree (one parent per id, or
 * the trace is refused). Ids visited by two or more requests form the core
 * tree of shared prefixes; each request is its core path, then a unique
 * leaf of ids no other request has, a residual of tokens in its last,
 * partial block and an output length. Sampling walks the core tree from a
 * super-root, choosing at each node a child by how many requests took it,
 * or "end" by how many requests' core paths ended there; an end draws the
 * (leaf length, residual, output length) of one of those requests, so the
 * joint distribution - and the spread of input lengths, which a global
 * leaf-length distribution would lose - carries over.
 */
#ifndef KV_SYNTH_H
#define KV_SYNTH_H

#include <stddef.h>
#include <stdint.h>

#include "kv_trace.h"

typedef struct kv_synth kv_synth_t;

typedef struct {
    double      prefix_len_multiplier;      /* core path length */
    uint32_t    prefix_root_multiplier;     /* disjoint copies of the core tree */
    double      prompt_len_multiplier;      /* unique leaf length */
    double      osl_multiplier;             /* output length */
    double      speedup_ratio;              /* divides inter-arrival times */
    uint64_t    num_requests;               /* 0: as many as the source */
    uint64_t    seed;
    uint32_t    block_size;                 /* tokens per hash id, default 512 */
} kv_synth_knobs_t;

typedef struct {
    uint64_t    requests;
    uint64_t    blocks;                     /* distinct hash ids */
    double      ideal_reuse;
    double      mean_input_length, std_input_length;
    double      mean_output_length, std_output_length;
    double      mean_interarrival_ms;
    uint64_t    core_nodes;                 /* ids shared by >= 2 requests */
    uint64_t    radix_nodes;                /* core tree with unary chains contracted */
    uint64_t    unique_leaves;              /* requests with a unique suffix */
    uint32_t    depth;                      /* longest core path, in ids */
    double      branching;                  /* mean core children of inner radix nodes */
} kv_synth_stats_t;

void kv_synth_knobs_default(kv_synth_knobs_t *k);

/* Learns from t (kept by reference while the model lives). NULL with a reason. */
kv_synth_t *kv_synth_learn(const kv_trace_t *t, uint32_t block_size, char *err, size_t errlen);
void        kv_synth_free(kv_synth_t *s);

/* Samples knobs->num_requests requests into out (appended). 0 or -1. */
int kv_synth_sample(const kv_synth_t *s, const kv_synth_knobs_t *knobs, kv_trace_t *out);

/* Statistics of any trace (the same numbers for a source and a synthesis). */
int kv_synth_stats(const kv_trace_t *t, uint32_t block_size, kv_synth_stats_t *st,
                   char *err, size_t errlen);

#endif
