/*
 * Mooncake-format request traces: one JSON object per line,
 *   {"timestamp": ms, "input_length": tokens, "output_length": tokens,
 *    "hash_ids": [ids of the prompt's blocks, trace block size, usually 512]}
 * Equal ids at the same position mean the same prefix, i.e. reusable KV.
 */
#ifndef KV_TRACE_H
#define KV_TRACE_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef struct {
    uint64_t    timestamp_ms;
    uint32_t    input_length;
    uint32_t    output_length;
    size_t      first_hash;     /* index into kv_trace_t.hash_ids */
    uint32_t    n_hash;
} kv_trace_req_t;

typedef struct {
    kv_trace_req_t *reqs;
    size_t          n;
    uint64_t       *hash_ids;
    size_t          n_hash_ids;
    size_t          cap_reqs, cap_hash;
} kv_trace_t;

/* Reads a whole trace. On a bad line returns -1 with "line N: reason" in err. */
int  kv_trace_load(const char *path, kv_trace_t *t, char *err, size_t errlen);
int  kv_trace_load_file(FILE *f, kv_trace_t *t, char *err, size_t errlen);
/* Parses one line and appends it; -1 with a reason (no line number). */
int  kv_trace_add_line(kv_trace_t *t, const char *line, size_t len, char *err, size_t errlen);
/* Appends a request; ids are copied. -1 on allocation failure. */
int  kv_trace_add(kv_trace_t *t, uint64_t timestamp_ms, uint32_t input_length,
                  uint32_t output_length, const uint64_t *ids, uint32_t n_ids);
void kv_trace_free(kv_trace_t *t);

static inline const uint64_t *kv_trace_ids(const kv_trace_t *t, const kv_trace_req_t *r)
{
    return t->hash_ids + r->first_hash;
}

/* Writes one request as a trace line (with the trailing newline). */
int  kv_trace_write(FILE *f, const kv_trace_t *t, const kv_trace_req_t *r);

/*
 * Ideal prefix reuse: with one worker and an unbounded cache, the share of
 * all prompt blocks whose whole prefix (this block and every one before it)
 * an earlier request already computed. Counted in trace blocks.
 */
double kv_trace_ideal_reuse(const kv_trace_t *t);

#endif
