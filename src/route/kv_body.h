/*
 * The routing-relevant fields of an OpenAI request body, found in one pass
 * without building a JSON tree: the router only needs `model`, the prompt
 * (or the raw `messages` array, handed to the chat template) and the cache
 * salt, and it runs on nginx's event loop for every request. It also keeps
 * a hash of the session hints `prompt_cache_key` and `user` (strings; any
 * other type is ignored) for session affinity. A Responses API request
 * (`input`, `instructions`) is read as the chat messages vLLM makes of it,
 * and the key of its `previous_response_id` kept: only the engine that made
 * that response holds it (kv_respmap.h).
 *
 * `prompt` may be a string, an array of strings, an array of token ids or
 * an array of token-id arrays; for the array forms (a batch of prompts) the
 * first element routes the request, since one upstream serves the batch,
 * and the others are counted for its load.
 */
#ifndef KV_BODY_H
#define KV_BODY_H

#include <stddef.h>
#include <stdint.h>

#include "kv_anthropic.h"
#include "kv_api.h"
#include "kv_chat_request.h"

typedef enum {
    KV_BODY_NONE = 0,       /* neither prompt nor messages */
    KV_BODY_TEXT,           /* prompt text in text/text_len */
    KV_BODY_IDS,            /* prompt token ids in ids/n_ids */
    KV_BODY_MESSAGES        /* raw JSON of `messages` in chat.messages */
} kv_body_kind_t;

/* `n` / `best_of` counted at most this (engines refuse far less) */
#define KV_BODY_SEQUENCES_MAX 4096

/* top-level `cache_salt` members recorded for a rewrite (more: a parse error) */
#define KV_BODY_SALTS_MAX 16

typedef struct {
    kv_body_kind_t  kind;
    char           *text;           /* unescaped UTF-8, NUL-terminated (owned) */
    size_t          text_len;
    uint32_t       *ids;            /* owned */
    size_t          n_ids;
    /* a chat: `messages` and the members the engine renders with them, as
     * spans into the caller's buffer (NULL when absent or null) */
    kv_chat_request_t chat;
    int             add_special_tokens;     /* -1 absent (engine default), 0, 1 */
    char            model[128];     /* "" when absent; truncated names are refused */
    char           *salt;           /* `cache_salt` or NULL (owned) */
    size_t          salt_len;
    int             stream;         /* `stream: true` */
    long            max_tokens;     /* `max_tokens` / `max_completion_tokens`, -1 if absent */
    long            sequences;      /* the larger of `n` and `best_of` (>= 1; 1 if absent):
                                       output sequences the engine decodes for it */
    long            prompts;        /* prompts in `prompt` (a batch: > 1); 1 otherwise */
    size_t          batch_bytes;    /* a batch's other string prompts: raw JSON bytes
                                       past each one's common prefix with the first */
    size_t          batch_ids;      /* ... its other id-array prompts: ids past it */
    /* the Responses API's `input` (a string or an array) and `instructions`
     * (a string), as spans; with no other prompt, made into chat messages
     * (kv_responses.h) held in `responses` */
    const char     *input;
    size_t          input_len;
    const char     *instructions;
    size_t          instructions_len;
    char           *responses;      /* owned */
    /* the Anthropic Messages API's `system` (a string or blocks), as a
     * span; its request made into a chat (kv_anthropic.h) when the path
     * says so, or on an unknown path when `system` is there */
    const char     *system;
    size_t          system_len;
    kv_anthropic_t  anthropic;      /* owned */
    /* nothing is decoded for it (an embedding, a score, a tokenize): by
     * its path, or on an unknown path by what only embeddings carry (an
     * `input` list of prompts, `encoding_format`, `dimensions`); `input`
     * is then its prompt, read as `prompt` is */
    int             prefill_only;
    int             embed_members;  /* `encoding_format` or `dimensions` seen */
    uint64_t        cache_key;      /* kv_body_session_key of `prompt_cache_key`; 0: absent */
    uint64_t        user;           /* ... of `user`; 0: absent */
    uint64_t        prev_response;  /* ... of the Responses API's `previous_response_id`
                                       (the response it continues); 0: absent */

    /* where to rewrite the salt (kv_prompt's operator salt): just past the
     * top-level '{', and the value (offset, length) of every top-level
     * `cache_salt` member, whatever its type: an engine may honour any
     * duplicate (Python's json keeps the last), so each is rewritten */
    size_t          obj_open;
    size_t          n_salts;
    size_t          salt_off[KV_BODY_SALTS_MAX];
    size_t          salt_len_raw[KV_BODY_SALTS_MAX];
} kv_body_t;

/*
 * Parses buf[0..len), a request for api (kv_api.h; KV_API_ANY when its
 * path is unknown). 0 on success (kind may still be KV_BODY_NONE), -1
 * with a reason when the body is not a JSON object or is malformed. Always
 * leaves b safe to pass to kv_body_free. A pooling request's `messages`
 * are rendered without the generation prompt unless it asks for one (as
 * vLLM's embeddings do).
 */
int  kv_body_parse_api(kv_body_t *b, kv_api_t api, const char *buf, size_t len, char *err,
                       size_t errlen);
/* kv_body_parse_api for a path that is not known */
int  kv_body_parse(kv_body_t *b, const char *buf, size_t len, char *err, size_t errlen);
void kv_body_free(kv_body_t *b);

/*
 * Only the body's `model` ("" when absent), into model[cap]: for choosing
 * among upstreams before the prompt is read. 0, or -1 with a reason when
 * the body is malformed (as kv_body_parse would say) or the name does not
 * fit.
 */
int  kv_body_model(const char *buf, size_t len, char *model, size_t cap, char *err,
                   size_t errlen);

/* The session key of a hint's bytes (a body field or an operator's header):
 * a 64-bit hash, never 0 (0 means no session); "" gives 0. */
uint64_t kv_body_session_key(const char *s, size_t len);

#endif
