/*
 * Anthropic Messages API requests as OpenAI chat requests (kv_anthropic.h).
 * Built with jansson: the blocks are rearranged (tool results move out of
 * their message, system text is joined), which raw spans cannot express.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "kv_anthropic.h"

#define BILLING "x-anthropic-billing-header"

/* o[k] when it is a string, else NULL */
static json_t *str_at(json_t *o, const char *k)
{
    json_t *v = json_object_get(o, k);
    return json_is_string(v) ? v : NULL;
}

/* o[k] when it is a non-empty string (Python's truth), else NULL */
static json_t *text_at(json_t *o, const char *k)
{
    json_t *v = str_at(o, k);
    return v && json_string_length(v) ? v : NULL;
}

static int is_type(json_t *block, const char *type)
{
    json_t *t = str_at(block, "type");
    return t && strcmp(json_string_value(t), type) == 0;
}

/* s (a string) or "" when it is not one */
static json_t *string_or_empty(json_t *s)
{
    return json_is_string(s) ? json_incref(s) : json_string("");
}

/* The text of a system value or a system message's content: a string
 * whole, text blocks but the billing header's. */
static int system_blocks(json_t *v, json_t *parts)
{
    size_t  i;
    json_t *block, *text;

    if (json_is_string(v)) {
        return json_array_append(parts, v);
    }
    json_array_foreach(v, i, block) {
        text = text_at(block, "text");
        if (is_type(block, "text") && text
            && strncmp(json_string_value(text), BILLING, sizeof(BILLING) - 1) != 0)
        {
            if (json_array_append(parts, text) != 0) {
                return -1;
            }
        }
    }
    return 0;
}

/* "".join(parts) as a JSON string (NUL bytes kept) */
static json_t *joined(json_t *parts)
{
    size_t  i, n = 0;
    json_t *p, *s;
    char   *buf;

    json_array_foreach(parts, i, p) {
        n += json_string_length(p);
    }
    buf = malloc(n + 1);
    if (buf == NULL) {
        return NULL;
    }
    n = 0;
    json_array_foreach(parts, i, p) {
        memcpy(buf + n, json_string_value(p), json_string_length(p));
        n += json_string_length(p);
    }
    s = json_stringn_nocheck(buf, n);
    free(buf);
    return s;
}

/* pre followed by the string s, as a new JSON string */
static json_t *prefixed(const char *pre, json_t *s)
{
    size_t  n = strlen(pre), m = json_string_length(s);
    char   *buf = malloc(n + m + 1);
    json_t *out;

    if (buf == NULL) {
        return NULL;
    }
    memcpy(buf, pre, n);
    memcpy(buf + n, json_string_value(s), m);
    out = json_stringn_nocheck(buf, n + m);
    free(buf);
    return out;
}

/* One system message from `system` and the system-role messages. */
static int system_message(json_t *system, json_t *msgs, json_t *out)
{
    json_t *parts = json_array(), *m, *content;
    size_t  i;
    int     rc = 0;

    if (parts == NULL) {
        return -1;
    }
    /* `if request.system:` an empty string or list adds nothing */
    if ((json_is_string(system) && json_string_length(system))
        || (json_is_array(system) && json_array_size(system)))
    {
        rc = system_blocks(system, parts);
    }
    json_array_foreach(msgs, i, m) {
        json_t *role = str_at(m, "role");
        if (rc == 0 && role && strcmp(json_string_value(role), "system") == 0) {
            content = json_object_get(m, "content");
            rc = system_blocks(content, parts);
        }
    }
    if (rc == 0 && json_array_size(parts)) {
        json_t *text = joined(parts);
        rc = text ? json_array_append_new(out, json_pack("{s:s,s:o}", "role", "system",
                                                         "content", text))
                  : -1;
    }
    json_decref(parts);
    return rc;
}

/* An image block's source as a URL: a url, or a data URI of base64 data. */
static json_t *image_url(json_t *source)
{
    json_t *type = str_at(source, "type"), *url, *media, *data;
    char   *buf;
    json_t *s;
    size_t  n;

    if (type && strcmp(json_string_value(type), "url") == 0) {
        url = str_at(source, "url");
        return url ? json_incref(url) : json_string("");
    }
    media = str_at(source, "media_type");
    data = str_at(source, "data");
    n = 32 + (media ? json_string_length(media) : 10) + (data ? json_string_length(data) : 0);
    buf = malloc(n);
    if (buf == NULL) {
        return NULL;
    }
    n = (size_t) snprintf(buf, n, "data:%s;base64,%s",
                          media ? json_string_value(media) : "image/jpeg",
                          data ? json_string_value(data) : "");
    s = json_stringn_nocheck(buf, n);
    free(buf);
    return s;
}

static json_t *image_part(json_t *source)
{
    json_t *url = image_url(source);
    return url ? json_pack("{s:s,s:{s:o}}", "type", "image_url", "image_url", "url", url) : NULL;
}

/* tool_use: {"id", "type": "function", "function": {"name", "arguments"}},
 * arguments the JSON text of `input` (or of {}) */
static json_t *tool_call(json_t *block)
{
    json_t *input = json_object_get(block, "input"), *id = str_at(block, "id");
    json_t *name = str_at(block, "name");
    char   *args;
    json_t *call;

    /* `input or {}`; what is not an object the chat path reads as {} too */
    if (!json_is_object(input) || json_object_size(input) == 0) {
        args = strdup("{}");
    } else {
        args = json_dumps(input, JSON_COMPACT | JSON_ENCODE_ANY);
    }
    if (args == NULL) {
        return NULL;
    }
    call = json_pack("{s:o,s:s,s:{s:o,s:s}}", "id", string_or_empty(id), "type", "function",
                     "function", "name", string_or_empty(name), "arguments", args);
    free(args);
    return call;
}

/* A user's tool_result: a tool message (text items joined with "\n"), and
 * its images as a user message after it, appended to out now. */
static int tool_result(json_t *block, json_t *out)
{
    json_t *content = json_object_get(block, "content"), *item, *text, *images, *id;
    json_t *parts = json_array();
    size_t  i;
    int     rc = 0;

    images = json_array();
    if (parts == NULL || images == NULL) {
        json_decref(parts);
        json_decref(images);
        return -1;
    }
    if (json_is_string(content)) {
        rc = json_array_append(parts, content);
    }
    json_array_foreach(json_is_array(content) ? content : NULL, i, item) {
        if (is_type(item, "text")) {
            text = str_at(item, "text");
            rc |= json_array_append_new(parts, text ? json_incref(text) : json_string(""));
        } else if (is_type(item, "image")) {
            json_t *source = json_object_get(item, "source");
            json_t *part = image_part(json_is_object(source) ? source : NULL);
            rc |= part ? json_array_append_new(images, part) : -1;
        }
    }
    for (i = json_array_size(parts); rc == 0 && i > 1; i--) {
        rc = json_array_insert_new(parts, i - 1, json_string("\n"));
    }
    id = str_at(block, "tool_use_id");
    text = rc == 0 ? joined(parts) : NULL;
    rc = text ? json_array_append_new(out, json_pack("{s:s,s:o,s:o}", "role", "tool",
                                                     "tool_call_id", string_or_empty(id),
                                                     "content", text))
              : -1;
    if (rc == 0 && json_array_size(images)) {
        rc = json_array_append_new(out, json_pack("{s:s,s:O}", "role", "user", "content",
                                                  images));
    }
    json_decref(parts);
    json_decref(images);
    return rc;
}

/* One block of a message's content into its parts, calls and reasoning. */
static int block_of(json_t *block, int user, json_t *parts, json_t *calls, json_t *reasoning,
                    json_t *out)
{
    json_t *v;

    if (is_type(block, "text") && (v = text_at(block, "text"))) {
        return json_array_append_new(parts, json_pack("{s:s,s:O}", "type", "text", "text", v));
    }
    if (is_type(block, "image") && json_is_object(v = json_object_get(block, "source"))
        && json_object_size(v))
    {
        json_t *part = image_part(v);
        return part ? json_array_append_new(parts, part) : -1;
    }
    if (is_type(block, "thinking") && (v = str_at(block, "thinking"))) {
        return json_array_append(reasoning, v);
    }
    if (is_type(block, "tool_use")) {
        json_t *call = tool_call(block);
        return call ? json_array_append_new(calls, call) : -1;
    }
    if (is_type(block, "tool_result") && user) {
        return tool_result(block, out);
    }
    if (is_type(block, "tool_result") && (v = str_at(block, "content"))) {
        json_t *text = prefixed("Tool result: ", v);
        return text ? json_array_append_new(parts, json_pack("{s:s,s:o}", "type", "text",
                                                             "text", text))
                    : -1;
    }
    return 0;           /* redacted_thinking, tool_reference, unknown: nothing */
}

/* A message with block content: its parts, then reasoning, calls, content. */
static int block_message(json_t *m, json_t *role, json_t *out)
{
    json_t *content = json_object_get(m, "content"), *msg, *block, *parts, *calls, *reasoning;
    size_t  i;
    int     rc = 0, user = strcmp(json_string_value(role), "user") == 0;

    msg = json_pack("{s:O}", "role", role);
    parts = json_array();
    calls = json_array();
    reasoning = json_array();
    if (msg == NULL || parts == NULL || calls == NULL || reasoning == NULL) {
        rc = -1;
    }
    json_array_foreach(content, i, block) {
        if (rc == 0 && json_is_object(block)) {
            rc = block_of(block, user, parts, calls, reasoning, out);
        }
    }
    if (rc == 0 && json_array_size(reasoning)) {
        json_t *text = joined(reasoning);
        rc = text ? json_object_set_new(msg, "reasoning", text) : -1;
    }
    if (rc == 0 && json_array_size(calls)) {
        rc = json_object_set(msg, "tool_calls", calls);
    }
    if (rc == 0 && json_array_size(parts) == 1 && is_type(json_array_get(parts, 0), "text")) {
        rc = json_object_set(msg, "content", json_object_get(json_array_get(parts, 0), "text"));
    } else if (rc == 0 && json_array_size(parts)) {
        rc = json_object_set(msg, "content", parts);
    }
    /* a user message whose blocks all moved out (tool results) is dropped */
    if (rc == 0 && !(user && json_object_get(msg, "content") == NULL)) {
        rc = json_array_append(out, msg);
    }
    json_decref(msg);
    json_decref(parts);
    json_decref(calls);
    json_decref(reasoning);
    return rc;
}

static int convert_messages(json_t *msgs, json_t *out)
{
    json_t *m, *role, *content;
    size_t  i;
    int     rc = 0;

    json_array_foreach(msgs, i, m) {
        role = str_at(m, "role");
        if (rc != 0 || role == NULL || strcmp(json_string_value(role), "system") == 0) {
            continue;
        }
        content = json_object_get(m, "content");
        if (json_is_array(content)) {
            rc = block_message(m, role, out);
        } else {
            rc = json_array_append_new(out, json_pack("{s:O,s:O}", "role", role, "content",
                                                      content ? content : json_null()));
        }
    }
    return rc;
}

/* o[k], or null when absent */
static json_t *or_null(json_t *o, const char *k)
{
    json_t *v = json_object_get(o, k);
    return v ? v : json_null();
}

static json_t *convert_tools(json_t *tools)
{
    json_t *out = json_array(), *t, *fn, *v;
    size_t  i;

    json_array_foreach(tools, i, t) {
        fn = json_pack("{s:O,s:O,s:O}", "name", or_null(t, "name"), "description",
                       or_null(t, "description"), "parameters", or_null(t, "input_schema"));
        if (fn && (v = json_object_get(t, "defer_loading"))) {
            json_object_set(fn, "defer_loading", v);
        }
        if (out == NULL || fn == NULL
            || json_array_append_new(out, json_pack("{s:s,s:o}", "type", "function",
                                                    "function", fn)) != 0)
        {
            json_decref(out);
            return NULL;
        }
    }
    return out;
}

static json_t *load(const char *s, size_t n, char *err, size_t errlen)
{
    json_error_t jerr;
    json_t      *v = json_loadb(s, n, JSON_DECODE_ANY | JSON_ALLOW_NUL, &jerr);

    if (v == NULL) {
        snprintf(err, errlen, "anthropic request: %s", jerr.text);
    }
    return v;
}

int kv_anthropic_chat(const char *system, size_t system_len, const char *messages,
                      size_t messages_len, const char *tools, size_t tools_len,
                      kv_anthropic_t *out, char *err, size_t errlen)
{
    json_t *sys = NULL, *msgs, *tl = NULL, *chat = NULL, *ctools = NULL;
    int     rc = -1;

    memset(out, 0, sizeof(*out));
    msgs = load(messages, messages_len, err, errlen);
    if (msgs == NULL || (system && (sys = load(system, system_len, err, errlen)) == NULL)
        || (tools && (tl = load(tools, tools_len, err, errlen)) == NULL))
    {
        goto done;
    }
    snprintf(err, errlen, "out of memory");
    chat = json_array();
    if (chat == NULL || system_message(sys, msgs, chat) != 0 || convert_messages(msgs, chat) != 0
        || (json_is_array(tl) && (ctools = convert_tools(tl)) == NULL))
    {
        goto done;
    }
    out->messages = json_dumps(chat, JSON_COMPACT);
    out->tools = ctools ? json_dumps(ctools, JSON_COMPACT) : NULL;
    if (out->messages == NULL || (ctools && out->tools == NULL)) {
        kv_anthropic_free(out);
        goto done;
    }
    out->messages_len = strlen(out->messages);
    out->tools_len = out->tools ? strlen(out->tools) : 0;
    rc = 0;
done:
    json_decref(sys);
    json_decref(msgs);
    json_decref(tl);
    json_decref(chat);
    json_decref(ctools);
    return rc;
}

void kv_anthropic_free(kv_anthropic_t *a)
{
    free(a->messages);
    free(a->tools);
    memset(a, 0, sizeof(*a));
}
