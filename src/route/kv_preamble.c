/*
 * The first event past a Responses API stream's preamble (kv_preamble.h).
 *
 * phase 0: matching `"type":`; 1: blanks; 2: matching `"response.`;
 * 3: the event's name up to its closing quote. A byte that breaks a match
 * starts over (a '"' at once: both patterns begin with one).
 */
#include <string.h>

#include "kv_preamble.h"

static const char key[] = "\"type\":";
static const char val[] = "\"response.";

void kv_preamble_init(kv_preamble_t *s)
{
    memset(s, 0, sizeof(*s));
}

/* the events vLLM sends before the engine runs */
static int preamble(const char *name, size_t len)
{
    return (len == 7 && memcmp(name, "created", 7) == 0)
           || (len == 11 && memcmp(name, "in_progress", 11) == 0);
}

static void restart(kv_preamble_t *s, char c)
{
    s->phase = 0;
    s->pos = c == '"';
}

int kv_preamble_feed(kv_preamble_t *s, const char *p, size_t n)
{
    for (size_t i = 0; i < n && !s->done; i++) {
        char c = p[i];

        switch (s->phase) {
        case 0:
            if (c != key[s->pos]) {
                restart(s, c);
            } else if (++s->pos == sizeof(key) - 1) {
                s->phase = 1;
            }
            break;
        case 1:
            if (c == ' ' || c == '\t' || c == '\r' || c == '\n') {
                break;
            }
            s->phase = 2;               /* c is the value's first byte */
            s->pos = 0;
            /* fall through */
        case 2:
            if (c != val[s->pos]) {
                restart(s, c);
            } else if (++s->pos == sizeof(val) - 1) {
                s->phase = 3;
                s->len = 0;
            }
            break;
        default:
            if (c == '"') {
                s->done = !preamble(s->name, s->len);
                restart(s, 0);
            } else if (s->len < sizeof(s->name)) {
                s->name[s->len++] = c;
            } else {
                s->done = 1;            /* longer than any preamble event's */
            }
        }
    }
    return s->done;
}
