/*
 * A Llama-family model from a HuggingFace-layout directory: config.json,
 * model.safetensors (f32, f16 or bf16, converted to f32 on load) and, if
 * present, generation_config.json (more end-of-sequence ids). RMSNorm, RoPE
 * (theta, linear or llama3 scaling; theta and scaling at the top level or
 * under rope_parameters), grouped-query attention, SwiGLU, tied or untied
 * embeddings, Qwen2-style q/k/v biases, Llama's attention_bias (q/k/v/o
 * biases). Anything else in config.json that changes the computation is
 * refused by name.
 *
 * Shapes below use H = hidden, Q = heads * head_dim, K = kv_heads *
 * head_dim, I = inter, V = vocab; matrices are row-major [rows][cols], so
 * a projection W of shape [out][in] computes out = W . in.
 */
#ifndef KVW_MODEL_H
#define KVW_MODEL_H

#include <stddef.h>
#include <stdint.h>

#define KVW_MAX_EOS 8

/* How RoPE frequencies are scaled (HF's rope_type). */
typedef enum {
    KVW_ROPE_DEFAULT = 0,       /* plain theta^(-2i/d) */
    KVW_ROPE_LINEAR,            /* every frequency divided by factor */
    KVW_ROPE_LLAMA3             /* Llama 3.1: low frequencies scaled, a smooth band between */
} kvw_rope_t;

/* The checkpoint's storage type (of model.embed_tokens.weight). */
typedef enum { KVW_DTYPE_F32 = 0, KVW_DTYPE_F16, KVW_DTYPE_BF16 } kvw_dtype_t;

typedef struct {
    float *attn_norm;           /* [H] input_layernorm */
    float *wq;                  /* [Q][H] */
    float *wk;                  /* [K][H] */
    float *wv;                  /* [K][H] */
    float *wo;                  /* [H][Q] */
    float *bq, *bk, *bv;        /* [Q], [K], [K]; NULL without q/k/v biases */
    float *bo;                  /* [H]; NULL unless attention_bias (Llama) */
    float *mlp_norm;            /* [H] post_attention_layernorm */
    float *w_gate;              /* [I][H] */
    float *w_up;                /* [I][H] */
    float *w_down;              /* [H][I] */
} kvw_layer_t;

typedef struct {
    uint32_t    vocab, hidden, layers, heads, kv_heads, head_dim, inter, max_pos;
    float       rms_eps;
    double      rope_theta;
    kvw_rope_t  rope_type;
    double      rope_factor, rope_low, rope_high, rope_orig_max;    /* scaling parameters */
    int         tied;                   /* lm_head is embed */
    int         qkv_bias, o_bias;       /* which projection biases the checkpoint has */
    kvw_dtype_t dtype;
    int64_t     bos;
    uint32_t    eos[KVW_MAX_EOS];       /* every end-of-sequence id, eos[0] the main one */
    uint32_t    n_eos;
    float      *embed;                  /* [V][H] */
    float      *norm;                   /* [H] */
    float      *lm_head;                /* [V][H]; == embed when tied */
    kvw_layer_t *L;                     /* [layers] */
    float      *inv_freq;               /* [head_dim / 2] RoPE frequencies, scaling applied */
    size_t      params;
} kvw_model_t;

int  kvw_model_load(const char *dir, kvw_model_t *m, char *err, size_t errlen);
void kvw_model_free(kvw_model_t *m);

#endif
