/*
 * The cpu engine's matmul: correct against a double-precision loop, and
 * each output independent of the other tokens in the product (what makes
 * batched, chunked and prefix-reused steps bit-identical).
 */
#include <math.h>
#include <stdlib.h>

#include "kvtest.h"
#include "kvw_cpu_matmul.h"

enum { T = 7, ROWS = 300, COLS = 517 };     /* odd sizes: the vector tail is used */

static float in[T * COLS], w[ROWS * COLS], bias[ROWS], out[T * ROWS], one[ROWS];

static void fill(void)
{
    uint64_t s = 42;
    for (size_t i = 0; i < T * COLS; i++) in[i] = (float) ((s = s * 6364136223846793005ULL + 1) >> 40) / (1 << 24) - 0.5f;
    for (size_t i = 0; i < ROWS * COLS; i++) w[i] = (float) ((s = s * 6364136223846793005ULL + 1) >> 40) / (1 << 24) - 0.5f;
    for (size_t i = 0; i < ROWS; i++) bias[i] = (float) i / ROWS;
}

TEST(matmul_matches_double_reference)
{
    double worst = 0;
    kvw_cpu_matmul(out, in, w, bias, T, ROWS, COLS);
    for (size_t t = 0; t < T; t++)
        for (size_t r = 0; r < ROWS; r++) {
            double ref = bias[r];
            for (size_t c = 0; c < COLS; c++) ref += (double) in[t * COLS + c] * w[r * COLS + c];
            worst = fmax(worst, fabs(ref - out[t * ROWS + r]));
        }
    CHECK(worst < 1e-4);
}

TEST(matmul_rows_independent_of_batch)
{
    kvw_cpu_matmul(out, in, w, NULL, T, ROWS, COLS);
    for (size_t t = 0; t < T; t++) {
        kvw_cpu_matmul(one, in + t * COLS, w, NULL, 1, ROWS, COLS);
        CHECK(memcmp(one, out + t * ROWS, sizeof one) == 0);
    }
}

int main(void)
{
    setenv("KVW_THREADS", "2", 1);
    fill();
    RUN(matmul_matches_double_reference);
    RUN(matmul_rows_independent_of_batch);
    return kvt_done();
}
