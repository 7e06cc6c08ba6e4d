/*
 * Kernels of the cuda engine, all f32: embedding gather, RMSNorm, bias add,
 * RoPE fused with the KV-cache store, paged attention over block tables
 * (prefill chunks and decode alike, GQA), SwiGLU, residual add and argmax.
 * Matmuls are cuBLAS (kvw_cuda.cu).
 */
#ifndef KVW_CUDA_KERNELS_CUH
#define KVW_CUDA_KERNELS_CUH

#include <stdint.h>

/* Where one token of the step sits: its position and its sequence's block table. */
struct kvw_cuda_tok {
    uint32_t pos;
    uint32_t bt_off;    /* offset of the sequence's block table in the step's table array */
};

/* The pool layout of kvw_backend.h: [block][layer][K|V][block_size][kv_heads][head_dim]. */
struct kvw_cuda_kv {
    float   *pool;
    uint32_t layers, block_size, kv_heads, head_dim;
};

__device__ inline float *kvw_kv_at(const kvw_cuda_kv &kv, uint32_t block, uint32_t layer,
                                   int is_v, uint32_t slot, uint32_t kvh)
{
    size_t off = (((size_t)block * kv.layers + layer) * 2 + (size_t)is_v) * kv.block_size + slot;
    return kv.pool + (off * kv.kv_heads + kvh) * kv.head_dim;
}

void kvw_cuda_embed(float *x, const float *embed, const uint32_t *tokens, uint32_t T, uint32_t hidden,
                    cudaStream_t s);
void kvw_cuda_rmsnorm(float *out, const float *x, const float *w, uint32_t rows, uint32_t n, float eps,
                      cudaStream_t s);
void kvw_cuda_bias(float *x, const float *bias, uint32_t rows, uint32_t n, cudaStream_t s);
void kvw_cuda_rope_store(float *q, const float *k, const float *v, const kvw_cuda_tok *toks,
                         const uint32_t *tables, const float *inv_freq, kvw_cuda_kv kv, uint32_t layer,
                         uint32_t T, uint32_t heads, cudaStream_t s);
void kvw_cuda_attention(float *out, const float *q, const kvw_cuda_tok *toks, const uint32_t *tables,
                        kvw_cuda_kv kv, uint32_t layer, uint32_t T, uint32_t heads, cudaStream_t s);
void kvw_cuda_swiglu(float *g, const float *u, size_t n, cudaStream_t s);
void kvw_cuda_add(float *x, const float *y, size_t n, cudaStream_t s);
void kvw_cuda_gather_rows(float *out, const float *x, const uint32_t *rows, uint32_t n, uint32_t width,
                          cudaStream_t s);
void kvw_cuda_argmax(uint32_t *out, const float *logits, uint32_t rows, uint32_t vocab, cudaStream_t s);

#define KVW_CUDA_MAX_HEAD_DIM 256

#endif
