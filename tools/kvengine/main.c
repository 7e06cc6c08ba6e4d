/*
 * kvengine: drives a compute backend (cpu, or cuda where built) directly,
 * without the HTTP front: logits for a token sequence (tests compare them
 * with an independent implementation) and throughput figures.
 *
 *   kvengine logits --model DIR --tokens '[1,2,3]' [--engine cpu|cuda] [--chunk N]
 *                   [--prefix N [--transfer cpu|cuda]] [--batch N] [--decode N]
 *                   [--block-size N] [--device N]
 *   kvengine bench --model DIR [--engine cpu|cuda] [--batch N] [--prompt N] [--gen N]
 *   kvengine info --model DIR [--engine cpu|cuda] [--num-blocks N] [--max-batched N]
 *                 [--max-seqs N]         (pool size, eos ids: JSON)
 *
 * --decode N: the last N tokens run as decode steps (one token a step; all
 * --batch sequences together). --transfer E: the --prefix runs on engine E
 * and its KV blocks move over with block_read/block_write. --device N: the
 * GPU (cuda). KVW_CUDA_LIB=libkvcuda-emu.so runs the cuda engine on the
 * host emulation of CUDA (workers/cuda/emu).
 */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <jansson.h>

#include "kvw_backend.h"

typedef struct {
    const char *model, *engine, *tokens, *transfer;
    long        chunk, prefix, block_size, batch, prompt, gen, decode, device;
    long        max_batched, max_seqs, num_blocks;  /* info: the scheduler limits, the pool */
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
    c.device = (int) o->device;
    c.max_batched_tokens = (uint32_t) o->max_batched;
    c.max_seqs = (uint32_t) o->max_seqs;
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

/*
 * The other sequences of a --batch run: lengths 3 + 7k mod (n + 30), tokens
 * from a fixed formula, so runs are repeatable.
 */
static uint32_t other_token(uint32_t k, uint32_t j, uint32_t vocab)
{
    return (j * 31 + k * 17) % vocab;
}

/*
 * --batch B: the sequence runs in one step beside B-1 others of other
 * lengths; with --decode N its last N tokens then run as N decode steps of
 * all B sequences (one token each). Its logits must not change.
 */
static int run_batch(kvw_backend_t *bb, const opts_t *o, const uint32_t *tok, uint32_t n,
                     float *logits)
{
    uint32_t        B = (uint32_t) o->batch, D = (uint32_t) o->decode, g, j, k;
    uint32_t        stride = n + 40 + D, per = stride / (uint32_t) o->block_size + 2;
    kvw_step_seq_t *sq = calloc(B, sizeof(*sq));
    uint32_t       *tt = malloc((size_t) B * per * sizeof(uint32_t));
    uint32_t       *other = malloc((size_t) B * stride * sizeof(uint32_t));
    uint32_t       *len = malloc(B * sizeof(uint32_t));
    double          ms;
    int             rc = -1;

    if (sq == NULL || tt == NULL || other == NULL || len == NULL) goto out;
    for (k = 0; k < B * per; k++) tt[k] = B * per - k;     /* blocks out of order */
    for (k = 0; k < B; k++) {
        len[k] = k == 0 ? n : 3 + (k * 7) % (n + 30) + D;
        for (j = 0; j < len[k]; j++)
            other[(size_t) k * stride + j] = k == 0 ? tok[j] : other_token(k, j, bb->vocab_size);
        sq[k].tokens = other + (size_t) k * stride;
        sq[k].n_tokens = len[k] - D;
        sq[k].block_table = tt + (size_t) k * per;
        sq[k].n_blocks = per;
        sq[k].logits = k == 0 && D == 0 ? logits : NULL;
    }
    if (bb->step(bb, sq, B, &ms) != 0) goto out;
    for (g = 0; g < D; g++) {
        for (k = 0; k < B; k++) {
            sq[k].pos = len[k] - D + g;
            sq[k].tokens = other + (size_t) k * stride + sq[k].pos;
            sq[k].n_tokens = 1;
            sq[k].decode = 1;
            sq[k].logits = k == 0 && g == D - 1 ? logits : NULL;
        }
        if (bb->step(bb, sq, B, &ms) != 0) goto out;
    }
    rc = 0;
out:
    free(sq); free(tt); free(other); free(len);
    return rc;
}

/*
 * --transfer ENGINE: the prefix runs on ENGINE, and its blocks move to the
 * engine under test with block_read/block_write (as disaggregated prefill
 * hands KV to a decode worker), into other block ids; the rest runs there.
 */
static int transfer_prefix(kvw_backend_t *b, const opts_t *o, const uint32_t *tok,
                           const uint32_t *table, uint32_t nb)
{
    opts_t          po = *o;
    kvw_backend_t  *src;
    uint32_t       *src_table = malloc(nb * sizeof(uint32_t)), i, full;
    void           *buf;
    int             rc = -1;

    po.engine = o->transfer;
    src = open_backend(&po, nb + 3);
    buf = malloc(src->block_bytes);
    if (src_table == NULL || buf == NULL) goto out;
    if (src->block_bytes != b->block_bytes) {
        fprintf(stderr, "kvengine: %s blocks are %zu bytes, %s blocks %zu\n", src->name,
                src->block_bytes, b->name, b->block_bytes);
        goto out;
    }
    if (src->kv_layout && b->kv_layout && strcmp(src->kv_layout, b->kv_layout) != 0) {
        fprintf(stderr, "kvengine: %s blocks are \"%s\", %s blocks \"%s\"\n", src->name,
                src->kv_layout, b->name, b->kv_layout);
        goto out;
    }
    for (i = 0; i < nb; i++) src_table[i] = i + 2;
    if (run(src, tok, 0, (uint32_t) o->prefix, o->chunk, src_table, nb, NULL) != 0) goto out;
    /* the prefix's blocks, the last one partial: the receiver recomputes nothing of it */
    full = ((uint32_t) o->prefix + (uint32_t) o->block_size - 1) / (uint32_t) o->block_size;
    for (i = 0; i < full; i++) {
        if (src->block_read(src, src_table[i], buf) != 0
            || b->block_write(b, table[i], buf) != 0) {
            fprintf(stderr, "kvengine: moving block %u failed\n", i);
            goto out;
        }
    }
    /* out of range ids are refused, not written */
    if (b->block_write(b, b->num_blocks, buf) == 0 || b->block_read(b, b->num_blocks, buf) == 0) {
        fprintf(stderr, "kvengine: a block id outside the pool was accepted\n");
        goto out;
    }
    rc = 0;
out:
    src->destroy(src);
    free(src_table);
    free(buf);
    return rc;
}

static int cmd_logits(const opts_t *o)
{
    json_error_t   je;
    json_t        *a = json_loads(o->tokens, 0, &je);
    uint32_t       n = (uint32_t) json_array_size(a), i, nb, *tok, *table;
    kvw_backend_t *b;
    float         *logits;
    int            rc = 1;

    if (!json_is_array(a) || n == 0 || (long) n <= o->decode) {
        fprintf(stderr, "kvengine: --tokens wants a non-empty JSON array, longer than --decode\n");
        json_decref(a);
        return 2;
    }
    tok = malloc(n * sizeof(uint32_t));
    for (i = 0; i < n; i++) tok[i] = (uint32_t) json_integer_value(json_array_get(a, i));
    json_decref(a);
    nb = (n + (uint32_t) o->block_size - 1) / (uint32_t) o->block_size;
    b = open_backend(o, o->batch > 1 ? (uint32_t) o->batch * ((n + 40 + (uint32_t) o->decode)
                                                              / (uint32_t) o->block_size + 2) + 1
                                     : 2 * nb + 2);
    /* blocks out of order on purpose: paging must not assume contiguity */
    table = malloc(nb * sizeof(uint32_t));
    for (i = 0; i < nb; i++) table[i] = 2 * nb - 2 * i;
    logits = malloc(b->vocab_size * sizeof(float));
    if (o->batch > 1) {
        if (run_batch(b, o, tok, n, logits) != 0) goto out;
    } else if (o->prefix > 0 && o->prefix < n) {
        /* the prefix runs first (here or elsewhere); the rest reads its blocks from the pool */
        if (o->transfer ? transfer_prefix(b, o, tok, table, nb) != 0
                        : run(b, tok, 0, (uint32_t) o->prefix, o->chunk, table, nb, logits) != 0)
            goto out;
        if (run(b, tok, (uint32_t) o->prefix, n - (uint32_t) o->decode, o->chunk, table, nb,
                logits) != 0)
            goto out;
    } else if (run(b, tok, 0, n - (uint32_t) o->decode, o->chunk, table, nb, logits) != 0) {
        goto out;
    }
    if (o->batch <= 1) {
        for (i = n - (uint32_t) o->decode; i < n; i++) {    /* decode steps, one token each */
            if (run(b, tok, i, i + 1, 1, table, nb, logits) != 0) goto out;
        }
    }
    putchar('[');
    /* 9 significant digits: f32 round-trips, so comparisons see every bit */
    for (i = 0; i < b->vocab_size; i++) printf(i ? ",%.9g" : "%.9g", logits[i]);
    printf("]\n");
    rc = 0;
out:
    b->destroy(b);
    free(tok); free(table); free(logits);
    return rc;
}

/* The engine's facts as JSON: the pool it sized (num_blocks 0: its own choice) and its eos ids. */
static int cmd_info(const opts_t *o)
{
    kvw_backend_t *b = open_backend(o, (uint32_t) o->num_blocks);
    uint32_t       i;

    printf("{\"engine\":\"%s\",\"vocab\":%u,\"num_blocks\":%u,\"block_bytes\":%zu,"
           "\"max_model_len\":%u,\"eos\":[%u", b->name, b->vocab_size, b->num_blocks,
           b->block_bytes, b->max_model_len, b->eos_token_id);
    for (i = 0; i < b->n_eos && i < 8; i++) {
        if (b->eos_ids[i] != b->eos_token_id) printf(",%u", b->eos_ids[i]);
    }
    printf("]");
    if (b->kv_layout) printf(",\"kv_layout\":\"%s\"", b->kv_layout);  /* no quotes in it */
    printf("}\n");
    b->destroy(b);
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
        { "batch", 1, 0, 'B' }, { "prompt", 1, 0, 'P' }, { "gen", 1, 0, 'g' },
        { "decode", 1, 0, 'd' }, { "transfer", 1, 0, 'T' }, { "device", 1, 0, 'D' },
        { "max-batched", 1, 0, 'M' }, { "max-seqs", 1, 0, 'S' }, { "num-blocks", 1, 0, 'n' },
        { 0, 0, 0, 0 }
    };
    opts_t o = { NULL, "cpu", NULL, NULL, 1 << 30, 0, 16, 1, 128, 32, 0, 0, 0, 0, 0 };
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
        case 'd': o.decode = atol(optarg); break;
        case 'T': o.transfer = optarg; break;
        case 'D': o.device = atol(optarg); break;
        case 'M': o.max_batched = atol(optarg); break;
        case 'S': o.max_seqs = atol(optarg); break;
        case 'n': o.num_blocks = atol(optarg); break;
        default: goto usage;
        }
    }
    if (o.model == NULL || o.chunk < 1 || o.block_size < 1 || o.batch < 1 || o.decode < 0
        || o.device < 0 || (o.transfer && o.prefix < 1))
        goto usage;
    if (!strcmp(argv[1], "logits") && o.tokens) return cmd_logits(&o);
    if (!strcmp(argv[1], "bench")) return cmd_bench(&o);
    if (!strcmp(argv[1], "info")) return cmd_info(&o);
usage:
    fprintf(stderr, "usage: kvengine logits --model DIR --tokens '[ids]' [--engine cpu|cuda] "
                    "[--chunk N] [--prefix N [--transfer cpu|cuda]] [--batch N] [--decode N] "
                    "[--block-size N] [--device N]\n"
                    "       kvengine bench --model DIR [--engine cpu|cuda] [--batch N] "
                    "[--prompt N] [--gen N] [--device N]\n"
                    "       kvengine info --model DIR [--engine cpu|cuda] [--num-blocks N] "
                    "[--max-batched N] [--max-seqs N] [--device N]\n");
    return 2;
}
