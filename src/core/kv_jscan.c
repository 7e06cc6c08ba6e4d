/* The one JSON reader (see kv_jscan.h). */
#include "kv_jscan.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "kv_unicode.h"

void kv_jscan_init(kv_jscan_t *s, const char *buf, size_t len)
{
    kv_jscan_init_err(s, buf, len, NULL, 0);
}

void kv_jscan_init_err(kv_jscan_t *s, const char *buf, size_t len, char *why, size_t whylen)
{
    s->p = buf;
    s->end = buf + len;
    s->base = buf;
    s->why = why;
    s->whylen = whylen;
    s->err = 0;
}

int kv_jscan_fail(kv_jscan_t *s, const char *fmt, ...)
{
    va_list ap;
    int     n;

    if (!s->err && s->why && s->whylen) {
        va_start(ap, fmt);
        n = vsnprintf(s->why, s->whylen, fmt, ap);
        va_end(ap);
        if (n >= 0 && (size_t)n < s->whylen)
            snprintf(s->why + n, s->whylen - (size_t)n, " at byte %zu",
                     (size_t)(s->p - s->base));
    }
    s->err = 1;
    return -1;
}

static void spaces(kv_jscan_t *s)
{
    while (s->p < s->end && (*s->p == ' ' || *s->p == '\n' || *s->p == '\r' || *s->p == '\t'))
        s->p++;
}

int kv_jscan_peek(kv_jscan_t *s)
{
    spaces(s);
    return s->err || s->p >= s->end ? 0 : (unsigned char)*s->p;
}

int kv_jscan_expect(kv_jscan_t *s, char c)
{
    if (kv_jscan_peek(s) != (unsigned char)c) {
        if (s->err)
            return -1;
        return s->p >= s->end ? kv_jscan_fail(s, "truncated, expected '%c'", c)
                              : kv_jscan_fail(s, "expected '%c'", c);
    }
    s->p++;
    return 0;
}

int kv_jscan_accept(kv_jscan_t *s, char c)
{
    if (kv_jscan_peek(s) != (unsigned char)c)
        return 0;
    s->p++;
    return 1;
}

/* --- strings ------------------------------------------------------------- */

/* Four validated hex digits. */
static unsigned hex4(const char *p)
{
    return (unsigned)(kv_hex_digit(p[0]) << 12 | kv_hex_digit(p[1]) << 8 | kv_hex_digit(p[2]) << 4
                      | kv_hex_digit(p[3]));
}

int kv_jscan_string_raw(kv_jscan_t *s, const char **raw, size_t *len, int *escaped)
{
    const char *start;
    int         esc = 0;

    if (kv_jscan_expect(s, '"') < 0)
        return -1;
    start = s->p;
    for (;;) {
        /* the fast path: plain bytes, the bulk of a prompt (locals, so the
         * compiler keeps them in registers) */
        const char *p = s->p, *end = s->end;
        /* eight at a time while a word has no '"', '\\' or control byte
         * (the tests have no false negatives; a hit goes byte by byte) */
        while (end - p >= 8) {
            uint64_t w, q, b;
            memcpy(&w, p, 8);
            q = w ^ 0x2222222222222222ULL;
            b = w ^ 0x5c5c5c5c5c5c5c5cULL;
            if (((q - 0x0101010101010101ULL) & ~q & 0x8080808080808080ULL)
                | ((b - 0x0101010101010101ULL) & ~b & 0x8080808080808080ULL)
                | ((w - 0x2020202020202020ULL) & ~w & 0x8080808080808080ULL))
                break;
            p += 8;
        }
        while (p < end && *p != '"' && *p != '\\' && (unsigned char)*p >= 0x20)
            p++;
        s->p = p;
        if (s->p >= s->end)
            return kv_jscan_fail(s, "unterminated string");
        if (*s->p == '"')
            break;
        if (*s->p != '\\')
            return kv_jscan_fail(s, "control character in string");
        esc = 1;
        if (++s->p >= s->end)
            return kv_jscan_fail(s, "unterminated string");
        if (*s->p == 'u') {
            if (s->end - s->p < 5)
                return kv_jscan_fail(s, "truncated \\u escape");
            for (int i = 1; i <= 4; i++)
                if (kv_hex_digit(s->p[i]) < 0)
                    return kv_jscan_fail(s, "bad \\u escape");
            s->p += 5;
        } else if (strchr("\"\\/bfnrt", *s->p) != NULL && *s->p != '\0') {
            s->p++;
        } else {
            return kv_jscan_fail(s, "bad escape '\\%c'", *s->p);
        }
    }
    if (raw)
        *raw = start;
    if (len)
        *len = (size_t)(s->p - start);
    if (escaped)
        *escaped = esc;
    s->p++;
    return 0;
}

/* One validated escape at *pp (just past the backslash) into dst (up to 6
 * bytes); returns the byte count. */
static size_t unescape_one(const char **pp, const char *end, char *dst)
{
    const char *p = *pp;
    unsigned    cp, lo;
    size_t      n;
    char        c = *p++;

    *pp = p;
    switch (c) {
    case 'b': dst[0] = '\b'; return 1;
    case 'f': dst[0] = '\f'; return 1;
    case 'n': dst[0] = '\n'; return 1;
    case 'r': dst[0] = '\r'; return 1;
    case 't': dst[0] = '\t'; return 1;
    case 'u': break;
    default:  dst[0] = c; return 1;         /* " \ / */
    }
    cp = hex4(p);
    p += 4;
    if (cp >= 0xdc00 && cp < 0xe000) {
        cp = 0xfffd;
    } else if (cp >= 0xd800 && cp < 0xdc00) {
        if (end - p >= 6 && p[0] == '\\' && p[1] == 'u') {
            lo = hex4(p + 2);
            p += 6;
            if (lo >= 0xdc00 && lo < 0xe000) {
                cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
            } else {
                n = kv_utf8_put(dst, 0xfffd);
                n += kv_utf8_put(dst + n, lo >= 0xd800 && lo < 0xe000 ? 0xfffd : lo);
                *pp = p;
                return n;
            }
        } else {
            cp = 0xfffd;
        }
    }
    *pp = p;
    return kv_utf8_put(dst, cp);
}

size_t kv_json_unescape(const char *raw, size_t len, char *dst)
{
    const char *p = raw, *end = raw + len, *plain;
    size_t      n = 0;

    while (p < end) {
        plain = memchr(p, '\\', (size_t)(end - p));
        if (plain == NULL)
            plain = end;
        memcpy(dst + n, p, (size_t)(plain - p));
        n += (size_t)(plain - p);
        p = plain;
        if (p < end) {
            p++;
            n += unescape_one(&p, end, dst + n);
        }
    }
    return n;
}

int kv_jscan_string(kv_jscan_t *s, char *out, size_t cap)
{
    const char *raw, *p, *end;
    size_t      len, n = 0, k;
    int         escaped;
    char        one[8];

    if (kv_jscan_string_raw(s, &raw, &len, &escaped) < 0)
        return -1;
    if (out == NULL || cap == 0)
        return 0;
    for (p = raw, end = raw + len; p < end && n + 1 < cap; ) {
        if (*p != '\\') {
            out[n++] = *p++;
            continue;
        }
        p++;
        k = unescape_one(&p, end, one);
        if (n + k + 1 > cap)
            break;
        memcpy(out + n, one, k);
        n += k;
    }
    out[n] = '\0';
    return 0;
}

/* --- numbers and literals ------------------------------------------------ */

static int is_digit(const char *p, const char *end)
{
    return p < end && *p >= '0' && *p <= '9';
}

int kv_jscan_number(kv_jscan_t *s, kv_jnum_t *num)
{
    const char *start;
    uint64_t    v = 0, d;
    int         neg = 0, big = 0, frac = 0;

    spaces(s);
    if (s->err)
        return -1;
    start = s->p;
    if (s->p < s->end && *s->p == '-') {
        neg = 1;
        s->p++;
    }
    if (!is_digit(s->p, s->end))
        return s->p >= s->end ? kv_jscan_fail(s, "truncated") : kv_jscan_fail(s, "bad value");
    while (is_digit(s->p, s->end)) {
        d = (uint64_t)(*s->p++ - '0');
        if (v > (UINT64_MAX - d) / 10)
            big = 1;
        else
            v = v * 10 + d;
    }
    if (s->p < s->end && *s->p == '.') {
        frac = 1;
        if (!is_digit(++s->p, s->end))
            return kv_jscan_fail(s, "bad number");
        while (is_digit(s->p, s->end))
            s->p++;
    }
    if (s->p < s->end && (*s->p == 'e' || *s->p == 'E')) {
        frac = 1;
        s->p++;
        if (s->p < s->end && (*s->p == '+' || *s->p == '-'))
            s->p++;
        if (!is_digit(s->p, s->end))
            return kv_jscan_fail(s, "bad number");
        while (is_digit(s->p, s->end))
            s->p++;
    }
    num->text = start;
    num->len = (size_t)(s->p - start);
    num->u = neg ? (uint64_t)0 - v : v;
    if (frac)
        num->kind = KV_JNUM_FLOAT;
    else if (big || (neg && v > (uint64_t)INT64_MAX + 1))
        num->kind = KV_JNUM_BIG;
    else
        num->kind = neg ? KV_JNUM_NEG : KV_JNUM_UINT;
    return 0;
}

int kv_jscan_u64(kv_jscan_t *s, uint64_t *v)
{
    kv_jnum_t num;

    if (kv_jscan_number(s, &num) < 0)
        return -1;
    if (num.kind == KV_JNUM_FLOAT)
        return kv_jscan_fail(s, "expected an integer");
    if (num.kind == KV_JNUM_BIG)
        return kv_jscan_fail(s, "integer out of 64-bit range");
    *v = num.u;
    return 0;
}

int kv_jscan_literal(kv_jscan_t *s, const char *lit)
{
    size_t n = strlen(lit);

    spaces(s);
    if (s->err)
        return -1;
    if ((size_t)(s->end - s->p) < n || memcmp(s->p, lit, n) != 0)
        return kv_jscan_fail(s, "bad value");
    s->p += n;
    return 0;
}

int kv_jscan_null(kv_jscan_t *s)
{
    spaces(s);
    if (!s->err && s->end - s->p >= 4 && memcmp(s->p, "null", 4) == 0) {
        s->p += 4;
        return 1;
    }
    return 0;
}

/* --- structure ----------------------------------------------------------- */

int kv_jscan_skip_at(kv_jscan_t *s, int depth)
{
    int c = kv_jscan_peek(s), first = 1, more;

    switch (c) {
    case '"':
        return kv_jscan_string_raw(s, NULL, NULL, NULL);
    case '{':
    case '[':
        if (depth >= KV_JSON_MAX_DEPTH)
            return kv_jscan_fail(s, "nested deeper than %d", KV_JSON_MAX_DEPTH);
        s->p++;
        for (;;) {
            more = c == '{' ? kv_jscan_key(s, &first, NULL, 0) : kv_jscan_item(s, &first);
            if (more <= 0)
                return more;
            if (kv_jscan_skip_at(s, depth + 1) < 0)
                return -1;
        }
    case 't':
        return kv_jscan_literal(s, "true");
    case 'f':
        return kv_jscan_literal(s, "false");
    case 'n':
        return kv_jscan_literal(s, "null");
    case 0:
        return s->err ? -1 : kv_jscan_fail(s, "truncated");
    default: {
        kv_jnum_t num;
        return kv_jscan_number(s, &num);
    }
    }
}

int kv_jscan_more(kv_jscan_t *s, int *first, char close)
{
    if (kv_jscan_accept(s, close))
        return 0;
    if (!*first && kv_jscan_expect(s, ',') < 0)
        return -1;
    *first = 0;
    return s->err ? -1 : 1;
}

int kv_jscan_key(kv_jscan_t *s, int *first, char *key, size_t cap)
{
    int more = kv_jscan_more(s, first, '}');

    if (more <= 0)
        return more;
    if (kv_jscan_peek(s) != '"')
        return s->err ? -1 : kv_jscan_fail(s, "expected a key");
    if (kv_jscan_string(s, key, cap) < 0 || kv_jscan_expect(s, ':') < 0)
        return -1;
    return 1;
}

static int read_field(kv_jscan_t *s, const kv_jfield_t *f, void *base)
{
    char  *at = (char *) base + f->off;

    switch (f->type) {
    case KV_JF_U64:
        return kv_jscan_u64(s, (uint64_t *) (void *) at);
    case KV_JF_STRING:
        return kv_jscan_string(s, at, f->cap);
    case KV_JF_OBJECT:
        return kv_jscan_fields(s, f->sub, at, NULL);
    default:
        return kv_jscan_skip(s);
    }
}

int kv_jscan_fields(kv_jscan_t *s, const kv_jfield_t *fields, void *base, uint32_t *seen)
{
    char      key[64];
    int       first = 1, r;
    uint32_t  i;

    if (kv_jscan_expect(s, '{') < 0) {
        return -1;
    }
    while ((r = kv_jscan_key(s, &first, key, sizeof(key))) == 1) {
        for (i = 0; fields[i].name != NULL; i++) {
            if (strcmp(key, fields[i].name) == 0) {
                break;
            }
        }
        if (fields[i].name == NULL) {
            r = kv_jscan_skip(s);
        } else {
            r = read_field(s, &fields[i], base);
            if (seen != NULL && i < 32) {
                *seen |= 1u << i;
            }
        }
        if (r < 0) {
            return -1;
        }
    }
    return r;
}
