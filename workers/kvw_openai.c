#include "kvw_openai.h"

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

static int append_text(char **buf, size_t *len, size_t *cap, const char *s, size_t n)
{
    if (*len + n + 1 > *cap) {
        size_t c = (*cap ? *cap * 2 : 256);
        while (c < *len + n + 1)
            c *= 2;
        char *p = realloc(*buf, c);
        if (p == NULL)
            return -1;
        *buf = p;
        *cap = c;
    }
    memcpy(*buf + *len, s, n);
    *len += n;
    (*buf)[*len] = '\0';
    return 0;
}

/* Plain rendering used until chat templates exist: "role: content\n". */
static int render_messages(json_t *msgs, char **out, size_t *outlen,
                           char *err, size_t errlen)
{
    size_t len = 0, cap = 0, i;
    json_t *m;
    char *buf = NULL;

    if (!json_is_array(msgs) || json_array_size(msgs) == 0)
        return fail(err, errlen, "'messages' must be a non-empty array");

    json_array_foreach(msgs, i, m) {
        json_t *role = json_object_get(m, "role");
        json_t *content = json_object_get(m, "content");
        if (!json_is_string(role)) {
            free(buf);
            return fail(err, errlen, "each message needs a string 'role'");
        }
        if (append_text(&buf, &len, &cap, json_string_value(role),
                        json_string_length(role)) || append_text(&buf, &len, &cap, ": ", 2))
            goto nomem;
        if (json_is_string(content)) {
            if (append_text(&buf, &len, &cap, json_string_value(content),
                            json_string_length(content)))
                goto nomem;
        } else if (json_is_array(content)) {
            size_t j;
            json_t *part;
            json_array_foreach(content, j, part) {
                json_t *text = json_object_get(part, "text");
                if (json_is_string(text) &&
                    append_text(&buf, &len, &cap, json_string_value(text),
                                json_string_length(text)))
                    goto nomem;
            }
        } else if (!json_is_null(content) && content != NULL) {
            free(buf);
            return fail(err, errlen, "message 'content' must be a string or an array of parts");
        }
        if (append_text(&buf, &len, &cap, "\n", 1))
            goto nomem;
    }
    *out = buf;
    *outlen = len;
    return 0;
nomem:
    free(buf);
    return fail(err, errlen, "out of memory");
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

static int parse_prompt(json_t *root, kvw_req_t *r, int chat,
                        kvw_tokenize_fn tok, void *tok_ctx, char *err, size_t errlen)
{
    char *text = NULL;
    size_t len = 0;

    if (chat) {
        if (render_messages(json_object_get(root, "messages"), &text, &len, err, errlen))
            return -1;
    } else {
        json_t *p = json_object_get(root, "prompt");
        if (json_is_string(p)) {
            text = strdup(json_string_value(p));
            len = json_string_length(p);
        } else if (json_is_array(p) && json_array_size(p) > 0
                   && json_is_integer(json_array_get(p, 0))) {
            return parse_token_ids(p, r, err, errlen);
        } else if (json_is_array(p) && json_array_size(p) == 1
                   && json_is_string(json_array_get(p, 0))) {
            json_t *s = json_array_get(p, 0);
            text = strdup(json_string_value(s));
            len = json_string_length(s);
        } else {
            return fail(err, errlen, "'prompt' must be a string, a list of one string, "
                        "or a list of token ids");
        }
        if (text == NULL)
            return fail(err, errlen, "out of memory");
    }
    long n = tok(tok_ctx, text, len, &r->prompt);
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

int kvw_openai_parse(kvw_req_t *r, int chat, const char *body, size_t len,
                     kvw_tokenize_fn tok, void *tok_ctx, char *err, size_t errlen)
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
    if (parse_prompt(root, r, chat, tok, tok_ctx, err, errlen))
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

    if (r->chat) {
        json_t *delta = finish ? json_object()
                               : json_pack("{s:s%}", "content", text, len);
        choice = json_pack("{s:i,s:o,s:n,s:s?}", "index", 0, "delta", delta,
                           "logprobs", "finish_reason", finish);
    } else {
        choice = json_pack("{s:i,s:s%,s:n,s:s?}", "index", 0, "text", text ? text : "",
                           text ? len : 0, "logprobs", "finish_reason", finish);
    }
    if (!finish)
        json_object_set_new(choice, "finish_reason", json_null());
    return dump(json_pack("{s:s,s:s,s:I,s:s,s:[o]}", "id", id,
                          "object", r->chat ? "chat.completion.chunk" : "text_completion",
                          "created", (json_int_t)created, "model", r->model,
                          "choices", choice));
}

char *kvw_openai_usage_chunk(const kvw_req_t *r, const char *id, long created)
{
    return dump(json_pack("{s:s,s:s,s:I,s:s,s:[],s:o}", "id", id,
                          "object", r->chat ? "chat.completion.chunk" : "text_completion",
                          "created", (json_int_t)created, "model", r->model,
                          "choices", "usage", usage_json(r)));
}

char *kvw_openai_response(const kvw_req_t *r, const char *id, long created,
                          const char *text, size_t len, const char *finish)
{
    json_t *choice;

    if (r->chat)
        choice = json_pack("{s:i,s:{s:s,s:s%},s:n,s:s}", "index", 0, "message",
                           "role", "assistant", "content", text ? text : "", text ? len : 0,
                           "logprobs", "finish_reason", finish);
    else
        choice = json_pack("{s:i,s:s%,s:n,s:s}", "index", 0, "text", text ? text : "",
                           text ? len : 0, "logprobs", "finish_reason", finish);
    return dump(json_pack("{s:s,s:s,s:I,s:s,s:[o],s:o}", "id", id,
                          "object", r->chat ? "chat.completion" : "text_completion",
                          "created", (json_int_t)created, "model", r->model,
                          "choices", choice, "usage", usage_json(r)));
}
