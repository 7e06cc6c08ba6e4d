#include <math.h>
#include <stdlib.h>

#include "kvtest.h"
#include "kv_synth.h"
#include "kv_trace.h"

#define SOURCE "t/data/mooncake_synthetic_trace.jsonl"
#define BS 512

static int load_string(kv_trace_t *t, const char *text, char *err, size_t errlen)
{
    FILE *f = fmemopen((void *)text, strlen(text), "r");
    int rc = kv_trace_load_file(f, t, err, errlen);
    fclose(f);
    return rc;
}

static void add(kv_trace_t *t, uint32_t in, const uint64_t *ids, uint32_t n)
{
    kv_trace_add(t, t->n * 10, in, 7, ids, n);
}

/* The small trace of the header comment in tiny_tree. */
static void tiny(kv_trace_t *t)
{
    add(t, 15, (uint64_t[]){ 1, 2, 3, 10 }, 4);
    add(t, 16, (uint64_t[]){ 1, 2, 3, 11 }, 4);
    add(t, 12, (uint64_t[]){ 1, 2, 4 }, 3);
    add(t, 10, (uint64_t[]){ 1, 2, 4 }, 3);
    add(t, 3, (uint64_t[]){ 20 }, 1);
}

/*
 * Block size 4. Trie: 1-2 (4 requests) then 3 (2: unique leaves 10, 11) and
 * 4 (2, both end there); 20 is a unique prompt from the root. Core radix tree:
 * [1,2] -> [3], [4]: 3 nodes, 2 levels, 3 blocks deep.
 */
TEST(tiny_tree)
{
    kv_trace_t t = {0};
    kv_synth_model_t *m;
    kv_synth_info_t in;
    char err[200];
    tiny(&t);
    CHECK(kv_synth_build(&t, 4, &m, err, sizeof(err)) == 0);
    kv_synth_info(m, &in);
    CHECK_EQ_U64(in.requests, 5);
    CHECK_EQ_U64(in.blocks, 7);
    CHECK_EQ_U64(in.core_nodes, 3);
    CHECK_EQ_U64(in.core_blocks, 4);
    CHECK_EQ_U64(in.unique_nodes, 3);
    CHECK_EQ_U64(in.core_depth, 2);
    CHECK_EQ_U64(in.core_max_blocks, 3);
    CHECK(fabs(in.branching - 1.5) < 1e-9);
    CHECK_EQ_U64(in.tree_violations, 0);
    kv_synth_free(m);
    kv_trace_free(&t);
}

/* Every sample is one of the source's shapes, renumbered. */
TEST(tiny_samples_keep_shapes)
{
    kv_trace_t t = {0}, s = {0};
    kv_synth_model_t *m;
    kv_synth_knobs_t k;
    char err[200];
    tiny(&t);
    CHECK(kv_synth_build(&t, 4, &m, err, sizeof(err)) == 0);
    kv_synth_knobs_default(&k);
    k.num_requests = 2000;
    CHECK(kv_synth_generate(m, &k, &s) == 0);
    CHECK_EQ_U64(s.n, 2000);
    int bad = 0, seen[4] = {0};
    for (size_t i = 0; i < s.n; i++) {
        const kv_trace_req_t *r = &s.reqs[i];
        const uint64_t *ids = kv_trace_ids(&s, r);
        /* core ids: [1,2] -> 0,1; [3] -> 2; [4] -> 3; unique from 4 up */
        if (r->n_hash == 4 && ids[0] == 0 && ids[1] == 1 && ids[2] == 2 && ids[3] >= 4
            && (r->input_length == 15 || r->input_length == 16))
            seen[0] = 1;
        else if (r->n_hash == 3 && ids[0] == 0 && ids[1] == 1 && ids[2] == 3
                 && (r->input_length == 12 || r->input_length == 10))
            seen[1] = 1;
        else if (r->n_hash == 1 && ids[0] >= 4 && r->input_length == 3)
            seen[2] = 1;
        else
            bad++;
        CHECK_EQ_U64(r->output_length, 7);
    }
    CHECK_EQ_U64(bad, 0);
    CHECK(seen[0] && seen[1] && seen[2]);
    kv_synth_free(m);
    kv_trace_free(&s);
    kv_trace_free(&t);
}

TEST(tree_violation_counted)
{
    kv_trace_t t = {0};
    kv_synth_model_t *m;
    kv_synth_info_t in;
    char err[200];
    add(&t, 8, (uint64_t[]){ 1, 2 }, 2);
    add(&t, 8, (uint64_t[]){ 3, 2 }, 2);
    CHECK(kv_synth_build(&t, 4, &m, err, sizeof(err)) == 0);
    kv_synth_info(m, &in);
    CHECK_EQ_U64(in.tree_violations, 1);
    kv_synth_free(m);
    kv_trace_free(&t);
}

TEST(empty_trace)
{
    kv_trace_t t = {0}, s = {0};
    kv_synth_model_t *m;
    kv_synth_knobs_t k;
    char err[200];
    CHECK(load_string(&t, "\n", err, sizeof(err)) == 0);
    CHECK(kv_synth_build(&t, BS, &m, err, sizeof(err)) == 0);
    kv_synth_knobs_default(&k);
    CHECK(kv_synth_generate(m, &k, &s) == 0);
    CHECK_EQ_U64(s.n, 0);
    kv_synth_free(m);
    kv_trace_free(&t);
}

/* --- on the shipped Mooncake trace -------------------------------------- */

static kv_trace_t src;
static kv_synth_model_t *model;
static kv_synth_info_t info;

static void gen(kv_trace_t *out, const kv_synth_knobs_t *k)
{
    memset(out, 0, sizeof(*out));
    CHECK(kv_synth_generate(model, k, out) == 0);
}

static void moments(const kv_trace_t *t, double *mi, double *si, double *mo)
{
    double a = 0, a2 = 0, b = 0;
    for (size_t i = 0; i < t->n; i++) {
        a += t->reqs[i].input_length;
        a2 += (double)t->reqs[i].input_length * t->reqs[i].input_length;
        b += t->reqs[i].output_length;
    }
    *mi = a / t->n;
    *si = sqrt(a2 / t->n - *mi * *mi);
    *mo = b / t->n;
}

static int near(double x, double want, double rel)
{
    return fabs(x / want - 1) <= rel;
}

/* Ids below core_ids belong to the core tree (one copy per block). */
static uint32_t core_count(const kv_trace_t *t, size_t i, uint64_t core_ids)
{
    const uint64_t *ids = kv_trace_ids(t, &t->reqs[i]);
    uint32_t n = 0;
    while (n < t->reqs[i].n_hash && ids[n] < core_ids)
        n++;
    return n;
}

static int consistent(const kv_trace_t *t)
{
    for (size_t i = 0; i < t->n; i++)
        if (t->reqs[i].n_hash != (t->reqs[i].input_length + BS - 1) / BS)
            return 0;
    return 1;
}

/* Mean over seeds of each statistic, against the source: reuse, input and output
 * means within 5%, input spread within 10%. */
TEST(multiplier_one_matches_source)
{
    double mi0, si0, mo0, r0 = kv_trace_ideal_reuse(&src);
    double mi = 0, si = 0, mo = 0, r = 0;
    const int seeds = 5;
    moments(&src, &mi0, &si0, &mo0);
    for (int s = 1; s <= seeds; s++) {
        kv_synth_knobs_t k;
        kv_trace_t t;
        double a, b, c;
        kv_synth_knobs_default(&k);
        k.seed = (uint64_t)s;
        gen(&t, &k);
        CHECK_EQ_U64(t.n, src.n);
        CHECK(consistent(&t));
        moments(&t, &a, &b, &c);
        mi += a / seeds, si += b / seeds, mo += c / seeds;
        r += kv_trace_ideal_reuse(&t) / seeds;
        kv_trace_free(&t);
    }
    fprintf(stderr, "  reuse %.4f/%.4f in %.0f/%.0f sd %.0f/%.0f out %.1f/%.1f\n",
            r, r0, mi, mi0, si, si0, mo, mo0);
    CHECK(near(r, r0, 0.05));
    CHECK(near(mi, mi0, 0.05));
    CHECK(near(mo, mo0, 0.05));
    CHECK(near(si, si0, 0.10));
}

static int write_bytes(const kv_synth_knobs_t *k, char **buf, size_t *len)
{
    FILE *f = open_memstream(buf, len);
    int rc = kv_synth_write(model, k, f);
    fclose(f);
    return rc;
}

TEST(deterministic_for_a_seed)
{
    kv_synth_knobs_t k;
    char *a, *b, *c;
    size_t na, nb, nc;
    kv_synth_knobs_default(&k);
    k.seed = 42;
    k.num_requests = 500;
    CHECK(write_bytes(&k, &a, &na) == 0);
    CHECK(write_bytes(&k, &b, &nb) == 0);
    k.seed = 43;
    CHECK(write_bytes(&k, &c, &nc) == 0);
    CHECK(na == nb && memcmp(a, b, na) == 0);
    CHECK(na != nc || memcmp(a, c, na) != 0);
    /* the writer and the in-memory generator agree */
    kv_trace_t t = {0};
    char err[200];
    CHECK(load_string(&t, a, err, sizeof(err)) == 0);
    CHECK_EQ_U64(t.n, 500);
    free(a), free(b), free(c);
    kv_trace_free(&t);
}

TEST(osl_multiplier_scales_output_only)
{
    kv_synth_knobs_t k;
    kv_trace_t a, b;
    kv_synth_knobs_default(&k);
    gen(&a, &k);
    k.osl_mult = 2.5;
    gen(&b, &k);
    int other = a.n != b.n || a.n_hash_ids != b.n_hash_ids
                || memcmp(a.hash_ids, b.hash_ids, a.n_hash_ids * 8) != 0, out = 0;
    for (size_t i = 0; i < a.n && !other; i++) {
        other |= a.reqs[i].input_length != b.reqs[i].input_length
                 || a.reqs[i].timestamp_ms != b.reqs[i].timestamp_ms;
        out |= b.reqs[i].output_length != (uint32_t)llround(a.reqs[i].output_length * 2.5)
               && !(a.reqs[i].output_length && b.reqs[i].output_length == 1);
    }
    CHECK(!other);
    CHECK(!out);
    kv_trace_free(&a), kv_trace_free(&b);
}

TEST(speedup_compresses_timestamps_only)
{
    kv_synth_knobs_t k;
    kv_trace_t a, b;
    kv_synth_knobs_default(&k);
    gen(&a, &k);
    k.speedup = 4;
    gen(&b, &k);
    int other = memcmp(a.hash_ids, b.hash_ids, a.n_hash_ids * 8) != 0, ts = 0;
    for (size_t i = 0; i < a.n && !other; i++) {
        other |= a.reqs[i].input_length != b.reqs[i].input_length
                 || a.reqs[i].output_length != b.reqs[i].output_length;
        ts |= b.reqs[i].timestamp_ms != a.reqs[i].timestamp_ms / 4;
    }
    CHECK(!other);
    CHECK(!ts);
    CHECK(a.reqs[a.n - 1].timestamp_ms > 1000);
    kv_trace_free(&a), kv_trace_free(&b);
}

/* Unique tokens scale; the shared prefix, outputs and times do not. */
TEST(prompt_multiplier_scales_unique_prompt)
{
    kv_synth_knobs_t k;
    kv_trace_t a, b;
    double ua = 0, ub = 0;
    kv_synth_knobs_default(&k);
    gen(&a, &k);
    k.prompt_len_mult = 2;
    gen(&b, &k);
    int other = 0;
    for (size_t i = 0; i < a.n; i++) {
        uint32_t ca = core_count(&a, i, info.core_blocks), cb = core_count(&b, i, info.core_blocks);
        other |= ca != cb || a.reqs[i].output_length != b.reqs[i].output_length
                 || a.reqs[i].timestamp_ms != b.reqs[i].timestamp_ms
                 || memcmp(kv_trace_ids(&a, &a.reqs[i]), kv_trace_ids(&b, &b.reqs[i]), ca * 8);
        if (a.reqs[i].n_hash > ca) {            /* has a unique prompt */
            ua += a.reqs[i].input_length - (double)ca * BS;
            ub += b.reqs[i].input_length - (double)cb * BS;
        }
    }
    CHECK(!other);
    CHECK(near(ub / ua, 2, 0.001));
    CHECK(consistent(&b));
    kv_trace_free(&a), kv_trace_free(&b);
}

/* Each core radix node doubles; the unique part and everything else stay. */
TEST(prefix_len_multiplier_scales_shared_prefix)
{
    kv_synth_knobs_t k;
    kv_trace_t a, b;
    kv_synth_knobs_default(&k);
    gen(&a, &k);
    k.prefix_len_mult = 2;
    gen(&b, &k);
    int bad = 0;
    for (size_t i = 0; i < a.n; i++) {
        uint32_t ca = core_count(&a, i, info.core_blocks);
        uint32_t cb = core_count(&b, i, 2 * info.core_blocks);
        bad |= cb != 2 * ca
               || b.reqs[i].input_length - a.reqs[i].input_length != ca * BS
               || b.reqs[i].n_hash - cb != a.reqs[i].n_hash - ca
               || a.reqs[i].output_length != b.reqs[i].output_length
               || a.reqs[i].timestamp_ms != b.reqs[i].timestamp_ms;
    }
    CHECK(!bad);
    CHECK(consistent(&b));
    CHECK(kv_trace_ideal_reuse(&b) > kv_trace_ideal_reuse(&a));
    kv_trace_free(&a), kv_trace_free(&b);
}

/*
 * N copies: each request's core ids lie in one copy, and with the copy's
 * offset removed the paths are exactly those of one copy (the copy draw has
 * its own stream). Unique ids sit above every copy and occur once.
 */
TEST(root_multiplier_makes_disjoint_copies)
{
    const uint32_t N = 3;
    const uint64_t C = info.core_blocks;
    kv_synth_knobs_t k;
    kv_trace_t a, b;
    kv_synth_knobs_default(&k);
    gen(&a, &k);
    k.prefix_root_mult = N;
    gen(&b, &k);
    int bad = 0, used[3] = {0};
    for (size_t i = 0; i < a.n; i++) {
        const uint64_t *ia = kv_trace_ids(&a, &a.reqs[i]), *ib = kv_trace_ids(&b, &b.reqs[i]);
        uint32_t ca = core_count(&a, i, C), cb = core_count(&b, i, N * C);
        bad |= ca != cb || a.reqs[i].input_length != b.reqs[i].input_length
               || a.reqs[i].n_hash != b.reqs[i].n_hash;
        if (cb) {
            uint64_t copy = ib[0] / C;
            used[copy] = 1;
            for (uint32_t j = 0; j < cb; j++)
                bad |= ib[j] / C != copy || ib[j] - copy * C != ia[j];
        }
    }
    CHECK(!bad);
    CHECK(used[0] && used[1] && used[2]);
    CHECK(kv_trace_ideal_reuse(&b) < kv_trace_ideal_reuse(&a));

    /* unique ids (>= N*C) occur once in the whole trace */
    uint64_t lo = N * C, hi = lo;
    for (size_t i = 0; i < b.n_hash_ids; i++)
        if (b.hash_ids[i] >= hi)
            hi = b.hash_ids[i] + 1;
    uint8_t *seen = calloc(hi - lo, 1);
    int dup = 0;
    for (size_t i = 0; i < b.n_hash_ids; i++)
        if (b.hash_ids[i] >= lo)
            dup |= seen[b.hash_ids[i] - lo]++ != 0;
    CHECK(!dup);
    free(seen);
    kv_trace_free(&a), kv_trace_free(&b);
}

/* The ablation only redraws lengths: paths, times and copies stay. */
TEST(pooled_lengths_keep_paths)
{
    kv_synth_knobs_t k;
    kv_trace_t a, b;
    kv_synth_knobs_default(&k);
    gen(&a, &k);
    k.pooled_lengths = 1;
    gen(&b, &k);
    int bad = 0;
    for (size_t i = 0; i < a.n; i++) {
        uint32_t ca = core_count(&a, i, info.core_blocks);
        bad |= ca != core_count(&b, i, info.core_blocks)
               || a.reqs[i].timestamp_ms != b.reqs[i].timestamp_ms
               || memcmp(kv_trace_ids(&a, &a.reqs[i]), kv_trace_ids(&b, &b.reqs[i]), ca * 8);
    }
    CHECK(!bad);
    CHECK(consistent(&b));
    kv_trace_free(&a), kv_trace_free(&b);
}

TEST(knob_ranges_checked)
{
    kv_synth_knobs_t k;
    char err[200];
    kv_synth_knobs_default(&k);
    CHECK(kv_synth_knobs_check(&k, err, sizeof(err)) == 0);
    k.speedup = 0;
    CHECK(kv_synth_knobs_check(&k, err, sizeof(err)) != 0);
    CHECK(strstr(err, "--speedup-ratio") != NULL);
    kv_synth_knobs_default(&k);
    k.prefix_root_mult = 0;
    CHECK(kv_synth_knobs_check(&k, err, sizeof(err)) != 0);
    kv_synth_knobs_default(&k);
    k.prompt_len_mult = NAN;
    CHECK(kv_synth_knobs_check(&k, err, sizeof(err)) != 0);
}

int main(void)
{
    char err[200];
    RUN(tiny_tree);
    RUN(tiny_samples_keep_shapes);
    RUN(tree_violation_counted);
    RUN(empty_trace);
    RUN(knob_ranges_checked);
    if (kv_trace_load(SOURCE, &src, err, sizeof(err))
        || kv_synth_build(&src, BS, &model, err, sizeof(err))) {
        fprintf(stderr, "cannot load %s: %s\n", SOURCE, err);
        return 1;
    }
    kv_synth_info(model, &info);
    RUN(multiplier_one_matches_source);
    RUN(deterministic_for_a_seed);
    RUN(osl_multiplier_scales_output_only);
    RUN(speedup_compresses_timestamps_only);
    RUN(prompt_multiplier_scales_unique_prompt);
    RUN(prefix_len_multiplier_scales_shared_prefix);
    RUN(root_multiplier_makes_disjoint_copies);
    RUN(pooled_lengths_keep_paths);
    kv_synth_free(model);
    kv_trace_free(&src);
    return kvt_done();
}
