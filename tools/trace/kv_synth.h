/*
 * Trace synthesizer: learns the prefix structure of a Mooncake hash trace and
 * samples new traces of any size from it (after Dynamo's prefix data
 * generator, with one change: lengths are kept per exit point, see below).
 *
 * Model, built by kv_synth_build():
 *   1. A prefix tree (trie) of hash ids: each node is a block at a position
 *      after a given prefix; its count is the number of requests through it.
 *      The tree property (an id always has the same parent) is checked and
 *      violations counted; the trie is keyed by path, so they do no harm.
 *   2. Nodes visited by one request only are unique user prompts. Removing
 *      them leaves the core tree of shared prefixes (count >= 2).
 *   3. Unary core chains with no request leaving midway are contracted into
 *      radix nodes with a length in blocks.
 *   4. Each request leaves the core tree at one radix node (the super-root if
 *      its first block is already unique). There it either stops ("cache
 *      end": its whole prompt is shared prefix, the last block maybe partial)
 *      or goes on into a unique leaf ("end" of the cached part). The exit is
 *      recorded with its token lengths and output length.
 *
 * Sampling walks from the super-root: at each radix node one draw in
 * [0, count) picks a child (in proportion to its count) or one of the exit
 * records, i.e. the "end" and "cache end" sentinels of the node's CDF carry
 * the empirical lengths seen at that node. Drawing lengths where the path
 * left the tree keeps the joint law of prefix and prompt length, which is
 * what preserves the input-length variance (a global unique-length
 * distribution, as Dynamo uses, loses it). Inter-arrival gaps are drawn from
 * their empirical distribution.
 *
 * Knobs each change one thing; every knob-dependent draw has its own random
 * stream, so with one seed the other fields stay byte-identical. Output is
 * always consistent: hash ids = ceil(input_length / block_size); a request
 * is capped at 2^20 blocks whatever the multipliers.
 */
#ifndef KV_SYNTH_H
#define KV_SYNTH_H

#include <stdint.h>
#include <stdio.h>

#include "kv_trace.h"

typedef struct kv_synth_model kv_synth_model_t;

typedef struct {
    double      prefix_len_mult;    /* scales every core radix node's length */
    uint32_t    prefix_root_mult;   /* N disjoint copies of the core tree */
    double      prompt_len_mult;    /* scales the unique user-prompt tokens */
    double      osl_mult;           /* scales output_length */
    double      speedup;            /* divides timestamps */
    uint64_t    num_requests;       /* 0: as many as the source */
    uint64_t    seed;
    int         pooled_lengths; /* ablation, Dynamo's way: unique-prompt and
                                   output lengths from one global pool, not
                                   from the exit point (loses ISL variance) */
} kv_synth_knobs_t;

typedef struct {
    uint64_t    requests, blocks, unique_nodes;
    uint64_t    core_nodes;         /* radix nodes, super-root excluded */
    uint64_t    core_blocks;        /* trie nodes in the core tree */
    uint32_t    core_depth;         /* deepest radix node, in radix levels */
    uint32_t    core_max_blocks;    /* deepest core prefix, in blocks */
    double      branching;          /* mean children of internal radix nodes */
    uint64_t    tree_violations;    /* ids seen under more than one parent */
} kv_synth_info_t;

void kv_synth_knobs_default(kv_synth_knobs_t *k);
/* Checks knob ranges; -1 with a reason. */
int  kv_synth_knobs_check(const kv_synth_knobs_t *k, char *err, size_t errlen);

/* Learns the model; block_size is the trace's tokens per hash id. */
int  kv_synth_build(const kv_trace_t *t, uint32_t block_size, kv_synth_model_t **out,
                    char *err, size_t errlen);
void kv_synth_free(kv_synth_model_t *m);
void kv_synth_info(const kv_synth_model_t *m, kv_synth_info_t *info);

/* Samples k->num_requests requests into out (appended). -1 on no memory. */
int  kv_synth_generate(const kv_synth_model_t *m, const kv_synth_knobs_t *k, kv_trace_t *out);
/* The same requests written as Mooncake JSONL (buffered, fast formatting). */
int  kv_synth_write(const kv_synth_model_t *m, const kv_synth_knobs_t *k, FILE *f);

#endif
