/*
 * Jinja tests, Python str/dict/list methods, and the globals transformers
 * provides (range, namespace, dict, raise_exception, strftime_now). The
 * parser refuses test and method names not listed here; mutating methods
 * fail as in ImmutableSandboxedEnvironment.
 */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kv_jinja.h"

/* ---- methods ---- */

static const char *const methods[] = {
    "strip", "lstrip", "rstrip", "startswith", "endswith", "split", "rsplit", "title", "upper",
    "lower", "replace", "capitalize", "find", "rfind", "count", "join", "get", "items", "keys",
    "values", "append", "extend", "insert", "pop", "remove", "update", "setdefault", "clear",
    "index", "isdigit", "isspace", "isalpha", "isalnum", "cycle", NULL,
};

int jj_method_known(const char *name)
{
    for (int i = 0; methods[i]; i++)
        if (!strcmp(methods[i], name)) return 1;
    return 0;
}

static int str_method(jj_ctx *c, jv s, const char *m, const jv *args, int nargs,
                      const char **kwn, const jv *kwv, int nkw, jv *out)
{
    const jv *a0 = ARG(0, NULL), *a1 = ARG(1, NULL), *a2 = ARG(2, NULL);
    if (!strcmp(m, "strip") || !strcmp(m, "lstrip") || !strcmp(m, "rstrip")) {
        if (a0 && a0->kind != JV_STR && a0->kind != JV_NONE) return jj_need_str(c, *a0, m);
        *out = jj_strip(s, a0, m[0] == 'l' ? 1 : m[0] == 'r' ? 2 : 3);
        return 0;
    }
    if (!strcmp(m, "startswith") || !strcmp(m, "endswith")) {
        int r;
        if (!a0) return jj_fail(c, "%s() takes at least 1 argument", m);
        if (jj_affix(c, s, *a0, m[0] == 'e', &r)) return -1;
        *out = jv_bool(r);
        return 0;
    }
    if (!strcmp(m, "split") || !strcmp(m, "rsplit")) {
        const jv *sep = ARG(0, "sep"), *mx = ARG(1, "maxsplit");
        if (sep && sep->kind != JV_STR && sep->kind != JV_NONE) return jj_need_str(c, *sep, m);
        return jj_split(c, s, sep, mx && mx->kind == JV_INT ? mx->u.i : -1, m[0] == 'r', out);
    }
    if (!strcmp(m, "upper") || !strcmp(m, "lower") || !strcmp(m, "title") || !strcmp(m, "capitalize")) {
        *out = jj_map_case(c, s, m[0] == 'u' ? 'u' : m[0] == 'l' ? 'l' : m[0] == 't' ? 't' : 'c');
        return 0;
    }
    if (!strcmp(m, "replace")) {
        if (!a0 || !a1 || jj_need_str(c, *a0, m) || jj_need_str(c, *a1, m)) return a0 && a1 ? -1 : jj_fail(c, "replace() takes 2 arguments");
        *out = jj_replace(c, s, *a0, *a1, a2 && a2->kind == JV_INT ? a2->u.i : -1);
        return 0;
    }
    if (!strcmp(m, "find") || !strcmp(m, "rfind") || !strcmp(m, "count") || !strcmp(m, "index")) {
        if (!a0 || jj_need_str(c, *a0, m)) return a0 ? -1 : jj_fail(c, "%s() takes 1 argument", m);
        int64_t cnt = 0, pos = -1;
        const char *p = s.u.str.s;
        for (size_t i = 0; i + a0->u.str.n <= s.u.str.n;) {
            if (!memcmp(p + i, a0->u.str.s, a0->u.str.n)) {
                if (pos < 0 || m[0] == 'r') pos = (int64_t)i;
                cnt++;
                i += a0->u.str.n ? a0->u.str.n : 1;
                if (m[0] == 'f' || m[0] == 'i') break;
            } else {
                i++;
            }
        }
        if (pos >= 0) pos = (int64_t)jj_cp_len(jv_strn(p, (size_t)pos));
        if (m[0] == 'i' && pos < 0) return jj_fail(c, "substring not found");
        *out = jv_int(m[0] == 'c' ? cnt : pos);
        return 0;
    }
    if (!strcmp(m, "join")) {
        const jv *items;
        size_t n;
        if (!a0 || jj_iterate(c, *a0, &items, &n)) return a0 ? -1 : jj_fail(c, "join() takes 1 argument");
        jj_buf b = { 0 };
        for (size_t i = 0; i < n; i++) {
            if (items[i].kind != JV_STR) { free(b.p); return jj_fail(c, "sequence item %zu: expected str instance", i); }
            if (i) jj_buf_put(&b, s.u.str.s, s.u.str.n);
            jj_buf_put(&b, items[i].u.str.s, items[i].u.str.n);
        }
        *out = jj_strdup(c, b.p ? b.p : "", b.n);
        free(b.p);
        return 0;
    }
    if (!strncmp(m, "is", 2)) {
        int r = s.u.str.n > 0;
        for (size_t i = 0; i < s.u.str.n && r; i++) {
            unsigned char ch = (unsigned char)s.u.str.s[i];
            if (ch >= 0x80) return jj_fail(c, "%s() on non-ASCII text is not supported", m);
            r = !strcmp(m, "isdigit") ? isdigit(ch) : !strcmp(m, "isspace") ? jj_py_space(ch) :
                !strcmp(m, "isalpha") ? isalpha(ch) : isalnum(ch);
        }
        *out = jv_bool(r);
        return 0;
    }
    return jj_fail(c, "'str' object has no attribute '%s'", m);
}

int jj_call_method(jj_ctx *c, jj_method *mt, const jv *args, int nargs,
                   const char **kwn, const jv *kwv, int nkw, jv *out)
{
    jv self = mt->self;
    const char *m = mt->name;
    if (self.kind == JV_LOOP) { /* loop.cycle(a, b, ...) */
        if (nargs < 1) return jj_fail(c, "no items for cycling given");
        *out = args[self.u.loop->index0 % (size_t)nargs];
        return 0;
    }
    if (self.kind == JV_STR) return str_method(c, self, m, args, nargs, kwn, kwv, nkw, out);
    if (self.kind == JV_DICT) {
        if (!strcmp(m, "get")) {
            const jv *k = ARG(0, NULL), *d = ARG(1, NULL);
            if (!k) return jj_fail(c, "get expected at least 1 argument");
            const jv *v = jv_dict_find(self, *k);
            *out = v ? *v : d ? *d : jv_none();
            return 0;
        }
        if (!strcmp(m, "items")) { *out = jj_items(c, self); return 0; }
        if (!strcmp(m, "keys") || !strcmp(m, "values")) {
            jv l = jv_new_list(jj_ctx_arena(c), self.u.dict->n);
            for (size_t i = 0; i < self.u.dict->n; i++)
                jv_list_push(jj_ctx_arena(c), l, m[0] == 'k' ? self.u.dict->keys[i] : self.u.dict->vals[i]);
            *out = l;
            return 0;
        }
    }
    if (self.kind == JV_LIST && (!strcmp(m, "index") || !strcmp(m, "count"))) {
        const jv *x = ARG(0, NULL);
        int64_t cnt = 0, pos = -1;
        if (!x) return jj_fail(c, "%s() takes exactly one argument", m);
        for (size_t i = 0; i < self.u.list->n; i++)
            if (jv_equal(self.u.list->items[i], *x)) { if (pos < 0) pos = (int64_t)i; cnt++; }
        if (m[0] == 'i' && pos < 0) return jj_fail(c, "value is not in list");
        *out = jv_int(m[0] == 'c' ? cnt : pos);
        return 0;
    }
    /* ImmutableSandboxedEnvironment refuses every mutating method. */
    return jj_fail(c, "access to attribute '%s' of '%s' object is unsafe.", m, jv_type_name(self));
}


/* ---- tests ---- */

static const char *const tests[] = {
    "defined", "undefined", "none", "boolean", "true", "false", "integer", "float", "number",
    "string", "mapping", "iterable", "sequence", "callable", "sameas", "eq", "equalto", "==",
    "ne", "!=", "lt", "gt", "le", "ge", "in", "odd", "even", "divisibleby", "lower", "upper", NULL,
};

int jj_test_known(const char *name)
{
    for (int i = 0; tests[i]; i++)
        if (!strcmp(tests[i], name)) return 1;
    return 0;
}

int jj_call_test(jj_ctx *c, const char *t, jv v, const jv *args, int nargs, int *out)
{
    jv x = nargs > 0 ? args[0] : jv_undef(NULL);
    jv_kind k = v.kind;
    if (!strcmp(t, "defined")) *out = k != JV_UNDEF;
    else if (!strcmp(t, "undefined")) *out = k == JV_UNDEF;
    else if (!strcmp(t, "none")) *out = k == JV_NONE;
    else if (!strcmp(t, "boolean")) *out = k == JV_BOOL;
    else if (!strcmp(t, "true")) *out = k == JV_BOOL && v.u.i;
    else if (!strcmp(t, "false")) *out = k == JV_BOOL && !v.u.i;
    else if (!strcmp(t, "integer")) *out = k == JV_INT;
    else if (!strcmp(t, "float")) *out = k == JV_FLOAT;
    else if (!strcmp(t, "number")) *out = k == JV_INT || k == JV_FLOAT || k == JV_BOOL;
    else if (!strcmp(t, "string")) *out = k == JV_STR;
    else if (!strcmp(t, "mapping")) *out = k == JV_DICT;
    else if (!strcmp(t, "iterable")) *out = k == JV_STR || k == JV_LIST || k == JV_DICT || k == JV_UNDEF;
    else if (!strcmp(t, "sequence")) *out = k == JV_STR || k == JV_LIST || k == JV_DICT || k == JV_UNDEF;
    else if (!strcmp(t, "callable")) *out = k == JV_FUNC || k == JV_METHOD || k == JV_MACRO;
    else if (!strcmp(t, "sameas")) *out = jv_equal(v, x) && (k == JV_NONE || k == JV_BOOL || k == x.kind);
    else if (!strcmp(t, "eq") || !strcmp(t, "equalto") || !strcmp(t, "==")) *out = jv_equal(v, x);
    else if (!strcmp(t, "ne") || !strcmp(t, "!=")) *out = !jv_equal(v, x);
    else if (!strcmp(t, "in")) {
        if (x.kind == JV_STR && k == JV_STR) *out = memmem(x.u.str.s, x.u.str.n, v.u.str.s, v.u.str.n) != NULL || !v.u.str.n;
        else if (x.kind == JV_LIST) { *out = 0; for (size_t i = 0; i < x.u.list->n && !*out; i++) *out = jv_equal(x.u.list->items[i], v); }
        else if (x.kind == JV_DICT) *out = jv_dict_find(x, v) != NULL;
        else return jj_fail(c, "test 'in': unsupported container %s", jv_type_name(x));
    } else if (!strcmp(t, "odd") || !strcmp(t, "even") || !strcmp(t, "divisibleby")) {
        if (k != JV_INT && k != JV_BOOL) return jj_fail(c, "test '%s' needs an integer", t);
        if (t[0] == 'd') {
            if ((x.kind != JV_INT && x.kind != JV_BOOL) || x.u.i == 0) return jj_fail(c, "divisibleby needs a non-zero integer");
            *out = v.u.i % x.u.i == 0;
        } else {
            *out = (v.u.i % 2 != 0) == (t[0] == 'o');
        }
    } else if (!strcmp(t, "lower") || !strcmp(t, "upper")) {
        jv s;
        if (jj_str(c, v, &s)) return -1;
        jv m = jj_map_case(c, s, t[0] == 'l' ? 'l' : 'u');
        *out = jv_equal(m, s);
    } else if (!strcmp(t, "lt") || !strcmp(t, "gt") || !strcmp(t, "le") || !strcmp(t, "ge")) {
        if ((k != JV_INT && k != JV_FLOAT) || (x.kind != JV_INT && x.kind != JV_FLOAT))
            return jj_fail(c, "test '%s' supports numbers only", t);
        double a = k == JV_FLOAT ? v.u.f : (double)v.u.i, b = x.kind == JV_FLOAT ? x.u.f : (double)x.u.i;
        *out = t[0] == 'l' ? (t[1] == 't' ? a < b : a <= b) : (t[1] == 't' ? a > b : a >= b);
    } else {
        return jj_fail(c, "unsupported test '%s'", t);
    }
    return 0;
}


/* ---- global functions ---- */

enum { F_RANGE, F_NAMESPACE, F_DICT, F_RAISE, F_STRFTIME };

int jj_func_id(const char *name)
{
    static const char *const names[] = { "range", "namespace", "dict", "raise_exception", "strftime_now", NULL };
    for (int i = 0; names[i]; i++)
        if (!strcmp(names[i], name)) return i;
    return -1;
}

static int func_range(jj_ctx *c, const jv *args, int nargs, jv *out)
{
    int64_t v[3] = { 0, 0, 1 };
    if (nargs < 1 || nargs > 3) return jj_fail(c, "range expected 1 to 3 arguments");
    for (int i = 0; i < nargs; i++) {
        if (args[i].kind != JV_INT && args[i].kind != JV_BOOL) return jj_fail(c, "range() arguments must be integers");
        v[nargs == 1 ? 1 : i] = args[i].u.i;
    }
    if (v[2] == 0) return jj_fail(c, "range() arg 3 must not be zero");
    /* 128-bit arithmetic: the int64 differences can overflow */
    __int128 span = v[2] > 0 ? (__int128)v[1] - v[0] : (__int128)v[0] - v[1];
    __int128 step = v[2] > 0 ? (__int128)v[2] : -(__int128)v[2];
    __int128 count = span <= 0 ? 0 : (span + step - 1) / step;
    if (count > 100000) return jj_fail(c, "Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
    jv l = jv_new_list(jj_ctx_arena(c), (size_t)count);
    for (int64_t i = 0; i < (int64_t)count; i++) jv_list_push(jj_ctx_arena(c), l, jv_int((int64_t)(v[0] + (__int128)i * v[2])));
    *out = l;
    return 0;
}

int jj_call_func(jj_ctx *c, int id, const jv *args, int nargs,
                 const char **kwn, const jv *kwv, int nkw, jv *out)
{
    jj_arena *a = jj_ctx_arena(c);
    switch (id) {
    case F_RANGE: return func_range(c, args, nargs, out);
    case F_NAMESPACE: case F_DICT: {
        jv d = jv_new_dict(a, (size_t)nkw + 4);
        if (nargs > 1) return jj_fail(c, "%s expected at most 1 positional argument", id == F_DICT ? "dict" : "namespace");
        if (nargs == 1) {
            if (args[0].kind != JV_DICT) return jj_fail(c, "%s: positional argument must be a mapping", id == F_DICT ? "dict" : "namespace");
            for (size_t i = 0; i < args[0].u.dict->n; i++) jv_dict_set(a, d, args[0].u.dict->keys[i], args[0].u.dict->vals[i]);
        }
        for (int i = 0; i < nkw; i++) jv_dict_set(a, d, jv_cstr(kwn[i]), kwv[i]);
        if (id == F_NAMESPACE) d.kind = JV_NS;
        *out = d;
        return 0;
    }
    case F_RAISE: {
        jv msg = nargs > 0 ? args[0] : jv_strn("", 0);
        if (jj_str(c, msg, &msg)) return -1;
        return jj_fail(c, "%.*s", (int)msg.u.str.n, msg.u.str.s);
    }
    case F_STRFTIME: {
        if (nargs != 1 || args[0].kind != JV_STR) return jj_fail(c, "strftime_now expects a format string");
        jv fmt = jj_strdup(c, args[0].u.str.s, args[0].u.str.n);
        time_t t = (time_t)jj_ctx_now(c);
        struct tm tm;
        char buf[256];
        if (!localtime_r(&t, &tm)) return jj_fail(c, "strftime_now: bad time");
        size_t n = strftime(buf, sizeof buf, fmt.u.str.s, &tm);
        if (n == 0 && fmt.u.str.n) return jj_fail(c, "strftime_now: format too long");
        *out = jj_strdup(c, buf, n);
        return 0;
    }
    }
    return jj_fail(c, "unknown function");
}

