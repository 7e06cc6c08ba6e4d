/*
 * The cuda engine's kernels. Attention gives one warp to each (token,
 * head): lanes split the head dimension, the warp walks the token's
 * positions [0, pos] through its block table with an online softmax, so no
 * score buffer is needed whatever the context length.
 */
#include <cuda_runtime.h>
#include <math.h>

#include "kvw_cuda_kernels.cuh"

__global__ void embed_k(float *x, const float *embed, const uint32_t *tokens, uint32_t hidden)
{
    const float *row = embed + (size_t)tokens[blockIdx.x] * hidden;
    for (uint32_t i = threadIdx.x; i < hidden; i += blockDim.x)
        x[(size_t)blockIdx.x * hidden + i] = row[i];
}

void kvw_cuda_embed(float *x, const float *embed, const uint32_t *tokens, uint32_t T, uint32_t hidden,
                    cudaStream_t s)
{
    embed_k<<<T, 256, 0, s>>>(x, embed, tokens, hidden);
}

__device__ float block_sum(float v)
{
    __shared__ float part[32];
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0)
        part[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        v = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : 0.0f;
        for (int o = 16; o > 0; o >>= 1)
            v += __shfl_xor_sync(0xffffffffu, v, o);
        if (threadIdx.x == 0)
            part[0] = v;
    }
    __syncthreads();
    return part[0];
}

__global__ void rmsnorm_k(float *out, const float *x, const float *w, uint32_t n, float eps)
{
    const float *xr = x + (size_t)blockIdx.x * n;
    float ss = 0;
    for (uint32_t i = threadIdx.x; i < n; i += blockDim.x)
        ss += xr[i] * xr[i];
    float r = rsqrtf(block_sum(ss) / (float)n + eps);
    for (uint32_t i = threadIdx.x; i < n; i += blockDim.x)
        out[(size_t)blockIdx.x * n + i] = xr[i] * r * w[i];
}

void kvw_cuda_rmsnorm(float *out, const float *x, const float *w, uint32_t rows, uint32_t n, float eps,
                      cudaStream_t s)
{
    rmsnorm_k<<<rows, 256, 0, s>>>(out, x, w, n, eps);
}

__global__ void bias_k(float *x, const float *bias, size_t total, uint32_t n)
{
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < total)
        x[i] += bias[i % n];
}

void kvw_cuda_bias(float *x, const float *bias, uint32_t rows, uint32_t n, cudaStream_t s)
{
    size_t total = (size_t)rows * n;
    bias_k<<<(unsigned)((total + 255) / 256), 256, 0, s>>>(x, bias, total, n);
}

/* One block per token: rotate q in place, rotate k into the cache, copy v into the cache. */
__global__ void rope_store_k(float *q, const float *k, const float *v, const kvw_cuda_tok *toks,
                             const uint32_t *tables, const float *inv_freq, kvw_cuda_kv kv,
                             uint32_t layer, uint32_t heads)
{
    uint32_t t = blockIdx.x, hd = kv.head_dim, half = hd / 2;
    kvw_cuda_tok tk = toks[t];
    uint32_t block = tables[tk.bt_off + tk.pos / kv.block_size], slot = tk.pos % kv.block_size;
    size_t qd = (size_t)heads * hd, kd = (size_t)kv.kv_heads * hd;
    for (uint32_t i = threadIdx.x; i < (heads + kv.kv_heads) * half; i += blockDim.x) {
        uint32_t h = i / half, d = i % half;
        float a = (float)tk.pos * inv_freq[d], c = cosf(a), sn = sinf(a);
        if (h < heads) {
            float *qh = q + t * qd + (size_t)h * hd;
            float x1 = qh[d], x2 = qh[d + half];
            qh[d] = x1 * c - x2 * sn;
            qh[d + half] = x2 * c + x1 * sn;
        } else {
            uint32_t kh = h - heads;
            const float *src = k + t * kd + (size_t)kh * hd;
            float *dst = kvw_kv_at(kv, block, layer, 0, slot, kh);
            float x1 = src[d], x2 = src[d + half];
            dst[d] = x1 * c - x2 * sn;
            dst[d + half] = x2 * c + x1 * sn;
        }
    }
    for (uint32_t i = threadIdx.x; i < kd; i += blockDim.x)
        kvw_kv_at(kv, block, layer, 1, slot, i / hd)[i % hd] = v[t * kd + i];
}

void kvw_cuda_rope_store(float *q, const float *k, const float *v, const kvw_cuda_tok *toks,
                         const uint32_t *tables, const float *inv_freq, kvw_cuda_kv kv, uint32_t layer,
                         uint32_t T, uint32_t heads, cudaStream_t s)
{
    rope_store_k<<<T, 128, 0, s>>>(q, k, v, toks, tables, inv_freq, kv, layer, heads);
}

enum { WARPS = 4, PER_LANE = KVW_CUDA_MAX_HEAD_DIM / 32 };

__global__ void attention_k(float *out, const float *q, const kvw_cuda_tok *toks, const uint32_t *tables,
                            kvw_cuda_kv kv, uint32_t layer, uint32_t T, uint32_t heads)
{
    uint32_t warp = blockIdx.x * WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (warp >= T * heads)
        return;
    uint32_t t = warp / heads, h = warp % heads, hd = kv.head_dim;
    uint32_t kvh = h / (heads / kv.kv_heads);
    kvw_cuda_tok tk = toks[t];
    const float *qh = q + ((size_t)t * heads + h) * hd;
    float qv[PER_LANE], acc[PER_LANE];
    for (int i = 0; i < PER_LANE; i++) {
        uint32_t d = lane + 32 * i;
        qv[i] = d < hd ? qh[d] : 0.0f;
        acc[i] = 0.0f;
    }
    float scale = rsqrtf((float)hd), mx = -INFINITY, sum = 0.0f;
    for (uint32_t p = 0; p <= tk.pos; p++) {
        uint32_t block = tables[tk.bt_off + p / kv.block_size], slot = p % kv.block_size;
        const float *kp = kvw_kv_at(kv, block, layer, 0, slot, kvh);
        const float *vp = kvw_kv_at(kv, block, layer, 1, slot, kvh);
        float s = 0.0f;
        for (int i = 0; i < PER_LANE; i++) {
            uint32_t d = lane + 32 * i;
            if (d < hd)
                s += qv[i] * kp[d];
        }
        for (int o = 16; o > 0; o >>= 1)
            s += __shfl_xor_sync(0xffffffffu, s, o);
        s *= scale;
        float nmx = fmaxf(mx, s), corr = expf(mx - nmx), w = expf(s - nmx);
        sum = sum * corr + w;
        for (int i = 0; i < PER_LANE; i++) {
            uint32_t d = lane + 32 * i;
            acc[i] = acc[i] * corr + (d < hd ? w * vp[d] : 0.0f);
        }
        mx = nmx;
    }
    float *oh = out + ((size_t)t * heads + h) * hd;
    for (int i = 0; i < PER_LANE; i++) {
        uint32_t d = lane + 32 * i;
        if (d < hd)
            oh[d] = acc[i] / sum;
    }
}

void kvw_cuda_attention(float *out, const float *q, const kvw_cuda_tok *toks, const uint32_t *tables,
                        kvw_cuda_kv kv, uint32_t layer, uint32_t T, uint32_t heads, cudaStream_t s)
{
    uint32_t warps = T * heads;
    attention_k<<<(warps + WARPS - 1) / WARPS, WARPS * 32, 0, s>>>(out, q, toks, tables, kv, layer, T, heads);
}

__global__ void swiglu_k(float *g, const float *u, size_t n)
{
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

void kvw_cuda_swiglu(float *g, const float *u, size_t n, cudaStream_t s)
{
    swiglu_k<<<(unsigned)((n + 255) / 256), 256, 0, s>>>(g, u, n);
}

__global__ void add_k(float *x, const float *y, size_t n)
{
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        x[i] += y[i];
}

void kvw_cuda_add(float *x, const float *y, size_t n, cudaStream_t s)
{
    add_k<<<(unsigned)((n + 255) / 256), 256, 0, s>>>(x, y, n);
}

__global__ void gather_k(float *out, const float *x, const uint32_t *rows, uint32_t width)
{
    const float *src = x + (size_t)rows[blockIdx.x] * width;
    for (uint32_t i = threadIdx.x; i < width; i += blockDim.x)
        out[(size_t)blockIdx.x * width + i] = src[i];
}

void kvw_cuda_gather_rows(float *out, const float *x, const uint32_t *rows, uint32_t n, uint32_t width,
                          cudaStream_t s)
{
    gather_k<<<n, 256, 0, s>>>(out, x, rows, width);
}

/* One block per row; ties go to the lowest id, as on the host. */
__global__ void argmax_k(uint32_t *out, const float *logits, uint32_t vocab)
{
    __shared__ float bv[256];
    __shared__ uint32_t bi[256];
    const float *row = logits + (size_t)blockIdx.x * vocab;
    float best = -INFINITY;
    uint32_t id = 0;
    for (uint32_t i = threadIdx.x; i < vocab; i += blockDim.x)
        if (row[i] > best) {
            best = row[i];
            id = i;
        }
    bv[threadIdx.x] = best;
    bi[threadIdx.x] = id;
    __syncthreads();
    for (uint32_t s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            float ov = bv[threadIdx.x + s];
            uint32_t oi = bi[threadIdx.x + s];
            if (ov > bv[threadIdx.x] || (ov == bv[threadIdx.x] && oi < bi[threadIdx.x])) {
                bv[threadIdx.x] = ov;
                bi[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0)
        out[blockIdx.x] = bi[0];
}

void kvw_cuda_argmax(uint32_t *out, const float *logits, uint32_t rows, uint32_t vocab, cudaStream_t s)
{
    argmax_k<<<rows, 256, 0, s>>>(out, logits, vocab);
}
