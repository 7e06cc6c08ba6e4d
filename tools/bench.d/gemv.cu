/*
 * gemv-bench: the CUDA engine's k_gemv against cuBLAS's GEMM on the matmul
 * shapes of a decode step of tools/bench.d/engine's 1.2B model (bf16
 * weights): the read bandwidth each reaches, from CUDA events over
 * repeated launches, one JSON line per (shape, tokens). Built and run by
 * tools/bench.d/gemv on a machine with a GPU; -DKVC_GEMV_WARPS=N and
 * -DKVC_GEMV_UNROLL=N build k_gemv's other shapes.
 */
#include <cublas_v2.h>
#include <stdio.h>
#include <stdlib.h>

#include "kvw_cuda_kernels.cuh"

#define REPS 50

/* w[i] = a small pseudo-random bf16, so the products are finite */
__global__ void k_fill(__nv_bfloat16 *w, size_t n, unsigned seed)
{
    for (size_t i = blockIdx.x * (size_t) blockDim.x + threadIdx.x; i < n;
         i += (size_t) gridDim.x * blockDim.x) {
        unsigned h = (unsigned) i * 2654435761u ^ seed;

        w[i] = __float2bfloat16(((float) (h >> 8) / 16777216.0f - 0.5f) * 0.05f);
    }
}

static double time_us(cudaEvent_t a, cudaEvent_t b)
{
    float ms;

    cudaEventSynchronize(b);
    cudaEventElapsedTime(&ms, a, b);
    return ms * 1000.0 / REPS;
}

int main(void)
{
    /* qkv, o_proj, gate|up, down_proj, lm_head (hidden 2048, intermediate 8192, vocab 50257) */
    const int      shapes[5][2] = {{3072, 2048}, {2048, 2048}, {16384, 2048}, {2048, 8192},
                                   {50257, 2048}};
    const char    *names[5] = {"qkv", "o_proj", "gate_up", "down", "lm_head"};
    __nv_bfloat16 *w, *x;
    float         *out, alpha = 1.0f, beta = 0.0f;
    cublasHandle_t cb;
    cudaEvent_t    a, b;

    if (cudaMalloc((void **) &w, (size_t) 50257 * 2048 * 2) != cudaSuccess
        || cudaMalloc((void **) &x, (size_t) KVC_GEMV_MAX_T * 8192 * 2) != cudaSuccess
        || cudaMalloc((void **) &out, (size_t) KVC_GEMV_MAX_T * 50257 * 4) != cudaSuccess
        || cublasCreate(&cb) != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "gemv-bench: no GPU, or no memory on it\n");
        return 2;
    }
    k_fill<<<1024, 256>>>(w, (size_t) 50257 * 2048, 1);
    k_fill<<<64, 256>>>(x, (size_t) KVC_GEMV_MAX_T * 8192, 2);
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    for (int s = 0; s < 5; s++) {
        int    rows = shapes[s][0], cols = shapes[s][1];
        double bytes = (double) rows * cols * 2, g, c;

        for (int T = 1; T <= KVC_GEMV_MAX_T; T *= 4) {
            unsigned blocks = (unsigned) ((rows + KVC_GEMV_WARPS - 1) / KVC_GEMV_WARPS);

            k_gemv<__nv_bfloat16><<<blocks, 32 * KVC_GEMV_WARPS>>>(out, x, w, T, rows, cols, 0);
            cudaEventRecord(a);
            for (int r = 0; r < REPS; r++)
                k_gemv<__nv_bfloat16><<<blocks, 32 * KVC_GEMV_WARPS>>>(out, x, w, T, rows, cols, 0);
            cudaEventRecord(b);
            g = time_us(a, b);
            cublasGemmEx(cb, CUBLAS_OP_T, CUBLAS_OP_N, rows, T, cols, &alpha, w, CUDA_R_16BF, cols,
                         x, CUDA_R_16BF, cols, &beta, out, CUDA_R_32F, rows, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT);
            cudaEventRecord(a);
            for (int r = 0; r < REPS; r++)
                cublasGemmEx(cb, CUBLAS_OP_T, CUBLAS_OP_N, rows, T, cols, &alpha, w, CUDA_R_16BF,
                             cols, x, CUDA_R_16BF, cols, &beta, out, CUDA_R_32F, rows,
                             CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
            cudaEventRecord(b);
            c = time_us(a, b);
            printf("{\"shape\":\"%s\",\"rows\":%d,\"cols\":%d,\"tokens\":%d,\"warps\":%d,"
                   "\"unroll\":%d,\"gemv_us\":%.2f,\"gemv_gbps\":%.0f,\"cublas_us\":%.2f,"
                   "\"cublas_gbps\":%.0f}\n", names[s], rows, cols, T, KVC_GEMV_WARPS,
                   KVC_GEMV_UNROLL, g, bytes / g / 1e3, c, bytes / c / 1e3);
        }
    }
    if (cudaDeviceSynchronize() != cudaSuccess) {
        fprintf(stderr, "gemv-bench: %s\n", cudaGetErrorString(cudaGetLastError()));
        return 1;
    }
    return 0;
}
