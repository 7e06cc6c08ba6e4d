/*
 * A chat completion request rendered as the engine renders it. The router
 * must hash exactly the tokens the engine will cache, so it cannot render
 * `messages` alone: vLLM also passes the request's `tools`, `documents` and
 * `chat_template_kwargs` to the template, honours `add_generation_prompt`
 * and `continue_final_message`, and rewrites the conversation first
 * (kv_chat_vllm.c says how; SGLang, kv_chat_sglang.c, differs). An
 * agent's request carries thousands of tokens of tool schemas right after
 * the system prompt: rendered without them, every block past that point
 * hashes differently from the engine's.
 */
#ifndef KV_CHAT_REQUEST_H
#define KV_CHAT_REQUEST_H

#include <stddef.h>

#include <jansson.h>

#include "kv_chat.h"

/* Whose rules: vLLM's (the default) or SGLang's (kv_chat_request.c). */
typedef enum {
    KV_CHAT_VLLM = 0,
    KV_CHAT_SGLANG
} kv_chat_engine_t;

/* The request's members that shape the prompt, as raw JSON spans of its
 * body (NULL: absent). */
typedef struct {
    kv_chat_engine_t engine;
    const char *messages;           /* a JSON array */
    size_t      messages_len;
    const char *tools;
    size_t      tools_len;
    const char *documents;
    size_t      documents_len;
    const char *kwargs;             /* `chat_template_kwargs` */
    size_t      kwargs_len;
    const char *default_kwargs;     /* the operator's (vLLM's --default-chat-template-
                                       kwargs), under the request's */
    size_t      default_kwargs_len;
    const char *tool_choice;                /* SGLang: "none" or a named tool */
    size_t      tool_choice_len;
    const char *reasoning_effort;           /* SGLang passes it to the template */
    size_t      reasoning_effort_len;
    int         add_generation_prompt;      /* 1 unless the body says false */
    int         continue_final_message;
} kv_chat_request_t;

/* Renders the request; a malloc'ed string (length in *len), or NULL with a
 * reason in err. */
char *kv_chat_render_request(const kv_chat_template_t *t, const kv_chat_request_t *r,
                             long long now, size_t *len, char *err, size_t errlen);

/* The same from a parsed request object (kvworker's side). */
char *kv_chat_render_request_json(const kv_chat_template_t *t, const json_t *req,
                                  kv_chat_engine_t engine, long long now, size_t *len,
                                  char *err, size_t errlen);

/* A request's `add_special_tokens` (default false for chat): the tokenizer
 * then adds its special tokens to the rendered text too. */
int kv_chat_request_add_special(const json_t *req);

#endif
