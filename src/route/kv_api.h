/*
 * Which engine API a request is for, from its path. The body alone cannot
 * always say: `{"input": "..."}` is a Responses API request (rendered by the
 * chat template, then decoded) at /v1/responses and an embeddings request
 * (tokenized as it is, nothing decoded) at /v1/embeddings. vLLM serves both
 * on one port, so one kvroute location fronts both.
 */
#ifndef KV_API_H
#define KV_API_H

#include <stddef.h>

typedef enum {
    KV_API_ANY = 0,     /* path unknown (rewritten, another engine's): the body says */
    KV_API_GENERATE,    /* completions, chat completions, responses, SGLang's /generate */
    KV_API_ANTHROPIC,   /* the Anthropic Messages API (kv_anthropic.h) */
    KV_API_POOLING,     /* embeddings, pooling, classify: `input` or `messages`,
                           prefilled, nothing decoded */
    KV_API_SCORE,       /* score, rerank: text pairs, prefilled, nothing decoded */
    KV_API_TOKENIZE     /* tokenize, detokenize, count_tokens: answered without the engine */
} kv_api_t;

/* The API of a request path (without its query string), by its last
 * segments, so a prefix an operator proxies under (/llm/v1/embeddings)
 * changes nothing. */
kv_api_t kv_api_of_path(const char *path, size_t len);

/* The response id a path names (the Responses API's GET, DELETE
 * /v1/responses/{id}, POST .../{id}/cancel, GET .../{id}/input_items): the
 * segment after "/responses/", as a span of path; 0 when there is none.
 * Only the engine that made the response can answer these. */
size_t kv_api_response_id(const char *path, size_t len, const char **id);

#endif
