/* Loading a Llama-family model: config.json + model.safetensors (kvw_model.h). */
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "kvw_model.h"

typedef struct {
    json_t         *header;
    const uint8_t  *data;
    size_t          data_len;
    void           *map;
    size_t          map_len;
} st_file_t;

static int fail(char *err, size_t errlen, const char *fmt, const char *a)
{
    snprintf(err, errlen, fmt, a);
    return -1;
}

static void st_close(st_file_t *f);

static int st_open(const char *path, st_file_t *f, char *err, size_t errlen)
{
    struct stat  st;
    int          fd = open(path, O_RDONLY);
    uint64_t     hlen;
    json_error_t je;

    memset(f, 0, sizeof(*f));
    if (fd < 0 || fstat(fd, &st) != 0 || st.st_size < 8) {
        if (fd >= 0) close(fd);
        return fail(err, errlen, "cannot read %s", path);
    }
    f->map_len = (size_t) st.st_size;
    f->map = mmap(NULL, f->map_len, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (f->map == MAP_FAILED) {
        return fail(err, errlen, "cannot map %s", path);
    }
    memcpy(&hlen, f->map, 8);       /* little-endian u64, as on every host we build for */
    if (hlen > f->map_len - 8) {
        st_close(f);
        return fail(err, errlen, "%s: bad safetensors header length", path);
    }
    f->header = json_loadb((const char *) f->map + 8, hlen, 0, &je);
    if (f->header == NULL) {
        st_close(f);
        return fail(err, errlen, "%s: bad safetensors header", path);
    }
    f->data = (const uint8_t *) f->map + 8 + hlen;
    f->data_len = f->map_len - 8 - hlen;
    return 0;
}

static void st_close(st_file_t *f)
{
    json_decref(f->header);
    if (f->map && f->map != MAP_FAILED) munmap(f->map, f->map_len);
}

static float half_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t) (h >> 15) << 31, e = (h >> 10) & 0x1f, m = h & 0x3ff, bits;
    float    out;

    if (e == 0) {
        out = ldexpf((float) m, -24);
        return sign ? -out : out;
    }
    bits = e == 31 ? sign | 0x7f800000 | (m << 13) : sign | ((e - 15 + 127) << 23) | (m << 13);
    memcpy(&out, &bits, 4);
    return out;
}

/* The tensor name as f32 with exactly n elements, or NULL (missing is ok when optional). */
static float *tensor(st_file_t *f, const char *name, size_t n, int optional, char *err, size_t errlen)
{
    json_t     *t = json_object_get(f->header, name), *off, *shape, *d;
    const char *dt;
    size_t      a, b, i, count = 1, esz;
    float      *out;

    if (t == NULL) {
        if (!optional) fail(err, errlen, "model.safetensors has no tensor %s", name);
        return NULL;
    }
    dt = json_string_value(json_object_get(t, "dtype"));
    off = json_object_get(t, "data_offsets");
    /* every dimension and product checked: a corrupt header must not wrap
     * to the right element count */
    shape = json_object_get(t, "shape");
    json_array_foreach(shape, i, d) {
        json_int_t k = json_integer_value(d);

        if (!json_is_integer(d) || k < 0 || (k > 0 && count > SIZE_MAX / (size_t) k)) {
            fail(err, errlen, "tensor %s has a bad shape", name);
            return NULL;
        }
        count *= (size_t) k;
    }
    esz = dt && strcmp(dt, "F32") == 0 ? 4 : dt && (!strcmp(dt, "F16") || !strcmp(dt, "BF16")) ? 2 : 0;
    if (esz == 0) {
        fail(err, errlen, "tensor dtype %s is not supported (F32, F16, BF16)", dt ? dt : "?");
        return NULL;
    }
    a = (size_t) json_integer_value(json_array_get(off, 0));
    b = (size_t) json_integer_value(json_array_get(off, 1));
    if (count != n || n > f->data_len / esz || b < a || b - a != n * esz || b > f->data_len) {
        fail(err, errlen, "tensor %s has the wrong shape or size", name);
        return NULL;
    }
    out = malloc(n * sizeof(float));
    if (out == NULL) {
        fail(err, errlen, "out of memory for %s", name);
        return NULL;
    }
    for (i = 0; i < n; i++) {
        const uint8_t *p = f->data + a + i * esz;

        if (esz == 4) {
            memcpy(&out[i], p, 4);
        } else {
            uint16_t h = (uint16_t) (p[0] | p[1] << 8);

            if (!strcmp(dt, "BF16")) {
                uint32_t bits = (uint32_t) h << 16;

                memcpy(&out[i], &bits, 4);
            } else {
                out[i] = half_to_f32(h);
            }
        }
    }
    return out;
}

static int cfg_int(json_t *c, const char *k, int64_t dflt, int64_t *out)
{
    json_t *v = json_object_get(c, k);

    if (v == NULL || json_is_null(v)) {
        *out = dflt;
        return dflt >= 0;
    }
    if (json_is_array(v)) {
        v = json_array_get(v, 0);
    }
    if (!json_is_integer(v)) {
        return 0;
    }
    *out = json_integer_value(v);
    return 1;
}

/* Adds the end-of-sequence ids of v (an integer or a list of them), without repeats. */
static void add_eos(kvw_model_t *m, json_t *v)
{
    size_t i, n = json_is_array(v) ? json_array_size(v) : 1;

    for (i = 0; i < n; i++) {
        json_t  *x = json_is_array(v) ? json_array_get(v, i) : v;
        uint32_t id, j;

        if (!json_is_integer(x) || json_integer_value(x) < 0
            || json_integer_value(x) > (json_int_t) UINT32_MAX)
            continue;
        id = (uint32_t) json_integer_value(x);
        for (j = 0; j < m->n_eos && m->eos[j] != id; j++) {}
        if (j == m->n_eos && m->n_eos < KVW_MAX_EOS) m->eos[m->n_eos++] = id;
    }
}

/*
 * config.json's eos_token_id, then generation_config.json's: Llama-3
 * instruct names <|eot_id|> only in the latter (or second in a list), and
 * generation must stop at any of them.
 */
static void load_eos(const char *dir, json_t *c, kvw_model_t *m)
{
    char          path[1024];
    json_error_t  je;
    json_t       *g;

    add_eos(m, json_object_get(c, "eos_token_id"));
    snprintf(path, sizeof(path), "%s/generation_config.json", dir);
    g = json_load_file(path, 0, &je);
    if (g) {
        add_eos(m, json_object_get(g, "eos_token_id"));
        json_decref(g);
    }
    if (m->n_eos == 0) m->eos[m->n_eos++] = 0;
}

static int load_config(const char *dir, kvw_model_t *m, char *err, size_t errlen)
{
    char          path[1024];
    json_error_t  je;
    json_t       *c, *rs, *rp;
    const char   *mt, *act;
    int64_t       v[8];
    int           ok;

    snprintf(path, sizeof(path), "%s/config.json", dir);
    c = json_load_file(path, 0, &je);
    if (c == NULL) {
        return fail(err, errlen, "cannot read %s", path);
    }
    mt = json_string_value(json_object_get(c, "model_type"));
    if (mt == NULL || (strcmp(mt, "llama") && strcmp(mt, "qwen2") && strcmp(mt, "mistral"))) {
        fail(err, errlen, "model_type %s is not supported (llama, qwen2, mistral)", mt ? mt : "?");
        goto bad;
    }
    act = json_string_value(json_object_get(c, "hidden_act"));
    if (act && strcmp(act, "silu")) {
        fail(err, errlen, "hidden_act %s is not supported (silu)", act);
        goto bad;
    }
    if (json_object_get(c, "quantization_config")) {
        fail(err, errlen, "%s", "quantization_config is not supported");
        goto bad;
    }
    if (json_object_get(c, "num_local_experts") || json_object_get(c, "num_experts")) {
        fail(err, errlen, "%s", "mixture-of-experts models are not supported");
        goto bad;
    }
    if ((json_is_true(json_object_get(c, "use_sliding_window")) || !strcmp(mt, "mistral"))
        && json_is_integer(json_object_get(c, "sliding_window")))
    {
        fail(err, errlen, "%s", "sliding_window attention is not supported");
        goto bad;
    }
    if (json_is_true(json_object_get(c, "mlp_bias"))) {
        fail(err, errlen, "%s", "mlp_bias is not supported");
        goto bad;
    }
    ok = cfg_int(c, "vocab_size", -1, &v[0]) && cfg_int(c, "hidden_size", -1, &v[1])
         && cfg_int(c, "num_hidden_layers", -1, &v[2]) && cfg_int(c, "num_attention_heads", -1, &v[3])
         && cfg_int(c, "intermediate_size", -1, &v[5]);
    if (!ok || v[0] < 1 || v[1] < 1 || v[2] < 1 || v[3] < 1 || v[5] < 1) {
        fail(err, errlen, "%s", "config.json lacks vocab_size/hidden_size/num_hidden_layers/"
             "num_attention_heads/intermediate_size");
        goto bad;
    }
    cfg_int(c, "num_key_value_heads", v[3], &v[4]);
    cfg_int(c, "head_dim", v[1] / v[3], &v[6]);
    cfg_int(c, "max_position_embeddings", 4096, &v[7]);
    if (v[4] < 1 || v[3] % v[4] || v[6] % 2) {
        fail(err, errlen, "%s", "num_attention_heads must be a multiple of num_key_value_heads "
             "and head_dim even");
        goto bad;
    }
    /* far beyond any dense model this engine runs, and small enough that no
     * size computed from them overflows */
    if (v[0] > (1 << 22) || v[1] > (1 << 16) || v[2] > 1024 || v[3] > 1024 || v[4] > v[3]
        || v[5] > (1 << 18) || v[6] < 2 || v[6] > 1024 || v[7] < 1 || v[7] > (1 << 24)) {
        fail(err, errlen, "%s", "config.json: a dimension is out of range (vocab_size <= 4M, "
             "hidden_size <= 65536, layers and heads <= 1024, intermediate_size <= 262144, "
             "head_dim 2..1024, max_position_embeddings 1..16M)");
        goto bad;
    }
    m->vocab = (uint32_t) v[0]; m->hidden = (uint32_t) v[1]; m->layers = (uint32_t) v[2];
    m->heads = (uint32_t) v[3]; m->kv_heads = (uint32_t) v[4]; m->inter = (uint32_t) v[5];
    m->head_dim = (uint32_t) v[6]; m->max_pos = (uint32_t) v[7];
    m->rms_eps = json_is_number(json_object_get(c, "rms_norm_eps"))
                 ? (float) json_number_value(json_object_get(c, "rms_norm_eps")) : 1e-6f;
    /* newer transformers configs keep theta and the scaling under rope_parameters */
    rp = json_object_get(c, "rope_parameters");
    if (!json_is_object(rp)) rp = NULL;
    m->rope_theta = json_is_number(json_object_get(c, "rope_theta"))
                    ? json_number_value(json_object_get(c, "rope_theta"))
                    : rp && json_is_number(json_object_get(rp, "rope_theta"))
                    ? json_number_value(json_object_get(rp, "rope_theta")) : 10000.0;
    if (!(m->rope_theta > 0)) {
        fail(err, errlen, "%s", "rope_theta must be positive");
        goto bad;
    }
    m->tied = json_is_true(json_object_get(c, "tie_word_embeddings"));
    /* Qwen2: q/k/v biases always, none on o; Llama's attention_bias: all four (HF LlamaAttention) */
    m->qkv_bias = !strcmp(mt, "qwen2") || json_is_true(json_object_get(c, "attention_bias"));
    m->o_bias = strcmp(mt, "qwen2") && json_is_true(json_object_get(c, "attention_bias"));
    cfg_int(c, "bos_token_id", 0, &m->bos);
    load_eos(dir, c, m);
    rs = json_object_get(c, "rope_scaling");
    if (rs == NULL || json_is_null(rs)) rs = rp;
    if (rs && !json_is_null(rs)) {
        const char *ty = json_string_value(json_object_get(rs, "rope_type"));

        if (ty == NULL) ty = json_string_value(json_object_get(rs, "type"));
        m->rope_factor = json_number_value(json_object_get(rs, "factor"));
        if (ty && !strcmp(ty, "linear") && m->rope_factor > 0) {
            m->rope_type = KVW_ROPE_LINEAR;
        } else if (ty && !strcmp(ty, "llama3") && m->rope_factor > 0) {
            m->rope_type = KVW_ROPE_LLAMA3;
            m->rope_low = json_number_value(json_object_get(rs, "low_freq_factor"));
            m->rope_high = json_number_value(json_object_get(rs, "high_freq_factor"));
            m->rope_orig_max = json_number_value(json_object_get(rs, "original_max_position_embeddings"));
        } else if (!(ty == NULL && rs == rp) && !(ty && !strcmp(ty, "default"))) {
            fail(err, errlen, "rope_scaling type %s is not supported (linear, llama3)", ty ? ty : "?");
            goto bad;
        }
    }
    json_decref(c);
    return 0;
bad:
    json_decref(c);
    return -1;
}

/* RoPE inverse frequencies with the configured scaling, as HF computes them. */
static int rope_freqs(kvw_model_t *m)
{
    uint32_t i, half = m->head_dim / 2;

    m->inv_freq = malloc(half * sizeof(float));
    if (m->inv_freq == NULL) return -1;
    for (i = 0; i < half; i++) {
        double f = 1.0 / pow(m->rope_theta, (double) (2 * i) / m->head_dim);

        if (m->rope_type == KVW_ROPE_LINEAR) {
            f /= m->rope_factor;
        } else if (m->rope_type == KVW_ROPE_LLAMA3) {
            double low_wl = m->rope_orig_max / m->rope_low, high_wl = m->rope_orig_max / m->rope_high;
            double wl = 2 * M_PI / f;

            if (wl > low_wl) {
                f /= m->rope_factor;
            } else if (wl >= high_wl) {
                double smooth = (m->rope_orig_max / wl - m->rope_low) / (m->rope_high - m->rope_low);

                f = (1 - smooth) * f / m->rope_factor + smooth * f;
            }
        }
        m->inv_freq[i] = (float) f;
    }
    return 0;
}

int kvw_model_load(const char *dir, kvw_model_t *m, char *err, size_t errlen)
{
    char      path[1024], name[256];
    st_file_t f;
    uint32_t  l, hd, q, kv;

    memset(m, 0, sizeof(*m));
    if (load_config(dir, m, err, errlen) != 0) return -1;
    snprintf(path, sizeof(path), "%s/model.safetensors", dir);
    if (st_open(path, &f, err, errlen) != 0) return -1;
    hd = m->head_dim;
    q = m->heads * hd;
    kv = m->kv_heads * hd;
    m->L = calloc(m->layers, sizeof(kvw_layer_t));
    if (m->L == NULL) {
        fail(err, errlen, "%s", "out of memory");
        st_close(&f);
        return -1;
    }
#define T(field, nm, n, opt) do {                                              \
        field = tensor(&f, nm, (size_t) (n), opt, err, errlen);                \
        if (field == NULL && !(opt)) goto bad;                                 \
        if (field) m->params += (size_t) (n);                                  \
    } while (0)
    T(m->embed, "model.embed_tokens.weight", (size_t) m->vocab * m->hidden, 0);
    {
        const char *dt = json_string_value(json_object_get(
            json_object_get(f.header, "model.embed_tokens.weight"), "dtype"));

        m->dtype = dt && !strcmp(dt, "F16") ? KVW_DTYPE_F16
                   : dt && !strcmp(dt, "BF16") ? KVW_DTYPE_BF16 : KVW_DTYPE_F32;
    }
    T(m->norm, "model.norm.weight", m->hidden, 0);
    for (l = 0; l < m->layers; l++) {
        kvw_layer_t *L = &m->L[l];
#define N(s) (snprintf(name, sizeof(name), "model.layers.%u.%s", l, s), name)
        T(L->attn_norm, N("input_layernorm.weight"), m->hidden, 0);
        T(L->wq, N("self_attn.q_proj.weight"), (size_t) q * m->hidden, 0);
        T(L->wk, N("self_attn.k_proj.weight"), (size_t) kv * m->hidden, 0);
        T(L->wv, N("self_attn.v_proj.weight"), (size_t) kv * m->hidden, 0);
        T(L->wo, N("self_attn.o_proj.weight"), (size_t) m->hidden * q, 0);
        T(L->bo, N("self_attn.o_proj.bias"), m->hidden, !m->o_bias);
        T(L->bq, N("self_attn.q_proj.bias"), q, !m->qkv_bias);
        T(L->bk, N("self_attn.k_proj.bias"), kv, !m->qkv_bias);
        T(L->bv, N("self_attn.v_proj.bias"), kv, !m->qkv_bias);
        T(L->mlp_norm, N("post_attention_layernorm.weight"), m->hidden, 0);
        T(L->w_gate, N("mlp.gate_proj.weight"), (size_t) m->inter * m->hidden, 0);
        T(L->w_up, N("mlp.up_proj.weight"), (size_t) m->inter * m->hidden, 0);
        T(L->w_down, N("mlp.down_proj.weight"), (size_t) m->hidden * m->inter, 0);
#undef N
    }
    if (m->tied) {
        m->lm_head = m->embed;
    } else {
        T(m->lm_head, "lm_head.weight", (size_t) m->vocab * m->hidden, 0);
    }
#undef T
    st_close(&f);
    if (rope_freqs(m) != 0) {
        snprintf(err, errlen, "out of memory");
        kvw_model_free(m);
        return -1;
    }
    return 0;
bad:
    st_close(&f);
    kvw_model_free(m);
    return -1;
}

void kvw_model_free(kvw_model_t *m)
{
    uint32_t l;

    if (m->L) {
        for (l = 0; l < m->layers; l++) {
            kvw_layer_t *L = &m->L[l];

            free(L->attn_norm); free(L->wq); free(L->wk); free(L->wv); free(L->wo);
            free(L->bq); free(L->bk); free(L->bv); free(L->bo); free(L->mlp_norm);
            free(L->w_gate); free(L->w_up); free(L->w_down);
        }
    }
    if (m->lm_head != m->embed) free(m->lm_head);
    free(m->embed);
    free(m->norm);
    free(m->L);
    free(m->inv_freq);
    memset(m, 0, sizeof(*m));
}
