/*
 * Synthetic prompts for trace replay. A Mooncake trace names a prompt only by
 * its block hash ids; we expand each id, deterministically and on its own, into
 * one block of content, so two requests that share leading hash ids share the
 * same leading tokens (or text) and therefore the same reusable KV prefix.
 */
#ifndef KVB_PROMPT_H
#define KVB_PROMPT_H

#include <stddef.h>
#include <stdint.h>

#include "kv_trace.h"

typedef struct {
    char   *buf;
    size_t  len, cap;
} kvb_buf_t;

int  kvb_buf_add(kvb_buf_t *b, const char *s, size_t n);
int  kvb_buf_printf(kvb_buf_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void kvb_buf_free(kvb_buf_t *b);

/* Token id at position pos of the block named by hash id h: in [100, 100+vocab). */
uint32_t kvb_block_token(uint64_t h, uint32_t pos, uint32_t vocab);

/* Word (with its leading space) at position pos of block h, for --text prompts. */
const char *kvb_block_word(uint64_t h, uint32_t pos);

/*
 * Appends request r's prompt as a JSON value: an array of token ids, or with
 * text != 0 a JSON string of words. Tokens past the last hash id's block are
 * made unique to the request (index idx), as a trace's unshared tail is.
 */
int  kvb_prompt_json(kvb_buf_t *b, const kv_trace_t *t, const kv_trace_req_t *r, size_t idx,
                     uint32_t block_size, uint32_t vocab, int text);

#endif
