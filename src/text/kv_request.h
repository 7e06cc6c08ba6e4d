/*
 * A request's prompt to token ids, the way the engines compute them, in one
 * place: the router (src/route/kv_prompt.c), kvworker (workers/kvw_text_hf.c)
 * and kvtok all call these, because the router and the worker agreeing on
 * token ids is what makes the router's block hashes name the worker's
 * cached blocks.
 *
 *   completion  the prompt text, encoded WITH the tokenizer's special tokens
 *               (HF encode's default, as vLLM does)
 *   chat        the messages rendered by the chat template with the
 *               generation prompt, then encoded WITHOUT special tokens (the
 *               template writes them itself, as vLLM does)
 */
#ifndef KV_REQUEST_H
#define KV_REQUEST_H

#include <stddef.h>

#include <jansson.h>

#include "kv_chat.h"
#include "kv_chat_request.h"
#include "kv_tokenizer.h"

typedef enum {
    KV_REQUEST_COMPLETION = 0,
    KV_REQUEST_CHAT                 /* text already rendered by the template */
} kv_request_kind_t;

typedef enum {
    KV_REQUEST_OK = 0,
    KV_REQUEST_NO_TEMPLATE,         /* a chat, and no template */
    KV_REQUEST_TEMPLATE,            /* the template failed on these messages */
    KV_REQUEST_NO_MEMORY
} kv_request_status_t;

/* A chat to prompt text (malloc'ed), or NULL with err: chat is the request
 * object (its messages, tools, kwargs, ..., kv_chat_request.h) or a bare
 * messages array, rendered by the engine's rules. */
char *kv_request_render(const kv_chat_template_t *tpl, const json_t *chat,
                        kv_chat_engine_t engine, size_t *len, char *err, size_t errlen);

/* Prompt text of the given kind to ids (appended to ids); -1: no memory. */
long kv_request_encode(const kv_tokenizer_t *tok, kv_request_kind_t kind, const char *text,
                       size_t len, kv_ids_t *ids);

/* Both steps: chat != NULL is a chat (text unused; as for
 * kv_request_render), else a completion. */
kv_request_status_t kv_request_ids(const kv_tokenizer_t *tok, const kv_chat_template_t *tpl,
                                   const char *text, size_t len, const json_t *chat,
                                   kv_chat_engine_t engine, kv_ids_t *ids, char *err,
                                   size_t errlen);

#endif
