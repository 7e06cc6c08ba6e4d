/*
 * A chat request to prompt text, as the engine's OpenAI server renders it
 * (see kv_chat_request.h): the request's members parsed into template
 * values (the fast JSON path, jansson for the rest), rewritten by the
 * engine's rules (kv_chat_vllm.c, kv_chat_sglang.c), rendered, and, for
 * continue_final_message, cut after the final message as transformers
 * does.
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

const jj_value *kv_chat_get(jj_value d, const char *key)
{
    return d.kind == JV_DICT ? jv_dict_get(d, key, strlen(key)) : NULL;
}

void kv_chat_set(jj_arena *a, jj_value d, const char *key, jj_value v)
{
    jv_dict_set(a, d, jv_cstr(key), v);
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

/* The operator's default kwargs with the request's over them, as vLLM
 * merges them ({**default, **request}). */
static jj_value merged(jj_arena *a, jj_value defaults, jj_value kwargs)
{
    jj_value out;

    if (defaults.kind != JV_DICT)
        return kwargs;
    if (kwargs.kind != JV_DICT)
        return defaults;
    out = jv_new_dict(a, defaults.u.dict->n + kwargs.u.dict->n);
    for (size_t i = 0; out.kind == JV_DICT && i < defaults.u.dict->n; i++)
        jv_dict_set(a, out, defaults.u.dict->keys[i], defaults.u.dict->vals[i]);
    for (size_t i = 0; out.kind == JV_DICT && i < kwargs.u.dict->n; i++)
        jv_dict_set(a, out, kwargs.u.dict->keys[i], kwargs.u.dict->vals[i]);
    return out;
}

/* A request's members, parsed into the arena. */
typedef struct {
    jj_value         msgs, tools, docs, kwargs, tool_choice, effort;
    int              agp, cont;
    kv_chat_engine_t engine;
} members_t;

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
        kv_chat_as_vllm(t, a, h, &m->msgs, &m->tools);
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
    jj_value        defaults;
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
        || kv_chat_parse_held(&a, &h, r->default_kwargs, r->default_kwargs_len, &defaults, err,
                              errlen) != 0
        || kv_chat_parse_held(&a, &h, r->tool_choice, r->tool_choice_len, &m.tool_choice, err,
                              errlen) != 0
        || kv_chat_parse_held(&a, &h, r->reasoning_effort, r->reasoning_effort_len, &m.effort,
                              err, errlen) != 0)
    {
        jj_arena_free(&a);
        kv_chat_holds_free(&h);
        return NULL;
    }
    m.kwargs = merged(&a, defaults, m.kwargs);
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
