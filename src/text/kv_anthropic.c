/*
 * Anthropic Messages API requests as OpenAI chat requests (kv_anthropic.h).
 * Built on the chat renderer's own values (kv_jinja.h): the blocks are
 * rearranged (tool results move out of their message, system text is
 * joined), which raw spans cannot express, and every value is read as
 * Python's json reads it (an integer past 64 bits too), which jansson
 * cannot do.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_anthropic.h"
#include "kv_chat_int.h"
#include "kv_jinja.h"

#define BILLING "x-anthropic-billing-header"
#define NO_MEMORY "out of memory"           /* the reason kv_body.c fails a body for */

/* o[k] when it is a string, else NULL */
static const jj_value *str_at(jj_value o, const char *k)
{
    const jj_value *v = kv_chat_get(o, k);
    return v && v->kind == JV_STR ? v : NULL;
}

/* o[k] when it is a non-empty string (Python's truth), else NULL */
static const jj_value *text_at(jj_value o, const char *k)
{
    const jj_value *v = str_at(o, k);
    return v && v->u.str.n ? v : NULL;
}

static int is_type(jj_value block, const char *type)
{
    const jj_value *t = str_at(block, "type");
    return t && jv_is_str(*t, type);
}

/* o[k], or None when absent */
static jj_value or_none(jj_value o, const char *k)
{
    const jj_value *v = kv_chat_get(o, k);
    return v ? *v : jv_none();
}

/* s when it is a string, else "" */
static jj_value string_or_empty(const jj_value *s)
{
    return s && s->kind == JV_STR ? *s : jv_cstr("");
}

static size_t list_len(jj_value l)
{
    return l.kind == JV_LIST ? l.u.list->n : 0;
}

static jj_value list_at(jj_value l, size_t i)
{
    return l.u.list->items[i];
}

/* A new list or dict in *out; -1 when the arena is out of room. */
static int new_list(jj_arena *a, jj_value *out)
{
    *out = jv_new_list(a, 4);
    return out->kind == JV_LIST ? 0 : -1;
}

static int new_dict(jj_arena *a, jj_value *out)
{
    *out = jv_new_dict(a, 4);
    return out->kind == JV_DICT ? 0 : -1;
}

/* A dict of the given keys and values (NULL-terminated keys). */
static int dict_of(jj_arena *a, jj_value *out, const char *const *keys, const jj_value *vals)
{
    if (new_dict(a, out) != 0) {
        return -1;
    }
    for (size_t i = 0; keys[i]; i++) {
        kv_chat_set(a, *out, keys[i], vals[i]);
    }
    return a->failed ? -1 : 0;
}

/* sep.join(parts) (parts: strings; NUL bytes kept) as a string in a */
static int joined(jj_arena *a, jj_value parts, const char *sep, jj_value *out)
{
    size_t n = 0, m = strlen(sep), i, k = list_len(parts);
    char  *buf;

    for (i = 0; i < k; i++) {
        n += list_at(parts, i).u.str.n + (i ? m : 0);
    }
    buf = jj_alloc(a, n + 1);
    if (buf == NULL) {
        return -1;
    }
    n = 0;
    for (i = 0; i < k; i++) {
        if (i) {
            memcpy(buf + n, sep, m);
            n += m;
        }
        memcpy(buf + n, list_at(parts, i).u.str.s, list_at(parts, i).u.str.n);
        n += list_at(parts, i).u.str.n;
    }
    buf[n] = '\0';
    *out = jv_strn(buf, n);
    return 0;
}

/* pre followed by the string s, in a */
static int prefixed(jj_arena *a, const char *pre, jj_value s, jj_value *out)
{
    jj_value parts;

    if (new_list(a, &parts) != 0) {
        return -1;
    }
    jv_list_push(a, parts, jv_cstr(pre));
    jv_list_push(a, parts, s);
    return a->failed ? -1 : joined(a, parts, "", out);
}

/* {"type": "text", "text": text} */
static int text_part(jj_arena *a, jj_value text, jj_value *out)
{
    static const char *const keys[] = { "type", "text", NULL };
    jj_value vals[] = { jv_cstr("text"), text };

    return dict_of(a, out, keys, vals);
}

/* The text of a system value or a system message's content: a string
 * whole, text blocks but the billing header's. */
static void system_blocks(jj_arena *a, jj_value v, jj_value parts)
{
    const jj_value *text;
    jj_value        block;

    if (v.kind == JV_STR) {
        jv_list_push(a, parts, v);
        return;
    }
    for (size_t i = 0; i < list_len(v); i++) {
        block = list_at(v, i);
        text = text_at(block, "text");
        if (is_type(block, "text") && text
            && !(text->u.str.n >= sizeof(BILLING) - 1
                 && memcmp(text->u.str.s, BILLING, sizeof(BILLING) - 1) == 0))
        {
            jv_list_push(a, parts, *text);
        }
    }
}

/* One system message from `system` and the system-role messages. */
static int system_message(jj_arena *a, jj_value system, jj_value msgs, jj_value out)
{
    static const char *const keys[] = { "role", "content", NULL };
    const jj_value *role;
    jj_value        parts, vals[2], msg;

    if (new_list(a, &parts) != 0) {
        return -1;
    }
    /* `if request.system:` an empty string or list adds nothing */
    if ((system.kind == JV_STR && system.u.str.n) || list_len(system)) {
        system_blocks(a, system, parts);
    }
    for (size_t i = 0; i < list_len(msgs); i++) {
        role = str_at(list_at(msgs, i), "role");
        if (role && jv_is_str(*role, "system")) {
            system_blocks(a, or_none(list_at(msgs, i), "content"), parts);
        }
    }
    if (a->failed || list_len(parts) == 0) {
        return a->failed ? -1 : 0;
    }
    vals[0] = jv_cstr("system");
    if (joined(a, parts, "", &vals[1]) != 0 || dict_of(a, &msg, keys, vals) != 0) {
        return -1;
    }
    jv_list_push(a, out, msg);
    return a->failed ? -1 : 0;
}

/* An image block's source as a URL: a url, or a data URI of base64 data. */
static int image_url(jj_arena *a, jj_value source, jj_value *out)
{
    const jj_value *type = str_at(source, "type"), *media, *data;
    jj_value        parts;

    if (type && jv_is_str(*type, "url")) {
        *out = string_or_empty(str_at(source, "url"));
        return 0;
    }
    media = str_at(source, "media_type");
    data = str_at(source, "data");
    if (new_list(a, &parts) != 0) {
        return -1;
    }
    jv_list_push(a, parts, jv_cstr("data:"));
    jv_list_push(a, parts, media ? *media : jv_cstr("image/jpeg"));
    jv_list_push(a, parts, jv_cstr(";base64,"));
    jv_list_push(a, parts, string_or_empty(data));
    return a->failed ? -1 : joined(a, parts, "", out);
}

/* {"type": "image_url", "image_url": {"url": ...}} */
static int image_part(jj_arena *a, jj_value source, jj_value *out)
{
    static const char *const url_key[] = { "url", NULL };
    static const char *const keys[] = { "type", "image_url", NULL };
    jj_value        url, vals[2];

    if (image_url(a, source, &url) != 0 || dict_of(a, &vals[1], url_key, &url) != 0) {
        return -1;
    }
    vals[0] = jv_cstr("image_url");
    return dict_of(a, out, keys, vals);
}

/* JSON text of v as Python's json.dumps writes it (separators ", ", ": "),
 * in a; -1 for a value JSON cannot hold or no memory */
static int dumps(jj_arena *a, jj_value v, jj_value *out)
{
    jj_buf b = { 0 };
    char  *s;
    int    rc = jv_write_json(&b, v, -1, ", ", ": ", 0, 0);

    s = rc == 0 && !b.oom ? jj_alloc(a, b.n + 1) : NULL;
    if (s != NULL) {
        memcpy(s, b.p, b.n);
        s[b.n] = '\0';
        *out = jv_strn(s, b.n);
    }
    free(b.p);
    return s ? 0 : -1;
}

/* tool_use: {"id", "type": "function", "function": {"name", "arguments"}},
 * arguments json.dumps(input or {}) */
static int tool_call(jj_arena *a, jj_value block, jj_value *out)
{
    static const char *const fn_keys[] = { "name", "arguments", NULL };
    static const char *const keys[] = { "id", "type", "function", NULL };
    const jj_value *input = kv_chat_get(block, "input");
    jj_value        fn[2], vals[3];

    fn[0] = string_or_empty(str_at(block, "name"));
    /* `input or {}`; what is not an object the chat path reads as {} too */
    if (input == NULL || input->kind != JV_DICT || input->u.dict->n == 0) {
        fn[1] = jv_cstr("{}");
    } else if (dumps(a, *input, &fn[1]) != 0) {
        return -1;
    }
    vals[0] = string_or_empty(str_at(block, "id"));
    vals[1] = jv_cstr("function");
    return dict_of(a, &vals[2], fn_keys, fn) != 0 ? -1 : dict_of(a, out, keys, vals);
}

/* A user's tool_result: a tool message (text items joined with "\n"), and
 * its images as a user message after it, appended to out now. */
static int tool_result(jj_arena *a, jj_value block, jj_value out)
{
    static const char *const tool_keys[] = { "role", "tool_call_id", "content", NULL };
    static const char *const user_keys[] = { "role", "content", NULL };
    jj_value        content = or_none(block, "content"), item, part, parts, images, msg[3];

    if (new_list(a, &parts) != 0 || new_list(a, &images) != 0) {
        return -1;
    }
    if (content.kind == JV_STR) {
        jv_list_push(a, parts, content);
    }
    for (size_t i = 0; i < list_len(content); i++) {
        item = list_at(content, i);
        if (is_type(item, "text")) {
            jv_list_push(a, parts, string_or_empty(str_at(item, "text")));
        } else if (is_type(item, "image")) {
            if (image_part(a, or_none(item, "source"), &part) != 0) {
                return -1;
            }
            jv_list_push(a, images, part);
        }
    }
    msg[0] = jv_cstr("tool");
    msg[1] = string_or_empty(str_at(block, "tool_use_id"));
    if (a->failed || joined(a, parts, "\n", &msg[2]) != 0 || dict_of(a, &part, tool_keys, msg))
    {
        return -1;
    }
    jv_list_push(a, out, part);
    if (list_len(images)) {
        msg[0] = jv_cstr("user");
        msg[1] = images;
        if (dict_of(a, &part, user_keys, msg) != 0) {
            return -1;
        }
        jv_list_push(a, out, part);
    }
    return a->failed ? -1 : 0;
}

/* One block of a message's content into its parts, calls and reasoning. */
static int block_of(jj_arena *a, jj_value block, int user, jj_value parts, jj_value calls,
                    jj_value reasoning, jj_value out)
{
    const jj_value *v;
    jj_value        item, text;

    if (is_type(block, "text") && (v = text_at(block, "text"))) {
        if (text_part(a, *v, &item) != 0) {
            return -1;
        }
        jv_list_push(a, parts, item);
    } else if (is_type(block, "image") && (v = kv_chat_get(block, "source"))
               && v->kind == JV_DICT && v->u.dict->n)
    {
        if (image_part(a, *v, &item) != 0) {
            return -1;
        }
        jv_list_push(a, parts, item);
    } else if (is_type(block, "thinking") && (v = str_at(block, "thinking"))) {
        jv_list_push(a, reasoning, *v);
    } else if (is_type(block, "tool_use")) {
        if (tool_call(a, block, &item) != 0) {
            return -1;
        }
        jv_list_push(a, calls, item);
    } else if (is_type(block, "tool_result") && user) {
        return tool_result(a, block, out);
    } else if (is_type(block, "tool_result") && (v = str_at(block, "content"))) {
        if (prefixed(a, "Tool result: ", *v, &text) != 0 || text_part(a, text, &item) != 0) {
            return -1;
        }
        jv_list_push(a, parts, item);
    }
    /* redacted_thinking, tool_reference, unknown: nothing */
    return a->failed ? -1 : 0;
}

/* A message with block content: its parts, then reasoning, calls, content. */
static int block_message(jj_arena *a, jj_value m, jj_value role, jj_value out)
{
    jj_value content = or_none(m, "content"), msg, parts, calls, reasoning, text;
    int      user = jv_is_str(role, "user");

    if (new_dict(a, &msg) != 0 || new_list(a, &parts) != 0 || new_list(a, &calls) != 0
        || new_list(a, &reasoning) != 0)
    {
        return -1;
    }
    kv_chat_set(a, msg, "role", role);
    for (size_t i = 0; i < list_len(content); i++) {
        if (list_at(content, i).kind == JV_DICT
            && block_of(a, list_at(content, i), user, parts, calls, reasoning, out) != 0)
        {
            return -1;
        }
    }
    if (list_len(reasoning)) {
        if (joined(a, reasoning, "", &text) != 0) {
            return -1;
        }
        kv_chat_set(a, msg, "reasoning", text);
    }
    if (list_len(calls)) {
        kv_chat_set(a, msg, "tool_calls", calls);
    }
    if (list_len(parts) == 1 && is_type(list_at(parts, 0), "text")) {
        kv_chat_set(a, msg, "content", *kv_chat_get(list_at(parts, 0), "text"));
    } else if (list_len(parts)) {
        kv_chat_set(a, msg, "content", parts);
    }
    /* a user message whose blocks all moved out (tool results) is dropped */
    if (!(user && kv_chat_get(msg, "content") == NULL)) {
        jv_list_push(a, out, msg);
    }
    return a->failed ? -1 : 0;
}

static int convert_messages(jj_arena *a, jj_value msgs, jj_value out)
{
    static const char *const keys[] = { "role", "content", NULL };
    const jj_value *role;
    jj_value        m, vals[2], msg;

    for (size_t i = 0; i < list_len(msgs); i++) {
        m = list_at(msgs, i);
        role = str_at(m, "role");
        if (role == NULL || jv_is_str(*role, "system")) {
            continue;
        }
        vals[0] = *role;
        vals[1] = or_none(m, "content");
        if (vals[1].kind == JV_LIST) {
            if (block_message(a, m, *role, out) != 0) {
                return -1;
            }
        } else if (dict_of(a, &msg, keys, vals) != 0) {
            return -1;
        } else {
            jv_list_push(a, out, msg);
        }
    }
    return a->failed ? -1 : 0;
}

/* {"type": "function", "function": {name, description, parameters}} each */
static int convert_tools(jj_arena *a, jj_value tools, jj_value *out)
{
    static const char *const fn_keys[] = { "name", "description", "parameters", NULL };
    static const char *const keys[] = { "type", "function", NULL };
    jj_value        t, fn[3], vals[2], tool;
    const jj_value *v;

    if (new_list(a, out) != 0) {
        return -1;
    }
    for (size_t i = 0; i < list_len(tools); i++) {
        t = list_at(tools, i);
        fn[0] = or_none(t, "name");
        fn[1] = or_none(t, "description");
        fn[2] = or_none(t, "input_schema");
        vals[0] = jv_cstr("function");
        if (dict_of(a, &vals[1], fn_keys, fn) != 0) {
            return -1;
        }
        if ((v = kv_chat_get(t, "defer_loading")) != NULL) {
            kv_chat_set(a, vals[1], "defer_loading", *v);
        }
        if (dict_of(a, &tool, keys, vals) != 0) {
            return -1;
        }
        jv_list_push(a, *out, tool);
    }
    return a->failed ? -1 : 0;
}

/* v as compact JSON text (malloc'ed) in *s, *n; -1 when it cannot be */
static int write_compact(jj_value v, char **s, size_t *n)
{
    jj_buf b = { 0 };

    if (jv_write_json(&b, v, -1, ",", ":", 0, 0) != 0 || (jj_buf_putc(&b, '\0'), b.oom)) {
        free(b.p);
        return -1;
    }
    *s = b.p;
    *n = b.n - 1;
    return 0;
}

int kv_anthropic_chat(const char *system, size_t system_len, const char *messages,
                      size_t messages_len, const char *tools, size_t tools_len,
                      kv_anthropic_t *out, char *err, size_t errlen)
{
    jj_arena         a = { 0 };
    kv_chat_holds_t  h = { 0 };
    jj_value         sys, msgs, tl, chat, ctools;
    char             why[128];
    int              rc = -1;

    memset(out, 0, sizeof(*out));
    if (kv_chat_parse_held(&a, &h, system, system_len, &sys, why, sizeof(why)) != 0
        || kv_chat_parse_held(&a, &h, messages, messages_len, &msgs, why, sizeof(why)) != 0
        || kv_chat_parse_held(&a, &h, tools, tools_len, &tl, why, sizeof(why)) != 0)
    {
        snprintf(err, errlen, "%s%s", strcmp(why, NO_MEMORY) ? "anthropic request: " : "", why);
        goto done;
    }
    snprintf(err, errlen, "%s",
             a.failed == JJ_ARENA_OVER ? "anthropic request: too large to convert" : NO_MEMORY);
    if (a.failed || new_list(&a, &chat) != 0 || system_message(&a, sys, msgs, chat) != 0
        || convert_messages(&a, msgs, chat) != 0
        || (tl.kind == JV_LIST && convert_tools(&a, tl, &ctools) != 0))
    {
        goto done;
    }
    snprintf(err, errlen, NO_MEMORY);
    if (write_compact(chat, &out->messages, &out->messages_len) != 0
        || (tl.kind == JV_LIST && write_compact(ctools, &out->tools, &out->tools_len) != 0))
    {
        kv_anthropic_free(out);
        goto done;
    }
    rc = 0;
done:
    kv_chat_holds_free(&h);
    jj_arena_free(&a);
    return rc;
}

void kv_anthropic_free(kv_anthropic_t *a)
{
    free(a->messages);
    free(a->tools);
    memset(a, 0, sizeof(*a));
}
