/* Pull scanner for heartbeat and dump JSON (see kv_jscan.h). */
#include "kv_jscan.h"

#include <string.h>

#define JSCAN_MAX_DEPTH 32

void kv_jscan_init(kv_jscan_t *s, const char *buf, size_t len)
{
    s->p = buf;
    s->end = buf + len;
    s->err = 0;
}

static int fail(kv_jscan_t *s)
{
    s->err = 1;
    return -1;
}

static void spaces(kv_jscan_t *s)
{
    while (s->p < s->end && (*s->p == ' ' || *s->p == '\t' || *s->p == '\n' || *s->p == '\r'))
        s->p++;
}

int kv_jscan_peek(kv_jscan_t *s)
{
    spaces(s);
    return s->err || s->p >= s->end ? 0 : (unsigned char)*s->p;
}

int kv_jscan_expect(kv_jscan_t *s, char c)
{
    if (kv_jscan_peek(s) != (unsigned char)c)
        return fail(s);
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

int kv_jscan_string(kv_jscan_t *s, char *out, size_t cap)
{
    size_t n = 0;
    if (kv_jscan_expect(s, '"') < 0)
        return -1;
    while (s->p < s->end && *s->p != '"') {
        char c = *s->p++;
        if ((unsigned char)c < 0x20)
            return fail(s);
        if (c == '\\') {
            if (s->p >= s->end)
                return fail(s);
            c = *s->p++;
            if (c == 'u') {
                if (s->end - s->p < 4)
                    return fail(s);
                s->p += 4;
                c = '?';
            }
        }
        if (out && n + 1 < cap)
            out[n++] = c;
    }
    if (s->p >= s->end)
        return fail(s);
    s->p++;
    if (out && cap)
        out[n] = '\0';
    return 0;
}

int kv_jscan_u64(kv_jscan_t *s, uint64_t *v)
{
    int neg = 0;
    uint64_t x = 0;
    spaces(s);
    if (s->p < s->end && *s->p == '-') {
        neg = 1;
        s->p++;
    }
    if (s->p >= s->end || *s->p < '0' || *s->p > '9')
        return fail(s);
    while (s->p < s->end && *s->p >= '0' && *s->p <= '9') {
        uint64_t d = (uint64_t)(*s->p++ - '0');
        if (x > (UINT64_MAX - d) / 10)
            return fail(s);
        x = x * 10 + d;
    }
    if (s->p < s->end && (*s->p == '.' || *s->p == 'e' || *s->p == 'E'))
        return fail(s);
    if (neg && x > (uint64_t)INT64_MAX + 1)
        return fail(s);
    *v = neg ? (uint64_t)0 - x : x;
    return 0;
}

int kv_jscan_null(kv_jscan_t *s)
{
    spaces(s);
    if (s->end - s->p >= 4 && memcmp(s->p, "null", 4) == 0) {
        s->p += 4;
        return 1;
    }
    return 0;
}

static int skip_depth(kv_jscan_t *s, int depth)
{
    if (depth > JSCAN_MAX_DEPTH)
        return fail(s);
    int c = kv_jscan_peek(s);
    if (c == '"')
        return kv_jscan_string(s, NULL, 0);
    if (c == '{' || c == '[') {
        char close = c == '{' ? '}' : ']';
        s->p++;
        if (kv_jscan_accept(s, close))
            return 0;
        for (;;) {
            if (c == '{' && (kv_jscan_string(s, NULL, 0) < 0 || kv_jscan_expect(s, ':') < 0))
                return -1;
            if (skip_depth(s, depth + 1) < 0)
                return -1;
            if (kv_jscan_accept(s, close))
                return 0;
            if (kv_jscan_expect(s, ',') < 0)
                return -1;
        }
    }
    /* number, true, false, null: a run of literal characters */
    const char *start = s->p;
    while (s->p < s->end && strchr("+-0123456789.eEtruefalsn", *s->p) != NULL)
        s->p++;
    return s->p == start ? fail(s) : 0;
}

int kv_jscan_skip(kv_jscan_t *s)
{
    return skip_depth(s, 0);
}

int kv_jscan_key(kv_jscan_t *s, int *first, char *key, size_t cap)
{
    if (kv_jscan_accept(s, '}'))
        return 0;
    if (!*first && kv_jscan_expect(s, ',') < 0)
        return -1;
    *first = 0;
    if (kv_jscan_string(s, key, cap) < 0 || kv_jscan_expect(s, ':') < 0)
        return -1;
    return 1;
}
