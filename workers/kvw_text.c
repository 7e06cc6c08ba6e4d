#include "kvw_text.h"
#include "kv_unicode.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int fail(char *err, size_t errlen, const char *msg)
{
    snprintf(err, errlen, "%s", msg);
    return -1;
}

long kvw_bytes_tokenize(void *ctx, const char *text, size_t len, uint32_t **ids)
{
    *ids = malloc((len ? len : 1) * sizeof(uint32_t));
    if (*ids == NULL)
        return -1;
    for (size_t i = 0; i < len; i++)
        (*ids)[i] = (unsigned char)text[i];
    return (long)len;
}

size_t kvw_bytes_detok(void *ctx, uint32_t token, char *buf, size_t cap)
{
    if (cap == 0 || token > 255)
        return 0;
    buf[0] = (char)token;
    return 1;
}

int kvw_text_append(char **buf, size_t *len, size_t *cap, const char *s, size_t n)
{
    if (*len + n + 1 > *cap) {
        size_t c = (*cap ? *cap * 2 : 256);
        while (c < *len + n + 1)
            c *= 2;
        char *p = realloc(*buf, c);
        if (p == NULL)
            return -1;
        *buf = p;
        *cap = c;
    }
    memcpy(*buf + *len, s, n);
    *len += n;
    (*buf)[*len] = '\0';
    return 0;
}

/* Plain rendering used until chat templates are wired: "role: content\n". */
int kvw_plain_render(void *ctx, json_t *req, char **out, size_t *outlen,
                     char *err, size_t errlen)
{
    size_t len = 0, cap = 0, i;
    json_t *m, *msgs = json_object_get(req, "messages");
    char *buf = NULL;

    if (!json_is_array(msgs) || json_array_size(msgs) == 0)
        return fail(err, errlen, "'messages' must be a non-empty array");

    json_array_foreach(msgs, i, m) {
        json_t *role = json_object_get(m, "role");
        json_t *content = json_object_get(m, "content");
        if (!json_is_string(role)) {
            free(buf);
            return fail(err, errlen, "each message needs a string 'role'");
        }
        if (kvw_text_append(&buf, &len, &cap, json_string_value(role),
                        json_string_length(role)) || kvw_text_append(&buf, &len, &cap, ": ", 2))
            goto nomem;
        if (json_is_string(content)) {
            if (kvw_text_append(&buf, &len, &cap, json_string_value(content),
                            json_string_length(content)))
                goto nomem;
        } else if (json_is_array(content)) {
            size_t j;
            json_t *part;
            json_array_foreach(content, j, part) {
                json_t *text = json_object_get(part, "text");
                if (json_is_string(text) &&
                    kvw_text_append(&buf, &len, &cap, json_string_value(text),
                                json_string_length(text)))
                    goto nomem;
            }
        } else if (!json_is_null(content) && content != NULL) {
            free(buf);
            return fail(err, errlen, "message 'content' must be a string or an array of parts");
        }
        if (kvw_text_append(&buf, &len, &cap, "\n", 1))
            goto nomem;
    }
    *out = buf;
    *outlen = len;
    return 0;
nomem:
    free(buf);
    return fail(err, errlen, "out of memory");
}

const kvw_text_t *kvw_text_bytes(void)
{
    static const kvw_text_t bytes = {
        .tokenize = kvw_bytes_tokenize,
        .render = kvw_plain_render,
        .detok = kvw_bytes_detok,
    };
    return &bytes;
}

size_t kvw_utf8_hold(const char *s, size_t n)
{
    size_t k, i, need;

    /* the last lead byte within 3 bytes of the end, and what it needs */
    for (k = 1; k <= 3 && k <= n; k++) {
        unsigned char c = (unsigned char)s[n - k];
        if ((c & 0xc0) == 0x80)
            continue;
        need = c >= 0xf0 && c <= 0xf4 ? 4 : c >= 0xe0 ? 3 : c >= 0xc2 && c < 0xe0 ? 2 : 1;
        if (need <= k)
            return 0;
        /* hold it only if what is there could still become valid */
        for (i = n - k + 1; i < n; i++)
            if (((unsigned char)s[i] & 0xc0) != 0x80)
                return 0;
        uint32_t cp;
        return kv_utf8_next((const uint8_t *)s + n - k, k, &cp) == k ? k : 0;
    }
    return 0;
}
