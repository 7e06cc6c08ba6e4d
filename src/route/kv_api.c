/*
 * Request paths to engine APIs (kv_api.h): the endpoints vLLM and SGLang
 * serve, matched on their last segments.
 */
#include <string.h>

#include "kv_api.h"

static const struct {
    const char *tail;       /* the path's end, from a '/' */
    kv_api_t    api;
} apis[] = {
    { "/completions", KV_API_GENERATE },    /* and /chat/completions */
    { "/responses", KV_API_GENERATE },
    { "/generate", KV_API_GENERATE },
    { "/messages", KV_API_ANTHROPIC },
    { "/count_tokens", KV_API_TOKENIZE },       /* /v1/messages/count_tokens */
    { "/embeddings", KV_API_POOLING },
    { "/pooling", KV_API_POOLING },
    { "/classify", KV_API_POOLING },
    { "/score", KV_API_SCORE },
    { "/rerank", KV_API_SCORE },
    { "/tokenize", KV_API_TOKENIZE },
    { "/detokenize", KV_API_TOKENIZE },
};

kv_api_t kv_api_of_path(const char *path, size_t len)
{
    size_t i, n;

    if (len > 1 && path[len - 1] == '/') {
        len--;
    }
    for (i = 0; i < sizeof(apis) / sizeof(apis[0]); i++) {
        n = strlen(apis[i].tail);
        if (len >= n && memcmp(path + len - n, apis[i].tail, n) == 0) {
            return apis[i].api;
        }
    }
    return KV_API_ANY;
}

size_t kv_api_response_id(const char *path, size_t len, const char **id)
{
    static const char seg[] = "/responses/";
    size_t            n = sizeof(seg) - 1, i, j;

    for (i = 0; i + n <= len; i++) {
        if (memcmp(path + i, seg, n) == 0) {
            for (j = i + n; j < len && path[j] != '/'; j++) {
            }
            *id = path + i + n;
            return j - i - n;
        }
    }
    return 0;
}
