/*
 * kvsynth: learn a Mooncake trace's prefix structure and synthesize new
 * traces from it (src/core/kv_synth.c), or describe a trace.
 *
 *   kvsynth synthesize TRACE [--num-requests N] [--seed S] [--prefix-len-multiplier X]
 *           [--prefix-root-multiplier N] [--prompt-len-multiplier X] [--osl-multiplier X]
 *           [--speedup-ratio X] [--block-size N] [--out FILE]
 *   kvsynth stats TRACE [--block-size N]
 */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_synth.h"

static void usage(void)
{
    fprintf(stderr,
        "usage: kvsynth synthesize TRACE [--num-requests N] [--seed S]\n"
        "           [--prefix-len-multiplier X] [--prefix-root-multiplier N]\n"
        "           [--prompt-len-multiplier X] [--osl-multiplier X] [--speedup-ratio X]\n"
        "           [--block-size N] [--out FILE]\n"
        "       kvsynth stats TRACE [--block-size N]\n");
    exit(2);
}

static double positive(const char *flag, const char *v)
{
    char  *end;
    double x = strtod(v, &end);

    if (*end || !(x > 0)) {
        fprintf(stderr, "kvsynth: %s wants a positive number, not '%s'\n", flag, v);
        exit(2);
    }
    return x;
}

static int stats(const kv_trace_t *t, uint32_t bs)
{
    kv_synth_stats_t st;
    char             err[256];

    if (kv_synth_stats(t, bs, &st, err, sizeof(err)) != 0) {
        fprintf(stderr, "kvsynth: %s\n", err);
        return 1;
    }
    printf("{\"requests\":%llu,\"blocks\":%llu,\"ideal_reuse\":%.4f,"
           "\"mean_input_length\":%.1f,\"std_input_length\":%.1f,"
           "\"mean_output_length\":%.1f,\"std_output_length\":%.1f,"
           "\"mean_interarrival_ms\":%.3f,\"core_nodes\":%llu,\"radix_nodes\":%llu,"
           "\"unique_leaves\":%llu,\"depth\":%u,\"branching\":%.3f}\n",
           (unsigned long long) st.requests, (unsigned long long) st.blocks, st.ideal_reuse,
           st.mean_input_length, st.std_input_length, st.mean_output_length,
           st.std_output_length, st.mean_interarrival_ms, (unsigned long long) st.core_nodes,
           (unsigned long long) st.radix_nodes, (unsigned long long) st.unique_leaves,
           st.depth, st.branching);
    return 0;
}

int main(int argc, char **argv)
{
    static const struct option lo[] = {
        { "num-requests", 1, 0, 'n' }, { "seed", 1, 0, 's' },
        { "prefix-len-multiplier", 1, 0, 'p' }, { "prefix-root-multiplier", 1, 0, 'r' },
        { "prompt-len-multiplier", 1, 0, 'P' }, { "osl-multiplier", 1, 0, 'o' },
        { "speedup-ratio", 1, 0, 'S' }, { "block-size", 1, 0, 'b' }, { "out", 1, 0, 'O' },
        { 0, 0, 0, 0 }
    };
    kv_synth_knobs_t k;
    kv_trace_t       src = { 0 }, out = { 0 };
    kv_synth_t      *s;
    const char      *cmd, *path, *out_path = NULL;
    char             err[512];
    FILE            *f;
    int              c, rc = 0;

    kv_synth_knobs_default(&k);
    if (argc < 3) usage();
    cmd = argv[1];
    path = argv[2];
    optind = 3;
    while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        switch (c) {
        case 'n': k.num_requests = strtoull(optarg, NULL, 10); break;
        case 's': k.seed = strtoull(optarg, NULL, 10); break;
        case 'p': k.prefix_len_multiplier = positive("--prefix-len-multiplier", optarg); break;
        case 'r': k.prefix_root_multiplier = (uint32_t) positive("--prefix-root-multiplier", optarg); break;
        case 'P': k.prompt_len_multiplier = positive("--prompt-len-multiplier", optarg); break;
        case 'o': k.osl_multiplier = positive("--osl-multiplier", optarg); break;
        case 'S': k.speedup_ratio = positive("--speedup-ratio", optarg); break;
        case 'b': k.block_size = (uint32_t) positive("--block-size", optarg); break;
        case 'O': out_path = optarg; break;
        default: usage();
        }
    }
    if (kv_trace_load(path, &src, err, sizeof(err)) != 0) {
        fprintf(stderr, "kvsynth: %s: %s\n", path, err);
        return 1;
    }
    if (strcmp(cmd, "stats") == 0) {
        rc = stats(&src, k.block_size);
        kv_trace_free(&src);
        return rc;
    }
    if (strcmp(cmd, "synthesize") != 0) usage();
    s = kv_synth_learn(&src, k.block_size, err, sizeof(err));
    if (s == NULL) {
        fprintf(stderr, "kvsynth: %s: %s\n", path, err);
        return 1;
    }
    if (kv_synth_sample(s, &k, &out) != 0) {
        fprintf(stderr, "kvsynth: out of memory\n");
        return 1;
    }
    f = out_path ? fopen(out_path, "w") : stdout;
    if (f == NULL) {
        fprintf(stderr, "kvsynth: cannot write %s\n", out_path);
        return 1;
    }
    setvbuf(f, NULL, _IOFBF, 1 << 20);
    for (size_t i = 0; i < out.n && rc == 0; i++) {
        rc = kv_trace_write(f, &out, &out.reqs[i]) != 0;
    }
    if (fflush(f) != 0 || rc) {
        fprintf(stderr, "kvsynth: write failed\n");
        rc = 1;
    }
    if (out_path) fclose(f);
    kv_synth_free(s);
    kv_trace_free(&src);
    kv_trace_free(&out);
    return rc;
}
