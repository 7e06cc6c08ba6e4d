/* The mock backend's timing: Dynamo's polynomial and an interpolated profile. */
#include "kvtest.h"
#include "kvw_backend.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define NEAR(a, b) (fabs((double)(a) - (double)(b)) < 1e-6 * (1 + fabs((double)(b))))

static double step_ms(kvw_backend_t *b, uint32_t prefill, uint32_t decode_ctx)
{
    kvw_step_seq_t q[2];
    uint64_t rng = 1;
    uint32_t n = 0;
    double ms = -1;

    memset(q, 0, sizeof(q));
    if (prefill) {
        q[n].n_tokens = prefill;
        q[n].sample = 1;
        q[n].sampling.rng = &rng;
        n++;
    }
    if (decode_ctx) {
        q[n].n_tokens = 1;
        q[n].pos = decode_ctx - 1;
        q[n].decode = 1;
        q[n].sample = 1;
        q[n].sampling.rng = &rng;
        n++;
    }
    CHECK(b->step(b, q, n, &ms) == 0);
    return ms;
}

TEST(polynomial_matches_reference_examples)
{
    /* dynamo reference: prefill 512 -> 24.4 ms, 4096 -> 85.8; decode p=0 5.74, .5 26.3, 1 34.0 */
    CHECK(fabs(kvw_mock_poly_prefill_ms(512) - 24.4) < 0.05);
    CHECK(fabs(kvw_mock_poly_prefill_ms(4096) - 85.8) < 0.05);
    CHECK(kvw_mock_poly_prefill_ms(0) == 0);
    CHECK(NEAR(kvw_mock_poly_decode_ms(0), 5.74));
    CHECK(fabs(kvw_mock_poly_decode_ms(0.5) - 26.3) < 0.05);
    CHECK(fabs(kvw_mock_poly_decode_ms(1) - 34.01) < 0.01);
    CHECK(NEAR(kvw_mock_poly_decode_ms(2), kvw_mock_poly_decode_ms(1)));
}

TEST(step_time_sums_and_speedup)
{
    kvw_backend_config_t c = { .block_size = 16, .num_blocks = 1024, .speedup = 2 };
    char err[128];
    kvw_backend_t *b = kvw_mock_backend_create(&c, err, sizeof(err));

    CHECK(b != NULL && b->simulated);
    double p = kvw_mock_poly_prefill_ms(1000), d = kvw_mock_poly_decode_ms(8192.0 / 16384);
    CHECK(NEAR(step_ms(b, 1000, 0), p / 2));
    CHECK(NEAR(step_ms(b, 0, 8192), d / 2));
    CHECK(NEAR(step_ms(b, 1000, 8192), (p + d) / 2));
    b->destroy(b);
}

TEST(tokens_are_deterministic_text)
{
    kvw_backend_config_t c = { .block_size = 16, .num_blocks = 64, .speedup = 1 };
    char err[128];
    kvw_backend_t *b = kvw_mock_backend_create(&c, err, sizeof(err));
    kvw_step_seq_t q;
    uint64_t rng = 42;
    double ms;
    uint32_t first;

    memset(&q, 0, sizeof(q));
    q.n_tokens = 5;
    q.sample = 1;
    q.sampling.rng = &rng;
    b->step(b, &q, 1, &ms);
    first = q.next_token;
    CHECK(first == ' ' || (first >= 'a' && first <= 'z'));
    q.next_token = 0;
    b->step(b, &q, 1, &ms);
    CHECK_EQ_U64(q.next_token, first);
    b->destroy(b);
}

TEST(profile_interpolates)
{
    char path[] = "/tmp/kvw_profile_XXXXXX";
    int fd = mkstemp(path);
    FILE *f = fdopen(fd, "w");
    fprintf(f, "{\"prefill_isl\":[100,1100],\"prefill_ttft_ms\":[10,30],"
               "\"decode_active_kv_tokens\":[0,1000],\"decode_context_length\":[100,200],"
               "\"decode_itl\":[[4,6],[8,10]]}");
    fclose(f);
    kvw_backend_config_t c = { .block_size = 16, .num_blocks = 64, .speedup = 1, .profile = path };
    char err[256];
    kvw_backend_t *b = kvw_mock_backend_create(&c, err, sizeof(err));
    CHECK(b != NULL);
    if (b) {
        CHECK(NEAR(step_ms(b, 600, 0), 20));        /* halfway */
        CHECK(NEAR(step_ms(b, 2100, 0), 50));       /* extrapolated */
        CHECK(NEAR(step_ms(b, 0, 150), 4 + 0.15 * 4 + 1));  /* a=150, c=150 */
        b->destroy(b);
    }
    /* broken profiles are refused with a reason */
    f = fopen(path, "w");
    fprintf(f, "{\"prefill_isl\":[2,1],\"prefill_ttft_ms\":[1,2]}");
    fclose(f);
    CHECK(kvw_mock_backend_create(&c, err, sizeof(err)) == NULL);
    CHECK(strstr(err, "ascending") != NULL);
    unlink(path);
}

int main(void)
{
    RUN(polynomial_matches_reference_examples);
    RUN(step_time_sums_and_speedup);
    RUN(tokens_are_deterministic_text);
    RUN(profile_interpolates);
    return kvt_done();
}
