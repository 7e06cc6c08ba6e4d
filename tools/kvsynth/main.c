/*
 * kvsynth: learn a Mooncake hash trace's prefix structure and synthesize
 * traces shaped like it (see tools/trace/kv_synth.h), or describe a trace.
 *
 *   kvsynth synthesize TRACE [knobs] [--out FILE]   Mooncake JSONL
 *   kvsynth stats TRACE [--block-size N]            one JSON object
 *   kvsynth sessions [knobs] [--out FILE]           multi-turn chat sessions
 *                                                   (tools/trace/kv_synth_sessions.h)
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_synth.h"
#include "kv_synth_sessions.h"
#include "kv_trace.h"

static void usage(FILE *f)
{
    fprintf(f,
        "usage: kvsynth synthesize TRACE [--prefix-len-multiplier X] [--prefix-root-multiplier N]\n"
        "                 [--prompt-len-multiplier X] [--osl-multiplier X] [--speedup-ratio X]\n"
        "                 [--num-requests N] [--seed S] [--block-size N] [--out FILE]\n"
        "                 [--pooled-lengths (ablation: Dynamo's global length pools)]\n"
        "       kvsynth stats TRACE [--block-size N]\n"
        "       kvsynth sessions [--num-requests N] [--rate R] [--seed S] [--block-size N]\n"
        "                 [--systems N] [--system-tokens N] [--turns MIN:MAX]\n"
        "                 [--user-tokens MIN:MAX] [--output-tokens MIN:MAX]\n"
        "                 [--think-s MIN:MEAN:MAX] [--out FILE]\n"
        "         defaults: 1000 requests, 10/s, seed 1, block 16, 16 x 1024-token system\n"
        "         prompts, 2:6 turns, 64:512 user and 64:384 output tokens, think 10:30:60 s\n"
        "TRACE is Mooncake JSONL ('-' for stdin); --block-size is the trace's tokens per\n"
        "hash id (default 512).\n");
}

static int parse_double(const char *s, double *v)
{
    char *end;
    errno = 0;
    *v = strtod(s, &end);
    return errno || end == s || *end ? -1 : 0;
}

static int parse_u64(const char *s, uint64_t *v)
{
    char *end;
    if (*s == '-' || *s == '\0')
        return -1;
    errno = 0;
    *v = strtoull(s, &end, 10);
    return errno || *end ? -1 : 0;
}

typedef struct {
    const char         *cmd, *trace, *out;
    uint64_t            block_size;
    kv_synth_knobs_t    k;
} opts_t;

static int parse_args(int argc, char **argv, opts_t *o)
{
    kv_synth_knobs_default(&o->k);
    o->block_size = 512;
    if (argc < 3)
        return -1;
    o->cmd = argv[1];
    o->trace = argv[2];
    for (int i = 3; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        uint64_t u = 0;
        if (!strcmp(a, "--pooled-lengths")) {
            o->k.pooled_lengths = 1;
            continue;
        }
        int bad = v == NULL;
        if (bad)
            ;
        else if (!strcmp(a, "--prefix-len-multiplier"))
            bad = parse_double(v, &o->k.prefix_len_mult);
        else if (!strcmp(a, "--prompt-len-multiplier"))
            bad = parse_double(v, &o->k.prompt_len_mult);
        else if (!strcmp(a, "--osl-multiplier"))
            bad = parse_double(v, &o->k.osl_mult);
        else if (!strcmp(a, "--speedup-ratio"))
            bad = parse_double(v, &o->k.speedup);
        else if (!strcmp(a, "--prefix-root-multiplier"))
            bad = parse_u64(v, &u) || u > UINT32_MAX, o->k.prefix_root_mult = (uint32_t)u;
        else if (!strcmp(a, "--num-requests"))
            bad = parse_u64(v, &o->k.num_requests);
        else if (!strcmp(a, "--seed"))
            bad = parse_u64(v, &o->k.seed);
        else if (!strcmp(a, "--block-size"))
            bad = parse_u64(v, &o->block_size) || o->block_size == 0 || o->block_size > 1u << 24;
        else if (!strcmp(a, "--out"))
            o->out = v;
        else {
            fprintf(stderr, "kvsynth: unknown option %s\n", a);
            return -1;
        }
        if (bad) {
            fprintf(stderr, "kvsynth: bad or missing value for %s\n", a);
            return -1;
        }
        i++;
    }
    return 0;
}

static void print_stats(const kv_trace_t *t, const kv_synth_model_t *m)
{
    double si = 0, si2 = 0, so = 0, so2 = 0, n = (double)t->n;
    for (size_t i = 0; i < t->n; i++) {
        double a = t->reqs[i].input_length, b = t->reqs[i].output_length;
        si += a, si2 += a * a, so += b, so2 += b * b;
    }
    double mi = n ? si / n : 0, mo = n ? so / n : 0;
    double vi = n ? si2 / n - mi * mi : 0, vo = n ? so2 / n - mo * mo : 0;
    double gap = t->n > 1 ? ((double)t->reqs[t->n - 1].timestamp_ms
                             - (double)t->reqs[0].timestamp_ms) / (n - 1) : 0;
    kv_synth_info_t in;
    kv_synth_info(m, &in);
    printf("{\"requests\": %zu, \"blocks\": %llu, \"ideal_reuse\": %.6f, "
           "\"mean_input_length\": %.3f, \"std_input_length\": %.3f, "
           "\"mean_output_length\": %.3f, \"std_output_length\": %.3f, "
           "\"mean_inter_arrival_ms\": %.3f, \"core_nodes\": %llu, \"core_blocks\": %llu, "
           "\"core_depth\": %u, \"core_max_blocks\": %u, \"branching\": %.4f, "
           "\"unique_blocks\": %llu, \"tree_violations\": %llu}\n",
           t->n, (unsigned long long)in.blocks, kv_trace_ideal_reuse(t), mi,
           sqrt(vi > 0 ? vi : 0), mo, sqrt(vo > 0 ? vo : 0), gap,
           (unsigned long long)in.core_nodes, (unsigned long long)in.core_blocks,
           in.core_depth, in.core_max_blocks, in.branching,
           (unsigned long long)in.unique_nodes, (unsigned long long)in.tree_violations);
}

static int synthesize(const opts_t *o, const kv_synth_model_t *m)
{
    FILE *f = o->out ? fopen(o->out, "w") : stdout;
    if (f == NULL) {
        fprintf(stderr, "kvsynth: %s: %s\n", o->out, strerror(errno));
        return 1;
    }
    int rc = kv_synth_write(m, &o->k, f);
    if (f != stdout && fclose(f))
        rc = -1;
    if (rc)
        fprintf(stderr, "kvsynth: writing %s failed\n", o->out ? o->out : "stdout");
    return rc ? 1 : 0;
}

/* "A:B" or "A:B:C" into v[0..n). */
static int parse_range(const char *s, double *v, int n)
{
    char buf[128], *save = NULL, *tok;
    int i = 0;
    if (strlen(s) >= sizeof(buf))
        return -1;
    strcpy(buf, s);
    for (tok = strtok_r(buf, ":", &save); tok; tok = strtok_r(NULL, ":", &save)) {
        if (i == n || parse_double(tok, &v[i]) || !(v[i] >= 0 && v[i] <= 1e9))
            return -1;
        i++;
    }
    return i == n ? 0 : -1;
}

static int sessions(int argc, char **argv)
{
    kv_sessions_knobs_t k;
    const char *out = NULL;
    char err[256];
    kv_trace_t t = {0};

    kv_sessions_knobs_default(&k);
    for (int i = 2; i < argc; i += 2) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        double r[3];
        uint64_t u = 0;
        int bad = v == NULL;
        if (bad)
            ;
        else if (!strcmp(a, "--num-requests"))
            bad = parse_u64(v, &k.num_requests);
        else if (!strcmp(a, "--seed"))
            bad = parse_u64(v, &k.seed);
        else if (!strcmp(a, "--rate"))
            bad = parse_double(v, &k.rate);
        else if (!strcmp(a, "--block-size"))
            bad = parse_u64(v, &u) || u > UINT32_MAX, k.block_size = (uint32_t)u;
        else if (!strcmp(a, "--systems"))
            bad = parse_u64(v, &u) || u > UINT32_MAX, k.systems = (uint32_t)u;
        else if (!strcmp(a, "--system-tokens"))
            bad = parse_u64(v, &u) || u > UINT32_MAX, k.system_tokens = (uint32_t)u;
        else if (!strcmp(a, "--turns"))
            bad = parse_range(v, r, 2), k.turns_min = (uint32_t)r[0], k.turns_max = (uint32_t)r[1];
        else if (!strcmp(a, "--user-tokens"))
            bad = parse_range(v, r, 2), k.user_min = (uint32_t)r[0], k.user_max = (uint32_t)r[1];
        else if (!strcmp(a, "--output-tokens"))
            bad = parse_range(v, r, 2), k.output_min = (uint32_t)r[0],
            k.output_max = (uint32_t)r[1];
        else if (!strcmp(a, "--think-s"))
            bad = parse_range(v, r, 3), k.think_min_s = r[0], k.think_mean_s = r[1],
            k.think_max_s = r[2];
        else if (!strcmp(a, "--out"))
            out = v;
        else {
            fprintf(stderr, "kvsynth: unknown option %s\n", a);
            usage(stderr);
            return 2;
        }
        if (bad) {
            fprintf(stderr, "kvsynth: bad or missing value for %s\n", a);
            return 2;
        }
    }
    if (kv_sessions_knobs_check(&k, err, sizeof(err))) {
        fprintf(stderr, "kvsynth: %s\n", err);
        return 2;
    }
    if (kv_sessions_generate(&k, &t)) {
        fprintf(stderr, "kvsynth: out of memory\n");
        kv_trace_free(&t);
        return 1;
    }
    FILE *f = out ? fopen(out, "w") : stdout;
    if (f == NULL) {
        fprintf(stderr, "kvsynth: %s: %s\n", out, strerror(errno));
        kv_trace_free(&t);
        return 1;
    }
    int rc = 0;
    for (size_t i = 0; i < t.n && rc == 0; i++)
        rc = kv_trace_write(f, &t, &t.reqs[i]);
    if ((f != stdout && fclose(f)) || (f == stdout && fflush(f)))
        rc = -1;
    if (rc)
        fprintf(stderr, "kvsynth: writing %s failed\n", out ? out : "stdout");
    kv_trace_free(&t);
    return rc ? 1 : 0;
}

int main(int argc, char **argv)
{
    opts_t o = {0};
    char err[256];
    kv_trace_t t = {0};
    kv_synth_model_t *m = NULL;

    if (argc >= 2 && (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help"))) {
        usage(stdout);
        return 0;
    }
    if (argc >= 2 && !strcmp(argv[1], "sessions"))
        return sessions(argc, argv);
    if (parse_args(argc, argv, &o)
        || (strcmp(o.cmd, "synthesize") && strcmp(o.cmd, "stats"))) {
        usage(stderr);
        return 2;
    }
    if (kv_synth_knobs_check(&o.k, err, sizeof(err))) {
        fprintf(stderr, "kvsynth: %s\n", err);
        return 2;
    }
    if (kv_trace_load(o.trace, &t, err, sizeof(err))
        || kv_synth_build(&t, (uint32_t)o.block_size, &m, err, sizeof(err))) {
        fprintf(stderr, "kvsynth: %s: %s\n", o.trace, err);
        kv_trace_free(&t);
        return 1;
    }
    int rc = 0;
    if (!strcmp(o.cmd, "stats"))
        print_stats(&t, m);
    else
        rc = synthesize(&o, m);
    kv_synth_free(m);
    kv_trace_free(&t);
    return rc;
}
