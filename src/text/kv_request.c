/* A request's prompt to token ids (see kv_request.h). */
#include <stdio.h>
#include <stdlib.h>

#include "kv_chat_request.h"
#include "kv_request.h"

char *kv_request_render(const kv_chat_template_t *tpl, const json_t *chat,
                        kv_chat_engine_t engine, size_t *len, char *err, size_t errlen)
{
    json_t *req;
    char   *text;

    if (!json_is_array(chat)) {
        return kv_chat_render_request_json(tpl, chat, engine, kv_chat_now(), len, err, errlen);
    }
    req = json_pack("{sO}", "messages", chat);
    if (req == NULL) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    text = kv_chat_render_request_json(tpl, req, engine, kv_chat_now(), len, err, errlen);
    json_decref(req);
    return text;
}

long kv_request_encode(const kv_tokenizer_t *tok, kv_request_kind_t kind, const char *text,
                       size_t len, kv_ids_t *ids)
{
    return kv_tokenizer_encode(tok, text, len, kind == KV_REQUEST_COMPLETION, ids);
}

kv_request_status_t kv_request_ids(const kv_tokenizer_t *tok, const kv_chat_template_t *tpl,
                                   const char *text, size_t len, const json_t *chat,
                                   kv_chat_engine_t engine, kv_ids_t *ids, char *err,
                                   size_t errlen)
{
    char *rendered;
    long  n;

    if (chat == NULL) {
        return kv_request_encode(tok, KV_REQUEST_COMPLETION, text, len, ids) < 0
               ? KV_REQUEST_NO_MEMORY : KV_REQUEST_OK;
    }
    if (tpl == NULL) {
        snprintf(err, errlen, "no chat template configured");
        return KV_REQUEST_NO_TEMPLATE;
    }
    rendered = kv_request_render(tpl, chat, engine, &len, err, errlen);
    if (rendered == NULL) {
        return KV_REQUEST_TEMPLATE;
    }
    n = kv_request_encode(tok, engine == KV_CHAT_VLLM && kv_chat_request_add_special(chat)
                               ? KV_REQUEST_COMPLETION : KV_REQUEST_CHAT, rendered, len, ids);
    free(rendered);
    return n < 0 ? KV_REQUEST_NO_MEMORY : KV_REQUEST_OK;
}
