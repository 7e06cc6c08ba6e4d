#include "kvw_openai.h"
#include "kvw_text.h"
#include "kv_unicode.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KVW_MAX_TOKENS_DEFAULT 16
#define KVW_MAX_STOP           4

static int fail(char *err, size_t errlen, const char *msg)
{
    snprintf(err, errlen, "%s", msg);
    return -1;
}

static int parse_token_ids(json_t *arr, kvw_req_t *r, char *err, size_t errlen)
{
    size_t n = json_array_size(arr), i;
    json_t *v;

    r->prompt = malloc((n ? n : 1) * sizeof(uint32_t));
    if (r->prompt == NULL)
        return fail(err, errlen, "out of memory");
    json_array_foreach(arr, i, v) {
        json_int_t t = json_integer_value(v);
        if (!json_is_integer(v) || t < 0 || t > 0xffffffffLL)
            return fail(err, errlen, "'prompt' token ids must be integers in [0, 2^32)");
        r->prompt[i] = (uint32_t)t;
    }
    r->n_prompt = n;
    return 0;
}

/*
 * The prompts of a completion request: a string, a list of token ids, or a
 * list of either. Returns how many there are (0: malformed).
 */
static size_t count_prompts(json_t *p)
{
    if (json_is_string(p))
        return 1;
    if (!json_is_array(p) || json_array_size(p) == 0)
        return 0;
    if (json_is_integer(json_array_get(p, 0)))
        return 1;
    size_t i;
    json_t *v;
    json_array_foreach(p, i, v)
        if (!json_is_string(v) && !(json_is_array(v) && json_array_size(v) > 0))
            return 0;
    return json_array_size(p);
}

static int parse_prompt(json_t *root, kvw_req_t *r, int chat, const kvw_text_t *tx,
                        size_t which, char *err, size_t errlen)
{
    char *text = NULL;
    size_t len = 0;

    if (chat) {
        json_t *msgs = json_object_get(root, "messages");
        if (!json_is_array(msgs) || json_array_size(msgs) == 0)
            return fail(err, errlen, "'messages' must be a non-empty array");
        if (tx->render(tx->ctx, msgs, &text, &len, err, errlen))
            return -1;
        r->n_prompts = 1;
    } else {
        json_t *p = json_object_get(root, "prompt");
        r->n_prompts = count_prompts(p);
        if (r->n_prompts == 0)
            return fail(err, errlen, "'prompt' must be a string, a list of token ids, "
                        "or a non-empty list of strings or token id lists");
        if (r->n_prompts > KVW_MAX_PROMPTS)
            return fail(err, errlen, "too many prompts in one request (at most 64)");
        if (json_is_array(p) && json_is_integer(json_array_get(p, 0)))
            return parse_token_ids(p, r, err, errlen);
        if (json_is_array(p))
            p = json_array_get(p, which);
        if (json_is_array(p))
            return parse_token_ids(p, r, err, errlen);
        text = strdup(json_string_value(p));
        len = json_string_length(p);
        if (text == NULL)
            return fail(err, errlen, "out of memory");
    }
    long n = (chat && tx->tokenize_chat ? tx->tokenize_chat : tx->tokenize)(tx->ctx, text, len,
                                                                         &r->prompt);
    free(text);
    if (n < 0)
        return fail(err, errlen, "prompt could not be tokenized");
    r->n_prompt = (size_t)n;
    return 0;
}

static int parse_stop(json_t *stop, kvw_req_t *r, char *err, size_t errlen)
{
    size_t i;
    json_t *s;

    if (stop == NULL || json_is_null(stop))
        return 0;
    if (json_is_string(stop)) {
        r->stop = calloc(1, sizeof(char *));
        if (r->stop == NULL || (r->stop[0] = strdup(json_string_value(stop))) == NULL)
            return fail(err, errlen, "out of memory");
        r->n_stop = 1;
        return 0;
    }
    if (!json_is_array(stop) || json_array_size(stop) > KVW_MAX_STOP)
        return fail(err, errlen, "'stop' must be a string or a list of up to 4 strings");
    r->stop = calloc(json_array_size(stop) + 1, sizeof(char *));
    if (r->stop == NULL)
        return fail(err, errlen, "out of memory");
    json_array_foreach(stop, i, s) {
        if (!json_is_string(s))
            return fail(err, errlen, "'stop' entries must be strings");
        if ((r->stop[i] = strdup(json_string_value(s))) == NULL)
            return fail(err, errlen, "out of memory");
        r->n_stop = i + 1;
    }
    return 0;
}

int kvw_openai_parse_text(kvw_req_t *r, int chat, const char *body, size_t len,
                          const kvw_text_t *tx, size_t which, char *err, size_t errlen)
{
    json_error_t jerr;
    json_t *root, *v;
    int rc = -1;

    memset(r, 0, sizeof(*r));
    r->chat = chat;
    r->max_tokens = KVW_MAX_TOKENS_DEFAULT;
    r->temperature = 1.0;
    r->top_p = 1.0;

    root = json_loadb(body, len, JSON_REJECT_DUPLICATES, &jerr);
    if (root == NULL) {
        snprintf(err, errlen, "request body is not valid JSON: %s (line %d)",
                 jerr.text, jerr.line);
        return -1;
    }
    if (!json_is_object(root)) {
        fail(err, errlen, "request body must be a JSON object");
        goto done;
    }

    v = json_object_get(root, "model");
    r->model = strdup(json_is_string(v) ? json_string_value(v) : "");
    v = json_object_get(root, "stream");
    r->stream = json_is_true(v);
    v = json_object_get(json_object_get(root, "stream_options"), "include_usage");
    r->include_usage = json_is_true(v);
    r->ignore_eos = json_is_true(json_object_get(root, "ignore_eos"));

    v = json_object_get(root, chat && json_object_get(root, "max_completion_tokens")
                        ? "max_completion_tokens" : "max_tokens");
    if (v && !json_is_null(v)) {
        if (!json_is_integer(v) || json_integer_value(v) < 1
            || json_integer_value(v) > 1000000) {
            fail(err, errlen, "'max_tokens' must be an integer between 1 and 1000000");
            goto done;
        }
        r->max_tokens = (int)json_integer_value(v);
    }
    v = json_object_get(root, "temperature");
    if (json_is_number(v))
        r->temperature = json_number_value(v);
    v = json_object_get(root, "top_p");
    if (json_is_number(v))
        r->top_p = json_number_value(v);
    v = json_object_get(root, "top_k");
    if (json_is_integer(v))
        r->top_k = (int)json_integer_value(v);
    v = json_object_get(root, "seed");
    if (json_is_integer(v))
        r->seed = (uint64_t)json_integer_value(v);
    v = json_object_get(root, "cache_salt");
    if (json_is_string(v) && (r->cache_salt = strdup(json_string_value(v))) == NULL)
        goto done;

    if (parse_stop(json_object_get(root, "stop"), r, err, errlen))
        goto done;
    if (parse_prompt(root, r, chat, tx, which, err, errlen))
        goto done;
    rc = 0;
done:
    json_decref(root);
    return rc;
}

void kvw_req_clear(kvw_req_t *r)
{
    free(r->model);
    free(r->cache_salt);
    free(r->prompt);
    for (size_t i = 0; i < r->n_stop; i++)
        free(r->stop[i]);
    free(r->stop);
    r->model = r->cache_salt = NULL;
    r->prompt = NULL;
    r->stop = NULL;
    r->n_stop = r->n_prompt = 0;
}

char *kvw_openai_error(const char *message, const char *type, const char *param)
{
    json_t *e = json_pack("{s:{s:s,s:s,s:s?,s:n}}", "error", "message", message,
                          "type", type, "param", param, "code");
    char *s = json_dumps(e, JSON_COMPACT);
    json_decref(e);
    return s;
}

const char *kvw_finish_name(kvw_finish_t why)
{
    switch (why) {
    case KVW_FINISH_LENGTH: return "length";
    case KVW_FINISH_STOP:   return "stop";
    default:                return "abort";
    }
}

static json_t *usage_json(const kvw_req_t *r)
{
    return json_pack("{s:I,s:I,s:I,s:{s:I}}",
                     "prompt_tokens", (json_int_t)r->n_prompt,
                     "completion_tokens", (json_int_t)r->n_output,
                     "total_tokens", (json_int_t)(r->n_prompt + r->n_output),
                     "prompt_tokens_details",
                     "cached_tokens", (json_int_t)r->cached_tokens);
}

static char *dump(json_t *j)
{
    char *s = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    return s;
}

char *kvw_openai_chunk(const kvw_req_t *r, const char *id, long created,
                       const char *text, size_t len, const char *finish)
{
    json_t *choice;
    char *clean = text ? kv_utf8_clean(text, len, &len) : NULL;
    char *out;

    text = clean;

    if (r->chat) {
        json_t *delta = finish ? json_object()
                               : json_pack("{s:s%}", "content", text ? text : "", len);
        if (!finish && r->n_output <= 1)    /* the first chunk names the role, as OpenAI's */
            json_object_set_new(delta, "role", json_string("assistant"));
        choice = json_pack("{s:I,s:o,s:n,s:s?}", "index", (json_int_t)r->index, "delta", delta,
                           "logprobs", "finish_reason", finish);
    } else {
        choice = json_pack("{s:I,s:s%,s:n,s:s?}", "index", (json_int_t)r->index,
                           "text", text ? text : "",
                           text ? len : 0, "logprobs", "finish_reason", finish);
    }
    if (!finish)
        json_object_set_new(choice, "finish_reason", json_null());
    out = dump(json_pack("{s:s,s:s,s:I,s:s,s:[o]}", "id", id,
                         "object", r->chat ? "chat.completion.chunk" : "text_completion",
                         "created", (json_int_t)created, "model", r->model,
                         "choices", choice));
    free(clean);
    return out;
}

char *kvw_openai_usage_chunk(const kvw_req_t *r, const char *id, long created)
{
    return dump(json_pack("{s:s,s:s,s:I,s:s,s:[],s:o}", "id", id,
                          "object", r->chat ? "chat.completion.chunk" : "text_completion",
                          "created", (json_int_t)created, "model", r->model,
                          "choices", "usage", usage_json(r)));
}

static json_t *choice_json(const kvw_req_t *r, const char *raw, size_t len,
                           const char *finish)
{
    char *text = raw ? kv_utf8_clean(raw, len, &len) : NULL;
    json_t *c;

    if (r->chat)
        c = json_pack("{s:I,s:{s:s,s:s%},s:n,s:s}", "index", (json_int_t)r->index,
                      "message", "role", "assistant", "content", text ? text : "",
                      text ? len : 0, "logprobs", "finish_reason", finish);
    else
        c = json_pack("{s:I,s:s%,s:n,s:s}", "index", (json_int_t)r->index,
                      "text", text ? text : "", text ? len : 0, "logprobs",
                      "finish_reason", finish);
    free(text);
    return c;
}

char *kvw_openai_response_n(const kvw_req_t *const *rs, const char *const *texts,
                            const size_t *lens, const char *const *finishes, size_t n,
                            const char *id, long created)
{
    json_t *choices = json_array();
    kvw_req_t sum = *rs[0];

    sum.n_prompt = sum.n_output = sum.cached_tokens = 0;
    for (size_t i = 0; i < n; i++) {
        json_array_append_new(choices, choice_json(rs[i], texts[i], lens[i], finishes[i]));
        sum.n_prompt += rs[i]->n_prompt;
        sum.n_output += rs[i]->n_output;
        sum.cached_tokens += rs[i]->cached_tokens;
    }
    return dump(json_pack("{s:s,s:s,s:I,s:s,s:o,s:o}", "id", id,
                          "object", sum.chat ? "chat.completion" : "text_completion",
                          "created", (json_int_t)created, "model", sum.model,
                          "choices", choices, "usage", usage_json(&sum)));
}

char *kvw_openai_response(const kvw_req_t *r, const char *id, long created,
                          const char *text, size_t len, const char *finish)
{
    return kvw_openai_response_n(&r, &text, &len, &finish, 1, id, created);
}
