#include <stdlib.h>

#include "kvtest.h"
#include "kv_trace.h"

static int load_string(kv_trace_t *t, const char *text, char *err, size_t errlen)
{
    FILE *f = fmemopen((void *)text, strlen(text), "r");
    int rc = kv_trace_load_file(f, t, err, errlen);
    fclose(f);
    return rc;
}

TEST(parses_lines)
{
    kv_trace_t t = {0};
    char err[200];
    CHECK(load_string(&t, "{\"timestamp\": 0, \"input_length\": 1000, \"output_length\": 5, "
                          "\"hash_ids\": [1, 2]}\n\n"
                          "{\"timestamp\": 40, \"input_length\": 600, \"output_length\": 2, "
                          "\"hash_ids\": [1, 3]}\n", err, sizeof(err)) == 0);
    CHECK_EQ_U64(t.n, 2);
    CHECK_EQ_U64(t.reqs[1].timestamp_ms, 40);
    CHECK_EQ_U64(t.reqs[1].n_hash, 2);
    CHECK_EQ_U64(kv_trace_ids(&t, &t.reqs[1])[1], 3);
    kv_trace_free(&t);
}

TEST(bad_line_names_its_number)
{
    kv_trace_t t = {0};
    char err[200];
    CHECK(load_string(&t, "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, "
                          "\"hash_ids\": [1]}\n{\"timestamp\": 1, \"input_length\": \"x\"}\n",
                      err, sizeof(err)) == -1);
    CHECK(strncmp(err, "line 2:", 7) == 0);
    kv_trace_free(&t);
}

TEST(ideal_reuse_counts_prefixes)
{
    kv_trace_t t = {0};
    uint64_t a[] = {1, 2, 3}, b[] = {1, 2, 4}, c[] = {5, 2, 3};
    kv_trace_add(&t, 0, 1536, 1, a, 3);
    kv_trace_add(&t, 1, 1536, 1, b, 3);     /* 1,2 reused */
    kv_trace_add(&t, 2, 1536, 1, c, 3);     /* 2,3 under another root: not reused */
    double r = kv_trace_ideal_reuse(&t);
    CHECK(r > 2.0 / 9 - 1e-9 && r < 2.0 / 9 + 1e-9);
    kv_trace_free(&t);
}

TEST(shipped_trace_reuse)
{
    kv_trace_t t = {0};
    char err[200];
    CHECK(kv_trace_load("t/data/mooncake_synthetic_trace.jsonl", &t, err, sizeof(err)) == 0);
    CHECK_EQ_U64(t.n, 3993);
    double r = kv_trace_ideal_reuse(&t);
    CHECK(r > 0.635 && r < 0.645);      /* 64.0% per the trace's README */
    kv_trace_free(&t);
}

int main(void)
{
    RUN(parses_lines);
    RUN(bad_line_names_its_number);
    RUN(ideal_reuse_counts_prefixes);
    RUN(shipped_trace_reuse);
    return kvt_done();
}
