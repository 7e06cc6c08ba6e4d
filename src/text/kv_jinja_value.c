/*
 * Jinja values: constructors, the per-render arena, JSON input conversion,
 * truthiness and equality with Python's rules, and the three ways a value
 * becomes text: str() (what {{ }} prints), repr() (inside containers) and
 * json.dumps (transformers' tojson filter).
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include <utf8proc.h>

#include "kv_jinja.h"

/* ---- arena ---- */

struct jj_chunk {
    jj_chunk *next;
    size_t used, cap;
    max_align_t data[];
};

static jj_chunk *new_chunk(jj_arena *a, size_t cap)
{
    if (a->failed)
        return NULL;
    if (cap > JJ_ARENA_MAX - a->total) {
        a->failed = JJ_ARENA_OVER;
        return NULL;
    }
    jj_chunk *c = malloc(sizeof *c + cap);
    if (!c) {
        a->failed = JJ_ARENA_OOM;
        return NULL;
    }
    a->total += cap;
    c->used = 0;
    c->cap = cap;
    c->next = NULL;
    return c;
}

void *jj_alloc(jj_arena *a, size_t n)
{
    if (a->failed)
        return NULL;
    if (n > JJ_ARENA_MAX) {
        a->failed = JJ_ARENA_OVER;
        return NULL;
    }
    n = (n + sizeof(max_align_t) - 1) / sizeof(max_align_t) * sizeof(max_align_t);
    jj_chunk *c = a->head;
    if (!c || c->cap - c->used < n) {
        c = new_chunk(a, n > 16384 ? n : 16384);
        if (!c)
            return NULL;
        c->next = a->head;
        a->head = c;
    }
    void *p = (char *)c->data + c->used;
    c->used += n;
    return p;
}

void jj_arena_free(jj_arena *a)
{
    jj_chunk *lists[2] = {a->head, a->big};
    for (int i = 0; i < 2; i++)
        for (jj_chunk *c = lists[i], *next; c; c = next) {
            next = c->next;
            free(c);
        }
    memset(a, 0, sizeof *a);
}

/* Strings shorter than this are copied when appended to: no chunk of their own. */
#define GROW_MIN 1024

jj_value jv_str_append(jj_arena *a, jj_value x, const char *y, size_t yn)
{
    size_t xn = x.u.str.n, n = xn + yn;
    if (yn == 0)
        return x;
    if (n < xn || n >= JJ_ARENA_MAX) {
        a->failed = JJ_ARENA_OVER;
        return jv_undef(NULL);
    }
    /* x is the whole content of a growing string's chunk: append after it */
    for (int i = 0; i < JJ_GROW_SLOTS; i++) {
        jj_chunk *g = a->grow[i];
        char *d = g ? (char *)g->data : NULL;
        if (g && d == x.u.str.s && g->used == xn + 1 && g->cap > n) {
            memmove(d + xn, y, yn);
            d[n] = 0;
            g->used = n + 1;
            return jv_strn(d, n);
        }
    }
    char *d;
    if (n < GROW_MIN) {
        d = jj_alloc(a, n + 1);
        if (!d)
            return jv_undef(NULL);
    } else {
        /* a chunk of its own with room to double, so that appending again is in place;
         * the copies left behind sum to less than the final string */
        jj_chunk *g = new_chunk(a, 2 * (n + 1) <= JJ_ARENA_MAX - a->total ? 2 * (n + 1) : n + 1);
        if (!g)
            return jv_undef(NULL);
        g->next = a->big;
        a->big = g;
        g->used = n + 1;
        a->grow[a->grow_next++ % JJ_GROW_SLOTS] = g;
        d = (char *)g->data;
    }
    memcpy(d, x.u.str.s, xn);
    memcpy(d + xn, y, yn);
    d[n] = 0;
    return jv_strn(d, n);
}

/* ---- constructors ---- */

jj_value jv_undef(const char *name)
{
    jj_value v = {.kind = JV_UNDEF};
    v.u.str.s = name;
    v.u.str.n = name ? strlen(name) : 0;
    return v;
}
jj_value jv_none(void)
{
    jj_value v = {.kind = JV_NONE};
    return v;
}
jj_value jv_bool(int b)
{
    jj_value v = {.kind = JV_BOOL};
    v.u.i = b != 0;
    return v;
}
jj_value jv_int(int64_t i)
{
    jj_value v = {.kind = JV_INT};
    v.u.i = i;
    return v;
}
jj_value jv_float(double f)
{
    jj_value v = {.kind = JV_FLOAT};
    v.u.f = f;
    return v;
}
jj_value jv_strn(const char *s, size_t n)
{
    jj_value v = {.kind = JV_STR};
    v.u.str.s = s;
    v.u.str.n = n;
    return v;
}
jj_value jv_bigint(const char *digits, size_t n)
{
    jj_value v = jv_strn(digits, n);
    v.kind = JV_BIGINT;
    return v;
}

jj_value jv_cstr(const char *s)
{
    return jv_strn(s, strlen(s));
}

jj_value jv_new_list(jj_arena *a, size_t cap)
{
    jj_value v = {.kind = JV_LIST};
    if (cap > JJ_ARENA_MAX / sizeof(jj_value)) {
        a->failed = JJ_ARENA_OVER;
        return jv_undef(NULL);
    }
    v.u.list = jj_alloc(a, sizeof(jj_list));
    if (!v.u.list)
        return jv_undef(NULL);
    memset(v.u.list, 0, sizeof(jj_list));
    if (cap) {
        v.u.list->items = jj_alloc(a, cap * sizeof(jj_value));
        if (!v.u.list->items)
            return jv_undef(NULL); /* not a list short of its capacity: callers fill it */
        v.u.list->cap = cap;
    }
    return v;
}

jj_value jv_new_dict(jj_arena *a, size_t cap)
{
    jj_value v = {.kind = JV_DICT};
    if (cap > JJ_ARENA_MAX / sizeof(jj_value)) {
        a->failed = JJ_ARENA_OVER;
        return jv_undef(NULL);
    }
    v.u.dict = jj_alloc(a, sizeof(jj_dict));
    if (!v.u.dict)
        return jv_undef(NULL);
    memset(v.u.dict, 0, sizeof(jj_dict));
    v.u.dict->a = a;
    if (cap) {
        v.u.dict->keys = jj_alloc(a, cap * sizeof(jj_value));
        v.u.dict->vals = jj_alloc(a, cap * sizeof(jj_value));
        if (!v.u.dict->keys || !v.u.dict->vals)
            return jv_undef(NULL);
        v.u.dict->cap = cap;
    }
    return v;
}

static int grow(jj_arena *a, jj_value **arr, size_t n, size_t *cap)
{
    size_t nc = *cap ? *cap * 2 : 4;
    if (nc > JJ_ARENA_MAX / sizeof(jj_value)) {
        a->failed = JJ_ARENA_OVER;
        return -1;
    }
    jj_value *p = jj_alloc(a, nc * sizeof(jj_value));
    if (!p)
        return -1;
    if (n)
        memcpy(p, *arr, n * sizeof(jj_value));
    *arr = p;
    *cap = nc;
    return 0;
}

void jv_list_push(jj_arena *a, jj_value list, jj_value item)
{
    jj_list *l = list.u.list;
    if (l->n == l->cap && grow(a, &l->items, l->n, &l->cap))
        return;
    l->items[l->n++] = item;
}

/* ---- dict index ---- */

/* Fewer keys than this are scanned: no index to build for the small dicts of a template. */
#define DICT_INDEX_MIN 16

/* SipHash-1-3 with a per-process random key: keys come from requests, and a hash an
 * attacker can collide would make the index a list again. */
static uint64_t sip_k0, sip_k1;
static pthread_once_t sip_once = PTHREAD_ONCE_INIT;

static void sip_init(void)
{
    uint64_t k[2];
    if (getrandom(k, sizeof k, GRND_NONBLOCK) != (ssize_t)sizeof k) {
        k[0] = (uint64_t)time(NULL) * 0x9E3779B97F4A7C15ULL ^ (uint64_t)(uintptr_t)&k;
        k[1] = (uint64_t)(uintptr_t)&sip_k0 * 0xC2B2AE3D27D4EB4FULL ^ (uint64_t)clock();
    }
    sip_k0 = k[0];
    sip_k1 = k[1];
}

#define ROTL(x, b) (((x) << (b)) | ((x) >> (64 - (b))))
#define SIPROUND                                                                                   \
    do {                                                                                           \
        v0 += v1;                                                                                  \
        v1 = ROTL(v1, 13) ^ v0;                                                                    \
        v0 = ROTL(v0, 32);                                                                         \
        v2 += v3;                                                                                  \
        v3 = ROTL(v3, 16) ^ v2;                                                                    \
        v0 += v3;                                                                                  \
        v3 = ROTL(v3, 21) ^ v0;                                                                    \
        v2 += v1;                                                                                  \
        v1 = ROTL(v1, 17) ^ v2;                                                                    \
        v2 = ROTL(v2, 32);                                                                         \
    } while (0)

static uint64_t siphash13(const void *src, size_t len)
{
    pthread_once(&sip_once, sip_init);
    const unsigned char *in = src;
    uint64_t v0 = sip_k0 ^ 0x736f6d6570736575ULL, v1 = sip_k1 ^ 0x646f72616e646f6dULL,
             v2 = sip_k0 ^ 0x6c7967656e657261ULL, v3 = sip_k1 ^ 0x7465646279746573ULL;
    uint64_t m, last = (uint64_t)len << 56;
    size_t i = 0;
    for (; i + 8 <= len; i += 8) {
        memcpy(&m, in + i, 8);
        v3 ^= m;
        SIPROUND;
        v0 ^= m;
    }
    for (size_t j = 0; i + j < len; j++)
        last |= (uint64_t)in[i + j] << (8 * j);
    v3 ^= last;
    SIPROUND;
    v0 ^= last;
    v2 ^= 0xff;
    SIPROUND;
    SIPROUND;
    SIPROUND;
    return v0 ^ v1 ^ v2 ^ v3;
}

/* Equal keys (jv_equal) hash equal: numbers by their value as a double, as 1 == 1.0 ==
 * True; containers and None by kind alone (rare as keys: they share one probe chain). */
static uint64_t hash_key(jj_value k)
{
    if (k.kind == JV_STR || k.kind == JV_BIGINT)
        return siphash13(k.u.str.s, k.u.str.n) ^ (k.kind == JV_BIGINT);
    if (k.kind == JV_INT || k.kind == JV_BOOL || k.kind == JV_FLOAT) {
        double f = k.kind == JV_FLOAT ? k.u.f : (double)k.u.i;
        if (f == 0)
            f = 0; /* -0.0 == 0.0 */
        return siphash13(&f, sizeof f) ^ 1;
    }
    return (uint64_t)k.kind * 0x9E3779B97F4A7C15ULL;
}

/* Indexes keys[nidx..n), keeping the first of equal keys (as a scan finds it); -1 if out
 * of memory (the dict is then scanned). */
static int index_catch_up(jj_dict *d)
{
    if (d->n < DICT_INDEX_MIN || !d->a || d->n > UINT32_MAX - 1)
        return d->nidx == d->n ? 0 : -1;
    if (d->n * 2 > d->idx_cap) {
        size_t cap = d->idx_cap ? d->idx_cap : 64;
        while (cap < d->n * 2)
            cap *= 2;
        uint32_t *idx = jj_alloc(d->a, cap * sizeof *idx);
        if (!idx) {
            d->idx = NULL;
            d->idx_cap = d->nidx = 0;
            return -1;
        }
        memset(idx, 0, cap * sizeof *idx);
        d->idx = idx;
        d->idx_cap = cap;
        d->nidx = 0;
    }
    for (; d->nidx < d->n; d->nidx++) {
        size_t mask = d->idx_cap - 1, i = hash_key(d->keys[d->nidx]) & mask;
        while (d->idx[i] && !jv_equal(d->keys[d->idx[i] - 1], d->keys[d->nidx]))
            i = (i + 1) & mask;
        if (!d->idx[i])
            d->idx[i] = (uint32_t)d->nidx + 1;
    }
    return 0;
}

/* The position of key in d, or -1. */
static ptrdiff_t dict_pos(jj_dict *d, jj_value key)
{
    if (index_catch_up(d) == 0 && d->idx) {
        size_t mask = d->idx_cap - 1, i = hash_key(key) & mask;
        for (; d->idx[i]; i = (i + 1) & mask)
            if (jv_equal(d->keys[d->idx[i] - 1], key))
                return (ptrdiff_t)d->idx[i] - 1;
        return -1;
    }
    for (size_t i = 0; i < d->n; i++)
        if (jv_equal(d->keys[i], key))
            return (ptrdiff_t)i;
    return -1;
}

int jv_dict_put(jj_arena *a, jj_value dict, jj_value key, jj_value val)
{
    jj_dict *d = dict.u.dict;
    ptrdiff_t i = dict_pos(d, key);
    if (i >= 0) {
        d->vals[i] = val;
        return 0;
    }
    if (d->n == d->cap) {
        size_t cap = d->cap;
        if (grow(a, &d->keys, d->n, &cap))
            return -1;
        if (grow(a, &d->vals, d->n, &d->cap))
            return -1;
    }
    d->keys[d->n] = key;
    d->vals[d->n++] = val;
    return 0;
}

void jv_dict_set(jj_arena *a, jj_value dict, jj_value key, jj_value val)
{
    jv_dict_put(a, dict, key, val);
}

void jv_dict_clear(jj_dict *d)
{
    d->n = d->nidx = 0;
    if (d->idx)
        memset(d->idx, 0, d->idx_cap * sizeof *d->idx);
}

const jj_value *jv_dict_get(jj_value dict, const char *key, size_t n)
{
    ptrdiff_t i = dict_pos(dict.u.dict, jv_strn(key, n));
    return i < 0 ? NULL : &dict.u.dict->vals[i];
}

const jj_value *jv_dict_find(jj_value dict, jj_value key)
{
    ptrdiff_t i = dict_pos(dict.u.dict, key);
    return i < 0 ? NULL : &dict.u.dict->vals[i];
}

/* JSON -> values; strings are borrowed from the (const, caller-owned) JSON. */
jj_value jv_from_json(jj_arena *a, const json_t *j)
{
    switch (json_typeof(j)) {
    case JSON_OBJECT: {
        jj_value d = jv_new_dict(a, json_object_size(j));
        if (d.kind != JV_DICT)
            return d;
        const char *k;
        json_t *v;
        json_object_foreach((json_t *)j, k, v)
        {
            jj_dict *dd = d.u.dict;
            if (dd->n < dd->cap) {
                dd->keys[dd->n] = jv_cstr(k);
                dd->vals[dd->n++] = jv_from_json(a, v);
            }
        }
        return d;
    }
    case JSON_ARRAY: {
        jj_value l = jv_new_list(a, json_array_size(j));
        if (l.kind != JV_LIST)
            return l;
        for (size_t i = 0; i < json_array_size(j) && i < l.u.list->cap; i++)
            l.u.list->items[l.u.list->n++] = jv_from_json(a, json_array_get(j, i));
        return l;
    }
    case JSON_STRING:
        return jv_strn(json_string_value(j), json_string_length(j));
    case JSON_INTEGER:
        return jv_int(json_integer_value(j));
    case JSON_REAL:
        return jv_float(json_real_value(j));
    case JSON_TRUE:
        return jv_bool(1);
    case JSON_FALSE:
        return jv_bool(0);
    default:
        return jv_none();
    }
}

int jv_truthy(jj_value v)
{
    switch (v.kind) {
    case JV_UNDEF:
    case JV_NONE:
        return 0;
    case JV_BOOL:
    case JV_INT:
        return v.u.i != 0;
    case JV_FLOAT:
        return v.u.f != 0.0;
    case JV_STR:
        return v.u.str.n != 0;
    case JV_LIST:
        return v.u.list->n != 0;
    case JV_DICT:
        return v.u.dict->n != 0;
    default:
        return 1;
    }
}

static int is_num(jj_value v)
{
    return v.kind == JV_BOOL || v.kind == JV_INT || v.kind == JV_FLOAT;
}
static double num(jj_value v)
{
    return v.kind == JV_FLOAT ? v.u.f : (double)v.u.i;
}

/* Values nest at most this deep when compared or printed: Python's recursion limit, so it
 * fails about where Python raises RecursionError, and the C stack stays small. A template
 * can nest a list in a list in a loop, 100000 deep. */
#define MAX_VALUE_DEPTH 1000

static int equal(jj_value a, jj_value b, int depth);

int jv_equal(jj_value a, jj_value b)
{
    return equal(a, b, 0);
}

/* Past MAX_VALUE_DEPTH values compare unequal (there is no error to give from here). */
static int equal(jj_value a, jj_value b, int depth)
{
    if (is_num(a) && is_num(b)) {
        if (a.kind != JV_FLOAT && b.kind != JV_FLOAT)
            return a.u.i == b.u.i;
        return num(a) == num(b);
    }
    if (a.kind != b.kind || depth > MAX_VALUE_DEPTH)
        return 0;
    switch (a.kind) {
    case JV_UNDEF:
    case JV_NONE:
        return 1;
    case JV_STR:
    case JV_BIGINT: /* digits without leading zeros: equal values, equal text */
        return a.u.str.n == b.u.str.n && !memcmp(a.u.str.s, b.u.str.s, a.u.str.n);
    case JV_LIST:
        if (a.u.list == b.u.list) /* Python compares items by identity first */
            return 1;
        if (a.u.list->n != b.u.list->n || a.u.list->tuple != b.u.list->tuple)
            return 0;
        for (size_t i = 0; i < a.u.list->n; i++)
            if (!equal(a.u.list->items[i], b.u.list->items[i], depth + 1))
                return 0;
        return 1;
    case JV_DICT:
        if (a.u.dict == b.u.dict)
            return 1;
        if (a.u.dict->n != b.u.dict->n)
            return 0;
        for (size_t i = 0; i < a.u.dict->n; i++) {
            const jj_value *o = jv_dict_find(b, a.u.dict->keys[i]);
            if (!o || !equal(a.u.dict->vals[i], *o, depth + 1))
                return 0;
        }
        return 1;
    case JV_NS:
        return a.u.dict == b.u.dict;
    case JV_LOOP:
        return a.u.loop == b.u.loop;
    case JV_FUNC:
        return a.u.i == b.u.i;
    case JV_MACRO:
        return a.u.macro == b.u.macro;
    default:
        return 0;
    }
}

int jv_is_str(jj_value v, const char *s)
{
    return v.kind == JV_STR && v.u.str.n == strlen(s) && !memcmp(v.u.str.s, s, v.u.str.n);
}

const char *jv_type_name(jj_value v)
{
    static const char *const names[] = {
        "Undefined", "NoneType",  "bool",        "int",      "float",  "str",   "list",
        "dict",      "Namespace", "LoopContext", "function", "method", "Macro",
        "int",
    };
    if (v.kind == JV_LIST && v.u.list->tuple)
        return "tuple";
    return names[v.kind];
}

/* ---- output buffer ---- */

void jj_buf_put(jj_buf *b, const char *s, size_t n)
{
    if (b->oom || n == 0)
        return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

void jj_buf_putc(jj_buf *b, char c)
{
    jj_buf_put(b, &c, 1);
}
void jj_buf_puts(jj_buf *b, const char *s)
{
    jj_buf_put(b, s, strlen(s));
}

/* ---- numbers ---- */

/* Python's repr(float): shortest round-trip digits, positional for 1e-4 <= |x| < 1e16. */
void jv_write_float(jj_buf *b, double f)
{
    if (isnan(f)) {
        jj_buf_puts(b, "nan");
        return;
    }
    if (isinf(f)) {
        jj_buf_puts(b, f < 0 ? "-inf" : "inf");
        return;
    }
    char tmp[40];
    int prec;
    for (prec = 1; prec < 17; prec++) {
        snprintf(tmp, sizeof tmp, "%.*e", prec - 1, f);
        if (strtod(tmp, NULL) == f)
            break;
    }
    snprintf(tmp, sizeof tmp, "%.*e", prec - 1, f);
    /* tmp = [-]d[.ddd]e[+-]XX: split into digits and exponent. */
    char digits[24];
    int nd = 0, neg = tmp[0] == '-';
    char *p = tmp + neg;
    for (; *p && *p != 'e'; p++)
        if (*p != '.')
            digits[nd++] = *p;
    int exp = atoi(p + 1);
    while (nd > 1 && digits[nd - 1] == '0')
        nd--;
    digits[nd] = 0;
    char out[64];
    int o = 0;
    if (neg)
        out[o++] = '-';
    if (exp >= -4 && exp < 16) {
        if (exp < 0) {
            out[o++] = '0';
            out[o++] = '.';
            for (int i = -1; i > exp; i--)
                out[o++] = '0';
            for (int i = 0; i < nd; i++)
                out[o++] = digits[i];
        } else {
            for (int i = 0; i <= exp; i++)
                out[o++] = i < nd ? digits[i] : '0';
            out[o++] = '.';
            if (nd > exp + 1)
                for (int i = exp + 1; i < nd; i++)
                    out[o++] = digits[i];
            else
                out[o++] = '0';
        }
        out[o] = 0;
    } else {
        out[o++] = digits[0];
        if (nd > 1) {
            out[o++] = '.';
            for (int i = 1; i < nd; i++)
                out[o++] = digits[i];
        }
        snprintf(out + o, sizeof out - (size_t)o, "e%c%02d", exp < 0 ? '-' : '+',
                 exp < 0 ? -exp : exp);
    }
    jj_buf_puts(b, out);
}

static void write_int(jj_buf *b, int64_t i)
{
    char tmp[24];
    snprintf(tmp, sizeof tmp, "%lld", (long long)i);
    jj_buf_puts(b, tmp);
}

/* ---- repr ---- */

static unsigned utf8_decode(const unsigned char *s, size_t n, size_t *len)
{
    unsigned c = s[0];
    int k = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (k == 0 || (size_t)k > n) {
        *len = 1;
        return c;
    }
    unsigned cp = k == 1 ? c : k == 2 ? c & 0x1F : k == 3 ? c & 0x0F : c & 0x07;
    for (int i = 1; i < k; i++)
        cp = (cp << 6) | (s[i] & 0x3F);
    *len = (size_t)k;
    return cp;
}

/* Python's repr() escapes what str.isprintable() refuses: the categories Cc, Cf, Cs, Co,
 * Cn (unassigned), Zl, Zp and Zs other than the space (utf8proc's tables; its Unicode
 * version may differ from Python's by a few new characters). */
static int nonprintable(unsigned cp)
{
    if (cp < 0x7F)
        return cp < 0x20;
    if (cp >= 0xD800 && cp <= 0xDFFF)
        return 1; /* a surrogate (an escape in the template can make one) */
    switch (utf8proc_category((utf8proc_int32_t)cp)) {
    case UTF8PROC_CATEGORY_CC:
    case UTF8PROC_CATEGORY_CF:
    case UTF8PROC_CATEGORY_CS:
    case UTF8PROC_CATEGORY_CO:
    case UTF8PROC_CATEGORY_CN:
    case UTF8PROC_CATEGORY_ZL:
    case UTF8PROC_CATEGORY_ZP:
    case UTF8PROC_CATEGORY_ZS:
        return 1;
    default:
        return 0;
    }
}

static void write_repr_str(jj_buf *b, const char *s, size_t n)
{
    int has_sq = memchr(s, '\'', n) != NULL, has_dq = memchr(s, '"', n) != NULL;
    char q = has_sq && !has_dq ? '"' : '\'';
    jj_buf_putc(b, q);
    size_t i = 0;
    while (i < n) {
        size_t len;
        unsigned cp = utf8_decode((const unsigned char *)s + i, n - i, &len);
        char tmp[16];
        if (cp == (unsigned char)q || cp == '\\') {
            jj_buf_putc(b, '\\');
            jj_buf_putc(b, (char)cp);
        } else if (cp == '\n') {
            jj_buf_puts(b, "\\n");
        } else if (cp == '\r') {
            jj_buf_puts(b, "\\r");
        } else if (cp == '\t') {
            jj_buf_puts(b, "\\t");
        } else if (nonprintable(cp)) {
            if (cp < 0x100)
                snprintf(tmp, sizeof tmp, "\\x%02x", cp);
            else if (cp < 0x10000)
                snprintf(tmp, sizeof tmp, "\\u%04x", cp);
            else
                snprintf(tmp, sizeof tmp, "\\U%08x", cp);
            jj_buf_puts(b, tmp);
        } else {
            jj_buf_put(b, s + i, len);
        }
        i += len;
    }
    jj_buf_putc(b, q);
}

/* The containers being printed, innermost first: as Python's Py_ReprEnter, a container
 * met again inside itself (a namespace holding itself) prints as [...] or {...}. */
typedef struct printing {
    const void *p;
    const struct printing *up;
    int depth;
} printing;

static int write_str(jj_buf *b, jj_value v, const printing *up);

/* Whether p is being printed; else pushes it as *me (0), or -1 when nested too deeply. */
static int enter(printing *me, const void *p, const printing *up)
{
    for (const printing *q = up; q; q = q->up)
        if (q->p == p)
            return 1;
    *me = (printing){p, up, up ? up->depth + 1 : 1};
    return me->depth > MAX_VALUE_DEPTH ? -1 : 0;
}

static int write_repr(jj_buf *b, jj_value v, const printing *up)
{
    printing me;
    int e;
    switch (v.kind) {
    case JV_STR:
        write_repr_str(b, v.u.str.s, v.u.str.n);
        return 0;
    case JV_LIST: {
        jj_list *l = v.u.list;
        if ((e = enter(&me, l, up)) != 0) {
            jj_buf_puts(b, l->tuple ? "(...)" : "[...]");
            return e < 0 ? -1 : 0;
        }
        jj_buf_putc(b, l->tuple ? '(' : '[');
        for (size_t i = 0; i < l->n; i++) {
            if (i)
                jj_buf_puts(b, ", ");
            if (write_repr(b, l->items[i], &me))
                return -1;
        }
        if (l->tuple && l->n == 1)
            jj_buf_putc(b, ',');
        jj_buf_putc(b, l->tuple ? ')' : ']');
        return 0;
    }
    case JV_DICT: {
        jj_dict *d = v.u.dict;
        if ((e = enter(&me, d, up)) != 0) {
            jj_buf_puts(b, "{...}");
            return e < 0 ? -1 : 0;
        }
        jj_buf_putc(b, '{');
        for (size_t i = 0; i < d->n; i++) {
            if (i)
                jj_buf_puts(b, ", ");
            if (write_repr(b, d->keys[i], &me))
                return -1;
            jj_buf_puts(b, ": ");
            if (write_repr(b, d->vals[i], &me))
                return -1;
        }
        jj_buf_putc(b, '}');
        return 0;
    }
    default:
        return write_str(b, v, up);
    }
}

int jv_write_repr(jj_buf *b, jj_value v)
{
    return write_repr(b, v, NULL);
}

int jv_write_str(jj_buf *b, jj_value v)
{
    return write_str(b, v, NULL);
}

static int write_str(jj_buf *b, jj_value v, const printing *up)
{
    switch (v.kind) {
    case JV_UNDEF:
        return 0;
    case JV_NONE:
        jj_buf_puts(b, "None");
        return 0;
    case JV_BOOL:
        jj_buf_puts(b, v.u.i ? "True" : "False");
        return 0;
    case JV_INT:
        write_int(b, v.u.i);
        return 0;
    case JV_FLOAT:
        jv_write_float(b, v.u.f);
        return 0;
    case JV_STR:
    case JV_BIGINT:
        jj_buf_put(b, v.u.str.s, v.u.str.n);
        return 0;
    case JV_LIST:
    case JV_DICT:
        return write_repr(b, v, up);
    case JV_NS: {
        jj_value d = v;
        d.kind = JV_DICT;
        jj_buf_puts(b, "<Namespace ");
        if (write_repr(b, d, up))
            return -1;
        jj_buf_putc(b, '>');
        return 0;
    }
    default:
        return -1; /* functions, loops: Python prints addresses; refuse */
    }
}

jj_value jv_to_str(jj_arena *a, jj_value v, int *ok)
{
    *ok = 1;
    if (v.kind == JV_STR)
        return v;
    jj_buf b = {0};
    if (jv_write_str(&b, v) || b.oom) {
        free(b.p);
        *ok = 0;
        return jv_undef(NULL);
    }
    char *s = jj_alloc(a, b.n + 1);
    if (!s) {
        free(b.p);
        *ok = 0;
        return jv_undef(NULL);
    }
    if (b.n)
        memcpy(s, b.p, b.n);
    s[b.n] = 0;
    free(b.p);
    return jv_strn(s, b.n);
}

/* ---- json.dumps(ensure_ascii=False) ---- */

static void write_json_str(jj_buf *b, const char *s, size_t n)
{
    jj_buf_putc(b, '"');
    size_t start = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c != '"' && c != '\\')
            continue;
        jj_buf_put(b, s + start, i - start);
        start = i + 1;
        char tmp[8];
        switch (c) {
        case '"':
            jj_buf_puts(b, "\\\"");
            break;
        case '\\':
            jj_buf_puts(b, "\\\\");
            break;
        case '\n':
            jj_buf_puts(b, "\\n");
            break;
        case '\r':
            jj_buf_puts(b, "\\r");
            break;
        case '\t':
            jj_buf_puts(b, "\\t");
            break;
        case '\b':
            jj_buf_puts(b, "\\b");
            break;
        case '\f':
            jj_buf_puts(b, "\\f");
            break;
        default:
            snprintf(tmp, sizeof tmp, "\\u%04x", c);
            jj_buf_puts(b, tmp);
        }
    }
    jj_buf_put(b, s + start, n - start);
    jj_buf_putc(b, '"');
}

static void newline_indent(jj_buf *b, int indent, int level)
{
    jj_buf_putc(b, '\n');
    for (int i = 0; i < indent * level; i++)
        jj_buf_putc(b, ' ');
}

/* A dict key as json.dumps converts it: str as is; int/float/bool/None to text. */
static int write_json_key(jj_buf *b, jj_value k)
{
    if (k.kind == JV_STR) {
        write_json_str(b, k.u.str.s, k.u.str.n);
        return 0;
    }
    jj_buf_putc(b, '"');
    if (k.kind == JV_BOOL)
        jj_buf_puts(b, k.u.i ? "true" : "false");
    else if (k.kind == JV_NONE)
        jj_buf_puts(b, "null");
    else if (k.kind == JV_INT)
        write_int(b, k.u.i);
    else if (k.kind == JV_BIGINT)
        jj_buf_put(b, k.u.str.s, k.u.str.n);
    else if (k.kind == JV_FLOAT)
        jv_write_float(b, k.u.f);
    else
        return -1;
    jj_buf_putc(b, '"');
    return 0;
}

static int key_cmp(const jj_value *a, const jj_value *b)
{
    size_t n = a->u.str.n < b->u.str.n ? a->u.str.n : b->u.str.n;
    int c = memcmp(a->u.str.s, b->u.str.s, n);
    return c ? c : (a->u.str.n > b->u.str.n) - (a->u.str.n < b->u.str.n);
}

static int key_ptr_cmp(const void *a, const void *b)
{
    return key_cmp(*(const jj_value *const *)a, *(const jj_value *const *)b);
}

int jv_write_json(jj_buf *b, jj_value v, int indent, const char *item_sep, const char *key_sep,
                  int sort_keys, int level)
{
    if (level > MAX_VALUE_DEPTH)
        return -1; /* json.dumps raises RecursionError too */
    switch (v.kind) {
    case JV_NONE:
        jj_buf_puts(b, "null");
        return 0;
    case JV_BOOL:
        jj_buf_puts(b, v.u.i ? "true" : "false");
        return 0;
    case JV_INT:
        write_int(b, v.u.i);
        return 0;
    case JV_BIGINT:
        jj_buf_put(b, v.u.str.s, v.u.str.n);
        return 0;
    case JV_FLOAT:
        if (isnan(v.u.f))
            jj_buf_puts(b, "NaN");
        else if (isinf(v.u.f))
            jj_buf_puts(b, v.u.f < 0 ? "-Infinity" : "Infinity");
        else
            jv_write_float(b, v.u.f);
        return 0;
    case JV_STR:
        write_json_str(b, v.u.str.s, v.u.str.n);
        return 0;
    case JV_LIST: {
        jj_list *l = v.u.list;
        if (l->n == 0) {
            jj_buf_puts(b, "[]");
            return 0;
        }
        jj_buf_putc(b, '[');
        for (size_t i = 0; i < l->n; i++) {
            if (i)
                jj_buf_puts(b, item_sep);
            if (indent >= 0)
                newline_indent(b, indent, level + 1);
            if (jv_write_json(b, l->items[i], indent, item_sep, key_sep, sort_keys, level + 1))
                return -1;
        }
        if (indent >= 0)
            newline_indent(b, indent, level);
        jj_buf_putc(b, ']');
        return 0;
    }
    case JV_DICT: {
        jj_dict *d = v.u.dict;
        if (d->n == 0) {
            jj_buf_puts(b, "{}");
            return 0;
        }
        const jj_value **order = malloc(d->n * sizeof *order);
        if (!order)
            return -1;
        for (size_t i = 0; i < d->n; i++)
            order[i] = &d->keys[i];
        if (sort_keys) {
            for (size_t i = 0; i < d->n; i++)
                if (d->keys[i].kind != JV_STR) {
                    free(order);
                    return -1;
                }
            /* keys are distinct, so an unstable sort is fine; a request chooses how many */
            qsort(order, d->n, sizeof *order, key_ptr_cmp);
        }
        jj_buf_putc(b, '{');
        int rc = 0;
        for (size_t k = 0; k < d->n && !rc; k++) {
            size_t i = (size_t)(order[k] - d->keys);
            if (k)
                jj_buf_puts(b, item_sep);
            if (indent >= 0)
                newline_indent(b, indent, level + 1);
            rc = write_json_key(b, d->keys[i]);
            if (!rc) {
                jj_buf_puts(b, key_sep);
                rc = jv_write_json(b, d->vals[i], indent, item_sep, key_sep, sort_keys, level + 1);
            }
        }
        free(order);
        if (rc)
            return -1;
        if (indent >= 0)
            newline_indent(b, indent, level);
        jj_buf_putc(b, '}');
        return 0;
    }
    default:
        return -1; /* Undefined, namespace, functions: not JSON serializable */
    }
}
