/*
 * The `usage` of an OpenAI response, found while the body streams past:
 * the last `"prompt_tokens": N` and `"cached_tokens": N` (the latter inside
 * usage.prompt_tokens_details) of a JSON body or of an SSE stream, whose
 * final chunk carries usage when the request asked for it.
 *
 * The scanner keeps a few bytes of state, so it takes the body in pieces
 * of any size (nginx buffers), never buffers it and costs one pass. It
 * matches keys only: the same words inside a JSON string are escaped
 * (\"cached_tokens\") and a key is followed by ':', so generated text
 * cannot fake them.
 */
#ifndef KV_USAGE_H
#define KV_USAGE_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    int64_t     prompt_tokens;      /* -1 until seen */
    int64_t     cached_tokens;      /* -1 until seen (null counts as unseen) */
    uint64_t    num;
    uint8_t     phase;
    uint8_t     key;                /* 1 prompt_tokens, 2 cached_tokens */
    uint8_t     pos;
    uint8_t     digits;
} kv_usage_scan_t;

void kv_usage_init(kv_usage_scan_t *u);
void kv_usage_feed(kv_usage_scan_t *u, const char *p, size_t n);
/* End of body: a number that ended with it is kept. */
void kv_usage_end(kv_usage_scan_t *u);

#endif
