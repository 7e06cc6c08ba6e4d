/*
 * A chat request as SGLang's OpenAI server hands it to the template
 * (kvroute ... chat_engine=sglang), from its serving_chat.py and
 * protocol.py:
 *
 *   - each message is its pydantic model's dump with null members dropped:
 *     a user message is {role, content}; the others {role, content,
 *     tool_call_id, name, reasoning_content, tool_calls}, and each call
 *     {id, index, type, function: {name, arguments}}; null content is "";
 *     a list of parts becomes its text parts joined with " " unless the
 *     template loops over content (then image parts become {"type":
 *     "image"}); a call's arguments given as JSON text are parsed (text
 *     that is not JSON: SGLang refuses the request);
 *   - tools are each tool's `function` alone, {description, name,
 *     parameters, strict}, none when tool_choice is "none" (its default
 *     when there are no tools), only the named one for a named choice;
 *   - the template always gets add_generation_prompt, no documents, and
 *     reasoning_effort (default "medium") beside chat_template_kwargs;
 *   - continue_final_message leaves the final assistant message out of
 *     the render: SGLang tokenizes that text on its own and appends it, so
 *     the router hashes the exact prefix before it.
 */
#include <stdio.h>
#include <string.h>

#include "kv_chat_int.h"

#define get kv_chat_get
#define set kv_chat_set

/* A list of parts, as SGLang's "string" or "openai" content format has it. */
static jj_value parts_of(jj_arena *a, jj_value parts, int keep)
{
    jj_value out;

    if (!keep)
        return kv_chat_join_parts(a, parts, ' ', 1, 0);
    out = jv_new_list(a, parts.u.list->n);
    for (size_t i = 0; out.kind == JV_LIST && i < parts.u.list->n; i++) {
        jj_value        p = parts.u.list->items[i], img;
        const jj_value *type = get(p, "type");
        if (type && jv_is_str(*type, "image_url")) {
            img = jv_new_dict(a, 1);
            if (img.kind == JV_DICT)
                set(a, img, "type", jv_cstr("image"));
            p = img;
        }
        jv_list_push(a, out, p);
    }
    return out;
}

/* m[key] into d when present and not null (the dump's null members are dropped) */
static void keep(jj_arena *a, jj_value d, jj_value m, const char *key)
{
    const jj_value *v = get(m, key);
    if (v && v->kind != JV_NONE)
        set(a, d, key, *v);
}

static int call_of(jj_arena *a, kv_chat_holds_t *h, jj_value c, jj_value *out, char *err,
                   size_t errlen)
{
    const jj_value *f = get(c, "function"), *v;
    jj_value        fn = jv_new_dict(a, 2), args;

    *out = jv_new_dict(a, 4);
    if (out->kind != JV_DICT || fn.kind != JV_DICT)
        return 0;
    set(a, *out, "id", (v = get(c, "id")) ? *v : jv_none());
    set(a, *out, "index", (v = get(c, "index")) ? *v : jv_none());
    set(a, *out, "type", jv_cstr("function"));
    set(a, fn, "name", f && (v = get(*f, "name")) ? *v : jv_none());
    args = f && (v = get(*f, "arguments")) ? *v : jv_none();
    if (args.kind == JV_STR
        && kv_chat_parse_held(a, h, args.u.str.s, args.u.str.n, &args, err, errlen) != 0) {
        snprintf(err, errlen, "a tool call's arguments are not JSON");
        return -1;
    }
    set(a, fn, "arguments", args);
    set(a, *out, "function", fn);
    return 0;
}

static int message_of(jj_arena *a, kv_chat_holds_t *h, jj_value m, int parts, jj_value *out,
                      char *err, size_t errlen)
{
    const jj_value *role = get(m, "role"), *content = get(m, "content"), *calls;
    jj_value        c = content && content->kind != JV_NONE ? *content : jv_strn("", 0);

    *out = m;
    if (m.kind != JV_DICT)
        return 0;
    *out = jv_new_dict(a, 6);
    if (out->kind != JV_DICT)
        return 0;
    set(a, *out, "role", role ? *role : jv_none());
    set(a, *out, "content", c.kind == JV_LIST ? parts_of(a, c, parts) : c);
    if (role && jv_is_str(*role, "user"))
        return 0;
    keep(a, *out, m, "tool_call_id");
    keep(a, *out, m, "name");
    keep(a, *out, m, "reasoning_content");
    calls = get(m, "tool_calls");
    if (calls && calls->kind == JV_LIST) {
        jj_value l = jv_new_list(a, calls->u.list->n), call;
        for (size_t i = 0; l.kind == JV_LIST && i < calls->u.list->n; i++) {
            if (call_of(a, h, calls->u.list->items[i], &call, err, errlen) != 0)
                return -1;
            jv_list_push(a, l, call);
        }
        set(a, *out, "tool_calls", l);
    }
    return 0;
}

/* The named tool of a tool_choice object, else NULL. */
static const jj_value *named(jj_value choice)
{
    const jj_value *f = get(choice, "function");
    return f ? get(*f, "name") : NULL;
}

static jj_value tools_of(jj_arena *a, jj_value tools, jj_value choice)
{
    const jj_value *name = named(choice), *f, *v;
    jj_value        out;

    if (tools.kind != JV_LIST || tools.u.list->n == 0 || jv_is_str(choice, "none"))
        return jv_none();
    out = jv_new_list(a, tools.u.list->n);
    for (size_t i = 0; out.kind == JV_LIST && i < tools.u.list->n; i++) {
        f = get(tools.u.list->items[i], "function");
        if (f == NULL)
            continue;
        v = get(*f, "name");
        if (choice.kind == JV_DICT && (!name || !v || !jv_equal(*name, *v)))
            continue;
        jj_value d = jv_new_dict(a, 5);
        if (d.kind != JV_DICT)
            return d;
        set(a, d, "description", (v = get(*f, "description")) ? *v : jv_none());
        set(a, d, "name", (v = get(*f, "name")) ? *v : jv_none());
        set(a, d, "parameters", (v = get(*f, "parameters")) ? *v : jv_none());
        set(a, d, "strict", (v = get(*f, "strict")) && v->kind != JV_NONE ? *v : jv_bool(0));
        keep(a, d, *f, "defer_loading");
        jv_list_push(a, out, d);
    }
    return out;
}

int kv_chat_as_sglang(const kv_chat_template_t *t, jj_arena *a, kv_chat_holds_t *h,
                      jj_value *msgs, jj_value *tools, jj_value *kwargs, jj_value tool_choice,
                      jj_value effort, int cont, char *err, size_t errlen)
{
    jj_value l = jv_new_list(a, msgs->u.list->n), m, kw;
    size_t   n = msgs->u.list->n;
    int      parts = kv_chat_content_parts(t);

    if (cont && n > 0) {
        const jj_value *role = get(msgs->u.list->items[n - 1], "role");
        if (role && jv_is_str(*role, "assistant"))
            n--;
    }
    for (size_t i = 0; l.kind == JV_LIST && i < n; i++) {
        if (message_of(a, h, msgs->u.list->items[i], parts, &m, err, errlen) != 0)
            return -1;
        jv_list_push(a, l, m);
    }
    *msgs = l;
    *tools = tools_of(a, *tools, tool_choice);
    /* reasoning_effort first: chat_template_kwargs may name it again */
    kw = jv_new_dict(a, 1 + (kwargs->kind == JV_DICT ? kwargs->u.dict->n : 0));
    if (kw.kind == JV_DICT) {
        set(a, kw, "reasoning_effort", effort.kind == JV_NONE ? jv_cstr("medium") : effort);
        for (size_t i = 0; kwargs->kind == JV_DICT && i < kwargs->u.dict->n; i++)
            jv_dict_set(a, kw, kwargs->u.dict->keys[i], kwargs->u.dict->vals[i]);
    }
    *kwargs = kw;
    return 0;
}
