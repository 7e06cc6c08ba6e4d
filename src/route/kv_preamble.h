/*
 * Where a streamed response's first token is. The router takes a stream's
 * first byte for the end of its prefill: it releases the prefill load
 * there and learns the server's prefill rate from it. vLLM's Responses API
 * stream breaks that: it opens with `response.created` and
 * `response.in_progress` before the engine has even queued the request
 * (serving.py, responses_stream_generator), so the first byte came after a
 * few milliseconds whatever the prompt, and every such request taught the
 * server a prefill rate thousands of times too fast. This scanner finds
 * the first event past that preamble: a `"type":"response.X"` member whose
 * X is neither `created` nor `in_progress`.
 *
 * It takes the body in pieces of any size with a few bytes of state and
 * matches a member only: inside a JSON string the same words are escaped
 * (\"type\":\"response.), so generated text cannot fake one.
 */
#ifndef KV_PREAMBLE_H
#define KV_PREAMBLE_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint8_t phase;
    uint8_t pos;
    uint8_t len;
    uint8_t done;
    char    name[16];
} kv_preamble_t;

void kv_preamble_init(kv_preamble_t *s);
/* 1 once the bytes fed so far hold an event past the preamble (and from
 * then on), 0 until then. */
int  kv_preamble_feed(kv_preamble_t *s, const char *p, size_t n);

#endif
