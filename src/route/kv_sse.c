/* Counting a server-sent event stream's events (kv_sse.h). */
#include <string.h>

#include "kv_sse.h"

enum { IN_LINE, LINE_END, EVENT_END };

void kv_sse_count_init(kv_sse_count_t *c)
{
    c->events = 0;
    c->state = EVENT_END;       /* a blank line first ends nothing */
}

/* 1 if p..end holds only carriage returns (or nothing): a CRLF's CR. */
static int only_cr(const char *p, const char *end)
{
    for (; p < end; p++) {
        if (*p != '\r') {
            return 0;
        }
    }
    return 1;
}

void kv_sse_count_feed(kv_sse_count_t *c, const char *p, size_t n)
{
    const char *end = p + n, *nl;

    while (p < end) {
        nl = memchr(p, '\n', (size_t) (end - p));
        if (!only_cr(p, nl ? nl : end)) {
            c->state = IN_LINE;
        }
        if (nl == NULL) {
            return;
        }
        if (c->state == LINE_END) {
            c->events++;
            c->state = EVENT_END;
        } else if (c->state == IN_LINE) {
            c->state = LINE_END;
        }
        p = nl + 1;
    }
}
