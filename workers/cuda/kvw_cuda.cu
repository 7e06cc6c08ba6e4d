/*
 * The cuda engine: the same forward pass as kvw_cpu.c on one NVIDIA GPU.
 * Weights are loaded on the host by kvw_model.c (f32) and uploaded once;
 * the KV pool is one cudaMalloc in the layout of kvw_backend.h, so one
 * block of all layers is one contiguous range (block_read/block_write are
 * one copy each, and the pool can be exported whole with CUDA IPC).
 * Every token of a step goes through each cuBLAS matmul together.
 */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <vector>

extern "C" {
#include "kvw_backend.h"
#include "kvw_model.h"
#include "kvw_sample.h"
}

#include "kvw_cuda_kernels.cuh"

namespace {

struct dev_layer {
    float *attn_norm, *wq, *wk, *wv, *wo, *bq, *bk, *bv, *mlp_norm, *w_gate, *w_up, *w_down;
};

struct cuda_engine {
    kvw_backend_t b;            /* first: the backend pointer is the engine pointer */
    uint32_t      vocab, hidden, layers, heads, kv_heads, head_dim, inter;
    float         rms_eps;
    int           tied;
    dev_layer    *L;
    float        *embed, *norm, *lm_head, *inv_freq;
    kvw_cuda_kv   kv;
    cublasHandle_t blas;
    cudaStream_t  stream;
    /* per-step buffers, grown as needed */
    size_t        cap_tok, cap_tab, cap_rows;
    float        *x, *xn, *q, *k, *v, *att, *o, *g, *u;
    kvw_cuda_tok *toks;
    uint32_t     *tokens, *tables, *rows, *argmax;
    float        *last, *logits;
    std::vector<float> host_logits;
};

#define CK(call)                                                                      \
    do {                                                                              \
        cudaError_t e_ = (call);                                                      \
        if (e_ != cudaSuccess) {                                                      \
            fprintf(stderr, "cuda engine: %s: %s\n", #call, cudaGetErrorString(e_));  \
            return -1;                                                                \
        }                                                                             \
    } while (0)

int upload(float **dst, const float *src, size_t n)
{
    *dst = NULL;
    if (src == NULL)
        return 0;
    CK(cudaMalloc((void **)dst, n * sizeof(float)));
    CK(cudaMemcpy(*dst, src, n * sizeof(float), cudaMemcpyHostToDevice));
    return 0;
}

int upload_model(cuda_engine *e, const kvw_model_t *m)
{
    size_t H = m->hidden, qd = (size_t)m->heads * m->head_dim, kd = (size_t)m->kv_heads * m->head_dim;
    size_t I = m->inter, VH = (size_t)m->vocab * H;
    e->L = (dev_layer *)calloc(m->layers, sizeof(dev_layer));
    if (e->L == NULL)
        return -1;
    if (upload(&e->embed, m->embed, VH) || upload(&e->norm, m->norm, H) ||
        upload(&e->inv_freq, m->inv_freq, m->head_dim / 2))
        return -1;
    if (m->lm_head == m->embed)
        e->lm_head = e->embed;
    else if (upload(&e->lm_head, m->lm_head, VH))
        return -1;
    for (uint32_t l = 0; l < m->layers; l++) {
        const kvw_layer_t *s = &m->L[l];
        dev_layer *d = &e->L[l];
        if (upload(&d->attn_norm, s->attn_norm, H) || upload(&d->wq, s->wq, qd * H) ||
            upload(&d->wk, s->wk, kd * H) || upload(&d->wv, s->wv, kd * H) ||
            upload(&d->wo, s->wo, H * qd) || upload(&d->bq, s->bq, qd) || upload(&d->bk, s->bk, kd) ||
            upload(&d->bv, s->bv, kd) || upload(&d->mlp_norm, s->mlp_norm, H) ||
            upload(&d->w_gate, s->w_gate, I * H) || upload(&d->w_up, s->w_up, I * H) ||
            upload(&d->w_down, s->w_down, H * I))
            return -1;
    }
    return 0;
}

template <typename T> int regrow(T **p, size_t n)
{
    if (*p != NULL)
        cudaFree(*p);
    *p = NULL;
    CK(cudaMalloc((void **)p, (n ? n : 1) * sizeof(T)));
    return 0;
}

int ensure(cuda_engine *e, size_t T, size_t tab, size_t rows)
{
    size_t H = e->hidden, qd = (size_t)e->heads * e->head_dim, kd = (size_t)e->kv_heads * e->head_dim;
    if (T > e->cap_tok) {
        if (regrow(&e->x, T * H) || regrow(&e->xn, T * H) || regrow(&e->q, T * qd) ||
            regrow(&e->k, T * kd) || regrow(&e->v, T * kd) || regrow(&e->att, T * qd) ||
            regrow(&e->o, T * H) || regrow(&e->g, T * e->inter) || regrow(&e->u, T * e->inter) ||
            regrow(&e->toks, T) || regrow(&e->tokens, T))
            return -1;
        e->cap_tok = T;
    }
    if (tab > e->cap_tab) {
        if (regrow(&e->tables, tab))
            return -1;
        e->cap_tab = tab;
    }
    if (rows > e->cap_rows) {
        if (regrow(&e->rows, rows) || regrow(&e->argmax, rows) || regrow(&e->last, rows * H) ||
            regrow(&e->logits, rows * (size_t)e->vocab))
            return -1;
        e->cap_rows = rows;
    }
    return 0;
}

/* out[T][o] = in[T][k] . W[o][k]^T: row-major W is column-major k x o, so C = W^T X. */
int gemm(cuda_engine *e, float *out, const float *in, const float *w, uint32_t T, uint32_t o, uint32_t k)
{
    const float one = 1.0f, zero = 0.0f;
    cublasStatus_t st = cublasSgemm(e->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)o, (int)T, (int)k, &one, w,
                                    (int)k, in, (int)k, &zero, out, (int)o);
    if (st != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "cuda engine: cublasSgemm failed (%d)\n", (int)st);
        return -1;
    }
    return 0;
}

int layer_forward(cuda_engine *e, uint32_t l, uint32_t T)
{
    const dev_layer *d = &e->L[l];
    uint32_t H = e->hidden, qd = e->heads * e->head_dim, kd = e->kv_heads * e->head_dim;
    cudaStream_t s = e->stream;
    kvw_cuda_rmsnorm(e->xn, e->x, d->attn_norm, T, H, e->rms_eps, s);
    if (gemm(e, e->q, e->xn, d->wq, T, qd, H) || gemm(e, e->k, e->xn, d->wk, T, kd, H) ||
        gemm(e, e->v, e->xn, d->wv, T, kd, H))
        return -1;
    if (d->bq != NULL) {
        kvw_cuda_bias(e->q, d->bq, T, qd, s);
        kvw_cuda_bias(e->k, d->bk, T, kd, s);
        kvw_cuda_bias(e->v, d->bv, T, kd, s);
    }
    kvw_cuda_rope_store(e->q, e->k, e->v, e->toks, e->tables, e->inv_freq, e->kv, l, T, e->heads, s);
    kvw_cuda_attention(e->att, e->q, e->toks, e->tables, e->kv, l, T, e->heads, s);
    if (gemm(e, e->o, e->att, d->wo, T, H, qd))
        return -1;
    kvw_cuda_add(e->x, e->o, (size_t)T * H, s);
    kvw_cuda_rmsnorm(e->xn, e->x, d->mlp_norm, T, H, e->rms_eps, s);
    if (gemm(e, e->g, e->xn, d->w_gate, T, e->inter, H) || gemm(e, e->u, e->xn, d->w_up, T, e->inter, H))
        return -1;
    kvw_cuda_swiglu(e->g, e->u, (size_t)T * e->inter, s);
    if (gemm(e, e->o, e->g, d->w_down, T, H, e->inter))
        return -1;
    kvw_cuda_add(e->x, e->o, (size_t)T * H, s);
    return 0;
}

/* Lays out the step for the device: tokens, per-token (pos, table offset), block tables. */
int stage(cuda_engine *e, const kvw_step_seq_t *seqs, uint32_t n, uint32_t *T_out,
          std::vector<uint32_t> &want)
{
    std::vector<uint32_t> tokens, tables;
    std::vector<kvw_cuda_tok> toks;
    uint32_t bs = e->b.block_size;
    for (uint32_t s = 0; s < n; s++) {
        const kvw_step_seq_t *sq = &seqs[s];
        if (sq->n_tokens == 0 || (uint64_t)sq->pos + sq->n_tokens > (uint64_t)sq->n_blocks * bs)
            return -1;
        uint32_t off = (uint32_t)tables.size();
        for (uint32_t i = 0; i < sq->n_blocks; i++) {
            if (sq->block_table[i] >= e->b.num_blocks)
                return -1;      /* a bad id would write outside the pool */
            tables.push_back(sq->block_table[i]);
        }
        for (uint32_t j = 0; j < sq->n_tokens; j++) {
            tokens.push_back(sq->tokens[j] < e->vocab ? sq->tokens[j] : 0);
            toks.push_back(kvw_cuda_tok{ sq->pos + j, off });
        }
        if (sq->sample || sq->logits)
            want.push_back((uint32_t)toks.size() - 1);
    }
    uint32_t T = (uint32_t)toks.size();
    if (ensure(e, T, tables.size(), want.size()))
        return -1;
    CK(cudaMemcpyAsync(e->tokens, tokens.data(), T * sizeof(uint32_t), cudaMemcpyHostToDevice, e->stream));
    CK(cudaMemcpyAsync(e->toks, toks.data(), T * sizeof(kvw_cuda_tok), cudaMemcpyHostToDevice, e->stream));
    CK(cudaMemcpyAsync(e->tables, tables.data(), tables.size() * sizeof(uint32_t), cudaMemcpyHostToDevice,
                       e->stream));
    if (!want.empty())
        CK(cudaMemcpyAsync(e->rows, want.data(), want.size() * sizeof(uint32_t), cudaMemcpyHostToDevice,
                           e->stream));
    /* the vectors die at return: wait until the copies have read them */
    CK(cudaStreamSynchronize(e->stream));
    *T_out = T;
    return 0;
}

/* Final norm and lm_head for the rows that want logits; greedy picks on the device. */
int finish(cuda_engine *e, kvw_step_seq_t *seqs, uint32_t n, const std::vector<uint32_t> &want)
{
    uint32_t R = (uint32_t)want.size(), V = e->vocab;
    if (R == 0)
        return 0;
    kvw_cuda_gather_rows(e->last, e->x, e->rows, R, e->hidden, e->stream);
    kvw_cuda_rmsnorm(e->last, e->last, e->norm, R, e->hidden, e->rms_eps, e->stream);
    if (gemm(e, e->logits, e->last, e->lm_head, R, V, e->hidden))
        return -1;
    kvw_cuda_argmax(e->argmax, e->logits, R, V, e->stream);
    std::vector<uint32_t> picks(R);
    CK(cudaMemcpyAsync(picks.data(), e->argmax, R * sizeof(uint32_t), cudaMemcpyDeviceToHost, e->stream));
    CK(cudaStreamSynchronize(e->stream));
    uint32_t r = 0;
    for (uint32_t s = 0; s < n; s++) {
        kvw_step_seq_t *sq = &seqs[s];
        if (!sq->sample && !sq->logits)
            continue;
        int greedy = !(sq->sampling.temperature > 0) || sq->sampling.top_k == 1;
        /* logits come back only when asked for or when sampling needs them */
        if (sq->logits || (sq->sample && !greedy)) {
            e->host_logits.resize(V);
            CK(cudaMemcpy(e->host_logits.data(), e->logits + (size_t)r * V, V * sizeof(float),
                          cudaMemcpyDeviceToHost));
            if (sq->logits)
                memcpy(sq->logits, e->host_logits.data(), V * sizeof(float));
        }
        if (sq->sample)
            sq->next_token = greedy ? picks[r] : kvw_sample(e->host_logits.data(), V, &sq->sampling);
        r++;
    }
    return 0;
}

int cuda_step(kvw_backend_t *b, kvw_step_seq_t *seqs, uint32_t n, double *step_ms)
{
    cuda_engine *e = (cuda_engine *)b;
    struct timespec t0, t1;
    uint32_t T = 0;
    std::vector<uint32_t> want;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    if (step_ms)
        *step_ms = 0;
    if (n == 0)
        return 0;
    if (stage(e, seqs, n, &T, want))
        return -1;
    kvw_cuda_embed(e->x, e->embed, e->tokens, T, e->hidden, e->stream);
    for (uint32_t l = 0; l < e->layers; l++)
        if (layer_forward(e, l, T))
            return -1;
    if (finish(e, seqs, n, want))
        return -1;
    CK(cudaStreamSynchronize(e->stream));
    CK(cudaGetLastError());
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (step_ms)
        *step_ms = (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e6;
    return 0;
}

int cuda_block_read(kvw_backend_t *b, uint32_t block, void *dst)
{
    cuda_engine *e = (cuda_engine *)b;
    if (block >= b->num_blocks)
        return -1;
    CK(cudaMemcpy(dst, (char *)e->kv.pool + (size_t)block * b->block_bytes, b->block_bytes,
                  cudaMemcpyDeviceToHost));
    return 0;
}

int cuda_block_write(kvw_backend_t *b, uint32_t block, const void *src)
{
    cuda_engine *e = (cuda_engine *)b;
    if (block >= b->num_blocks)
        return -1;
    CK(cudaMemcpy((char *)e->kv.pool + (size_t)block * b->block_bytes, src, b->block_bytes,
                  cudaMemcpyHostToDevice));
    return 0;
}

void cuda_destroy(kvw_backend_t *b)
{
    cuda_engine *e = (cuda_engine *)b;
    if (e == NULL)
        return;
    if (e->L != NULL) {
        for (uint32_t l = 0; l < e->layers; l++) {
            dev_layer *d = &e->L[l];
            float *all[] = { d->attn_norm, d->wq, d->wk, d->wv, d->wo, d->bq, d->bk, d->bv,
                             d->mlp_norm, d->w_gate, d->w_up, d->w_down };
            for (float *p : all)
                cudaFree(p);
        }
        free(e->L);
    }
    if (e->lm_head != e->embed)
        cudaFree(e->lm_head);
    void *bufs[] = { e->embed, e->norm, e->inv_freq, e->kv.pool, e->x, e->xn, e->q, e->k, e->v,
                     e->att, e->o, e->g, e->u, e->toks, e->tokens, e->tables, e->rows, e->argmax,
                     e->last, e->logits };
    for (void *p : bufs)
        cudaFree(p);
    if (e->blas)
        cublasDestroy(e->blas);
    if (e->stream)
        cudaStreamDestroy(e->stream);
    delete e;
}

/* KV pool: the configured block count, or half the memory left after the weights. */
int alloc_pool(cuda_engine *e, const kvw_backend_config_t *cfg, char *err, size_t errlen)
{
    kvw_backend_t *b = &e->b;
    b->block_bytes = (size_t)e->layers * 2 * b->block_size * e->kv_heads * e->head_dim * sizeof(float);
    if (cfg->num_blocks) {
        b->num_blocks = cfg->num_blocks;
    } else {
        size_t free_b = 0, total_b = 0;
        cudaMemGetInfo(&free_b, &total_b);
        size_t nb = free_b / 2 / b->block_bytes;
        b->num_blocks = (uint32_t)(nb > (1u << 20) ? (1u << 20) : nb);
    }
    if (b->num_blocks == 0 ||
        cudaMalloc((void **)&e->kv.pool, (size_t)b->num_blocks * b->block_bytes) != cudaSuccess) {
        snprintf(err, errlen, "cuda engine: cannot allocate a KV pool of %u blocks of %zu bytes",
                 b->num_blocks, b->block_bytes);
        return -1;
    }
    cudaMemset(e->kv.pool, 0, (size_t)b->num_blocks * b->block_bytes);
    e->kv.layers = e->layers;
    e->kv.block_size = b->block_size;
    e->kv.kv_heads = e->kv_heads;
    e->kv.head_dim = e->head_dim;
    return 0;
}

int init(cuda_engine *e, const kvw_backend_config_t *cfg, char *err, size_t errlen)
{
    kvw_model_t m;
    if (kvw_model_load(cfg->model_dir, &m, err, errlen) != 0)
        return -1;
    e->vocab = m.vocab; e->hidden = m.hidden; e->layers = m.layers; e->heads = m.heads;
    e->kv_heads = m.kv_heads; e->head_dim = m.head_dim; e->inter = m.inter; e->rms_eps = m.rms_eps;
    kvw_backend_t *b = &e->b;
    b->name = "cuda";
    b->vocab_size = m.vocab;
    b->eos_token_id = (uint32_t)m.eos;
    b->block_size = cfg->block_size ? cfg->block_size : 16;
    b->max_model_len = m.max_pos;
    if (m.head_dim > KVW_CUDA_MAX_HEAD_DIM) {
        snprintf(err, errlen, "cuda engine: unsupported: head_dim %u (at most %d)", m.head_dim,
                 KVW_CUDA_MAX_HEAD_DIM);
        kvw_model_free(&m);
        return -1;
    }
    int rc = upload_model(e, &m);
    kvw_model_free(&m);     /* the host copy is not needed once on the device */
    if (rc != 0) {
        snprintf(err, errlen, "cuda engine: cannot upload the weights (device memory?)");
        return -1;
    }
    if (cudaStreamCreate(&e->stream) != cudaSuccess || cublasCreate(&e->blas) != CUBLAS_STATUS_SUCCESS ||
        cublasSetStream(e->blas, e->stream) != CUBLAS_STATUS_SUCCESS) {
        snprintf(err, errlen, "cuda engine: cannot create a stream or cuBLAS handle");
        return -1;
    }
    /* f32 results close to the cpu engine's: no TF32 tensor-core rounding */
    cublasSetMathMode(e->blas, CUBLAS_PEDANTIC_MATH);
    if (alloc_pool(e, cfg, err, errlen))
        return -1;
    b->step = cuda_step;
    b->block_read = cuda_block_read;
    b->block_write = cuda_block_write;
    b->destroy = cuda_destroy;
    return 0;
}

} /* namespace */

extern "C" __attribute__((visibility("default")))
kvw_backend_t *kvw_cuda_backend_create_impl(const kvw_backend_config_t *cfg, char *err, size_t errlen)
{
    int count = 0;
    cudaError_t ce = cudaGetDeviceCount(&count);
    if (ce != cudaSuccess || count == 0) {
        snprintf(err, errlen, "no CUDA device: %s", ce != cudaSuccess ? cudaGetErrorString(ce) : "none found");
        return NULL;
    }
    if (cfg == NULL || cfg->model_dir == NULL) {
        snprintf(err, errlen, "--engine cuda needs --model DIR");
        return NULL;
    }
    cuda_engine *e = new (std::nothrow) cuda_engine();
    if (e == NULL) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    if (init(e, cfg, err, errlen) != 0) {
        cuda_destroy(&e->b);
        return NULL;
    }
    return &e->b;
}
