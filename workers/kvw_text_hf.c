/*
 * kvworker's text side on the shared tokenizer and chat templates
 * (src/text): what --tokenizer and --chat-template select. Prompts go to
 * ids through kv_request.h, the functions the router uses, so that both
 * hash the same blocks.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_chat.h"
#include "kv_chat_request.h"
#include "kv_request.h"
#include "kv_tokenizer.h"
#include "kvw_text.h"

typedef struct {
    kvw_text_t          text;
    kv_tokenizer_t     *tok;
    kv_chat_template_t *tpl;
    json_t             *defaults;       /* default chat_template_kwargs, or NULL */
} hf_text_t;

static long encode(hf_text_t *h, const char *text, size_t len, kv_request_kind_t kind,
                   uint32_t **ids)
{
    kv_ids_t out = { 0 };

    if (kv_request_encode(h->tok, kind, text, len, &out) < 0) {
        kv_ids_free(&out);
        return -1;
    }
    if (out.ids == NULL) {
        out.ids = malloc(sizeof(uint32_t));
        if (out.ids == NULL) {
            return -1;
        }
    }
    *ids = out.ids;
    return (long) out.n;
}

static long tokenize(void *ctx, const char *text, size_t len, uint32_t **ids)
{
    return encode(ctx, text, len, KV_REQUEST_COMPLETION, ids);
}

static long tokenize_chat(void *ctx, const char *text, size_t len, uint32_t **ids)
{
    return encode(ctx, text, len, KV_REQUEST_CHAT, ids);
}

static int render(void *ctx, json_t *req, char **text, size_t *len, char *err,
                  size_t errlen)
{
    hf_text_t *h = ctx;

    if (h->tpl == NULL) {
        return kvw_plain_render(NULL, req, text, len, err, errlen);
    }
    if (h->defaults) {
        /* vLLM's {**default, **request}: the request's own kwargs win */
        json_t *kw = json_deep_copy(h->defaults);
        json_t *own = json_object_get(req, "chat_template_kwargs");
        if (kw == NULL || (json_is_object(own) && json_object_update(kw, own) != 0)
            || json_object_set_new(req, "chat_template_kwargs", kw) != 0) {
            snprintf(err, errlen, "out of memory");
            return -1;
        }
    }
    *text = kv_chat_render_request_json(h->tpl, req, h->text.engine, kv_chat_now(), len, err,
                                        errlen);
    return *text ? 0 : -1;
}

static size_t detok(void *ctx, uint32_t token, char *buf, size_t cap)
{
    hf_text_t *h = ctx;
    long       n = kv_tokenizer_token_bytes(h->tok, token, buf, cap);

    return n < 0 ? 0 : (size_t) n;
}

void kvw_text_free(const kvw_text_t *text)
{
    hf_text_t *h = (hf_text_t *) text;      /* text is h's first member */

    if (h == NULL) {
        return;
    }
    kv_chat_free(h->tpl);
    kv_tokenizer_free(h->tok);
    json_decref(h->defaults);
    free(h);
}

const kvw_text_t *kvw_text_load(const char *tokenizer, const char *chat_template,
                                kv_chat_engine_t engine, const char *default_kwargs,
                                char *err, size_t errlen)
{
    hf_text_t *h = calloc(1, sizeof(*h));
    char       e[512];

    if (h == NULL) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    h->tok = kv_tokenizer_load(tokenizer, e, sizeof(e));
    if (h->tok == NULL) {
        snprintf(err, errlen, "--tokenizer %s: %s", tokenizer, e);
        free(h);
        return NULL;
    }
    if (chat_template) {
        h->tpl = kv_chat_load(chat_template, NULL, e, sizeof(e));
        if (h->tpl == NULL) {
            snprintf(err, errlen, "--chat-template %s: %s", chat_template, e);
            kv_tokenizer_free(h->tok);
            free(h);
            return NULL;
        }
    }
    h->text.tokenize = tokenize;
    h->text.tokenize_chat = tokenize_chat;
    h->text.render = render;
    h->text.detok = detok;
    h->text.ctx = h;
    h->text.vocab_size = kv_tokenizer_vocab_size(h->tok);
    h->text.engine = engine;
    if (default_kwargs) {
        json_error_t jerr;
        h->defaults = json_loads(default_kwargs, 0, &jerr);
        if (!json_is_object(h->defaults)) {
            snprintf(err, errlen, "--default-chat-template-kwargs: not a JSON object%s%s",
                     h->defaults ? "" : ": ", h->defaults ? "" : jerr.text);
            kvw_text_free(&h->text);
            return NULL;
        }
    }
    return &h->text;
}
