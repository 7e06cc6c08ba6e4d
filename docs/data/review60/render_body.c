/*
 * render_body BODYFILE: the router's path for a chat request body, timed:
 * kv_body_parse (the one-pass scan nginx uses) then kv_chat_render_request
 * with a probe template that prints every member. For stop 60's figure of
 * a message with 80,000 keys (docs/BENCHMARKS.md). Build, in a checkout:
 *   cc -O2 -D_GNU_SOURCE -Isrc/core -Isrc/text -Isrc/route -o render_body \
 *      docs/data/review60/render_body.c build/lib/libkvcore.a \
 *      -ljansson -lxxhash -lutf8proc -lm -pthread
 * (from a code review's harness, /tmp/rev-req/h.c).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kv_body.h"
#include "kv_chat_request.h"

static const char *probe =
    "{%- for m in messages -%}"
    "[{{ m.role }}]{{ m.content if m.content is string else m.content | tojson }}\n"
    "{%- endfor -%}";

int main(int argc, char **argv)
{
    char err[256] = "", *body, *txt;
    size_t n, len = 0;
    FILE *f;
    kv_body_t b;
    kv_chat_template_t *t;
    struct timespec t0, t1;

    if (argc != 2 || (f = fopen(argv[1], "rb")) == NULL) {
        fprintf(stderr, "usage: render_body BODYFILE\n");
        return 2;
    }
    fseek(f, 0, SEEK_END);
    n = (size_t) ftell(f);
    fseek(f, 0, SEEK_SET);
    body = malloc(n + 1);
    if (body == NULL || fread(body, 1, n, f) != n) {
        return 2;
    }
    fclose(f);
    t = kv_chat_load_string(probe, "<s>", "</s>", err, sizeof err);
    if (t == NULL) {
        fprintf(stderr, "template: %s\n", err);
        return 1;
    }
    clock_gettime(CLOCK_MONOTONIC, &t0);
    if (kv_body_parse(&b, body, n, err, sizeof err) != 0) {
        fprintf(stderr, "parse: %s\n", err);
        return 1;
    }
    txt = kv_chat_render_request(t, &b.chat, 0, &len, err, sizeof err);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("%s: %zu bytes rendered in %.3f s\n", argv[1], txt ? len : 0,
           (double) (t1.tv_sec - t0.tv_sec) + (double) (t1.tv_nsec - t0.tv_nsec) / 1e9);
    free(txt);
    kv_body_free(&b);
    kv_chat_free(t);
    free(body);
    return 0;
}
