/*
 * Samples requests from a kv_synth model: walk the core radix tree from the
 * super-root, append a unique leaf, scale lengths by the knobs, draw arrival
 * gaps. Each knob-dependent draw has its own random stream (see kv_synth.h).
 */
#include "kv_synth_model.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kv_rng.h"

/* Bounds what the multipliers can blow one request up to (2^20 blocks is
 * 512M tokens at 512 per block), so a large knob cannot exhaust memory. */
#define MAX_BLOCKS (1u << 20)

typedef struct {
    const kv_synth_model_t *m;
    kv_synth_knobs_t    k;
    rng_t               path, copy, gap, pool;
    uint32_t           *len;        /* radix node length after the multiplier */
    uint64_t           *base;       /* first core id of each radix node */
    uint64_t            per_copy;   /* core ids in one copy of the tree */
    uint64_t            next_unique;
    uint64_t            clock;      /* sum of source gaps so far, ms */
    uint64_t           *ids;
    size_t              cap_ids;
} sampler_t;

typedef struct {
    uint64_t    ts;
    uint32_t    in, out, n;
} sample_t;

void kv_synth_knobs_default(kv_synth_knobs_t *k)
{
    *k = (kv_synth_knobs_t){ .prefix_len_mult = 1, .prefix_root_mult = 1,
                             .prompt_len_mult = 1, .osl_mult = 1, .speedup = 1,
                             .num_requests = 0, .seed = 0 };
}

int kv_synth_knobs_check(const kv_synth_knobs_t *k, char *err, size_t errlen)
{
    const char *bad = NULL;
    if (!(k->prefix_len_mult > 0 && k->prefix_len_mult <= 1000))
        bad = "--prefix-len-multiplier must be in (0, 1000]";
    else if (k->prefix_root_mult < 1 || k->prefix_root_mult > 1000000)
        bad = "--prefix-root-multiplier must be in [1, 1000000]";
    else if (!(k->prompt_len_mult > 0 && k->prompt_len_mult <= 1000))
        bad = "--prompt-len-multiplier must be in (0, 1000]";
    else if (!(k->osl_mult > 0 && k->osl_mult <= 1000))
        bad = "--osl-multiplier must be in (0, 1000]";
    else if (!(k->speedup > 0 && k->speedup <= 1e6))
        bad = "--speedup-ratio must be in (0, 1e6]";
    if (bad)
        snprintf(err, errlen, "%s", bad);
    return bad ? -1 : 0;
}

static void sampler_free(sampler_t *s)
{
    free(s->len), free(s->base), free(s->ids);
}

static int sampler_init(sampler_t *s, const kv_synth_model_t *m, const kv_synth_knobs_t *k)
{
    memset(s, 0, sizeof(*s));
    s->m = m;
    s->k = *k;
    if (s->k.num_requests == 0)
        s->k.num_requests = m->n_requests;
    rng_seed(&s->path, k->seed, 1);
    rng_seed(&s->copy, k->seed, 2);
    rng_seed(&s->gap, k->seed, 3);
    rng_seed(&s->pool, k->seed, 4);
    s->len = malloc(m->n_node * sizeof(uint32_t));
    s->base = malloc(m->n_node * sizeof(uint64_t));
    s->cap_ids = 1024;
    s->ids = malloc(s->cap_ids * sizeof(uint64_t));
    if (s->len == NULL || s->base == NULL || s->ids == NULL) {
        sampler_free(s);
        return -1;
    }
    for (uint32_t r = 0; r < m->n_node; r++) {
        double l = fmin(llround(m->node[r].len * k->prefix_len_mult), MAX_BLOCKS / 4);
        s->len[r] = r == 0 ? 0 : l < 1 ? 1 : (uint32_t)l;
        s->base[r] = s->per_copy;
        s->per_copy += s->len[r];
    }
    /* unique leaves take ids above every copy of the core tree */
    s->next_unique = s->per_copy * k->prefix_root_mult;
    return 0;
}

static int push_id(sampler_t *s, uint32_t n, uint64_t id)
{
    if (n == s->cap_ids) {
        uint64_t *p = realloc(s->ids, 2 * s->cap_ids * sizeof(uint64_t));
        if (p == NULL)
            return -1;
        s->ids = p;
        s->cap_ids *= 2;
    }
    s->ids[n] = id;
    return 0;
}

static uint32_t clamp32(double x)
{
    return x >= UINT32_MAX ? UINT32_MAX : (uint32_t)x;
}

/* Picks the child whose cumulative range holds x (x < child_sum). */
static uint32_t pick_child(const kv_synth_model_t *m, const kv_synth_node_t *x, uint64_t v)
{
    const uint32_t *cum = m->child_cum + x->first_child;
    uint32_t lo = 0, hi = x->n_child - 1;
    while (lo < hi) {
        uint32_t mid = (lo + hi) / 2;
        if (v < cum[mid])
            hi = mid;
        else
            lo = mid + 1;
    }
    return m->child[x->first_child + lo];
}

static int sample_one(sampler_t *s, sample_t *out)
{
    const kv_synth_model_t *m = s->m;
    const uint32_t bs = m->block_size;
    uint64_t off = s->k.prefix_root_mult > 1
                   ? rng_below(&s->copy, s->k.prefix_root_mult) * s->per_copy : 0;
    uint32_t r = 0, n = 0;
    const kv_synth_exit_t *e;
    int tail;

    for (;;) {      /* walk the core tree, emitting each radix node's blocks */
        const kv_synth_node_t *x = &m->node[r];
        uint64_t v = rng_below(&s->path, x->count);
        if (v < x->child_sum) {
            r = pick_child(m, x, v);
            for (uint32_t i = 0; i < s->len[r]; i++)
                if (push_id(s, n++, off + s->base[r] + i))
                    return -1;
            continue;
        }
        v -= x->child_sum;
        e = &m->exits[x->first_exit + v];
        tail = v < x->n_tail;       /* else the "cache end" sentinel */
        break;
    }
    uint32_t tokens = e->tokens, osl = e->osl;
    if (s->k.pooled_lengths) {
        if (tail)
            tokens = m->exits[m->tail_exits[rng_below(&s->pool, m->n_tail_exits)]].tokens;
        osl = m->exits[rng_below(&s->pool, m->n_requests)].osl;
    }
    double in;
    if (tail) {
        double u = llround(tokens * s->k.prompt_len_mult);
        /* a multiplied prompt stays within uint32 tokens and MAX_BLOCKS ids */
        double room = fmin((double)UINT32_MAX - (double)n * bs, (double)(MAX_BLOCKS - n) * bs);
        u = fmin(u, room);
        if (u < 1)
            u = 1;
        double tb = ceil(u / bs);
        for (double i = 0; i < tb; i++)
            if (push_id(s, n++, s->next_unique++))
                return -1;
        in = (double)(n - tb) * bs + u;
    } else {
        in = n ? (double)(n - 1) * bs + tokens : tokens;
    }
    double o = osl ? llround(osl * s->k.osl_mult) : 0;
    out->in = clamp32(in);
    out->out = osl && o < 1 ? 1 : clamp32(o);
    out->n = n;
    out->ts = s->k.speedup == 1 ? s->clock : (uint64_t)((double)s->clock / s->k.speedup);
    if (m->n_gaps)
        s->clock += m->gaps[rng_below(&s->gap, m->n_gaps)];
    return 0;
}

int kv_synth_generate(const kv_synth_model_t *m, const kv_synth_knobs_t *k, kv_trace_t *out)
{
    sampler_t s;
    sample_t q;
    if (sampler_init(&s, m, k))
        return -1;
    for (uint64_t i = 0; i < s.k.num_requests; i++)
        if (sample_one(&s, &q) || kv_trace_add(out, q.ts, q.in, q.out, s.ids, q.n)) {
            sampler_free(&s);
            return -1;
        }
    sampler_free(&s);
    return 0;
}

/* --- fast JSONL output ---------------------------------------------------- */

typedef struct {
    FILE   *f;
    char    buf[1 << 16];
    size_t  pos;
    int     err;
} outbuf_t;

static void ob_flush(outbuf_t *b)
{
    if (b->pos && fwrite(b->buf, 1, b->pos, b->f) != b->pos)
        b->err = 1;
    b->pos = 0;
}

static inline void ob_room(outbuf_t *b, size_t n)
{
    if (b->pos + n > sizeof(b->buf))
        ob_flush(b);
}

static inline void ob_str(outbuf_t *b, const char *s, size_t n)
{
    ob_room(b, n);
    memcpy(b->buf + b->pos, s, n);
    b->pos += n;
}

static inline void ob_u64(outbuf_t *b, uint64_t v)
{
    char tmp[20];
    int i = 20;
    do {
        tmp[--i] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    ob_str(b, tmp + i, (size_t)(20 - i));
}

#define OB_LIT(b, s) ob_str(b, s, sizeof(s) - 1)

int kv_synth_write(const kv_synth_model_t *m, const kv_synth_knobs_t *k, FILE *f)
{
    sampler_t s;
    sample_t q;
    outbuf_t *b = malloc(sizeof(*b));
    if (b == NULL || sampler_init(&s, m, k)) {
        free(b);
        return -1;
    }
    b->f = f, b->pos = 0, b->err = 0;
    int rc = 0;
    for (uint64_t i = 0; i < s.k.num_requests && !b->err; i++) {
        if (sample_one(&s, &q)) {
            rc = -1;
            break;
        }
        OB_LIT(b, "{\"timestamp\": ");
        ob_u64(b, q.ts);
        OB_LIT(b, ", \"input_length\": ");
        ob_u64(b, q.in);
        OB_LIT(b, ", \"output_length\": ");
        ob_u64(b, q.out);
        OB_LIT(b, ", \"hash_ids\": [");
        for (uint32_t j = 0; j < q.n; j++) {
            if (j)
                OB_LIT(b, ", ");
            ob_u64(b, s.ids[j]);
        }
        OB_LIT(b, "]}\n");
    }
    ob_flush(b);
    if (b->err || fflush(f))
        rc = -1;
    free(b);
    sampler_free(&s);
    return rc;
}
