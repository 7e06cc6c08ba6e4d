#include "kvw_openai.h"
#include "kvw_text.h"
#include "kv_unicode.h"
#include "kv_chat_request.h"
#include "kv_model.h"
#include "kv_anthropic.h"
#include "kv_responses.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KVW_MAX_TOKENS_DEFAULT 16
#define KVW_MAX_STOP           4

int kvw_openai_fail(kvw_openai_err_t *e, int status, const char *type, const char *param,
                    const char *code, const char *fmt, ...)
{
    va_list ap;

    e->status = status;
    e->type = type;
    e->param = param;
    e->code = code;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof(e->message), fmt, ap);
    va_end(ap);
    return -1;
}

/* A field of the wrong JSON type: OpenAI's "invalid_type". */
static int bad_type(kvw_openai_err_t *e, const char *param, const char *expected)
{
    return kvw_openai_fail(e, 400, "invalid_request_error", param, "invalid_type",
                           "Invalid type for '%s': expected %s.", param, expected);
}

static int bad_value(kvw_openai_err_t *e, const char *param, const char *expected)
{
    return kvw_openai_fail(e, 400, "invalid_request_error", param, "invalid_value",
                           "Invalid value for '%s': expected %s.", param, expected);
}

static int unsupported(kvw_openai_err_t *e, const char *param, const char *what)
{
    return kvw_openai_fail(e, 400, "invalid_request_error", param, "unsupported_parameter",
                           "Unsupported parameter '%s': kvworker %s.", param, what);
}

static int no_memory(kvw_openai_err_t *e)
{
    return kvw_openai_fail(e, 503, "server_error", NULL, "out_of_memory", "out of memory");
}

/* The field, or NULL when absent or null (OpenAI treats null as absent). */
static json_t *field(json_t *root, const char *name)
{
    json_t *v = json_object_get(root, name);
    return json_is_null(v) ? NULL : v;
}

static int get_bool(json_t *root, const char *name, int *out, kvw_openai_err_t *e)
{
    json_t *v = field(root, name);

    if (v == NULL)
        return 0;
    if (!json_is_boolean(v))
        return bad_type(e, name, "a boolean");
    *out = json_is_true(v);
    return 0;
}

static int get_number(json_t *root, const char *name, double min, double max, double *out,
                      kvw_openai_err_t *e)
{
    json_t *v = field(root, name);
    char want[96];

    if (v == NULL)
        return 0;
    if (!json_is_number(v))
        return bad_type(e, name, "a number");
    if (!(json_number_value(v) >= min && json_number_value(v) <= max)) {
        snprintf(want, sizeof(want), "a number in [%g, %g]", min, max);
        return bad_value(e, name, want);
    }
    *out = json_number_value(v);
    return 0;
}

static int get_int(json_t *root, const char *name, json_int_t min, json_int_t max,
                   json_int_t *out, kvw_openai_err_t *e)
{
    json_t *v = field(root, name);
    char want[96];

    if (v == NULL)
        return 0;
    if (!json_is_integer(v))
        return bad_type(e, name, "an integer");
    if (json_integer_value(v) < min || json_integer_value(v) > max) {
        snprintf(want, sizeof(want), "an integer in [%lld, %lld]", (long long)min,
                 (long long)max);
        return bad_value(e, name, want);
    }
    *out = json_integer_value(v);
    return 0;
}

static int parse_token_ids(json_t *arr, kvw_req_t *r, kvw_openai_err_t *e)
{
    size_t n = json_array_size(arr), i;
    json_t *v;

    r->prompt = malloc((n ? n : 1) * sizeof(uint32_t));
    if (r->prompt == NULL)
        return no_memory(e);
    json_array_foreach(arr, i, v) {
        json_int_t t = json_integer_value(v);
        if (!json_is_integer(v) || t < 0 || t > 0xffffffffLL)
            return bad_value(e, "prompt", "token ids that are integers in [0, 2^32)");
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
                        size_t which, kvw_openai_err_t *e)
{
    char *text = NULL, err[256];
    size_t len = 0;

    if (chat) {
        json_t *msgs = json_object_get(root, "messages");
        if (msgs == NULL)
            return kvw_openai_fail(e, 400, "invalid_request_error", "messages",
                                   "missing_required_parameter",
                                   "Missing required parameter: 'messages'.");
        if (!json_is_array(msgs) || json_array_size(msgs) == 0)
            return bad_type(e, "messages", "a non-empty array");
        if (tx->render(tx->ctx, root, &text, &len, err, sizeof(err)))
            return kvw_openai_fail(e, 400, "invalid_request_error", "messages",
                                   "invalid_value", "%s", err);
        r->n_prompts = 1;
    } else {
        json_t *p = json_object_get(root, "prompt");
        if (p == NULL)
            return kvw_openai_fail(e, 400, "invalid_request_error", "prompt",
                                   "missing_required_parameter",
                                   "Missing required parameter: 'prompt'.");
        r->n_prompts = count_prompts(p);
        if (r->n_prompts == 0)
            return bad_type(e, "prompt", "a string, a list of token ids, or a non-empty "
                            "list of strings or token id lists");
        if (r->n_prompts > KVW_MAX_PROMPTS)
            return bad_value(e, "prompt", "at most 64 prompts in one request");
        if (json_is_array(p) && json_is_integer(json_array_get(p, 0)))
            return parse_token_ids(p, r, e);
        if (json_is_array(p))
            p = json_array_get(p, which);
        if (json_is_array(p))
            return parse_token_ids(p, r, e);
        /* the whole string: a "\u0000" in it is a character like any other */
        len = json_string_length(p);
        if ((text = malloc(len + 1)) == NULL)
            return no_memory(e);
        memcpy(text, json_string_value(p), len + 1);
    }
    /* add_special_tokens (vLLM's default: false for a chat, true for a
     * prompt): plain tokenize adds the tokenizer's special tokens */
    json_t *special = json_object_get(root, "add_special_tokens");
    int plain = !tx->tokenize_chat
                || (chat ? tx->engine == KV_CHAT_VLLM && json_is_true(special)
                         : !json_is_false(special));
    long n = (plain ? tx->tokenize : tx->tokenize_chat)(tx->ctx, text, len, &r->prompt);
    free(text);
    if (n < 0)
        return bad_value(e, chat ? "messages" : "prompt", "text the tokenizer accepts");
    r->n_prompt = (size_t)n;
    return 0;
}

static int parse_stop(json_t *stop, kvw_req_t *r, kvw_openai_err_t *e)
{
    size_t i;
    json_t *s;

    if (stop == NULL || json_is_null(stop))
        return 0;
    if (json_is_string(stop)) {
        r->stop = calloc(1, sizeof(char *));
        if (r->stop == NULL || (r->stop[0] = strdup(json_string_value(stop))) == NULL)
            return no_memory(e);
        r->n_stop = 1;
        return 0;
    }
    if (!json_is_array(stop))
        return bad_type(e, "stop", "a string or a list of strings");
    if (json_array_size(stop) > KVW_MAX_STOP)
        return bad_value(e, "stop", "at most 4 sequences");
    r->stop = calloc(json_array_size(stop) + 1, sizeof(char *));
    if (r->stop == NULL)
        return no_memory(e);
    json_array_foreach(stop, i, s) {
        if (!json_is_string(s))
            return bad_type(e, "stop", "a string or a list of strings");
        if ((r->stop[i] = strdup(json_string_value(s))) == NULL)
            return no_memory(e);
        r->n_stop = i + 1;
    }
    return 0;
}

/*
 * What kvworker does not implement is refused by name, so that a client
 * never takes a silently ignored field for an answer: several choices per
 * prompt (n, best_of) and log probabilities.
 */
static int refuse_unsupported(json_t *root, int chat, kvw_openai_err_t *e)
{
    json_int_t n = 1;
    json_t *v;

    if (get_int(root, "n", 1, 128, &n, e))
        return -1;
    if (n != 1)
        return unsupported(e, "n", "returns one choice per prompt (n must be 1)");
    if (!chat) {
        n = 1;
        if (get_int(root, "best_of", 1, 128, &n, e))
            return -1;
        if (n != 1)
            return unsupported(e, "best_of", "returns one choice per prompt (best_of must be 1)");
    }
    v = field(root, "logprobs");
    if (v && !json_is_false(v)) {
        if (chat ? !json_is_boolean(v) : !json_is_integer(v))
            return bad_type(e, "logprobs", chat ? "a boolean" : "an integer");
        return unsupported(e, "logprobs", "does not return log probabilities");
    }
    if (field(root, "top_logprobs"))
        return unsupported(e, "top_logprobs", "does not return log probabilities");
    return 0;
}

void *kvw_openai_load(const char *body, size_t len, kvw_openai_err_t *e)
{
    json_error_t jerr;
    /* "\u0000" is valid JSON, and vLLM (Python's json) takes it: a model's
     * own output, echoed back in the next turn, may hold one */
    json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES | JSON_ALLOW_NUL, &jerr);

    if (root == NULL) {
        kvw_openai_fail(e, 400, "invalid_request_error", NULL, "invalid_json",
                        "request body is not valid JSON: %s (line %d)", jerr.text, jerr.line);
        return NULL;
    }
    if (!json_is_object(root)) {
        kvw_openai_fail(e, 400, "invalid_request_error", NULL, "invalid_json",
                        "request body must be a JSON object");
        json_decref(root);
        return NULL;
    }
    return root;
}

void kvw_openai_unload(void *doc)
{
    json_decref(doc);
}

int kvw_openai_parse_text(kvw_req_t *r, int chat, const char *body, size_t len,
                          const kvw_text_t *tx, size_t which, kvw_openai_err_t *e)
{
    json_t *root = kvw_openai_load(body, len, e);
    int rc;

    memset(r, 0, sizeof(*r));
    if (root == NULL)
        return -1;
    rc = kvw_openai_parse_doc(r, chat, root, tx, which, e);
    json_decref(root);
    return rc;
}

static int parse_doc(kvw_req_t *r, int chat, void *doc, const kvw_text_t *tx,
                     size_t which, kvw_openai_err_t *e);

/* A raw JSON copy of v (NULL: none), malloc'ed; *len its length. */
static char *raw_json(const json_t *v, size_t *len)
{
    char *s = v ? json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY) : NULL;

    *len = s ? strlen(s) : 0;
    return s;
}

/*
 * A Responses API body as the chat request vLLM makes of it: its messages
 * from `instructions` and `input` (kv_responses.h, as the router reads
 * them), `max_output_tokens` as max_tokens, and no `tools` (refused).
 */
static json_t *responses_as_chat(json_t *root, kvw_openai_err_t *e)
{
    json_t *input = json_object_get(root, "input"), *instr = json_object_get(root, "instructions");
    json_t *chat, *msgs, *v;
    char   *in_raw, *instr_raw, *m;
    size_t  in_len, instr_len, m_len;

    if (input == NULL) {
        kvw_openai_fail(e, 400, "invalid_request_error", "input", "missing_required_parameter",
                        "Missing required parameter: 'input'.");
        return NULL;
    }
    if (!json_is_string(input) && !json_is_array(input)) {
        bad_type(e, "input", "a string or a list of input items");
        return NULL;
    }
    if (instr && !json_is_null(instr) && !json_is_string(instr)) {
        bad_type(e, "instructions", "a string");
        return NULL;
    }
    v = json_object_get(root, "tools");
    if (v && json_is_array(v) && json_array_size(v) > 0) {
        unsupported(e, "tools", "serves the Responses API without tools");
        return NULL;
    }
    in_raw = raw_json(input, &in_len);
    instr_raw = json_is_string(instr) ? raw_json(instr, &instr_len) : NULL;
    m = in_raw ? kv_responses_messages(instr_raw, instr_raw ? instr_len : 0, in_raw, in_len,
                                       &m_len)
               : NULL;
    msgs = m ? json_loadb(m, m_len, JSON_ALLOW_NUL, NULL) : NULL;
    free(in_raw);
    free(instr_raw);
    free(m);
    if (msgs == NULL) {
        no_memory(e);
        return NULL;
    }
    chat = json_copy(root);
    json_object_del(chat, "input");
    json_object_del(chat, "instructions");
    json_object_del(chat, "tools");
    json_object_set_new(chat, "messages", msgs);
    v = json_object_get(root, "max_output_tokens");
    if (v) {
        json_object_set(chat, "max_tokens", v);
        json_object_del(chat, "max_output_tokens");
    }
    return chat;
}

/*
 * An Anthropic Messages API body as the chat request vLLM makes of it: its
 * system, messages and tools through kv_anthropic (as the router reads
 * them), `stop_sequences` as stop; tool_choice, thinking and metadata are
 * not read.
 */
static json_t *anthropic_as_chat(json_t *root, kvw_openai_err_t *e)
{
    json_t        *msgs = json_object_get(root, "messages"), *sys = json_object_get(root, "system");
    json_t        *tools = json_object_get(root, "tools"), *chat, *v;
    char          *m_raw, *s_raw = NULL, *t_raw = NULL, why[128];
    size_t         m_len, s_len = 0, t_len = 0;
    kv_anthropic_t a;
    int            rc;

    if (!json_is_array(msgs)) {
        bad_type(e, "messages", "a list of messages");
        return NULL;
    }
    if (sys && !json_is_null(sys) && !json_is_string(sys) && !json_is_array(sys)) {
        bad_type(e, "system", "a string or a list of text blocks");
        return NULL;
    }
    if (tools && !json_is_null(tools) && !json_is_array(tools)) {
        bad_type(e, "tools", "a list of tools");
        return NULL;
    }
    m_raw = raw_json(msgs, &m_len);
    if (sys && !json_is_null(sys))
        s_raw = raw_json(sys, &s_len);
    if (json_is_array(tools))
        t_raw = raw_json(tools, &t_len);
    rc = m_raw ? kv_anthropic_chat(s_raw, s_len, m_raw, m_len, t_raw, t_len, &a, why,
                                   sizeof(why))
               : -1;
    free(m_raw);
    free(s_raw);
    free(t_raw);
    if (rc != 0) {
        no_memory(e);
        return NULL;
    }
    chat = json_copy(root);
    v = json_loadb(a.messages, a.messages_len, JSON_ALLOW_NUL, NULL);
    json_object_set_new(chat, "messages", v ? v : json_array());
    json_object_del(chat, "tools");
    if (a.tools)
        json_object_set_new(chat, "tools", json_loadb(a.tools, a.tools_len, JSON_ALLOW_NUL, NULL));
    kv_anthropic_free(&a);
    json_object_del(chat, "system");
    json_object_del(chat, "tool_choice");
    v = json_object_get(root, "stop_sequences");
    if (v) {
        json_object_set(chat, "stop", v);
        json_object_del(chat, "stop_sequences");
    }
    return chat;
}

int kvw_openai_parse_doc(kvw_req_t *r, int chat, void *doc, const kvw_text_t *tx,
                         size_t which, kvw_openai_err_t *e)
{
    json_t *c;
    int     rc;

    if (chat != KVW_API_ANTHROPIC && chat != KVW_API_RESPONSES)
        return parse_doc(r, chat, doc, tx, which, e);
    /* rendered as the chat request vLLM makes of it */
    c = chat == KVW_API_ANTHROPIC ? anthropic_as_chat(doc, e) : responses_as_chat(doc, e);
    if (c == NULL) {
        memset(r, 0, sizeof(*r));
        return -1;
    }
    rc = parse_doc(r, KVW_API_CHAT, c, tx, which, e);
    json_decref(c);
    r->anthropic = chat == KVW_API_ANTHROPIC;
    r->responses = chat == KVW_API_RESPONSES;
    return rc;
}

static int parse_doc(kvw_req_t *r, int chat, void *doc, const kvw_text_t *tx,
                     size_t which, kvw_openai_err_t *e)
{
    json_t *root = doc, *v;
    json_int_t i;
    const char *max_name;

    memset(r, 0, sizeof(*r));
    r->chat = chat;
    r->max_tokens = KVW_MAX_TOKENS_DEFAULT;
    r->temperature = 1.0;
    r->top_p = 1.0;

    v = field(root, "model");
    if (v && !json_is_string(v)) {
        bad_type(e, "model", "a string");
        return -1;
    }
    if ((r->model = strdup(v ? json_string_value(v) : "")) == NULL) {
        no_memory(e);
        return -1;
    }
    if (get_bool(root, "stream", &r->stream, e) || get_bool(root, "ignore_eos", &r->ignore_eos, e))
        return -1;
    v = field(root, "stream_options");
    if (v && !json_is_object(v)) {
        bad_type(e, "stream_options", "an object");
        return -1;
    }
    if (v && get_bool(v, "include_usage", &r->include_usage, e)) {
        e->param = "stream_options.include_usage";
        return -1;
    }

    max_name = chat && field(root, "max_completion_tokens") ? "max_completion_tokens"
                                                            : "max_tokens";
    i = r->max_tokens;
    if (get_int(root, max_name, 1, 1000000, &i, e))
        return -1;
    r->max_tokens = (int)i;
    if (get_number(root, "temperature", 0, 2, &r->temperature, e)
        || get_number(root, "top_p", 0, 1, &r->top_p, e))
        return -1;
    if (r->top_p == 0)      /* as vLLM: 0 keeps no token (the sampler took it for "off") */
        return bad_value(e, "top_p", "a number in (0, 1]");
    i = r->top_k;
    if (get_int(root, "top_k", -1, 1 << 30, &i, e))
        return -1;
    r->top_k = (int)i;
    i = 0;
    if (get_int(root, "seed", INT64_MIN, INT64_MAX, &i, e))
        return -1;
    r->seed = (uint64_t)i;
    v = field(root, "cache_salt");
    if (v && !json_is_string(v)) {
        bad_type(e, "cache_salt", "a string");
        return -1;
    }
    if (v && (r->cache_salt = strdup(json_string_value(v))) == NULL) {
        no_memory(e);
        return -1;
    }
    if (refuse_unsupported(root, chat, e))
        return -1;

    if (parse_stop(json_object_get(root, "stop"), r, e))
        return -1;
    if (parse_prompt(root, r, chat, tx, which, e))
        return -1;
    return 0;
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

char *kvw_openai_error(const char *message, const char *type, const char *param,
                       const char *code)
{
    json_t *e = json_pack("{s:{s:s,s:s,s:s?,s:s?}}", "error", "message", message,
                          "type", type, "param", param, "code", code);
    char *s = json_dumps(e, JSON_COMPACT);
    json_decref(e);
    return s;
}

/* vLLM lists a LoRA adapter with its base model as "parent" */
static json_t *model_json(const char *id, const char *parent)
{
    return json_pack("{s:s,s:s,s:I,s:s,s:s?}", "id", id, "object", "model", "created",
                     (json_int_t)0, "owned_by", "kvroute", "parent", parent);
}

char *kvw_openai_model(const char *id, const char *parent)
{
    json_t *j = model_json(id, parent);
    char *s = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    return s;
}

char *kvw_openai_models(const char *id, const char *loras)
{
    json_t     *data = json_array(), *j;
    const char *p = loras, *lora;
    char        name[128];
    char       *s;
    size_t      n;

    json_array_append_new(data, model_json(id, NULL));
    while (kv_model_next(&p, &lora, &n)) {
        snprintf(name, sizeof(name), "%.*s", (int) n, lora);
        json_array_append_new(data, model_json(name, id));
    }
    j = json_pack("{s:s,s:o}", "object", "list", "data", data);
    s = json_dumps(j, JSON_COMPACT);
    json_decref(j);
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

/* A Response (the Responses API's object) with its one output message. */
static json_t *response_json(const kvw_req_t *r, const char *id, long created,
                             const char *raw, size_t len, const char *finish)
{
    char   *text = raw ? kv_utf8_clean(raw, len, &len) : NULL;
    char    msg_id[96];
    json_t *out = json_array(), *j;

    snprintf(msg_id, sizeof(msg_id), "msg_%s", id);
    if (finish) {
        json_array_append_new(out, json_pack(
            "{s:s,s:s,s:s,s:s,s:[{s:s,s:s%,s:[]}]}", "type", "message", "id", msg_id,
            "status", "completed", "role", "assistant", "content", "type", "output_text",
            "text", text ? text : "", text ? len : 0, "annotations"));
    }
    j = json_pack("{s:s,s:s,s:I,s:s,s:s,s:o,s:n}", "id", id, "object", "response",
                  "created_at", (json_int_t)created, "model", r->model,
                  "status", !finish ? "in_progress"
                            : strcmp(finish, "length") == 0 ? "incomplete" : "completed",
                  "output", out, "usage");
    if (finish) {
        json_object_set_new(j, "usage", json_pack(
            "{s:I,s:{s:I},s:I,s:{s:I},s:I}", "input_tokens", (json_int_t)r->n_prompt,
            "input_tokens_details", "cached_tokens", (json_int_t)r->cached_tokens,
            "output_tokens", (json_int_t)r->n_output, "output_tokens_details",
            "reasoning_tokens", (json_int_t)0, "total_tokens",
            (json_int_t)(r->n_prompt + r->n_output)));
    }
    if (finish && strcmp(finish, "length") == 0)
        json_object_set_new(j, "incomplete_details",
                            json_pack("{s:s}", "reason", "max_output_tokens"));
    free(text);
    return j;
}

char *kvw_openai_response_event(const kvw_req_t *r, const char *id, long created,
                                const char *text, size_t len, const char *finish)
{
    return dump(json_pack("{s:s,s:I,s:o}",
                          "type", finish ? "response.completed" : "response.created",
                          "sequence_number", (json_int_t)(finish ? r->n_output + 2 : 0),
                          "response", response_json(r, id, created, text, len, finish)));
}

char *kvw_openai_response_in_progress(const kvw_req_t *r, const char *id, long created)
{
    return dump(json_pack("{s:s,s:I,s:o}", "type", "response.in_progress", "sequence_number",
                          (json_int_t)1, "response",
                          response_json(r, id, created, NULL, 0, NULL)));
}

/* A Response's streamed text: one output_text delta event. */
static char *response_delta(const kvw_req_t *r, const char *id, const char *text, size_t len)
{
    char msg_id[96];

    snprintf(msg_id, sizeof(msg_id), "msg_%s", id);
    return dump(json_pack("{s:s,s:I,s:s,s:i,s:i,s:s%,s:[]}",
                          "type", "response.output_text.delta",
                          "sequence_number", (json_int_t)r->n_output + 1, "item_id", msg_id,
                          "output_index", 0, "content_index", 0,
                          "delta", text ? text : "", text ? len : 0, "logprobs"));
}

/* An Anthropic message's stop reason for a finish */
static const char *stop_reason(const char *finish)
{
    return strcmp(finish, "length") == 0 ? "max_tokens" : "end_turn";
}

/* An Anthropic message (non-streamed), or the one message_start carries. */
static json_t *message_json(const kvw_req_t *r, const char *id, const char *raw, size_t len,
                            const char *finish)
{
    char   *text = raw ? kv_utf8_clean(raw, len, &len) : NULL;
    json_t *content = json_array();

    if (finish)
        json_array_append_new(content, json_pack("{s:s,s:s%}", "type", "text",
                                                 "text", text ? text : "", text ? len : 0));
    free(text);
    return json_pack("{s:s,s:s,s:s,s:s,s:o,s:s?,s:n,s:{s:I,s:I,s:I,s:I}}", "id", id,
                     "type", "message", "role", "assistant", "model", r->model,
                     "content", content, "stop_reason", finish ? stop_reason(finish) : NULL,
                     "stop_sequence", "usage", "input_tokens", (json_int_t)r->n_prompt,
                     "output_tokens", (json_int_t)(finish ? r->n_output : 0),
                     "cache_read_input_tokens", (json_int_t)r->cached_tokens,
                     "cache_creation_input_tokens", (json_int_t)0);
}

/* *acc with "event: NAME\ndata: JSON\n\n" appended; *acc NULL once out of
 * memory (and stays so) */
static void add_event(char **acc, const char *name, json_t *data)
{
    char *s = dump(data), *out = NULL;

    if (*acc && s && asprintf(&out, "%sevent: %s\ndata: %s\n\n", *acc, name, s) < 0)
        out = NULL;
    free(s);
    free(*acc);
    *acc = out;
}

char *kvw_openai_message_events(const kvw_req_t *r, const char *id, const char *finish)
{
    char *ev = strdup("");

    if (finish == NULL) {
        add_event(&ev, "message_start", json_pack("{s:s,s:o}", "type", "message_start", "message",
                                                  message_json(r, id, NULL, 0, NULL)));
        add_event(&ev, "content_block_start",
                  json_pack("{s:s,s:i,s:{s:s,s:s}}", "type", "content_block_start", "index", 0,
                            "content_block", "type", "text", "text", ""));
    } else if (strcmp(finish, "abort") == 0) {
        add_event(&ev, "error", json_pack("{s:s,s:{s:s,s:s}}", "type", "error", "error", "type",
                                          "api_error", "message",
                                          "the engine aborted the request"));
    } else {
        add_event(&ev, "content_block_stop",
                  json_pack("{s:s,s:i}", "type", "content_block_stop", "index", 0));
        add_event(&ev, "message_delta",
                  json_pack("{s:s,s:{s:s,s:n},s:{s:I}}", "type", "message_delta", "delta",
                            "stop_reason", stop_reason(finish), "stop_sequence", "usage",
                            "output_tokens", (json_int_t)r->n_output));
        add_event(&ev, "message_stop", json_pack("{s:s}", "type", "message_stop"));
    }
    return ev;
}

char *kvw_openai_chunk(const kvw_req_t *r, const char *id, long created,
                       const char *text, size_t len, const char *finish)
{
    json_t *choice;
    char *clean, *out;

    if (r->anthropic) {     /* its end is kvw_openai_message_events' */
        if (finish)
            return NULL;
        clean = text ? kv_utf8_clean(text, len, &len) : NULL;
        out = dump(json_pack("{s:s,s:i,s:{s:s,s:s%}}", "type", "content_block_delta", "index",
                             0, "delta", "type", "text_delta", "text", clean ? clean : "",
                             clean ? len : 0));
        free(clean);
        return out;
    }

    if (r->responses) {
        if (finish)
            return NULL;
        clean = text ? kv_utf8_clean(text, len, &len) : NULL;
        out = response_delta(r, id, clean, len);
        free(clean);
        return out;
    }
    clean = text ? kv_utf8_clean(text, len, &len) : NULL;
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
    json_t *choices;
    kvw_req_t sum = *rs[0];

    if (rs[0]->responses)       /* one input, one output */
        return dump(response_json(rs[0], id, created, texts[0], lens[0], finishes[0]));
    if (rs[0]->anthropic)
        return dump(message_json(rs[0], id, texts[0], lens[0], finishes[0]));
    choices = json_array();

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
