/* Trace synthesis on small hand-made traces: tree building, sampling, knobs. */
#include <stdlib.h>
#include "kvtest.h"
#include "kv_synth.h"

static void build(kv_trace_t *t)
{
    /* a shared 3-block system prompt, two branches of it, and unique tails */
    static const uint64_t a[] = { 1, 2, 3, 10, 100 }, b[] = { 1, 2, 3, 10, 101 },
                          c[] = { 1, 2, 3, 20, 102 }, d[] = { 1, 2, 3, 20, 103, 104 },
                          e[] = { 7 }, f[] = { 1, 2, 3 };
    memset(t, 0, sizeof(*t));
    kv_trace_add(t, 0, 5 * 512 - 100, 10, a, 5);
    kv_trace_add(t, 100, 5 * 512 - 50, 20, b, 5);
    kv_trace_add(t, 200, 5 * 512, 30, c, 5);
    kv_trace_add(t, 300, 6 * 512 - 1, 40, d, 6);
    kv_trace_add(t, 400, 300, 50, e, 1);
    kv_trace_add(t, 500, 3 * 512, 60, f, 3);
}

TEST(stats_of_a_known_tree)
{
    kv_trace_t       t;
    kv_synth_stats_t st;
    char             err[128];

    build(&t);
    CHECK(kv_synth_stats(&t, 512, &st, err, sizeof(err)) == 0);
    CHECK_EQ_U64(st.requests, 6);
    CHECK_EQ_U64(st.core_nodes, 5);          /* 1 2 3 10 20 */
    CHECK_EQ_U64(st.unique_leaves, 5);        /* all but f */
    CHECK_EQ_U64(st.depth, 4);
    CHECK_EQ_U64(st.radix_nodes, 3);          /* [1 2 3], [10], [20] */
    kv_trace_free(&t);
}

TEST(samples_keep_structure_and_are_deterministic)
{
    kv_trace_t       t, o1 = { 0 }, o2 = { 0 };
    kv_synth_knobs_t k;
    char             err[128];
    kv_synth_t      *s;
    size_t           i;

    build(&t);
    s = kv_synth_learn(&t, 512, err, sizeof(err));
    CHECK(s != NULL);
    kv_synth_knobs_default(&k);
    k.num_requests = 2000;
    CHECK(kv_synth_sample(s, &k, &o1) == 0);
    CHECK(kv_synth_sample(s, &k, &o2) == 0);
    CHECK_EQ_U64(o1.n, 2000);
    CHECK(o1.n_hash_ids == o2.n_hash_ids
          && memcmp(o1.hash_ids, o2.hash_ids, o1.n_hash_ids * 8) == 0);
    for (i = 0; i < o1.n; i++) {
        const kv_trace_req_t *r = &o1.reqs[i];
        const uint64_t       *ids = kv_trace_ids(&o1, r);

        /* hash ids match the length; paths start where the source's did */
        CHECK(r->n_hash == 0 || (r->input_length > (r->n_hash - 1) * 512u
                                 && r->input_length <= r->n_hash * 512u));
        CHECK(r->n_hash == 0 || ids[0] == 1 || ids[0] > 104);    /* fresh ids follow the largest */
        if (r->n_hash >= 4 && ids[0] == 1) {
            CHECK(ids[1] == 2 && ids[2] == 3 && (ids[3] == 10 || ids[3] == 20 || ids[3] > 104));
        }
    }
    kv_synth_free(s);
    kv_trace_free(&t);
    kv_trace_free(&o1);
    kv_trace_free(&o2);
}

TEST(osl_and_speedup_knobs)
{
    kv_trace_t       t, o = { 0 };
    kv_synth_knobs_t k;
    char             err[128];
    kv_synth_t      *s;
    double           out = 0;
    size_t           i;

    build(&t);
    s = kv_synth_learn(&t, 512, err, sizeof(err));
    kv_synth_knobs_default(&k);
    k.num_requests = 3000;
    k.osl_multiplier = 3;
    k.speedup_ratio = 10;
    CHECK(kv_synth_sample(s, &k, &o) == 0);
    for (i = 0; i < o.n; i++) out += o.reqs[i].output_length;
    out /= (double) o.n;
    CHECK(out > 3 * 35 * 0.9 && out < 3 * 35 * 1.1);          /* source mean 35 */
    CHECK(o.reqs[o.n - 1].timestamp_ms < 3000 * 100 / 10 * 1.2);  /* gaps of 100 ms / 10 */
    kv_synth_free(s);
    kv_trace_free(&t);
    kv_trace_free(&o);
}

TEST(not_a_tree_is_refused)
{
    kv_trace_t      t = { 0 };
    static const uint64_t a[] = { 1, 2 }, b[] = { 3, 2 };
    char            err[128];

    kv_trace_add(&t, 0, 1024, 1, a, 2);
    kv_trace_add(&t, 1, 1024, 1, b, 2);
    CHECK(kv_synth_learn(&t, 512, err, sizeof(err)) == NULL);
    CHECK(strstr(err, "two different parents") != NULL);
    kv_trace_free(&t);
}

int main(void)
{
    RUN(stats_of_a_known_tree);
    RUN(samples_keep_structure_and_are_deterministic);
    RUN(osl_and_speedup_knobs);
    RUN(not_a_tree_is_refused);
    return kvt_done();
}
