/* The learned model behind kv_synth.h; shared by the builder and sampler. */
#ifndef KV_SYNTH_MODEL_H
#define KV_SYNTH_MODEL_H

#include "kv_synth.h"

/* One way a request left the core tree at a radix node. */
typedef struct {
    uint32_t    tokens;     /* tail exit: unique tokens after the core prefix;
                               cache end: tokens in the last (core) block */
    uint32_t    osl;
} kv_synth_exit_t;

/*
 * A radix node: len core blocks in a row. Its draw range [0, count) is split
 * as [children by cumulative count | tail exits ("end") | cache ends].
 * Children and exits are stored contiguously (CSR) in the model arrays.
 */
typedef struct {
    uint32_t    len;
    uint32_t    depth_blocks;   /* core blocks from the super-root to our end */
    uint32_t    count;
    uint32_t    child_sum;
    uint32_t    first_child, n_child;   /* into child / child_cum */
    uint32_t    first_exit, n_tail, n_cache;    /* into exits */
} kv_synth_node_t;

struct kv_synth_model {
    uint32_t            block_size;
    kv_synth_node_t    *node;       /* node[0] is the super-root (len 0) */
    uint32_t            n_node;
    uint32_t           *child;      /* radix node index */
    uint32_t           *child_cum;  /* inclusive cumulative counts */
    kv_synth_exit_t    *exits;
    uint32_t           *tail_exits; /* indices of every tail exit (pooled mode) */
    uint32_t            n_tail_exits;
    uint64_t           *gaps;       /* inter-arrival gaps, ms */
    uint64_t            n_gaps;
    uint64_t            n_requests;
    kv_synth_info_t     info;
};

#endif
