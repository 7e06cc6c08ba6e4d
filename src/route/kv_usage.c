/*
 * Streaming key scanner for a response's usage (see kv_usage.h); a Response
 * (the Responses API) names prompt_tokens input_tokens.
 *
 * phase 0: looking for '"'; 1: matching a key's letters; 2: after the
 * key's closing quote, blanks then ':'; 3: blanks then the first digit;
 * 4: digits. Any other byte drops back to phase 0 (and a '"' there starts
 * a new key at once).
 */
#include "kv_usage.h"

#include <string.h>

/* a Response (the Responses API) says input_tokens for prompt_tokens */
static const char *const keys[] = { NULL, "prompt_tokens", "cached_tokens", "input_tokens" };

void kv_usage_init(kv_usage_scan_t *u)
{
    memset(u, 0, sizeof(*u));
    u->prompt_tokens = -1;
    u->cached_tokens = -1;
}

static int blank(char c)
{
    return c == ' ' || c == '\t' || c == '\r' || c == '\n';
}

static void store(kv_usage_scan_t *u)
{
    if (u->key == 1 || u->key == 3)
        u->prompt_tokens = (int64_t)u->num;
    else
        u->cached_tokens = (int64_t)u->num;
}

void kv_usage_feed(kv_usage_scan_t *u, const char *p, size_t n)
{
    const char *end = p + n;
    while (p < end) {
        if (u->phase == 0) {
            const char *q = memchr(p, '"', (size_t)(end - p));
            if (q == NULL)
                return;
            p = q + 1;
            u->phase = 1;
            u->key = 0;
            u->pos = 0;
            continue;
        }
        char c = *p;
        switch (u->phase) {
        case 1:
            if (u->key == 0) {
                u->key = c == 'p' ? 1 : c == 'c' ? 2 : c == 'i' ? 3 : 0;
                if (u->key == 0) {
                    u->phase = 0;
                    continue;       /* c may be '"': phase 0 sees it */
                }
                u->pos = 1;
            } else if (keys[u->key][u->pos] == '\0') {
                u->phase = c == '"' ? 2 : 0;
                if (u->phase == 0)
                    continue;
            } else if (c == keys[u->key][u->pos]) {
                u->pos++;
            } else {
                u->phase = 0;
                continue;
            }
            break;
        case 2:
            if (c == ':')
                u->phase = 3;
            else if (!blank(c)) {
                u->phase = 0;
                continue;
            }
            break;
        case 3:
            if (c >= '0' && c <= '9') {
                u->num = (uint64_t)(c - '0');
                u->digits = 1;
                u->phase = 4;
            } else if (!blank(c)) {
                u->phase = 0;       /* null, a string, an object: not a count */
                continue;
            }
            break;
        case 4:
            if (c >= '0' && c <= '9') {
                if (++u->digits > 18) {     /* no real count is this long */
                    u->phase = 0;
                    break;
                }
                u->num = u->num * 10 + (uint64_t)(c - '0');
            } else {
                store(u);
                u->phase = 0;
                continue;
            }
            break;
        }
        p++;
    }
}

void kv_usage_end(kv_usage_scan_t *u)
{
    if (u->phase == 4)
        store(u);
    u->phase = 0;
}
