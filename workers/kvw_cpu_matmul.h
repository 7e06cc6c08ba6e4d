/* The cpu engine's matmul: f32, row-major, output rows split over threads. */
#ifndef KVW_CPU_MATMUL_H
#define KVW_CPU_MATMUL_H

#include <stddef.h>

/* out[t][r] = sum_c w[r][c] * in[t][c] (+ bias[r]); weights row-major [rows][cols]. */
void kvw_cpu_matmul(float *out, const float *in, const float *w, const float *bias,
                    size_t T, size_t rows, size_t cols);

#endif
