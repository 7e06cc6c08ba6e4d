/*
 * Chat templates: loads a model's Jinja chat template and renders OpenAI
 * messages with it, as transformers' apply_chat_template(tokenize=False).
 *
 * Variables passed to the template, as transformers does: messages, tools
 * (None when absent), documents (None), add_generation_prompt, and the
 * special tokens bos_token, eos_token, unk_token, pad_token that the
 * tokenizer_config.json defines (a {"content": ...} object gives its
 * content; a null token is left undefined, as in special_tokens_map).
 *
 * Content normalisation (vLLM's rule): if the template never loops over a
 * message's content (vLLM's "string" content format), a content given as a
 * list of parts becomes the text of its text parts (kv_chat_part_text)
 * joined with "\n". Templates that loop over content (e.g. Gemma 3) get the
 * list as is. String content is always passed unchanged. (A whole request,
 * tools and all, is rendered by kv_chat_request.h.)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kv_chat.h"
#include "kv_chat_int.h"
#include "kv_jinja.h"
#include "kv_jscan.h"
#include "kv_tree.h"
#include "kv_unicode.h"

enum {
    TOK_BOS,
    TOK_EOS,
    TOK_UNK,
    TOK_PAD,
    TOK_N
};
static const char *const tok_names[TOK_N] = {"bos_token", "eos_token", "unk_token", "pad_token"};

struct kv_chat_template {
    jj_template *tpl;
    char *tokens[TOK_N];
    int content_parts; /* the template iterates over content: keep lists */
};

static char *read_file(const char *path, size_t *len, char *err, size_t errlen)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, errlen, "%s: cannot open", path);
        return NULL;
    }
    size_t cap = 65536, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        n += fread(buf + n, 1, cap - n - 1, f);
        if (n < cap - 1)
            break;
        if (cap >= (64u << 20)) {
            free(buf);
            buf = NULL;
            snprintf(err, errlen, "%s: too large", path);
            fclose(f);
            return NULL;
        }
        char *p = realloc(buf, cap * 2);
        if (!p) {
            free(buf);
            buf = NULL;
            break;
        }
        buf = p;
        cap *= 2;
    }
    fclose(f);
    if (!buf) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    buf[n] = 0;
    *len = n;
    return buf;
}

static kv_chat_template_t *compile(const char *src, size_t len, char *err, size_t errlen)
{
    kv_chat_template_t *t = calloc(1, sizeof *t);
    if (!t) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    char perr[256];
    t->tpl = jj_parse(src, len, perr, sizeof perr);
    if (!t->tpl) {
        snprintf(err, errlen, "chat template: %s", perr);
        free(t);
        return NULL;
    }
    t->content_parts = jj_template_iterates_content(t->tpl);
    return t;
}

kv_chat_template_t *kv_chat_load_string(const char *source, const char *bos_token,
                                        const char *eos_token, char *err, size_t errlen)
{
    char dummy[8];
    if (!err) {
        err = dummy;
        errlen = sizeof dummy;
    }
    if (!source) {
        snprintf(err, errlen, "no template source");
        return NULL;
    }
    kv_chat_template_t *t = compile(source, strlen(source), err, errlen);
    if (!t)
        return NULL;
    if ((bos_token && !(t->tokens[TOK_BOS] = strdup(bos_token)))
        || (eos_token && !(t->tokens[TOK_EOS] = strdup(eos_token)))) {
        kv_chat_free(t);
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    return t;
}

/* A special token in tokenizer_config.json: a string or {"content": ...}. */
static const char *token_text(const json_t *v)
{
    if (json_is_string(v))
        return json_string_value(v);
    if (json_is_object(v))
        return json_string_value(json_object_get(v, "content"));
    return NULL;
}

static const char *pick_template(const json_t *ct, const char *name, char *err, size_t errlen)
{
    if (json_is_string(ct))
        return json_string_value(ct);
    if (!json_is_array(ct)) {
        snprintf(err, errlen, "chat_template is neither a string nor a list");
        return NULL;
    }
    const char *want = name ? name : "default";
    size_t i;
    json_t *e;
    json_array_foreach(ct, i, e)
    {
        const char *n = json_string_value(json_object_get(e, "name"));
        if (n && !strcmp(n, want)) {
            const char *s = json_string_value(json_object_get(e, "template"));
            if (s)
                return s;
        }
    }
    snprintf(err, errlen, "chat_template has no template named '%s'", want);
    return NULL;
}

static char *sibling(const char *path, const char *file)
{
    const char *slash = strrchr(path, '/');
    size_t dir = slash ? (size_t)(slash - path) + 1 : 0;
    char *p = malloc(dir + strlen(file) + 1);
    if (!p)
        return NULL;
    memcpy(p, path, dir);
    strcpy(p + dir, file);
    return p;
}

static int ends_with(const char *s, const char *suffix)
{
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && !strcmp(s + n - m, suffix);
}

kv_chat_template_t *kv_chat_load(const char *path, const char *name, char *err, size_t errlen)
{
    char dummy[8];
    if (!err) {
        err = dummy;
        errlen = sizeof dummy;
    }
    if (!path) {
        snprintf(err, errlen, "no path");
        return NULL;
    }
    int is_jinja = ends_with(path, ".jinja");
    char *cfg_path = is_jinja ? sibling(path, "tokenizer_config.json") : strdup(path);
    if (!cfg_path) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    json_error_t jerr;
    json_t *cfg = json_load_file(cfg_path, 0, &jerr);
    if (!cfg && !is_jinja) {
        snprintf(err, errlen, "%s: %s (line %d)", cfg_path, jerr.text, jerr.line);
        free(cfg_path);
        return NULL;
    }
    kv_chat_template_t *t = NULL;
    const json_t *ct = cfg ? json_object_get(cfg, "chat_template") : NULL;
    if (!is_jinja && ct && !json_is_null(ct)) {
        const char *src = pick_template(ct, name, err, errlen);
        if (src)
            t = compile(src, strlen(src), err, errlen);
    } else {
        /* chat_template.jinja: the given file, or next to the tokenizer_config.json */
        char *jpath = is_jinja ? strdup(path) : sibling(path, "chat_template.jinja");
        size_t len;
        char *src = jpath ? read_file(jpath, &len, err, errlen) : NULL;
        if (src)
            t = compile(src, len, err, errlen);
        else if (jpath && !is_jinja)
            snprintf(err, errlen, "%s: no chat_template and no chat_template.jinja", cfg_path);
        free(src);
        free(jpath);
    }
    for (int i = 0; t && cfg && i < TOK_N; i++) {
        const char *s = token_text(json_object_get(cfg, tok_names[i]));
        if (s && !(t->tokens[i] = strdup(s))) {
            kv_chat_free(t);
            t = NULL;
            snprintf(err, errlen, "out of memory");
        }
    }
    json_decref(cfg);
    free(cfg_path);
    return t;
}

void kv_chat_free(kv_chat_template_t *t)
{
    if (!t)
        return;
    jj_template_free(t->tpl);
    for (int i = 0; i < TOK_N; i++)
        free(t->tokens[i]);
    free(t);
}

/*
 * Whether a part is one vLLM reads as text (its MM_PARSER_MAP; a plain
 * string part is text too, taken by the caller): {"type": "text" |
 * "input_text" | "output_text", "text"}, {"type": "refusal", "refusal"},
 * {"type": "thinking", "thinking"}; with text_only, {"type": "text"} alone
 * (SGLang). *text: its text, NULL when null or absent (vLLM skips it).
 */
int kv_chat_part_text(jj_value p, int text_only, const jj_value **text)
{
    const jj_value *type = p.kind == JV_DICT ? jv_dict_get(p, "type", 4) : NULL;

    *text = NULL;
    if (type == NULL || type->kind != JV_STR)
        return 0;
    if (jv_is_str(*type, "text")
        || (!text_only && (jv_is_str(*type, "input_text") || jv_is_str(*type, "output_text"))))
        *text = jv_dict_get(p, "text", 4);
    else if (!text_only && jv_is_str(*type, "refusal"))
        *text = jv_dict_get(p, "refusal", 7);
    else if (!text_only && jv_is_str(*type, "thinking"))
        *text = jv_dict_get(p, "thinking", 8);
    else
        return 0;
    if (*text && (*text)->kind != JV_STR)
        *text = NULL;
    return 1;
}

/* The "string" content format: the parts' text joined with sep (vLLM:
 * "\n", every text kind, and drop_empty: its parser keeps only truthy
 * parts, so an empty text adds no separator; SGLang: ' ' and "text" parts
 * only, empty ones joined too). */
jj_value kv_chat_join_parts(jj_arena *a, jj_value parts, char sep, int text_only, int drop_empty)
{
    jj_buf b = {0};
    int first = 1;
    for (size_t i = 0; i < parts.u.list->n; i++) {
        jj_value p = parts.u.list->items[i];
        const jj_value *text = &parts.u.list->items[i];
        if ((p.kind != JV_STR || text_only) && !kv_chat_part_text(p, text_only, &text))
            continue;
        if (text == NULL || (drop_empty && text->u.str.n == 0))
            continue;
        if (!first)
            jj_buf_putc(&b, sep);
        jj_buf_put(&b, text->u.str.s, text->u.str.n);
        first = 0;
    }
    char *s = b.oom ? NULL : jj_alloc(a, b.n + 1);
    jj_value r = jv_strn("", 0);
    if (s) {
        if (b.n)
            memcpy(s, b.p, b.n);
        s[b.n] = 0;
        r = jv_strn(s, b.n);
    }
    free(b.p);
    return r;
}

static void normalise_content(jj_arena *a, jj_value msgs)
{
    if (msgs.kind != JV_LIST)
        return;
    for (size_t i = 0; i < msgs.u.list->n; i++) {
        jj_value m = msgs.u.list->items[i];
        if (m.kind != JV_DICT)
            continue;
        for (size_t k = 0; k < m.u.dict->n; k++)
            if (jv_is_str(m.u.dict->keys[k], "content") && m.u.dict->vals[k].kind == JV_LIST)
                m.u.dict->vals[k] = kv_chat_join_parts(a, m.u.dict->vals[k], '\n', 0, 1);
    }
}

static int reserved(const char *k)
{
    return !strcmp(k, "messages") || !strcmp(k, "tools") || !strcmp(k, "documents")
           || !strcmp(k, "add_generation_prompt");
}

int kv_chat_content_parts(const kv_chat_template_t *t)
{
    return t->content_parts;
}

char *kv_chat_render_values(const kv_chat_template_t *t, jj_arena *a, jj_value msgs,
                            jj_value tools, jj_value documents, jj_value kwargs,
                            int add_generation_prompt, long long now, size_t *len, char *err,
                            size_t errlen)
{
    size_t nkw = kwargs.kind == JV_DICT ? kwargs.u.dict->n : 0;
    jj_var *vars = jj_alloc(a, (4 + TOK_N + nkw) * sizeof *vars);
    size_t n = 0;
    if (!vars) {
        jj_arena_free(a);
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    if (!t->content_parts)
        normalise_content(a, msgs);
    vars[n++] = (jj_var){"messages", msgs};
    vars[n++] = (jj_var){"tools", tools};
    vars[n++] = (jj_var){"documents", documents};
    vars[n++] = (jj_var){"add_generation_prompt", jv_bool(add_generation_prompt)};
    for (int i = 0; i < TOK_N; i++)
        if (t->tokens[i])
            vars[n++] = (jj_var){tok_names[i], jv_cstr(t->tokens[i])};
    /* later entries win: kwargs override special tokens, never the fixed four */
    for (size_t i = 0; i < nkw; i++) {
        jj_value k = kwargs.u.dict->keys[i];
        if (k.kind == JV_STR && !memchr(k.u.str.s, 0, k.u.str.n) && !reserved(k.u.str.s))
            vars[n++] = (jj_var){k.u.str.s, kwargs.u.dict->vals[i]};
    }
    jj_buf out = {0};
    int rc = jj_render(t->tpl, a, vars, n, now, &out, err, errlen);
    jj_arena_free(a);
    if (rc || out.oom) {
        if (!rc)
            snprintf(err, errlen, "out of memory");
        free(out.p);
        return NULL;
    }
    if (!out.p && !(out.p = calloc(1, 1))) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    if (len)
        *len = out.n;
    return out.p;
}

char *kv_chat_render_ex(const kv_chat_template_t *t, const json_t *messages, const json_t *tools,
                        int add_generation_prompt, const json_t *kwargs, long long now, size_t *len,
                        char *err, size_t errlen)
{
    char dummy[8];
    if (!err) {
        err = dummy;
        errlen = sizeof dummy;
    }
    if (!t || !json_is_array(messages)) {
        snprintf(err, errlen, "messages must be a JSON array");
        return NULL;
    }
    if (kwargs && !json_is_null(kwargs) && !json_is_object(kwargs)) {
        snprintf(err, errlen, "chat template kwargs must be a JSON object");
        return NULL;
    }
    jj_arena a = {0};
    jj_value msgs = jv_from_json(&a, messages);
    jj_value tv = tools && !json_is_null(tools) ? jv_from_json(&a, tools) : jv_none();
    jj_value kv = kwargs && json_is_object(kwargs) ? jv_from_json(&a, kwargs) : jv_none();
    return kv_chat_render_values(t, &a, msgs, tv, jv_none(), kv, add_generation_prompt, now, len,
                                 err, errlen);
}

/*
 * A request's members straight from its JSON text (kv_tree), without
 * jansson, whose parse of a long conversation costs ten times the render:
 * the values built are exactly the ones jansson + jv_from_json would give,
 * for the JSON this accepts. Numbers other than 64-bit signed integers and
 * duplicate keys are read by jv_from_scan (jansson refuses an integer past
 * 64 bits and a float past DBL_MAX, which Python reads); strings that are
 * not valid UTF-8 once unescaped or that jansson reads otherwise
 * (\u0000, a lone surrogate) are left to jansson (return 1).
 */

static int hex4(const char *p)
{
    int v = 0;
    for (int i = 0; i < 4; i++) {
        char c = p[i];
        v = v * 16 + (c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10);
    }
    return v;
}

/* 1 when jansson takes these (validated) escapes as kv_json_unescape does */
static int escapes_ok(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        const char *e = memchr(s + i, '\\', n - i);
        if (!e)
            break;
        i = (size_t)(e - s);
        if (s[i + 1] != 'u') {
            i++;
            continue;
        }
        int u = hex4(s + i + 2);
        i += 5;
        if (u == 0 || (u >= 0xdc00 && u <= 0xdfff))
            return 0;
        if (u >= 0xd800 && u <= 0xdbff) {
            if (i + 6 >= n || s[i + 1] != '\\' || s[i + 2] != 'u')
                return 0;
            int lo = hex4(s + i + 3);
            if (lo < 0xdc00 || lo > 0xdfff)
                return 0;
            i += 6;
        }
    }
    return 1;
}

/* A string's raw JSON bytes (between the quotes) as a value */
static int str_from_raw(jj_arena *a, const char *raw, size_t len, jj_value *out)
{
    char *p = jj_alloc(a, len + 1);
    size_t n;
    if (!p)
        return -1;
    if (memchr(raw, '\\', len)) {
        if (!escapes_ok(raw, len))
            return 1;
        n = kv_json_unescape(raw, len, p);
    } else {
        memcpy(p, raw, len);
        n = len;
    }
    p[n] = '\0';
    /* (no NUL: a raw one is a control character kv_jscan refuses, and
     * escapes_ok refused \u0000) */
    if (!kv_utf8_valid((const uint8_t *)p, n))
        return 1;
    *out = jv_strn(p, n);
    return 0;
}

static int str_from_tree(jj_arena *a, const kv_tnode_t *x, jj_value *out)
{
    return str_from_raw(a, x->s, x->len, out);
}

/* 0, 1: not for this path, -1: no memory */
static int jv_from_tree(jj_arena *a, const kv_tree_t *tr, uint32_t node, jj_value *out)
{
    const kv_tnode_t *x = &tr->nodes[node];
    uint32_t c, i;
    int rc;

    switch (x->type) {
    case KV_T_NULL:
        *out = jv_none();
        return 0;
    case KV_T_TRUE:
    case KV_T_FALSE:
        *out = jv_bool(x->type == KV_T_TRUE);
        return 0;
    case KV_T_UINT:
        if (x->u > INT64_MAX)
            return 1;
        *out = jv_int((int64_t)x->u);
        return 0;
    case KV_T_NEG:
        *out = jv_int((int64_t)x->u);
        return 0;
    case KV_T_STR:
        return str_from_tree(a, x, out);
    case KV_T_ARR:
        *out = jv_new_list(a, x->n);
        if (out->kind != JV_LIST)
            return -1;
        for (c = kv_tree_first(node), i = 0; i < x->n; c = kv_tree_next(tr, c), i++)
            if ((rc = jv_from_tree(a, tr, c, &out->u.list->items[out->u.list->n++])) != 0)
                return rc;
        return 0;
    case KV_T_OBJ: {
        *out = jv_new_dict(a, x->n);
        if (out->kind != JV_DICT)
            return -1;
        jj_dict *d = out->u.dict;
        for (c = kv_tree_first(node), i = 0; i < x->n; i++) {
            jj_value k;
            if ((rc = str_from_tree(a, &tr->nodes[c], &k)) != 0)
                return rc;
            /* a duplicate key: jansson keeps the last (the dict's lookup is
             * hashed past a few keys: a pairwise scan was quadratic) */
            if (jv_dict_find(*out, k) != NULL)
                return 1;
            c = kv_tree_next(tr, c);
            d->keys[d->n] = k;
            if ((rc = jv_from_tree(a, tr, c, &d->vals[d->n++])) != 0)
                return rc;
            c = kv_tree_next(tr, c);
        }
        return 0;
    }
    default:
        return 1;
    }
}

/*
 * A number as Python's json holds it: an int (past 64 bits too: kept as its
 * digits, which JSON writes without leading zeros, as Python prints them),
 * or a float as float() reads it (1e400 is inf, which jansson refuses).
 */
static int num_from_scan(jj_arena *a, const kv_jnum_t *num, jj_value *out)
{
    char *text;

    if (num->kind == KV_JNUM_NEG || (num->kind == KV_JNUM_UINT && num->u <= INT64_MAX)) {
        *out = jv_int((int64_t)num->u);
        return 0;
    }
    text = jj_alloc(a, num->len + 1);
    if (!text)
        return -1;
    memcpy(text, num->text, num->len);
    text[num->len] = '\0';
    *out = num->kind == KV_JNUM_FLOAT ? jv_float(strtod(text, NULL)) : jv_bigint(text, num->len);
    return 0;
}

/*
 * A value straight from the scanner, for what jv_from_tree leaves but
 * Python's json reads: integers past 64 bits, floats, repeated keys (the
 * last value, at the first one's place, as a Python dict keeps it). 0; 1:
 * left to jansson (a string it reads otherwise, malformed JSON, nesting past
 * KV_JSON_MAX_DEPTH); -1: no memory.
 */
static int jv_from_scan(jj_arena *a, kv_jscan_t *s, int depth, jj_value *out)
{
    const char *raw;
    size_t len;
    kv_jnum_t num;
    jj_value k = jv_none(), v;
    int c = kv_jscan_peek(s), first = 1, more, rc, obj = c == '{';

    if (depth > KV_JSON_MAX_DEPTH)
        return 1;
    if (c == '"')
        return kv_jscan_string_raw(s, &raw, &len, NULL) ? 1 : str_from_raw(a, raw, len, out);
    if (c == 't' || c == 'f' || c == 'n') {
        if (kv_jscan_literal(s, c == 't' ? "true" : c == 'f' ? "false" : "null"))
            return 1;
        *out = c == 'n' ? jv_none() : jv_bool(c == 't');
        return 0;
    }
    if (c != '{' && c != '[')
        return kv_jscan_number(s, &num) ? 1 : num_from_scan(a, &num, out);
    s->p++;
    *out = obj ? jv_new_dict(a, 4) : jv_new_list(a, 4);
    if (out->kind != (obj ? JV_DICT : JV_LIST))
        return -1;
    while ((more = kv_jscan_more(s, &first, obj ? '}' : ']')) == 1) {
        if (obj && (kv_jscan_peek(s) != '"' || kv_jscan_string_raw(s, &raw, &len, NULL)
                    || kv_jscan_expect(s, ':')))
            return 1;
        if ((obj && (rc = str_from_raw(a, raw, len, &k)) != 0)
            || (rc = jv_from_scan(a, s, depth + 1, &v)) != 0)
            return rc;
        if (obj ? jv_dict_put(a, *out, k, v) != 0 : (jv_list_push(a, *out, v), a->failed))
            return -1;
    }
    return more < 0 ? 1 : 0;
}

/* json[0..len) by jv_from_scan, the whole of it */
static int parse_scan(jj_arena *a, const char *json, size_t len, jj_value *out)
{
    kv_jscan_t s;
    int rc;

    kv_jscan_init(&s, json, len);
    rc = jv_from_scan(a, &s, 0, out);
    return rc == 0 && kv_jscan_peek(&s) != 0 ? 1 : rc;
}

/*
 * Whether json nests at most max deep (strings skipped). The jansson
 * fallback below takes 2048 levels and jv_from_json recurses through them:
 * a tool call's arguments text (a plain string to the body's own depth
 * check) nested 2000 deep needed over 256 KiB of a thread pool's stack,
 * more than musl gives a thread. Deeper than the body itself may nest
 * (KV_JSON_MAX_DEPTH), it is unparsable here: a call's arguments become {}
 * as a bad call's do, a routing miss on a pathological request only.
 */
static int depth_within(const char *json, size_t len, int max)
{
    int depth = 0, in_str = 0;

    for (size_t i = 0; i < len; i++) {
        char c = json[i];
        if (in_str) {
            if (c == '\\')
                i++;
            else if (c == '"')
                in_str = 0;
        } else if (c == '"') {
            in_str = 1;
        } else if (c == '[' || c == '{') {
            if (++depth > max)
                return 0;
        } else if (c == ']' || c == '}') {
            depth--;
        }
    }
    return 1;
}

int kv_chat_parse_value(jj_arena *a, const char *json, size_t len, jj_value *out,
                        json_t **held, char *err, size_t errlen)
{
    kv_tree_t tr = {0};
    json_error_t jerr;
    int rc = 1;

    *held = NULL;
    if (kv_tree_json(&tr, json, len, err, errlen) == 0 && tr.n > 0)
        rc = jv_from_tree(a, &tr, 0, out);
    kv_tree_free(&tr);
    if (rc == 1)
        rc = parse_scan(a, json, len, out);
    if (rc == 0)
        return 0;
    if (rc < 0) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    if (!depth_within(json, len, KV_JSON_MAX_DEPTH)) {
        snprintf(err, errlen, "nested deeper than %d", KV_JSON_MAX_DEPTH);
        return -1;
    }
    /* "\u0000" is valid JSON, and the engines (Python's json) take it */
    *held = json_loadb(json, len, JSON_DECODE_ANY | JSON_ALLOW_NUL, &jerr);
    if (*held == NULL) {
        snprintf(err, errlen, "%s", jerr.text);
        return -1;
    }
    *out = jv_from_json(a, *held);
    return 0;
}

char *kv_chat_render_at(const kv_chat_template_t *t, const json_t *messages, const json_t *tools,
                        int add_generation_prompt, long long now, size_t *len, char *err,
                        size_t errlen)
{
    return kv_chat_render_ex(t, messages, tools, add_generation_prompt, NULL, now, len, err,
                             errlen);
}

char *kv_chat_render(const kv_chat_template_t *t, const json_t *messages, const json_t *tools,
                     int add_generation_prompt, size_t *len, char *err, size_t errlen)
{
    return kv_chat_render_at(t, messages, tools, add_generation_prompt, kv_chat_now(), len, err,
                             errlen);
}

long long kv_chat_now(void)
{
    /* KV_CHAT_NOW (seconds since the epoch) pins strftime_now, for tests. */
    const char *pin = getenv("KV_CHAT_NOW");
    return pin && *pin ? strtoll(pin, NULL, 10) : (long long)time(NULL);
}
