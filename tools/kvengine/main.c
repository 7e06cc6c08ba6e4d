/*
 * kvengine: drives a compute backend (cpu, or cuda where built) directly,
 * without the HTTP front: logits for a token sequence (tests compare them
 * with an independent implementation) and throughput figures.
 *
 *   kvengine logits --model DIR --tokens '[1,2,3]' [--engine cpu|cuda] [--chunk N]
 *                   [--prefix N] [--block-size N]
 *   kvengine bench --model DIR [--engine cpu|cuda] [--batch N] [--prompt N] [--gen N]
 */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <jansson.h>

#include "kvw_backend.h"

typedef struct {
    const char *model, *engine, *tokens;
    long        chunk, prefix, block_size, batch, prompt, gen;
} opts_t;

static kvw_backend_t *open_backend(const opts_t *o, uint32_t blocks)
{
    kvw_backend_config_t c;
    char                 err[512];
    kvw_backend_t       *b;

    memset(&c, 0, sizeof(c));
    c.model_dir = o->model;
    c.block_size = (uint32_t) o->block_size;
    c.num_blocks = blocks;
    b = !strcmp(o->engine, "cuda") ? kvw_cuda_backend_create(&c, err, sizeof(err))
                                   : kvw_cpu_backend_create(&c, err, sizeof(err));
    if (b == NULL) {
        fprintf(stderr, "kvengine: %s\n", err);
        exit(1);
    }
    return b;
}

/* Runs tokens[from..to) of one sequence, in chunks; logits of the last. */
static int run(kvw_backend_t *b, const uint32_t *tok, uint32_t from, uint32_t to, long chunk,
               const uint32_t *table, uint32_t nblocks, float *logits)
{
    uint32_t p;
    double   ms;

    for (p = from; p < to; p += (uint32_t) chunk) {
        kvw_step_seq_t s;

        memset(&s, 0, sizeof(s));
        s.tokens = tok + p;
        s.n_tokens = (uint32_t) ((long) (to - p) < chunk ? to - p : (uint32_t) chunk);
        s.pos = p;
        s.block_table = table;
        s.n_blocks = nblocks;
        s.logits = p + s.n_tokens == to ? logits : NULL;
        if (b->step(b, &s, 1, &ms) != 0) return -1;
    }
    return 0;
}

static int cmd_logits(const opts_t *o)
{
    json_error_t   je;
    json_t        *a = json_loads(o->tokens, 0, &je);
    uint32_t       n = (uint32_t) json_array_size(a), i, nb, *tok, *table;
    kvw_backend_t *b;
    float         *logits;

    if (!json_is_array(a) || n == 0) {
        fprintf(stderr, "kvengine: --tokens wants a non-empty JSON array\n");
        return 2;
    }
    tok = malloc(n * sizeof(uint32_t));
    for (i = 0; i < n; i++) tok[i] = (uint32_t) json_integer_value(json_array_get(a, i));
    nb = (n + (uint32_t) o->block_size - 1) / (uint32_t) o->block_size;
    b = open_backend(o, 2 * nb + 2);
    /* blocks out of order on purpose: paging must not assume contiguity */
    table = malloc(nb * sizeof(uint32_t));
    for (i = 0; i < nb; i++) table[i] = 2 * nb - 2 * i;
    logits = malloc(b->vocab_size * sizeof(float));
    if (o->batch > 1) {
        /* the sequence runs in one step beside batch-1 others of other lengths:
         * its logits must not change */
        uint32_t        B = (uint32_t) o->batch, k, per = nb + 4;
        kvw_step_seq_t *sq = calloc(B, sizeof(*sq));
        uint32_t       *tt = malloc((size_t) B * per * sizeof(uint32_t));
        uint32_t       *other = malloc((size_t) B * (n + 40) * sizeof(uint32_t));
        double          ms;

        kvw_backend_t  *bb = open_backend(o, B * per + 1);

        for (k = 0; k < B * per; k++) tt[k] = B * per - k;
        for (k = 0; k < B; k++) {
            uint32_t len = k == 0 ? n : 3 + (k * 7) % (n + 30), j;

            for (j = 0; j < len; j++) other[(size_t) k * (n + 40) + j] = (j * 31 + k * 17) % bb->vocab_size;
            sq[k].tokens = k == 0 ? tok : other + (size_t) k * (n + 40);
            sq[k].n_tokens = len;
            sq[k].block_table = tt + (size_t) k * per;
            sq[k].n_blocks = per;
            sq[k].logits = k == 0 ? logits : NULL;
        }
        if (bb->step(bb, sq, B, &ms) != 0) return 1;
        b->destroy(b);
        b = bb;
        free(sq); free(tt); free(other);
    } else if (o->prefix > 0 && o->prefix < n) {
        /* the prefix runs first; the rest reads its blocks from the pool */
        if (run(b, tok, 0, (uint32_t) o->prefix, o->chunk, table, nb, logits) != 0
            || run(b, tok, (uint32_t) o->prefix, n, o->chunk, table, nb, logits) != 0)
            return 1;
    } else if (run(b, tok, 0, n, o->chunk, table, nb, logits) != 0) {
        return 1;
    }
    putchar('[');
    for (i = 0; i < b->vocab_size; i++) printf(i ? ",%.6g" : "%.6g", logits[i]);
    printf("]\n");
    b->destroy(b);
    free(tok); free(table); free(logits);
    json_decref(a);
    return 0;
}

static double now(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double) ts.tv_sec + (double) ts.tv_nsec / 1e9;
}

/* Prefill batch x prompt tokens, then gen decode steps of batch tokens. */
static int cmd_bench(const opts_t *o)
{
    uint32_t        B = (uint32_t) o->batch, P = (uint32_t) o->prompt, G = (uint32_t) o->gen;
    uint32_t        per = (P + G) / (uint32_t) o->block_size + 2, i, j, g;
    kvw_backend_t  *b = open_backend(o, B * per);
    kvw_step_seq_t *s = calloc(B, sizeof(*s));
    uint32_t       *tok = malloc((size_t) B * (P + G) * sizeof(uint32_t));
    uint32_t       *table = malloc((size_t) B * per * sizeof(uint32_t));
    double          t0, t_prefill, t_decode, ms;

    for (i = 0; i < B * (P + G); i++) tok[i] = (i * 2654435761u) % b->vocab_size;
    for (i = 0; i < B * per; i++) table[i] = i;
    for (i = 0; i < B; i++) {
        s[i].tokens = tok + (size_t) i * (P + G);
        s[i].n_tokens = P;
        s[i].block_table = table + (size_t) i * per;
        s[i].n_blocks = per;
        s[i].sample = 1;
    }
    t0 = now();
    for (i = 0; i < B; i++) {       /* prefill one sequence at a time, like a prefill queue */
        if (b->step(b, &s[i], 1, &ms) != 0) return 1;
    }
    t_prefill = now() - t0;
    t0 = now();
    for (g = 0; g < G; g++) {
        for (j = 0; j < B; j++) {
            s[j].tokens = tok + (size_t) j * (P + G) + P + g;
            s[j].n_tokens = 1;
            s[j].pos = P + g;
        }
        if (b->step(b, s, B, &ms) != 0) return 1;
    }
    t_decode = now() - t0;
    printf("{\"engine\":\"%s\",\"batch\":%u,\"prompt\":%u,\"gen\":%u,"
           "\"prefill_tokens_per_s\":%.1f,\"decode_tokens_per_s\":%.1f}\n",
           b->name, B, P, G, B * P / t_prefill, B * G / t_decode);
    b->destroy(b);
    free(s); free(tok); free(table);
    return 0;
}

int main(int argc, char **argv)
{
    static const struct option lo[] = {
        { "model", 1, 0, 'm' }, { "engine", 1, 0, 'e' }, { "tokens", 1, 0, 't' },
        { "chunk", 1, 0, 'c' }, { "prefix", 1, 0, 'p' }, { "block-size", 1, 0, 'b' },
        { "batch", 1, 0, 'B' }, { "prompt", 1, 0, 'P' }, { "gen", 1, 0, 'g' }, { 0, 0, 0, 0 }
    };
    opts_t o = { NULL, "cpu", NULL, 1 << 30, 0, 16, 1, 128, 32 };
    int    c;

    if (argc < 2) goto usage;
    optind = 2;
    while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        switch (c) {
        case 'm': o.model = optarg; break;
        case 'e': o.engine = optarg; break;
        case 't': o.tokens = optarg; break;
        case 'c': o.chunk = atol(optarg); break;
        case 'p': o.prefix = atol(optarg); break;
        case 'b': o.block_size = atol(optarg); break;
        case 'B': o.batch = atol(optarg); break;
        case 'P': o.prompt = atol(optarg); break;
        case 'g': o.gen = atol(optarg); break;
        default: goto usage;
        }
    }
    if (o.model == NULL || o.chunk < 1 || o.block_size < 1 || o.batch < 1) goto usage;
    if (!strcmp(argv[1], "logits") && o.tokens) return cmd_logits(&o);
    if (!strcmp(argv[1], "bench")) return cmd_bench(&o);
usage:
    fprintf(stderr, "usage: kvengine logits --model DIR --tokens '[ids]' [--engine cpu|cuda] "
                    "[--chunk N] [--prefix N] [--block-size N]\n"
                    "       kvengine bench --model DIR [--engine cpu|cuda] [--batch N] "
                    "[--prompt N] [--gen N]\n");
    return 2;
}
