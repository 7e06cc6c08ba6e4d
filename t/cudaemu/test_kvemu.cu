/*
 * kvemu itself (workers/cuda/emu): that the emulation catches what it
 * claims to (docs/CUDA.md): barriers and shuffles that behave as on a GPU,
 * a missing barrier that shows as a difference between thread orders, a
 * barrier in divergent code reported, launches queued until a sync point,
 * copies and cuBLAS arguments checked, sticky faults, half/bfloat16
 * rounding. Built with g++ against the emulation headers, under ASan.
 */
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "kvtest.h"
#include "kvw_cuda_kernels.cuh"

extern "C" {
#include "kvw_sample.h"
}
#include "kvw_cuda_sample.h"

#define KVC_COMMA ,

static void order(const char *o) { setenv("KVW_CUDAEMU_ORDER", o, 1); }

/* --- kernels ----------------------------------------------------------------- */

__global__ void k_warp_sum(float *out, const float *in)
{
    float v = in[threadIdx.x];

    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    out[threadIdx.x] = v;
}

__global__ void k_shfl_moves(int *bcast, int *down)
{
    int lane = threadIdx.x & 31;

    bcast[threadIdx.x] = __shfl_sync(0xffffffffu, lane * 10, 3);
    down[threadIdx.x] = __shfl_down_sync(0xffffffffu, lane, 1);
}

/* reads the neighbour's write: right only with the barrier */
__global__ void k_neighbour(int *out, int with_barrier)
{
    __shared__ int s[256];

    s[threadIdx.x] = (int) (threadIdx.x * 3 + blockIdx.x);
    if (with_barrier) __syncthreads();
    out[blockIdx.x * blockDim.x + threadIdx.x] = s[(threadIdx.x + 1) % blockDim.x];
}

__global__ void k_divergent(int *out)
{
    if (threadIdx.x < 16) return;
    __syncthreads();
    out[threadIdx.x] = 1;
}

__global__ void k_fill(float *p, float v) { p[threadIdx.x] = v; }

/* --- tests ------------------------------------------------------------------- */

TEST(warp_shuffles_reduce_and_move_values)
{
    float *in, *out, h[64];
    int   *b, *d, hb[64], hd[64];

    for (const char *o : {"forward", "reverse"}) {
        order(o);
        CHECK(cudaMalloc((void **) &in, sizeof(h)) == cudaSuccess);
        CHECK(cudaMalloc((void **) &out, sizeof(h)) == cudaSuccess);
        for (int i = 0; i < 64; i++) h[i] = (float) i;
        cudaMemcpy(in, h, sizeof(h), cudaMemcpyHostToDevice);
        KVW_LAUNCH(k_warp_sum, 1, 64, 0, (cudaStream_t) 0, out, in);
        CHECK(cudaGetLastError() == cudaSuccess);
        CHECK(cudaMemcpy(h, out, sizeof(h), cudaMemcpyDeviceToHost) == cudaSuccess);
        for (int i = 0; i < 64; i++) CHECK(h[i] == (i < 32 ? 496.0f : 1520.0f));
        CHECK(cudaMalloc((void **) &b, sizeof(hb)) == cudaSuccess);
        CHECK(cudaMalloc((void **) &d, sizeof(hd)) == cudaSuccess);
        KVW_LAUNCH(k_shfl_moves, 1, 64, 0, (cudaStream_t) 0, b, d);
        cudaMemcpy(hb, b, sizeof(hb), cudaMemcpyDeviceToHost);
        cudaMemcpy(hd, d, sizeof(hd), cudaMemcpyDeviceToHost);
        for (int i = 0; i < 64; i++) {
            CHECK(hb[i] == 30);
            CHECK(hd[i] == ((i & 31) == 31 ? 31 : (i & 31) + 1));  /* the last lane keeps its own */
        }
        cudaFree(in); cudaFree(out); cudaFree(b); cudaFree(d);
    }
}

/* a missing __syncthreads: one of the two orders reads a value not yet written */
TEST(a_missing_barrier_shows_in_one_order)
{
    int *out, fwd[512], rev[512], good = 1;

    CHECK(cudaMalloc((void **) &out, sizeof(fwd)) == cudaSuccess);
    for (int with = 1; with >= 0; with--) {
        order("forward");
        KVW_LAUNCH(k_neighbour, 2, 256, 0, (cudaStream_t) 0, out, with);
        cudaMemcpy(fwd, out, sizeof(fwd), cudaMemcpyDeviceToHost);
        order("reverse");
        KVW_LAUNCH(k_neighbour, 2, 256, 0, (cudaStream_t) 0, out, with);
        cudaMemcpy(rev, out, sizeof(rev), cudaMemcpyDeviceToHost);
        good = 1;
        for (int i = 0; i < 512; i++) {
            int want = ((i % 256 + 1) % 256) * 3 + i / 256;

            good &= fwd[i] == want && rev[i] == want;
        }
        CHECK(good == with);        /* right with the barrier, wrong in some order without */
    }
    order("forward");
    cudaFree(out);
}

TEST(launches_wait_for_a_sync_point)
{
    cudaStream_t st;
    float       *d, *h;

    CHECK(cudaStreamCreateWithFlags(&st, cudaStreamDefault) == cudaSuccess);
    CHECK(cudaMalloc((void **) &d, 32 * sizeof(float)) == cudaSuccess);
    CHECK(cudaMallocHost((void **) &h, 32 * sizeof(float)) == cudaSuccess);
    for (int i = 0; i < 32; i++) h[i] = -1;
    KVW_LAUNCH(k_fill, 1, 32, 0, st, d, 7.0f);
    CHECK(cudaMemcpyAsync(h, d, 32 * sizeof(float), cudaMemcpyDeviceToHost, st) == cudaSuccess);
    CHECK(h[0] == -1);              /* nothing has run yet */
    CHECK(cudaStreamSynchronize(st) == cudaSuccess);
    CHECK(h[0] == 7 && h[31] == 7);
    cudaFreeHost(h); cudaFree(d); cudaStreamDestroy(st);
}

TEST(copies_and_configurations_are_checked)
{
    float *d, h[8];

    CHECK(cudaMalloc((void **) &d, 4 * sizeof(float)) == cudaSuccess);
    CHECK(cudaMemcpy(d, h, 8 * sizeof(float), cudaMemcpyHostToDevice) == cudaErrorInvalidValue);
    CHECK(cudaMemcpy(h, d, 4 * sizeof(float), cudaMemcpyHostToDevice) == cudaErrorInvalidValue);
    CHECK(cudaGetLastError() == cudaErrorInvalidValue);
    CHECK(cudaGetLastError() == cudaSuccess);   /* not sticky */
    KVW_LAUNCH(k_fill, 1, 2048, 0, (cudaStream_t) 0, d, 1.0f);
    CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration);
    CHECK(cudaFree(h) == cudaErrorInvalidValue);
    cudaGetLastError();
    cudaFree(d);
}

TEST(gemm_matches_a_reference_and_checks_arguments)
{
    cublasHandle_t cb;
    const int      m = 3, n = 2, k = 4;
    float          A[k * m], B[k * n], C[m * n], ref[m * n], one = 1, zero = 0;
    float         *dA, *dB, *dC;

    for (int i = 0; i < k * m; i++) A[i] = (float) (i % 5) - 2;
    for (int i = 0; i < k * n; i++) B[i] = (float) (i % 3) + 0.5f;
    /* C = A^T B with A stored k x m (lda k), B k x n (ldb k): column-major */
    for (int j = 0; j < n; j++) {
        for (int i = 0; i < m; i++) {
            float s = 0;

            for (int l = 0; l < k; l++) s += A[i * k + l] * B[j * k + l];
            ref[j * m + i] = s;
        }
    }
    CHECK(cublasCreate(&cb) == CUBLAS_STATUS_SUCCESS);
    cudaMalloc((void **) &dA, sizeof(A));
    cudaMalloc((void **) &dB, sizeof(B));
    cudaMalloc((void **) &dC, sizeof(C));
    cudaMemcpy(dA, A, sizeof(A), cudaMemcpyHostToDevice);
    cudaMemcpy(dB, B, sizeof(B), cudaMemcpyHostToDevice);
    CHECK(cublasGemmEx(cb, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one, dA, CUDA_R_32F, k, dB,
                       CUDA_R_32F, k, &zero, dC, CUDA_R_32F, m, CUBLAS_COMPUTE_32F,
                       CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS);
    cudaMemcpy(C, dC, sizeof(C), cudaMemcpyDeviceToHost);
    for (int i = 0; i < m * n; i++) CHECK(C[i] == ref[i]);
    /* the mistakes a caller makes */
    CHECK(cublasGemmEx(cb, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &one, dA, CUDA_R_32F, k - 2, dB,
                       CUDA_R_32F, k, &zero, dC, CUDA_R_32F, m, CUBLAS_COMPUTE_32F,
                       CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_INVALID_VALUE);   /* lda < m */
    CHECK(cublasGemmEx(cb, CUBLAS_OP_T, CUBLAS_OP_N, m, n + 1, k, &one, dA, CUDA_R_32F, k, dB,
                       CUDA_R_32F, k, &zero, dC, CUDA_R_32F, m, CUBLAS_COMPUTE_32F,
                       CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_INVALID_VALUE);   /* B, C too small */
    CHECK(cublasGemmEx(cb, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one, A, CUDA_R_32F, k, dB,
                       CUDA_R_32F, k, &zero, dC, CUDA_R_32F, m, CUBLAS_COMPUTE_32F,
                       CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_INVALID_VALUE);   /* host A */
    CHECK(cublasGemmEx(cb, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one, dA, CUDA_R_32F, k, dB,
                       CUDA_R_16BF, k, &zero, dC, CUDA_R_32F, m, CUBLAS_COMPUTE_32F,
                       CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_NOT_SUPPORTED);   /* mixed types */
    CHECK(cublasGemmEx(cb, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, dC, dA, CUDA_R_32F, k, dB,
                       CUDA_R_32F, k, &zero, dC, CUDA_R_32F, m, CUBLAS_COMPUTE_32F,
                       CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_INVALID_VALUE);   /* device alpha */
    cublasDestroy(cb);
    cudaFree(dA); cudaFree(dB); cudaFree(dC);
}

TEST(half_and_bfloat16_round_to_nearest_even)
{
    CHECK(__half2float(__float2half(1.0f + 1.0f / 2048)) == 1.0f);             /* tie: even */
    CHECK(__half2float(__float2half(1.0f + 3.0f / 2048)) == 1.0f + 2.0f / 1024);
    CHECK(__half2float(__float2half(65504.0f)) == 65504.0f);
    CHECK(isinf(__half2float(__float2half(70000.0f))));
    CHECK(__half2float(__float2half(5.9604645e-08f)) == 5.9604645e-08f);       /* smallest subnormal */
    CHECK(__bfloat162float(__float2bfloat16(1.0f + 1.0f / 256)) == 1.0f);      /* tie: even */
    CHECK(__bfloat162float(__float2bfloat16(1.0f + 3.0f / 256)) == 1.0f + 2.0f / 128);
    CHECK(isnan(__bfloat162float(__float2bfloat16(nanf("")))));
}

/* The engine's two-pass device argmax (copy_out's launches), chunk logits a block. */
static void argmax_rows(int *best, const float *logits, int rows, int vocab, int chunk)
{
    int    nchunk = (vocab + chunk - 1) / chunk, *di;
    float *dv;

    cudaMalloc((void **) &dv, sizeof(float) * rows * nchunk);
    cudaMalloc((void **) &di, sizeof(int) * rows * nchunk);
    KVW_LAUNCH(k_argmax, dim3(rows, nchunk), 256, 0, (cudaStream_t) 0, dv, di, logits, vocab,
               chunk);
    KVW_LAUNCH(k_argmax_pick, rows, 32, 0, (cudaStream_t) 0, best, dv, di, nchunk, vocab);
    cudaDeviceSynchronize();
    cudaFree(dv); cudaFree(di);
}

/* The engine's device argmax (greedy sampling) against kvw_sample's host scan. */
TEST(argmax_kernel_matches_the_host_scan)
{
    const int rows = 5, vocab = 1000;
    float    *h = (float *) malloc(sizeof(float) * rows * vocab), *d;
    int       got[rows], *db;
    uint64_t  x = 42;

    for (int i = 0; i < rows * vocab; i++) {
        x = x * 6364136223846793005ULL + 1442695040888963407ULL;
        h[i] = (float) ((x >> 40) % 50) - 25;       /* many ties */
    }
    for (int i = 0; i < vocab; i++) h[3 * vocab + i] = -INFINITY;   /* nothing beats -inf: 0 */
    h[4 * vocab + 999] = 1e9f;                                      /* the last index */
    cudaMalloc((void **) &d, sizeof(float) * rows * vocab);
    cudaMalloc((void **) &db, sizeof(got));
    cudaMemcpy(d, h, sizeof(float) * rows * vocab, cudaMemcpyHostToDevice);
    /* chunks of 1000 (one a row), 96 (ties across chunks) and 7 (more chunks than a warp) */
    for (int chunk : {1000, 96, 7}) for (const char *o : {"forward", "reverse"}) {
        order(o);
        argmax_rows(db, d, rows, vocab, chunk);
        CHECK(cudaMemcpy(got, db, sizeof(got), cudaMemcpyDeviceToHost) == cudaSuccess);
        for (int r = 0; r < rows; r++) {
            int best = 0;

            for (int i = 1; i < vocab; i++) {
                if (h[r * vocab + i] > h[r * vocab + best]) best = i;
            }
            CHECK_EQ_U64(got[r], best);
        }
    }
    order("forward");
    cudaFree(d); cudaFree(db); free(h);
}

/* --- the engine's attention kernels against a CPU reference ------------------------ */

/* A small paged step: 4 tokens (one decode token at position 13, a 3-token chunk at 3..5). */
enum { AH = 8, AKV = 2, AHD = 40, ABS = 4, ALAYERS = 2, ANB = 12, AT = 4 };

static uint64_t lcg(uint64_t *x)
{
    *x = *x * 6364136223846793005ULL + 1442695040888963407ULL;
    return *x >> 33;
}

static float frand(uint64_t *x) { return (float) lcg(x) / (float) (1u << 31) * 2.0f - 1.0f; }

struct att_case {
    int    pos[AT], bt[AT], tables[6];
    float  qkv[AT * (AH + 2 * AKV) * AHD];
    float  pool[ANB * ALAYERS * 2 * ABS * AKV * AHD];   /* as the kernels see it (KV rounded) */
    double ref[AT * AH * AHD];
};

template <class KV> static void att_setup(att_case *c, KV *host_pool)
{
    const int tables[6] = {7, 2, 9, 4, 11, 0}, pos[AT] = {13, 3, 4, 5}, bt[AT] = {0, 4, 4, 4};
    size_t    n = sizeof(c->pool) / sizeof(float);
    uint64_t  x = 7;
    int       qd = AH * AHD, kd = AKV * AHD, ld = qd + 2 * kd, G = AH / AKV;
    size_t    layer_e = 2 * (size_t) ABS * kd, block_e = layer_e * ALAYERS;

    memcpy(c->tables, tables, sizeof(tables));
    memcpy(c->pos, pos, sizeof(pos));
    memcpy(c->bt, bt, sizeof(bt));
    for (size_t i = 0; i < sizeof(c->qkv) / sizeof(float); i++) c->qkv[i] = frand(&x);
    for (size_t i = 0; i < n; i++) {
        host_pool[i] = from_f<KV>(frand(&x) * 2.0f);
        c->pool[i] = to_f(host_pool[i]);
    }
    /* layer 1, in double: softmax(q k / sqrt(hd)) v over positions 0..pos */
    for (int t = 0; t < AT; t++) {
        for (int h = 0; h < AH; h++) {
            double s[16], mx = -1e300, sum = 0;
            int    kvh = h / G;

            for (int p = 0; p <= c->pos[t]; p++) {
                const float *k = c->pool + (size_t) c->tables[c->bt[t] + p / ABS] * block_e
                                 + layer_e + (size_t) (p % ABS) * kd + (size_t) kvh * AHD;

                s[p] = 0;
                for (int d = 0; d < AHD; d++)
                    s[p] += (double) c->qkv[t * ld + h * AHD + d] * k[d] / sqrt((double) AHD);
                mx = s[p] > mx ? s[p] : mx;
            }
            for (int p = 0; p <= c->pos[t]; p++) sum += exp(s[p] - mx);
            for (int d = 0; d < AHD; d++) {
                double r = 0;

                for (int p = 0; p <= c->pos[t]; p++) {
                    const float *v = c->pool + (size_t) c->tables[c->bt[t] + p / ABS] * block_e
                                     + layer_e + layer_e / 2 + (size_t) (p % ABS) * kd
                                     + (size_t) kvh * AHD;

                    r += exp(s[p] - mx) / sum * v[d];
                }
                c->ref[(t * AH + h) * AHD + d] = r;
            }
        }
    }
}

/* Largest |kernel - reference| of each attention kernel, the split one at several split lengths. */
template <class KV> static void attention_kernels_match(const char *what)
{
    att_case *c = (att_case *) calloc(1, sizeof(att_case));
    KV       *hp = (KV *) malloc(sizeof(c->pool) / sizeof(float) * sizeof(KV));
    int      *dm;
    float    *dq, *dpart, *dout, out[AT * AH * AHD];
    void     *dpool;
    kvc_meta  m;
    size_t    kd = AKV * AHD, layer_e = 2 * (size_t) ABS * kd, block_e = layer_e * ALAYERS;
    float     scale = 1.0f / sqrtf((float) AHD);

    att_setup<KV>(c, hp);
    cudaMalloc((void **) &dm, 64 * sizeof(int));
    cudaMalloc((void **) &dq, sizeof(c->qkv));
    cudaMalloc(&dpool, sizeof(c->pool) / sizeof(float) * sizeof(KV));
    cudaMalloc((void **) &dpart, (size_t) AT * AH * 16 * (AHD + 2) * sizeof(float));
    cudaMalloc((void **) &dout, sizeof(out));
    cudaMemcpy(dm, c->pos, sizeof(c->pos), cudaMemcpyHostToDevice);
    cudaMemcpy(dm + AT, c->bt, sizeof(c->bt), cudaMemcpyHostToDevice);
    cudaMemcpy(dm + 2 * AT, c->tables, sizeof(c->tables), cudaMemcpyHostToDevice);
    cudaMemcpy(dq, c->qkv, sizeof(c->qkv), cudaMemcpyHostToDevice);
    cudaMemcpy(dpool, hp, sizeof(c->pool) / sizeof(float) * sizeof(KV), cudaMemcpyHostToDevice);
    m.tok = NULL;
    m.rows = NULL;
    m.pos = dm;
    m.bt = dm + AT;
    m.tables = dm + 2 * AT;
    for (const char *o : {"forward", "reverse"}) {
        order(o);
        for (int kernel = 0; kernel < 6; kernel++) {
            const int lens[4] = {1, 3, 4, 16};
            double    worst = 0;

            cudaMemset(dout, 0xff, sizeof(out));
            if (kernel < 4) {
                int L = lens[kernel], nsplit = 13 / L + 1;

                KVW_LAUNCH(k_attn_split<KV>, dim3(AT, AKV, nsplit), 32 * KVC_ATT_WARPS, 0,
                           (cudaStream_t) 0, dpart, dq, dpool, m, AH, AKV, AHD, ABS, block_e,
                           layer_e, 1, scale, L, (const float *) NULL, (const float *) NULL);
                KVW_LAUNCH(k_attn_merge<float>, dim3(AT, AH), 64, 0, (cudaStream_t) 0, dout,
                           dpart, m, AH, AHD, L, nsplit);
            } else if (kernel == 4) {
                KVW_LAUNCH(k_attention_gqa<float KVC_COMMA KV>, dim3(AT, AKV),
                           32 * KVC_ATT_WARPS, 0, (cudaStream_t) 0, dout, dq, dpool, m, AH, AKV,
                           AHD, ABS, block_e, layer_e, 1, scale);
            } else {
                KVW_LAUNCH(k_attention<float KVC_COMMA KV>, dim3(AT, AH), 32 * KVC_ATT_WARPS, 0,
                           (cudaStream_t) 0, dout, dq, dpool, m, AH, AKV, AHD, ABS, block_e,
                           layer_e, 1, scale);
            }
            CHECK(cudaMemcpy(out, dout, sizeof(out), cudaMemcpyDeviceToHost) == cudaSuccess);
            for (int i = 0; i < AT * AH * AHD; i++) {
                double d = fabs(out[i] - c->ref[i]);

                worst = d > worst || d != d ? (d != d ? 1e9 : d) : worst;
            }
            if (worst > 2e-6) {
                fprintf(stderr, "  %s, %s order, kernel %d (%s): off by %g\n", what, o, kernel,
                        kernel < 4 ? "split" : kernel == 4 ? "gqa" : "head", worst);
            }
            CHECK(worst <= 2e-6);
        }
    }
    order("forward");
    cudaFree(dm); cudaFree(dq); cudaFree(dpool); cudaFree(dpart); cudaFree(dout);
    free(hp); free(c);
}

TEST(split_attention_matches_a_cpu_reference)
{
    attention_kernels_match<float>("f32 KV");
    attention_kernels_match<__nv_bfloat16>("bf16 KV");
}

/* --- the matrix-vector products of decode steps (k_gemv) against a CPU reference ----------- */

/*
 * out[t][r] = in[t] . w[r] (+ out when add) for 1..KVC_GEMV_MAX_T tokens: rows not a multiple
 * of the block's warps, a row short of one unrolled pass (cols 200) and one past it (1320).
 */
template <class T> static void gemv_matches(const char *what, double tol)
{
    uint64_t x = 11;

    for (int cols : {200, 1320}) for (int add = 0; add < 2; add++) {
        const int rows = 37, nt = KVC_GEMV_MAX_T;
        T        *hw = (T *) malloc(sizeof(T) * rows * cols), *hx = (T *) malloc(sizeof(T) * nt * cols);
        float    *hout = (float *) malloc(sizeof(float) * nt * rows), *got = (float *) malloc(sizeof(float) * nt * rows);
        T        *dw, *dx;
        float    *dout;

        for (int i = 0; i < rows * cols; i++) hw[i] = from_f<T>(frand(&x));
        for (int i = 0; i < nt * cols; i++) hx[i] = from_f<T>(frand(&x));
        for (int i = 0; i < nt * rows; i++) hout[i] = frand(&x);
        cudaMalloc((void **) &dw, sizeof(T) * rows * cols);
        cudaMalloc((void **) &dx, sizeof(T) * nt * cols);
        cudaMalloc((void **) &dout, sizeof(float) * nt * rows);
        cudaMemcpy(dw, hw, sizeof(T) * rows * cols, cudaMemcpyHostToDevice);
        cudaMemcpy(dx, hx, sizeof(T) * nt * cols, cudaMemcpyHostToDevice);
        for (int T_tokens = 1; T_tokens <= nt; T_tokens++) for (const char *o : {"forward", "reverse"}) {
            double worst = 0;

            order(o);
            cudaMemcpy(dout, hout, sizeof(float) * nt * rows, cudaMemcpyHostToDevice);
            KVW_LAUNCH(k_gemv<T>, (rows + KVC_GEMV_WARPS - 1) / KVC_GEMV_WARPS, 32 * KVC_GEMV_WARPS,
                       0, (cudaStream_t) 0, dout, dx, dw, T_tokens, rows, cols, add);
            CHECK(cudaMemcpy(got, dout, sizeof(float) * nt * rows, cudaMemcpyDeviceToHost)
                  == cudaSuccess);
            for (int t = 0; t < nt; t++) {
                for (int r = 0; r < rows; r++) {
                    double want = t < T_tokens && add ? hout[t * rows + r] : 0, d;

                    if (t >= T_tokens) want = hout[t * rows + r];   /* untouched */
                    for (int c = 0; t < T_tokens && c < cols; c++)
                        want += (double) to_f(hw[r * cols + c]) * to_f(hx[t * cols + c]);
                    d = fabs(got[t * rows + r] - want);
                    worst = d > worst || d != d ? (d != d ? 1e9 : d) : worst;
                }
            }
            if (worst > tol) {
                fprintf(stderr, "  %s, cols %d, add %d, %d tokens, %s order: off by %g\n", what,
                        cols, add, T_tokens, o, worst);
            }
            CHECK(worst <= tol);
        }
        cudaFree(dw); cudaFree(dx); cudaFree(dout);
        free(hw); free(hx); free(hout); free(got);
    }
    order("forward");
}

TEST(gemv_matches_a_cpu_reference)
{
    gemv_matches<float>("f32", 1e-4);
    gemv_matches<__nv_bfloat16>("bf16", 1e-4);
    gemv_matches<__half>("f16", 1e-4);
}

/* --- wmma (emu/mma.h) and the tensor-core prefill attention ------------------------------ */

static int in_child(void (*fn)(void));

/*
 * d = a * b + c with every operand stored another way: a row-major with a
 * padded ldm (24), b column-major (ldm 16), or (flip) a column-major and b
 * row-major; c loaded column-major (ldm 20), d stored row-major (ldm 20).
 */
template <class T>
__global__ void k_wmma_one(float *d, const T *a, const T *b, const float *c, int flip)
{
    using namespace nvcuda;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> fc;

    wmma::load_matrix_sync(fc, c, 20, wmma::mem_col_major);
    if (!flip) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb;

        wmma::load_matrix_sync(fa, a, 24);
        wmma::load_matrix_sync(fb, b, 16);
        wmma::mma_sync(fc, fa, fb, fc);
    } else {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major> fa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> fb;

        wmma::load_matrix_sync(fa, a, 24);
        wmma::load_matrix_sync(fb, b, 16);
        wmma::mma_sync(fc, fa, fb, fc);
    }
    wmma::store_matrix_sync(d, fc, 20, wmma::mem_row_major);
}

/* fill_fragment, and element-wise work on x[] (legal whatever the layout): d = 2 * (1 + 0) */
__global__ void k_wmma_fill(float *d)
{
    using namespace nvcuda;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> fc;

    wmma::fill_fragment(fc, 1.0f);
    for (int i = 0; i < fc.num_elements; i++) fc.x[i] *= 2.0f;
    wmma::store_matrix_sync(d, fc, 16, wmma::mem_row_major);
}

template <class T> static void wmma_case(int flip)
{
    T     *da, *db, ha[16 * 24], hb[16 * 16];
    float *dc, *dd, hc[16 * 20], hd[16 * 20], A[16][16], B[16][16], C[16][16];
    int    good = 1;

    for (int r = 0; r < 16; r++) {
        for (int c = 0; c < 16; c++) {
            A[r][c] = (float) ((r * 7 + c * 3) % 11 - 5);
            B[r][c] = (float) ((r * 5 + c * 13) % 9 - 4);
            C[r][c] = (float) (r - c);
        }
    }
    for (int i = 0; i < 16 * 24; i++) ha[i] = from_f<T>(99.0f);   /* the padding: never read */
    for (int r = 0; r < 16; r++) {
        for (int c = 0; c < 16; c++) {
            ha[flip ? c * 24 + r : r * 24 + c] = from_f<T>(A[r][c]);
            hb[flip ? r * 16 + c : c * 16 + r] = from_f<T>(B[r][c]);
            hc[c * 20 + r] = C[r][c];
        }
    }
    cudaMalloc((void **) &da, sizeof(ha));
    cudaMalloc((void **) &db, sizeof(hb));
    cudaMalloc((void **) &dc, sizeof(hc));
    cudaMalloc((void **) &dd, sizeof(hd));
    cudaMemcpy(da, ha, sizeof(ha), cudaMemcpyHostToDevice);
    cudaMemcpy(db, hb, sizeof(hb), cudaMemcpyHostToDevice);
    cudaMemcpy(dc, hc, sizeof(hc), cudaMemcpyHostToDevice);
    cudaMemset(dd, 0, sizeof(hd));
    KVW_LAUNCH(k_wmma_one<T>, 1, 32, 0, (cudaStream_t) 0, dd, da, db, dc, flip);
    CHECK(cudaMemcpy(hd, dd, sizeof(hd), cudaMemcpyDeviceToHost) == cudaSuccess);
    for (int r = 0; r < 16; r++) {
        for (int c = 0; c < 20; c++) {
            float want = 0;

            if (c < 16) {
                want = C[r][c];
                for (int k = 0; k < 16; k++) want += A[r][k] * B[k][c];
            }
            good &= hd[r * 20 + c] == want;     /* small integers: exact; the padding untouched */
        }
    }
    CHECK(good);
    KVW_LAUNCH(k_wmma_fill, 1, 32, 0, (cudaStream_t) 0, dd);
    CHECK(cudaMemcpy(hd, dd, 256 * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess);
    for (int i = 0; i < 256; i++) good &= hd[i] == 2.0f;
    CHECK(good);
    cudaFree(da); cudaFree(db); cudaFree(dc); cudaFree(dd);
}

TEST(wmma_follows_the_documented_semantics)
{
    for (const char *o : {"forward", "reverse"}) {
        order(o);
        for (int flip = 0; flip < 2; flip++) {
            wmma_case<__half>(flip);
            wmma_case<__nv_bfloat16>(flip);
        }
    }
    order("forward");
}

/* what the documentation forbids: each must fail the launch */
__global__ void k_wmma_misuse(float *d, const __half *a, int how)
{
    using namespace nvcuda;
    __shared__ __align__(32) float s[16 * 16];
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fa;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float>                fc;

    wmma::fill_fragment(fc, 0.0f);
    if (how == 0 && threadIdx.x < 16) wmma::load_matrix_sync(fa, a, 16);     /* half a warp */
    if (how == 1) wmma::load_matrix_sync(fa, a + 1, 16);                     /* misaligned */
    if (how == 2) wmma::load_matrix_sync(fa, a, 12);                         /* ldm */
    if (how == 3) wmma::load_matrix_sync(fa, a + 16 * (threadIdx.x & 1), 16); /* lanes disagree */
    if (how == 4) {                     /* a load racing the scalar writes (no __syncwarp) */
        for (int i = threadIdx.x; i < 256; i += 32) s[i] = 1.0f;
        wmma::load_matrix_sync(fc, s, 16, wmma::mem_row_major);
        wmma::store_matrix_sync(d, fc, 16, wmma::mem_row_major);
        return;
    }
    if (how == 5 && threadIdx.x == 3) __syncwarp();  /* one lane at another warp barrier */
    if (how == 5 && threadIdx.x != 3) wmma::load_matrix_sync(fa, a, 16);
    wmma::store_matrix_sync(d, fc, 16, wmma::mem_row_major);
}

static int misuse_how;

static void wmma_misuse(void)
{
    float  *d;
    __half *a;
    float   h[256];
    int     ok = 1;

    cudaMalloc((void **) &d, 256 * sizeof(float));
    cudaMalloc((void **) &a, 64 * 16 * sizeof(__half));
    cudaMemset(a, 0, 64 * 16 * sizeof(__half));
    if (misuse_how == 4) {              /* not an error: wrong values in one order or the other */
        for (const char *o : {"forward", "reverse"}) {
            order(o);
            KVW_LAUNCH(k_wmma_misuse, 1, 32, 0, (cudaStream_t) 0, d, a, 4);
            if (cudaMemcpy(h, d, sizeof(h), cudaMemcpyDeviceToHost) != cudaSuccess) _exit(2);
            for (int i = 0; i < 256; i++) ok &= h[i] == 1.0f;
        }
        _exit(ok ? 1 : 0);
    }
    KVW_LAUNCH(k_wmma_misuse, 1, 32, 0, (cudaStream_t) 0, d, a, misuse_how);
    _exit(cudaDeviceSynchronize() == cudaErrorLaunchFailure ? 0 : 1);
}

TEST(wmma_misuse_is_reported)
{
    for (misuse_how = 0; misuse_how <= 5; misuse_how++) {
        int rc = in_child(wmma_misuse);

        if (rc != 0) fprintf(stderr, "  wmma misuse %d not caught (%d)\n", misuse_how, rc);
        CHECK(rc == 0);
    }
}

/*
 * The tensor-core prefill attention against a double-precision softmax: a
 * step of two sequences (A: positions 3..22 after a cached prefix of 3, B:
 * positions 0..8), 29 tokens, so the second tile holds rows of both; a
 * 4-slot paged pool with shuffled blocks; head_dim 32, GQA 4:2; pool rows
 * past each sequence's last position are NaN (never to be read).
 */
enum { PH = 4, PKV = 2, PHD = 32, PBS = 4, PNB = 16, PT = 29 };

template <class T, class KV> static double tc_prefill_case(const char *o)
{
    const int tables[9] = {5, 9, 2, 14, 7, 0, 11, 4, 13};
    int       qd = PH * PHD, kd = PKV * PHD, ld = qd + 2 * kd, G = PH / PKV;
    size_t    layer_e = 2 * (size_t) PBS * kd, block_e = layer_e * 2;
    size_t    npool = block_e * PNB;
    int       pos[PT], bt[PT], *dm;
    float    *qkv = (float *) malloc(PT * ld * sizeof(float)), *pool = (float *) malloc(npool * 4);
    KV       *hp = (KV *) malloc(npool * sizeof(KV));
    T        *hout = (T *) malloc(PT * qd * sizeof(T));
    float    *dq;
    void     *dpool, *dout;
    uint64_t  x = 11;
    double    worst = 0;
    kvc_meta  m;

    for (int t = 0; t < PT; t++) {
        pos[t] = t < 20 ? t + 3 : t - 20;
        bt[t] = t < 20 ? 0 : 6;
    }
    for (int i = 0; i < PT * ld; i++) qkv[i] = frand(&x);
    for (size_t i = 0; i < npool; i++) pool[i] = NAN;
    for (int s = 0; s < 2; s++) {
        for (int p = 0; p <= (s ? 8 : 22); p++) {
            for (int kvv = 0; kvv < 2; kvv++) {
                float *row = pool + (size_t) tables[6 * s + p / PBS] * block_e + layer_e
                             + kvv * layer_e / 2 + (size_t) (p % PBS) * kd;

                for (int i = 0; i < kd; i++) row[i] = to_f(from_f<KV>(frand(&x) * 2.0f));
            }
        }
    }
    for (size_t i = 0; i < npool; i++) hp[i] = from_f<KV>(pool[i]);
    cudaMalloc((void **) &dm, (2 * PT + 9) * sizeof(int));
    cudaMalloc((void **) &dq, PT * ld * sizeof(float));
    cudaMalloc(&dpool, npool * sizeof(KV));
    cudaMalloc(&dout, PT * qd * sizeof(T));
    cudaMemcpy(dm, pos, sizeof(pos), cudaMemcpyHostToDevice);
    cudaMemcpy(dm + PT, bt, sizeof(bt), cudaMemcpyHostToDevice);
    cudaMemcpy(dm + 2 * PT, tables, sizeof(tables), cudaMemcpyHostToDevice);
    cudaMemcpy(dq, qkv, PT * ld * sizeof(float), cudaMemcpyHostToDevice);
    cudaMemcpy(dpool, hp, npool * sizeof(KV), cudaMemcpyHostToDevice);
    m.tok = NULL;
    m.rows = NULL;
    m.pos = dm;
    m.bt = dm + PT;
    m.tables = dm + 2 * PT;
    order(o);
    KVW_LAUNCH(k_attn_prefill_tc<T KVC_COMMA KV>, dim3((PT + 15) / 16, PH), 32, 0,
               (cudaStream_t) 0, dout, dq, dpool, m, PT, PH, PKV, PHD, PBS, block_e, layer_e, 1,
               1.0f / sqrtf((float) PHD));
    CHECK(cudaMemcpy(hout, dout, PT * qd * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess);
    order("forward");
    for (int t = 0; t < PT; t++) {
        const int *tb = tables + bt[t];

        for (int h = 0; h < PH; h++) {
            double s[32], mx = -1e300, sum = 0;
            int    kvh = h / G;

            for (int p = 0; p <= pos[t]; p++) {
                const float *k = pool + (size_t) tb[p / PBS] * block_e + layer_e
                                 + (size_t) (p % PBS) * kd + (size_t) kvh * PHD;

                s[p] = 0;
                for (int d = 0; d < PHD; d++)
                    s[p] += (double) qkv[t * ld + h * PHD + d] * k[d] / sqrt((double) PHD);
                mx = s[p] > mx ? s[p] : mx;
            }
            for (int p = 0; p <= pos[t]; p++) sum += exp(s[p] - mx);
            for (int d = 0; d < PHD; d++) {
                double r = 0, got = to_f(hout[t * qd + h * PHD + d]), diff;

                for (int p = 0; p <= pos[t]; p++) {
                    const float *v = pool + (size_t) tb[p / PBS] * block_e + layer_e
                                     + layer_e / 2 + (size_t) (p % PBS) * kd + (size_t) kvh * PHD;

                    r += exp(s[p] - mx) / sum * v[d];
                }
                diff = fabs(got - r);
                worst = diff > worst || diff != diff ? (diff != diff ? 1e9 : diff) : worst;
            }
        }
    }
    cudaFree(dm); cudaFree(dq); cudaFree(dpool); cudaFree(dout);
    free(qkv); free(pool); free(hp); free(hout);
    return worst;
}

TEST(tensor_core_prefill_matches_a_cpu_reference)
{
    for (const char *o : {"forward", "reverse"}) {
        double bf = tc_prefill_case<__nv_bfloat16 KVC_COMMA float>(o);
        double bfb = tc_prefill_case<__nv_bfloat16 KVC_COMMA __nv_bfloat16>(o);
        double hf = tc_prefill_case<__half KVC_COMMA float>(o);
        double hfb = tc_prefill_case<__half KVC_COMMA __nv_bfloat16>(o);

        fprintf(stderr, "  tensor-core prefill, %s order: off by bf16 %.2g (bf16 KV %.2g), "
                "f16 %.2g (bf16 KV %.2g)\n", o, bf, bfb, hf, hfb);
        CHECK(bf < 2.5e-2 && bfb < 2.5e-2);
        CHECK(hf < 4e-3 && hfb < 4e-3);
    }
}

__global__ void k_axpy(float *y, const float *x, float a) { y[threadIdx.x] += a * x[threadIdx.x]; }

/* A captured graph replays the recorded work with the arguments of the capture. */
TEST(graphs_replay_what_was_captured)
{
    cudaStream_t            st;
    cudaGraph_t             g;
    cudaGraphExec_t         ex;
    cudaStreamCaptureStatus cs;
    float                  *x, *y, *z, hy[32], hz[32], direct[32];

    CHECK(cudaStreamCreateWithFlags(&st, cudaStreamDefault) == cudaSuccess);
    cudaMalloc((void **) &x, 32 * sizeof(float));
    cudaMalloc((void **) &y, 32 * sizeof(float));
    cudaMalloc((void **) &z, 32 * sizeof(float));
    KVW_LAUNCH(k_fill, 1, 32, 0, st, x, 2.0f);
    KVW_LAUNCH(k_fill, 1, 32, 0, st, y, 1.0f);
    CHECK(cudaStreamSynchronize(st) == cudaSuccess);
    /* the same work done directly, for comparison: y += 3x, then z = y, three times */
    for (int i = 0; i < 32; i++) direct[i] = 1.0f + 3 * 3 * 2.0f;
    CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal) == cudaSuccess);
    CHECK(cudaStreamIsCapturing(st, &cs) == cudaSuccess && cs == cudaStreamCaptureStatusActive);
    KVW_LAUNCH(k_axpy, 1, 32, 0, st, y, x, 3.0f);
    CHECK(cudaMemcpyAsync(z, y, 32 * sizeof(float), cudaMemcpyDeviceToDevice, st) == cudaSuccess);
    CHECK(cudaStreamEndCapture(st, &g) == cudaSuccess && g != NULL);
    cudaMemcpy(hy, y, sizeof(hy), cudaMemcpyDeviceToHost);
    CHECK(hy[0] == 1.0f);                       /* captured, not run */
    CHECK(cudaGraphInstantiate(&ex, g, 0) == cudaSuccess);
    CHECK(cudaGraphDestroy(g) == cudaSuccess);  /* the instance keeps its copy */
    for (int r = 0; r < 3; r++) CHECK(cudaGraphLaunch(ex, st) == cudaSuccess);
    CHECK(cudaStreamSynchronize(st) == cudaSuccess);
    cudaMemcpy(hy, y, sizeof(hy), cudaMemcpyDeviceToHost);
    cudaMemcpy(hz, z, sizeof(hz), cudaMemcpyDeviceToHost);
    for (int i = 0; i < 32; i++) CHECK(hy[i] == direct[i] && hz[i] == direct[i]);
    CHECK(cudaGraphExecDestroy(ex) == cudaSuccess);
    /* a synchronizing call while capturing is refused and the capture is void */
    CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal) == cudaSuccess);
    KVW_LAUNCH(k_axpy, 1, 32, 0, st, y, x, 3.0f);
    CHECK(cudaStreamSynchronize(st) == cudaErrorStreamCaptureUnsupported);
    CHECK(cudaMemcpy(hy, y, sizeof(hy), cudaMemcpyDeviceToHost) == cudaErrorStreamCaptureUnsupported);
    CHECK(cudaStreamEndCapture(st, &g) == cudaErrorStreamCaptureInvalidated && g == NULL);
    CHECK(cudaStreamBeginCapture((cudaStream_t) 0, cudaStreamCaptureModeGlobal)
          == cudaErrorStreamCaptureUnsupported);
    cudaGetLastError();
    cudaMemcpy(hy, y, sizeof(hy), cudaMemcpyDeviceToHost);
    CHECK(hy[0] == direct[0]);                  /* the void capture ran nothing */
    cudaFree(x); cudaFree(y); cudaFree(z); cudaStreamDestroy(st);
}

/*
 * Sampling on the device (k_sample_cand, then kvc_sample_pick on the host)
 * against kvw_sample on the full row, with the same RNG state: the same
 * token and the same RNG state after, whenever the candidates decide it
 * (else kvc_sample_pick says so and leaves the RNG alone). Peaked, flat
 * and tied rows; a vocabulary of several chunks (the last one partial) and
 * one shorter than the candidates; greedy, temperature, top-k, top-p.
 */
TEST(device_sampling_picks_what_kvw_sample_picks)
{
    const int      vocabs[2] = {9000, 20}, rows = 6;
    const float    temps[6] = {0.7f, 1.0f, 0.8f, 1.3f, 1.0f, 0.5f};
    const float    top_ps[6] = {1.0f, 0.9f, 1.0f, 0.5f, 1.0f, 0.95f};
    const int      top_ks[6] = {0, 0, 40, 10, 5000, 3};
    uint64_t       x = 99;
    long           decided = 0, undecided = 0, wrong = 0;

    for (int vi = 0; vi < 2; vi++) {
        int       vocab = vocabs[vi], nchunk = (vocab + KVC_SAMPLE_CHUNK - 1) / KVC_SAMPLE_CHUNK;
        size_t    nc = (size_t) rows * nchunk * KVC_SAMPLE_CANDS;
        float    *h = (float *) malloc(sizeof(float) * rows * vocab), *row = (float *) malloc(sizeof(float) * vocab);
        float    *d, *dt, *dcp, *hcp = (float *) malloc(nc * sizeof(float)), temp[rows];
        int      *db, *dci, *hci = (int *) malloc(nc * sizeof(int));
        double   *dcs, *hcs = (double *) malloc(rows * nchunk * sizeof(double));
        kvc_cand *buf = (kvc_cand *) malloc(nc * sizeof(kvc_cand));

        for (int r = 0; r < rows; r++) {
            for (int i = 0; i < vocab; i++) {
                float v = frand(&x);

                h[r * vocab + i] = r % 3 == 0 ? v * 12.0f                    /* peaked */
                                   : r % 3 == 1 ? v * 0.2f                   /* flat */
                                   : (float) (lcg(&x) % 7);                  /* many ties */
            }
        }
        cudaMalloc((void **) &d, sizeof(float) * rows * vocab);
        cudaMalloc((void **) &db, rows * sizeof(int));
        cudaMalloc((void **) &dt, rows * sizeof(float));
        cudaMalloc((void **) &dcp, nc * sizeof(float));
        cudaMalloc((void **) &dci, nc * sizeof(int));
        cudaMalloc((void **) &dcs, rows * nchunk * sizeof(double));
        cudaMemcpy(d, h, sizeof(float) * rows * vocab, cudaMemcpyHostToDevice);
        for (int set = 0; set < 6; set++) {
            for (int r = 0; r < rows; r++) temp[r] = temps[set];
            order(set % 2 ? "reverse" : "forward");
            cudaMemcpy(dt, temp, sizeof(temp), cudaMemcpyHostToDevice);
            argmax_rows(db, d, rows, vocab, 1024);
            KVW_LAUNCH(k_sample_cand, dim3(rows, nchunk), 256, 0, (cudaStream_t) 0, dcp, dci, dcs,
                       d, db, dt, vocab);
            CHECK(cudaMemcpy(hcp, dcp, nc * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess);
            cudaMemcpy(hci, dci, nc * sizeof(int), cudaMemcpyDeviceToHost);
            cudaMemcpy(hcs, dcs, rows * nchunk * sizeof(double), cudaMemcpyDeviceToHost);
            for (int r = 0; r < rows; r++) {
                for (int draw = 0; draw < 20; draw++) {
                    uint64_t       st_dev = x + (uint64_t) draw * 7919, st_host = st_dev;
                    kvw_sampling_t sd = {temps[set], top_ps[set], top_ks[set], &st_dev};
                    kvw_sampling_t sh = {temps[set], top_ps[set], top_ks[set], &st_host};
                    size_t         c0 = (size_t) r * nchunk;
                    int            got = kvc_sample_pick(hcp + c0 * KVC_SAMPLE_CANDS,
                                                         hci + c0 * KVC_SAMPLE_CANDS, hcs + c0,
                                                         nchunk, KVC_SAMPLE_CANDS,
                                                         KVC_SAMPLE_CHUNK, (uint32_t) vocab, &sd,
                                                         buf);
                    uint32_t       want;

                    memcpy(row, h + r * vocab, sizeof(float) * vocab);
                    if (got < 0) {
                        CHECK(st_dev == x + (uint64_t) draw * 7919);   /* untouched */
                        undecided++;
                        continue;
                    }
                    want = kvw_sample(row, (uint32_t) vocab, &sh);
                    decided++;
                    if ((uint32_t) got != want || st_dev != st_host) {
                        if (wrong++ < 5)
                            fprintf(stderr, "  vocab %d row %d setting %d draw %d: %d, kvw_sample "
                                    "%u\n", vocab, r, set, draw, got, want);
                    }
                }
            }
        }
        order("forward");
        cudaFree(d); cudaFree(db); cudaFree(dt); cudaFree(dcp); cudaFree(dci); cudaFree(dcs);
        free(h); free(row); free(hcp); free(hci); free(hcs); free(buf);
    }
    fprintf(stderr, "  device sampling: %ld decided on the candidates, %ld left to the host\n",
            decided, undecided);
    CHECK(wrong == 0);
    CHECK(decided > undecided);     /* the peaked and tied rows, top-k and top-p settle there */
    CHECK(undecided > 0);           /* flat rows without top-k, and top_k 5000, do not */
}

/*
 * RoPE and the KV write fused into k_attn_split (decode steps) against
 * k_rope_store then k_attn_split: the same pool bytes and the same output,
 * bit for bit, with and without q/k/v biases, f32 and bf16 KV. Two decode
 * tokens of two sequences, at positions 13 and 5.
 */
template <class KV> static void fused_rope_matches(void)
{
    att_case *c = (att_case *) calloc(1, sizeof(att_case));
    size_t    npool = sizeof(c->pool) / sizeof(float), kd = AKV * AHD;
    size_t    layer_e = 2 * (size_t) ABS * kd, block_e = layer_e * ALAYERS;
    KV       *hp = (KV *) malloc(npool * sizeof(KV)), *pa = (KV *) malloc(npool * sizeof(KV));
    KV       *pb = (KV *) malloc(npool * sizeof(KV));
    int       meta[2 + 2 + 6] = {13, 5, 0, 4, 7, 2, 9, 4, 11, 0}, *dm, ld = (AH + 2 * AKV) * AHD;
    float     inv[AHD / 2], bias[(AH + 2 * AKV) * AHD], oa[2 * AH * AHD], ob[2 * AH * AHD];
    float    *dq, *dq2, *dpart, *dout, *dinv, *dbias;
    void     *dpool;
    uint64_t  x = 11;
    kvc_meta  m;
    float     scale = 1.0f / sqrtf((float) AHD);

    att_setup<KV>(c, hp);
    for (int i = 0; i < AHD / 2; i++) inv[i] = powf(10000.0f, -2.0f * i / AHD);
    for (int i = 0; i < ld; i++) bias[i] = frand(&x) * 0.5f;
    cudaMalloc((void **) &dm, sizeof(meta));
    cudaMalloc((void **) &dq, 2 * ld * sizeof(float));
    cudaMalloc((void **) &dq2, 2 * ld * sizeof(float));
    cudaMalloc(&dpool, npool * sizeof(KV));
    cudaMalloc((void **) &dpart, (size_t) 2 * AH * 16 * (AHD + 2) * sizeof(float));
    cudaMalloc((void **) &dout, sizeof(oa));
    cudaMalloc((void **) &dinv, sizeof(inv));
    cudaMalloc((void **) &dbias, sizeof(bias));
    cudaMemcpy(dm, meta, sizeof(meta), cudaMemcpyHostToDevice);
    cudaMemcpy(dinv, inv, sizeof(inv), cudaMemcpyHostToDevice);
    cudaMemcpy(dbias, bias, sizeof(bias), cudaMemcpyHostToDevice);
    m.tok = NULL;
    m.rows = NULL;
    m.pos = dm;
    m.bt = dm + 2;
    m.tables = dm + 4;
    for (int with_bias = 0; with_bias < 2; with_bias++) {
        for (const char *o : {"forward", "reverse"}) {
            const float *b = with_bias ? dbias : NULL;
            int          L = 3, nsplit = 13 / L + 1;

            order(o);
            /* unfused: k_rope_store, then the split kernel on the rotated q */
            cudaMemcpy(dpool, hp, npool * sizeof(KV), cudaMemcpyHostToDevice);
            cudaMemcpy(dq, c->qkv, 2 * ld * sizeof(float), cudaMemcpyHostToDevice);
            KVW_LAUNCH(k_rope_store<KV>, 2, 128, 0, (cudaStream_t) 0, dq, b, dpool, m, dinv, AH,
                       AKV, AHD, ABS, block_e, layer_e, 1);
            KVW_LAUNCH(k_attn_split<KV>, dim3(2, AKV, nsplit), 32 * KVC_ATT_WARPS, 0,
                       (cudaStream_t) 0, dpart, dq, dpool, m, AH, AKV, AHD, ABS, block_e, layer_e,
                       1, scale, L, (const float *) NULL, (const float *) NULL);
            KVW_LAUNCH(k_attn_merge<float>, dim3(2, AH), 64, 0, (cudaStream_t) 0, dout, dpart, m,
                       AH, AHD, L, nsplit);
            cudaMemcpy(oa, dout, sizeof(oa), cudaMemcpyDeviceToHost);
            cudaMemcpy(pa, dpool, npool * sizeof(KV), cudaMemcpyDeviceToHost);
            /* fused */
            cudaMemcpy(dpool, hp, npool * sizeof(KV), cudaMemcpyHostToDevice);
            cudaMemcpy(dq2, c->qkv, 2 * ld * sizeof(float), cudaMemcpyHostToDevice);
            cudaMemset(dout, 0xff, sizeof(ob));
            KVW_LAUNCH(k_attn_split<KV>, dim3(2, AKV, nsplit), 32 * KVC_ATT_WARPS, 0,
                       (cudaStream_t) 0, dpart, dq2, dpool, m, AH, AKV, AHD, ABS, block_e, layer_e,
                       1, scale, L, b, (const float *) dinv);
            KVW_LAUNCH(k_attn_merge<float>, dim3(2, AH), 64, 0, (cudaStream_t) 0, dout, dpart, m,
                       AH, AHD, L, nsplit);
            CHECK(cudaMemcpy(ob, dout, sizeof(ob), cudaMemcpyDeviceToHost) == cudaSuccess);
            cudaMemcpy(pb, dpool, npool * sizeof(KV), cudaMemcpyDeviceToHost);
            CHECK(memcmp(oa, ob, sizeof(oa)) == 0);
            CHECK(memcmp(pa, pb, npool * sizeof(KV)) == 0);
            CHECK(memcmp(pa, hp, npool * sizeof(KV)) != 0);     /* K/V were written */
        }
    }
    order("forward");
    cudaFree(dm); cudaFree(dq); cudaFree(dq2); cudaFree(dpool); cudaFree(dpart); cudaFree(dout);
    cudaFree(dinv); cudaFree(dbias);
    free(hp); free(pa); free(pb); free(c);
}

TEST(fused_rope_attention_matches_the_two_kernels)
{
    fused_rope_matches<float>();
    fused_rope_matches<__nv_bfloat16>();
}

/* k_embed_rmsnorm = k_embed then k_rmsnorm; k_rmsnorm's add = k_add_bias first: the same bits. */
TEST(fused_norms_match_the_kernels_they_replace)
{
    const int H = 200, T = 3, V = 10;
    float     emb[V * H], w[H], add[H], xa[T * H], xb[T * H], aa[T * H], ab[T * H];
    float    *de, *dw, *dadd, *dx, *dact;
    int       tok[T] = {7, 0, 7}, *dt;
    uint64_t  x = 5;

    for (int i = 0; i < V * H; i++) emb[i] = frand(&x);
    for (int i = 0; i < H; i++) {
        w[i] = 1.0f + frand(&x) * 0.3f;
        add[i] = frand(&x);
    }
    cudaMalloc((void **) &de, sizeof(emb));
    cudaMalloc((void **) &dw, sizeof(w));
    cudaMalloc((void **) &dadd, sizeof(add));
    cudaMalloc((void **) &dx, sizeof(xa));
    cudaMalloc((void **) &dact, sizeof(aa));
    cudaMalloc((void **) &dt, sizeof(tok));
    cudaMemcpy(de, emb, sizeof(emb), cudaMemcpyHostToDevice);
    cudaMemcpy(dw, w, sizeof(w), cudaMemcpyHostToDevice);
    cudaMemcpy(dadd, add, sizeof(add), cudaMemcpyHostToDevice);
    cudaMemcpy(dt, tok, sizeof(tok), cudaMemcpyHostToDevice);
    for (const char *o : {"forward", "reverse"}) {
        order(o);
        KVW_LAUNCH(k_embed<float>, T, 256, 0, (cudaStream_t) 0, dx, (const void *) de, dt, H);
        KVW_LAUNCH(k_add_bias, T, 256, 0, (cudaStream_t) 0, dx, dadd, H);
        KVW_LAUNCH(k_rmsnorm<float>, T, 256, 0, (cudaStream_t) 0, (void *) dact, dx, dw,
                   (const int *) NULL, H, 1e-5f, (const float *) NULL);
        cudaMemcpy(xa, dx, sizeof(xa), cudaMemcpyDeviceToHost);
        cudaMemcpy(aa, dact, sizeof(aa), cudaMemcpyDeviceToHost);
        KVW_LAUNCH(k_embed<float>, T, 256, 0, (cudaStream_t) 0, dx, (const void *) de, dt, H);
        KVW_LAUNCH(k_rmsnorm<float>, T, 256, 0, (cudaStream_t) 0, (void *) dact, dx, dw,
                   (const int *) NULL, H, 1e-5f, (const float *) dadd);
        cudaMemcpy(xb, dx, sizeof(xb), cudaMemcpyDeviceToHost);
        cudaMemcpy(ab, dact, sizeof(ab), cudaMemcpyDeviceToHost);
        CHECK(memcmp(xa, xb, sizeof(xa)) == 0 && memcmp(aa, ab, sizeof(aa)) == 0);
        KVW_LAUNCH(k_embed<float>, T, 256, 0, (cudaStream_t) 0, dx, (const void *) de, dt, H);
        KVW_LAUNCH(k_rmsnorm<float>, T, 256, 0, (cudaStream_t) 0, (void *) dact, dx, dw,
                   (const int *) NULL, H, 1e-5f, (const float *) NULL);
        cudaMemcpy(xa, dx, sizeof(xa), cudaMemcpyDeviceToHost);
        cudaMemcpy(aa, dact, sizeof(aa), cudaMemcpyDeviceToHost);
        cudaMemset(dx, 0xff, sizeof(xb));
        KVW_LAUNCH(k_embed_rmsnorm<float>, T, 256, 0, (cudaStream_t) 0, dx, (void *) dact,
                   (const void *) de, dt, dw, H, 1e-5f);
        cudaMemcpy(xb, dx, sizeof(xb), cudaMemcpyDeviceToHost);
        cudaMemcpy(ab, dact, sizeof(ab), cudaMemcpyDeviceToHost);
        CHECK(memcmp(xa, xb, sizeof(xa)) == 0 && memcmp(aa, ab, sizeof(aa)) == 0);
        /* and against a plain CPU rmsnorm, within float rounding */
        for (int t = 0; t < T; t++) {
            double ss = 0;

            for (int i = 0; i < H; i++) ss += (double) emb[tok[t] * H + i] * emb[tok[t] * H + i];
            for (int i = 0; i < H; i++) {
                double want = emb[tok[t] * H + i] / sqrt(ss / H + 1e-5) * w[i];

                CHECK(fabs(ab[t * H + i] - want) < 1e-5);
            }
        }
    }
    order("forward");
    cudaFree(de); cudaFree(dw); cudaFree(dadd); cudaFree(dx); cudaFree(dact); cudaFree(dt);
}

/* Runs fn in a child (a fault is sticky for the whole process); its exit code. */
static int in_child(void (*fn)(void))
{
    pid_t pid = fork();
    int   st = 0;

    if (pid == 0) {
        fn();
        _exit(100);
    }
    waitpid(pid, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void divergent(void)
{
    int *d;

    cudaMalloc((void **) &d, 64 * sizeof(int));
    KVW_LAUNCH(k_divergent, 1, 64, 0, (cudaStream_t) 0, d);
    /* reported at the sync point, and sticky from then on */
    _exit(cudaDeviceSynchronize() == cudaErrorLaunchFailure
          && cudaMalloc((void **) &d, 4) == cudaErrorLaunchFailure ? 0 : 1);
}

static void injected_fault(void)
{
    float *d;

    setenv("KVW_CUDAEMU_FAIL_LAUNCH", "2", 1);
    cudaMalloc((void **) &d, 32 * sizeof(float));
    KVW_LAUNCH(k_fill, 1, 32, 0, (cudaStream_t) 0, d, 1.0f);
    KVW_LAUNCH(k_fill, 1, 32, 0, (cudaStream_t) 0, d, 2.0f);
    _exit(cudaDeviceSynchronize() == cudaErrorIllegalAddress
          && cudaGetLastError() == cudaErrorIllegalAddress       /* reading it does not clear it */
          && cudaDeviceSynchronize() == cudaErrorIllegalAddress ? 0 : 1);
}

static void device_errors(void)
{
    int n = 5;

    setenv("KVW_CUDAEMU_DEVICE_ERROR", "35", 1);
    if (cudaGetDeviceCount(&n) != cudaErrorInsufficientDriver || n != 0) _exit(1);
    unsetenv("KVW_CUDAEMU_DEVICE_ERROR");
    setenv("KVW_CUDAEMU_DEVICES", "2", 1);
    _exit(cudaGetDeviceCount(&n) == cudaSuccess && n == 2 && cudaSetDevice(1) == cudaSuccess
          && cudaSetDevice(2) == cudaErrorInvalidDevice ? 0 : 1);
}

/* --- CUDA IPC: another process maps an allocation ------------------------------ */

static cudaIpcMemHandle_t ipc_h;
static const size_t       IPC_N = 3000;     /* floats: not a whole number of pages */

static void ipc_child_maps(void)
{
    float              *m = NULL, *m2 = NULL, host[IPC_N];
    cudaIpcMemHandle_t  junk;
    int                 ok = 1;

    ok &= cudaIpcOpenMemHandle((void **) &m, ipc_h, cudaIpcMemLazyEnablePeerAccess) == cudaSuccess;
    ok &= cudaMemcpy(host, m, sizeof(host), cudaMemcpyDeviceToHost) == cudaSuccess;
    for (size_t i = 0; ok && i < IPC_N; i++) ok &= host[i] == (float) i;
    /* one open per handle and process, as the driver */
    ok &= cudaIpcOpenMemHandle((void **) &m2, ipc_h, 0) == cudaErrorAlreadyMapped;
    cudaGetLastError();
    /* a kernel writes through the mapping: the exporter sees it */
    KVW_LAUNCH(k_fill, 1, 32, 0, (cudaStream_t) 0, m, 7.0f);
    ok &= cudaDeviceSynchronize() == cudaSuccess;
    /* a mapping is device memory of its own size; cudaFree is not how it goes */
    ok &= cudaMemcpy(host, m + 1, sizeof(host), cudaMemcpyDeviceToHost) == cudaErrorInvalidValue;
    ok &= cudaFree(m) == cudaErrorInvalidValue;
    ok &= cudaIpcGetMemHandle(&junk, m) == cudaErrorInvalidValue;  /* not this process's */
    cudaGetLastError();
    ok &= cudaIpcCloseMemHandle(m) == cudaSuccess;
    ok &= cudaIpcCloseMemHandle(m) == cudaErrorInvalidValue;
    cudaGetLastError();
    _exit(ok ? 0 : 1);
}

static void ipc_child_garbage(void)
{
    cudaIpcMemHandle_t bad = ipc_h;
    void              *m = NULL;
    int                ok = 1;

    bad.reserved[0] ^= 1;                   /* not a handle */
    ok &= cudaIpcOpenMemHandle(&m, bad, 0) == cudaErrorInvalidValue && m == NULL;
    bad = ipc_h;
    bad.reserved[33] ^= 1;                  /* another inode: not that allocation */
    ok &= cudaIpcOpenMemHandle(&m, bad, 0) == cudaErrorInvalidValue;
    bad = ipc_h;
    bad.reserved[50] ^= 1;                  /* another machine's boot id */
    ok &= cudaIpcOpenMemHandle(&m, bad, 0) == cudaErrorInvalidValue;
    cudaGetLastError();
    _exit(ok ? 0 : 1);
}

static void ipc_child_no_peer(void)
{
    void *m = NULL;
    int   can = 1, ok = 1;

    setenv("KVW_CUDAEMU_DEVICES", "2", 1);
    setenv("KVW_CUDAEMU_NO_PEER", "1", 1);
    ok &= cudaSetDevice(1) == cudaSuccess;
    ok &= cudaDeviceCanAccessPeer(&can, 1, 0) == cudaSuccess && can == 0;
    ok &= cudaIpcOpenMemHandle(&m, ipc_h, cudaIpcMemLazyEnablePeerAccess)
          == cudaErrorPeerAccessUnsupported;
    unsetenv("KVW_CUDAEMU_NO_PEER");        /* peers that can reach each other: it opens */
    ok &= cudaDeviceCanAccessPeer(&can, 1, 0) == cudaSuccess && can == 1;
    ok &= cudaIpcOpenMemHandle(&m, ipc_h, cudaIpcMemLazyEnablePeerAccess) == cudaSuccess;
    cudaGetLastError();
    _exit(ok ? 0 : 1);
}

static void ipc_child_stale(void)
{
    void *m = NULL;

    _exit(cudaIpcOpenMemHandle(&m, ipc_h, 0) == cudaErrorInvalidValue && m == NULL ? 0 : 1);
}

static void ipc_child_unsupported(void)
{
    float *d;
    int    ok;

    setenv("KVW_CUDAEMU_IPC", "0", 1);
    ok = cudaMalloc((void **) &d, 64) == cudaSuccess
         && cudaIpcGetMemHandle(&ipc_h, d) == cudaErrorNotSupported;
    _exit(ok ? 0 : 1);
}

TEST(ipc_maps_an_allocation_into_another_process)
{
    float  *d, host[IPC_N];
    void   *self = NULL;

    for (size_t i = 0; i < IPC_N; i++) host[i] = (float) i;
    CHECK(cudaMalloc((void **) &d, sizeof(host)) == cudaSuccess);
    CHECK(cudaMemcpy(d, host, sizeof(host), cudaMemcpyHostToDevice) == cudaSuccess);
    /* only the base of a device allocation */
    CHECK(cudaIpcGetMemHandle(&ipc_h, d + 1) == cudaErrorInvalidValue);
    CHECK(cudaIpcGetMemHandle(&ipc_h, host) == cudaErrorInvalidValue);
    cudaGetLastError();
    CHECK(cudaIpcGetMemHandle(&ipc_h, d) == cudaSuccess);
    /* the exporting process cannot open its own handle */
    CHECK(cudaIpcOpenMemHandle(&self, ipc_h, 0) == cudaErrorDeviceUninitialized);
    cudaGetLastError();
    CHECK(in_child(ipc_child_maps) == 0);
    CHECK(cudaMemcpy(host, d, sizeof(host), cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(host[0] == 7.0f && host[31] == 7.0f && host[32] == 32.0f);
    CHECK(in_child(ipc_child_garbage) == 0);
    CHECK(in_child(ipc_child_no_peer) == 0);
    CHECK(cudaFree(d) == cudaSuccess);
    CHECK(in_child(ipc_child_stale) == 0);      /* freed: the handle is stale */
    CHECK(in_child(ipc_child_unsupported) == 0);
}

TEST(barrier_in_divergent_code_is_reported)
{
    CHECK(in_child(divergent) == 0);
}

TEST(injected_fault_is_sticky)
{
    CHECK(in_child(injected_fault) == 0);
}

TEST(device_count_errors_and_devices_can_be_faked)
{
    CHECK(in_child(device_errors) == 0);
}

int main(void)
{
    RUN(injected_fault_is_sticky);      /* first: KVW_CUDAEMU_FAIL_LAUNCH counts from the start */
    RUN(warp_shuffles_reduce_and_move_values);
    RUN(a_missing_barrier_shows_in_one_order);
    RUN(launches_wait_for_a_sync_point);
    RUN(copies_and_configurations_are_checked);
    RUN(gemm_matches_a_reference_and_checks_arguments);
    RUN(half_and_bfloat16_round_to_nearest_even);
    RUN(argmax_kernel_matches_the_host_scan);
    RUN(split_attention_matches_a_cpu_reference);
    RUN(gemv_matches_a_cpu_reference);
    RUN(wmma_follows_the_documented_semantics);
    RUN(wmma_misuse_is_reported);
    RUN(tensor_core_prefill_matches_a_cpu_reference);
    RUN(fused_rope_attention_matches_the_two_kernels);
    RUN(fused_norms_match_the_kernels_they_replace);
    RUN(graphs_replay_what_was_captured);
    RUN(device_sampling_picks_what_kvw_sample_picks);
    RUN(ipc_maps_an_allocation_into_another_process);
    RUN(barrier_in_divergent_code_is_reported);
    RUN(device_count_errors_and_devices_can_be_faked);
    return kvt_done();
}
