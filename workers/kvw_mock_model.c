/*
 * The mock backend: no weights, only time. A step's duration comes from
 * Dynamo's mocker perf model (lib/mocker perf_model, the "polynomial"
 * default), or from a measured profile interpolated the way Dynamo's NPZ
 * profiles are, divided by --speedup:
 *
 *   prefill(T) = 4.209989e-07 T^2 + 1.518344e-02 T + 16.50142   (ms)
 *       T = prompt tokens computed in the step (cached ones are not)
 *   decode(p)  = max(1, -25.74 p^2 + 54.01 p + 5.74)             (ms)
 *       p = min(1, context tokens of the decoding sequences / (num_blocks * block_size))
 *
 * A step with both prompt chunks and decoding sequences takes the sum, as
 * Dynamo's iteration time does. Sampled tokens are pseudo-random but
 * deterministic in (request seed, position), so a recomputed or repeated
 * request produces the same text; the mock never samples EOS.
 *
 * Profile file (--perf-profile FILE), JSON, the fields of Dynamo's NPZ:
 *   {"prefill_isl":        [t0, t1, ...],     prompt tokens in a step, ascending
 *    "prefill_ttft_ms":    [m0, m1, ...],     its duration
 *    "decode_active_kv_tokens": [a0, ...],    KV tokens of the decoding batch, ascending
 *    "decode_context_length":   [c0, ...],    mean context length, ascending
 *    "decode_itl":         [[ms(a0,c0), ms(a0,c1), ...], [ms(a1,c0), ...], ...]}
 * Prefill is interpolated linearly in T, decode bilinearly in (a, c); both
 * extrapolate linearly past the ends, and decode is floored at 1 ms.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "kvw_backend.h"

#define MAX_POINTS 256

typedef struct {
    size_t  n;
    double  x[MAX_POINTS], y[MAX_POINTS];
} curve_t;

typedef struct {
    kvw_backend_t   b;
    double          speedup, decode_speedup;
    int             profiled;
    curve_t         prefill;
    size_t          na, nc;
    double          a[MAX_POINTS], c[MAX_POINTS];
    double         *itl;            /* na x nc */
} mock_t;

static const char alphabet[] = " abcdefghijklmnopqrstuvwxyz";

double kvw_mock_poly_prefill_ms(double t)
{
    if (t <= 0)
        return 0;
    return KVW_MOCK_PREFILL_SQUARE * t * t + KVW_MOCK_PREFILL_PER_TOKEN * t
           + KVW_MOCK_PREFILL_FIXED;
}

double kvw_mock_poly_decode_ms(double p)
{
    if (p > 1)
        p = 1;
    double ms = -25.74 * p * p + 54.01 * p + 5.74;
    return ms < 1 ? 1 : ms;
}

/* Index i such that x[i] <= v < x[i+1], clamped so [i, i+1] exists. */
static size_t segment(const double *x, size_t n, double v)
{
    size_t i = 0;
    while (i + 2 < n && v >= x[i + 1])
        i++;
    return i;
}

static double lerp_at(const double *x, const double *y, size_t n, double v)
{
    if (n == 1)
        return y[0];
    size_t i = segment(x, n, v);
    double f = (v - x[i]) / (x[i + 1] - x[i]);
    return y[i] + f * (y[i + 1] - y[i]);
}

static double profile_decode_ms(const mock_t *m, double a, double c)
{
    double row[MAX_POINTS];
    for (size_t i = 0; i < m->na; i++)
        row[i] = lerp_at(m->c, m->itl + i * m->nc, m->nc, c);
    double ms = lerp_at(m->a, row, m->na, a);
    return ms < 1 ? 1 : ms;
}

static uint64_t mix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

static uint32_t mock_token(const mock_t *m, uint64_t seed, uint32_t pos)
{
    uint64_t h = mix64(seed ^ mix64(pos));
    if (m->b.vocab_size == 256)     /* the byte stand-in tokenizer: readable text */
        return (uint32_t)(unsigned char)alphabet[h % (sizeof(alphabet) - 1)];
    uint32_t t = (uint32_t)(h % m->b.vocab_size);
    return t == m->b.eos_token_id ? (t + 1) % m->b.vocab_size : t;
}

static int mock_step(kvw_backend_t *b, kvw_step_seq_t *seqs, uint32_t n, double *step_ms)
{
    mock_t *m = (mock_t *)b;
    double prefill_tokens = 0, kv_tokens = 0;
    uint32_t decoding = 0;

    for (uint32_t i = 0; i < n; i++) {
        kvw_step_seq_t *q = &seqs[i];
        if (q->decode) {
            decoding++;
            kv_tokens += q->pos + q->n_tokens;
        } else {
            prefill_tokens += q->n_tokens;
        }
        if (q->sample)
            q->next_token = mock_token(m, q->sampling.rng ? *q->sampling.rng : 0,
                                       q->pos + q->n_tokens);
    }
    double pre = 0, dec = 0;
    if (prefill_tokens > 0)
        pre = m->profiled ? lerp_at(m->prefill.x, m->prefill.y, m->prefill.n, prefill_tokens)
                          : kvw_mock_poly_prefill_ms(prefill_tokens);
    if (decoding > 0) {
        double total = (double)b->num_blocks * b->block_size;
        dec = m->profiled ? profile_decode_ms(m, kv_tokens, kv_tokens / decoding)
                          : kvw_mock_poly_decode_ms(kv_tokens / total);
    }
    *step_ms = pre / m->speedup + dec / (m->speedup * m->decode_speedup);
    return 0;
}

static void mock_destroy(kvw_backend_t *b)
{
    mock_t *m = (mock_t *)b;
    free(m->itl);
    free(m);
}

/* --- profile loading ------------------------------------------------------- */

static int load_axis(json_t *root, const char *key, double *out, size_t *n,
                     char *err, size_t errlen)
{
    json_t *a = json_object_get(root, key), *v;
    size_t i;

    if (!json_is_array(a) || json_array_size(a) < 1 || json_array_size(a) > MAX_POINTS) {
        snprintf(err, errlen, "profile: '%s' must be an array of 1..%d numbers", key, MAX_POINTS);
        return -1;
    }
    json_array_foreach(a, i, v) {
        if (!json_is_number(v)) {
            snprintf(err, errlen, "profile: '%s' must hold numbers", key);
            return -1;
        }
        out[i] = json_number_value(v);
        if (i > 0 && !(out[i] > out[i - 1]) && strcmp(key, "prefill_ttft_ms") != 0) {
            snprintf(err, errlen, "profile: '%s' must be strictly ascending", key);
            return -1;
        }
    }
    *n = json_array_size(a);
    return 0;
}

static int load_profile(mock_t *m, const char *path, char *err, size_t errlen)
{
    json_error_t je;
    json_t *root = json_load_file(path, 0, &je);
    size_t ny = 0;
    int rc = -1;

    if (root == NULL) {
        snprintf(err, errlen, "profile %s: %s (line %d)", path, je.text, je.line);
        return -1;
    }
    if (load_axis(root, "prefill_isl", m->prefill.x, &m->prefill.n, err, errlen)
        || load_axis(root, "prefill_ttft_ms", m->prefill.y, &ny, err, errlen)
        || load_axis(root, "decode_active_kv_tokens", m->a, &m->na, err, errlen)
        || load_axis(root, "decode_context_length", m->c, &m->nc, err, errlen))
        goto done;
    if (ny != m->prefill.n) {
        snprintf(err, errlen, "profile: prefill_isl and prefill_ttft_ms differ in length");
        goto done;
    }
    json_t *itl = json_object_get(root, "decode_itl");
    if (!json_is_array(itl) || json_array_size(itl) != m->na) {
        snprintf(err, errlen, "profile: 'decode_itl' must have one row per active_kv_tokens value");
        goto done;
    }
    m->itl = malloc(m->na * m->nc * sizeof(double));
    if (m->itl == NULL)
        goto done;
    for (size_t i = 0; i < m->na; i++) {
        json_t *row = json_array_get(itl, i);
        if (!json_is_array(row) || json_array_size(row) != m->nc) {
            snprintf(err, errlen, "profile: each 'decode_itl' row needs one value per context length");
            goto done;
        }
        for (size_t j = 0; j < m->nc; j++) {
            json_t *v = json_array_get(row, j);
            if (!json_is_number(v)) {
                snprintf(err, errlen, "profile: 'decode_itl' must hold numbers");
                goto done;
            }
            m->itl[i * m->nc + j] = json_number_value(v);
        }
    }
    m->profiled = 1;
    rc = 0;
done:
    json_decref(root);
    return rc;
}

kvw_backend_t *kvw_mock_backend_create(const kvw_backend_config_t *cfg, char *err, size_t errlen)
{
    mock_t *m = calloc(1, sizeof(*m));

    if (m == NULL) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    m->b.name = "mock";
    m->b.vocab_size = 256;
    m->b.eos_token_id = 0;      /* NUL: never sampled from the alphabet */
    m->b.max_model_len = 0;
    m->b.block_size = cfg->block_size ? cfg->block_size : 16;
    m->b.num_blocks = cfg->num_blocks ? cfg->num_blocks : 16384;
    m->b.block_bytes = 0;
    m->b.simulated = 1;
    m->b.step = mock_step;
    m->b.destroy = mock_destroy;
    m->speedup = cfg->speedup > 0 ? cfg->speedup : 1;
    m->decode_speedup = cfg->decode_speedup > 0 ? cfg->decode_speedup : 1;
    if (cfg->profile && load_profile(m, cfg->profile, err, errlen)) {
        mock_destroy(&m->b);
        return NULL;
    }
    return &m->b;
}
