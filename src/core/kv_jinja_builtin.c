/*
 * Jinja builtins used by chat templates: filters, tests, Python str/dict/
 * list methods and the globals transformers provides (range, namespace,
 * dict, raise_exception, strftime_now). Semantics follow jinja2 3.1 and
 * CPython; the parser refuses filter, test and method names not listed
 * here. Case mapping covers ASCII, Latin-1, Greek and Cyrillic only.
 */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kv_jinja.h"

/* ---- argument helpers ---- */

/* Positional index pos or keyword name; NULL if absent. */
static const jv *arg(const jv *args, int nargs, const char **kwn, const jv *kwv, int nkw, int pos, const char *name)
{
    if (pos >= 0 && pos < nargs) return &args[pos];
    for (int i = 0; i < nkw; i++)
        if (name && !strcmp(kwn[i], name)) return &kwv[i];
    return NULL;
}
#define ARG(pos, name) arg(args, nargs, kwn, kwv, nkw, pos, name)

static int need_str(jj_ctx *c, jv v, const char *what)
{
    if (v.kind == JV_STR) return 0;
    return jj_fail(c, "%s: expected a string, got %s", what, jv_type_name(v));
}

static jv dup_str(jj_ctx *c, const char *s, size_t n)
{
    char *p = jj_alloc(jj_ctx_arena(c), n + 1);
    if (!p) return jv_undef(NULL);
    memcpy(p, s, n);
    p[n] = 0;
    return jv_strn(p, n);
}

static int to_str(jj_ctx *c, jv v, jv *out)
{
    int ok;
    *out = jv_to_str(jj_ctx_arena(c), v, &ok);
    return ok ? 0 : jj_fail(c, "cannot convert %s to a string", jv_type_name(v));
}

/* ---- unicode helpers ---- */

static unsigned dec(const char *s, size_t n, size_t *len)
{
    const unsigned char *u = (const unsigned char *)s;
    unsigned c = u[0];
    int k = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    if ((size_t)k > n) k = 1;
    unsigned cp = k == 1 ? c : k == 2 ? c & 0x1F : k == 3 ? c & 0x0F : c & 0x07;
    for (int i = 1; i < k; i++) cp = (cp << 6) | (u[i] & 0x3F);
    *len = (size_t)k;
    return cp;
}

static size_t enc(char *o, unsigned cp)
{
    if (cp < 0x80) { o[0] = (char)cp; return 1; }
    if (cp < 0x800) { o[0] = (char)(0xC0 | (cp >> 6)); o[1] = (char)(0x80 | (cp & 0x3F)); return 2; }
    if (cp < 0x10000) {
        o[0] = (char)(0xE0 | (cp >> 12)); o[1] = (char)(0x80 | ((cp >> 6) & 0x3F)); o[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (char)(0xF0 | (cp >> 18)); o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (char)(0x80 | ((cp >> 6) & 0x3F)); o[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* Python str.isspace() code points. */
static int py_space(unsigned cp)
{
    return (cp >= 9 && cp <= 13) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 ||
           cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 ||
           cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

static unsigned to_upper(unsigned cp)
{
    if (cp >= 'a' && cp <= 'z') return cp - 32;
    if ((cp >= 0xE0 && cp <= 0xFE && cp != 0xF7)) return cp - 32;
    if (cp >= 0x3B1 && cp <= 0x3C9 && cp != 0x3C2) return cp - 32;
    if (cp >= 0x430 && cp <= 0x44F) return cp - 32;
    if (cp >= 0x450 && cp <= 0x45F) return cp - 80;
    return cp;
}

static unsigned to_lower(unsigned cp)
{
    if (cp >= 'A' && cp <= 'Z') return cp + 32;
    if ((cp >= 0xC0 && cp <= 0xDE && cp != 0xD7)) return cp + 32;
    if (cp >= 0x391 && cp <= 0x3A9 && cp != 0x3A2) return cp + 32;
    if (cp >= 0x410 && cp <= 0x42F) return cp + 32;
    if (cp >= 0x400 && cp <= 0x40F) return cp + 80;
    return cp;
}

static int is_cased_letter(unsigned cp) { return to_upper(cp) != cp || to_lower(cp) != cp; }

/* mode: 'u' upper, 'l' lower, 'c' capitalize, 't' Python title, 'j' jinja title */
static jv map_case(jj_ctx *c, jv s, char mode)
{
    char *o = jj_alloc(jj_ctx_arena(c), s.u.str.n + 1);
    if (!o) return jv_undef(NULL);
    size_t j = 0, i = 0;
    int prev_cased = 0, first = 1, word_start = 1;
    while (i < s.u.str.n) {
        size_t len;
        unsigned cp = dec(s.u.str.s + i, s.u.str.n - i, &len), r = cp;
        switch (mode) {
        case 'u': r = to_upper(cp); break;
        case 'l': r = to_lower(cp); break;
        case 'c': r = first ? to_upper(cp) : to_lower(cp); break;
        case 't': r = prev_cased ? to_lower(cp) : to_upper(cp); prev_cased = is_cased_letter(cp); break;
        case 'j':
            r = word_start ? to_upper(cp) : to_lower(cp);
            word_start = py_space(cp) || cp == '-' || cp == '(' || cp == '{' || cp == '[' || cp == '<';
            break;
        }
        /* same-length mapping in these ranges, except Cyrillic 0x400-0x45F stays 2 bytes */
        size_t w = enc(o + j, r);
        j += w;
        i += len;
        first = 0;
    }
    o[j] = 0;
    return jv_strn(o, j);
}

static int in_chars(unsigned cp, const jv *chars)
{
    if (!chars || chars->kind != JV_STR) return py_space(cp);
    size_t i = 0;
    while (i < chars->u.str.n) {
        size_t len;
        if (dec(chars->u.str.s + i, chars->u.str.n - i, &len) == cp) return 1;
        i += len;
    }
    return 0;
}

/* which: 1 left, 2 right, 3 both */
static jv strip(jv s, const jv *chars, int which)
{
    size_t b = 0, e = s.u.str.n, len;
    if (which & 1)
        while (b < e && in_chars(dec(s.u.str.s + b, e - b, &len), chars)) b += len;
    if (which & 2)
        while (e > b) {
            size_t k = e - 1;
            while (k > b && ((unsigned char)s.u.str.s[k] & 0xC0) == 0x80) k--;
            if (!in_chars(dec(s.u.str.s + k, e - k, &len), chars)) break;
            e = k;
        }
    return jv_strn(s.u.str.s + b, e - b);
}

static size_t cp_len(jv s)
{
    size_t n = 0;
    for (size_t i = 0; i < s.u.str.n; i++)
        if (((unsigned char)s.u.str.s[i] & 0xC0) != 0x80) n++;
    return n;
}

static jv replace(jj_ctx *c, jv s, jv old, jv new, int64_t count)
{
    jj_buf b = { 0 };
    size_t i = 0, done = 0;
    if (old.u.str.n == 0) { /* Python inserts new between every character */
        while ((count < 0 || (int64_t)done < count) && i <= s.u.str.n) {
            jj_buf_put(&b, new.u.str.s, new.u.str.n);
            done++;
            if (i == s.u.str.n) { i++; break; }
            size_t len;
            dec(s.u.str.s + i, s.u.str.n - i, &len);
            jj_buf_put(&b, s.u.str.s + i, len);
            i += len;
        }
        if (i < s.u.str.n) jj_buf_put(&b, s.u.str.s + i, s.u.str.n - i);
    } else {
        while (i < s.u.str.n) {
            const char *hit = (count < 0 || (int64_t)done < count) ?
                memmem(s.u.str.s + i, s.u.str.n - i, old.u.str.s, old.u.str.n) : NULL;
            if (!hit) { jj_buf_put(&b, s.u.str.s + i, s.u.str.n - i); break; }
            jj_buf_put(&b, s.u.str.s + i, (size_t)(hit - (s.u.str.s + i)));
            jj_buf_put(&b, new.u.str.s, new.u.str.n);
            i = (size_t)(hit - s.u.str.s) + old.u.str.n;
            done++;
        }
    }
    jv r = b.oom ? jv_undef(NULL) : dup_str(c, b.p ? b.p : "", b.n);
    free(b.p);
    return r;
}

/* Python str.split / rsplit. */
static int split(jj_ctx *c, jv s, const jv *sep, int64_t maxsplit, int right, jv *out)
{
    jj_arena *a = jj_ctx_arena(c);
    jv l = jv_new_list(a, 4);
    if (l.kind != JV_LIST) return jj_fail(c, "out of memory");
    const char *p = s.u.str.s;
    size_t n = s.u.str.n;
    if (sep && sep->kind == JV_STR) {
        if (sep->u.str.n == 0) return jj_fail(c, "empty separator");
        size_t sl = sep->u.str.n;
        if (!right) {
            size_t i = 0;
            int64_t k = 0;
            for (;;) {
                const char *hit = (maxsplit < 0 || k < maxsplit) ? memmem(p + i, n - i, sep->u.str.s, sl) : NULL;
                if (!hit) { jv_list_push(a, l, jv_strn(p + i, n - i)); break; }
                jv_list_push(a, l, jv_strn(p + i, (size_t)(hit - (p + i))));
                i = (size_t)(hit - p) + sl;
                k++;
            }
        } else {
            jv parts = jv_new_list(a, 4);
            size_t e = n;
            int64_t k = 0;
            for (;;) {
                const char *hit = NULL;
                if ((maxsplit < 0 || k < maxsplit) && e >= sl)
                    for (size_t j = e - sl + 1; j-- > 0;)
                        if (!memcmp(p + j, sep->u.str.s, sl)) { hit = p + j; break; }
                if (!hit) { jv_list_push(a, parts, jv_strn(p, e)); break; }
                jv_list_push(a, parts, jv_strn(hit + sl, e - (size_t)(hit - p) - sl));
                e = (size_t)(hit - p);
                k++;
            }
            for (size_t j = parts.u.list->n; j-- > 0;) jv_list_push(a, l, parts.u.list->items[j]);
        }
        *out = l;
        return 0;
    }
    if (right && maxsplit >= 0) return jj_fail(c, "rsplit() on whitespace with maxsplit is not supported");
    size_t i = 0, len;
    int64_t k = 0;
    while (i < n) {
        while (i < n && py_space(dec(p + i, n - i, &len))) i += len;
        if (i >= n) break;
        if (maxsplit >= 0 && k >= maxsplit) { /* the remainder keeps its trailing whitespace */
            jv_list_push(a, l, jv_strn(p + i, n - i));
            break;
        }
        size_t start = i;
        while (i < n && !py_space(dec(p + i, n - i, &len))) i += len;
        jv_list_push(a, l, jv_strn(p + start, i - start));
        k++;
    }
    *out = l;
    return 0;
}

static int affix(jj_ctx *c, jv s, jv x, int end, int *res)
{
    if (x.kind == JV_LIST && x.u.list->tuple) {
        *res = 0;
        for (size_t i = 0; i < x.u.list->n && !*res; i++)
            if (affix(c, s, x.u.list->items[i], end, res)) return -1;
        return 0;
    }
    if (need_str(c, x, end ? "endswith" : "startswith")) return -1;
    size_t n = x.u.str.n;
    *res = n <= s.u.str.n && !memcmp(s.u.str.s + (end ? s.u.str.n - n : 0), x.u.str.s, n);
    return 0;
}

static jv make_items(jj_ctx *c, jv d)
{
    jj_arena *a = jj_ctx_arena(c);
    jv l = jv_new_list(a, d.u.dict->n);
    for (size_t i = 0; i < d.u.dict->n; i++) {
        jv t = jv_new_list(a, 2);
        t.u.list->tuple = 1;
        jv_list_push(a, t, d.u.dict->keys[i]);
        jv_list_push(a, t, d.u.dict->vals[i]);
        jv_list_push(a, l, t);
    }
    return l;
}

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
        if (a0 && a0->kind != JV_STR && a0->kind != JV_NONE) return need_str(c, *a0, m);
        *out = strip(s, a0, m[0] == 'l' ? 1 : m[0] == 'r' ? 2 : 3);
        return 0;
    }
    if (!strcmp(m, "startswith") || !strcmp(m, "endswith")) {
        int r;
        if (!a0) return jj_fail(c, "%s() takes at least 1 argument", m);
        if (affix(c, s, *a0, m[0] == 'e', &r)) return -1;
        *out = jv_bool(r);
        return 0;
    }
    if (!strcmp(m, "split") || !strcmp(m, "rsplit")) {
        const jv *sep = ARG(0, "sep"), *mx = ARG(1, "maxsplit");
        if (sep && sep->kind != JV_STR && sep->kind != JV_NONE) return need_str(c, *sep, m);
        return split(c, s, sep, mx && mx->kind == JV_INT ? mx->u.i : -1, m[0] == 'r', out);
    }
    if (!strcmp(m, "upper") || !strcmp(m, "lower") || !strcmp(m, "title") || !strcmp(m, "capitalize")) {
        *out = map_case(c, s, m[0] == 'u' ? 'u' : m[0] == 'l' ? 'l' : m[0] == 't' ? 't' : 'c');
        return 0;
    }
    if (!strcmp(m, "replace")) {
        if (!a0 || !a1 || need_str(c, *a0, m) || need_str(c, *a1, m)) return a0 && a1 ? -1 : jj_fail(c, "replace() takes 2 arguments");
        *out = replace(c, s, *a0, *a1, a2 && a2->kind == JV_INT ? a2->u.i : -1);
        return 0;
    }
    if (!strcmp(m, "find") || !strcmp(m, "rfind") || !strcmp(m, "count") || !strcmp(m, "index")) {
        if (!a0 || need_str(c, *a0, m)) return a0 ? -1 : jj_fail(c, "%s() takes 1 argument", m);
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
        if (pos >= 0) pos = (int64_t)cp_len(jv_strn(p, (size_t)pos));
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
        *out = dup_str(c, b.p ? b.p : "", b.n);
        free(b.p);
        return 0;
    }
    if (!strncmp(m, "is", 2)) {
        int r = s.u.str.n > 0;
        for (size_t i = 0; i < s.u.str.n && r; i++) {
            unsigned char ch = (unsigned char)s.u.str.s[i];
            if (ch >= 0x80) return jj_fail(c, "%s() on non-ASCII text is not supported", m);
            r = !strcmp(m, "isdigit") ? isdigit(ch) : !strcmp(m, "isspace") ? py_space(ch) :
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
        if (!strcmp(m, "items")) { *out = make_items(c, self); return 0; }
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

/* ---- filters ---- */

static const char *const filters[] = {
    "tojson", "trim", "length", "count", "upper", "lower", "capitalize", "title", "replace",
    "default", "d", "first", "last", "join", "list", "items", "selectattr", "rejectattr", "map",
    "select", "reject", "string", "int", "float", "abs", "reverse", "safe", "unique", "dictsort",
    "sort", "indent", "escape", "e", "sum", "min", "max", NULL,
};

int jj_filter_known(const char *name)
{
    for (int i = 0; filters[i]; i++)
        if (!strcmp(filters[i], name)) return 1;
    return 0;
}

/* getattr along a dotted path ("function.name"), as jinja's make_attrgetter. */
static jv attr_path(jj_ctx *c, jv v, jv path)
{
    if (path.kind == JV_INT) return jj_getitem(c, v, path);
    const char *p = path.u.str.s, *end = p + path.u.str.n;
    while (p < end && v.kind != JV_UNDEF) {
        const char *dot = memchr(p, '.', (size_t)(end - p));
        size_t n = dot ? (size_t)(dot - p) : (size_t)(end - p);
        jv key = dup_str(c, p, n);
        int digits = n > 0;
        for (size_t i = 0; i < n; i++) digits &= isdigit((unsigned char)p[i]) != 0;
        v = jj_getitem(c, v, digits ? jv_int(strtoll(key.u.str.s, NULL, 10)) : key);
        p += n + 1;
    }
    return v;
}

/* select/reject/selectattr/rejectattr */
static int filter_select(jj_ctx *c, jv seq, const char *name, const jv *args, int nargs, jv *out)
{
    int by_attr = strstr(name, "attr") != NULL, reject = name[0] == 'r';
    const jv *items;
    size_t n;
    if (jj_iterate(c, seq, &items, &n)) return -1;
    if (by_attr && nargs < 1) return jj_fail(c, "%s needs an attribute name", name);
    int targ = by_attr ? 1 : 0;
    const char *test = NULL;
    if (nargs > targ) {
        if (args[targ].kind != JV_STR) return jj_fail(c, "%s: test name must be a string", name);
        test = dup_str(c, args[targ].u.str.s, args[targ].u.str.n).u.str.s;
        if (!jj_test_known(test)) return jj_fail(c, "unsupported test '%s'", test);
    }
    jv l = jv_new_list(jj_ctx_arena(c), n);
    for (size_t i = 0; i < n; i++) {
        jv v = by_attr ? attr_path(c, items[i], args[0]) : items[i];
        int r;
        if (jj_failed(c)) return -1;
        if (test) {
            if (jj_call_test(c, test, v, args + targ + 1, nargs - targ - 1, &r)) return -1;
        } else {
            r = jv_truthy(v);
        }
        if (r != reject) jv_list_push(jj_ctx_arena(c), l, items[i]);
    }
    *out = l;
    return 0;
}

static int filter_map(jj_ctx *c, jv seq, const jv *args, int nargs, const char **kwn, const jv *kwv, int nkw, jv *out)
{
    const jv *items;
    size_t n;
    if (jj_iterate(c, seq, &items, &n)) return -1;
    const jv *attr = ARG(-1, "attribute"), *def = ARG(-1, "default");
    jv l = jv_new_list(jj_ctx_arena(c), n);
    for (size_t i = 0; i < n; i++) {
        jv v;
        if (attr) {
            v = attr_path(c, items[i], *attr);
            if (v.kind == JV_UNDEF && def) v = *def;
        } else {
            if (nargs < 1 || args[0].kind != JV_STR) return jj_fail(c, "map needs a filter name or attribute=");
            jv fname = dup_str(c, args[0].u.str.s, args[0].u.str.n);
            if (!jj_filter_known(fname.u.str.s)) return jj_fail(c, "unsupported filter '%s'", fname.u.str.s);
            if (jj_call_filter(c, fname.u.str.s, items[i], args + 1, nargs - 1, NULL, NULL, 0, &v)) return -1;
        }
        jv_list_push(jj_ctx_arena(c), l, v);
    }
    *out = l;
    return 0;
}

/* Stable merge sort of items by keys (Python's sorted()); reverse as sorted(reverse=True). */
static int sort_by_keys(jj_ctx *c, jv *items, jv *keys, size_t n, int reverse)
{
    if (n < 2) return 0;
    size_t h = n / 2;
    if (sort_by_keys(c, items, keys, h, reverse) || sort_by_keys(c, items + h, keys + h, n - h, reverse)) return -1;
    jv *ti = jj_alloc(jj_ctx_arena(c), n * sizeof *ti), *tk = jj_alloc(jj_ctx_arena(c), n * sizeof *tk);
    if (!ti || !tk) return jj_fail(c, "out of memory");
    size_t i = 0, j = h, k = 0;
    while (i < h && j < n) {
        int cmp;
        if (jj_order(c, keys[j], keys[i], &cmp)) return -1;
        int take_right = reverse ? cmp > 0 : cmp < 0; /* ties keep the left (earlier) item */
        ti[k] = take_right ? items[j] : items[i];
        tk[k++] = take_right ? keys[j++] : keys[i++];
    }
    while (i < h) { ti[k] = items[i]; tk[k++] = keys[i++]; }
    while (j < n) { ti[k] = items[j]; tk[k++] = keys[j++]; }
    memcpy(items, ti, n * sizeof *ti);
    memcpy(keys, tk, n * sizeof *tk);
    return 0;
}

/* dictsort(case_sensitive=False, by='key', reverse=False) and sort(reverse, case_sensitive, attribute) */
static int filter_sort(jj_ctx *c, const char *name, jv v, const jv *args, int nargs,
                       const char **kwn, const jv *kwv, int nkw, jv *out)
{
    int dict = name[0] == 'd';
    const jv *cs = dict ? ARG(0, "case_sensitive") : ARG(1, "case_sensitive");
    const jv *rev = dict ? ARG(2, "reverse") : ARG(0, "reverse");
    const jv *by = dict ? ARG(1, "by") : NULL, *attr = dict ? NULL : ARG(2, "attribute");
    int by_value = by && jv_is_str(*by, "value");
    if (by && !by_value && !jv_is_str(*by, "key")) return jj_fail(c, "You can only sort by either \"key\" or \"value\"");
    jv items;
    if (dict) {
        if (v.kind != JV_DICT) return jj_fail(c, "dictsort: not a mapping");
        items = make_items(c, v);
    } else {
        const jv *it;
        size_t n;
        if (jj_iterate(c, v, &it, &n)) return -1;
        items = jv_new_list(jj_ctx_arena(c), n);
        for (size_t i = 0; i < n; i++) jv_list_push(jj_ctx_arena(c), items, it[i]);
    }
    size_t n = items.u.list->n;
    jv *keys = jj_alloc(jj_ctx_arena(c), (n + 1) * sizeof *keys);
    if (!keys) return jj_fail(c, "out of memory");
    for (size_t i = 0; i < n; i++) {
        jv it = items.u.list->items[i];
        jv k = dict ? it.u.list->items[by_value ? 1 : 0] : attr ? attr_path(c, it, *attr) : it;
        if (jj_failed(c)) return -1;
        if (k.kind == JV_STR && !(cs && jv_truthy(*cs))) k = map_case(c, k, 'l');
        keys[i] = k;
    }
    if (sort_by_keys(c, items.u.list->items, keys, n, rev && jv_truthy(*rev))) return -1;
    *out = items;
    return 0;
}

/* Length of the line break at s (Python str.splitlines() breaks), 0 if none. */
static size_t line_break(const char *s, size_t n)
{
    unsigned char c = (unsigned char)s[0];
    if (c == '\r') return n > 1 && s[1] == '\n' ? 2 : 1;
    if (c == '\n' || c == '\v' || c == '\f' || (c >= 0x1c && c <= 0x1e)) return 1;
    if (n > 1 && c == 0xC2 && (unsigned char)s[1] == 0x85) return 2;
    if (n > 2 && c == 0xE2 && (unsigned char)s[1] == 0x80 && ((unsigned char)s[2] == 0xA8 || (unsigned char)s[2] == 0xA9)) return 3;
    return 0;
}

/* jinja2's indent(width=4, first=False, blank=False): the lines of s + "\n" (splitlines)
 * joined with "\n", each after the first indented unless empty (or always, with blank). */
static int filter_indent(jj_ctx *c, jv s, const jv *args, int nargs, const char **kwn, const jv *kwv, int nkw, jv *out)
{
    const jv *w = ARG(0, "width"), *first = ARG(1, "first"), *bl = ARG(2, "blank");
    int blank = bl && jv_truthy(*bl);
    jv ind = jv_strn("    ", 4);
    if (w && w->kind == JV_STR) {
        ind = *w;
    } else if (w && (w->kind == JV_INT || w->kind == JV_BOOL)) {
        size_t k = w->u.i > 0 ? (size_t)(w->u.i > 1024 ? 1024 : w->u.i) : 0;
        char *sp = jj_alloc(jj_ctx_arena(c), k + 1);
        if (!sp) return jj_fail(c, "out of memory");
        memset(sp, ' ', k);
        ind = jv_strn(sp, k);
    } else if (w) {
        return jj_fail(c, "indent: width must be an integer or a string");
    }
    jj_buf b = { 0 };
    if (first && jv_truthy(*first)) jj_buf_put(&b, ind.u.str.s, ind.u.str.n);
    size_t i = 0, n = s.u.str.n;
    for (int line = 0;; line++) {
        size_t e = i, br = 0;
        while (e < n && !(br = line_break(s.u.str.s + e, n - e))) e++;
        if (line > 0) {
            jj_buf_putc(&b, '\n');
            if (e > i || blank) jj_buf_put(&b, ind.u.str.s, ind.u.str.n);
        }
        jj_buf_put(&b, s.u.str.s + i, e - i);
        if (!br) break;          /* the appended "\n" ends this last line */
        i = e + br;
        if (i == n) {            /* s ended with a break: one more, empty, line */
            jj_buf_putc(&b, '\n');
            if (blank) jj_buf_put(&b, ind.u.str.s, ind.u.str.n);
            break;
        }
    }
    *out = dup_str(c, b.p ? b.p : "", b.n);
    free(b.p);
    return b.oom ? jj_fail(c, "out of memory") : 0;
}

static jv html_escape(jj_ctx *c, jv s)
{
    jj_buf b = { 0 };
    for (size_t i = 0; i < s.u.str.n; i++) {
        char ch = s.u.str.s[i];
        switch (ch) {
        case '&': jj_buf_puts(&b, "&amp;"); break;
        case '<': jj_buf_puts(&b, "&lt;"); break;
        case '>': jj_buf_puts(&b, "&gt;"); break;
        case '"': jj_buf_puts(&b, "&#34;"); break;
        case '\'': jj_buf_puts(&b, "&#39;"); break;
        default: jj_buf_putc(&b, ch);
        }
    }
    jv r = dup_str(c, b.p ? b.p : "", b.n);
    free(b.p);
    return r;
}

/* sum(attribute=None, start=0), min/max(case_sensitive=False, attribute=None) */
static int filter_aggregate(jj_ctx *c, const char *name, jv v, const jv *args, int nargs,
                            const char **kwn, const jv *kwv, int nkw, jv *out)
{
    const jv *items;
    size_t n;
    if (jj_iterate(c, v, &items, &n)) return -1;
    if (name[1] == 'u') {
        const jv *attr = ARG(0, "attribute"), *start = ARG(1, "start");
        jv acc = start ? *start : jv_int(0);
        for (size_t i = 0; i < n; i++) {
            jv x = attr ? attr_path(c, items[i], *attr) : items[i];
            int fl = acc.kind == JV_FLOAT || x.kind == JV_FLOAT;
            if ((acc.kind != JV_INT && acc.kind != JV_BOOL && acc.kind != JV_FLOAT) ||
                (x.kind != JV_INT && x.kind != JV_BOOL && x.kind != JV_FLOAT))
                return jj_fail(c, "sum: unsupported operand types");
            double fa = acc.kind == JV_FLOAT ? acc.u.f : (double)acc.u.i, fx = x.kind == JV_FLOAT ? x.u.f : (double)x.u.i;
            acc = fl ? jv_float(fa + fx) : jv_int(acc.u.i + x.u.i);
        }
        *out = acc;
        return 0;
    }
    const jv *cs = ARG(0, "case_sensitive"), *attr = ARG(1, "attribute");
    if (n == 0) { *out = jv_undef(NULL); return 0; }
    jv best = items[0], bkey = attr ? attr_path(c, items[0], *attr) : items[0];
    if (bkey.kind == JV_STR && !(cs && jv_truthy(*cs))) bkey = map_case(c, bkey, 'l');
    for (size_t i = 1; i < n; i++) {
        jv k = attr ? attr_path(c, items[i], *attr) : items[i];
        int cmp;
        if (k.kind == JV_STR && !(cs && jv_truthy(*cs))) k = map_case(c, k, 'l');
        if (jj_order(c, k, bkey, &cmp)) return -1;
        if (name[1] == 'i' ? cmp < 0 : cmp > 0) { best = items[i]; bkey = k; }
    }
    *out = best;
    return 0;
}

static int filter_tojson(jj_ctx *c, jv v, const jv *args, int nargs, const char **kwn, const jv *kwv, int nkw, jv *out)
{
    const jv *ea = ARG(0, "ensure_ascii"), *ind = ARG(1, "indent"), *sep = ARG(2, "separators"), *sk = ARG(3, "sort_keys");
    if (ea && jv_truthy(*ea)) return jj_fail(c, "tojson(ensure_ascii=True) is not supported");
    int indent = -1;
    if (ind && ind->kind != JV_NONE) {
        if (ind->kind != JV_INT) return jj_fail(c, "tojson: indent must be an integer");
        indent = (int)(ind->u.i < 0 ? 0 : ind->u.i > 64 ? 64 : ind->u.i);
    }
    const char *item_sep = indent >= 0 ? "," : ", ", *key_sep = ": ";
    if (sep && sep->kind != JV_NONE) {
        if (sep->kind != JV_LIST || sep->u.list->n != 2 || sep->u.list->items[0].kind != JV_STR ||
            sep->u.list->items[1].kind != JV_STR)
            return jj_fail(c, "tojson: separators must be a pair of strings");
        item_sep = dup_str(c, sep->u.list->items[0].u.str.s, sep->u.list->items[0].u.str.n).u.str.s;
        key_sep = dup_str(c, sep->u.list->items[1].u.str.s, sep->u.list->items[1].u.str.n).u.str.s;
    }
    jj_buf b = { 0 };
    if (jv_write_json(&b, v, indent, item_sep, key_sep, sk && jv_truthy(*sk), 0)) {
        free(b.p);
        return jj_fail(c, "Object of type %s is not JSON serializable", jv_type_name(v));
    }
    *out = dup_str(c, b.p ? b.p : "", b.n);
    free(b.p);
    return b.oom ? jj_fail(c, "out of memory") : 0;
}

static int filter_int(jj_ctx *c, jv v, const jv *def, int is_float, jv *out)
{
    jv d = def ? *def : is_float ? jv_float(0) : jv_int(0);
    switch (v.kind) {
    case JV_INT: case JV_BOOL: *out = is_float ? jv_float((double)v.u.i) : jv_int(v.u.i); return 0;
    case JV_FLOAT: *out = is_float ? v : jv_int((int64_t)v.u.f); return 0;
    case JV_STR: {
        char buf[64];
        if (v.u.str.n >= sizeof buf) { *out = d; return 0; }
        memcpy(buf, v.u.str.s, v.u.str.n);
        buf[v.u.str.n] = 0;
        char *end;
        if (!is_float) {
            long long i = strtoll(buf, &end, 10);
            while (*end && isspace((unsigned char)*end)) end++;
            if (end != buf && !*end) { *out = jv_int(i); return 0; }
        }
        if (strpbrk(buf, "xXpP")) { *out = d; return 0; } /* strtod would read hex floats */
        double f = strtod(buf, &end);
        while (*end && isspace((unsigned char)*end)) end++;
        *out = end != buf && !*end ? (is_float ? jv_float(f) : jv_int((int64_t)f)) : d;
        return 0;
    }
    default: *out = d; return 0;
    }
}

int jj_call_filter(jj_ctx *c, const char *name, jv v, const jv *args, int nargs,
                   const char **kwn, const jv *kwv, int nkw, jv *out)
{
    jj_arena *a = jj_ctx_arena(c);
    if (!strcmp(name, "default") || !strcmp(name, "d")) {
        const jv *dv = ARG(0, "default_value"), *bo = ARG(1, "boolean");
        int use = v.kind == JV_UNDEF || (bo && jv_truthy(*bo) && !jv_truthy(v));
        *out = use ? (dv ? *dv : jv_strn("", 0)) : v;
        return 0;
    }
    if (!strcmp(name, "tojson")) return filter_tojson(c, v, args, nargs, kwn, kwv, nkw, out);
    if (!strcmp(name, "safe")) { *out = v; return 0; }
    if (!strcmp(name, "length") || !strcmp(name, "count")) {
        if (v.kind == JV_STR) *out = jv_int((int64_t)cp_len(v));
        else if (v.kind == JV_LIST) *out = jv_int((int64_t)v.u.list->n);
        else if (v.kind == JV_DICT || v.kind == JV_NS) *out = jv_int((int64_t)v.u.dict->n);
        else if (v.kind == JV_UNDEF) *out = jv_int(0);
        else return jj_fail(c, "object of type '%s' has no len()", jv_type_name(v));
        return 0;
    }
    if (!strcmp(name, "items")) {
        if (v.kind == JV_UNDEF) { *out = jv_new_list(a, 0); return 0; }
        if (v.kind != JV_DICT) return jj_fail(c, "Can only get item pairs from a mapping.");
        *out = make_items(c, v);
        return 0;
    }
    if (!strcmp(name, "int") || !strcmp(name, "float"))
        return filter_int(c, v, ARG(0, "default"), name[0] == 'f', out);
    if (!strcmp(name, "abs")) {
        if (v.kind == JV_INT || v.kind == JV_BOOL) *out = jv_int(v.u.i < 0 ? -v.u.i : v.u.i);
        else if (v.kind == JV_FLOAT) *out = jv_float(v.u.f < 0 ? -v.u.f : v.u.f);
        else return jj_fail(c, "bad operand type for abs(): '%s'", jv_type_name(v));
        return 0;
    }
    if (!strcmp(name, "selectattr") || !strcmp(name, "rejectattr") || !strcmp(name, "select") || !strcmp(name, "reject"))
        return filter_select(c, v, name, args, nargs, out);
    if (!strcmp(name, "map")) return filter_map(c, v, args, nargs, kwn, kwv, nkw, out);
    if (!strcmp(name, "dictsort") || !strcmp(name, "sort")) return filter_sort(c, name, v, args, nargs, kwn, kwv, nkw, out);
    if (!strcmp(name, "sum") || !strcmp(name, "min") || !strcmp(name, "max"))
        return filter_aggregate(c, name, v, args, nargs, kwn, kwv, nkw, out);
    if (!strcmp(name, "list") || !strcmp(name, "first") || !strcmp(name, "last") || !strcmp(name, "reverse") ||
        !strcmp(name, "join") || !strcmp(name, "unique")) {
        const jv *items;
        size_t n;
        if (!strcmp(name, "reverse") && v.kind == JV_STR) {
            if (jj_iterate(c, v, &items, &n)) return -1;
            jj_buf b = { 0 };
            for (size_t i = n; i-- > 0;) jj_buf_put(&b, items[i].u.str.s, items[i].u.str.n);
            *out = dup_str(c, b.p ? b.p : "", b.n);
            free(b.p);
            return 0;
        }
        if (jj_iterate(c, v, &items, &n)) return -1;
        if (name[0] == 'f') { *out = n ? items[0] : jv_undef(NULL); return 0; }
        if (name[0] == 'l' && name[1] == 'a') { *out = n ? items[n - 1] : jv_undef(NULL); return 0; }
        if (name[0] == 'j') {
            const jv *sep = ARG(0, "d"), *attr = ARG(1, "attribute");
            jj_buf b = { 0 };
            for (size_t i = 0; i < n; i++) {
                if (i && sep && sep->kind == JV_STR) jj_buf_put(&b, sep->u.str.s, sep->u.str.n);
                jv item = attr ? attr_path(c, items[i], *attr) : items[i];
                if (jv_write_str(&b, item)) { free(b.p); return jj_fail(c, "join: cannot convert item"); }
            }
            *out = dup_str(c, b.p ? b.p : "", b.n);
            free(b.p);
            return 0;
        }
        jv l = jv_new_list(a, n);
        for (size_t i = 0; i < n; i++) {
            jv item = name[0] == 'r' ? items[n - 1 - i] : items[i];
            int dup = 0;
            if (name[0] == 'u')
                for (size_t k = 0; k < l.u.list->n && !dup; k++) dup = jv_equal(l.u.list->items[k], item);
            if (!dup) jv_list_push(a, l, item);
        }
        *out = l;
        return 0;
    }
    /* string filters: jinja converts the value with str() first */
    jv s;
    if (to_str(c, v, &s)) return -1;
    if (!strcmp(name, "string")) { *out = s; return 0; }
    if (!strcmp(name, "trim")) { const jv *ch = ARG(0, "chars"); *out = strip(s, ch, 3); return 0; }
    if (!strcmp(name, "upper")) { *out = map_case(c, s, 'u'); return 0; }
    if (!strcmp(name, "lower")) { *out = map_case(c, s, 'l'); return 0; }
    if (!strcmp(name, "capitalize")) { *out = map_case(c, s, 'c'); return 0; }
    if (!strcmp(name, "title")) { *out = map_case(c, s, 'j'); return 0; }
    if (!strcmp(name, "indent")) return filter_indent(c, s, args, nargs, kwn, kwv, nkw, out);
    if (!strcmp(name, "escape") || !strcmp(name, "e")) { *out = html_escape(c, s); return 0; }
    if (!strcmp(name, "replace")) {
        const jv *o = ARG(0, "old"), *nw = ARG(1, "new"), *cnt = ARG(2, "count");
        jv os, ns;
        if (!o || !nw) return jj_fail(c, "replace needs old and new");
        if (to_str(c, *o, &os) || to_str(c, *nw, &ns)) return -1;
        *out = replace(c, s, os, ns, cnt && cnt->kind == JV_INT ? cnt->u.i : -1);
        return 0;
    }
    return jj_fail(c, "unsupported filter '%s'", name);
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
        if (to_str(c, v, &s)) return -1;
        jv m = map_case(c, s, t[0] == 'l' ? 'l' : 'u');
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
    int64_t count = v[2] > 0 ? (v[1] - v[0] + v[2] - 1) / v[2] : (v[0] - v[1] - v[2] - 1) / -v[2];
    if (count < 0) count = 0;
    if (count > 100000) return jj_fail(c, "Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
    jv l = jv_new_list(jj_ctx_arena(c), (size_t)count);
    for (int64_t i = 0; i < count; i++) jv_list_push(jj_ctx_arena(c), l, jv_int(v[0] + i * v[2]));
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
        if (to_str(c, msg, &msg)) return -1;
        return jj_fail(c, "%.*s", (int)msg.u.str.n, msg.u.str.s);
    }
    case F_STRFTIME: {
        if (nargs != 1 || args[0].kind != JV_STR) return jj_fail(c, "strftime_now expects a format string");
        jv fmt = dup_str(c, args[0].u.str.s, args[0].u.str.n);
        time_t t = (time_t)jj_ctx_now(c);
        struct tm tm;
        char buf[256];
        if (!localtime_r(&t, &tm)) return jj_fail(c, "strftime_now: bad time");
        size_t n = strftime(buf, sizeof buf, fmt.u.str.s, &tm);
        if (n == 0 && fmt.u.str.n) return jj_fail(c, "strftime_now: format too long");
        *out = dup_str(c, buf, n);
        return 0;
    }
    }
    return jj_fail(c, "unknown function");
}
