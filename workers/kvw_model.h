/*
 * A Llama-family model from a HuggingFace-layout directory: config.json and
 * model.safetensors (f32, f16 or bf16, converted to f32 on load). RMSNorm,
 * RoPE (theta, linear or llama3 scaling), grouped-query attention, SwiGLU,
 * tied or untied embeddings, Qwen2-style q/k/v biases. Anything else in
 * config.json that changes the computation is refused by name.
 */
#ifndef KVW_MODEL_H
#define KVW_MODEL_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    float *attn_norm, *wq, *wk, *wv, *wo, *bq, *bk, *bv;
    float *mlp_norm, *w_gate, *w_up, *w_down;
} kvw_layer_t;

typedef struct {
    uint32_t    vocab, hidden, layers, heads, kv_heads, head_dim, inter, max_pos;
    float       rms_eps;
    double      rope_theta;
    int         rope_type;              /* 0 none, 1 linear, 2 llama3 */
    double      rope_factor, rope_low, rope_high, rope_orig_max;
    int         tied, qkv_bias;
    int64_t     bos, eos;
    float      *embed, *norm, *lm_head; /* lm_head == embed when tied */
    kvw_layer_t *L;
    float      *inv_freq;               /* head_dim / 2 */
    size_t      params;
} kvw_model_t;

int  kvw_model_load(const char *dir, kvw_model_t *m, char *err, size_t errlen);
void kvw_model_free(kvw_model_t *m);

#endif
