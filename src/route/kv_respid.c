/*
 * Streaming scanner for a response's first "id" key (see kv_respid.h).
 *
 * phase 0: looking for '"'; 1: matching the key's letters; 2: after its
 * closing quote, blanks then ':'; 3: blanks then the value's opening
 * quote; 4: the value's bytes; FOUND and GONE are final. A byte that does
 * not fit drops back to phase 0 (a '"' there starts a new key at once).
 */
#include "kv_respid.h"

#include <string.h>

enum { SEEK, KEY, COLON, VALUE, ID, FOUND, GONE };

void kv_respid_init(kv_respid_scan_t *s)
{
    memset(s, 0, sizeof(*s));
}

static int blank(char c)
{
    return c == ' ' || c == '\t' || c == '\r' || c == '\n';
}

static int result(const kv_respid_scan_t *s)
{
    return s->phase == FOUND ? 1 : s->phase == GONE ? -1 : 0;
}

int kv_respid_feed(kv_respid_scan_t *s, const char *p, size_t n)
{
    const char *end;

    if (s->phase == FOUND || s->phase == GONE)
        return result(s);
    if (n > KV_RESPID_SCAN - s->seen)
        n = KV_RESPID_SCAN - s->seen;
    s->seen += (uint32_t) n;
    end = p + n;
    while (p < end && s->phase != FOUND && s->phase != GONE) {
        char c = *p;

        switch (s->phase) {
        case SEEK:
            p = memchr(p, '"', (size_t) (end - p));
            if (p == NULL) {
                p = end;
                continue;
            }
            s->phase = KEY;
            s->pos = 0;
            break;
        case KEY:
            if (s->pos < 2 && c == "id"[s->pos]) {
                s->pos++;
            } else {
                s->phase = s->pos == 2 && c == '"' ? COLON : SEEK;
                if (s->phase == SEEK)
                    continue;       /* c may be '"': SEEK sees it */
            }
            break;
        case COLON:
            if (c == ':') {
                s->phase = VALUE;
            } else if (!blank(c)) {
                s->phase = SEEK;
                continue;
            }
            break;
        case VALUE:
            if (c == '"') {
                s->phase = ID;
                s->len = 0;
            } else if (!blank(c)) {
                s->phase = SEEK;    /* a number, null: not a response's id */
                continue;
            }
            break;
        case ID:
            if (c == '"') {
                s->phase = s->len ? FOUND : GONE;
            } else if (c == '\\' || (unsigned char) c < 0x20 || s->len == KV_RESPID_MAX) {
                s->phase = GONE;
            } else {
                s->id[s->len++] = c;
            }
            break;
        }
        p++;
    }
    if (s->phase != FOUND && s->seen >= KV_RESPID_SCAN)
        s->phase = GONE;
    return result(s);
}
