/*
 * The CUDA engine's kernels (kvw_cuda.cu): everything of the Llama forward
 * pass that is not a matmul, and the matrix-vector products of decode steps
 * of a few sequences (k_gemv). Other matmuls go to cuBLAS.
 *
 * Types: weights and matmul inputs ("act") are T: float, __half or
 * __nv_bfloat16, the type the weights were uploaded in. Everything a matmul
 * writes (residual stream x, q/k/v, gate/up, logits), norms and biases are
 * f32. The KV pool is KV: float (the default: the CPU engine's layout and
 * bytes) or __nv_bfloat16 (KVW_CUDA_KV_DTYPE=bf16: half the bytes to read
 * per decode step, same element order).
 *
 * KV pool: [block][layer][K|V][block_size][kv_heads][head_dim] (kvw_backend.h);
 * block_elems and layer_elems count elements of type KV.
 */
#ifndef KVW_CUDA_KERNELS_CUH
#define KVW_CUDA_KERNELS_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <mma.h>
#include <stdint.h>

/*
 * Every launch goes through KVW_LAUNCH so that the same text builds with
 * nvcc and, against the host emulation in emu/ (which defines it), with g++.
 */
#ifndef KVW_LAUNCH
#define KVW_LAUNCH(K, grid, block, smem, stream, ...) K<<<grid, block, smem, stream>>>(__VA_ARGS__)
#endif

/*
 * Programmatic dependent launch (sm_90 and newer): a kernel launched with
 * KVW_LAUNCH_PDL(1, ...) may start while the kernel before it in the
 * stream is still running. Until kvc_pdl_wait() returns it may read only
 * what no step writes (weights, norms, the step's meta) and must write
 * nothing; kvc_pdl_wait() waits for the kernel before it to finish and its
 * writes to be visible. kvc_pdl_trigger() lets the kernel after it start;
 * every kernel here calls it only after its own wait, so when a kernel
 * starts, the one two back has finished. Both are no-ops for a launch
 * without the attribute, on older GPUs and in the host emulation (which
 * runs kernels one after another).
 */
static __device__ __forceinline__ void kvc_pdl_wait(void)
{
#if defined(KVEMU)
    kvemu::pdl_wait();                  /* checks that a PDL launch's blocks wait */
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

static __device__ __forceinline__ void kvc_pdl_trigger(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

#ifndef KVW_LAUNCH_PDL
template <class... P, class... A>
static void kvc_launch_pdl(void (*k)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t st,
                           A... a)
{
    cudaLaunchConfig_t  c = {};
    cudaLaunchAttribute at[1] = {};

    c.gridDim = grid;
    c.blockDim = block;
    c.dynamicSmemBytes = smem;
    c.stream = st;
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    c.attrs = at;
    c.numAttrs = 1;
    cudaLaunchKernelEx(&c, k, a...);    /* an error is cudaGetLastError's, as for <<<>>> */
}

/* pdl 0: KVW_LAUNCH; else the launch may overlap the kernel before it (see kvc_pdl_wait) */
#define KVW_LAUNCH_PDL(pdl, K, grid, block, smem, stream, ...) do {               \
        if (pdl) kvc_launch_pdl(K, grid, block, smem, stream, __VA_ARGS__);        \
        else KVW_LAUNCH(K, grid, block, smem, stream, __VA_ARGS__);                \
    } while (0)
#endif

#define KVC_MAX_HEAD_DIM 256    /* attention keeps a head's accumulator in registers */
#define KVC_ATT_WARPS    4
#define KVC_MAX_GROUP    8      /* query heads per KV head that k_attention_gqa serves */

static __device__ __forceinline__ float to_f(float v) { return v; }
static __device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
static __device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

template <class T> static __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v)
{
    return __float2bfloat16(v);
}

/* Kernels take weight-typed buffers as void * so one launch line serves all three types. */

/* Where one step's per-token facts live on the device (one upload per step). */
struct kvc_meta {
    const int *tok;     /* [T] token ids (already clamped to the vocabulary) */
    const int *pos;     /* [T] position of each token in its sequence */
    const int *bt;      /* [T] offset of each token's block table in tables */
    const int *rows;    /* [n_out] rows of x whose logits are wanted */
    const int *tables;  /* every sequence's block table, one after another */
};

/* x[t][:] = embed[tok[t]][:], one thread block per token. */
template <class T>
__global__ void k_embed(float *x, const void *embed, const int *tok, int H)
{
    const T *row = (const T *) embed + (size_t) tok[blockIdx.x] * H;
    float   *out = x + (size_t) blockIdx.x * H;

    for (int i = threadIdx.x; i < H; i += blockDim.x) out[i] = to_f(row[i]);
}

/* Sum of a float over the thread block (blockDim a multiple of 32, <= 1024). */
static __device__ float block_sum(float v);

/*
 * k_embed and the first layer's attention norm in one launch: x[t][:] =
 * embed[tok[t]][:], act[t][:] = rmsnorm(x[t][:]) * w. The same arithmetic
 * as the two kernels (each thread norms the elements it copied).
 */
template <class T>
__global__ void k_embed_rmsnorm(float *x, void *act, const void *embed, const int *tok,
                                const float *w, int H, float eps)
{
    const T *row = (const T *) embed + (size_t) tok[blockIdx.x] * H;
    float   *xr = x + (size_t) blockIdx.x * H, ss = 0, inv;
    T       *o = (T *) act + (size_t) blockIdx.x * H;

    for (int i = threadIdx.x; i < H; i += blockDim.x) xr[i] = to_f(row[i]);
    for (int i = threadIdx.x; i < H; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss);
    inv = rsqrtf(ss / (float) H + eps);
    for (int i = threadIdx.x; i < H; i += blockDim.x) o[i] = from_f<T>(xr[i] * inv * w[i]);
}

/* Sum of a float over the thread block (blockDim a multiple of 32, <= 1024). */
static __device__ float block_sum(float v)
{
    __shared__ float part[32];
    int              lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();                    /* part[] may still be read by a previous call */
    if (lane == 0) part[warp] = v;
    __syncthreads();
    v = 0;
    for (int w = 0; w < (int) (blockDim.x >> 5); w++) v += part[w];
    return v;
}

/*
 * out[r][:] = rmsnorm(x[rows ? rows[r] : r][:]) * w, one thread block per
 * output row; rows picks the last tokens for the final norm. add (with
 * rows NULL): x[r][:] += add first, written back (o_proj's bias with
 * Llama's attention_bias, fused here: one launch and one pass over x less).
 * Each thread touches only its own elements of x, so no barrier is needed
 * between the add and the norm.
 */
template <class T>
__global__ void k_rmsnorm(void *out, float *x, const float *w, const int *rows, int H,
                          float eps, const float *add)
{
    float *in = x + (size_t) (rows ? rows[blockIdx.x] : (int) blockIdx.x) * H;
    T     *o = (T *) out + (size_t) blockIdx.x * H;
    float  ss = 0, inv;

    if (add) {
        for (int i = threadIdx.x; i < H; i += blockDim.x) in[i] += add[i];
    }
    for (int i = threadIdx.x; i < H; i += blockDim.x) ss += in[i] * in[i];
    ss = block_sum(ss);
    inv = rsqrtf(ss / (float) H + eps);
    for (int i = threadIdx.x; i < H; i += blockDim.x) o[i] = from_f<T>(in[i] * inv * w[i]);
}

/*
 * After the fused q|k|v matmul (qkv rows of ld = qd + 2 kd floats): adds
 * the biases (Qwen2) if any, rotates q in place and k into the KV pool with
 * rotate_half RoPE, and copies v into the pool. One thread block per token;
 * each element is touched by one thread, so no synchronisation is needed.
 */
template <class KV>
__global__ void k_rope_store(float *qkv, const float *bias, void *kvp, kvc_meta m,
                             const float *inv_freq, int heads, int kv_heads, int hd,
                             int block_size, size_t block_elems, size_t layer_elems, int layer)
{
    KV     *kv = (KV *) kvp;
    int     t = blockIdx.x, half = hd / 2, qd = heads * hd, kd = kv_heads * hd;
    int     p = m.pos[t];
    float  *row = qkv + (size_t) t * (qd + 2 * kd);
    int     blk = m.tables[m.bt[t] + p / block_size];
    KV     *k_dst = kv + (size_t) blk * block_elems + (size_t) layer * layer_elems
                    + (size_t) (p % block_size) * kd;
    KV     *v_dst = k_dst + layer_elems / 2;

    for (int i = threadIdx.x; i < (heads + kv_heads) * half; i += blockDim.x) {
        int    h = i / half, d = i % half, base = h * hd;   /* k heads follow q heads in row */
        float  a = (float) p * inv_freq[d], c = cosf(a), s = sinf(a);
        float  x1 = row[base + d], x2 = row[base + d + half];

        if (bias) {
            x1 += bias[base + d];
            x2 += bias[base + d + half];
        }
        if (h < heads) {
            row[base + d] = x1 * c - x2 * s;
            row[base + d + half] = x2 * c + x1 * s;
        } else {
            k_dst[base - qd + d] = from_f<KV>(x1 * c - x2 * s);
            k_dst[base - qd + d + half] = from_f<KV>(x2 * c + x1 * s);
        }
    }
    for (int i = threadIdx.x; i < kd; i += blockDim.x) {
        v_dst[i] = from_f<KV>(row[qd + kd + i] + (bias ? bias[qd + kd + i] : 0.0f));
    }
}

/*
 * Paged attention, prefill chunks and decode alike: one thread block per
 * (token, query head), KVC_ATT_WARPS warps. Warp w takes positions w, w +
 * warps, ... of 0..pos (its sequence's block table maps them to pool
 * blocks); lanes split head_dim for the dot product and the output. Each
 * warp keeps an online softmax (running max, sum, weighted V); the warps'
 * partial results are merged at the end. GQA: query head h reads KV head
 * h / (heads / kv_heads).
 */
template <class T, class KV>
__global__ void k_attention(void *out, const float *qkv, const void *kvp, kvc_meta m,
                            int heads, int kv_heads, int hd, int block_size,
                            size_t block_elems, size_t layer_elems, int layer, float scale)
{
    __shared__ float q[KVC_MAX_HEAD_DIM];
    __shared__ float w_max[KVC_ATT_WARPS], w_sum[KVC_ATT_WARPS];
    __shared__ float w_acc[KVC_ATT_WARPS][KVC_MAX_HEAD_DIM];
    const KV    *kv = (const KV *) kvp;
    int          t = blockIdx.x, h = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int          qd = heads * hd, kd = kv_heads * hd, kvh = h / (heads / kv_heads);
    int          pos = m.pos[t];
    const int   *table = m.tables + m.bt[t];
    const float *qh = qkv + (size_t) t * (qd + 2 * kd) + h * hd;
    float        acc[KVC_MAX_HEAD_DIM / 32], mx = -INFINITY, sum = 0;

    for (int d = threadIdx.x; d < hd; d += blockDim.x) q[d] = qh[d] * scale;
    for (int j = 0; j < KVC_MAX_HEAD_DIM / 32; j++) acc[j] = 0;
    __syncthreads();
    for (int p = warp; p <= pos; p += KVC_ATT_WARPS) {
        const KV    *k = kv + (size_t) table[p / block_size] * block_elems
                         + (size_t) layer * layer_elems + (size_t) (p % block_size) * kd
                         + (size_t) kvh * hd;
        const KV    *v = k + layer_elems / 2;
        float        s = 0, nmx, corr, e;

        for (int d = lane; d < hd; d += 32) s += q[d] * to_f(k[d]);
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        nmx = fmaxf(mx, s);
        corr = expf(mx - nmx);          /* 0 on a warp's first position */
        e = expf(s - nmx);
        sum = sum * corr + e;
#pragma unroll
        for (int j = 0; j < KVC_MAX_HEAD_DIM / 32; j++) {   /* unrolled: acc stays in registers */
            int d = lane + 32 * j;

            if (d < hd) acc[j] = acc[j] * corr + e * to_f(v[d]);
        }
        mx = nmx;
    }
    if (lane == 0) {
        w_max[warp] = mx;
        w_sum[warp] = sum;
    }
#pragma unroll
    for (int j = 0; j < KVC_MAX_HEAD_DIM / 32; j++) {
        if (lane + 32 * j < hd) w_acc[warp][lane + 32 * j] = acc[j];
    }
    __syncthreads();
    {
        float gmx = -INFINITY, total = 0;
        T    *o = (T *) out + (size_t) t * qd + h * hd;

        for (int w = 0; w < KVC_ATT_WARPS; w++) gmx = fmaxf(gmx, w_max[w]);
        for (int w = 0; w < KVC_ATT_WARPS; w++) {
            total += w_max[w] == -INFINITY ? 0.0f : w_sum[w] * expf(w_max[w] - gmx);
        }
        for (int d = threadIdx.x; d < hd; d += blockDim.x) {
            float r = 0;

            for (int w = 0; w < KVC_ATT_WARPS; w++) {
                if (w_max[w] != -INFINITY) r += w_acc[w][d] * expf(w_max[w] - gmx);
            }
            o[d] = from_f<T>(r / total);
        }
    }
}

/* x[t][:] += bias (o_proj's bias with Llama's attention_bias), one thread block per token. */
__global__ void k_add_bias(float *x, const float *bias, int H)
{
    float *row = x + (size_t) blockIdx.x * H;

    for (int i = threadIdx.x; i < H; i += blockDim.x) row[i] += bias[i];
}

/* (v, i) becomes (ov, oi) when that is larger, or equal at a smaller index (the first one wins). */
static __device__ __forceinline__ void kvc_better(float *v, int *i, float ov, int oi)
{
    if (ov > *v || (ov == *v && oi < *i)) {
        *v = ov;
        *i = oi;
    }
}

/*
 * The device argmax (greedy sampling), pass 1: one thread block per (logit
 * row, chunk of `chunk` logits), blockDim a multiple of 32 (at most 1024),
 * writes its chunk's largest value and the first index holding it to
 * val/idx[row * gridDim.y + chunk] (index vocab when nothing beats -inf).
 * One block per row walked 50k logits alone: 78 us a token on an H200.
 */
__global__ void k_argmax(float *val, int *idx, const float *logits, int vocab, int chunk)
{
    __shared__ float w_val[32];
    __shared__ int   w_idx[32];
    const float     *row = logits + (size_t) blockIdx.x * vocab;
    float            v = -INFINITY;
    int              i = vocab, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int              end = (int) (blockIdx.y + 1) * chunk;

    kvc_pdl_wait();
    kvc_pdl_trigger();
    for (int j = (int) blockIdx.y * chunk + threadIdx.x; j < end && j < vocab; j += blockDim.x) {
        if (row[j] > v) {
            v = row[j];
            i = j;
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        kvc_better(&v, &i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
    }
    if (lane == 0) {
        w_val[warp] = v;
        w_idx[warp] = i;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int) (blockDim.x >> 5); w++) kvc_better(&v, &i, w_val[w], w_idx[w]);
        val[blockIdx.x * gridDim.y + blockIdx.y] = v;
        idx[blockIdx.x * gridDim.y + blockIdx.y] = i;
    }
}

/*
 * Pass 2: one warp per row merges its nchunk chunks: best[r] = the index of
 * row r's largest logit, the first one on ties (as kvw_sample's greedy
 * scan: a later equal value does not replace it); 0 when no value beats
 * -inf.
 */
__global__ void k_argmax_pick(int *best, const float *val, const int *idx, int nchunk, int vocab)
{
    float v = -INFINITY;
    int   i = vocab, lane = threadIdx.x;

    kvc_pdl_wait();
    kvc_pdl_trigger();
    for (int c = lane; c < nchunk; c += 32) {
        kvc_better(&v, &i, val[blockIdx.x * nchunk + c], idx[blockIdx.x * nchunk + c]);
    }
    for (int o = 16; o > 0; o >>= 1) {
        kvc_better(&v, &i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
    }
    if (lane == 0) best[blockIdx.x] = i < vocab ? i : 0;
}

/*
 * One position of a warp's online softmax over a GQA group (k_attention_gqa
 * and k_attn_split share it): the lane's slice of K row k and V row v
 * (every load issued before the first use), scored against each of the G
 * query heads in q and folded into the running max, sum of exp and
 * weighted V. Inlined with the loops unrolled, so acc stays in registers.
 */
#define KVC_NJ (KVC_MAX_HEAD_DIM / 32)

template <class KV>
static __device__ __forceinline__ void kvc_group_step(const float (*q)[KVC_MAX_HEAD_DIM],
                                                      const KV *k, const KV *v, int G, int hd,
                                                      int lane, float (*acc)[KVC_NJ], float *mx,
                                                      float *sum)
{
    float kr[KVC_NJ], vr[KVC_NJ];

#pragma unroll
    for (int j = 0; j < KVC_NJ; j++) {
        int d = lane + 32 * j;

        kr[j] = d < hd ? to_f(k[d]) : 0.0f;
        vr[j] = d < hd ? to_f(v[d]) : 0.0f;
    }
#pragma unroll
    for (int g = 0; g < KVC_MAX_GROUP; g++) {
        float s = 0, nmx, corr, e;

        if (g >= G) break;              /* the same for the whole warp */
#pragma unroll
        for (int j = 0; j < KVC_NJ; j++) {
            if (lane + 32 * j < hd) s += q[g][lane + 32 * j] * kr[j];
        }
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        nmx = fmaxf(mx[g], s);
        corr = expf(mx[g] - nmx);       /* 0 on a warp's first position */
        e = expf(s - nmx);
        sum[g] = sum[g] * corr + e;
#pragma unroll
        for (int j = 0; j < KVC_NJ; j++) acc[g][j] = acc[g][j] * corr + e * vr[j];
        mx[g] = nmx;
    }
}

/* A warp's running max, sum and weighted V of each group head, to shared memory for the merge. */
static __device__ __forceinline__ void kvc_group_spill(float *w_max, float *w_sum,
                                                       float (*w_acc)[KVC_MAX_HEAD_DIM], int G,
                                                       int hd, int lane,
                                                       const float (*acc)[KVC_NJ],
                                                       const float *mx, const float *sum)
{
#pragma unroll
    for (int g = 0; g < KVC_MAX_GROUP; g++) {  /* unrolled: acc stays in registers */
        if (g >= G) break;
        if (lane == 0) {
            w_max[g] = mx[g];
            w_sum[g] = sum[g];
        }
#pragma unroll
        for (int j = 0; j < KVC_NJ; j++) {
            if (lane + 32 * j < hd) w_acc[g][lane + 32 * j] = acc[g][j];
        }
    }
}

/*
 * The same attention with one thread block per (token, KV head) serving
 * all heads / kv_heads (at most KVC_MAX_GROUP) query heads of the group:
 * each K and V row is read once per group instead of once per query head
 * (the GQA saving; decode is bound by these reads). A lane holds its slice
 * of the K and V row in registers and uses it for every head of the group.
 * Sums run in k_attention's order, so the results are the same bits.
 */
template <class T, class KV>
__global__ void k_attention_gqa(void *out, const float *qkv, const void *kvp, kvc_meta m,
                                int heads, int kv_heads, int hd, int block_size,
                                size_t block_elems, size_t layer_elems, int layer, float scale)
{
    __shared__ float q[KVC_MAX_GROUP][KVC_MAX_HEAD_DIM];
    __shared__ float w_max[KVC_ATT_WARPS][KVC_MAX_GROUP], w_sum[KVC_ATT_WARPS][KVC_MAX_GROUP];
    __shared__ float w_acc[KVC_ATT_WARPS][KVC_MAX_GROUP][KVC_MAX_HEAD_DIM];
    const KV    *kv = (const KV *) kvp;
    int          t = blockIdx.x, kvh = blockIdx.y, G = heads / kv_heads;
    int          lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int          qd = heads * hd, kd = kv_heads * hd, pos = m.pos[t];
    const int   *table = m.tables + m.bt[t];
    const float *qg = qkv + (size_t) t * (qd + 2 * kd) + (size_t) kvh * G * hd;
    float        acc[KVC_MAX_GROUP][KVC_NJ], mx[KVC_MAX_GROUP], sum[KVC_MAX_GROUP];

    for (int i = threadIdx.x; i < G * hd; i += blockDim.x) q[i / hd][i % hd] = qg[i] * scale;
#pragma unroll
    for (int g = 0; g < KVC_MAX_GROUP; g++) {
        mx[g] = -INFINITY;
        sum[g] = 0;
#pragma unroll
        for (int j = 0; j < KVC_NJ; j++) acc[g][j] = 0;
    }
    __syncthreads();
    for (int p = warp; p <= pos; p += KVC_ATT_WARPS) {
        const KV *k = kv + (size_t) table[p / block_size] * block_elems
                      + (size_t) layer * layer_elems + (size_t) (p % block_size) * kd
                      + (size_t) kvh * hd;

        kvc_group_step(q, k, k + layer_elems / 2, G, hd, lane, acc, mx, sum);
    }
    kvc_group_spill(w_max[warp], w_sum[warp], w_acc[warp], G, hd, lane, acc, mx, sum);
    __syncthreads();
    for (int i = threadIdx.x; i < G * hd; i += blockDim.x) {
        int   g = i / hd, d = i % hd;
        float gmx = -INFINITY, total = 0, r = 0;
        T    *o = (T *) out + (size_t) t * qd + (size_t) (kvh * G + g) * hd;

        for (int w = 0; w < KVC_ATT_WARPS; w++) gmx = fmaxf(gmx, w_max[w][g]);
        for (int w = 0; w < KVC_ATT_WARPS; w++) {
            total += w_max[w][g] == -INFINITY ? 0.0f : w_sum[w][g] * expf(w_max[w][g] - gmx);
        }
        for (int w = 0; w < KVC_ATT_WARPS; w++) {
            if (w_max[w][g] != -INFINITY) r += w_acc[w][g][d] * expf(w_max[w][g] - gmx);
        }
        o[d] = from_f<T>(r / total);
    }
}

/*
 * Split-K ("flash-decoding") attention, pass 1: one thread block per
 * (token, KV head, split). Split s covers positions [s * split_len,
 * min((s + 1) * split_len, pos + 1)) of the token's sequence, so a decode
 * step of one long sequence still spreads over many blocks (one block per
 * head walked the whole sequence alone). All query heads of the GQA group
 * (at most KVC_MAX_GROUP) share each K and V row read: a lane holds its
 * slice of the row in registers and uses it for every head of the group.
 * Within the block, warps take every KVC_ATT_WARPS-th position with an
 * online softmax and are merged in shared memory; the block writes, per
 * query head, its split's running max, sum of exp and unnormalised
 * weighted V to part[t][h][s] = {m, l, acc[hd]} (f32). Splits past the
 * token's position (the grid is sized for the step's longest sequence)
 * write nothing: k_attn_merge reads only the token's own splits, so a
 * token's result does not depend on what else is in the step.
 */
template <class KV>
__global__ void k_attn_split(float *part, const float *qkv, const void *kvp, kvc_meta m,
                             int heads, int kv_heads, int hd, int block_size,
                             size_t block_elems, size_t layer_elems, int layer, float scale,
                             int split_len, const float *bias, const float *inv_freq)
{
    __shared__ float q[KVC_MAX_GROUP][KVC_MAX_HEAD_DIM];
    __shared__ float w_max[KVC_ATT_WARPS][KVC_MAX_GROUP], w_sum[KVC_ATT_WARPS][KVC_MAX_GROUP];
    __shared__ float w_acc[KVC_ATT_WARPS][KVC_MAX_GROUP][KVC_MAX_HEAD_DIM];
    const KV    *kv = (const KV *) kvp;
    int          t = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z, G = heads / kv_heads;
    int          lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nsplit = gridDim.z;
    int          qd = heads * hd, kd = kv_heads * hd, pos = m.pos[t];
    int          start = split * split_len, end = start + split_len;
    const int   *table = m.tables + m.bt[t];
    const float *qg = qkv + (size_t) t * (qd + 2 * kd) + (size_t) kvh * G * hd;
    float        acc[KVC_MAX_GROUP][KVC_NJ], mx[KVC_MAX_GROUP], sum[KVC_MAX_GROUP];

    kvc_pdl_wait();                     /* q, k, v: the matmul just before */
    kvc_pdl_trigger();
    if (start > pos) return;            /* the whole block: before any barrier */
    if (end > pos + 1) end = pos + 1;
    if (inv_freq == NULL) {             /* k_rope_store ran: q is rotated, K/V are in the pool */
        for (int i = threadIdx.x; i < G * hd; i += blockDim.x) q[i / hd][i % hd] = qg[i] * scale;
    } else {
        /*
         * RoPE fused in (decode steps: one token per sequence, so no block
         * reads another token's new K/V): q of the group rotated here, and
         * the block whose split holds the token writes its K and V rows to
         * the pool before its warps read them (the barrier below). The
         * arithmetic is k_rope_store's, so the results are the same bits.
         */
        const float *row = qkv + (size_t) t * (qd + 2 * kd);
        int          half = hd / 2, kb = qd + kvh * hd;
        KV          *k_dst = (KV *) kvp + (size_t) table[pos / block_size] * block_elems
                             + (size_t) layer * layer_elems + (size_t) (pos % block_size) * kd
                             + (size_t) kvh * hd;

        for (int i = threadIdx.x; i < G * half; i += blockDim.x) {
            int   g = i / half, d = i % half, b = (kvh * G + g) * hd;
            float a = (float) pos * inv_freq[d], c = cosf(a), sn = sinf(a);
            float x1 = row[b + d], x2 = row[b + d + half];

            if (bias) {
                x1 += bias[b + d];
                x2 += bias[b + d + half];
            }
            q[g][d] = (x1 * c - x2 * sn) * scale;
            q[g][d + half] = (x2 * c + x1 * sn) * scale;
        }
        if (pos < end) {
            for (int d = threadIdx.x; d < half; d += blockDim.x) {
                float a = (float) pos * inv_freq[d], c = cosf(a), sn = sinf(a);
                float x1 = row[kb + d], x2 = row[kb + d + half];

                if (bias) {
                    x1 += bias[kb + d];
                    x2 += bias[kb + d + half];
                }
                k_dst[d] = from_f<KV>(x1 * c - x2 * sn);
                k_dst[d + half] = from_f<KV>(x2 * c + x1 * sn);
            }
            for (int d = threadIdx.x; d < hd; d += blockDim.x) {
                k_dst[layer_elems / 2 + d] = from_f<KV>(row[kb + kd + d]
                                                        + (bias ? bias[kb + kd + d] : 0.0f));
            }
        }
    }
#pragma unroll
    for (int g = 0; g < KVC_MAX_GROUP; g++) {
        mx[g] = -INFINITY;
        sum[g] = 0;
#pragma unroll
        for (int j = 0; j < KVC_NJ; j++) acc[g][j] = 0;
    }
    __syncthreads();
    for (int p = start + warp; p < end; p += KVC_ATT_WARPS) {
        const KV *k = kv + (size_t) table[p / block_size] * block_elems
                      + (size_t) layer * layer_elems + (size_t) (p % block_size) * kd
                      + (size_t) kvh * hd;

        kvc_group_step(q, k, k + layer_elems / 2, G, hd, lane, acc, mx, sum);
    }
    kvc_group_spill(w_max[warp], w_sum[warp], w_acc[warp], G, hd, lane, acc, mx, sum);
    __syncthreads();
    for (int i = threadIdx.x; i < G * hd; i += blockDim.x) {
        int    g = i / hd, d = i % hd;
        float  gmx = -INFINITY, total = 0, r = 0;
        float *o = part + (((size_t) t * heads + kvh * G + g) * nsplit + split) * (hd + 2);

        for (int w = 0; w < KVC_ATT_WARPS; w++) gmx = fmaxf(gmx, w_max[w][g]);
        for (int w = 0; w < KVC_ATT_WARPS; w++) {
            if (w_max[w][g] != -INFINITY) {
                float c = expf(w_max[w][g] - gmx);

                total += w_sum[w][g] * c;
                r += w_acc[w][g][d] * c;
            }
        }
        if (d == 0) {
            o[0] = gmx;
            o[1] = total;
        }
        o[2 + d] = r;
    }
}

/*
 * Split-K attention, pass 2: one thread block per (token, query head)
 * merges the token's pos / split_len + 1 splits by log-sum-exp: out =
 * sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M), M the largest m_s. Every
 * split it reads has at least one position, so every m_s is finite.
 */
template <class T>
__global__ void k_attn_merge(void *out, const float *part, kvc_meta m, int heads, int hd,
                             int split_len, int nsplit)
{
    int          t = blockIdx.x, h = blockIdx.y, n = m.pos[t] / split_len + 1;
    const float *pp = part + ((size_t) t * heads + h) * nsplit * (hd + 2);
    T           *o = (T *) out + (size_t) t * heads * hd + (size_t) h * hd;
    float        gmx = -INFINITY, total = 0;

    kvc_pdl_wait();
    kvc_pdl_trigger();
    for (int s = 0; s < n; s++) gmx = fmaxf(gmx, pp[(size_t) s * (hd + 2)]);
    for (int s = 0; s < n; s++) {
        total += pp[(size_t) s * (hd + 2) + 1] * expf(pp[(size_t) s * (hd + 2)] - gmx);
    }
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float r = 0;

        for (int s = 0; s < n; s++) {
            const float *ps = pp + (size_t) s * (hd + 2);

            r += ps[2 + d] * expf(ps[0] - gmx);
        }
        o[d] = from_f<T>(r / total);
    }
}

/*
 * Tensor-core prefill attention (prefill and chunked-prefill steps with f16
 * or bf16 weights; kvw_cuda.cu's use_tc() has the rule): flash-attention
 * tiles with QK^T and PV on the tensor cores through nvcuda::wmma (16x16x16,
 * T = __half or __nv_bfloat16 inputs, f32 accumulators; sm_80+). One warp
 * per thread block, one block per (tile of KVC_TC_TILE consecutive tokens
 * of the step, query head); GQA: head h reads KV head h / (heads /
 * kv_heads). Q (scaled) is staged in shared memory as T once; then, for
 * each tile of 16 key positions 0..last (last: the tile's largest
 * position), K and V are read from the paged pool through the block table,
 * converted to T (zero past last: unwritten pool rows may hold NaN), S =
 * Q K^T goes through the tensor cores to shared memory, one lane per row
 * applies the causal mask (key <= the row's position) and the online
 * softmax (running max and sum per row; P rounded to T), the f32 output
 * tile O in shared memory is rescaled by each row's correction and O += P V
 * goes through the tensor cores again. O / sum is written as T.
 *
 * The tokens of a tile may belong to several sequences (a step packs its
 * sequences one after another): the tile is walked once per run of rows
 * with the same block table, the other rows masked out of that run (no
 * update at all: correction 1, P 0). A row's result depends only on its own
 * query, position and sequence, never on the other rows of its tile.
 *
 * Shared memory (static, head_dim up to KVC_TC_MAX_HD = 256): Q, K, V as T
 * (8 KB each), O as f32 (16 KB), S and P: 41.5 KB. head_dim must be a
 * multiple of 16 (the wmma k step); other shapes take the fallback.
 */
#define KVC_TC_TILE   16
#define KVC_TC_MAX_HD 256

template <class T, class KV>
__global__ void k_attn_prefill_tc(void *out, const float *qkv, const void *kvp, kvc_meta m,
                                  int n_tokens, int heads, int kv_heads, int hd, int block_size,
                                  size_t block_elems, size_t layer_elems, int layer, float scale)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    __trap();                           /* no f16/bf16 wmma before sm_80: use_tc() never launches it */
#else
    using namespace nvcuda;
    const int TT = KVC_TC_TILE;
    __shared__ __align__(32) T     sq[KVC_TC_TILE * KVC_TC_MAX_HD];
    __shared__ __align__(32) T     sk[KVC_TC_TILE * KVC_TC_MAX_HD];
    __shared__ __align__(32) T     sv[KVC_TC_TILE * KVC_TC_MAX_HD];
    __shared__ __align__(32) float so[KVC_TC_TILE * KVC_TC_MAX_HD];
    __shared__ __align__(32) float ss[KVC_TC_TILE * KVC_TC_TILE];
    __shared__ __align__(32) T     sp[KVC_TC_TILE * KVC_TC_TILE];
    __shared__ float s_max[KVC_TC_TILE], s_sum[KVC_TC_TILE], s_corr[KVC_TC_TILE];
    __shared__ int   s_pos[KVC_TC_TILE], s_bt[KVC_TC_TILE];
    const KV *kv = (const KV *) kvp;
    int       t0 = blockIdx.x * TT, h = blockIdx.y, lane = threadIdx.x;
    int       qd = heads * hd, kd = kv_heads * hd, kvh = h / (heads / kv_heads);
    int       rows = n_tokens - t0 < TT ? n_tokens - t0 : TT;
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fk;  /* K^T: K rows are columns */
    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> fv;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float>          fc;

    if (lane < TT) {
        s_pos[lane] = lane < rows ? m.pos[t0 + lane] : -1;
        s_bt[lane] = lane < rows ? m.bt[t0 + lane] : -1;
        s_max[lane] = -INFINITY;
        s_sum[lane] = 0;
    }
    for (int i = lane; i < TT * hd; i += 32) {
        int r = i / hd, d = i % hd;

        sq[i] = from_f<T>(r < rows ? qkv[(size_t) (t0 + r) * (qd + 2 * kd) + (size_t) h * hd + d]
                                         * scale
                                   : 0.0f);
        so[i] = 0;
    }
    __syncwarp();
    for (int r0 = 0, r1; r0 < rows; r0 = r1) {      /* a run of rows of one sequence */
        int        bt = s_bt[r0], last = -1;
        const int *table = m.tables + bt;

        for (r1 = r0; r1 < rows && s_bt[r1] == bt; r1++) last = s_pos[r1] > last ? s_pos[r1] : last;
        for (int kb = 0; kb <= last; kb += TT) {
            for (int i = lane; i < TT * hd; i += 32) {
                int   j = i / hd, d = i % hd, p = kb + j;
                float kx = 0, vx = 0;

                if (p <= last) {
                    const KV *k = kv + (size_t) table[p / block_size] * block_elems
                                  + (size_t) layer * layer_elems + (size_t) (p % block_size) * kd
                                  + (size_t) kvh * hd;

                    kx = to_f(k[d]);
                    vx = to_f(k[layer_elems / 2 + d]);
                }
                sk[i] = from_f<T>(kx);
                sv[i] = from_f<T>(vx);
            }
            __syncwarp();
            wmma::fill_fragment(fc, 0.0f);
            for (int d0 = 0; d0 < hd; d0 += 16) {           /* S = Q K^T */
                wmma::load_matrix_sync(fa, sq + d0, hd);
                wmma::load_matrix_sync(fk, sk + d0, hd);
                wmma::mma_sync(fc, fa, fk, fc);
            }
            wmma::store_matrix_sync(ss, fc, TT, wmma::mem_row_major);
            __syncwarp();
            if (lane < TT) {                /* online softmax, one lane per row */
                int   r = lane, pos = s_pos[r], any = r >= r0 && r < r1 && kb <= pos;
                float mx = s_max[r], nmx = mx, corr = 1, sum = 0;

                if (any) {
                    for (int c = 0; c < TT && kb + c <= pos; c++) nmx = fmaxf(nmx, ss[r * TT + c]);
                    corr = expf(mx - nmx);  /* 0 on the row's first tile */
                }
                for (int c = 0; c < TT; c++) {
                    float e = any && kb + c <= pos ? expf(ss[r * TT + c] - nmx) : 0.0f;

                    sum += e;
                    sp[r * TT + c] = from_f<T>(e);
                }
                if (any) {
                    s_max[r] = nmx;
                    s_sum[r] = s_sum[r] * corr + sum;
                }
                s_corr[r] = corr;
            }
            __syncwarp();
            for (int i = lane; i < TT * hd; i += 32) so[i] *= s_corr[i / hd];
            __syncwarp();
            wmma::load_matrix_sync(fa, sp, TT);
            for (int d0 = 0; d0 < hd; d0 += 16) {           /* O += P V */
                wmma::load_matrix_sync(fc, so + d0, hd, wmma::mem_row_major);
                wmma::load_matrix_sync(fv, sv + d0, hd);
                wmma::mma_sync(fc, fa, fv, fc);
                wmma::store_matrix_sync(so + d0, fc, hd, wmma::mem_row_major);
            }
            __syncwarp();                   /* sk, sv, sp, so are written again next tile */
        }
    }
    for (int i = lane; i < rows * hd; i += 32) {
        int r = i / hd, d = i % hd;

        ((T *) out)[(size_t) (t0 + r) * qd + (size_t) h * hd + d] = from_f<T>(so[i] / s_sum[r]);
    }
#endif
}

/*
 * Sampling on the device, pass 1 (kvw_cuda_sample.h has pass 2, on the
 * host): one thread block per (logit row, chunk of KVC_SAMPLE_CHUNK
 * vocabulary entries). p = expf((logit - max) / temperature), exactly as
 * kvw_sample computes it (max from k_argmax's best[row]); the block writes
 * its chunk's sum of p (double) and its KVC_SAMPLE_CANDS largest p in
 * kvw_sample's order (p descending, then id ascending), found by that many
 * rounds of a block-wide arg-max over the chunk staged in shared memory:
 * no sort of the vocabulary, and 8 bytes back per candidate instead of the
 * row. Rounds past the chunk's length write p = -1, id = -1.
 */
#define KVC_SAMPLE_CHUNK 4096
#define KVC_SAMPLE_CANDS 32

static __device__ __forceinline__ int kvc_before(float p, int i, float q, int j)
{
    return p > q || (p == q && i < j);
}

__global__ void k_sample_cand(float *cand_p, int *cand_id, double *chunk_sum,
                              const float *logits, const int *best, const float *temp, int vocab)
{
    __shared__ float  sp[KVC_SAMPLE_CHUNK];
    __shared__ float  w_p[32];
    __shared__ int    w_i[32];
    __shared__ double w_s[32];
    int          r = blockIdx.x, c = blockIdx.y, nchunk = gridDim.y;
    int          lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int          base = c * KVC_SAMPLE_CHUNK;
    int          n = vocab - base < KVC_SAMPLE_CHUNK ? vocab - base : KVC_SAMPLE_CHUNK;
    const float *row = logits + (size_t) r * vocab;
    float        mx = row[best[r]], t = temp[r];
    double       sum = 0;
    size_t       out = ((size_t) r * nchunk + c) * KVC_SAMPLE_CANDS;

    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float p = expf((row[base + i] - mx) / t);

        sp[i] = p;
        sum += p;
    }
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) w_s[warp] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        double total = 0;

        for (int w = 0; w < nw; w++) total += w_s[w];
        chunk_sum[(size_t) r * nchunk + c] = total;
    }
    for (int k = 0; k < KVC_SAMPLE_CANDS; k++) {
        float bp = -1;
        int   bi = -1;

        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            if (sp[i] >= 0 && (bi < 0 || kvc_before(sp[i], i, bp, bi))) {   /* -1: taken */
                bp = sp[i];
                bi = i;
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            float op = __shfl_xor_sync(0xffffffffu, bp, o);
            int   oi = __shfl_xor_sync(0xffffffffu, bi, o);

            if (oi >= 0 && (bi < 0 || kvc_before(op, oi, bp, bi))) {
                bp = op;
                bi = oi;
            }
        }
        if (lane == 0) {
            w_p[warp] = bp;
            w_i[warp] = bi;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int w = 1; w < nw; w++) {
                if (w_i[w] >= 0 && (bi < 0 || kvc_before(w_p[w], w_i[w], bp, bi))) {
                    bp = w_p[w];
                    bi = w_i[w];
                }
            }
            cand_p[out + k] = bi >= 0 ? bp : -1.0f;
            cand_id[out + k] = bi >= 0 ? base + bi : -1;
            if (bi >= 0) sp[bi] = -1;
        }
        __syncthreads();                /* sp[] and w_*[] are read again next round */
    }
}

/*
 * Matrix-vector products for steps of a few tokens (the engine uses it
 * for batch-1 decode; gemm() says why): out[t][r] = in[t][:] . w[r][:]
 * (+ out[t][r] when add) for t < T_tokens <= KVC_GEMV_MAX_T, f32 out, in
 * and w of type T. A decode step reads every weight once for one token, so
 * it is bound by memory bandwidth, and cuBLAS's GEMM with a one-column
 * operand read the 1.2B model's matrices at 0.7-3.4 TB/s of the H200's 4.8
 * (tools/bench.d/gemv). One warp per weight row: each lane streams 16-byte
 * packs of the row, KVC_GEMV_UNROLL of them in flight before the first is
 * used, and dots each with the same pack of every token's input (a few KB,
 * read by every warp, so it stays in L1). Requires cols * sizeof(T) a
 * multiple of 16 and 16-byte aligned w and in (gemm() checks, else cuBLAS).
 * 8 warps a block and 4 packs in flight timed at or below 8 x 8 on each
 * of the model's matrices at one token, and within 0.5 us of the fastest
 * of six shapes (docs/CUDA.md).
 */
#define KVC_GEMV_MAX_T  4
#ifndef KVC_GEMV_WARPS                  /* -D: tools/bench.d/gemv.cu tries others */
#define KVC_GEMV_WARPS  8
#endif
#ifndef KVC_GEMV_UNROLL
#define KVC_GEMV_UNROLL 4
#endif

template <class T> struct alignas(16) kvc_pack {
    T v[16 / sizeof(T)];
};

/* The lane's first KVC_GEMV_UNROLL packs of a weight row, from pack base on. */
template <class T>
static __device__ __forceinline__ void kvc_gemv_load(kvc_pack<T> *wp, const kvc_pack<T> *wr,
                                                     int base, int np)
{
#pragma unroll
    for (int u = 0; u < KVC_GEMV_UNROLL; u++) {
        if (base + 32 * u < np) wp[u] = wr[base + 32 * u];
    }
}

/* acc[t] += the loaded packs . token t's input packs (x: np packs a token) */
template <class T>
static __device__ __forceinline__ void kvc_gemv_dot(float *acc, const kvc_pack<T> *wp,
                                                    const kvc_pack<T> *x, int base, int np,
                                                    int T_tokens)
{
    const int P = 16 / sizeof(T);

#pragma unroll
    for (int u = 0; u < KVC_GEMV_UNROLL; u++) {
        if (base + 32 * u >= np) break;
#pragma unroll
        for (int t = 0; t < KVC_GEMV_MAX_T; t++) {
            kvc_pack<T> xp;
            float       s = 0;

            if (t >= T_tokens) break;
            xp = x[(size_t) t * np + base + 32 * u];
#pragma unroll
            for (int j = 0; j < P; j++) s += to_f(wp[u].v[j]) * to_f(xp.v[j]);
            acc[t] += s;
        }
    }
}

/*
 * The row's dot products: acc[t] = w row . token t's input for t <
 * T_tokens, summed over the warp (every lane ends with the sums). The first packs were loaded before
 * the kernel's kvc_pdl_wait (weights only), so they are in flight while
 * the kernel before finishes.
 */
template <class T>
static __device__ __forceinline__ void kvc_gemv_row(float *acc, kvc_pack<T> *wp,
                                                    const kvc_pack<T> *wr, const kvc_pack<T> *x,
                                                    int np, int T_tokens, int lane)
{
#pragma unroll
    for (int t = 0; t < KVC_GEMV_MAX_T; t++) acc[t] = 0;
    for (int base = lane; base < np; base += 32 * KVC_GEMV_UNROLL) {
        if (base != lane) kvc_gemv_load(wp, wr, base, np);
        kvc_gemv_dot(acc, wp, x, base, np, T_tokens);
    }
#pragma unroll
    for (int t = 0; t < KVC_GEMV_MAX_T; t++) {
        if (t >= T_tokens) break;       /* only the step's tokens: no shuffles for idle slots */
        for (int o = 16; o > 0; o >>= 1) acc[t] += __shfl_xor_sync(0xffffffffu, acc[t], o);
    }
}

template <class T>
__global__ void k_gemv(float *out, const void *in, const void *w, int T_tokens, int rows,
                       int cols, int add)
{
    const int           np = cols / (16 / (int) sizeof(T));
    int                 lane = threadIdx.x & 31;
    int                 r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const kvc_pack<T>  *wr = (const kvc_pack<T> *) w + (size_t) r * np;
    kvc_pack<T>         wp[KVC_GEMV_UNROLL];
    float               acc[KVC_GEMV_MAX_T];

    if (r >= rows) return;              /* the whole warp: one row per warp */
    kvc_gemv_load(wp, wr, lane, np);
    kvc_pdl_wait();                     /* in (and out, when adding): the kernel before */
    kvc_pdl_trigger();
    kvc_gemv_row(acc, wp, wr, (const kvc_pack<T> *) in, np, T_tokens, lane);
    if (lane != 0) return;
#pragma unroll
    for (int t = 0; t < KVC_GEMV_MAX_T; t++) {
        float *o = out + (size_t) t * rows + r;

        if (t >= T_tokens) break;
        *o = add ? *o + acc[t] : acc[t];
    }
}

/*
 * k_gemv for one token with the RMSNorm in front of it (batch-1 decode:
 * the attention and MLP norms before q|k|v and gate|up, the final norm
 * before lm_head), so the norm's own launch and act's round trip go. Each
 * block norms the token's row of x (cols floats, x + *xrow * cols when
 * xrow is set) into shared memory as T, with k_rmsnorm's arithmetic in the
 * same order (blockDim 256 both), so the products read the same bits; then
 * its warps take rows gridDim.x * warps apart, so a grid sized to the GPU
 * (a few blocks an SM) norms once a block, not once every 8 rows.
 * GLU (gate|up): warp r dots gate row r and up row rows + r and writes
 * act[r] = silu(gate) * up as T, k_swiglu's arithmetic, instead of out.
 * cols * sizeof(T) at most KVC_GEMV_SMEM.
 */
#define KVC_GEMV_SMEM 32768

template <class T, int GLU>
static __device__ __forceinline__ void kvc_gemv_norm(float *out, void *act, const float *x,
                                                     const int *xrow, const float *nw,
                                                     const void *w, int rows, int cols,
                                                     float eps)
{
    __shared__ kvc_pack<T> xs[KVC_GEMV_SMEM / 16];
    const int           np = cols / (16 / (int) sizeof(T)), warps = blockDim.x >> 5;
    int                 lane = threadIdx.x & 31;
    int                 r0 = blockIdx.x * warps + (threadIdx.x >> 5);
    const kvc_pack<T>  *wk = (const kvc_pack<T> *) w;
    const float        *in;
    kvc_pack<T>         wp[KVC_GEMV_UNROLL], up[KVC_GEMV_UNROLL];
    float               acc[KVC_GEMV_MAX_T], accu[KVC_GEMV_MAX_T], ss = 0, inv;
    T                  *xt = (T *) xs;

    if (r0 < rows) {
        kvc_gemv_load(wp, wk + (size_t) r0 * np, lane, np);
        if (GLU) kvc_gemv_load(up, wk + (size_t) (rows + r0) * np, lane, np);
    }
    kvc_pdl_wait();                     /* x: the residual add just before */
    kvc_pdl_trigger();
    in = x + (size_t) (xrow ? xrow[0] : 0) * cols;
    /* every thread, the idle warps of the last block too: block_sum has barriers */
    for (int i = threadIdx.x; i < cols; i += blockDim.x) ss += in[i] * in[i];
    ss = block_sum(ss);
    inv = rsqrtf(ss / (float) cols + eps);
    for (int i = threadIdx.x; i < cols; i += blockDim.x) xt[i] = from_f<T>(in[i] * inv * nw[i]);
    __syncthreads();
    for (int r = r0; r < rows; r += gridDim.x * warps) {
        const kvc_pack<T> *wr = wk + (size_t) r * np, *wu = wk + (size_t) (rows + r) * np;

        if (r != r0) {
            kvc_gemv_load(wp, wr, lane, np);
            if (GLU) kvc_gemv_load(up, wu, lane, np);
        }
        kvc_gemv_row(acc, wp, wr, xs, np, 1, lane);
        if (GLU) kvc_gemv_row(accu, up, wu, xs, np, 1, lane);
        if (lane != 0) continue;
        if (GLU) ((T *) act)[r] = from_f<T>(acc[0] / (1.0f + expf(-acc[0])) * accu[0]);
        else out[r] = acc[0];
    }
}

template <class T>
__global__ void k_gemv_norm(float *out, const float *x, const int *xrow, const float *nw,
                            const void *w, int rows, int cols, float eps)
{
    kvc_gemv_norm<T, 0>(out, NULL, x, xrow, nw, w, rows, cols, eps);
}

/* gate|up: rows is the intermediate size (the matrix has 2 * rows) */
template <class T>
__global__ void k_gemv_glu(void *act, const float *x, const float *nw, const void *w, int rows,
                           int cols, float eps)
{
    kvc_gemv_norm<T, 1>(NULL, act, x, NULL, nw, w, rows, cols, eps);
}

/* act[t][i] = silu(gate) * up, from the fused gate|up matmul (rows of 2 * inter). */
template <class T>
__global__ void k_swiglu(void *act, const float *gu, size_t T_tokens, int inter)
{
    size_t n = T_tokens * (size_t) inter;

    for (size_t i = blockIdx.x * (size_t) blockDim.x + threadIdx.x; i < n;
         i += (size_t) gridDim.x * blockDim.x) {
        size_t t = i / inter, c = i % inter;
        float  g = gu[t * 2 * inter + c], u = gu[t * 2 * inter + inter + c];

        ((T *) act)[i] = from_f<T>(g / (1.0f + expf(-g)) * u);
    }
}

#endif
