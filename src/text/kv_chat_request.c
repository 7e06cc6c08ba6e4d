/*
 * A chat request to prompt text, as vLLM's OpenAI server renders it (see
 * kv_chat_request.h). Before the template runs, vLLM (entrypoints/chat_utils)
 * rebuilds each message and each tool:
 *
 *   - a message keeps `role` and `content` (a list of parts joined into text
 *     with "\n", or, for templates that loop over content, kept as parts with
 *     plain text wrapped as [{"type": "text", "text": ...}]; null is "" or
 *     []), then `tool_calls` (assistant, unless null), `reasoning` and
 *     `reasoning_content` (assistant, from either name), `tool_call_id`
 *     (tool) and `name` (a string); every other member is dropped;
 *   - an assistant's empty `tool_calls` is dropped, and each call's
 *     `arguments`, a JSON string on the wire, is parsed into the object the
 *     templates expect (empty, null, malformed or not an object: {}), so
 *     `arguments | tojson` prints Python's json.dumps of it, not the
 *     client's bytes;
 *   - a tool is pydantic's dump of it: {"type", "function": {"name",
 *     "description", "parameters", extra members...}, extra members...},
 *     absent description and parameters as null.
 *
 * continue_final_message cuts the text after the last message's content, as
 * transformers does. SGLang passes tools differently (the function alone,
 * and none when tool_choice is "none"): docs/CONFIG.md says what that costs.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_chat_int.h"
#include "kv_chat_request.h"

void kv_chat_holds_free(kv_chat_holds_t *h)
{
    for (size_t i = 0; i < h->n; i++)
        json_decref(h->held[i]);
    free(h->held);
    h->held = NULL;
    h->n = h->cap = 0;
}

static int holds_add(kv_chat_holds_t *h, json_t *j)
{
    if (h->n == h->cap) {
        size_t   cap = h->cap ? h->cap * 2 : 8;
        json_t **grown = realloc(h->held, cap * sizeof(*grown));
        if (grown == NULL)
            return -1;
        h->held = grown;
        h->cap = cap;
    }
    h->held[h->n++] = j;
    return 0;
}

int kv_chat_parse_held(jj_arena *a, kv_chat_holds_t *h, const char *json, size_t len,
                       jj_value *out, char *err, size_t errlen)
{
    json_t *held;

    *out = jv_none();
    if (json == NULL)
        return 0;
    if (kv_chat_parse_value(a, json, len, out, &held, err, errlen) != 0)
        return -1;
    if (held != NULL && holds_add(h, held) != 0) {
        json_decref(held);
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    return 0;
}

#define get kv_chat_get
#define set kv_chat_set

const jj_value *kv_chat_get(jj_value d, const char *key)
{
    return d.kind == JV_DICT ? jv_dict_get(d, key, strlen(key)) : NULL;
}

void kv_chat_set(jj_arena *a, jj_value d, const char *key, jj_value v)
{
    jv_dict_set(a, d, jv_cstr(key), v);
}

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
        return kv_chat_join_parts(a, *c, '\n', 0);
    l = parts_of(a, *c, &all_text);
    return tool && all_text ? kv_chat_join_parts(a, l, '\n', 0) : l;
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

/* The text continue_final_message continues: the last message's content,
 * or the last text part of it. NULL: none. */
static const jj_value *final_text(jj_value msgs)
{
    if (msgs.kind != JV_LIST || msgs.u.list->n == 0)
        return NULL;
    const jj_value *c = get(msgs.u.list->items[msgs.u.list->n - 1], "content");
    if (c && c->kind == JV_LIST) {
        for (size_t i = c->u.list->n; i-- > 0;) {
            const jj_value *t = get(c->u.list->items[i], "text");
            if (t)
                return t->kind == JV_STR ? t : NULL;
        }
        return NULL;
    }
    return c && c->kind == JV_STR ? c : NULL;
}

static const char *last_of(const char *s, size_t n, const char *w, size_t m)
{
    if (m > n)
        return NULL;
    for (size_t i = n - m + 1; i-- > 0;)
        if (memcmp(s + i, w, m) == 0)
            return s + i;
    return NULL;
}

/* transformers' cut: the text ends where the final message's content does */
static int cut_after_final(char *text, size_t *len, jj_value final, char *err, size_t errlen)
{
    jj_value stripped = jj_strip(final, NULL, JJ_STRIP_BOTH);
    jj_value left = jj_strip(final, NULL, JJ_STRIP_LEFT);
    const char *at = last_of(text, *len, stripped.u.str.s, stripped.u.str.n);

    if (at == NULL) {
        snprintf(err, errlen, "continue_final_message: the final message does not appear "
                 "in the rendered chat");
        return -1;
    }
    size_t end = (size_t) (at - text);
    if (left.u.str.n == final.u.str.n && *len - end >= final.u.str.n
        && memcmp(at, final.u.str.s, final.u.str.n) == 0)
        end += final.u.str.n;
    else
        end += stripped.u.str.n;
    *len = end;
    text[end] = '\0';
    return 0;
}

/* A request's members, parsed into the arena. */
typedef struct {
    jj_value         msgs, tools, docs, kwargs, tool_choice, effort;
    int              agp, cont;
    kv_chat_engine_t engine;
} members_t;

/* What the template gets, by vLLM's rules. */
static void as_vllm(const kv_chat_template_t *t, jj_arena *a, kv_chat_holds_t *h,
                    members_t *m)
{
    m->msgs = messages_of(a, h, m->msgs, kv_chat_content_parts(t));
    m->tools = tools_of(a, m->tools);
}

/* Renders parsed members; frees a and the holds whatever the outcome. */
static char *render(const kv_chat_template_t *t, jj_arena *a, kv_chat_holds_t *h,
                    members_t *m, long long now, size_t *len, char *err, size_t errlen)
{
    const jj_value *final;
    jj_value        fin = jv_none();
    size_t          n = 0;
    char           *text;

    if (m->msgs.kind != JV_LIST) {
        jj_arena_free(a);
        kv_chat_holds_free(h);
        snprintf(err, errlen, "messages must be a JSON array");
        return NULL;
    }
    if (m->kwargs.kind != JV_DICT)
        m->kwargs = jv_none();
    if (m->engine == KV_CHAT_SGLANG) {
        if (kv_chat_as_sglang(t, a, h, &m->msgs, &m->tools, &m->kwargs, m->tool_choice,
                              m->effort, m->cont, err, errlen) != 0) {
            jj_arena_free(a);
            kv_chat_holds_free(h);
            return NULL;
        }
        m->docs = jv_none();
        m->agp = 1;
        m->cont = 0;            /* done: the continued message is left out */
    } else {
        as_vllm(t, a, h, m);
    }
    /* the arena goes with the render: keep a copy of what the cut needs */
    if (m->cont && (final = final_text(m->msgs)) != NULL)
        fin = *final;
    char *copy = fin.kind == JV_STR ? strndup(fin.u.str.s, fin.u.str.n) : NULL;
    text = kv_chat_render_values(t, a, m->msgs, m->tools, m->docs, m->kwargs, m->agp, now, &n,
                                 err, errlen);
    kv_chat_holds_free(h);
    if (text && m->cont && copy
        && cut_after_final(text, &n, jv_strn(copy, fin.u.str.n), err, errlen) != 0) {
        free(text);
        text = NULL;
    }
    free(copy);
    if (text && len)
        *len = n;
    return text;
}

char *kv_chat_render_request(const kv_chat_template_t *t, const kv_chat_request_t *r,
                             long long now, size_t *len, char *err, size_t errlen)
{
    jj_arena        a = {0};
    kv_chat_holds_t h = {0};
    members_t       m = { .agp = r->add_generation_prompt, .cont = r->continue_final_message,
                          .engine = r->engine };
    char            dummy[8];

    if (err == NULL) {
        err = dummy;
        errlen = sizeof dummy;
    }
    if (t == NULL || r->messages == NULL) {
        snprintf(err, errlen, t ? "no messages" : "no chat template configured");
        return NULL;
    }
    if (kv_chat_parse_held(&a, &h, r->messages, r->messages_len, &m.msgs, err, errlen) != 0
        || kv_chat_parse_held(&a, &h, r->tools, r->tools_len, &m.tools, err, errlen) != 0
        || kv_chat_parse_held(&a, &h, r->documents, r->documents_len, &m.docs, err, errlen) != 0
        || kv_chat_parse_held(&a, &h, r->kwargs, r->kwargs_len, &m.kwargs, err, errlen) != 0
        || kv_chat_parse_held(&a, &h, r->tool_choice, r->tool_choice_len, &m.tool_choice, err,
                              errlen) != 0
        || kv_chat_parse_held(&a, &h, r->reasoning_effort, r->reasoning_effort_len, &m.effort,
                              err, errlen) != 0)
    {
        jj_arena_free(&a);
        kv_chat_holds_free(&h);
        return NULL;
    }
    return render(t, &a, &h, &m, now, len, err, errlen);
}

static jj_value member(jj_arena *a, const json_t *req, const char *key)
{
    const json_t *v = json_object_get(req, key);
    return v && !json_is_null(v) ? jv_from_json(a, v) : jv_none();
}

char *kv_chat_render_request_json(const kv_chat_template_t *t, const json_t *req,
                                  kv_chat_engine_t engine, long long now, size_t *len,
                                  char *err, size_t errlen)
{
    jj_arena        a = {0};
    kv_chat_holds_t h = {0};
    members_t       m;
    char            dummy[8];

    if (err == NULL) {
        err = dummy;
        errlen = sizeof dummy;
    }
    if (t == NULL) {
        snprintf(err, errlen, "no chat template configured");
        return NULL;
    }
    m = (members_t) {
        .msgs = member(&a, req, "messages"), .tools = member(&a, req, "tools"),
        .docs = member(&a, req, "documents"), .kwargs = member(&a, req, "chat_template_kwargs"),
        .tool_choice = member(&a, req, "tool_choice"),
        .effort = member(&a, req, "reasoning_effort"),
        .agp = !json_is_false(json_object_get(req, "add_generation_prompt")),
        .cont = json_is_true(json_object_get(req, "continue_final_message")),
        .engine = engine,
    };
    return render(t, &a, &h, &m, now, len, err, errlen);
}

int kv_chat_request_add_special(const json_t *req)
{
    return json_is_true(json_object_get(req, "add_special_tokens"));
}
