/*
 * The cpu engine's matmul, where nearly all of its time goes. Two things
 * over a plain loop: the dot product uses GCC vector types (16 lanes in two
 * accumulators) so it vectorises without -ffast-math, and output rows are
 * split over threads (KVW_THREADS, default the CPU count). Each output is
 * summed in an order that depends only on cols, so results do not depend
 * on the thread count or on which other tokens share the step: batching,
 * chunking and prefix reuse stay bit-identical.
 */
#include "kvw_cpu_matmul.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef float v8f __attribute__((vector_size(32)));

static float dot(const float *a, const float *b, size_t n)
{
    v8f    acc0 = { 0 }, acc1 = { 0 };
    size_t i = 0;
    float  s = 0;

    for (; i + 16 <= n; i += 16) {
        v8f a0, a1, b0, b1;

        memcpy(&a0, a + i, 32);
        memcpy(&a1, a + i + 8, 32);
        memcpy(&b0, b + i, 32);
        memcpy(&b1, b + i + 8, 32);
        acc0 += a0 * b0;
        acc1 += a1 * b1;
    }
    acc0 += acc1;
    for (int k = 0; k < 8; k++) s += acc0[k];
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

typedef struct {
    float       *out;
    const float *in, *w, *bias;
    size_t       T, rows, cols, lo, hi;
} job_t;

/*
 * Rows [lo, hi) in tiles of TILE rows: a tile of weights stays in cache
 * while every token passes over it, so with many tokens the inputs are
 * streamed once per tile rather than once per weight row.
 */
static void *run(void *arg)
{
    enum { TILE = 16 };
    const job_t *j = arg;

    for (size_t r0 = j->lo; r0 < j->hi; r0 += TILE) {
        size_t r1 = r0 + TILE < j->hi ? r0 + TILE : j->hi;

        for (size_t t = 0; t < j->T; t++) {
            const float *x = j->in + t * j->cols;

            for (size_t r = r0; r < r1; r++)
                j->out[t * j->rows + r] = dot(x, j->w + r * j->cols, j->cols) + (j->bias ? j->bias[r] : 0.0f);
        }
    }
    return NULL;
}

static int threads(void)
{
    static int n;

    if (n == 0) {
        const char *e = getenv("KVW_THREADS");
        long        v = e ? strtol(e, NULL, 10) : sysconf(_SC_NPROCESSORS_ONLN);

        n = v < 1 ? 1 : v > 64 ? 64 : (int) v;
    }
    return n;
}

void kvw_cpu_matmul(float *out, const float *in, const float *w, const float *bias,
                    size_t T, size_t rows, size_t cols)
{
    enum { MAX = 64 };
    job_t     jobs[MAX];
    pthread_t tid[MAX];
    int       started[MAX] = { 0 }, n = threads();

    /* a thread costs tens of microseconds: only worth it for large products */
    if (n == 1 || (double) T * rows * cols < (double) (1 << 18)) n = 1;
    for (int i = 0; i < n; i++) {
        jobs[i] = (job_t) { out, in, w, bias, T, rows, cols, rows * (size_t) i / (size_t) n,
                            rows * (size_t) (i + 1) / (size_t) n };
        if (i > 0) started[i] = pthread_create(&tid[i], NULL, run, &jobs[i]) == 0;
    }
    run(&jobs[0]);
    for (int i = 1; i < n; i++) {
        if (started[i]) pthread_join(tid[i], NULL);
        else run(&jobs[i]);     /* no thread: do its share here */
    }
}
