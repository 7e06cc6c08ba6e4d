/* JSON and MessagePack into a flat node array (see kv_tree.h). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_buf.h"
#include "kv_jscan.h"
#include "kv_tree.h"

#define MAX_NODES  (1u << 24)

typedef struct {
    kv_tree_t      *t;
    const uint8_t  *p, *end, *base;     /* MessagePack */
    kv_jscan_t     *js;                 /* JSON: the scanner keeps the place */
    char           *err;
    size_t          errlen;
} rd_t;

static int fail(rd_t *r, const char *fmt, ...)
{
    va_list ap;
    char    msg[160];

    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    if (r->js) {
        return kv_jscan_fail(r->js, "%s", msg);
    }
    snprintf(r->err, r->errlen, "%s at byte %zu", msg, (size_t) (r->p - r->base));
    return -1;
}

static long push(rd_t *r, uint8_t type)
{
    kv_tree_t  *t = r->t;
    kv_tnode_t *grown;

    if (t->n == t->cap) {
        if (t->cap >= MAX_NODES) {
            return fail(r, "document too large");
        }
        uint32_t cap = t->cap ? t->cap * 2 : 256;

        /* cap only once the memory is there: a failed realloc leaves the
         * old block, and a cap larger than it would let the next
         * document write past its end */
        grown = realloc(t->nodes, cap * sizeof(kv_tnode_t));
        if (grown == NULL) {
            return fail(r, "out of memory");
        }
        t->nodes = grown;
        t->cap = cap;
    }
    memset(&t->nodes[t->n], 0, sizeof(kv_tnode_t));
    t->nodes[t->n].type = type;
    return (long) t->n++;
}

/* --- JSON: nodes over the one JSON reader (kv_jscan.h) -------------------- */

static long push_leaf(rd_t *r, uint8_t type)
{
    long at = push(r, type);

    if (at >= 0) {
        r->t->nodes[at].end = r->t->n;
    }
    return at;
}

static int json_value(rd_t *r, int depth)
{
    kv_jscan_t *js = r->js;
    kv_jnum_t   num;
    const char *raw;
    size_t      len;
    long        at;
    uint32_t    n = 0;
    int         c = kv_jscan_peek(js), first = 1, more;

    switch (c) {
    case '{':
    case '[':
        if (depth >= KV_JSON_MAX_DEPTH) {
            return fail(r, "nested deeper than %d", KV_JSON_MAX_DEPTH);
        }
        if ((at = push(r, c == '{' ? KV_T_OBJ : KV_T_ARR)) < 0) {
            return -1;
        }
        js->p++;
        while ((more = kv_jscan_more(js, &first, c == '{' ? '}' : ']')) == 1) {
            if (c == '{') {
                /* the key is a string node before its value */
                if (kv_jscan_peek(js) != '"') {
                    return js->err ? -1 : fail(r, "expected a key");
                }
                if (json_value(r, depth + 1) != 0 || kv_jscan_expect(js, ':') < 0) {
                    return -1;
                }
            }
            if (json_value(r, depth + 1) != 0) {
                return -1;
            }
            n++;
        }
        if (more < 0) {
            return -1;
        }
        r->t->nodes[at].n = n;
        r->t->nodes[at].end = r->t->n;
        return 0;

    case '"':
        if (kv_jscan_string_raw(js, &raw, &len, NULL) < 0 || (at = push_leaf(r, KV_T_STR)) < 0) {
            return -1;
        }
        r->t->nodes[at].s = raw;
        r->t->nodes[at].len = (uint32_t) len;
        return 0;

    case 't': return kv_jscan_literal(js, "true") < 0 || push_leaf(r, KV_T_TRUE) < 0 ? -1 : 0;
    case 'f': return kv_jscan_literal(js, "false") < 0 || push_leaf(r, KV_T_FALSE) < 0 ? -1 : 0;
    case 'n': return kv_jscan_literal(js, "null") < 0 || push_leaf(r, KV_T_NULL) < 0 ? -1 : 0;

    default:
        if (kv_jscan_number(js, &num) < 0) {
            return -1;
        }
        if (num.kind == KV_JNUM_BIG) {
            return fail(r, "integer out of 64-bit range");
        }
        at = push_leaf(r, num.kind == KV_JNUM_FLOAT ? KV_T_FLOAT
                          : num.kind == KV_JNUM_NEG ? KV_T_NEG : KV_T_UINT);
        if (at < 0) {
            return -1;
        }
        r->t->nodes[at].u = num.u;
        r->t->nodes[at].s = num.text;
        return 0;
    }
}

int kv_tree_json(kv_tree_t *t, const char *buf, size_t len, char *err, size_t errlen)
{
    kv_jscan_t js;
    rd_t       r = { t, NULL, NULL, NULL, &js, err, errlen };

    kv_jscan_init_err(&js, buf, len, err, errlen);
    t->n = 0;
    if (json_value(&r, 0) != 0) {
        t->n = 0;
        return -1;
    }
    kv_jscan_peek(&js);     /* past trailing spaces */
    if (js.p != js.end) {
        t->n = 0;
        return fail(&r, "trailing data");
    }
    return 0;
}

/* --- MessagePack ---------------------------------------------------------- */

static int need(rd_t *r, size_t n)
{
    return (size_t) (r->end - r->p) >= n ? 0 : fail(r, "truncated");
}

static int mp_value(rd_t *r, int depth);

static int mp_scalar(rd_t *r, uint8_t type, uint64_t u)
{
    long at = push(r, type);

    if (at < 0) {
        return -1;
    }
    r->t->nodes[at].u = u;
    r->t->nodes[at].end = r->t->n;
    return 0;
}

static int mp_bytes(rd_t *r, uint8_t type, size_t n)
{
    long at;

    if (need(r, n) != 0 || (at = push(r, type)) < 0) {
        return -1;
    }
    r->t->nodes[at].s = (const char *) r->p;
    r->t->nodes[at].len = (uint32_t) n;
    r->t->nodes[at].end = r->t->n;
    r->p += n;
    return 0;
}

static int mp_container(rd_t *r, int depth, int obj, uint64_t n)
{
    long     at;
    uint64_t i;

    if (depth >= KV_JSON_MAX_DEPTH) {
        return fail(r, "nested deeper than %d", KV_JSON_MAX_DEPTH);
    }
    if (n > (uint64_t) (r->end - r->p)) {
        return fail(r, "container longer than the message");
    }
    if ((at = push(r, obj ? KV_T_OBJ : KV_T_ARR)) < 0) {
        return -1;
    }
    for (i = 0; i < n * (obj ? 2 : 1); i++) {
        if (mp_value(r, depth + 1) != 0) {
            return -1;
        }
        if (obj && i % 2 == 0 && r->t->nodes[r->t->n - 1].type != KV_T_STR) {
            return fail(r, "map key is not a string");
        }
    }
    r->t->nodes[at].n = (uint32_t) n;
    r->t->nodes[at].end = r->t->n;
    return 0;
}

static int mp_value(rd_t *r, int depth)
{
    uint8_t c;
    int64_t sv;

    if (need(r, 1) != 0) {
        return -1;
    }
    c = *r->p++;
    if (c <= 0x7f) return mp_scalar(r, KV_T_UINT, c);
    if (c >= 0xe0) return mp_scalar(r, KV_T_NEG, (uint64_t) (int64_t) (int8_t) c);
    if ((c & 0xf0) == 0x80) return mp_container(r, depth, 1, c & 0x0f);
    if ((c & 0xf0) == 0x90) return mp_container(r, depth, 0, c & 0x0f);
    if ((c & 0xe0) == 0xa0) return mp_bytes(r, KV_T_STR, c & 0x1f);
    switch (c) {
    case 0xc0: return mp_scalar(r, KV_T_NULL, 0);
    case 0xc2: return mp_scalar(r, KV_T_FALSE, 0);
    case 0xc3: return mp_scalar(r, KV_T_TRUE, 0);
    case 0xcc: case 0xcd: case 0xce: case 0xcf: {
        int n = 1 << (c - 0xcc);
        if (need(r, (size_t) n) != 0) return -1;
        r->p += n;
        return mp_scalar(r, KV_T_UINT, kv_be(r->p - n, n));
    }
    case 0xd0: case 0xd1: case 0xd2: case 0xd3: {
        int n = 1 << (c - 0xd0);
        uint64_t v;
        if (need(r, (size_t) n) != 0) return -1;
        v = kv_be(r->p, n);
        r->p += n;
        /* sign-extend from n bytes */
        sv = n == 8 ? (int64_t) v : (int64_t) (v << (64 - 8 * n)) >> (64 - 8 * n);
        return mp_scalar(r, sv < 0 ? KV_T_NEG : KV_T_UINT, (uint64_t) sv);
    }
    case 0xca: case 0xcb:
        if (need(r, c == 0xca ? 4 : 8) != 0) return -1;
        r->p += c == 0xca ? 4 : 8;
        return mp_scalar(r, KV_T_FLOAT, 0);
    case 0xd9: case 0xda: case 0xdb:
    case 0xc4: case 0xc5: case 0xc6: {
        int n = c >= 0xd9 ? 1 << (c - 0xd9) : 1 << (c - 0xc4);
        uint64_t len;
        if (need(r, (size_t) n) != 0) return -1;
        len = kv_be(r->p, n);
        r->p += n;
        return mp_bytes(r, c >= 0xd9 ? KV_T_STR : KV_T_BIN, (size_t) len);
    }
    case 0xdc: case 0xdd: case 0xde: case 0xdf: {
        int n = (c == 0xdc || c == 0xde) ? 2 : 4;
        uint64_t len;
        if (need(r, (size_t) n) != 0) return -1;
        len = kv_be(r->p, n);
        r->p += n;
        return mp_container(r, depth, c >= 0xde, len);
    }
    default:
        r->p--;
        return fail(r, "unsupported msgpack type 0x%02x", c);
    }
}

int kv_tree_msgpack(kv_tree_t *t, const void *buf, size_t len, char *err, size_t errlen)
{
    rd_t r = { t, buf, (const uint8_t *) buf + len, buf, NULL, err, errlen };

    t->n = 0;
    if (mp_value(&r, 0) != 0) {
        t->n = 0;
        return -1;
    }
    if (r.p != r.end) {
        t->n = 0;
        return fail(&r, "trailing data");
    }
    return 0;
}

void kv_tree_free(kv_tree_t *t)
{
    free(t->nodes);
    t->nodes = NULL;
    t->n = t->cap = 0;
}

int kv_tree_streq(const kv_tree_t *t, uint32_t node, const char *s)
{
    const kv_tnode_t *x = &t->nodes[node];
    size_t            n = strlen(s);

    return x->type == KV_T_STR && x->len == n && memcmp(x->s, s, n) == 0;
}

long kv_tree_get(const kv_tree_t *t, uint32_t obj, const char *key)
{
    uint32_t i, k;

    if (t->nodes[obj].type != KV_T_OBJ) {
        return -1;
    }
    for (i = 0, k = obj + 1; i < t->nodes[obj].n; i++) {
        uint32_t v = t->nodes[k].end;

        if (kv_tree_streq(t, k, key)) {
            return (long) v;
        }
        k = t->nodes[v].end;
    }
    return -1;
}
