/*
 * Python str semantics for the interpreter: UTF-8 code points, str.isspace(),
 * case mapping (ASCII, Latin-1, Greek and Cyrillic only), strip, replace,
 * split/rsplit, startswith/endswith, len(); plus the argument helpers that
 * filters and methods share.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_jinja.h"
#include "kv_unicode.h"

/* ---- argument helpers ---- */

/* Positional index pos or keyword name; NULL if absent. */
const jj_value *jj_arg(const jj_value *args, int nargs, const char **kwn, const jj_value *kwv,
                       int nkw, int pos, const char *name)
{
    if (pos >= 0 && pos < nargs)
        return &args[pos];
    for (int i = 0; i < nkw; i++)
        if (name && !strcmp(kwn[i], name))
            return &kwv[i];
    return NULL;
}

int jj_need_str(jj_ctx *c, jj_value v, const char *what)
{
    if (v.kind == JV_STR)
        return 0;
    return jj_fail(c, "%s: expected a string, got %s", what, jv_type_name(v));
}

jj_value jj_strdup(jj_ctx *c, const char *s, size_t n)
{
    char *p = jj_alloc(jj_ctx_arena(c), n + 1);
    if (!p)
        return jv_undef(NULL);
    memcpy(p, s, n);
    p[n] = 0;
    return jv_strn(p, n);
}

int jj_str(jj_ctx *c, jj_value v, jj_value *out)
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
    if ((size_t)k > n)
        k = 1;
    for (int i = 1; i < k; i++)
        if ((u[i] & 0xC0) != 0x80)
            k = 1; /* not a sequence: a stray byte, as Python's decoder would see it */
    unsigned cp = k == 1 ? c : k == 2 ? c & 0x1F : k == 3 ? c & 0x0F : c & 0x07;
    for (int i = 1; i < k; i++)
        cp = (cp << 6) | (u[i] & 0x3F);
    *len = (size_t)k;
    return cp;
}

/* Python str.isspace() code points. */
int jj_py_space(unsigned cp)
{
    return (cp >= 9 && cp <= 13) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0
           || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029
           || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

static unsigned to_upper(unsigned cp)
{
    if (cp >= 'a' && cp <= 'z')
        return cp - 32;
    if ((cp >= 0xE0 && cp <= 0xFE && cp != 0xF7))
        return cp - 32;
    if (cp >= 0x3B1 && cp <= 0x3C9 && cp != 0x3C2)
        return cp - 32;
    if (cp >= 0x430 && cp <= 0x44F)
        return cp - 32;
    if (cp >= 0x450 && cp <= 0x45F)
        return cp - 80;
    return cp;
}

static unsigned to_lower(unsigned cp)
{
    if (cp >= 'A' && cp <= 'Z')
        return cp + 32;
    if ((cp >= 0xC0 && cp <= 0xDE && cp != 0xD7))
        return cp + 32;
    if (cp >= 0x391 && cp <= 0x3A9 && cp != 0x3A2)
        return cp + 32;
    if (cp >= 0x410 && cp <= 0x42F)
        return cp + 32;
    if (cp >= 0x400 && cp <= 0x40F)
        return cp + 80;
    return cp;
}

static int is_cased_letter(unsigned cp)
{
    return to_upper(cp) != cp || to_lower(cp) != cp;
}

int jj_has_cased(jj_value s)
{
    size_t i = 0, len;
    while (i < s.u.str.n) {
        unsigned cp = dec(s.u.str.s + i, s.u.str.n - i, &len);
        if (!(len == 1 && cp >= 0x80) && is_cased_letter(cp))
            return 1;
        i += len;
    }
    return 0;
}

jj_value jj_map_case(jj_ctx *c, jj_value s, jj_case mode)
{
    char *o = jj_alloc(jj_ctx_arena(c), s.u.str.n + 1);
    if (!o)
        return jv_undef(NULL);
    size_t j = 0, i = 0;
    int prev_cased = 0, first = 1, word_start = 1;
    while (i < s.u.str.n) {
        size_t len;
        unsigned cp = dec(s.u.str.s + i, s.u.str.n - i, &len), r = cp;
        if (len == 1 && cp >= 0x80) {
            /* A stray byte of invalid UTF-8 is no letter: mapping it as the code point
             * of its value would write 2 bytes for 1, past the end of o. Copy it. */
            o[j++] = s.u.str.s[i++];
            prev_cased = first = word_start = 0;
            continue;
        }
        switch (mode) {
        case JJ_CASE_UPPER:
            r = to_upper(cp);
            break;
        case JJ_CASE_LOWER:
            r = to_lower(cp);
            break;
        case JJ_CASE_CAPITALIZE:
            r = first ? to_upper(cp) : to_lower(cp);
            break;
        case JJ_CASE_TITLE:
            r = prev_cased ? to_lower(cp) : to_upper(cp);
            prev_cased = is_cased_letter(cp);
            break;
        case JJ_CASE_JINJA_TITLE:
            r = word_start ? to_upper(cp) : to_lower(cp);
            word_start =
                jj_py_space(cp) || cp == '-' || cp == '(' || cp == '{' || cp == '[' || cp == '<';
            break;
        }
        /* The mappings above keep the length of a character's encoding; an unmapped
         * character is copied as it was (an overlong form must not grow either). */
        if (r == cp)
            memcpy(o + j, s.u.str.s + i, len);
        j += r == cp ? len : kv_utf8_put(o + j, r);
        i += len;
        first = 0;
    }
    o[j] = 0;
    return jv_strn(o, j);
}

static int in_chars(unsigned cp, const jj_value *chars)
{
    if (!chars || chars->kind != JV_STR)
        return jj_py_space(cp);
    size_t i = 0;
    while (i < chars->u.str.n) {
        size_t len;
        if (dec(chars->u.str.s + i, chars->u.str.n - i, &len) == cp)
            return 1;
        i += len;
    }
    return 0;
}

jj_value jj_strip(jj_value s, const jj_value *chars, jj_strip_side which)
{
    size_t b = 0, e = s.u.str.n, len;
    if (which & JJ_STRIP_LEFT)
        while (b < e && in_chars(dec(s.u.str.s + b, e - b, &len), chars))
            b += len;
    if (which & JJ_STRIP_RIGHT)
        while (e > b) {
            size_t k = e - 1;
            while (k > b && ((unsigned char)s.u.str.s[k] & 0xC0) == 0x80)
                k--;
            if (!in_chars(dec(s.u.str.s + k, e - k, &len), chars))
                break;
            e = k;
        }
    return jv_strn(s.u.str.s + b, e - b);
}

size_t jj_cp_len(jj_value s)
{
    size_t n = 0;
    for (size_t i = 0; i < s.u.str.n; i++)
        if (((unsigned char)s.u.str.s[i] & 0xC0) != 0x80)
            n++;
    return n;
}

jj_value jj_replace(jj_ctx *c, jj_value s, jj_value old, jj_value new, int64_t count)
{
    jj_buf b = {0};
    size_t i = 0, done = 0;
    if (old.u.str.n == 0) { /* Python inserts new between every character */
        while ((count < 0 || (int64_t)done < count) && i <= s.u.str.n) {
            jj_buf_put(&b, new.u.str.s, new.u.str.n);
            done++;
            if (i == s.u.str.n) {
                i++;
                break;
            }
            size_t len;
            dec(s.u.str.s + i, s.u.str.n - i, &len);
            jj_buf_put(&b, s.u.str.s + i, len);
            i += len;
        }
        if (i < s.u.str.n)
            jj_buf_put(&b, s.u.str.s + i, s.u.str.n - i);
    } else {
        while (i < s.u.str.n) {
            const char *hit = (count < 0 || (int64_t)done < count)
                                  ? memmem(s.u.str.s + i, s.u.str.n - i, old.u.str.s, old.u.str.n)
                                  : NULL;
            if (!hit) {
                jj_buf_put(&b, s.u.str.s + i, s.u.str.n - i);
                break;
            }
            jj_buf_put(&b, s.u.str.s + i, (size_t)(hit - (s.u.str.s + i)));
            jj_buf_put(&b, new.u.str.s, new.u.str.n);
            i = (size_t)(hit - s.u.str.s) + old.u.str.n;
            done++;
        }
    }
    jj_value r = b.oom ? jv_undef(NULL) : jj_strdup(c, b.p ? b.p : "", b.n);
    free(b.p);
    return r;
}

/* Python str.split / rsplit. */
int jj_split(jj_ctx *c, jj_value s, const jj_value *sep, int64_t maxsplit, int right, jj_value *out)
{
    jj_arena *a = jj_ctx_arena(c);
    jj_value l = jv_new_list(a, 4);
    if (l.kind != JV_LIST)
        return jj_oom(c);
    const char *p = s.u.str.s;
    size_t n = s.u.str.n;
    if (sep && sep->kind == JV_STR) {
        if (sep->u.str.n == 0)
            return jj_fail(c, "empty separator");
        size_t sl = sep->u.str.n;
        if (!right) {
            size_t i = 0;
            int64_t k = 0;
            for (;;) {
                const char *hit =
                    (maxsplit < 0 || k < maxsplit) ? memmem(p + i, n - i, sep->u.str.s, sl) : NULL;
                if (!hit) {
                    jv_list_push(a, l, jv_strn(p + i, n - i));
                    break;
                }
                jv_list_push(a, l, jv_strn(p + i, (size_t)(hit - (p + i))));
                i = (size_t)(hit - p) + sl;
                k++;
            }
        } else {
            jj_value parts = jv_new_list(a, 4);
            if (parts.kind != JV_LIST)
                return jj_oom(c);
            size_t e = n;
            int64_t k = 0;
            for (;;) {
                const char *hit = NULL;
                if ((maxsplit < 0 || k < maxsplit) && e >= sl)
                    for (size_t j = e - sl + 1; j-- > 0;)
                        if (!memcmp(p + j, sep->u.str.s, sl)) {
                            hit = p + j;
                            break;
                        }
                if (!hit) {
                    jv_list_push(a, parts, jv_strn(p, e));
                    break;
                }
                jv_list_push(a, parts, jv_strn(hit + sl, e - (size_t)(hit - p) - sl));
                e = (size_t)(hit - p);
                k++;
            }
            for (size_t j = parts.u.list->n; j-- > 0;)
                jv_list_push(a, l, parts.u.list->items[j]);
        }
        *out = l;
        return 0;
    }
    if (right && maxsplit >= 0)
        return jj_fail(c, "rsplit() on whitespace with maxsplit is not supported");
    size_t i = 0, len;
    int64_t k = 0;
    while (i < n) {
        while (i < n && jj_py_space(dec(p + i, n - i, &len)))
            i += len;
        if (i >= n)
            break;
        if (maxsplit >= 0 && k >= maxsplit) { /* the remainder keeps its trailing whitespace */
            jv_list_push(a, l, jv_strn(p + i, n - i));
            break;
        }
        size_t start = i;
        while (i < n && !jj_py_space(dec(p + i, n - i, &len)))
            i += len;
        jv_list_push(a, l, jv_strn(p + start, i - start));
        k++;
    }
    *out = l;
    return 0;
}

int jj_affix(jj_ctx *c, jj_value s, jj_value x, int end, int *res)
{
    if (x.kind == JV_LIST && x.u.list->tuple) {
        *res = 0;
        for (size_t i = 0; i < x.u.list->n && !*res; i++)
            if (jj_affix(c, s, x.u.list->items[i], end, res))
                return -1;
        return 0;
    }
    if (jj_need_str(c, x, end ? "endswith" : "startswith"))
        return -1;
    size_t n = x.u.str.n;
    *res = n <= s.u.str.n && !memcmp(s.u.str.s + (end ? s.u.str.n - n : 0), x.u.str.s, n);
    return 0;
}


jj_value jj_items(jj_ctx *c, jj_value d)
{
    jj_arena *a = jj_ctx_arena(c);
    jj_value l = jv_new_list(a, d.u.dict->n);
    if (l.kind != JV_LIST)
        return l;
    for (size_t i = 0; i < d.u.dict->n; i++) {
        jj_value t = jv_new_list(a, 2);
        if (t.kind != JV_LIST)
            return t;
        t.u.list->tuple = 1;
        jv_list_push(a, t, d.u.dict->keys[i]);
        jv_list_push(a, t, d.u.dict->vals[i]);
        jv_list_push(a, l, t);
    }
    return l;
}
