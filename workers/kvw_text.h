/*
 * Text <-> tokens, in one place. The HTTP front tokenizes prompts and
 * renders chat messages; the scheduler turns sampled token ids back into
 * text (stop strings, responses). kvw_text_load() puts the shared
 * tokenizer (src/text/kv_tokenizer.h) and chat template (kv_chat.h) behind
 * these; without --tokenizer, kvw_text_bytes() stands in: one token per
 * byte, and chat messages rendered as "role: content\n" lines.
 */
#ifndef KVW_TEXT_H
#define KVW_TEXT_H

#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "kv_chat_request.h"

/* Turns prompt text into token ids; returns the count or -1. */
typedef long (*kvw_tokenize_fn)(void *ctx, const char *text, size_t len,
                                uint32_t **ids);

/* Renders a chat request (the body's object: its "messages", and the tools,
 * template kwargs and flags the engine renders too) into prompt text
 * (malloc'd); -1 with err. */
typedef int (*kvw_render_fn)(void *ctx, json_t *req, char **text, size_t *len,
                             char *err, size_t errlen);

/* The bytes of one token into buf (cap bytes); returns the length. */
typedef size_t (*kvw_detok_fn)(void *ctx, uint32_t token, char *buf, size_t cap);

typedef struct kvw_text {
    kvw_tokenize_fn tokenize;
    kvw_tokenize_fn tokenize_chat;      /* rendered chats; NULL: tokenize */
    kvw_render_fn   render;
    kvw_detok_fn    detok;
    void           *ctx;
    uint32_t        vocab_size;         /* 0: the byte stand-in */
    kv_chat_engine_t engine;            /* whose rules render chat requests */
} kvw_text_t;

/* The shared tokenizer (and chat template, may be NULL) from src/text. */
/* default_kwargs: vLLM's --default-chat-template-kwargs (a JSON object, the
 * request's chat_template_kwargs over it) or NULL. */
const kvw_text_t *kvw_text_load(const char *tokenizer, const char *chat_template,
                                kv_chat_engine_t engine, const char *default_kwargs,
                                char *err, size_t errlen);
/* Frees what kvw_text_load returned (never kvw_text_bytes()). */
void kvw_text_free(const kvw_text_t *text);

/*
 * Token bytes are not always whole characters (a byte-level token may hold
 * part of one). kvw_utf8_hold: how many bytes at the end of s[0..n) to keep
 * back while streaming because more bytes may complete them (responses
 * then clean what they send with kv_utf8_clean, src/core/kv_unicode.h).
 */
size_t kvw_utf8_hold(const char *s, size_t n);

/* Appends s[0..n) to a growing NUL-terminated buffer; -1: no memory. */
int kvw_text_append(char **buf, size_t *len, size_t *cap, const char *s, size_t n);

/* The byte-per-token stand-in. */
const kvw_text_t *kvw_text_bytes(void);

long   kvw_bytes_tokenize(void *ctx, const char *text, size_t len, uint32_t **ids);
int    kvw_plain_render(void *ctx, json_t *req, char **text, size_t *len,
                        char *err, size_t errlen);
size_t kvw_bytes_detok(void *ctx, uint32_t token, char *buf, size_t cap);

#endif
