/*
 * --engine cuda: the CPU reference engine's computation (kvw_cpu.c) on an
 * NVIDIA GPU. Built into libkvcuda.so, which kvworker dlopen()s
 * (kvw_cuda_loader.c) so that kvworker never needs CUDA libraries itself.
 *
 * A step, as on the CPU: every token of every sequence in it is one row of a
 * [T x hidden] matrix through the matmuls (cuBLAS, f32 accumulate), so a
 * weight is read once per step; RoPE'd K and V of the whole layer go into
 * the paged pool before that layer's attention, which reads each token's
 * own sequence through its block table (positions 0..pos, GQA). Logits are
 * computed for each sequence's last token only; a greedy sequence's token
 * is their argmax on the device (one int comes back), the others' rows are
 * copied back and sampled on the host with kvw_sample().
 *
 * Weights are uploaded in the checkpoint's type (f32, f16 or bf16) unless
 * KVW_CUDA_DTYPE=bf16|f16|f32 says otherwise. q|k|v and gate|up are fused into one matrix each, so a
 * layer is four matmuls. The KV pool is f32 in kvw_backend.h's layout,
 * allocated once: one block of all layers is one contiguous range, so
 * block_read/block_write are one cudaMemcpy each, byte-compatible with the
 * CPU engine's blocks.
 */
#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cublas_v2.h>
#include <cuda_runtime.h>

extern "C" {
#include "kvw_backend.h"
#include "kvw_model.h"
#include "kvw_sample.h"
}

#include "kvw_cuda_kernels.cuh"
#include "kvw_cuda_sample.h"

enum { DT_F32, DT_F16, DT_BF16 };
enum { KV_F32, KV_BF16 };
enum { ATT_SPLIT, ATT_GQA, ATT_HEAD };

/* The argmax's chunks: a row's partials fit in its candidates' slots (copy_out) */
#define KVC_ARGMAX_CHUNK 1024
static_assert(KVC_SAMPLE_CHUNK / KVC_ARGMAX_CHUNK <= KVC_SAMPLE_CANDS, "argmax partials");

#define KVC_GEMV_MIN_COLS 512           /* shorter weight rows stay on cuBLAS (gemm()) */
/*
 * Blocks an SM of k_gemv_norm and k_gemv_glu (norm_blocks()): each block
 * norms x once, then its warps loop over rows. Enough warps that an SM
 * keeps about 64 KB of weights in flight (4 KB a GLU warp: two rows; 2 KB
 * otherwise), within the registers (96 a GLU thread, 56 otherwise, sm_90).
 */
#define KVC_GEMV_NORM_PER_SM 4
#define KVC_GEMV_GLU_PER_SM  2

/* Split-K partials beyond this (prefill of long prompts) take the one-pass kernel instead. */
#define KVC_PART_MAX_BYTES ((size_t) 64 << 20)
/*
 * Split-K's positions per split (splits_for). Decode attention is
 * latency-bound (each warp walks its positions one after another), so a
 * step needs many warps in flight: on an H200 a fixed 128 positions a split
 * gave batch-1 decode of a 100-token context 8 blocks and 30 us a layer
 * (ncu). So a token gets up to KVC_SPLIT_MOST splits, as many as bring the
 * step's grid to KVC_SPLIT_BLOCKS blocks, of KVC_SPLIT_MIN to KVC_SPLIT_MAX
 * positions. The cap: k_attn_merge walks a token's splits one by one, and
 * 128 splits of an 8k context decoded 10% slower than 65 (docs/CUDA.md).
 */
#define KVC_SPLIT_MIN      16
#define KVC_SPLIT_MAX      128
#define KVC_SPLIT_MOST     64
#define KVC_SPLIT_BLOCKS   1024

#define KVC_MAX_AUTO_BLOCKS 65536u

typedef struct {
    void  *wqkv, *wo, *wgu, *wdown;     /* weights, in the engine's dtype */
    float *attn_norm, *mlp_norm, *bqkv; /* f32; bqkv NULL without biases */
    float *bo;                          /* f32; NULL without attention_bias */
} dlayer_t;

/*
 * A decode step's launches captured as a CUDA graph, replayed for every
 * later step of the same shape: the same token count, logit rows and
 * split-K grid (every pointer and launch argument is then the same; the
 * per-step facts are in the meta uploaded before the replay).
 */
typedef struct {
    size_t          T, n_out;
    int             nsplit, split_len;
    unsigned long   used;
    cudaGraphExec_t exec;
} kvc_graph;

#define KVC_MAX_GRAPHS   16
#define KVC_MAX_PEERS    8       /* other processes' pools mapped by CUDA IPC */
#define KVC_CUBLAS_WS    ((size_t) 32 << 20)

typedef struct {
    kvw_backend_t   b;
    uint32_t        vocab, H, layers, heads, kv_heads, hd, inter;
    int             device;             /* --device: every thread that drives us selects it */
    float           eps;
    int             dtype;
    size_t          esz;                /* bytes of one weight element */
    cudaDataType_t  ctype;              /* the same, for cuBLAS */
    cudaStream_t    st;
    cublasHandle_t  cb;
    void           *embed, *lm_head;    /* lm_head == embed when tied */
    float          *norm, *inv_freq;
    dlayer_t       *L;
    void           *kv;                 /* the pool: num_blocks * block_elems of kvdt */
    size_t          block_elems, layer_elems;
    int             kvdt;               /* KV_F32 or KV_BF16 (KVW_CUDA_KV_DTYPE) */
    size_t          kvsz;               /* bytes of one KV element */
    char            kv_layout[160];     /* b.kv_layout: what block_read/block_write move */
    int             att;                /* ATT_SPLIT, ATT_GQA or ATT_HEAD (KVW_CUDA_ATTENTION) */
    int             split_fixed;        /* positions per split (KVW_CUDA_ATT_SPLIT), else 0 */
    int             split_len;          /* positions per split of this step (splits_for) */
    float          *part;               /* split-K partials, part_cap floats */
    size_t          part_cap;
    void           *cublas_ws;          /* cuBLAS's workspace: none allocated while capturing */
    int             use_graphs;         /* KVW_CUDA_GRAPHS (1 unless "0") */
    int             fuse;               /* RoPE inside split-K attention (KVW_CUDA_FUSE not "0") */
    int             fuse_norm;          /* norms and SwiGLU inside k_gemv (KVW_CUDA_FUSE unset or "1") */
    int             pdl;                /* decode kernels overlap (KVW_CUDA_PDL=1; sm_90+) */
    int             sms;                /* the device's multiprocessors */
    int             pdl_now;            /* this forward pass's launches may (a decode step) */
    int             tc;                 /* tensor-core prefill attention (KVW_CUDA_TC_PREFILL, 1 unless "0") */
    size_t          gemv_t, gemv_cols;  /* k_gemv up to this many tokens, from this row length */
    long            tc_steps;           /* steps that ran it, for KVW_CUDA_STATS */
    long            fused_steps, pdl_steps;     /* fuse_norm, pdl: likewise */
    kvc_graph       graphs[KVC_MAX_GRAPHS];
    unsigned        n_graphs;
    unsigned long   clock;              /* orders the graphs' last uses */
    long            captured, replayed; /* graphs, for KVW_CUDA_STATS */
    /* sampling on the device: per logit row, temperature in, candidates and chunk sums out */
    int             nchunk;             /* vocabulary chunks of KVC_SAMPLE_CHUNK */
    float          *d_temp, *h_temp, *d_cp, *h_cp;
    int            *d_ci, *h_ci;
    double         *d_cs, *h_cs;
    kvc_cand       *cands;              /* kvc_sample_pick's merge buffer */
    long            dev_sampled, host_sampled;  /* for KVW_CUDA_STATS */
    /* scratch, grown on demand: cap tokens, cap_out logit rows, meta_cap ints */
    size_t          cap, cap_out, meta_cap;
    float          *x, *qkv, *gu, *logits, *h_logits;
    int            *d_best, *h_best;    /* [cap_out] each logit row's argmax (greedy tokens) */
    void           *act;
    int            *d_meta, *h_meta;
    /* CUDA IPC (docs/PROTOCOL.md): this pool exported, other processes' pools mapped */
    int             exported;
    cudaIpcMemHandle_t ipc;
    struct {
        cudaIpcMemHandle_t h;
        void          *base;
        uint64_t       bytes;
        unsigned long  used;            /* clock of the last open, for eviction */
    }               peers[KVC_MAX_PEERS];
    unsigned        n_peers;
    char            err[256];
    char            unhealthy[256];     /* b.unhealthy points here once the device is lost */
} cuda_t;

/* Records why the last call failed (printed by step, returned by create). */
static int fail(cuda_t *e, const char *fmt, ...)
{
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(e->err, sizeof(e->err), fmt, ap);
    va_end(ap);
    return -1;
}

#define CK(call) do {                                                          \
        cudaError_t ce_ = (call);                                              \
        if (ce_ != cudaSuccess)                                                \
            return fail(e, "%s: %s", #call, cudaGetErrorString(ce_));          \
    } while (0)

#define CB(call) do {                                                          \
        cublasStatus_t cs_ = (call);                                           \
        if (cs_ != CUBLAS_STATUS_SUCCESS)                                      \
            return fail(e, "%s: %s", #call, cublasGetStatusString(cs_));       \
    } while (0)

/* Kernel launches report through cudaGetLastError. */
#define LAUNCHED(what) do {                                                    \
        cudaError_t ce_ = cudaGetLastError();                                  \
        if (ce_ != cudaSuccess)                                                \
            return fail(e, "kernel %s: %s", what, cudaGetErrorString(ce_));    \
    } while (0)

/*
 * Calls kernel K templated on the engine's weight type. DISPATCH_PDL: K
 * calls kvc_pdl_wait before it reads what a kernel wrote, so in a decode
 * step (e->pdl_now) it may start while the kernel before it finishes.
 */
#define DISPATCH_P(pdl, K, grid, block, ...) do {                              \
        switch (e->dtype) {                                                    \
        case DT_F32: KVW_LAUNCH_PDL(pdl, K<float>, grid, block, 0, e->st, __VA_ARGS__); break; \
        case DT_F16: KVW_LAUNCH_PDL(pdl, K<__half>, grid, block, 0, e->st, __VA_ARGS__); break; \
        default: KVW_LAUNCH_PDL(pdl, K<__nv_bfloat16>, grid, block, 0, e->st, __VA_ARGS__);    \
        }                                                                      \
        LAUNCHED(#K);                                                          \
    } while (0)
#define DISPATCH(K, grid, block, ...)     DISPATCH_P(0, K, grid, block, __VA_ARGS__)
#define DISPATCH_PDL(K, grid, block, ...) DISPATCH_P(e->pdl_now, K, grid, block, __VA_ARGS__)

/* Calls kernel K templated on the weight type and the KV pool's type (KVC_COMMA: one macro argument). */
#define KVC_COMMA ,
#define DISPATCH_KV(K, grid, block, ...) do {                                  \
        if (e->kvdt == KV_F32) {                                               \
            switch (e->dtype) {                                                \
            case DT_F32: KVW_LAUNCH(K<float KVC_COMMA float>, grid, block, 0, e->st, __VA_ARGS__); break; \
            case DT_F16: KVW_LAUNCH(K<__half KVC_COMMA float>, grid, block, 0, e->st, __VA_ARGS__); break; \
            default: KVW_LAUNCH(K<__nv_bfloat16 KVC_COMMA float>, grid, block, 0, e->st, __VA_ARGS__); \
            }                                                                  \
        } else {                                                               \
            switch (e->dtype) {                                                \
            case DT_F32: KVW_LAUNCH(K<float KVC_COMMA __nv_bfloat16>, grid, block, 0, e->st, __VA_ARGS__); break; \
            case DT_F16: KVW_LAUNCH(K<__half KVC_COMMA __nv_bfloat16>, grid, block, 0, e->st, __VA_ARGS__); break; \
            default: KVW_LAUNCH(K<__nv_bfloat16 KVC_COMMA __nv_bfloat16>, grid, block, 0, e->st, __VA_ARGS__); \
            }                                                                  \
        }                                                                      \
        LAUNCHED(#K);                                                          \
    } while (0)

/* Calls kernel K templated on the KV pool's type only (LAUNCH_KV_PDL: as DISPATCH_PDL). */
#define LAUNCH_KV_P(pdl, K, grid, block, ...) do {                             \
        if (e->kvdt == KV_F32) KVW_LAUNCH_PDL(pdl, K<float>, grid, block, 0, e->st, __VA_ARGS__); \
        else KVW_LAUNCH_PDL(pdl, K<__nv_bfloat16>, grid, block, 0, e->st, __VA_ARGS__); \
        LAUNCHED(#K);                                                          \
    } while (0)
#define LAUNCH_KV(K, grid, block, ...)     LAUNCH_KV_P(0, K, grid, block, __VA_ARGS__)
#define LAUNCH_KV_PDL(K, grid, block, ...) LAUNCH_KV_P(e->pdl_now, K, grid, block, __VA_ARGS__)

/* Calls kernel K templated on the half weight type (f16 or bf16) and the KV pool's type. */
#define DISPATCH_HALF_KV(K, grid, block, ...) do {                             \
        if (e->kvdt == KV_F32) {                                               \
            if (e->dtype == DT_F16) KVW_LAUNCH(K<__half KVC_COMMA float>, grid, block, 0, e->st, __VA_ARGS__); \
            else KVW_LAUNCH(K<__nv_bfloat16 KVC_COMMA float>, grid, block, 0, e->st, __VA_ARGS__); \
        } else {                                                               \
            if (e->dtype == DT_F16) KVW_LAUNCH(K<__half KVC_COMMA __nv_bfloat16>, grid, block, 0, e->st, __VA_ARGS__); \
            else KVW_LAUNCH(K<__nv_bfloat16 KVC_COMMA __nv_bfloat16>, grid, block, 0, e->st, __VA_ARGS__); \
        }                                                                      \
        LAUNCHED(#K);                                                          \
    } while (0)

/* Forgets every captured graph: a buffer they point into moved. */
static void drop_graphs(cuda_t *e)
{
    unsigned i;

    for (i = 0; i < e->n_graphs; i++) cudaGraphExecDestroy(e->graphs[i].exec);
    e->n_graphs = 0;
}

/* --- weights ------------------------------------------------------------ */

/* Copies n floats to dst + off elements, converted to the engine's dtype. */
static int upload_w(cuda_t *e, void *dst, size_t off, const float *src, size_t n)
{
    const size_t chunk = (size_t) 1 << 22;
    void        *tmp;
    size_t       i, j, m;

    if (e->dtype == DT_F32) {
        CK(cudaMemcpy((float *) dst + off, src, n * sizeof(float), cudaMemcpyHostToDevice));
        return 0;
    }
    tmp = malloc(chunk * e->esz);
    if (tmp == NULL) return fail(e, "out of host memory converting weights");
    for (i = 0; i < n; i += chunk) {
        m = n - i < chunk ? n - i : chunk;
        for (j = 0; j < m; j++) {
            if (e->dtype == DT_F16) ((__half *) tmp)[j] = __float2half(src[i + j]);
            else ((__nv_bfloat16 *) tmp)[j] = __float2bfloat16(src[i + j]);
        }
        cudaError_t ce = cudaMemcpy((char *) dst + (off + i) * e->esz, tmp, m * e->esz,
                                    cudaMemcpyHostToDevice);
        if (ce != cudaSuccess) {
            free(tmp);
            return fail(e, "uploading weights: %s", cudaGetErrorString(ce));
        }
    }
    free(tmp);
    return 0;
}

static int alloc_w(cuda_t *e, void **dst, size_t n)
{
    CK(cudaMalloc(dst, n * e->esz));
    return 0;
}

static int upload_f32(cuda_t *e, float **dst, const float *src, size_t n)
{
    CK(cudaMalloc((void **) dst, n * sizeof(float)));
    CK(cudaMemcpy(*dst, src, n * sizeof(float), cudaMemcpyHostToDevice));
    return 0;
}

/* One layer, with q|k|v and gate|up concatenated by rows (row-major). */
static int upload_layer(cuda_t *e, const kvw_layer_t *l, dlayer_t *d)
{
    size_t H = e->H, qd = (size_t) e->heads * e->hd, kd = (size_t) e->kv_heads * e->hd;
    size_t I = e->inter;

    if (alloc_w(e, &d->wqkv, (qd + 2 * kd) * H) || upload_w(e, d->wqkv, 0, l->wq, qd * H)
        || upload_w(e, d->wqkv, qd * H, l->wk, kd * H)
        || upload_w(e, d->wqkv, (qd + kd) * H, l->wv, kd * H)
        || alloc_w(e, &d->wo, H * qd) || upload_w(e, d->wo, 0, l->wo, H * qd)
        || alloc_w(e, &d->wgu, 2 * I * H) || upload_w(e, d->wgu, 0, l->w_gate, I * H)
        || upload_w(e, d->wgu, I * H, l->w_up, I * H)
        || alloc_w(e, &d->wdown, H * I) || upload_w(e, d->wdown, 0, l->w_down, H * I)
        || upload_f32(e, &d->attn_norm, l->attn_norm, H)
        || upload_f32(e, &d->mlp_norm, l->mlp_norm, H))
        return -1;
    if (l->bo && upload_f32(e, &d->bo, l->bo, H) != 0) return -1;
    if (l->bq) {
        CK(cudaMalloc((void **) &d->bqkv, (qd + 2 * kd) * sizeof(float)));
        CK(cudaMemcpy(d->bqkv, l->bq, qd * sizeof(float), cudaMemcpyHostToDevice));
        CK(cudaMemcpy(d->bqkv + qd, l->bk, kd * sizeof(float), cudaMemcpyHostToDevice));
        CK(cudaMemcpy(d->bqkv + qd + kd, l->bv, kd * sizeof(float), cudaMemcpyHostToDevice));
    }
    return 0;
}

static int upload_model(cuda_t *e, const kvw_model_t *m)
{
    size_t   vh = (size_t) m->vocab * m->hidden;
    uint32_t l;

    if (alloc_w(e, &e->embed, vh) || upload_w(e, e->embed, 0, m->embed, vh)) return -1;
    if (m->lm_head == m->embed) {
        e->lm_head = e->embed;
    } else if (alloc_w(e, &e->lm_head, vh) || upload_w(e, e->lm_head, 0, m->lm_head, vh)) {
        return -1;
    }
    if (upload_f32(e, &e->norm, m->norm, m->hidden)
        || upload_f32(e, &e->inv_freq, m->inv_freq, m->head_dim / 2))
        return -1;
    e->L = (dlayer_t *) calloc(m->layers, sizeof(dlayer_t));
    if (e->L == NULL) return fail(e, "out of host memory");
    for (l = 0; l < m->layers; l++) {
        if (upload_layer(e, &m->L[l], &e->L[l]) != 0) return -1;
    }
    return 0;
}

/* --- scratch ------------------------------------------------------------ */

/* Buffers for T tokens, n_out logit rows and a meta of n_meta ints. */
static int ensure(cuda_t *e, size_t T, size_t n_out, size_t n_meta)
{
    size_t qd = (size_t) e->heads * e->hd, kd = (size_t) e->kv_heads * e->hd;
    size_t widest = e->H > qd ? e->H : qd;

    if (widest < e->inter) widest = e->inter;
    if (T > e->cap || n_out > e->cap_out || n_meta > e->meta_cap) drop_graphs(e);
    if (T > e->cap) {
        cudaFree(e->x); cudaFree(e->qkv); cudaFree(e->gu); cudaFree(e->act);
        e->x = e->qkv = e->gu = NULL;
        e->act = NULL;
        e->cap = 0;
        CK(cudaMalloc((void **) &e->x, T * e->H * sizeof(float)));
        CK(cudaMalloc((void **) &e->qkv, T * (qd + 2 * kd) * sizeof(float)));
        CK(cudaMalloc((void **) &e->gu, T * 2 * e->inter * sizeof(float)));
        CK(cudaMalloc(&e->act, T * widest * e->esz));
        e->cap = T;
    }
    if (n_out > e->cap_out) {
        size_t nc = n_out * e->nchunk * KVC_SAMPLE_CANDS;

        cudaFree(e->logits); cudaFreeHost(e->h_logits);
        cudaFree(e->d_best); cudaFreeHost(e->h_best);
        cudaFree(e->d_temp); cudaFreeHost(e->h_temp); cudaFree(e->d_cp); cudaFreeHost(e->h_cp);
        cudaFree(e->d_ci); cudaFreeHost(e->h_ci); cudaFree(e->d_cs); cudaFreeHost(e->h_cs);
        e->logits = e->h_logits = e->d_temp = e->h_temp = e->d_cp = e->h_cp = NULL;
        e->d_best = e->h_best = e->d_ci = e->h_ci = NULL;
        e->d_cs = e->h_cs = NULL;
        e->cap_out = 0;
        CK(cudaMalloc((void **) &e->logits, n_out * e->vocab * sizeof(float)));
        CK(cudaMallocHost((void **) &e->h_logits, n_out * e->vocab * sizeof(float)));
        CK(cudaMalloc((void **) &e->d_best, n_out * sizeof(int)));
        CK(cudaMallocHost((void **) &e->h_best, n_out * sizeof(int)));
        CK(cudaMalloc((void **) &e->d_temp, n_out * sizeof(float)));
        CK(cudaMallocHost((void **) &e->h_temp, n_out * sizeof(float)));
        CK(cudaMalloc((void **) &e->d_cp, nc * sizeof(float)));
        CK(cudaMallocHost((void **) &e->h_cp, nc * sizeof(float)));
        CK(cudaMalloc((void **) &e->d_ci, nc * sizeof(int)));
        CK(cudaMallocHost((void **) &e->h_ci, nc * sizeof(int)));
        CK(cudaMalloc((void **) &e->d_cs, n_out * e->nchunk * sizeof(double)));
        CK(cudaMallocHost((void **) &e->h_cs, n_out * e->nchunk * sizeof(double)));
        e->cap_out = n_out;
    }
    if (n_meta > e->meta_cap) {
        cudaFree(e->d_meta); cudaFreeHost(e->h_meta);
        e->d_meta = e->h_meta = NULL;
        e->meta_cap = 0;
        CK(cudaMalloc((void **) &e->d_meta, n_meta * sizeof(int)));
        CK(cudaMallocHost((void **) &e->h_meta, n_meta * sizeof(int)));
        e->meta_cap = n_meta;
    }
    return 0;
}

/* --- the step ----------------------------------------------------------- */

/*
 * out[T][rows] (f32) = in[T][cols] . W[rows][cols]^T + beta * out. Row-major
 * out is column-major [rows x T]: out = op_T(W) . in in cuBLAS's terms.
 * beta 1 adds into out: the residual adds of o_proj and down_proj. Steps
 * of one token (batch-1 decode) take k_gemv instead where a row has at
 * least KVC_GEMV_MIN_COLS weights (below that a warp's lanes idle and
 * cuBLAS does as well). On an H200 it read the 1.2B model's matrices 1.2-2.3x
 * faster than cuBLAS at one token, except gate|up (0.84-0.86x), and slower at
 * 2-4 tokens, where decode ran 0.92x and 0.74x with it (docs/CUDA.md).
 * KVW_CUDA_GEMV=0: cuBLAS for every step; =all: k_gemv for steps of up to
 * KVC_GEMV_MAX_T tokens and rows of any length (the tests' tiny models).
 */
static int gemv_fits(const cuda_t *e, size_t T, size_t cols)
{
    return T <= e->gemv_t && cols >= e->gemv_cols && (cols * e->esz) % 16 == 0;
}

static unsigned gemv_blocks(size_t rows)
{
    return (unsigned) ((rows + KVC_GEMV_WARPS - 1) / KVC_GEMV_WARPS);
}

/* k_gemv_norm's and k_gemv_glu's grid: per_sm blocks an SM, fewer for short matrices */
static unsigned norm_blocks(const cuda_t *e, size_t rows, int per_sm)
{
    unsigned most = (unsigned) (e->sms * per_sm);

    return gemv_blocks(rows) < most ? gemv_blocks(rows) : most;
}

static int gemm(cuda_t *e, float *out, const void *in, const void *w, size_t T, size_t rows,
                size_t cols, float beta)
{
    const float alpha = 1.0f;

    if (gemv_fits(e, T, cols) && (uintptr_t) w % 16 == 0 && (uintptr_t) in % 16 == 0) {
        DISPATCH_PDL(k_gemv, gemv_blocks(rows), 32 * KVC_GEMV_WARPS, out, in, w, (int) T,
                     (int) rows, (int) cols, beta != 0.0f);
        return 0;
    }
    CB(cublasGemmEx(e->cb, CUBLAS_OP_T, CUBLAS_OP_N, (int) rows, (int) T, (int) cols,
                    &alpha, w, e->ctype, (int) cols, in, e->ctype, (int) cols,
                    &beta, out, CUDA_R_32F, (int) rows, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return 0;
}

/*
 * Fills the host meta (tok | pos | bt | rows | tables) for the step and
 * checks what the device would otherwise trust: lengths and block ids.
 */
static int build_meta(cuda_t *e, const kvw_step_seq_t *seqs, uint32_t n, size_t T, size_t n_out,
                      size_t n_tables, kvc_meta *m)
{
    int     *tok = e->h_meta, *pos = tok + T, *bt = pos + T, *rows = bt + T;
    int     *tables = rows + n_out;
    size_t   t = 0, r = 0, b = 0;
    uint32_t s, j;

    for (s = 0; s < n; s++) {
        const kvw_step_seq_t *sq = &seqs[s];

        if (sq->n_tokens == 0) continue;        /* as counted by cuda_step */
        for (j = 0; j < sq->n_blocks; j++) {
            if (sq->block_table[j] >= e->b.num_blocks)
                return fail(e, "block %u is outside the pool of %u", sq->block_table[j],
                            e->b.num_blocks);
            tables[b + j] = (int) sq->block_table[j];
        }
        for (j = 0; j < sq->n_tokens; j++, t++) {
            tok[t] = (int) (sq->tokens[j] < e->vocab ? sq->tokens[j] : 0);
            pos[t] = (int) (sq->pos + j);
            bt[t] = (int) b;
        }
        if (sq->sample || sq->logits) rows[r++] = (int) t - 1;
        b += sq->n_blocks;
    }
    m->tok = e->d_meta;
    m->pos = m->tok + T;
    m->bt = m->pos + T;
    m->rows = m->bt + T;
    m->tables = m->rows + n_out;
    CK(cudaMemcpyAsync(e->d_meta, e->h_meta, (3 * T + n_out + n_tables) * sizeof(int),
                       cudaMemcpyHostToDevice, e->st));
    return 0;
}

/*
 * Whether this step's norms and SwiGLU run inside k_gemv (k_gemv_norm,
 * k_gemv_glu): batch-1 decode steps whose matmuls take k_gemv, with rows
 * short enough to stage in shared memory, and no o_proj bias (k_rmsnorm
 * adds it to x). The same bits as the separate kernels, 3 launches a layer
 * fewer. Weights and x are cudaMalloc'ed: aligned for k_gemv's packs.
 */
static int fuse_norm(const cuda_t *e, size_t T, int decode)
{
    return e->fuse_norm && decode && T == 1 && e->L[0].bo == NULL && gemv_fits(e, 1, e->H)
           && gemv_fits(e, 1, e->inter) && e->H * e->esz <= KVC_GEMV_SMEM;
}

/*
 * One transformer layer over the step's T tokens; x is updated in place.
 * nsplit 0: no split-K. fuse_rope (decode steps with split-K): RoPE and the
 * KV write happen inside k_attn_split, one launch less. tc: the tensor-core
 * prefill attention (use_tc). fn: fuse_norm() holds.
 */
static int run_layer(cuda_t *e, uint32_t l, size_t T, const kvc_meta *m, int nsplit,
                     int fuse_rope, int tc, int fn)
{
    float           scale = 1.0f / sqrtf((float) e->hd);
    const dlayer_t *L = &e->L[l];
    size_t          H = e->H, qd = (size_t) e->heads * e->hd, kd = (size_t) e->kv_heads * e->hd;
    size_t          sw = (T * e->inter + 255) / 256;
    dim3            att_grid((unsigned) T, e->heads), gqa_grid((unsigned) T, e->kv_heads);

    if (fn) {
        DISPATCH_PDL(k_gemv_norm, norm_blocks(e, qd + 2 * kd, KVC_GEMV_NORM_PER_SM),
                     32 * KVC_GEMV_WARPS, e->qkv, e->x, (const int *) NULL, L->attn_norm,
                     L->wqkv, (int) (qd + 2 * kd), (int) H, e->eps);
    } else {
        if (l > 0) {                    /* layer 0's norm ran with the embedding */
            DISPATCH(k_rmsnorm, (unsigned) T, 256, e->act, e->x, L->attn_norm, (const int *) NULL,
                     (int) H, e->eps, (const float *) NULL);
        }
        if (gemm(e, e->qkv, e->act, L->wqkv, T, qd + 2 * kd, H, 0.0f) != 0) return -1;
    }
    if (!fuse_rope) {
        LAUNCH_KV(k_rope_store, (unsigned) T, 128, e->qkv, L->bqkv, e->kv, *m, e->inv_freq,
                  (int) e->heads, (int) e->kv_heads, (int) e->hd, (int) e->b.block_size,
                  e->block_elems, e->layer_elems, (int) l);
    }
    if (tc) {                           /* prefill: flash-attention tiles on the tensor cores */
        dim3 tc_grid((unsigned) ((T + KVC_TC_TILE - 1) / KVC_TC_TILE), e->heads);

        DISPATCH_HALF_KV(k_attn_prefill_tc, tc_grid, 32, e->act, e->qkv, e->kv, *m, (int) T,
                         (int) e->heads, (int) e->kv_heads, (int) e->hd, (int) e->b.block_size,
                         e->block_elems, e->layer_elems, (int) l, scale);
    } else if (nsplit > 0) {            /* split-K: K/V read once per group, many blocks */
        dim3 split_grid((unsigned) T, e->kv_heads, (unsigned) nsplit);

        LAUNCH_KV_PDL(k_attn_split, split_grid, 32 * KVC_ATT_WARPS, e->part, e->qkv, e->kv, *m,
                      (int) e->heads, (int) e->kv_heads, (int) e->hd, (int) e->b.block_size,
                      e->block_elems, e->layer_elems, (int) l, scale, e->split_len,
                      fuse_rope ? (const float *) L->bqkv : (const float *) NULL,
                      fuse_rope ? (const float *) e->inv_freq : (const float *) NULL);
        DISPATCH_PDL(k_attn_merge, att_grid, 64, e->act, e->part, *m, (int) e->heads,
                     (int) e->hd, e->split_len, nsplit);
    } else if (e->att != ATT_HEAD && e->heads / e->kv_heads <= KVC_MAX_GROUP) {
        /* a block per (token, KV head): K/V read once per group */
        DISPATCH_KV(k_attention_gqa, gqa_grid, 32 * KVC_ATT_WARPS, e->act, e->qkv, e->kv, *m,
                    (int) e->heads, (int) e->kv_heads, (int) e->hd, (int) e->b.block_size,
                    e->block_elems, e->layer_elems, (int) l, scale);
    } else {
        DISPATCH_KV(k_attention, att_grid, 32 * KVC_ATT_WARPS, e->act, e->qkv, e->kv, *m,
                    (int) e->heads, (int) e->kv_heads, (int) e->hd, (int) e->b.block_size,
                    e->block_elems, e->layer_elems, (int) l, scale);
    }
    if (gemm(e, e->x, e->act, L->wo, T, H, qd, 1.0f) != 0) return -1;
    if (fn) {
        DISPATCH_PDL(k_gemv_glu, norm_blocks(e, e->inter, KVC_GEMV_GLU_PER_SM),
                     32 * KVC_GEMV_WARPS, e->act, e->x, L->mlp_norm, L->wgu, (int) e->inter,
                     (int) H, e->eps);
    } else {
        /* o_proj's bias (attention_bias) is added to x by the norm */
        DISPATCH(k_rmsnorm, (unsigned) T, 256, e->act, e->x, L->mlp_norm, (const int *) NULL,
                 (int) H, e->eps, (const float *) L->bo);
        if (gemm(e, e->gu, e->act, L->wgu, T, 2 * (size_t) e->inter, H, 0.0f) != 0) return -1;
        DISPATCH(k_swiglu, (unsigned) (sw < 65535 ? sw : 65535), 256, e->act, e->gu, T,
                 (int) e->inter);
    }
    return gemm(e, e->x, e->act, L->wdown, T, H, e->inter, 1.0f);
}

/*
 * How many splits the split-K attention runs this step (grid z), and
 * e->split_len, positions per split. By default the step's token count
 * sets the splits wanted (KVC_SPLIT_BLOCKS, KVC_SPLIT_MOST), a split is the
 * step's longest sequence over that many (KVC_SPLIT_MIN..KVC_SPLIT_MAX
 * positions, a multiple of KVC_SPLIT_MIN), and the grid is the splits
 * wanted or, past KVC_SPLIT_MAX positions a split, what the longest
 * sequence needs; so decode steps of
 * one shape replay one CUDA graph until contexts are long, and splits past
 * a token's position exit at once. KVW_CUDA_ATT_SPLIT fixes the positions
 * per split, and the grid follows the longest sequence. 0 when it does not
 * run: another kernel was asked for, a group too wide for it, or partials
 * too large for KVC_PART_MAX_BYTES. -1: no memory for them.
 */
static int splits_for(cuda_t *e, const kvw_step_seq_t *seqs, uint32_t n, size_t T)
{
    uint32_t s, last = 0;
    size_t   row = T * e->heads * (e->hd + 2) * sizeof(float), need, want;
    int      nsplit, len;

    e->split_len = 0;
    if (e->att != ATT_SPLIT || e->heads / e->kv_heads > KVC_MAX_GROUP) return 0;
    for (s = 0; s < n; s++) {
        if (seqs[s].n_tokens > 0 && seqs[s].pos + seqs[s].n_tokens - 1 > last)
            last = seqs[s].pos + seqs[s].n_tokens - 1;
    }
    if (e->split_fixed) {
        len = e->split_fixed;
        nsplit = (int) (last / (uint32_t) len) + 1;
    } else {
        want = (KVC_SPLIT_BLOCKS + T * e->kv_heads - 1) / (T * e->kv_heads);
        if (want > KVC_SPLIT_MOST) want = KVC_SPLIT_MOST;
        len = (int) ((last + want) / want);             /* ceil((last + 1) / want) */
        /* whole KVC_SPLIT_MIN's: the length, and so the graph, changes less often */
        len = (len + KVC_SPLIT_MIN - 1) / KVC_SPLIT_MIN * KVC_SPLIT_MIN;
        len = len > KVC_SPLIT_MAX ? KVC_SPLIT_MAX : len;
        nsplit = (int) (last / (uint32_t) len) + 1;
        if (nsplit < (int) want) nsplit = (int) want;
    }
    need = row * (size_t) nsplit;
    if (nsplit > 65535 || need > KVC_PART_MAX_BYTES) return 0;
    if (need > e->part_cap * sizeof(float)) {
        drop_graphs(e);
        cudaFree(e->part);
        e->part = NULL;
        e->part_cap = 0;
        CK(cudaMalloc((void **) &e->part, need));
        e->part_cap = need / sizeof(float);
    }
    e->split_len = len;
    return nsplit;
}

/* Greedy, as kvw_sample decides it: the token is the argmax, found on the device. */
static int greedy(const kvw_step_seq_t *sq)
{
    return sq->sample && !sq->logits
           && (sq->sampling.temperature <= 1e-5f || sq->sampling.rng == NULL);
}

/* Sampled on the device: a temperature, and no logits asked for (those copy the row anyway). */
static int device_sampled(const kvw_step_seq_t *sq)
{
    return sq->sample && !sq->logits && !greedy(sq) && getenv("KVW_CUDA_HOST_SAMPLING") == NULL;
}

/*
 * Logits to the host only for the rows that need them (logits asked for);
 * greedy rows bring back one token id, rows sampled with a temperature
 * their candidates (k_sample_cand: KVC_SAMPLE_CANDS per vocabulary chunk).
 */
static int copy_out(cuda_t *e, const kvw_step_seq_t *seqs, uint32_t n, size_t n_out)
{
    uint32_t s, r = 0;
    int      any = 0;

    /* the argmax ran with the forward pass (argmax()) */
    CK(cudaMemcpyAsync(e->h_best, e->d_best, n_out * sizeof(int), cudaMemcpyDeviceToHost,
                       e->st));
    for (s = 0; s < n; s++) {
        if (!seqs[s].sample && !seqs[s].logits) continue;
        e->h_temp[r] = 1.0f;
        if (device_sampled(&seqs[s])) {
            e->h_temp[r] = seqs[s].sampling.temperature;
            any = 1;
        } else if (!greedy(&seqs[s])) {
            CK(cudaMemcpyAsync(e->h_logits + (size_t) r * e->vocab,
                               e->logits + (size_t) r * e->vocab, e->vocab * sizeof(float),
                               cudaMemcpyDeviceToHost, e->st));
        }
        r++;
    }
    if (any) {
        size_t nc = n_out * e->nchunk * KVC_SAMPLE_CANDS;
        dim3   grid((unsigned) n_out, (unsigned) e->nchunk);

        CK(cudaMemcpyAsync(e->d_temp, e->h_temp, n_out * sizeof(float), cudaMemcpyHostToDevice,
                           e->st));
        KVW_LAUNCH(k_sample_cand, grid, 256, 0, e->st, e->d_cp, e->d_ci, e->d_cs, e->logits,
                   e->d_best, e->d_temp, (int) e->vocab);
        LAUNCHED("k_sample_cand");
        CK(cudaMemcpyAsync(e->h_cp, e->d_cp, nc * sizeof(float), cudaMemcpyDeviceToHost, e->st));
        CK(cudaMemcpyAsync(e->h_ci, e->d_ci, nc * sizeof(int), cudaMemcpyDeviceToHost, e->st));
        CK(cudaMemcpyAsync(e->h_cs, e->d_cs, n_out * e->nchunk * sizeof(double),
                           cudaMemcpyDeviceToHost, e->st));
    }
    return 0;
}

/* Picks each sampled sequence's token (or hands out logits), after the step. */
static int finish_host(cuda_t *e, kvw_step_seq_t *seqs, uint32_t n)
{
    uint32_t s, r = 0;

    for (s = 0; s < n; s++) {
        float *lg;
        size_t c0;
        int    tok;

        if (!seqs[s].sample && !seqs[s].logits) continue;
        lg = e->h_logits + (size_t) r * e->vocab;
        if (greedy(&seqs[s])) {
            seqs[s].next_token = (uint32_t) e->h_best[r++];
            continue;
        }
        if (device_sampled(&seqs[s])) {
            c0 = (size_t) r * e->nchunk;
            tok = kvc_sample_pick(e->h_cp + c0 * KVC_SAMPLE_CANDS, e->h_ci + c0 * KVC_SAMPLE_CANDS,
                                  e->h_cs + c0, e->nchunk, KVC_SAMPLE_CANDS, KVC_SAMPLE_CHUNK,
                                  e->vocab, &seqs[s].sampling, e->cands);
            if (tok >= 0) {
                seqs[s].next_token = (uint32_t) tok;
                e->dev_sampled++;
                r++;
                continue;
            }
            /* the candidates cannot decide it (a flat distribution): the row, and kvw_sample */
            CK(cudaMemcpy(lg, e->logits + (size_t) r * e->vocab, e->vocab * sizeof(float),
                          cudaMemcpyDeviceToHost));
            e->host_sampled++;
        }
        r++;
        if (seqs[s].logits) memcpy(seqs[s].logits, lg, e->vocab * sizeof(float));
        if (seqs[s].sample) seqs[s].next_token = kvw_sample(lg, e->vocab, &seqs[s].sampling);
    }
    return 0;
}

/*
 * The tensor-core prefill attention (k_attn_prefill_tc) runs a step when:
 * the step is not a decode step (some sequence brings more than one
 * token: prefill and chunked prefill), the weights are f16 or bf16 (its
 * inputs are rounded to the weights' type; an f32 model keeps f32
 * attention), head_dim is a multiple of 16 and at most KVC_TC_MAX_HD, and
 * KVW_CUDA_TC_PREFILL is not "0", on an sm_80 or newer device (bf16 and f16
 * tensor cores; the default build targets sm_80 and sm_90 only). Either KV
 * type. Otherwise the step takes the kernel it took before (split-K, or the
 * one-pass kernels).
 */
static int use_tc(const cuda_t *e, int decode)
{
    return e->tc && !decode && e->dtype != DT_F32 && e->hd % 16 == 0 && e->hd <= KVC_TC_MAX_HD;
}

/*
 * Each logit row's argmax (the greedy token), in two passes over chunks of
 * KVC_ARGMAX_CHUNK logits; the chunks' partials go to the candidates'
 * buffers (at least as many slots a row), which k_sample_cand overwrites
 * only after k_argmax_pick.
 */
static int argmax(cuda_t *e, size_t n_out)
{
    dim3 grid((unsigned) n_out, (unsigned) ((e->vocab + KVC_ARGMAX_CHUNK - 1) / KVC_ARGMAX_CHUNK));

    KVW_LAUNCH_PDL(e->pdl_now, k_argmax, grid, 256, 0, e->st, e->d_cp, e->d_ci, e->logits,
                   (int) e->vocab, KVC_ARGMAX_CHUNK);
    LAUNCHED("k_argmax");
    KVW_LAUNCH_PDL(e->pdl_now, k_argmax_pick, (unsigned) n_out, 32, 0, e->st, e->d_best, e->d_cp,
                   e->d_ci, (int) grid.y, (int) e->vocab);
    LAUNCHED("k_argmax_pick");
    return 0;
}

/*
 * The forward pass on the device, from token ids to the logit rows and
 * their argmax (queued, not waited for). A decode step's kernels may
 * overlap (e->pdl: programmatic dependent launch, kvc_pdl_wait).
 */
static int forward(cuda_t *e, size_t T, size_t n_out, const kvc_meta *m, int nsplit,
                   int decode)
{
    uint32_t l;
    int      fuse_rope = decode && nsplit > 0 && e->fuse, tc = use_tc(e, decode);
    int      fn = fuse_norm(e, T, decode);

    e->pdl_now = decode && e->pdl;      /* read by DISPATCH_PDL in every launch below */
    if (fn) {                           /* layer 0's q|k|v norms x itself */
        DISPATCH(k_embed, (unsigned) T, 256, e->x, e->embed, m->tok, (int) e->H);
    } else {
        DISPATCH(k_embed_rmsnorm, (unsigned) T, 256, e->x, e->act, e->embed, m->tok,
                 e->L[0].attn_norm, (int) e->H, e->eps);
    }
    for (l = 0; l < e->layers; l++) {
        if (run_layer(e, l, T, m, nsplit, fuse_rope, tc, fn) != 0) return -1;
    }
    if (n_out > 0) {
        if (fn) {
            DISPATCH_PDL(k_gemv_norm, norm_blocks(e, e->vocab, KVC_GEMV_NORM_PER_SM),
                         32 * KVC_GEMV_WARPS, e->logits, e->x,
                         m->rows, e->norm, e->lm_head, (int) e->vocab, (int) e->H, e->eps);
        } else {
            DISPATCH(k_rmsnorm, (unsigned) n_out, 256, e->act, e->x, e->norm, m->rows,
                     (int) e->H, e->eps, (const float *) NULL);
            if (gemm(e, e->logits, e->act, e->lm_head, n_out, e->vocab, e->H, 0.0f) != 0)
                return -1;
        }
        return argmax(e, n_out);
    }
    return 0;
}

/* A decode step: one token for every sequence that runs (graphs are kept for these). */
static int decode_only(const kvw_step_seq_t *seqs, uint32_t n, size_t T)
{
    uint32_t s, running = 0;

    for (s = 0; s < n; s++) running += seqs[s].n_tokens > 0;
    return running == T;
}

/*
 * A capture the driver refused (not an error of the step: a device or
 * driver without what capture needs): say so once, launch directly from
 * now on, and run this step that way. g is the slot the graph would take.
 */
static int no_graphs(cuda_t *e, kvc_graph *g, size_t T, size_t n_out, const kvc_meta *m,
                     int nsplit, const char *what)
{
    cudaError_t ce = cudaGetLastError();

    *g = e->graphs[--e->n_graphs];
    fprintf(stderr, "kvcuda: %s failed (%s): decode steps run without CUDA graphs\n", what,
            cudaGetErrorString(ce));
    e->use_graphs = 0;
    if (cudaStreamSynchronize(e->st) != cudaSuccess) return fail(e, "%s", what);
    return forward(e, T, n_out, m, nsplit, 1);
}

/*
 * forward() through a CUDA graph: replayed when a step of this shape was
 * captured, else captured now (the oldest graph makes room) and launched.
 * What changes from step to step (tokens, positions, block tables) is in
 * the meta buffer, uploaded before the launch.
 */
static int replay(cuda_t *e, size_t T, size_t n_out, const kvc_meta *m, int nsplit)
{
    kvc_graph  *g = NULL;
    cudaGraph_t graph = NULL;
    unsigned    i;
    int         rc;

    for (i = 0; i < e->n_graphs; i++) {
        if (e->graphs[i].T == T && e->graphs[i].n_out == n_out && e->graphs[i].nsplit == nsplit
            && e->graphs[i].split_len == e->split_len) {
            g = &e->graphs[i];
            break;
        }
    }
    if (g == NULL) {
        if (e->n_graphs == KVC_MAX_GRAPHS) {
            for (g = &e->graphs[0], i = 1; i < e->n_graphs; i++) {
                if (e->graphs[i].used < g->used) g = &e->graphs[i];
            }
            cudaGraphExecDestroy(g->exec);
        } else {
            g = &e->graphs[e->n_graphs++];
        }
        if (cudaStreamBeginCapture(e->st, cudaStreamCaptureModeGlobal) != cudaSuccess)
            return no_graphs(e, g, T, n_out, m, nsplit, "cudaStreamBeginCapture");
        rc = forward(e, T, n_out, m, nsplit, 1);
        if (cudaStreamEndCapture(e->st, &graph) != cudaSuccess || rc != 0) {
            if (graph) cudaGraphDestroy(graph);
            if (rc != 0) {              /* the step itself is wrong: no retry */
                *g = e->graphs[--e->n_graphs];
                return -1;
            }
            return no_graphs(e, g, T, n_out, m, nsplit, "capturing a decode step");
        }
        rc = cudaGraphInstantiate(&g->exec, graph, 0) != cudaSuccess;
        cudaGraphDestroy(graph);
        if (rc) return no_graphs(e, g, T, n_out, m, nsplit, "cudaGraphInstantiate");
        g->T = T;
        g->n_out = n_out;
        g->nsplit = nsplit;
        g->split_len = e->split_len;
        e->captured++;
    } else {
        e->replayed++;
    }
    g->used = ++e->clock;
    CK(cudaGraphLaunch(g->exec, e->st));
    return 0;
}

/* The step on the device, up to the logits in host memory. */
static int step_device(cuda_t *e, kvw_step_seq_t *seqs, uint32_t n, size_t T, size_t n_out,
                       size_t n_tables)
{
    kvc_meta m;
    int      nsplit, decode;

    if (ensure(e, T, n_out, 3 * T + n_out + n_tables) != 0
        || build_meta(e, seqs, n, T, n_out, n_tables, &m) != 0)
        return -1;
    decode = decode_only(seqs, n, T);
    nsplit = use_tc(e, decode) ? 0 : splits_for(e, seqs, n, T);
    if (nsplit < 0) return -1;
    e->tc_steps += use_tc(e, decode);
    e->fused_steps += fuse_norm(e, T, decode);
    e->pdl_steps += decode && e->pdl;
    if (e->use_graphs && decode ? replay(e, T, n_out, &m, nsplit)
                                : forward(e, T, n_out, &m, nsplit, decode))
        return -1;
    if (n_out > 0 && copy_out(e, seqs, n, n_out) != 0) return -1;
    CK(cudaStreamSynchronize(e->st));
    return 0;
}

/*
 * After a failed step: an error that a synchronize still reports is sticky
 * (an illegal address, a launch failure, a lost device): the context is
 * unusable until the process exits, so every later step would fail. Say so
 * once; kvworker then fails health checks and stops announcing itself.
 */
static void check_sticky(cuda_t *e)
{
    cudaError_t first = cudaGetLastError(), now = cudaDeviceSynchronize();

    if (now == cudaSuccess) now = cudaGetLastError();
    if (now == cudaSuccess) return;     /* e.g. out of memory: the next step may work */
    snprintf(e->unhealthy, sizeof(e->unhealthy), "CUDA device %d is unusable: %s (%s)",
             e->device, cudaGetErrorString(now), cudaGetErrorName(first != cudaSuccess ? first : now));
    e->b.unhealthy = e->unhealthy;
    fprintf(stderr, "kvcuda: %s; this worker stops taking requests\n", e->unhealthy);
}

static int cuda_step(kvw_backend_t *b, kvw_step_seq_t *seqs, uint32_t n, double *step_ms)
{
    cuda_t          *e = (cuda_t *) b;
    size_t           T = 0, n_out = 0, n_tables = 0;
    struct timespec  t0, t1;
    uint32_t         s;

    clock_gettime(CLOCK_MONOTONIC, &t0);
    *step_ms = 0;
    if (b->unhealthy) return -1;        /* the device is lost: fail fast */
    /* the scheduler may run steps on another thread than create: the device is per thread */
    if (cudaSetDevice(e->device) != cudaSuccess) {
        fprintf(stderr, "kvcuda: cudaSetDevice(%d) failed\n", e->device);
        return -1;
    }
    for (s = 0; s < n; s++) {
        if ((size_t) seqs[s].pos + seqs[s].n_tokens > (size_t) seqs[s].n_blocks * b->block_size) {
            fprintf(stderr, "kvcuda: sequence %u: %u + %u tokens exceed its %u blocks\n",
                    s, seqs[s].pos, seqs[s].n_tokens, seqs[s].n_blocks);
            return -1;
        }
        if (seqs[s].n_tokens == 0) continue;
        T += seqs[s].n_tokens;
        n_out += seqs[s].sample || seqs[s].logits;
        n_tables += seqs[s].n_blocks;
    }
    for (s = 0; s < n; s++) {
        if (seqs[s].n_tokens == 0 && (seqs[s].sample || seqs[s].logits)) {
            fprintf(stderr, "kvcuda: sequence %u asks for a token but runs none\n", s);
            return -1;
        }
    }
    if (T == 0) return 0;
    if (step_device(e, seqs, n, T, n_out, n_tables) != 0) {
        fprintf(stderr, "kvcuda: step failed: %s\n", e->err);
        check_sticky(e);
        return -1;
    }
    if (finish_host(e, seqs, n) != 0) {
        fprintf(stderr, "kvcuda: step failed: %s\n", e->err);
        check_sticky(e);
        return -1;
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    *step_ms = (double) (t1.tv_sec - t0.tv_sec) * 1e3 + (double) (t1.tv_nsec - t0.tv_nsec) / 1e6;
    return 0;
}

/* --- CUDA IPC between processes on one node (docs/PROTOCOL.md) -------------- */

static int ipc_err(char *err, size_t errlen, const char *what, cudaError_t ce)
{
    cudaGetLastError();                 /* IPC errors are not sticky: clear it for the steps */
    snprintf(err, errlen, "%s: %s (%s)", what, cudaGetErrorString(ce), cudaGetErrorName(ce));
    return -1;
}

static int cuda_ipc_export(kvw_backend_t *b, uint8_t handle[64], uint64_t *pool_bytes,
                           uint32_t *device, char *err, size_t errlen)
{
    cuda_t     *e = (cuda_t *) b;
    cudaError_t ce;

    if (b->unhealthy) return ipc_err(err, errlen, "engine unhealthy", cudaErrorIllegalState);
    if ((ce = cudaSetDevice(e->device)) != cudaSuccess) return ipc_err(err, errlen, "cudaSetDevice", ce);
    if (!e->exported) {
        if ((ce = cudaIpcGetMemHandle(&e->ipc, e->kv)) != cudaSuccess)
            return ipc_err(err, errlen, "cudaIpcGetMemHandle", ce);
        e->exported = 1;
    }
    /* the prefill's KV writes were queued on our stream: complete before another process reads */
    if ((ce = cudaStreamSynchronize(e->st)) != cudaSuccess)
        return ipc_err(err, errlen, "cudaStreamSynchronize", ce);
    memcpy(handle, e->ipc.reserved, 64);
    *pool_bytes = (uint64_t) b->num_blocks * b->block_bytes;
    *device = (uint32_t) e->device;
    return 0;
}

static void *cuda_ipc_open(kvw_backend_t *b, const uint8_t handle[64], uint64_t pool_bytes,
                           char *err, size_t errlen)
{
    cuda_t     *e = (cuda_t *) b;
    cudaError_t ce;
    unsigned    i, slot = 0;
    void       *base = NULL;

    /* a handle is opened once per process (the driver refuses a second open) */
    for (i = 0; i < e->n_peers; i++) {
        if (!memcmp(e->peers[i].h.reserved, handle, 64) && e->peers[i].bytes == pool_bytes) {
            e->peers[i].used = ++e->clock;
            return e->peers[i].base;
        }
    }
    if ((ce = cudaSetDevice(e->device)) != cudaSuccess) {
        ipc_err(err, errlen, "cudaSetDevice", ce);
        return NULL;
    }
    if (e->n_peers < KVC_MAX_PEERS) {
        slot = e->n_peers;
    } else {
        /* the least recently used mapping goes (a prefill worker that restarted, or left) */
        for (i = 1; i < KVC_MAX_PEERS; i++)
            if (e->peers[i].used < e->peers[slot].used) slot = i;
        cudaIpcCloseMemHandle(e->peers[slot].base);
        cudaGetLastError();
        e->n_peers--;
        e->peers[slot] = e->peers[e->n_peers];
        slot = e->n_peers;
    }
    cudaIpcMemHandle_t h;
    memcpy(h.reserved, handle, 64);
    if ((ce = cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess)) != cudaSuccess) {
        ipc_err(err, errlen, "cudaIpcOpenMemHandle", ce);
        return NULL;
    }
    e->peers[slot].h = h;
    e->peers[slot].base = base;
    e->peers[slot].bytes = pool_bytes;
    e->peers[slot].used = ++e->clock;
    e->n_peers++;
    return base;
}

static int cuda_blocks_copy_peer(kvw_backend_t *b, void *peer, const uint64_t *src,
                                 const uint32_t *dst, uint32_t n, char *err, size_t errlen)
{
    cuda_t     *e = (cuda_t *) b;
    cudaError_t ce;
    uint64_t    bytes = 0;
    uint32_t    i;

    for (i = 0; i < e->n_peers; i++)
        if (e->peers[i].base == peer) bytes = e->peers[i].bytes;
    if (b->unhealthy) return ipc_err(err, errlen, "engine unhealthy", cudaErrorIllegalState);
    if ((ce = cudaSetDevice(e->device)) != cudaSuccess) return ipc_err(err, errlen, "cudaSetDevice", ce);
    for (i = 0; i < n; i++) {
        if (dst[i] >= b->num_blocks || bytes < b->block_bytes || src[i] > bytes - b->block_bytes) {
            snprintf(err, errlen, "block copy %u: offset %llu or block %u outside the pools", i,
                     (unsigned long long) src[i], dst[i]);
            return -1;
        }
        /* on our stream: a later step is ordered after it */
        ce = cudaMemcpyAsync((char *) e->kv + (size_t) dst[i] * b->block_bytes,
                             (const char *) peer + src[i], b->block_bytes,
                             cudaMemcpyDeviceToDevice, e->st);
        if (ce != cudaSuccess) return ipc_err(err, errlen, "cudaMemcpyAsync (peer)", ce);
    }
    /* complete before the prefill side lets its blocks go (device-to-device copies are async) */
    if ((ce = cudaStreamSynchronize(e->st)) != cudaSuccess)
        return ipc_err(err, errlen, "cudaStreamSynchronize", ce);
    return 0;
}

/* --- KV blocks, lifetime -------------------------------------------------- */

static int cuda_block_read(kvw_backend_t *b, uint32_t block, void *dst)
{
    cuda_t *e = (cuda_t *) b;

    if (block >= b->num_blocks) return -1;
    /* the default stream waits for our stream's work (legacy default-stream semantics) */
    if (cudaMemcpy(dst, (char *) e->kv + (size_t) block * b->block_bytes, b->block_bytes,
                   cudaMemcpyDeviceToHost) != cudaSuccess) {
        fprintf(stderr, "kvcuda: block_read %u failed\n", block);
        return -1;
    }
    return 0;
}

static int cuda_block_write(kvw_backend_t *b, uint32_t block, const void *src)
{
    cuda_t *e = (cuda_t *) b;

    if (block >= b->num_blocks) return -1;
    if (cudaMemcpy((char *) e->kv + (size_t) block * b->block_bytes, src, b->block_bytes,
                   cudaMemcpyHostToDevice) != cudaSuccess) {
        fprintf(stderr, "kvcuda: block_write %u failed\n", block);
        return -1;
    }
    return 0;
}

static void cuda_destroy(kvw_backend_t *b)
{
    cuda_t  *e = (cuda_t *) b;
    uint32_t l;

    if (getenv("KVW_CUDA_STATS")) {
        fprintf(stderr, "kvcuda: graphs captured %ld, replayed %ld; sampled on the device %ld, "
                "on the host %ld; tensor-core prefill steps %ld; fused-norm steps %ld; "
                "overlapped (PDL) steps %ld\n", e->captured, e->replayed, e->dev_sampled,
                e->host_sampled, e->tc_steps, e->fused_steps, e->pdl_steps);
    }
    drop_graphs(e);
    for (unsigned i = 0; i < e->n_peers; i++) cudaIpcCloseMemHandle(e->peers[i].base);
    if (e->L) {
        for (l = 0; l < e->layers; l++) {
            dlayer_t *d = &e->L[l];

            cudaFree(d->wqkv); cudaFree(d->wo); cudaFree(d->wgu); cudaFree(d->wdown);
            cudaFree(d->attn_norm); cudaFree(d->mlp_norm); cudaFree(d->bqkv); cudaFree(d->bo);
        }
        free(e->L);
    }
    if (e->lm_head != e->embed) cudaFree(e->lm_head);
    cudaFree(e->embed); cudaFree(e->norm); cudaFree(e->inv_freq); cudaFree(e->kv);
    cudaFree(e->x); cudaFree(e->qkv); cudaFree(e->gu); cudaFree(e->act); cudaFree(e->logits);
    cudaFree(e->d_meta); cudaFreeHost(e->h_logits); cudaFreeHost(e->h_meta);
    cudaFree(e->d_best); cudaFreeHost(e->h_best); cudaFree(e->part); cudaFree(e->cublas_ws);
    cudaFree(e->d_temp); cudaFreeHost(e->h_temp); cudaFree(e->d_cp); cudaFreeHost(e->h_cp);
    cudaFree(e->d_ci); cudaFreeHost(e->h_ci); cudaFree(e->d_cs); cudaFreeHost(e->h_cs);
    free(e->cands);
    if (e->cb) cublasDestroy(e->cb);
    if (e->st) cudaStreamDestroy(e->st);
    free(e);
}

static const char *dtype_name(int dt)
{
    return dt == DT_F32 ? "f32" : dt == DT_F16 ? "f16" : "bf16";
}

/*
 * The KV pool's type (KVW_CUDA_KV_DTYPE=f32, the default, or bf16) and the
 * attention kernel (KVW_CUDA_ATTENTION=split, the default, gqa or head:
 * the earlier one-pass kernels, kept to compare against), with
 * KVW_CUDA_ATT_SPLIT positions per split if set (else splits_for sizes
 * them step by step).
 */
static int pick_kernels(cuda_t *e)
{
    const char *kv = getenv("KVW_CUDA_KV_DTYPE"), *att = getenv("KVW_CUDA_ATTENTION");
    const char *sl = getenv("KVW_CUDA_ATT_SPLIT");
    char       *end;
    long        n;

    if (kv == NULL || *kv == '\0' || !strcmp(kv, "f32")) e->kvdt = KV_F32;
    else if (!strcmp(kv, "bf16")) e->kvdt = KV_BF16;
    else return fail(e, "KVW_CUDA_KV_DTYPE=%s: want f32 or bf16", kv);
    e->kvsz = e->kvdt == KV_F32 ? 4 : 2;
    if (att == NULL || *att == '\0' || !strcmp(att, "split")) e->att = ATT_SPLIT;
    else if (!strcmp(att, "gqa")) e->att = ATT_GQA;
    else if (!strcmp(att, "head")) e->att = ATT_HEAD;
    else return fail(e, "KVW_CUDA_ATTENTION=%s: want split, gqa or head", att);
    e->split_fixed = 0;
    if (sl != NULL && *sl != '\0') {
        n = strtol(sl, &end, 10);
        if (*end != '\0' || n < 1 || n > 1 << 20)
            return fail(e, "KVW_CUDA_ATT_SPLIT=%s: want positions per split, 1..1048576", sl);
        e->split_fixed = (int) n;
    }
    return 0;
}

/* Weight dtype: KVW_CUDA_DTYPE, else the checkpoint's own (an f16 model stays f16). */
static int pick_dtype(cuda_t *e, const kvw_model_t *m)
{
    const char *v = getenv("KVW_CUDA_DTYPE");

    if (v == NULL || *v == '\0') {
        e->dtype = m->dtype == KVW_DTYPE_F16 ? DT_F16 : m->dtype == KVW_DTYPE_BF16 ? DT_BF16
                                                                              : DT_F32;
    } else if (!strcmp(v, "bf16")) {
        e->dtype = DT_BF16;
    } else if (!strcmp(v, "f16")) {
        e->dtype = DT_F16;
    } else if (!strcmp(v, "f32")) {
        e->dtype = DT_F32;
    } else {
        return fail(e, "KVW_CUDA_DTYPE=%s: want bf16, f16 or f32", v);
    }
    e->esz = e->dtype == DT_F32 ? 4 : 2;
    if (pick_kernels(e) != 0) return -1;
    e->ctype = e->dtype == DT_F32 ? CUDA_R_32F : e->dtype == DT_F16 ? CUDA_R_16F : CUDA_R_16BF;
    fprintf(stderr, "kvcuda: weights in %s (checkpoint %s%s), KV cache %s, %s attention\n",
            dtype_name(e->dtype),
            m->dtype == KVW_DTYPE_F16 ? "f16" : m->dtype == KVW_DTYPE_BF16 ? "bf16" : "f32",
            v && *v ? ", KVW_CUDA_DTYPE" : "", e->kvdt == KV_F32 ? "f32" : "bf16",
            e->att == ATT_SPLIT ? "split-K" : e->att == ATT_GQA ? "grouped" : "per-head");
    return 0;
}

/* cuBLAS workspaces and the CUDA context's own needs, kept free of the pool. */
#define KVC_RESERVE ((size_t) 256 << 20)

/*
 * The pool: num_blocks from the config, or what device memory holds once
 * the scratch for the batched-token limit (already allocated) and a
 * reserve for cuBLAS are set aside.
 */
static int alloc_pool(cuda_t *e, uint32_t want)
{
    size_t free_b = 0, total_b = 0, fit;

    e->layer_elems = 2 * (size_t) e->b.block_size * e->kv_heads * e->hd;
    e->block_elems = e->layer_elems * e->layers;
    e->b.block_bytes = e->block_elems * e->kvsz;
    snprintf(e->kv_layout, sizeof(e->kv_layout),
             "kvw-kv/1 %s [block][layer=%u][K|V][slot=%u][kv_head=%u][dim=%u] %zu bytes",
             e->kvdt == KV_F32 ? "f32" : "bf16", e->layers, e->b.block_size, e->kv_heads, e->hd,
             e->b.block_bytes);
    e->b.kv_layout = e->kv_layout;
    if (want == 0) {
        CK(cudaMemGetInfo(&free_b, &total_b));
        if (free_b <= KVC_RESERVE + e->b.block_bytes)
            return fail(e, "not enough device memory for a KV pool (%zu bytes free after "
                        "weights and scratch)", free_b);
        /* the block manager scans its blocks: more than KVC_MAX_AUTO_BLOCKS only on request */
        fit = (free_b - KVC_RESERVE) / e->b.block_bytes * 9 / 10;
        want = (uint32_t) (fit < KVC_MAX_AUTO_BLOCKS ? fit : KVC_MAX_AUTO_BLOCKS);
        if (want < 1) want = 1;
    }
    e->b.num_blocks = want;
    if (cudaMalloc((void **) &e->kv, (size_t) want * e->b.block_bytes) != cudaSuccess) {
        cudaGetLastError();
        return fail(e, "cannot allocate a KV pool of %u blocks of %zu bytes", want,
                    e->b.block_bytes);
    }
    /* zero bits are 0.0 in f32 and bf16 alike */
    CK(cudaMemset(e->kv, 0, (size_t) want * e->b.block_bytes));
    return 0;
}

/*
 * Scratch for a step of the scheduler's limits, allocated before the pool
 * so that the pool takes only what is left and a full step cannot run out
 * of device memory mid-serving. Without limits (kvengine) it grows on demand.
 */
static int alloc_scratch(cuda_t *e, const kvw_backend_config_t *cfg)
{
    size_t T = cfg->max_batched_tokens, seqs = cfg->max_seqs ? cfg->max_seqs : 1, part;

    if (T == 0) return 0;
    if (seqs > T) seqs = T;             /* every sequence in a step runs at least one token */
    /* meta: tok|pos|bt per token, rows per sequence, and block tables sized like ensure()'s caller */
    if (ensure(e, T, seqs, 3 * T + seqs + (size_t) seqs * (e->b.max_model_len / e->b.block_size + 2))
        != 0) {
        cudaGetLastError();
        return fail(e, "no device memory for the scratch of a %zu-token, %zu-sequence step "
                    "(--max-num-batched-tokens, --max-num-seqs): %s", T, seqs, e->err);
    }
    /* split-K partials for decode steps of every sequence at the longest length (capped) */
    part = seqs * e->heads * ((size_t) e->b.max_model_len
                              / (size_t) (e->split_fixed ? e->split_fixed : KVC_SPLIT_MIN) + 1)
           * (e->hd + 2) * sizeof(float);
    if (part > KVC_PART_MAX_BYTES) part = KVC_PART_MAX_BYTES;
    if (e->att == ATT_SPLIT && cudaMalloc((void **) &e->part, part) != cudaSuccess) {
        cudaGetLastError();
        return fail(e, "no device memory for %zu bytes of split-K attention partials", part);
    }
    if (e->part) e->part_cap = part / sizeof(float);
    return 0;
}

/* The steps k_gemv takes (gemm()): KVW_CUDA_GEMV "0" none, "all" every one it can. */
static void pick_gemv(cuda_t *e, const char *v)
{
    e->gemv_t = v && !strcmp(v, "0") ? 0 : v && !strcmp(v, "all") ? KVC_GEMV_MAX_T : 1;
    e->gemv_cols = v && !strcmp(v, "all") ? 0 : KVC_GEMV_MIN_COLS;
}

/*
 * Fusion and overlap of the decode kernels (docs/CUDA.md). KVW_CUDA_FUSE:
 * unset or "1" every fusion, "rope" RoPE inside the split-K attention only
 * (the kernels before the norms moved into k_gemv), "0" none.
 * KVW_CUDA_PDL=1: programmatic dependent launch of the decode kernels, off
 * by default until a GPU has checked it (the emulation runs kernels one
 * after another, so it cannot show a kernel reading too early).
 */
static void pick_fuse(cuda_t *e, const char *fuse, const char *pdl)
{
    e->fuse = !(fuse && !strcmp(fuse, "0"));
    e->fuse_norm = !(fuse && (!strcmp(fuse, "0") || !strcmp(fuse, "rope")));
    e->pdl = pdl && !strcmp(pdl, "1");
}

/* Everything after the model is on the host: device, weights, scratch, pool. */
static int setup(cuda_t *e, const kvw_backend_config_t *cfg, const kvw_model_t *m)
{
    if (m->head_dim > KVC_MAX_HEAD_DIM)
        return fail(e, "head_dim %u is unsupported by the CUDA engine (at most %d)",
                    m->head_dim, KVC_MAX_HEAD_DIM);
    e->vocab = m->vocab; e->H = m->hidden; e->layers = m->layers; e->heads = m->heads;
    e->kv_heads = m->kv_heads; e->hd = m->head_dim; e->inter = m->inter; e->eps = m->rms_eps;
    if (pick_dtype(e, m) != 0) return -1;
    CK(cudaSetDevice(e->device));
    CK(cudaStreamCreateWithFlags(&e->st, cudaStreamDefault));
    CB(cublasCreate(&e->cb));
    CB(cublasSetStream(e->cb, e->st));
    /* a workspace of our own: cuBLAS then allocates nothing while a graph captures */
    CK(cudaMalloc(&e->cublas_ws, KVC_CUBLAS_WS));
    CB(cublasSetWorkspace(e->cb, e->cublas_ws, KVC_CUBLAS_WS));
    e->use_graphs = !(getenv("KVW_CUDA_GRAPHS") && !strcmp(getenv("KVW_CUDA_GRAPHS"), "0"));
    pick_fuse(e, getenv("KVW_CUDA_FUSE"), getenv("KVW_CUDA_PDL"));
    e->tc = !(getenv("KVW_CUDA_TC_PREFILL") && !strcmp(getenv("KVW_CUDA_TC_PREFILL"), "0"));
    pick_gemv(e, getenv("KVW_CUDA_GEMV"));
    {
        cudaDeviceProp prop;

        /* f16/bf16 wmma needs sm_80 (the default build has no older code, -arch=native
         * may); programmatic dependent launch sm_90 */
        e->sms = 1;
        if (cudaGetDeviceProperties(&prop, e->device) == cudaSuccess) {
            if (prop.major < 8) e->tc = 0;
            if (prop.major < 9) e->pdl = 0;
            e->sms = prop.multiProcessorCount > 0 ? prop.multiProcessorCount : 1;
        }
    }
    if (upload_model(e, m) != 0) return -1;
    e->nchunk = (int) ((m->vocab + KVC_SAMPLE_CHUNK - 1) / KVC_SAMPLE_CHUNK);
    e->cands = (kvc_cand *) malloc((size_t) e->nchunk * KVC_SAMPLE_CANDS * sizeof(kvc_cand));
    if (e->cands == NULL) return fail(e, "out of host memory");
    e->b.name = "cuda";
    e->b.vocab_size = m->vocab;
    e->b.eos_token_id = m->eos[0];
    memcpy(e->b.eos_ids, m->eos, sizeof(e->b.eos_ids));
    e->b.n_eos = m->n_eos;
    e->b.max_model_len = m->max_pos;
    e->b.block_size = cfg->block_size ? cfg->block_size : 16;
    if (alloc_scratch(e, cfg) != 0 || alloc_pool(e, cfg->num_blocks) != 0) return -1;
    e->b.step = cuda_step;
    e->b.block_read = cuda_block_read;
    e->b.block_write = cuda_block_write;
    if (!(getenv("KVW_CUDA_IPC") && !strcmp(getenv("KVW_CUDA_IPC"), "0"))) {
        e->b.ipc_export = cuda_ipc_export;
        e->b.ipc_open = cuda_ipc_open;
        e->b.blocks_copy_peer = cuda_blocks_copy_peer;
    }
    e->b.destroy = cuda_destroy;
    return 0;
}

/*
 * Whether an NVIDIA driver is installed: its library loads, or its device
 * node exists. KVW_CUDA_DRIVER_LIB names another library to look for
 * (tests stand in a present driver with it).
 */
static int driver_installed(void)
{
    const char *lib = getenv("KVW_CUDA_DRIVER_LIB");
    void       *h;

    if (lib == NULL || *lib == '\0') {
        lib = "libcuda.so.1";
        if (access("/dev/nvidiactl", F_OK) == 0) return 1;
    }
    h = dlopen(lib, RTLD_LAZY | RTLD_LOCAL);
    if (h) dlclose(h);
    return h != NULL;
}

/*
 * "no CUDA device" (tests skip, kvworker refuses --engine cuda plainly)
 * only when there is none: no device, or no driver at all. A device that
 * is there but cannot be used (a driver older than the CUDA this library
 * was built with, busy or prohibited devices, a driver/library mismatch)
 * is a loud failure with the reason: it is a broken machine, not a
 * GPU-less one.
 */
static int check_device(int device, char *err, size_t errlen)
{
    int         ndev = 0;
    cudaError_t ce = cudaGetDeviceCount(&ndev);

    if (ce == cudaErrorNoDevice || (ce == cudaSuccess && ndev == 0)) {
        snprintf(err, errlen, "no CUDA device: %s",
                 ce != cudaSuccess ? cudaGetErrorString(ce) : "cudaGetDeviceCount found none");
        return -1;
    }
    if (ce == cudaErrorInsufficientDriver && !driver_installed()) {
        snprintf(err, errlen, "no CUDA device: no NVIDIA driver is installed (%s)",
                 cudaGetErrorString(ce));
        return -1;
    }
    if (ce != cudaSuccess) {
        snprintf(err, errlen, "a CUDA device is present but unusable: %s (%s); this engine is "
                 "built with CUDA %d.%d and needs a driver that supports it",
                 cudaGetErrorString(ce), cudaGetErrorName(ce), CUDART_VERSION / 1000,
                 CUDART_VERSION % 1000 / 10);
        return -1;
    }
    if (device < 0 || device >= ndev) {
        snprintf(err, errlen, "--device %d: this machine has %d CUDA device%s (0..%d)", device,
                 ndev, ndev == 1 ? "" : "s", ndev - 1);
        return -1;
    }
    return 0;
}

extern "C" kvw_backend_t *kvw_cuda_backend_create_impl(const kvw_backend_config_t *cfg,
                                                       char *err, size_t errlen)
{
    cuda_t      *e;
    kvw_model_t  m;

    if (check_device(cfg->device, err, errlen) != 0) return NULL;
    if (cfg->model_dir == NULL) {
        snprintf(err, errlen, "--engine cuda needs --model DIR");
        return NULL;
    }
    e = (cuda_t *) calloc(1, sizeof(*e));
    if (e == NULL) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    e->device = cfg->device;
    if (kvw_model_load(cfg->model_dir, &m, err, errlen) != 0) {
        free(e);
        return NULL;
    }
    /* the host copy goes once uploaded: kvworker keeps only device weights */
    if (setup(e, cfg, &m) != 0) {
        snprintf(err, errlen, "CUDA engine: %s", e->err);
        kvw_model_free(&m);
        cuda_destroy(&e->b);
        return NULL;
    }
    kvw_model_free(&m);
    return &e->b;
}
