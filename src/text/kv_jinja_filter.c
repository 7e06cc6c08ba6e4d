/*
 * Jinja filters used by chat templates (jinja2 3.1 semantics; tojson is
 * transformers' json.dumps(ensure_ascii=False, ...)). The parser refuses any
 * filter name not listed here.
 */
#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_jinja.h"

/* ---- filters ---- */

/* getattr along a dotted path ("function.name"), as jinja's make_attrgetter. */
static jj_value attr_path(jj_ctx *c, jj_value v, jj_value path)
{
    if (path.kind == JV_INT)
        return jj_getitem(c, v, path);
    const char *p = path.u.str.s, *end = p + path.u.str.n;
    while (p < end && v.kind != JV_UNDEF) {
        const char *dot = memchr(p, '.', (size_t)(end - p));
        size_t n = dot ? (size_t)(dot - p) : (size_t)(end - p);
        jj_value key = jj_strdup(c, p, n);
        if (key.kind != JV_STR)
            return key; /* the arena failed: the caller's check fails the render */
        int digits = n > 0;
        for (size_t i = 0; i < n; i++)
            digits &= isdigit((unsigned char)p[i]) != 0;
        v = jj_getitem(c, v, digits ? jv_int(strtoll(key.u.str.s, NULL, 10)) : key);
        p += n + 1;
    }
    return v;
}

/* select/reject/selectattr/rejectattr */
static int filter_select(jj_ctx *c, jj_value seq, jj_filter_id id, const jj_value *args, int nargs,
                         jj_value *out)
{
    const char *name = jj_filter_names[id];
    int by_attr = id == JJ_FILTER_SELECTATTR || id == JJ_FILTER_REJECTATTR;
    int reject = id == JJ_FILTER_REJECT || id == JJ_FILTER_REJECTATTR;
    const jj_value *items;
    size_t n;
    if (jj_iterate(c, seq, &items, &n))
        return -1;
    if (by_attr && nargs < 1)
        return jj_fail(c, "%s needs an attribute name", name);
    int targ = by_attr ? 1 : 0;
    const char *test = NULL;
    if (nargs > targ) {
        if (args[targ].kind != JV_STR)
            return jj_fail(c, "%s: test name must be a string", name);
        test = jj_strdup(c, args[targ].u.str.s, args[targ].u.str.n).u.str.s;
        if (!test)
            return jj_oom(c);
        if (jj_test_lookup(test) < 0)
            return jj_fail(c, "unsupported test '%s'", test);
    }
    jj_value l = jv_new_list(jj_ctx_arena(c), n);
    if (l.kind != JV_LIST)
        return jj_oom(c);
    for (size_t i = 0; i < n; i++) {
        jj_value v = by_attr ? attr_path(c, items[i], args[0]) : items[i];
        int r;
        if (jj_failed(c))
            return -1;
        if (test) {
            if (jj_call_test(c, test, v, args + targ + 1, nargs - targ - 1, &r))
                return -1;
        } else {
            r = jv_truthy(v);
        }
        if (r != reject)
            jv_list_push(jj_ctx_arena(c), l, items[i]);
    }
    *out = l;
    return 0;
}

static int filter_map(jj_ctx *c, jj_value seq, const jj_value *args, int nargs, const char **kwn,
                      const jj_value *kwv, int nkw, jj_value *out)
{
    const jj_value *items;
    size_t n;
    if (jj_iterate(c, seq, &items, &n))
        return -1;
    const jj_value *attr = ARG(-1, "attribute"), *def = ARG(-1, "default");
    jj_value l = jv_new_list(jj_ctx_arena(c), n);
    if (l.kind != JV_LIST)
        return jj_oom(c);
    for (size_t i = 0; i < n; i++) {
        jj_value v;
        if (attr) {
            v = attr_path(c, items[i], *attr);
            if (v.kind == JV_UNDEF && def)
                v = *def;
        } else {
            if (nargs < 1 || args[0].kind != JV_STR)
                return jj_fail(c, "map needs a filter name or attribute=");
            jj_value fname = jj_strdup(c, args[0].u.str.s, args[0].u.str.n);
            if (fname.kind != JV_STR)
                return jj_oom(c);
            if (jj_filter_lookup(fname.u.str.s) < 0)
                return jj_fail(c, "unsupported filter '%s'", fname.u.str.s);
            if (jj_call_filter(c, fname.u.str.s, items[i], args + 1, nargs - 1, NULL, NULL, 0, &v))
                return -1;
        }
        jv_list_push(jj_ctx_arena(c), l, v);
    }
    *out = l;
    return 0;
}

/* Stable merge sort of items by keys (Python's sorted()); reverse as sorted(reverse=True). */
static int sort_by_keys(jj_ctx *c, jj_value *items, jj_value *keys, size_t n, int reverse)
{
    if (n < 2)
        return 0;
    size_t h = n / 2;
    if (sort_by_keys(c, items, keys, h, reverse)
        || sort_by_keys(c, items + h, keys + h, n - h, reverse))
        return -1;
    jj_value *ti = jj_alloc(jj_ctx_arena(c), n * sizeof *ti),
             *tk = jj_alloc(jj_ctx_arena(c), n * sizeof *tk);
    if (!ti || !tk)
        return jj_oom(c);
    size_t i = 0, j = h, k = 0;
    while (i < h && j < n) {
        int cmp;
        if (jj_order(c, keys[j], keys[i], &cmp))
            return -1;
        int take_right = reverse ? cmp > 0 : cmp < 0; /* ties keep the left (earlier) item */
        ti[k] = take_right ? items[j] : items[i];
        tk[k++] = take_right ? keys[j++] : keys[i++];
    }
    while (i < h) {
        ti[k] = items[i];
        tk[k++] = keys[i++];
    }
    while (j < n) {
        ti[k] = items[j];
        tk[k++] = keys[j++];
    }
    memcpy(items, ti, n * sizeof *ti);
    memcpy(keys, tk, n * sizeof *tk);
    return 0;
}

/* dictsort(case_sensitive=False, by='key', reverse=False) and
 * sort(reverse, case_sensitive, attribute) */
static int filter_sort(jj_ctx *c, jj_filter_id id, jj_value v, const jj_value *args, int nargs,
                       const char **kwn, const jj_value *kwv, int nkw, jj_value *out)
{
    int dict = id == JJ_FILTER_DICTSORT;
    const jj_value *cs = dict ? ARG(0, "case_sensitive") : ARG(1, "case_sensitive");
    const jj_value *rev = dict ? ARG(2, "reverse") : ARG(0, "reverse");
    const jj_value *by = dict ? ARG(1, "by") : NULL, *attr = dict ? NULL : ARG(2, "attribute");
    int by_value = by && jv_is_str(*by, "value");
    if (by && !by_value && !jv_is_str(*by, "key"))
        return jj_fail(c, "You can only sort by either \"key\" or \"value\"");
    jj_value items;
    if (dict) {
        if (v.kind != JV_DICT)
            return jj_fail(c, "dictsort: not a mapping");
        items = jj_items(c, v);
        if (items.kind != JV_LIST)
            return jj_oom(c);
    } else {
        const jj_value *it;
        size_t n;
        if (jj_iterate(c, v, &it, &n))
            return -1;
        items = jv_new_list(jj_ctx_arena(c), n);
        if (items.kind != JV_LIST)
            return jj_oom(c);
        for (size_t i = 0; i < n; i++)
            jv_list_push(jj_ctx_arena(c), items, it[i]);
    }
    size_t n = items.u.list->n;
    jj_value *keys = jj_alloc(jj_ctx_arena(c), (n + 1) * sizeof *keys);
    if (!keys)
        return jj_oom(c);
    for (size_t i = 0; i < n; i++) {
        jj_value it = items.u.list->items[i];
        jj_value k = dict   ? it.u.list->items[by_value ? 1 : 0]
                     : attr ? attr_path(c, it, *attr)
                            : it;
        if (jj_failed(c))
            return -1;
        if (k.kind == JV_STR && !(cs && jv_truthy(*cs)))
            k = jj_map_case(c, k, JJ_CASE_LOWER);
        keys[i] = k;
    }
    if (sort_by_keys(c, items.u.list->items, keys, n, rev && jv_truthy(*rev)))
        return -1;
    *out = items;
    return 0;
}

/* Length of the line break at s (Python str.splitlines() breaks), 0 if none. */
static size_t line_break(const char *s, size_t n)
{
    unsigned char c = (unsigned char)s[0];
    if (c == '\r')
        return n > 1 && s[1] == '\n' ? 2 : 1;
    if (c == '\n' || c == '\v' || c == '\f' || (c >= 0x1c && c <= 0x1e))
        return 1;
    if (n > 1 && c == 0xC2 && (unsigned char)s[1] == 0x85)
        return 2;
    if (n > 2 && c == 0xE2 && (unsigned char)s[1] == 0x80
        && ((unsigned char)s[2] == 0xA8 || (unsigned char)s[2] == 0xA9))
        return 3;
    return 0;
}

/* jinja2's indent(width=4, first=False, blank=False): the lines of s + "\n" (splitlines)
 * joined with "\n", each after the first indented unless empty (or always, with blank). */
static int filter_indent(jj_ctx *c, jj_value s, const jj_value *args, int nargs, const char **kwn,
                         const jj_value *kwv, int nkw, jj_value *out)
{
    const jj_value *w = ARG(0, "width"), *first = ARG(1, "first"), *bl = ARG(2, "blank");
    int blank = bl && jv_truthy(*bl);
    jj_value ind = jv_strn("    ", 4);
    if (w && w->kind == JV_STR) {
        ind = *w;
    } else if (w && (w->kind == JV_INT || w->kind == JV_BOOL)) {
        size_t k = w->u.i > 0 ? (size_t)(w->u.i > 1024 ? 1024 : w->u.i) : 0;
        char *sp = jj_alloc(jj_ctx_arena(c), k + 1);
        if (!sp)
            return jj_oom(c);
        memset(sp, ' ', k);
        ind = jv_strn(sp, k);
    } else if (w) {
        return jj_fail(c, "indent: width must be an integer or a string");
    }
    jj_buf b = {0};
    if (first && jv_truthy(*first))
        jj_buf_put(&b, ind.u.str.s, ind.u.str.n);
    size_t i = 0, n = s.u.str.n;
    for (int line = 0;; line++) {
        size_t e = i, br = 0;
        while (e < n && !(br = line_break(s.u.str.s + e, n - e)))
            e++;
        if (line > 0) {
            jj_buf_putc(&b, '\n');
            if (e > i || blank)
                jj_buf_put(&b, ind.u.str.s, ind.u.str.n);
        }
        jj_buf_put(&b, s.u.str.s + i, e - i);
        if (!br)
            break; /* the appended "\n" ends this last line */
        i = e + br;
        if (i == n) { /* s ended with a break: one more, empty, line */
            jj_buf_putc(&b, '\n');
            if (blank)
                jj_buf_put(&b, ind.u.str.s, ind.u.str.n);
            break;
        }
    }
    *out = jj_strdup(c, b.p ? b.p : "", b.n);
    free(b.p);
    return b.oom ? jj_oom(c) : 0;
}

static jj_value html_escape(jj_ctx *c, jj_value s)
{
    jj_buf b = {0};
    for (size_t i = 0; i < s.u.str.n; i++) {
        char ch = s.u.str.s[i];
        switch (ch) {
        case '&':
            jj_buf_puts(&b, "&amp;");
            break;
        case '<':
            jj_buf_puts(&b, "&lt;");
            break;
        case '>':
            jj_buf_puts(&b, "&gt;");
            break;
        case '"':
            jj_buf_puts(&b, "&#34;");
            break;
        case '\'':
            jj_buf_puts(&b, "&#39;");
            break;
        default:
            jj_buf_putc(&b, ch);
        }
    }
    jj_value r = jj_strdup(c, b.p ? b.p : "", b.n);
    free(b.p);
    return r;
}

/* sum(attribute=None, start=0), min/max(case_sensitive=False, attribute=None) */
static int filter_aggregate(jj_ctx *c, jj_filter_id id, jj_value v, const jj_value *args, int nargs,
                            const char **kwn, const jj_value *kwv, int nkw, jj_value *out)
{
    const jj_value *items;
    size_t n;
    if (jj_iterate(c, v, &items, &n))
        return -1;
    if (id == JJ_FILTER_SUM) {
        const jj_value *attr = ARG(0, "attribute"), *start = ARG(1, "start");
        jj_value acc = start ? *start : jv_int(0);
        for (size_t i = 0; i < n; i++) {
            jj_value x = attr ? attr_path(c, items[i], *attr) : items[i];
            int fl = acc.kind == JV_FLOAT || x.kind == JV_FLOAT;
            if ((acc.kind != JV_INT && acc.kind != JV_BOOL && acc.kind != JV_FLOAT)
                || (x.kind != JV_INT && x.kind != JV_BOOL && x.kind != JV_FLOAT))
                return jj_fail(c, "sum: unsupported operand types");
            double fa = acc.kind == JV_FLOAT ? acc.u.f : (double)acc.u.i,
                   fx = x.kind == JV_FLOAT ? x.u.f : (double)x.u.i;
            int64_t r;
            if (!fl && __builtin_add_overflow(acc.u.i, x.u.i, &r))
                return jj_fail(c, "integer overflow");
            acc = fl ? jv_float(fa + fx) : jv_int(r);
        }
        *out = acc;
        return 0;
    }
    const jj_value *cs = ARG(0, "case_sensitive"), *attr = ARG(1, "attribute");
    if (n == 0) {
        *out = jv_undef(NULL);
        return 0;
    }
    jj_value best = items[0], bkey = attr ? attr_path(c, items[0], *attr) : items[0];
    if (bkey.kind == JV_STR && !(cs && jv_truthy(*cs)))
        bkey = jj_map_case(c, bkey, JJ_CASE_LOWER);
    for (size_t i = 1; i < n; i++) {
        jj_value k = attr ? attr_path(c, items[i], *attr) : items[i];
        int cmp;
        if (k.kind == JV_STR && !(cs && jv_truthy(*cs)))
            k = jj_map_case(c, k, JJ_CASE_LOWER);
        if (jj_order(c, k, bkey, &cmp))
            return -1;
        if (id == JJ_FILTER_MIN ? cmp < 0 : cmp > 0) {
            best = items[i];
            bkey = k;
        }
    }
    *out = best;
    return 0;
}

static int filter_tojson(jj_ctx *c, jj_value v, const jj_value *args, int nargs, const char **kwn,
                         const jj_value *kwv, int nkw, jj_value *out)
{
    const jj_value *ea = ARG(0, "ensure_ascii"), *ind = ARG(1, "indent"),
                   *sep = ARG(2, "separators"), *sk = ARG(3, "sort_keys");
    if (ea && jv_truthy(*ea))
        return jj_fail(c, "tojson(ensure_ascii=True) is not supported");
    int indent = -1;
    if (ind && ind->kind != JV_NONE) {
        if (ind->kind != JV_INT)
            return jj_fail(c, "tojson: indent must be an integer");
        indent = (int)(ind->u.i < 0 ? 0 : ind->u.i > 64 ? 64 : ind->u.i);
    }
    const char *item_sep = indent >= 0 ? "," : ", ", *key_sep = ": ";
    if (sep && sep->kind != JV_NONE) {
        if (sep->kind != JV_LIST || sep->u.list->n != 2 || sep->u.list->items[0].kind != JV_STR
            || sep->u.list->items[1].kind != JV_STR)
            return jj_fail(c, "tojson: separators must be a pair of strings");
        item_sep =
            jj_strdup(c, sep->u.list->items[0].u.str.s, sep->u.list->items[0].u.str.n).u.str.s;
        key_sep =
            jj_strdup(c, sep->u.list->items[1].u.str.s, sep->u.list->items[1].u.str.n).u.str.s;
        if (!item_sep || !key_sep)
            return jj_oom(c);
    }
    jj_buf b = {0};
    if (jv_write_json(&b, v, indent, item_sep, key_sep, sk && jv_truthy(*sk), 0)) {
        free(b.p);
        return jj_fail(c, "Object of type %s is not JSON serializable", jv_type_name(v));
    }
    *out = jj_strdup(c, b.p ? b.p : "", b.n);
    free(b.p);
    return b.oom ? jj_oom(c) : 0;
}

/* int(f) for a float; values beyond int64 are an error (Python would give a big int). */
static int float_to_int(jj_ctx *c, double f, jj_value *out)
{
    if (!(f > -9.2e18 && f < 9.2e18))
        return jj_fail(c, "integer overflow (integers beyond 64 bits are not supported)");
    *out = jv_int((int64_t)f);
    return 0;
}

static int filter_int(jj_ctx *c, jj_value v, const jj_value *def, int is_float, jj_value *out)
{
    jj_value d = def ? *def : is_float ? jv_float(0) : jv_int(0);
    switch (v.kind) {
    case JV_INT:
    case JV_BOOL:
        *out = is_float ? jv_float((double)v.u.i) : jv_int(v.u.i);
        return 0;
    case JV_FLOAT:
        if (is_float) {
            *out = v;
            return 0;
        }
        return float_to_int(c, v.u.f, out);
    case JV_STR: {
        char buf[64];
        size_t k = 0;
        if (v.u.str.n >= sizeof buf) {
            *out = d;
            return 0;
        }
        /* Python's int()/float() take one _ between digits ('1_000'); anywhere else it is
         * no number */
        for (size_t i = 0; i < v.u.str.n; i++) {
            char ch = v.u.str.s[i];
            if (ch == '_') {
                if (!i || i + 1 == v.u.str.n || !isdigit((unsigned char)v.u.str.s[i - 1])
                    || !isdigit((unsigned char)v.u.str.s[i + 1])) {
                    *out = d;
                    return 0;
                }
                continue;
            }
            buf[k++] = ch;
        }
        buf[k] = 0;
        char *end;
        if (!is_float) {
            long long i = strtoll(buf, &end, 10);
            while (*end && isspace((unsigned char)*end))
                end++;
            if (end != buf && !*end) {
                *out = jv_int(i);
                return 0;
            }
        }
        if (strpbrk(buf, "xXpP")) {
            *out = d;
            return 0;
        } /* strtod would read hex floats */
        double f = strtod(buf, &end);
        while (*end && isspace((unsigned char)*end))
            end++;
        if (end == buf || *end) {
            *out = d;
            return 0;
        }
        if (is_float) {
            *out = jv_float(f);
            return 0;
        }
        if (isnan(f) || isinf(f)) { /* int(float('nan')) raises: jinja2 gives the default */
            *out = d;
            return 0;
        }
        return float_to_int(c, f, out);
    }
    default:
        *out = d;
        return 0;
    }
}

int jj_call_filter(jj_ctx *c, const char *name, jj_value v, const jj_value *args, int nargs,
                   const char **kwn, const jj_value *kwv, int nkw, jj_value *out)
{
    jj_arena *a = jj_ctx_arena(c);
    jj_filter_id id = (jj_filter_id)jj_filter_lookup(name);
    const jj_value *items;
    size_t n;

    switch (id) {
    case JJ_FILTER_DEFAULT:
    case JJ_FILTER_D: {
        const jj_value *dv = ARG(0, "default_value"), *bo = ARG(1, "boolean");
        int use = v.kind == JV_UNDEF || (bo && jv_truthy(*bo) && !jv_truthy(v));
        *out = use ? (dv ? *dv : jv_strn("", 0)) : v;
        return 0;
    }
    case JJ_FILTER_TOJSON:
        return filter_tojson(c, v, args, nargs, kwn, kwv, nkw, out);
    case JJ_FILTER_SAFE:
        *out = v;
        return 0;
    case JJ_FILTER_LENGTH:
    case JJ_FILTER_COUNT:
        if (v.kind == JV_STR)
            *out = jv_int((int64_t)jj_cp_len(v));
        else if (v.kind == JV_LIST)
            *out = jv_int((int64_t)v.u.list->n);
        else if (v.kind == JV_DICT || v.kind == JV_NS)
            *out = jv_int((int64_t)v.u.dict->n);
        else if (v.kind == JV_UNDEF)
            *out = jv_int(0);
        else
            return jj_fail(c, "object of type '%s' has no len()", jv_type_name(v));
        return 0;
    case JJ_FILTER_ITEMS:
        if (v.kind == JV_UNDEF) {
            *out = jv_new_list(a, 0);
            return 0;
        }
        if (v.kind != JV_DICT)
            return jj_fail(c, "Can only get item pairs from a mapping.");
        *out = jj_items(c, v);
        return out->kind == JV_LIST ? 0 : jj_oom(c);
    case JJ_FILTER_INT:
    case JJ_FILTER_FLOAT:
        return filter_int(c, v, ARG(0, "default"), id == JJ_FILTER_FLOAT, out);
    case JJ_FILTER_ABS:
        if ((v.kind == JV_INT || v.kind == JV_BOOL) && v.u.i == INT64_MIN)
            return jj_fail(c, "integer overflow");
        if (v.kind == JV_INT || v.kind == JV_BOOL)
            *out = jv_int(v.u.i < 0 ? -v.u.i : v.u.i);
        else if (v.kind == JV_FLOAT)
            *out = jv_float(v.u.f < 0 ? -v.u.f : v.u.f);
        else
            return jj_fail(c, "bad operand type for abs(): '%s'", jv_type_name(v));
        return 0;
    case JJ_FILTER_SELECTATTR:
    case JJ_FILTER_REJECTATTR:
    case JJ_FILTER_SELECT:
    case JJ_FILTER_REJECT:
        return filter_select(c, v, id, args, nargs, out);
    case JJ_FILTER_MAP:
        return filter_map(c, v, args, nargs, kwn, kwv, nkw, out);
    case JJ_FILTER_DICTSORT:
    case JJ_FILTER_SORT:
        return filter_sort(c, id, v, args, nargs, kwn, kwv, nkw, out);
    case JJ_FILTER_SUM:
    case JJ_FILTER_MIN:
    case JJ_FILTER_MAX:
        return filter_aggregate(c, id, v, args, nargs, kwn, kwv, nkw, out);
    case JJ_FILTER_REVERSE:
        if (v.kind == JV_STR) {
            if (jj_iterate(c, v, &items, &n))
                return -1;
            jj_buf b = {0};
            for (size_t i = n; i-- > 0;)
                jj_buf_put(&b, items[i].u.str.s, items[i].u.str.n);
            *out = jj_strdup(c, b.p ? b.p : "", b.n);
            free(b.p);
            return 0;
        }
        /* fall through */
    case JJ_FILTER_LIST: {
        if (jj_iterate(c, v, &items, &n))
            return -1;
        jj_value l = jv_new_list(a, n);
        if (l.kind != JV_LIST)
            return jj_oom(c);
        for (size_t i = 0; i < n; i++)
            l.u.list->items[l.u.list->n++] = id == JJ_FILTER_REVERSE ? items[n - 1 - i] : items[i];
        *out = l;
        return 0;
    }
    case JJ_FILTER_UNIQUE: {
        /* unique(case_sensitive=False, attribute=None): the first item of each key, the
         * keys kept in a (hashed) dict as jinja2 keeps them in a set */
        const jj_value *cs = ARG(0, "case_sensitive"), *attr = ARG(1, "attribute");
        if (jj_iterate(c, v, &items, &n))
            return -1;
        jj_value l = jv_new_list(a, n), seen = jv_new_dict(a, 0);
        if (l.kind != JV_LIST || seen.kind != JV_DICT)
            return jj_oom(c);
        for (size_t i = 0; i < n; i++) {
            jj_value key = attr ? attr_path(c, items[i], *attr) : items[i];
            if (jj_failed(c))
                return -1;
            if (key.kind == JV_STR && !(cs && jv_truthy(*cs))
                && (key = jj_map_case(c, key, JJ_CASE_LOWER)).kind != JV_STR)
                return jj_oom(c);
            if (jv_dict_find(seen, key))
                continue;
            if (jv_dict_put(a, seen, key, jv_none()))
                return jj_oom(c);
            l.u.list->items[l.u.list->n++] = items[i];
        }
        *out = l;
        return 0;
    }
    case JJ_FILTER_FIRST:
    case JJ_FILTER_LAST:
        if (jj_iterate(c, v, &items, &n))
            return -1;
        *out = n ? items[id == JJ_FILTER_FIRST ? 0 : n - 1] : jv_undef(NULL);
        return 0;
    case JJ_FILTER_JOIN: {
        if (jj_iterate(c, v, &items, &n))
            return -1;
        const jj_value *sep = ARG(0, "d"), *attr = ARG(1, "attribute");
        jj_buf b = {0};
        for (size_t i = 0; i < n; i++) {
            if (i && sep && sep->kind == JV_STR)
                jj_buf_put(&b, sep->u.str.s, sep->u.str.n);
            jj_value item = attr ? attr_path(c, items[i], *attr) : items[i];
            if (jv_write_str(&b, item)) {
                free(b.p);
                return jj_fail(c, "join: cannot convert item");
            }
        }
        *out = jj_strdup(c, b.p ? b.p : "", b.n);
        free(b.p);
        return 0;
    }
    default:
        break;
    }
    /* string filters: jinja converts the value with str() first */
    jj_value s;
    if (id < 0)
        return jj_fail(c, "unsupported filter '%s'", name);
    if (jj_str(c, v, &s))
        return -1;
    switch (id) {
    case JJ_FILTER_STRING:
        *out = s;
        return 0;
    case JJ_FILTER_TRIM:
        *out = jj_strip(s, ARG(0, "chars"), JJ_STRIP_BOTH);
        return 0;
    case JJ_FILTER_UPPER:
        *out = jj_map_case(c, s, JJ_CASE_UPPER);
        return 0;
    case JJ_FILTER_LOWER:
        *out = jj_map_case(c, s, JJ_CASE_LOWER);
        return 0;
    case JJ_FILTER_CAPITALIZE:
        *out = jj_map_case(c, s, JJ_CASE_CAPITALIZE);
        return 0;
    case JJ_FILTER_TITLE:
        *out = jj_map_case(c, s, JJ_CASE_JINJA_TITLE);
        return 0;
    case JJ_FILTER_INDENT:
        return filter_indent(c, s, args, nargs, kwn, kwv, nkw, out);
    case JJ_FILTER_ESCAPE:
    case JJ_FILTER_E:
        *out = html_escape(c, s);
        return 0;
    case JJ_FILTER_REPLACE: {
        const jj_value *o = ARG(0, "old"), *nw = ARG(1, "new"), *cnt = ARG(2, "count");
        jj_value os, ns;
        if (!o || !nw)
            return jj_fail(c, "replace needs old and new");
        if (jj_str(c, *o, &os) || jj_str(c, *nw, &ns))
            return -1;
        *out = jj_replace(c, s, os, ns, cnt && cnt->kind == JV_INT ? cnt->u.i : -1);
        return 0;
    }
    default:
        return jj_fail(c, "unsupported filter '%s'", name);
    }
}
