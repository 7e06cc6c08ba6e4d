/*
 * kvtiny-model: writes a random-weight Llama-family model in HuggingFace
 * layout (config.json, model.safetensors, tokenizer files copied from a
 * shipped tokenizer), for tests and demos. Nothing is downloaded.
 *
 *   kvtiny-model --out DIR [--layers N] [--hidden N] [--heads N] [--kv-heads N]
 *       [--intermediate N] [--tokenizer FILE] [--seed S] [--dtype f32|f16|bf16]
 *       [--qkv-bias] [--tie] [--rope-scaling none|linear|llama3] [--max-pos N]
 */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "kv_tokenizer.h"

typedef struct {
    const char *out, *tokenizer, *dtype, *rope;
    long        layers, hidden, heads, kv_heads, inter, max_pos;
    uint64_t    seed;
    int         qkv_bias, tie;
    uint32_t    vocab;
} opts_t;

typedef struct {
    char        name[128];
    size_t      n, rows, cols;      /* cols 0: a vector */
    int         kind;               /* 0 weight, 1 norm, 2 bias, 3 embedding */
} tensor_t;

static uint64_t rng;

static double gauss(void)
{
    double u1, u2;

    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    u1 = ((double) (rng >> 11) + 1) / 9007199254740993.0;
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    u2 = (double) (rng >> 11) / 9007199254740992.0;
    return sqrt(-2 * log(u1)) * cos(2 * M_PI * u2);
}

static uint16_t to_half(float f)
{
    uint32_t x;
    int      e;
    uint32_t m, s;

    memcpy(&x, &f, 4);
    s = (x >> 16) & 0x8000;
    e = (int) ((x >> 23) & 0xff) - 127 + 15;
    m = x & 0x7fffff;
    if (e <= 0) return (uint16_t) s;
    if (e >= 31) return (uint16_t) (s | 0x7c00);
    return (uint16_t) (s | (uint32_t) e << 10 | ((m + 0x1000) >> 13));
}

static void put_value(FILE *f, const char *dtype, float v)
{
    if (!strcmp(dtype, "f32")) {
        fwrite(&v, 4, 1, f);
    } else if (!strcmp(dtype, "bf16")) {
        uint32_t x;
        uint16_t h;

        memcpy(&x, &v, 4);
        h = (uint16_t) ((x + 0x7fff + ((x >> 16) & 1)) >> 16);
        fwrite(&h, 2, 1, f);
    } else {
        uint16_t h = to_half(v);

        fwrite(&h, 2, 1, f);
    }
}

static int copy_file(const char *from, const char *to)
{
    FILE  *a = fopen(from, "rb"), *b;
    char   buf[65536];
    size_t n;

    if (a == NULL) return -1;
    b = fopen(to, "wb");
    if (b == NULL) { fclose(a); return -1; }
    while ((n = fread(buf, 1, sizeof(buf), a)) > 0) fwrite(buf, 1, n, b);
    fclose(a);
    return fclose(b);
}

static size_t plan(const opts_t *o, tensor_t *t)
{
    size_t k = 0, l, hd = (size_t) (o->hidden / o->heads);
    size_t q = (size_t) o->heads * hd, kv = (size_t) o->kv_heads * hd, H = (size_t) o->hidden;

#define ADD(kd, r, c, ...) do { snprintf(t[k].name, sizeof(t[k].name), __VA_ARGS__); \
        t[k].rows = r; t[k].cols = c; t[k].n = (r) * ((c) ? (c) : 1); t[k].kind = kd; k++; } while (0)
    ADD(3, o->vocab, H, "model.embed_tokens.weight");
    for (l = 0; l < (size_t) o->layers; l++) {
        ADD(1, H, 0, "model.layers.%zu.input_layernorm.weight", l);
        ADD(0, q, H, "model.layers.%zu.self_attn.q_proj.weight", l);
        ADD(0, kv, H, "model.layers.%zu.self_attn.k_proj.weight", l);
        ADD(0, kv, H, "model.layers.%zu.self_attn.v_proj.weight", l);
        if (o->qkv_bias) {
            ADD(2, q, 0, "model.layers.%zu.self_attn.q_proj.bias", l);
            ADD(2, kv, 0, "model.layers.%zu.self_attn.k_proj.bias", l);
            ADD(2, kv, 0, "model.layers.%zu.self_attn.v_proj.bias", l);
        }
        ADD(0, H, q, "model.layers.%zu.self_attn.o_proj.weight", l);
        ADD(1, H, 0, "model.layers.%zu.post_attention_layernorm.weight", l);
        ADD(0, (size_t) o->inter, H, "model.layers.%zu.mlp.gate_proj.weight", l);
        ADD(0, (size_t) o->inter, H, "model.layers.%zu.mlp.up_proj.weight", l);
        ADD(0, H, (size_t) o->inter, "model.layers.%zu.mlp.down_proj.weight", l);
    }
    ADD(1, H, 0, "model.norm.weight");
    if (!o->tie) ADD(0, o->vocab, H, "lm_head.weight");
#undef ADD
    return k;
}

static int write_safetensors(const opts_t *o, const char *path)
{
    tensor_t *t = calloc((size_t) o->layers * 12 + 8, sizeof(tensor_t));
    size_t    n = plan(o, t), i, j, off = 0, esz = strcmp(o->dtype, "f32") ? 2 : 4, hlen;
    char     *hdr = malloc(64 * 1024 + n * 256), *p;
    FILE     *f = fopen(path, "wb");
    uint64_t  h64;

    if (!t || !hdr || !f) return -1;
    p = hdr;
    p += sprintf(p, "{\"__metadata__\":{\"format\":\"pt\"}");
    for (i = 0; i < n; i++) {
        p += sprintf(p, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[%zu", t[i].name,
                     !strcmp(o->dtype, "f32") ? "F32" : !strcmp(o->dtype, "bf16") ? "BF16" : "F16",
                     t[i].rows);
        if (t[i].cols) p += sprintf(p, ",%zu", t[i].cols);
        p += sprintf(p, "],\"data_offsets\":[%zu,%zu]}", off, off + t[i].n * esz);
        off += t[i].n * esz;
    }
    p += sprintf(p, "}");
    hlen = (size_t) (p - hdr);
    while (hlen % 8) hdr[hlen++] = ' ';
    h64 = hlen;
    fwrite(&h64, 8, 1, f);
    fwrite(hdr, 1, hlen, f);
    for (i = 0; i < n; i++) {
        double scale = t[i].kind == 0 ? 1.0 / sqrt((double) t[i].cols) : t[i].kind == 3 ? 1.0 : 0.1;

        for (j = 0; j < t[i].n; j++) {
            float v = (float) (gauss() * scale) + (t[i].kind == 1 ? 1.0f : 0.0f);

            put_value(f, o->dtype, v);
        }
    }
    free(t);
    free(hdr);
    return fclose(f);
}

static int write_config(const opts_t *o, const char *path)
{
    FILE *f = fopen(path, "w");

    if (f == NULL) return -1;
    fprintf(f, "{\n  \"architectures\": [\"%s\"],\n  \"model_type\": \"%s\",\n",
            o->qkv_bias ? "Qwen2ForCausalLM" : "LlamaForCausalLM", o->qkv_bias ? "qwen2" : "llama");
    fprintf(f, "  \"vocab_size\": %u,\n  \"hidden_size\": %ld,\n  \"intermediate_size\": %ld,\n"
               "  \"num_hidden_layers\": %ld,\n  \"num_attention_heads\": %ld,\n"
               "  \"num_key_value_heads\": %ld,\n  \"max_position_embeddings\": %ld,\n"
               "  \"rms_norm_eps\": 1e-05,\n  \"rope_theta\": 10000.0,\n  \"hidden_act\": \"silu\",\n"
               "  \"tie_word_embeddings\": %s,\n  \"bos_token_id\": 0,\n  \"eos_token_id\": 0,\n"
               "  \"torch_dtype\": \"%s\",\n",
            o->vocab, o->hidden, o->inter, o->layers, o->heads, o->kv_heads, o->max_pos,
            o->tie ? "true" : "false",
            !strcmp(o->dtype, "f32") ? "float32" : !strcmp(o->dtype, "bf16") ? "bfloat16" : "float16");
    if (!strcmp(o->rope, "linear")) {
        fprintf(f, "  \"rope_scaling\": {\"rope_type\": \"linear\", \"factor\": 2.0}\n}\n");
    } else if (!strcmp(o->rope, "llama3")) {
        fprintf(f, "  \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0, "
                   "\"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0, "
                   "\"original_max_position_embeddings\": 64}\n}\n");
    } else {
        fprintf(f, "  \"rope_scaling\": null\n}\n");
    }
    return fclose(f);
}

int main(int argc, char **argv)
{
    static const struct option lo[] = {
        { "out", 1, 0, 'o' }, { "layers", 1, 0, 'l' }, { "hidden", 1, 0, 'H' },
        { "heads", 1, 0, 'a' }, { "kv-heads", 1, 0, 'k' }, { "intermediate", 1, 0, 'i' },
        { "tokenizer", 1, 0, 't' }, { "seed", 1, 0, 's' }, { "dtype", 1, 0, 'd' },
        { "qkv-bias", 0, 0, 'b' }, { "tie", 0, 0, 'T' }, { "rope-scaling", 1, 0, 'r' },
        { "max-pos", 1, 0, 'm' }, { 0, 0, 0, 0 }
    };
    opts_t          o = { NULL, "conf/tokenizers/gpt2/tokenizer.json", "f32", "none",
                          2, 64, 4, 2, 128, 2048, 1, 0, 0, 0 };
    char            path[1200], err[512], dir[1024];
    const char     *slash;
    kv_tokenizer_t *tok;
    int             c;

    while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        switch (c) {
        case 'o': o.out = optarg; break;
        case 'l': o.layers = atol(optarg); break;
        case 'H': o.hidden = atol(optarg); break;
        case 'a': o.heads = atol(optarg); break;
        case 'k': o.kv_heads = atol(optarg); break;
        case 'i': o.inter = atol(optarg); break;
        case 't': o.tokenizer = optarg; break;
        case 's': o.seed = strtoull(optarg, NULL, 10); break;
        case 'd': o.dtype = optarg; break;
        case 'b': o.qkv_bias = 1; break;
        case 'T': o.tie = 1; break;
        case 'r': o.rope = optarg; break;
        case 'm': o.max_pos = atol(optarg); break;
        default: goto usage;
        }
    }
    if (o.out == NULL || o.layers < 1 || o.hidden < 2 || o.heads < 1 || o.kv_heads < 1
        || o.heads % o.kv_heads || o.hidden % o.heads || (o.hidden / o.heads) % 2 || o.inter < 1
        || (strcmp(o.dtype, "f32") && strcmp(o.dtype, "f16") && strcmp(o.dtype, "bf16"))
        || (strcmp(o.rope, "none") && strcmp(o.rope, "linear") && strcmp(o.rope, "llama3")))
    {
        goto usage;
    }
    tok = kv_tokenizer_load(o.tokenizer, err, sizeof(err));
    if (tok == NULL) {
        fprintf(stderr, "kvtiny-model: %s: %s\n", o.tokenizer, err);
        return 1;
    }
    o.vocab = kv_tokenizer_vocab_size(tok);
    kv_tokenizer_free(tok);
    rng = o.seed * 0x9e3779b97f4a7c15ULL + 1;
    mkdir(o.out, 0755);
    snprintf(path, sizeof(path), "%s/config.json", o.out);
    if (write_config(&o, path) != 0) goto io;
    snprintf(path, sizeof(path), "%s/model.safetensors", o.out);
    if (write_safetensors(&o, path) != 0) goto io;
    snprintf(path, sizeof(path), "%s/tokenizer.json", o.out);
    if (copy_file(o.tokenizer, path) != 0) goto io;
    slash = strrchr(o.tokenizer, '/');
    snprintf(dir, sizeof(dir), "%.*s", slash ? (int) (slash - o.tokenizer) : 1, slash ? o.tokenizer : ".");
    snprintf(path, sizeof(path), "%s/tokenizer_config.json", dir);
    {
        char to[1200];

        snprintf(to, sizeof(to), "%s/tokenizer_config.json", o.out);
        copy_file(path, to);        /* optional */
    }
    return 0;
io:
    fprintf(stderr, "kvtiny-model: cannot write %s\n", path);
    return 1;
usage:
    fprintf(stderr, "usage: kvtiny-model --out DIR [--layers N] [--hidden N] [--heads N] "
                    "[--kv-heads N] [--intermediate N]\n    [--tokenizer FILE] [--seed S] "
                    "[--dtype f32|f16|bf16] [--qkv-bias] [--tie]\n    "
                    "[--rope-scaling none|linear|llama3] [--max-pos N]\n");
    return 2;
}
