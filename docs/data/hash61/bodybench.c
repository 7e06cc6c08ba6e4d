/* kv_body_parse over two bodies, many times: ns per parse (median of 7 rounds) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "kv_body.h"

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e9 + t.tv_nsec; }
static int cmp(const void *a, const void *b) { double x = *(double *)a, y = *(double *)b; return x < y ? -1 : x > y; }

static double run(const char *body, size_t len, int iters)
{
    double r[7];
    char err[128];
    for (int k = 0; k < 7; k++) {
        double t0 = now();
        for (int i = 0; i < iters; i++) {
            kv_body_t b;
            memset(&b, 0, sizeof b);
            if (kv_body_parse(&b, body, len, err, sizeof err) != 0) { fprintf(stderr, "parse: %s\n", err); exit(1); }
            kv_body_free(&b);
        }
        r[k] = (now() - t0) / iters;
    }
    qsort(r, 7, sizeof r[0], cmp);
    return r[3];
}

int main(void)
{
    static char ids[16384], chat[65536];
    size_t n = 0;
    n += sprintf(ids + n, "{\"model\":\"m\",\"prompt\":[");
    for (int i = 0; i < 1024; i++) n += sprintf(ids + n, "%s%d", i ? "," : "", (i * 7919) % 150000);
    n += sprintf(ids + n, "],\"max_tokens\":64,\"stream\":true,\"temperature\":0.7}");
    size_t m = 0;
    m += sprintf(chat + m, "{\"model\":\"m\",\"messages\":[{\"role\":\"system\",\"content\":\"You are a helpful assistant.\"}");
    for (int i = 0; i < 20; i++)
        m += sprintf(chat + m, ",{\"role\":\"%s\",\"content\":\"turn %d: the quick brown fox jumps over the lazy dog again and again, with numbers 12345 and words\"}", i % 2 ? "assistant" : "user", i);
    m += sprintf(chat + m, "],\"max_tokens\":256,\"stream\":true,\"user\":\"u1\",\"temperature\":0.2,\"top_p\":0.9}");
    printf("ids1k %.0f ns  chat20 %.0f ns\n", run(ids, n, 20000), run(chat, m, 20000));
    return 0;
}
