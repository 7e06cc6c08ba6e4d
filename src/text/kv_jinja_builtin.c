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

/* ---- lookup ---- */

static int lookup(const char *const *names, int n, const char *name)
{
    for (int i = 0; i < n; i++)
        if (!strcmp(names[i], name))
            return i;
    return -1;
}

static const char *const method_names[] = {JJ_METHODS(JJ_NAME)};
static const char *const test_names[] = {JJ_TESTS(JJ_NAME)};
const char *const jj_filter_names[JJ_FILTER_N] = {JJ_FILTERS(JJ_NAME)};
const char *const jj_func_names[JJ_FUNC_N] = {JJ_FUNCS(JJ_NAME)};

int jj_method_lookup(const char *name)
{
    return lookup(method_names, JJ_METHOD_N, name);
}

int jj_filter_lookup(const char *name)
{
    return lookup(jj_filter_names, JJ_FILTER_N, name);
}

int jj_test_lookup(const char *name)
{
    return lookup(test_names, JJ_TEST_N, name);
}

int jj_func_lookup(const char *name)
{
    return lookup(jj_func_names, JJ_FUNC_N, name);
}

/* ---- methods ---- */

static int str_method(jj_ctx *c, jj_value s, const char *m, const jj_value *args, int nargs,
                      const char **kwn, const jj_value *kwv, int nkw, jj_value *out)
{
    const jj_value *a0 = ARG(0, NULL), *a1 = ARG(1, NULL), *a2 = ARG(2, NULL);
    jj_method_id id = (jj_method_id)jj_method_lookup(m);

    switch (id) {
    case JJ_METHOD_STRIP:
    case JJ_METHOD_LSTRIP:
    case JJ_METHOD_RSTRIP:
        if (a0 && a0->kind != JV_STR && a0->kind != JV_NONE)
            return jj_need_str(c, *a0, m);
        *out = jj_strip(s, a0,
                        id == JJ_METHOD_LSTRIP   ? JJ_STRIP_LEFT
                        : id == JJ_METHOD_RSTRIP ? JJ_STRIP_RIGHT
                                                 : JJ_STRIP_BOTH);
        return 0;
    case JJ_METHOD_STARTSWITH:
    case JJ_METHOD_ENDSWITH: {
        int r;
        if (!a0)
            return jj_fail(c, "%s() takes at least 1 argument", m);
        if (jj_affix(c, s, *a0, id == JJ_METHOD_ENDSWITH, &r))
            return -1;
        *out = jv_bool(r);
        return 0;
    }
    case JJ_METHOD_SPLIT:
    case JJ_METHOD_RSPLIT: {
        const jj_value *sep = ARG(0, "sep"), *mx = ARG(1, "maxsplit");
        if (sep && sep->kind != JV_STR && sep->kind != JV_NONE)
            return jj_need_str(c, *sep, m);
        return jj_split(c, s, sep, mx && mx->kind == JV_INT ? mx->u.i : -1, id == JJ_METHOD_RSPLIT,
                        out);
    }
    case JJ_METHOD_UPPER:
        *out = jj_map_case(c, s, JJ_CASE_UPPER);
        return 0;
    case JJ_METHOD_LOWER:
        *out = jj_map_case(c, s, JJ_CASE_LOWER);
        return 0;
    case JJ_METHOD_TITLE:
        *out = jj_map_case(c, s, JJ_CASE_TITLE);
        return 0;
    case JJ_METHOD_CAPITALIZE:
        *out = jj_map_case(c, s, JJ_CASE_CAPITALIZE);
        return 0;
    default:
        break;
    }
    if (id == JJ_METHOD_REPLACE) {
        if (!a0 || !a1 || jj_need_str(c, *a0, m) || jj_need_str(c, *a1, m))
            return a0 && a1 ? -1 : jj_fail(c, "replace() takes 2 arguments");
        *out = jj_replace(c, s, *a0, *a1, a2 && a2->kind == JV_INT ? a2->u.i : -1);
        return 0;
    }
    if (id == JJ_METHOD_FIND || id == JJ_METHOD_RFIND || id == JJ_METHOD_COUNT
        || id == JJ_METHOD_INDEX) {
        if (!a0 || jj_need_str(c, *a0, m))
            return a0 ? -1 : jj_fail(c, "%s() takes 1 argument", m);
        int64_t cnt = 0, pos = -1;
        const char *p = s.u.str.s;
        if (id == JJ_METHOD_RFIND) /* the last match, overlapping others: 'aaa'.rfind('aa') is 1 */
            for (size_t i = s.u.str.n - a0->u.str.n + 1; a0->u.str.n <= s.u.str.n && i-- > 0;)
                if (!memcmp(p + i, a0->u.str.s, a0->u.str.n)) {
                    pos = (int64_t)i;
                    break;
                }
        for (size_t i = 0; id != JJ_METHOD_RFIND && i + a0->u.str.n <= s.u.str.n;) {
            if (!memcmp(p + i, a0->u.str.s, a0->u.str.n)) {
                if (pos < 0)
                    pos = (int64_t)i;
                cnt++;
                i += a0->u.str.n ? a0->u.str.n : 1;
                if (id == JJ_METHOD_FIND || id == JJ_METHOD_INDEX)
                    break;
            } else {
                i++;
            }
        }
        if (pos >= 0)
            pos = (int64_t)jj_cp_len(jv_strn(p, (size_t)pos));
        if (id == JJ_METHOD_INDEX && pos < 0)
            return jj_fail(c, "substring not found");
        *out = jv_int(id == JJ_METHOD_COUNT ? cnt : pos);
        return 0;
    }
    if (id == JJ_METHOD_JOIN) {
        const jj_value *items;
        size_t n;
        if (!a0 || jj_iterate(c, *a0, &items, &n))
            return a0 ? -1 : jj_fail(c, "join() takes 1 argument");
        jj_buf b = {0};
        for (size_t i = 0; i < n; i++) {
            if (items[i].kind != JV_STR) {
                free(b.p);
                return jj_fail(c, "sequence item %zu: expected str instance", i);
            }
            if (i)
                jj_buf_put(&b, s.u.str.s, s.u.str.n);
            jj_buf_put(&b, items[i].u.str.s, items[i].u.str.n);
        }
        *out = b.oom ? jv_undef(NULL) : jj_strdup(c, b.p ? b.p : "", b.n);
        free(b.p);
        return out->kind == JV_STR ? 0 : jj_oom(c);
    }
    if (id == JJ_METHOD_ISDIGIT || id == JJ_METHOD_ISSPACE || id == JJ_METHOD_ISALPHA
        || id == JJ_METHOD_ISALNUM) {
        int r = s.u.str.n > 0;
        for (size_t i = 0; i < s.u.str.n && r; i++) {
            unsigned char ch = (unsigned char)s.u.str.s[i];
            if (ch >= 0x80)
                return jj_fail(c, "%s() on non-ASCII text is not supported", m);
            r = id == JJ_METHOD_ISDIGIT   ? isdigit(ch)
                : id == JJ_METHOD_ISSPACE ? jj_py_space(ch)
                : id == JJ_METHOD_ISALPHA ? isalpha(ch)
                                          : isalnum(ch);
        }
        *out = jv_bool(r);
        return 0;
    }
    return jj_fail(c, "'str' object has no attribute '%s'", m);
}

int jj_call_method(jj_ctx *c, jj_method *mt, const jj_value *args, int nargs, const char **kwn,
                   const jj_value *kwv, int nkw, jj_value *out)
{
    jj_value self = mt->self;
    const char *m = mt->name;
    jj_method_id id = (jj_method_id)jj_method_lookup(m);
    if (self.kind == JV_LOOP) { /* loop.cycle(a, b, ...) */
        if (nargs < 1)
            return jj_fail(c, "no items for cycling given");
        *out = args[self.u.loop->index0 % (size_t)nargs];
        return 0;
    }
    if (self.kind == JV_STR)
        return str_method(c, self, m, args, nargs, kwn, kwv, nkw, out);
    if (self.kind == JV_DICT) {
        if (id == JJ_METHOD_GET) {
            const jj_value *k = ARG(0, NULL), *d = ARG(1, NULL);
            if (!k)
                return jj_fail(c, "get expected at least 1 argument");
            const jj_value *v = jv_dict_find(self, *k);
            *out = v ? *v : d ? *d : jv_none();
            return 0;
        }
        if (id == JJ_METHOD_ITEMS) {
            *out = jj_items(c, self);
            return out->kind == JV_LIST ? 0 : jj_oom(c);
        }
        if (id == JJ_METHOD_KEYS || id == JJ_METHOD_VALUES) {
            jj_value l = jv_new_list(jj_ctx_arena(c), self.u.dict->n);
            if (l.kind != JV_LIST)
                return jj_oom(c);
            for (size_t i = 0; i < self.u.dict->n; i++)
                jv_list_push(jj_ctx_arena(c), l,
                             id == JJ_METHOD_KEYS ? self.u.dict->keys[i] : self.u.dict->vals[i]);
            *out = l;
            return 0;
        }
    }
    if (self.kind == JV_LIST && (id == JJ_METHOD_INDEX || id == JJ_METHOD_COUNT)) {
        const jj_value *x = ARG(0, NULL);
        int64_t cnt = 0, pos = -1;
        if (!x)
            return jj_fail(c, "%s() takes exactly one argument", m);
        for (size_t i = 0; i < self.u.list->n; i++)
            if (jv_equal(self.u.list->items[i], *x)) {
                if (pos < 0)
                    pos = (int64_t)i;
                cnt++;
            }
        if (id == JJ_METHOD_INDEX && pos < 0)
            return jj_fail(c, "value is not in list");
        *out = jv_int(id == JJ_METHOD_COUNT ? cnt : pos);
        return 0;
    }
    /* ImmutableSandboxedEnvironment refuses every mutating method. */
    return jj_fail(c, "access to attribute '%s' of '%s' object is unsafe.", m, jv_type_name(self));
}


/* ---- tests ---- */

int jj_call_test(jj_ctx *c, const char *t, jj_value v, const jj_value *args, int nargs, int *out)
{
    jj_value x = nargs > 0 ? args[0] : jv_undef(NULL);
    jj_value_kind k = v.kind;
    jj_test_id id = (jj_test_id)jj_test_lookup(t);

    switch (id) {
    case JJ_TEST_DEFINED:
        *out = k != JV_UNDEF;
        return 0;
    case JJ_TEST_UNDEFINED:
        *out = k == JV_UNDEF;
        return 0;
    case JJ_TEST_NONE:
        *out = k == JV_NONE;
        return 0;
    case JJ_TEST_BOOLEAN:
        *out = k == JV_BOOL;
        return 0;
    case JJ_TEST_TRUE:
        *out = k == JV_BOOL && v.u.i;
        return 0;
    case JJ_TEST_FALSE:
        *out = k == JV_BOOL && !v.u.i;
        return 0;
    case JJ_TEST_INTEGER:
        *out = k == JV_INT || k == JV_BIGINT;
        return 0;
    case JJ_TEST_FLOAT:
        *out = k == JV_FLOAT;
        return 0;
    case JJ_TEST_NUMBER:
        *out = k == JV_INT || k == JV_BIGINT || k == JV_FLOAT || k == JV_BOOL;
        return 0;
    case JJ_TEST_STRING:
        *out = k == JV_STR;
        return 0;
    case JJ_TEST_MAPPING:
        *out = k == JV_DICT;
        return 0;
    case JJ_TEST_ITERABLE:
    case JJ_TEST_SEQUENCE:
        *out = k == JV_STR || k == JV_LIST || k == JV_DICT || k == JV_UNDEF;
        return 0;
    case JJ_TEST_CALLABLE:
        *out = k == JV_FUNC || k == JV_METHOD || k == JV_MACRO;
        return 0;
    case JJ_TEST_SAMEAS:
        *out = jv_equal(v, x) && (k == JV_NONE || k == JV_BOOL || k == x.kind);
        return 0;
    case JJ_TEST_EQ:
    case JJ_TEST_EQUALTO:
    case JJ_TEST_EQ_OP:
        *out = jv_equal(v, x);
        return 0;
    case JJ_TEST_NE:
    case JJ_TEST_NE_OP:
        *out = !jv_equal(v, x);
        return 0;
    case JJ_TEST_IN:
        if (x.kind == JV_STR && k == JV_STR)
            *out = memmem(x.u.str.s, x.u.str.n, v.u.str.s, v.u.str.n) != NULL || !v.u.str.n;
        else if (x.kind == JV_LIST) {
            *out = 0;
            for (size_t i = 0; i < x.u.list->n && !*out; i++)
                *out = jv_equal(x.u.list->items[i], v);
        } else if (x.kind == JV_DICT)
            *out = jv_dict_find(x, v) != NULL;
        else
            return jj_fail(c, "test 'in': unsupported container %s", jv_type_name(x));
        return 0;
    case JJ_TEST_ODD:
    case JJ_TEST_EVEN:
    case JJ_TEST_DIVISIBLEBY:
        if (k != JV_INT && k != JV_BOOL)
            return jj_fail(c, "test '%s' needs an integer", t);
        if (id == JJ_TEST_DIVISIBLEBY) {
            if ((x.kind != JV_INT && x.kind != JV_BOOL) || x.u.i == 0)
                return jj_fail(c, "divisibleby needs a non-zero integer");
            /* INT64_MIN % -1 overflows in C (SIGFPE on x86); anything % -1 is 0 */
            *out = x.u.i == -1 || v.u.i % x.u.i == 0;
        } else {
            *out = (v.u.i % 2 != 0) == (id == JJ_TEST_ODD);
        }
        return 0;
    case JJ_TEST_LOWER:
    case JJ_TEST_UPPER: {
        jj_value s;
        if (jj_str(c, v, &s))
            return -1;
        jj_value m = jj_map_case(c, s, id == JJ_TEST_LOWER ? JJ_CASE_LOWER : JJ_CASE_UPPER);
        /* str.islower()/isupper(): and at least one cased character ('123' is neither) */
        *out = jv_equal(m, s) && jj_has_cased(s);
        return 0;
    }
    case JJ_TEST_LT:
    case JJ_TEST_GT:
    case JJ_TEST_LE:
    case JJ_TEST_GE: {
        if ((k != JV_INT && k != JV_FLOAT) || (x.kind != JV_INT && x.kind != JV_FLOAT))
            return jj_fail(c, "test '%s' supports numbers only", t);
        double a = k == JV_FLOAT ? v.u.f : (double)v.u.i,
               b = x.kind == JV_FLOAT ? x.u.f : (double)x.u.i;
        *out = id == JJ_TEST_LT   ? a < b
               : id == JJ_TEST_LE ? a <= b
               : id == JJ_TEST_GT ? a > b
                                  : a >= b;
        return 0;
    }
    default:
        return jj_fail(c, "unsupported test '%s'", t);
    }
}


/* ---- global functions ---- */

static int func_range(jj_ctx *c, const jj_value *args, int nargs, jj_value *out)
{
    int64_t v[3] = {0, 0, 1};
    if (nargs < 1 || nargs > 3)
        return jj_fail(c, "range expected 1 to 3 arguments");
    for (int i = 0; i < nargs; i++) {
        if (args[i].kind != JV_INT && args[i].kind != JV_BOOL)
            return jj_fail(c, "range() arguments must be integers");
        v[nargs == 1 ? 1 : i] = args[i].u.i;
    }
    if (v[2] == 0)
        return jj_fail(c, "range() arg 3 must not be zero");
    /* 128-bit arithmetic: the int64 differences can overflow */
    __int128 span = v[2] > 0 ? (__int128)v[1] - v[0] : (__int128)v[0] - v[1];
    __int128 step = v[2] > 0 ? (__int128)v[2] : -(__int128)v[2];
    __int128 count = span <= 0 ? 0 : (span + step - 1) / step;
    if (count > 100000)
        return jj_fail(c,
                       "Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
    jj_value l = jv_new_list(jj_ctx_arena(c), (size_t)count);
    if (l.kind != JV_LIST)
        return jj_oom(c);
    for (int64_t i = 0; i < (int64_t)count; i++)
        jv_list_push(jj_ctx_arena(c), l, jv_int((int64_t)(v[0] + (__int128)i * v[2])));
    *out = l;
    return 0;
}

int jj_call_func(jj_ctx *c, int id, const jj_value *args, int nargs, const char **kwn,
                 const jj_value *kwv, int nkw, jj_value *out)
{
    jj_arena *a = jj_ctx_arena(c);
    switch (id) {
    case JJ_FUNC_RANGE:
        return func_range(c, args, nargs, out);
    case JJ_FUNC_NAMESPACE:
    case JJ_FUNC_DICT: {
        jj_value d = jv_new_dict(a, (size_t)nkw + 4);
        if (d.kind != JV_DICT)
            return jj_oom(c);
        if (nargs > 1)
            return jj_fail(c, "%s expected at most 1 positional argument",
                           id == JJ_FUNC_DICT ? "dict" : "namespace");
        if (nargs == 1) {
            if (args[0].kind != JV_DICT)
                return jj_fail(c, "%s: positional argument must be a mapping",
                               id == JJ_FUNC_DICT ? "dict" : "namespace");
            for (size_t i = 0; i < args[0].u.dict->n; i++)
                jv_dict_set(a, d, args[0].u.dict->keys[i], args[0].u.dict->vals[i]);
        }
        for (int i = 0; i < nkw; i++)
            jv_dict_set(a, d, jv_cstr(kwn[i]), kwv[i]);
        if (id == JJ_FUNC_NAMESPACE)
            d.kind = JV_NS;
        *out = d;
        return 0;
    }
    case JJ_FUNC_RAISE_EXCEPTION: {
        jj_value msg = nargs > 0 ? args[0] : jv_strn("", 0);
        if (jj_str(c, msg, &msg))
            return -1;
        return jj_fail(c, "%.*s", (int)msg.u.str.n, msg.u.str.s);
    }
    case JJ_FUNC_STRFTIME_NOW: {
        if (nargs != 1 || args[0].kind != JV_STR)
            return jj_fail(c, "strftime_now expects a format string");
        jj_value fmt = jj_strdup(c, args[0].u.str.s, args[0].u.str.n);
        if (fmt.kind != JV_STR)
            return jj_oom(c);
        time_t t = (time_t)jj_ctx_now(c);
        struct tm tm;
        char buf[256];
        if (!localtime_r(&t, &tm))
            return jj_fail(c, "strftime_now: bad time");
        size_t n = strftime(buf, sizeof buf, fmt.u.str.s, &tm);
        if (n == 0 && fmt.u.str.n)
            return jj_fail(c, "strftime_now: format too long");
        *out = jj_strdup(c, buf, n);
        return 0;
    }
    }
    return jj_fail(c, "unknown function");
}
