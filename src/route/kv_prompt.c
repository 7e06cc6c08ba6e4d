/* Request body -> tokens -> block sequence hashes (see kv_prompt.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "kv_body.h"
#include "kv_chat_request.h"
#include "kv_clock.h"
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
         ? kv_turn_encode(cfg->turns, cfg->tokenizer, kind, text, cut, kv_clock_ms(), ids,
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

/* messages (and the rest of a chat request) -> prompt text -> ids, as the
 * engines render chat requests. */
static kv_prompt_status_t chat_ids(const kv_prompt_config_t *cfg, const kv_body_t *b,
                                   kv_ids_t *ids, kv_prompt_t *out)
{
    kv_chat_request_t   r;
    char               *text, err[160];
    size_t              len;
    kv_prompt_status_t  st;

    if (cfg->chat == NULL) {
        return fail(out, KV_PROMPT_NO_TEMPLATE, "no chat template configured");
    }
    r = b->chat;
    r.engine = cfg->chat_engine;
    r.default_kwargs = cfg->chat_kwargs;
    r.default_kwargs_len = cfg->chat_kwargs ? strlen(cfg->chat_kwargs) : 0;
    text = kv_chat_render_request(cfg->chat, &r, kv_chat_now(), &len, err, sizeof(err));
    if (text == NULL) {
        return fail(out, KV_PROMPT_TEMPLATE, err);
    }
    /* add_special_tokens: the tokenizer adds its own (a second BOS, say) */
    st = encode(cfg, text, len, b->add_special_tokens == 1 && r.engine == KV_CHAT_VLLM
                                ? KV_REQUEST_COMPLETION : KV_REQUEST_CHAT, ids, out);
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
        /* a completion gets the tokenizer's special tokens unless it says not */
        return encode(cfg, b->text, b->text_len,
                      b->add_special_tokens == 0 ? KV_REQUEST_CHAT : KV_REQUEST_COMPLETION, ids,
                      out);
    case KV_BODY_MESSAGES:
        if (cfg->tokenizer == NULL) {
            return fail(out, KV_PROMPT_NO_TOKENIZER, "no tokenizer configured");
        }
        return chat_ids(cfg, b, ids, out);
    default:
        return fail(out, KV_PROMPT_NO_PROMPT, "body has neither prompt nor messages");
    }
}

_Static_assert(KV_BODY_SALTS_MAX == sizeof(((kv_prompt_t *) 0)->salt_off) / sizeof(size_t),
               "kv_prompt_t holds every salt kv_body_t records");

/* A batch's other prompts in tokens: their ids, and their text at the
 * first prompt's tokens per byte (4 bytes a token when it has none). */
static uint64_t batch_tokens(const kv_body_t *b, uint64_t first_tokens)
{
    uint64_t text;

    if (b->kind == KV_BODY_TEXT && b->text_len && first_tokens) {
        text = (uint64_t) ((double) b->batch_bytes * first_tokens / b->text_len + 0.5);
    } else {
        text = (b->batch_bytes + 3) / 4;
    }
    return b->batch_ids + text;
}

/*
 * A score or rerank (prompts that pair a query with each document, made by
 * the engine) and a tokenize (no engine work) are not tokenized: they route
 * by load, a score counting its body's bytes at 4 a token as prefill work.
 * 1 when api is one of those.
 */
static int unread(kv_api_t api, size_t len, kv_prompt_t *out)
{
    if (api != KV_API_SCORE && api != KV_API_TOKENIZE) {
        return 0;
    }
    out->batch_tokens = api == KV_API_SCORE ? (len + 3) / 4 : 0;
    out->status = KV_PROMPT_OK;
    return 1;
}

kv_prompt_status_t kv_prompt_compute(const kv_prompt_config_t *cfg, const char *body,
                                     size_t len, const char *salt, size_t salt_len,
                                     kv_prompt_t *out)
{
    kv_body_t        b;
    kv_ids_t         ids = { NULL, 0, 0 };
    kv_model_role_t  role;
    uint64_t         seed;
    size_t           bs = cfg->block_size ? cfg->block_size : 16, hashed;

    memset(out, 0, sizeof(*out));
    /* what the path says, even of a body that cannot be read */
    out->prefill_only = cfg->api >= KV_API_POOLING;
    if (kv_body_parse_api(&b, cfg->api, body, len, out->err, sizeof(out->err)) != 0) {
        out->status = KV_PROMPT_PARSE;
        return out->status;
    }
    out->parsed = 1;
    out->obj_open = b.obj_open;
    out->n_salts = b.n_salts;
    memcpy(out->salt_off, b.salt_off, sizeof(out->salt_off));
    memcpy(out->salt_len_raw, b.salt_len_raw, sizeof(out->salt_len_raw));
    out->stream = b.stream;
    /* counted into load as max_tokens x sequences: both bounded far above
     * what an engine accepts, so the product cannot wrap */
    out->max_tokens = b.max_tokens < KV_PROMPT_MAX_TOKENS ? b.max_tokens : KV_PROMPT_MAX_TOKENS;
    out->sequences = b.sequences * b.prompts < KV_PROMPT_SEQUENCES_MAX
                     ? b.sequences * b.prompts : KV_PROMPT_SEQUENCES_MAX;
    out->session = b.cache_key ? b.cache_key : b.user;
    out->prev_response = b.prev_response;
    out->prefill_only |= b.prefill_only;
    out->preamble = b.responses != NULL;
    role = kv_model_role(cfg->model, cfg->lora, b.model);
    if (role == KV_MODEL_OTHER) {
        fail(out, KV_PROMPT_MODEL, "unknown model");
        goto done;
    }
    if (cfg->salt_combine && (salt_len > 0 || b.salt != NULL)) {
        out->salt = kv_prompt_salt(salt, salt ? salt_len : 0, b.salt, b.salt ? b.salt_len : 0,
                                   &out->salt_len);
        if (out->salt == NULL) {
            fail(out, KV_PROMPT_NO_MEMORY, "out of memory");
            goto done;
        }
        salt = out->salt;
        salt_len = out->salt_len;
    } else if (cfg->salt_combine) {
        salt = NULL;                /* no operator salt, no client salt: none */
    } else if (b.salt) {
        salt = b.salt;
        salt_len = b.salt_len;
    }
    if (salt == NULL && role == KV_MODEL_LORA) {
        /* the engine seeds a LoRA request's blocks with the adapter's
         * name (vLLM's lora_name, Dynamo's seed); a salt replaces it, as
         * vLLM's salted first block does */
        salt = b.model;
        salt_len = strlen(b.model);
    }
    /* after the salt: an engine must see it whatever the router reads */
    if (unread(cfg->api, len, out)) {
        goto done;
    }
    if (prompt_ids(cfg, &b, &ids, out) != KV_PROMPT_OK) {
        goto done;
    }
    seed = kv_hash_seed(salt, salt ? salt_len : 0);
    out->prompt_tokens = ids.n + out->estimated_tokens;
    out->batch_tokens = batch_tokens(&b, out->prompt_tokens);
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
    free(p->salt);
    p->seq = NULL;
    p->nseq = 0;
    p->salt = NULL;
    p->salt_len = 0;
}

char *kv_prompt_salt(const char *op, size_t op_len, const char *client, size_t client_len,
                     size_t *out_len)
{
    char   head[32];
    int    n = snprintf(head, sizeof(head), "%zu:", op_len);
    char  *s = malloc((size_t) n + op_len + client_len + 1);

    if (s == NULL) {
        return NULL;
    }
    memcpy(s, head, (size_t) n);
    if (op_len) {
        memcpy(s + n, op, op_len);
    }
    if (client_len) {
        memcpy(s + n + op_len, client, client_len);
    }
    *out_len = (size_t) n + op_len + client_len;
    s[*out_len] = '\0';
    return s;
}

size_t kv_prompt_json_string(const char *s, size_t len, char *out)
{
    static const char  hex[] = "0123456789abcdef";
    size_t             n = 0;

#define PUT(c) do { if (out) out[n] = (c); n++; } while (0)
    PUT('"');
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char) s[i];
        if (c == '"' || c == '\\') {
            PUT('\\');
            PUT((char) c);
        } else if (c < 0x20 || c == 0x7f) {
            PUT('\\');
            PUT('u');
            PUT('0');
            PUT('0');
            PUT(hex[c >> 4]);
            PUT(hex[c & 15]);
        } else {
            PUT((char) c);
        }
    }
    PUT('"');
#undef PUT
    return n;
}
