/*
 * What vLLM's OpenAI server hands the template for a chat request
 * (entrypoints/chat_utils: _parse_chat_message_content, _postprocess_messages;
 * the tool dumps of serving_chat):
 *
 *   - a message keeps `role` and `content` (parts vLLM reads as text joined
 *     with "\n", or, for templates that loop over content, kept as parts
 *     with plain text wrapped as [{"type": "text", "text": ...}]; null is ""
 *     or []), then `tool_calls` (assistant, unless null), `reasoning` and
 *     `reasoning_content` (assistant, from either name), `tool_call_id`
 *     (tool) and `name` (a string); every other member is dropped; a tool
 *     result sent as text parts becomes one string;
 *   - an assistant's empty `tool_calls` is dropped, and each call's
 *     `arguments`, a JSON string on the wire, is parsed into the object the
 *     templates expect (empty, null, malformed or not an object: {}), so
 *     `arguments | tojson` prints Python's json.dumps of it, not the
 *     client's bytes;
 *   - a tool is pydantic's dump of it: {"type", "function": {"name",
 *     "description", "parameters", extra members...}, extra members...},
 *     absent description and parameters as null.
 */
#include "kv_chat_int.h"

#define get kv_chat_get
#define set kv_chat_set

/* d's members but the named ones, in their order: pydantic keeps extras last */
static void copy_extras(jj_arena *a, jj_value to, jj_value d, const char *const *known)
{
    for (size_t k = 0; k < d.u.dict->n; k++) {
        int skip = 0;
        for (const char *const *n = known; *n && !skip; n++)
            skip = jv_is_str(d.u.dict->keys[k], *n);
        if (!skip)
            jv_dict_set(a, to, d.u.dict->keys[k], d.u.dict->vals[k]);
    }
}

/* A text part as vLLM wraps it in the "openai" content format. */
static jj_value text_part(jj_arena *a, jj_value text)
{
    jj_value p = jv_new_dict(a, 2);
    if (p.kind == JV_DICT) {
        set(a, p, "type", jv_cstr("text"));
        set(a, p, "text", text);
    }
    return p;
}

/* A list of parts as vLLM's "openai" format keeps it: every text kind as
 * {"type": "text", "text"} with the part's unknown members after it (e.g.
 * cache_control), other parts as they came. *all_text: no other part. */
static jj_value parts_of(jj_arena *a, jj_value parts, int *all_text)
{
    static const char *const known[] = {"type", "text", "refusal", "thinking", "closed",
                                        "uuid", NULL};
    jj_value out = jv_new_list(a, parts.u.list->n);

    *all_text = 1;
    for (size_t i = 0; out.kind == JV_LIST && i < parts.u.list->n; i++) {
        jj_value        p = parts.u.list->items[i], d;
        const jj_value *text = &parts.u.list->items[i];
        if (p.kind != JV_STR && !kv_chat_part_text(p, 0, &text)) {
            *all_text = 0;
            jv_list_push(a, out, p);
            continue;
        }
        if (text == NULL)
            continue;           /* a text part without text: vLLM skips it */
        d = text_part(a, *text);
        if (p.kind == JV_DICT && d.kind == JV_DICT)
            copy_extras(a, d, p, known);
        jv_list_push(a, out, d);
    }
    return out;
}

/* A message's content as vLLM hands it to the template; tool results given
 * as text parts become one string, as vLLM does for clients that send them
 * so. */
static jj_value content_of(jj_arena *a, const jj_value *c, int parts, int tool)
{
    jj_value l;
    int      all_text;

    if (c == NULL || c->kind == JV_NONE)
        return parts ? jv_new_list(a, 0) : jv_strn("", 0);
    if (parts && c->kind == JV_STR) {
        l = jv_new_list(a, 1);
        if (l.kind == JV_LIST)
            jv_list_push(a, l, text_part(a, *c));
        return l;
    }
    if (c->kind != JV_LIST)
        return *c;
    if (!parts)
        return kv_chat_join_parts(a, *c, '\n', 0, 1);
    l = parts_of(a, *c, &all_text);
    return tool && all_text ? kv_chat_join_parts(a, l, '\n', 0, 0) : l;
}

/*
 * A call's arguments as the template sees them: the JSON text parsed into
 * an object, {} for anything else (vLLM's rule since it stopped failing
 * whole conversations on one bad call).
 */
static jj_value call_arguments(jj_arena *a, kv_chat_holds_t *h, jj_value args)
{
    jj_value parsed;
    char     err[8];

    if (args.kind == JV_DICT)
        return args;
    if (args.kind == JV_STR && args.u.str.n > 0
        && kv_chat_parse_held(a, h, args.u.str.s, args.u.str.n, &parsed, err, sizeof err) == 0
        && parsed.kind == JV_DICT)
        return parsed;
    return jv_new_dict(a, 0);
}

static jj_value tool_calls_of(jj_arena *a, kv_chat_holds_t *h, jj_value calls)
{
    if (calls.kind != JV_LIST)
        return calls;
    jj_value out = jv_new_list(a, calls.u.list->n);
    for (size_t i = 0; out.kind == JV_LIST && i < calls.u.list->n; i++) {
        jj_value call = calls.u.list->items[i], fn;
        const jj_value *f = get(call, "function");
        if (f == NULL || f->kind != JV_DICT) {
            jv_list_push(a, out, call);
            continue;
        }
        /* copies, so the request's own values stay as they came */
        fn = jv_new_dict(a, f->u.dict->n + 1);
        for (size_t k = 0; fn.kind == JV_DICT && k < f->u.dict->n; k++)
            jv_dict_set(a, fn, f->u.dict->keys[k], f->u.dict->vals[k]);
        const jj_value *args = get(fn, "arguments");
        set(a, fn, "arguments", call_arguments(a, h, args ? *args : jv_none()));
        jj_value c = jv_new_dict(a, call.u.dict->n);
        for (size_t k = 0; c.kind == JV_DICT && k < call.u.dict->n; k++)
            jv_dict_set(a, c, call.u.dict->keys[k],
                        jv_is_str(call.u.dict->keys[k], "function") ? fn : call.u.dict->vals[k]);
        jv_list_push(a, out, c);
    }
    return out;
}

static jj_value message_of(jj_arena *a, kv_chat_holds_t *h, jj_value m, int parts)
{
    const jj_value *role = get(m, "role"), *v;
    jj_value out;

    if (m.kind != JV_DICT)
        return m;
    out = jv_new_dict(a, 7);
    if (out.kind != JV_DICT)
        return out;
    set(a, out, "role", role ? *role : jv_none());
    set(a, out, "content", content_of(a, get(m, "content"), parts,
                                      role && jv_is_str(*role, "tool")));
    if (role && jv_is_str(*role, "assistant")) {
        v = get(m, "tool_calls");
        if (v && v->kind != JV_NONE && !(v->kind == JV_LIST && v->u.list->n == 0))
            set(a, out, "tool_calls", tool_calls_of(a, h, *v));
        v = get(m, "reasoning");
        if (v == NULL || v->kind == JV_NONE)
            v = get(m, "reasoning_content");
        if (v && v->kind != JV_NONE) {
            set(a, out, "reasoning", *v);
            set(a, out, "reasoning_content", *v);
        }
    } else if (role && jv_is_str(*role, "tool") && (v = get(m, "tool_call_id")) != NULL) {
        set(a, out, "tool_call_id", *v);
    }
    if ((v = get(m, "name")) != NULL && v->kind == JV_STR)
        set(a, out, "name", *v);
    return out;
}

static jj_value messages_of(jj_arena *a, kv_chat_holds_t *h, jj_value msgs, int parts)
{
    if (msgs.kind != JV_LIST)
        return msgs;
    jj_value out = jv_new_list(a, msgs.u.list->n);
    for (size_t i = 0; out.kind == JV_LIST && i < msgs.u.list->n; i++)
        jv_list_push(a, out, message_of(a, h, msgs.u.list->items[i], parts));
    return out;
}

static jj_value function_of(jj_arena *a, jj_value f)
{
    static const char *const known[] = {"name", "description", "parameters", NULL};
    const jj_value *v;

    if (f.kind != JV_DICT)
        return f;
    jj_value out = jv_new_dict(a, f.u.dict->n + 3);
    if (out.kind != JV_DICT)
        return out;
    if ((v = get(f, "name")) != NULL)
        set(a, out, "name", *v);
    set(a, out, "description", (v = get(f, "description")) ? *v : jv_none());
    set(a, out, "parameters", (v = get(f, "parameters")) ? *v : jv_none());
    copy_extras(a, out, f, known);
    return out;
}

static jj_value tools_of(jj_arena *a, jj_value tools)
{
    static const char *const known[] = {"type", "function", NULL};

    if (tools.kind != JV_LIST)
        return tools;
    jj_value out = jv_new_list(a, tools.u.list->n);
    for (size_t i = 0; out.kind == JV_LIST && i < tools.u.list->n; i++) {
        jj_value t = tools.u.list->items[i], d;
        const jj_value *v;
        if (t.kind != JV_DICT) {
            jv_list_push(a, out, t);
            continue;
        }
        d = jv_new_dict(a, t.u.dict->n + 2);
        if (d.kind != JV_DICT)
            return d;
        set(a, d, "type", (v = get(t, "type")) ? *v : jv_cstr("function"));
        if ((v = get(t, "function")) != NULL)
            set(a, d, "function", function_of(a, *v));
        copy_extras(a, d, t, known);
        jv_list_push(a, out, d);
    }
    return out;
}

void kv_chat_as_vllm(const kv_chat_template_t *t, jj_arena *a, kv_chat_holds_t *h,
                     jj_value *msgs, jj_value *tools)
{
    *msgs = messages_of(a, h, *msgs, kv_chat_content_parts(t));
    *tools = tools_of(a, *tools);
}
