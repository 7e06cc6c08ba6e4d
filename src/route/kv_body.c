/*
 * One-pass scanner for OpenAI request bodies (see kv_body.h). It validates
 * the whole document as JSON (a malformed body must fall back to load-only
 * routing, not be half-understood) but only materialises the fields the
 * router uses. Nesting is limited so a hostile body cannot exhaust the stack.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_body.h"
#include "kv_unicode.h"

#define KV_BODY_MAX_DEPTH  64

typedef struct {
    const char *base;
    const char *p;
    const char *end;
    char       *err;
    size_t      errlen;
    int         failed;
} scan_t;

static int fail(scan_t *s, const char *fmt, ...)
{
    va_list ap;

    if (!s->failed && s->errlen) {
        va_start(ap, fmt);
        vsnprintf(s->err, s->errlen, fmt, ap);
        va_end(ap);
    }
    s->failed = 1;
    return -1;
}

static void skip_ws(scan_t *s)
{
    while (s->p < s->end
           && (*s->p == ' ' || *s->p == '\n' || *s->p == '\r' || *s->p == '\t'))
    {
        s->p++;
    }
}

static int expect(scan_t *s, char c)
{
    skip_ws(s);
    if (s->p >= s->end || *s->p != c) {
        return fail(s, "expected '%c' at byte %zu", c, (size_t) (s->p - s->base));
    }
    s->p++;
    return 0;
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static int read_hex4(scan_t *s, unsigned *out)
{
    unsigned v = 0;
    int      i, h;

    if (s->end - s->p < 4) {
        return fail(s, "truncated \\u escape");
    }
    for (i = 0; i < 4; i++) {
        h = hexval(s->p[i]);
        if (h < 0) {
            return fail(s, "bad \\u escape");
        }
        v = v << 4 | (unsigned) h;
    }
    s->p += 4;
    *out = v;
    return 0;
}

/* One escape after the backslash; a lone surrogate becomes U+FFFD, as
 * Python's json (and so the engines) would not, but the engines reject
 * such text anyway and routing only needs a stable answer. */
static int unescape_one(scan_t *s, char *dst, size_t *n)
{
    unsigned cp, lo;
    char     c = *s->p++;

    switch (c) {
    case '"': case '\\': case '/': dst[0] = c; *n = 1; return 0;
    case 'b': dst[0] = '\b'; *n = 1; return 0;
    case 'f': dst[0] = '\f'; *n = 1; return 0;
    case 'n': dst[0] = '\n'; *n = 1; return 0;
    case 'r': dst[0] = '\r'; *n = 1; return 0;
    case 't': dst[0] = '\t'; *n = 1; return 0;
    case 'u': break;
    default:  return fail(s, "bad escape '\\%c'", c);
    }
    if (read_hex4(s, &cp) != 0) {
        return -1;
    }
    if (cp >= 0xd800 && cp < 0xdc00) {
        if (s->end - s->p >= 6 && s->p[0] == '\\' && s->p[1] == 'u') {
            s->p += 2;
            if (read_hex4(s, &lo) != 0) {
                return -1;
            }
            if (lo >= 0xdc00 && lo < 0xe000) {
                cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
            } else {
                *n = kv_utf8_put(dst, 0xfffd);
                *n += kv_utf8_put(dst + *n, lo >= 0xd800 && lo < 0xe000 ? 0xfffd : lo);
                return 0;
            }
        } else {
            cp = 0xfffd;
        }
    } else if (cp >= 0xdc00 && cp < 0xe000) {
        cp = 0xfffd;
    }
    *n = kv_utf8_put(dst, cp);
    return 0;
}

/*
 * A string at s->p (the opening quote). With out != NULL, the unescaped
 * bytes are malloc'ed into *out (NUL-terminated). Unescaped output is never
 * longer than the escaped input, so one allocation of the span suffices.
 */
static int scan_string(scan_t *s, char **out, size_t *out_len)
{
    const char *start;
    char       *dst = NULL;
    size_t      n = 0, k = 0;

    if (expect(s, '"') != 0) {
        return -1;
    }
    start = s->p;
    while (s->p < s->end && *s->p != '"' && *s->p != '\\'
           && (unsigned char) *s->p >= 0x20)
    {
        s->p++;
    }
    if (out) {
        dst = malloc((size_t) (s->end - start) + 1);
        if (dst == NULL) {
            return fail(s, "out of memory");
        }
        n = (size_t) (s->p - start);
        memcpy(dst, start, n);
    }
    while (s->p < s->end && *s->p != '"') {
        if ((unsigned char) *s->p < 0x20) {
            free(dst);
            return fail(s, "control character in string");
        }
        if (*s->p == '\\') {
            char tmp[8];

            s->p++;
            if (s->p >= s->end) {
                break;
            }
            if (unescape_one(s, tmp, &k) != 0) {
                free(dst);
                return -1;
            }
            if (dst) {
                memcpy(dst + n, tmp, k);
                n += k;
            }
            continue;
        }
        if (dst) {
            dst[n++] = *s->p;
        }
        s->p++;
    }
    if (s->p >= s->end) {
        free(dst);
        return fail(s, "unterminated string");
    }
    s->p++;
    if (out) {
        dst[n] = '\0';
        *out = dst;
        *out_len = n;
    }
    return 0;
}

static int scan_number(scan_t *s)
{
    const char *start = s->p;

    if (s->p < s->end && *s->p == '-') s->p++;
    while (s->p < s->end && ((*s->p >= '0' && *s->p <= '9') || *s->p == '.'
                             || *s->p == 'e' || *s->p == 'E' || *s->p == '+'
                             || *s->p == '-'))
    {
        s->p++;
    }
    if (s->p == start || (s->p == start + 1 && *start == '-')) {
        return fail(s, "bad value");
    }
    return 0;
}

static int skip_value(scan_t *s, int depth);

static int skip_container(scan_t *s, char close, int depth)
{
    int first = 1;

    if (depth > KV_BODY_MAX_DEPTH) {
        return fail(s, "nested deeper than %d", KV_BODY_MAX_DEPTH);
    }
    s->p++;
    for ( ;; ) {
        skip_ws(s);
        if (s->p < s->end && *s->p == close) {
            s->p++;
            return 0;
        }
        if (!first && expect(s, ',') != 0) {
            return -1;
        }
        first = 0;
        if (close == '}') {
            if (scan_string(s, NULL, NULL) != 0 || expect(s, ':') != 0) {
                return -1;
            }
        }
        if (skip_value(s, depth + 1) != 0) {
            return -1;
        }
    }
}

static int skip_literal(scan_t *s, const char *lit)
{
    size_t n = strlen(lit);

    if ((size_t) (s->end - s->p) < n || memcmp(s->p, lit, n) != 0) {
        return fail(s, "bad value");
    }
    s->p += n;
    return 0;
}

static int skip_value(scan_t *s, int depth)
{
    skip_ws(s);
    if (s->p >= s->end) {
        return fail(s, "truncated body");
    }
    switch (*s->p) {
    case '{': return skip_container(s, '}', depth);
    case '[': return skip_container(s, ']', depth);
    case '"': return scan_string(s, NULL, NULL);
    case 't': return skip_literal(s, "true");
    case 'f': return skip_literal(s, "false");
    case 'n': return skip_literal(s, "null");
    default:  return scan_number(s);
    }
}

/* A token id: a non-negative integer below 2^32. */
static int scan_id(scan_t *s, uint32_t *id)
{
    uint64_t v = 0;
    const char *start;

    skip_ws(s);
    start = s->p;
    while (s->p < s->end && *s->p >= '0' && *s->p <= '9' && s->p - start < 11) {
        v = v * 10 + (uint64_t) (*s->p - '0');
        s->p++;
    }
    if (s->p == start || v > UINT32_MAX
        || (s->p < s->end && (*s->p == '.' || *s->p == 'e' || *s->p == 'E'
                              || (*s->p >= '0' && *s->p <= '9'))))
    {
        return fail(s, "prompt token ids must be integers in [0, 2^32)");
    }
    *id = (uint32_t) v;
    return 0;
}

/* An id array at s->p ('['); with keep, the ids go to b. */
static int scan_ids(scan_t *s, kv_body_t *b, int keep)
{
    size_t    cap = 0;
    uint32_t  id = 0, *grown;

    s->p++;
    skip_ws(s);
    if (s->p < s->end && *s->p == ']') {
        s->p++;
        return 0;
    }
    for ( ;; ) {
        if (scan_id(s, &id) != 0) {
            return -1;
        }
        if (keep) {
            if (b->n_ids == cap) {
                cap = cap ? cap * 2 : 1024;
                grown = realloc(b->ids, cap * sizeof(uint32_t));
                if (grown == NULL) {
                    return fail(s, "out of memory");
                }
                b->ids = grown;
            }
            b->ids[b->n_ids++] = id;
        }
        skip_ws(s);
        if (s->p < s->end && *s->p == ']') {
            s->p++;
            return 0;
        }
        if (expect(s, ',') != 0) {
            return -1;
        }
    }
}

/* `prompt`: string, [string...], [id...] or [[id...]...]. */
static int scan_prompt(scan_t *s, kv_body_t *b)
{
    const char *save;
    int         first = 1;

    skip_ws(s);
    if (s->p < s->end && *s->p == '"') {
        b->kind = KV_BODY_TEXT;
        return scan_string(s, &b->text, &b->text_len);
    }
    if (s->p >= s->end || *s->p != '[') {
        return fail(s, "prompt must be a string or an array");
    }
    save = s->p++;
    skip_ws(s);
    if (s->p < s->end && (*s->p == ']' || (*s->p >= '0' && *s->p <= '9'))) {
        s->p = save;
        b->kind = KV_BODY_IDS;
        return scan_ids(s, b, 1);
    }
    for ( ;; ) {
        skip_ws(s);
        if (s->p < s->end && *s->p == '"') {
            if (scan_string(s, first ? &b->text : NULL, &b->text_len) != 0) {
                return -1;
            }
            if (first) b->kind = KV_BODY_TEXT;
        } else if (s->p < s->end && *s->p == '[') {
            if (scan_ids(s, b, first) != 0) {
                return -1;
            }
            if (first) b->kind = KV_BODY_IDS;
        } else {
            return fail(s, "prompt array elements must be strings or id arrays");
        }
        first = 0;
        skip_ws(s);
        if (s->p < s->end && *s->p == ']') {
            s->p++;
            return 0;
        }
        if (expect(s, ',') != 0) {
            return -1;
        }
    }
}

static int scan_long(scan_t *s, long *out)
{
    const char *start;
    char        buf[32];
    char       *end;
    size_t      n;

    skip_ws(s);
    start = s->p;
    if (scan_number(s) != 0) {
        return -1;
    }
    n = (size_t) (s->p - start);
    if (n >= sizeof(buf)) {
        return fail(s, "number too long");
    }
    memcpy(buf, start, n);
    buf[n] = '\0';
    errno = 0;
    *out = strtol(buf, &end, 10);
    if (errno || *end != '\0') {
        *out = -1;
    }
    return 0;
}

static int scan_field(scan_t *s, kv_body_t *b, const char *key, size_t klen)
{
    char   *str;
    size_t  n;

#define KEY(lit) (klen == sizeof(lit) - 1 && memcmp(key, lit, klen) == 0)

    skip_ws(s);
    if (KEY("prompt") && b->kind == KV_BODY_NONE) {
        return scan_prompt(s, b);
    }
    if (KEY("messages") && b->kind == KV_BODY_NONE && s->p < s->end && *s->p == '[') {
        const char *start = s->p;

        if (skip_value(s, 1) != 0) {
            return -1;
        }
        b->kind = KV_BODY_MESSAGES;
        b->messages = start;
        b->messages_len = (size_t) (s->p - start);
        return 0;
    }
    if (KEY("model") && s->p < s->end && *s->p == '"') {
        if (scan_string(s, &str, &n) != 0) {
            return -1;
        }
        if (n >= sizeof(b->model)) {
            free(str);
            return fail(s, "model name longer than %zu bytes", sizeof(b->model) - 1);
        }
        memcpy(b->model, str, n + 1);
        free(str);
        return 0;
    }
    if (KEY("cache_salt") && s->p < s->end && *s->p == '"' && b->salt == NULL) {
        return scan_string(s, &b->salt, &b->salt_len);
    }
    if (KEY("stream") && s->p < s->end && *s->p == 't') {
        b->stream = 1;
        return skip_literal(s, "true");
    }
    if ((KEY("max_tokens") || KEY("max_completion_tokens"))
        && s->p < s->end && (*s->p == '-' || (*s->p >= '0' && *s->p <= '9')))
    {
        return scan_long(s, &b->max_tokens);
    }
#undef KEY
    return skip_value(s, 1);
}

int kv_body_parse(kv_body_t *b, const char *buf, size_t len, char *err, size_t errlen)
{
    scan_t  s = { buf, buf, buf + len, err, errlen, 0 };
    char   *key;
    size_t  klen;
    int     first = 1;

    memset(b, 0, sizeof(*b));
    b->max_tokens = -1;

    if (expect(&s, '{') != 0) {
        fail(&s, "body is not a JSON object");
        goto bad;
    }
    for ( ;; ) {
        skip_ws(&s);
        if (s.p < s.end && *s.p == '}') {
            s.p++;
            break;
        }
        if (!first && expect(&s, ',') != 0) {
            goto bad;
        }
        first = 0;
        skip_ws(&s);
        if (scan_string(&s, &key, &klen) != 0) {
            goto bad;
        }
        if (expect(&s, ':') != 0 || scan_field(&s, b, key, klen) != 0) {
            free(key);
            goto bad;
        }
        free(key);
    }
    skip_ws(&s);
    if (s.p != s.end) {
        fail(&s, "trailing data after the JSON object");
        goto bad;
    }
    return 0;

bad:
    kv_body_free(b);
    b->max_tokens = -1;
    return -1;
}

void kv_body_free(kv_body_t *b)
{
    free(b->text);
    free(b->ids);
    free(b->salt);
    b->text = NULL;
    b->ids = NULL;
    b->salt = NULL;
    b->n_ids = 0;
    b->text_len = 0;
    b->kind = KV_BODY_NONE;
}
