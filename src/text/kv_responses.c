/*
 * The Responses API's `instructions` and `input` as chat messages
 * (kv_responses.h). Works on raw JSON spans the body scanner has already
 * validated: each kept item is copied as the client wrote it, and the chat
 * path reads it as it reads a chat request's messages.
 */
#include <stdlib.h>
#include <string.h>

#include "kv_jscan.h"
#include "kv_responses.h"

typedef struct {
    char   *p;
    size_t  n;
} out_t;

static void put(out_t *o, const char *s, size_t n)
{
    memcpy(o->p + o->n, s, n);
    o->n += n;
}

static void put_str(out_t *o, const char *s)
{
    put(o, s, strlen(s));
}

/* {"role":ROLE,"content":raw} */
static void message(out_t *o, const char *role, const char *raw, size_t len)
{
    if (o->n > 1) {
        put_str(o, ",");
    }
    put_str(o, "{\"role\":\"");
    put_str(o, role);
    put_str(o, "\",\"content\":");
    put(o, raw, len);
    put_str(o, "}");
}

/* An item is a message when it has a `role` and no `type` but "message"
 * (a `type` that is no string: none). A member given twice counts by its
 * last value, as Python's json keeps it. Consumes the object. */
static int is_message(kv_jscan_t *s)
{
    const char *raw;
    size_t      n;
    char        key[8];
    int         first = 1, role = 0, other = 0, esc;

    s->p++;
    while (kv_jscan_key(s, &first, key, sizeof(key)) == 1) {
        if (strcmp(key, "type") == 0) {
            other = 0;
        } else if (strcmp(key, "role") == 0) {
            role = kv_jscan_peek(s) == '"';
        }
        if (strcmp(key, "type") == 0 && kv_jscan_peek(s) == '"') {
            if (kv_jscan_string_raw(s, &raw, &n, &esc) != 0) {
                return 0;
            }
            other = !(n == 7 && !esc && memcmp(raw, "message", 7) == 0);
            continue;
        }
        if (kv_jscan_skip_at(s, 3) != 0) {
            return 0;
        }
    }
    return role && !other && !s->err;
}

char *kv_responses_messages(const char *instructions, size_t instructions_len,
                            const char *input, size_t input_len, size_t *len)
{
    out_t       o;
    kv_jscan_t  s;
    const char *at;
    int         first = 1;

    /* the copies, two wrappers and the brackets */
    o.p = malloc(instructions_len + input_len + 96);
    if (o.p == NULL) {
        return NULL;
    }
    o.n = 0;
    put_str(&o, "[");
    if (instructions && instructions_len > 2) {            /* not "" */
        message(&o, "system", instructions, instructions_len);
    }
    if (input[0] == '"') {
        message(&o, "user", input, input_len);
    } else {
        kv_jscan_init_err(&s, input, input_len, NULL, 0);
        s.p++;
        while (kv_jscan_item(&s, &first) == 1) {
            if (kv_jscan_peek(&s) != '{') {
                if (kv_jscan_skip_at(&s, 2) != 0) {
                    break;
                }
                continue;
            }
            at = s.p;
            if (is_message(&s)) {
                if (o.n > 1) {
                    put_str(&o, ",");
                }
                put(&o, at, (size_t) (s.p - at));
            }
        }
    }
    put_str(&o, "]");
    *len = o.n;
    return o.p;
}
