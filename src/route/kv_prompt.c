/* Request body -> tokens -> block sequence hashes (see kv_prompt.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "kv_body.h"
#include "kv_hash.h"
#include "kv_prompt.h"
#include "kv_request.h"

static kv_prompt_status_t fail(kv_prompt_t *out, kv_prompt_status_t st, const char *why)
{
    out->status = st;
    snprintf(out->err, sizeof(out->err), "%s", why);
    return st;
}

/*
 * Tokenizes text, or only its first cfg->max_tokenize bytes (cut back to a
 * character boundary) so one request's cost to the router is bounded: a
 * 16 MB body would otherwise hold a tokenizing thread for seconds. The
 * rest's tokens are estimated at the part's bytes per token.
 */
static kv_prompt_status_t encode(const kv_prompt_config_t *cfg, const char *text,
                                 size_t len, kv_request_kind_t kind, kv_ids_t *ids,
                                 kv_prompt_t *out)
{
    size_t         cut = len;
    kv_turn_info_t info;

    if (cfg->max_tokenize && len > cfg->max_tokenize) {
        cut = cfg->max_tokenize;
        while (cut > 0 && ((unsigned char) text[cut] & 0xc0) == 0x80) {
            cut--;
        }
        out->capped = 1;
    }
    if ((cfg->turns
         ? kv_turn_encode(cfg->turns, cfg->tokenizer, kind, text, cut, kv_turn_now_ms(), ids,
                          &info)
         : kv_request_encode(cfg->tokenizer, kind, text, cut, ids)) < 0)
    {
        return fail(out, KV_PROMPT_NO_MEMORY, "out of memory");
    }
    if (cfg->turns) {
        out->turn_cached_tokens = info.reused_ids;
    }
    if (out->capped) {
        /* 4 bytes per token when nothing was tokenized to measure by */
        out->estimated_tokens = ids->n && cut
                                ? (uint64_t) ((double) (len - cut) * ids->n / cut + 0.5)
                                : (len - cut + 3) / 4;
        snprintf(out->err, sizeof(out->err), "prompt of %zu bytes: tokenized the first %zu",
                 len, cut);
    }
    return KV_PROMPT_OK;
}

/* messages -> prompt text -> ids, as the engines render chat requests. */
static kv_prompt_status_t chat_ids(const kv_prompt_config_t *cfg, const kv_body_t *b,
                                   kv_ids_t *ids, kv_prompt_t *out)
{
    json_error_t        jerr;
    json_t             *msgs;
    char               *text, err[160];
    size_t              len;
    kv_prompt_status_t  st;

    int                 unsupported;

    if (cfg->chat == NULL) {
        return fail(out, KV_PROMPT_NO_TEMPLATE, "no chat template configured");
    }
    /* what kv_request_render renders, without jansson's slow parse when
     * the JSON allows (a long conversation parses in a tenth of the time) */
    text = kv_chat_render_json(cfg->chat, b->messages, b->messages_len, 1, kv_chat_now(), &len,
                               err, sizeof(err), &unsupported);
    if (text == NULL && unsupported) {
        msgs = json_loadb(b->messages, b->messages_len, 0, &jerr);
        if (msgs == NULL) {
            return fail(out, KV_PROMPT_PARSE, jerr.text);
        }
        text = kv_request_render(cfg->chat, msgs, &len, err, sizeof(err));
        json_decref(msgs);
    }
    if (text == NULL) {
        return fail(out, KV_PROMPT_TEMPLATE, err);
    }
    st = encode(cfg, text, len, KV_REQUEST_CHAT, ids, out);
    free(text);
    return st;
}

static kv_prompt_status_t prompt_ids(const kv_prompt_config_t *cfg, kv_body_t *b,
                                     kv_ids_t *ids, kv_prompt_t *out)
{
    switch (b->kind) {
    case KV_BODY_IDS:
        ids->ids = b->ids;          /* take ownership */
        ids->n = ids->cap = b->n_ids;
        b->ids = NULL;
        b->n_ids = 0;
        return KV_PROMPT_OK;
    case KV_BODY_TEXT:
        if (cfg->tokenizer == NULL) {
            return fail(out, KV_PROMPT_NO_TOKENIZER, "no tokenizer configured");
        }
        return encode(cfg, b->text, b->text_len, KV_REQUEST_COMPLETION, ids, out);
    case KV_BODY_MESSAGES:
        if (cfg->tokenizer == NULL) {
            return fail(out, KV_PROMPT_NO_TOKENIZER, "no tokenizer configured");
        }
        return chat_ids(cfg, b, ids, out);
    default:
        return fail(out, KV_PROMPT_NO_PROMPT, "body has neither prompt nor messages");
    }
}

kv_prompt_status_t kv_prompt_compute(const kv_prompt_config_t *cfg, const char *body,
                                     size_t len, const char *salt, size_t salt_len,
                                     kv_prompt_t *out)
{
    kv_body_t  b;
    kv_ids_t   ids = { NULL, 0, 0 };
    uint64_t   seed;
    size_t     bs = cfg->block_size ? cfg->block_size : 16, hashed;

    memset(out, 0, sizeof(*out));
    if (kv_body_parse(&b, body, len, out->err, sizeof(out->err)) != 0) {
        out->status = KV_PROMPT_PARSE;
        return out->status;
    }
    out->stream = b.stream;
    out->max_tokens = b.max_tokens;
    if (cfg->model && cfg->model[0] && b.model[0] && strcmp(cfg->model, b.model) != 0) {
        fail(out, KV_PROMPT_MODEL, "unknown model");
        goto done;
    }
    if (prompt_ids(cfg, &b, &ids, out) != KV_PROMPT_OK) {
        goto done;
    }
    if (b.salt) {
        salt = b.salt;
        salt_len = b.salt_len;
    }
    seed = kv_hash_seed(salt, salt ? salt_len : 0);
    out->prompt_tokens = ids.n + out->estimated_tokens;
    hashed = ids.n;
    if (out->capped) {
        hashed = ids.n > KV_PROMPT_CAP_MARGIN ? ids.n - KV_PROMPT_CAP_MARGIN : 0;
    }
    out->nseq = hashed / bs;
    if (out->nseq) {
        out->seq = malloc(out->nseq * sizeof(uint64_t));
        if (out->seq == NULL) {
            out->nseq = 0;
            fail(out, KV_PROMPT_NO_MEMORY, "out of memory");
            goto done;
        }
        kv_hash_blocks(ids.ids, hashed, bs, seed, NULL, out->seq);
    }
    out->status = KV_PROMPT_OK;
done:
    free(ids.ids);
    kv_body_free(&b);
    return out->status;
}

void kv_prompt_free(kv_prompt_t *p)
{
    free(p->seq);
    p->seq = NULL;
    p->nseq = 0;
}
