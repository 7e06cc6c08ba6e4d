/*
 * The CPU reference engine: a Llama-family forward pass in plain C over the
 * paged KV cache (kvw_backend.h layout), for tests and small models.
 *
 * One step runs every token of every sequence in it together: the matmuls
 * see one [tokens x hidden] matrix, so a weight row is read once per step
 * (the whole point of batching); attention is per token, over its own
 * sequence's block table, positions 0..pos. All K/V of a layer are written
 * before that layer's attention, so a prompt chunk attends to itself.
 * Prefix-cached blocks are simply already in the pool: a sequence whose
 * pos > 0 reads them and never recomputes them.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvw_backend.h"
#include "kvw_model.h"
#include "kvw_sample.h"

typedef struct {
    kvw_backend_t   b;
    kvw_model_t     m;
    float          *kv;             /* num_blocks * block_floats */
    size_t          block_floats;
    size_t          layer_floats;   /* K and V of one layer in one block */
    size_t          cap;            /* tokens the scratch buffers hold */
    float          *x, *xn, *q, *k, *v, *att, *o, *g, *u, *scores, *logits;
} cpu_t;

/* out[t][r] = sum_c w[r][c] * in[t][c] (+ bias[r]): weights row-major [rows][cols]. */
static void matmul(float *out, const float *in, const float *w, const float *bias,
                   size_t T, size_t rows, size_t cols)
{
    size_t r, t, c;

    for (r = 0; r < rows; r++) {
        const float *wr = w + r * cols;

        for (t = 0; t < T; t++) {
            const float *x = in + t * cols;
            float        s0 = 0, s1 = 0, s2 = 0, s3 = 0;

            for (c = 0; c + 4 <= cols; c += 4) {
                s0 += wr[c] * x[c];
                s1 += wr[c + 1] * x[c + 1];
                s2 += wr[c + 2] * x[c + 2];
                s3 += wr[c + 3] * x[c + 3];
            }
            for (; c < cols; c++) s0 += wr[c] * x[c];
            out[t * rows + r] = s0 + s1 + s2 + s3 + (bias ? bias[r] : 0);
        }
    }
}

static void rmsnorm(float *out, const float *x, const float *w, size_t n, float eps)
{
    double ss = 0;
    size_t i;
    float  inv;

    for (i = 0; i < n; i++) ss += (double) x[i] * x[i];
    inv = (float) (1.0 / sqrt(ss / (double) n + eps));
    for (i = 0; i < n; i++) out[i] = x[i] * inv * w[i];
}

/* rotate_half RoPE on one head vector, as HF Llama applies it. */
static void rope(float *v, const float *inv_freq, uint32_t hd, uint32_t pos)
{
    uint32_t i, half = hd / 2;

    for (i = 0; i < half; i++) {
        float  a = (float) pos * inv_freq[i], c = cosf(a), s = sinf(a);
        float  x1 = v[i], x2 = v[i + half];

        v[i] = x1 * c - x2 * s;
        v[i + half] = x2 * c + x1 * s;
    }
}

static float *kv_at(cpu_t *e, uint32_t block, uint32_t layer, int which, uint32_t off)
{
    const kvw_model_t *m = &e->m;

    return e->kv + block * e->block_floats + layer * e->layer_floats
           + (size_t) which * (e->layer_floats / 2)
           + (size_t) off * m->kv_heads * m->head_dim;
}

typedef struct {
    uint32_t seq, pos;
} tokpos_t;

static int ensure(cpu_t *e, size_t T)
{
    const kvw_model_t *m = &e->m;
    size_t             qd = m->heads * m->head_dim, kd = m->kv_heads * m->head_dim;

    if (T <= e->cap) return 0;
    free(e->x); free(e->xn); free(e->q); free(e->k); free(e->v); free(e->att);
    free(e->o); free(e->g); free(e->u);
    e->x = malloc(T * m->hidden * sizeof(float));
    e->xn = malloc(T * m->hidden * sizeof(float));
    e->q = malloc(T * qd * sizeof(float));
    e->k = malloc(T * kd * sizeof(float));
    e->v = malloc(T * kd * sizeof(float));
    e->att = malloc(T * qd * sizeof(float));
    e->o = malloc(T * m->hidden * sizeof(float));
    e->g = malloc(T * m->inter * sizeof(float));
    e->u = malloc(T * m->inter * sizeof(float));
    if (e->x && e->xn && e->q && e->k && e->v && e->att && e->o && e->g && e->u) {
        e->cap = T;
        return 0;
    }
    /* none kept: the next step must allocate again, not use a NULL buffer */
    free(e->x); free(e->xn); free(e->q); free(e->k); free(e->v); free(e->att);
    free(e->o); free(e->g); free(e->u);
    e->x = e->xn = e->q = e->k = e->v = e->att = e->o = e->g = e->u = NULL;
    e->cap = 0;
    return -1;
}

static void attention(cpu_t *e, const kvw_step_seq_t *sq, uint32_t layer, uint32_t pos,
                      const float *q, float *out)
{
    const kvw_model_t *m = &e->m;
    uint32_t           h, p, d, hd = m->head_dim, group = m->heads / m->kv_heads;
    uint32_t           bs = e->b.block_size;
    float              scale = 1.0f / sqrtf((float) hd);

    for (h = 0; h < m->heads; h++) {
        const float *qh = q + h * hd;
        uint32_t     kvh = h / group;
        float        max = -INFINITY, sum = 0, *o = out + h * hd;

        for (p = 0; p <= pos; p++) {
            const float *kp = kv_at(e, sq->block_table[p / bs], layer, 0, p % bs) + kvh * hd;
            float        s = 0;

            for (d = 0; d < hd; d++) s += qh[d] * kp[d];
            e->scores[p] = s * scale;
            if (e->scores[p] > max) max = e->scores[p];
        }
        for (p = 0; p <= pos; p++) {
            e->scores[p] = expf(e->scores[p] - max);
            sum += e->scores[p];
        }
        memset(o, 0, hd * sizeof(float));
        for (p = 0; p <= pos; p++) {
            const float *vp = kv_at(e, sq->block_table[p / bs], layer, 1, p % bs) + kvh * hd;
            float        w = e->scores[p] / sum;

            for (d = 0; d < hd; d++) o[d] += w * vp[d];
        }
    }
}

static int cpu_step(kvw_backend_t *b, kvw_step_seq_t *seqs, uint32_t n, double *step_ms)
{
    cpu_t             *e = (cpu_t *) b;
    const kvw_model_t *m = &e->m;
    size_t             T = 0, t, i, H = m->hidden, qd = m->heads * m->head_dim;
    size_t             kd = m->kv_heads * m->head_dim;
    tokpos_t          *tp;
    uint32_t           s, l, j;
    struct timespec    t0, t1;

    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (s = 0; s < n; s++) {
        if ((size_t) (seqs[s].pos + seqs[s].n_tokens) > (size_t) seqs[s].n_blocks * b->block_size) {
            return -1;
        }
        T += seqs[s].n_tokens;
    }
    tp = malloc((T + 1) * sizeof(tokpos_t));
    if (tp == NULL || ensure(e, T) != 0) {
        free(tp);
        return -1;
    }
    for (s = 0, t = 0; s < n; s++) {
        for (j = 0; j < seqs[s].n_tokens; j++, t++) {
            uint32_t id = seqs[s].tokens[j] < m->vocab ? seqs[s].tokens[j] : 0;

            tp[t].seq = s;
            tp[t].pos = seqs[s].pos + j;
            memcpy(e->x + t * H, m->embed + (size_t) id * H, H * sizeof(float));
        }
    }
    for (l = 0; l < m->layers; l++) {
        const kvw_layer_t *L = &m->L[l];

        for (t = 0; t < T; t++) rmsnorm(e->xn + t * H, e->x + t * H, L->attn_norm, H, m->rms_eps);
        matmul(e->q, e->xn, L->wq, L->bq, T, qd, H);
        matmul(e->k, e->xn, L->wk, L->bk, T, kd, H);
        matmul(e->v, e->xn, L->wv, L->bv, T, kd, H);
        for (t = 0; t < T; t++) {
            const kvw_step_seq_t *sq = &seqs[tp[t].seq];
            uint32_t              p = tp[t].pos, bs = b->block_size;

            for (j = 0; j < m->heads; j++) rope(e->q + t * qd + j * m->head_dim, m->inv_freq, m->head_dim, p);
            for (j = 0; j < m->kv_heads; j++) rope(e->k + t * kd + j * m->head_dim, m->inv_freq, m->head_dim, p);
            memcpy(kv_at(e, sq->block_table[p / bs], l, 0, p % bs), e->k + t * kd, kd * sizeof(float));
            memcpy(kv_at(e, sq->block_table[p / bs], l, 1, p % bs), e->v + t * kd, kd * sizeof(float));
        }
        for (t = 0; t < T; t++) {
            attention(e, &seqs[tp[t].seq], l, tp[t].pos, e->q + t * qd, e->att + t * qd);
        }
        matmul(e->o, e->att, L->wo, L->bo, T, H, qd);
        for (i = 0; i < T * H; i++) e->x[i] += e->o[i];
        for (t = 0; t < T; t++) rmsnorm(e->xn + t * H, e->x + t * H, L->mlp_norm, H, m->rms_eps);
        matmul(e->g, e->xn, L->w_gate, NULL, T, m->inter, H);
        matmul(e->u, e->xn, L->w_up, NULL, T, m->inter, H);
        for (i = 0; i < T * m->inter; i++) {
            float gv = e->g[i];

            e->g[i] = gv / (1.0f + expf(-gv)) * e->u[i];
        }
        matmul(e->o, e->g, L->w_down, NULL, T, H, m->inter);
        for (i = 0; i < T * H; i++) e->x[i] += e->o[i];
    }
    /* logits only for each sequence's last token, when wanted */
    for (s = 0, t = 0; s < n; s++) {
        size_t last = t + seqs[s].n_tokens - 1;

        t += seqs[s].n_tokens;
        if (!seqs[s].sample && !seqs[s].logits) continue;
        rmsnorm(e->xn, e->x + last * H, m->norm, H, m->rms_eps);
        matmul(e->logits, e->xn, m->lm_head, NULL, 1, m->vocab, H);
        if (seqs[s].logits) memcpy(seqs[s].logits, e->logits, m->vocab * sizeof(float));
        if (seqs[s].sample) seqs[s].next_token = kvw_sample(e->logits, m->vocab, &seqs[s].sampling);
    }
    free(tp);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    *step_ms = (double) (t1.tv_sec - t0.tv_sec) * 1e3 + (double) (t1.tv_nsec - t0.tv_nsec) / 1e6;
    return 0;
}

static int cpu_block_read(kvw_backend_t *b, uint32_t block, void *dst)
{
    cpu_t *e = (cpu_t *) b;

    if (block >= b->num_blocks) return -1;
    memcpy(dst, e->kv + block * e->block_floats, b->block_bytes);
    return 0;
}

static int cpu_block_write(kvw_backend_t *b, uint32_t block, const void *src)
{
    cpu_t *e = (cpu_t *) b;

    if (block >= b->num_blocks) return -1;
    memcpy(e->kv + block * e->block_floats, src, b->block_bytes);
    return 0;
}

static void *cpu_block_ptr(kvw_backend_t *b, uint32_t block)
{
    cpu_t *e = (cpu_t *) b;

    return block < b->num_blocks ? e->kv + block * e->block_floats : NULL;
}

static void cpu_destroy(kvw_backend_t *b)
{
    cpu_t *e = (cpu_t *) b;

    kvw_model_free(&e->m);
    free(e->kv);
    free(e->x); free(e->xn); free(e->q); free(e->k); free(e->v); free(e->att);
    free(e->o); free(e->g); free(e->u); free(e->scores); free(e->logits);
    free(e);
}

kvw_backend_t *kvw_cpu_backend_create(const kvw_backend_config_t *cfg, char *err, size_t errlen)
{
    cpu_t *e = calloc(1, sizeof(*e));

    if (e == NULL) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    if (cfg->model_dir == NULL) {
        snprintf(err, errlen, "--engine cpu needs --model DIR");
        free(e);
        return NULL;
    }
    if (kvw_model_load(cfg->model_dir, &e->m, err, errlen) != 0) {
        free(e);
        return NULL;
    }
    e->b.name = "cpu";
    e->b.vocab_size = e->m.vocab;
    e->b.eos_token_id = e->m.eos[0];
    memcpy(e->b.eos_ids, e->m.eos, sizeof(e->b.eos_ids));
    e->b.n_eos = e->m.n_eos;
    e->b.block_size = cfg->block_size ? cfg->block_size : 16;
    e->b.num_blocks = cfg->num_blocks ? cfg->num_blocks : 1024;
    e->layer_floats = 2 * (size_t) e->b.block_size * e->m.kv_heads * e->m.head_dim;
    e->block_floats = e->layer_floats * e->m.layers;
    e->b.block_bytes = e->block_floats * sizeof(float);
    e->b.max_model_len = e->m.max_pos;
    e->kv = calloc((size_t) e->b.num_blocks, e->b.block_bytes);
    e->scores = malloc(((size_t) e->b.num_blocks * e->b.block_size + 1) * sizeof(float));
    e->logits = malloc(e->m.vocab * sizeof(float));
    if (e->kv == NULL || e->scores == NULL || e->logits == NULL) {
        snprintf(err, errlen, "cannot allocate a KV pool of %u blocks of %zu bytes",
                 e->b.num_blocks, e->b.block_bytes);
        cpu_destroy(&e->b);
        return NULL;
    }
    e->b.step = cpu_step;
    e->b.block_read = cpu_block_read;
    e->b.block_write = cpu_block_write;
    e->b.block_ptr = cpu_block_ptr;
    e->b.destroy = cpu_destroy;
    return &e->b;
}
