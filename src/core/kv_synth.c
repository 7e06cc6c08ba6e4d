/* Trace synthesis: learn a trace's prefix tree, sample new traces (kv_synth.h). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_synth.h"

#define SUPER       UINT32_MAX          /* the super-root, parent of first ids */
#define EXPAND_BIT  0x4000000000000000ULL     /* ids made by the prefix length
                                                  multiplier: hashed into the
                                                  top quarter, far above the
                                                  small ids traces use */

typedef struct {
    uint64_t    id;
    uint32_t    parent;                 /* node index or SUPER */
    uint32_t    visits;
} node_t;

typedef struct {
    uint32_t    leaf;                   /* unique ids after the core path */
    uint32_t    residual;               /* tokens in the last, partial block */
    uint32_t    output;
} tuple_t;

typedef struct {
    uint32_t    node;                   /* child node, or SUPER for "end" */
    uint64_t    cum;                    /* cumulative weight */
} choice_t;

struct kv_synth {
    const kv_trace_t *trace;
    uint32_t    block_size;
    node_t     *nodes;
    uint32_t    n_nodes;
    uint64_t   *map_id;                 /* id -> node, open addressing */
    uint32_t   *map_node;
    uint64_t    map_mask;
    choice_t   *choices;                /* per node (and the super-root, last) */
    uint32_t   *choice_off;             /* n_nodes + 2 offsets */
    tuple_t    *tuples;                 /* grouped by end node */
    uint32_t   *tuple_off;              /* n_nodes + 2 offsets */
    uint64_t   *gaps;                   /* inter-arrival times, ms */
    size_t      n_gaps;
    uint64_t    max_id;
};

void kv_synth_knobs_default(kv_synth_knobs_t *k)
{
    memset(k, 0, sizeof(*k));
    k->prefix_len_multiplier = 1;
    k->prefix_root_multiplier = 1;
    k->prompt_len_multiplier = 1;
    k->osl_multiplier = 1;
    k->speedup_ratio = 1;
    k->seed = 42;
    k->block_size = 512;
}

static uint64_t mix(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    return x ^ (x >> 33);
}

static uint32_t node_of(const kv_synth_t *s, uint64_t id)
{
    uint64_t i = mix(id) & s->map_mask;

    for (;; i = (i + 1) & s->map_mask) {
        if (s->map_node[i] == UINT32_MAX) {
            return UINT32_MAX;
        }
        if (s->map_id[i] == id) {
            return s->map_node[i];
        }
    }
}

static uint32_t node_add(kv_synth_t *s, uint64_t id, uint32_t parent, int *conflict)
{
    uint64_t i = mix(id) & s->map_mask;

    for (;; i = (i + 1) & s->map_mask) {
        if (s->map_node[i] == UINT32_MAX) {
            s->map_id[i] = id;
            s->map_node[i] = s->n_nodes;
            s->nodes[s->n_nodes].id = id;
            s->nodes[s->n_nodes].parent = parent;
            s->nodes[s->n_nodes].visits = 0;
            return s->n_nodes++;
        }
        if (s->map_id[i] == id) {
            *conflict = s->nodes[s->map_node[i]].parent != parent;
            return s->map_node[i];
        }
    }
}

static uint32_t residual_of(const kv_trace_req_t *r, uint32_t bs)
{
    if (r->n_hash == 0) {
        return r->input_length;
    }
    if (r->input_length <= (uint64_t) (r->n_hash - 1) * bs) {
        return 1;
    }
    return (uint32_t) (r->input_length - (uint64_t) (r->n_hash - 1) * bs);
}

/* Leading ids of r shared with another request. */
static uint32_t core_depth(const kv_synth_t *s, const kv_trace_req_t *r)
{
    const uint64_t *ids = kv_trace_ids(s->trace, r);
    uint32_t        d;

    for (d = 0; d < r->n_hash && s->nodes[node_of(s, ids[d])].visits >= 2; d++) {
        /* void */
    }
    return d;
}

static int build_tree(kv_synth_t *s, char *err, size_t errlen)
{
    const kv_trace_t *t = s->trace;
    uint64_t          cap;
    size_t            i;

    for (cap = 1024; cap < 2 * t->n_hash_ids + 2; cap *= 2) {
        /* void */
    }
    s->map_mask = cap - 1;
    s->map_id = malloc(cap * sizeof(uint64_t));
    s->map_node = malloc(cap * sizeof(uint32_t));
    s->nodes = malloc((t->n_hash_ids + 1) * sizeof(node_t));
    if (!s->map_id || !s->map_node || !s->nodes) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    memset(s->map_node, 0xff, cap * sizeof(uint32_t));
    for (i = 0; i < t->n; i++) {
        const kv_trace_req_t *r = &t->reqs[i];
        const uint64_t       *ids = kv_trace_ids(t, r);
        uint32_t              parent = SUPER, j, v;
        int                   conflict = 0;

        for (j = 0; j < r->n_hash; j++) {
            v = node_add(s, ids[j], parent, &conflict);
            if (conflict) {
                snprintf(err, errlen, "request %zu: hash id %llu follows two different "
                         "parents: not a prefix tree", i + 1, (unsigned long long) ids[j]);
                return -1;
            }
            /* an id repeated within one request counts once */
            if (j == 0 || node_of(s, ids[j - 1]) != v) {
                s->nodes[v].visits++;
            }
            if (ids[j] > s->max_id) {
                s->max_id = ids[j];
            }
            parent = v;
        }
    }
    return 0;
}

/* End tuples grouped by end node (counting sort); the super-root is n_nodes. */
static int build_tuples(kv_synth_t *s)
{
    const kv_trace_t *t = s->trace;
    uint32_t          n = s->n_nodes + 1, *fill;
    size_t            i;

    s->tuple_off = calloc(n + 1, sizeof(uint32_t));
    s->tuples = malloc((t->n + 1) * sizeof(tuple_t));
    fill = calloc(n + 1, sizeof(uint32_t));
    if (!s->tuple_off || !s->tuples || !fill) {
        free(fill);
        return -1;
    }
    for (i = 0; i < t->n; i++) {
        uint32_t d = core_depth(s, &t->reqs[i]);
        uint32_t e = d ? node_of(s, kv_trace_ids(t, &t->reqs[i])[d - 1]) : s->n_nodes;

        s->tuple_off[e + 1]++;
    }
    for (i = 0; i < n; i++) {
        s->tuple_off[i + 1] += s->tuple_off[i];
    }
    for (i = 0; i < t->n; i++) {
        const kv_trace_req_t *r = &t->reqs[i];
        uint32_t d = core_depth(s, r);
        uint32_t e = d ? node_of(s, kv_trace_ids(t, r)[d - 1]) : s->n_nodes;
        tuple_t *tp = &s->tuples[s->tuple_off[e] + fill[e]++];

        tp->leaf = r->n_hash - d;
        tp->residual = residual_of(r, s->block_size);
        tp->output = r->output_length;
    }
    free(fill);
    return 0;
}

/* Choices per node: core children weighted by visits, then "end". */
static int build_choices(kv_synth_t *s)
{
    uint32_t  n = s->n_nodes + 1, v, p, *fill;
    uint64_t  total = 0;

    s->choice_off = calloc(n + 1, sizeof(uint32_t));
    s->choices = malloc((s->n_nodes + n + 1) * sizeof(choice_t));
    fill = calloc(n + 1, sizeof(uint32_t));
    if (!s->choice_off || !s->choices || !fill) {
        free(fill);
        return -1;
    }
    for (v = 0; v < s->n_nodes; v++) {
        if (s->nodes[v].visits >= 2) {
            p = s->nodes[v].parent == SUPER ? s->n_nodes : s->nodes[v].parent;
            s->choice_off[p + 1]++;
        }
    }
    for (v = 0; v < n; v++) {
        s->choice_off[v + 1] += s->choice_off[v] + 1;   /* + the end choice */
    }
    for (v = 0; v < s->n_nodes; v++) {
        if (s->nodes[v].visits >= 2) {
            p = s->nodes[v].parent == SUPER ? s->n_nodes : s->nodes[v].parent;
            s->choices[s->choice_off[p] + fill[p]++].node = v;
        }
    }
    for (v = 0; v < n; v++) {
        uint32_t a = s->choice_off[v], b = s->choice_off[v + 1], k;

        s->choices[b - 1].node = SUPER;
        total = 0;
        for (k = a; k < b; k++) {
            total += s->choices[k].node == SUPER
                     ? s->tuple_off[v + 1] - s->tuple_off[v]
                     : s->nodes[s->choices[k].node].visits;
            s->choices[k].cum = total;
        }
    }
    free(fill);
    return 0;
}

static int build_gaps(kv_synth_t *s)
{
    const kv_trace_t *t = s->trace;
    size_t            i;

    s->gaps = malloc((t->n + 1) * sizeof(uint64_t));
    if (s->gaps == NULL) {
        return -1;
    }
    for (i = 1; i < t->n; i++) {
        uint64_t a = t->reqs[i - 1].timestamp_ms, b = t->reqs[i].timestamp_ms;

        s->gaps[s->n_gaps++] = b > a ? b - a : 0;
    }
    if (s->n_gaps == 0) {
        s->gaps[s->n_gaps++] = 0;
    }
    return 0;
}

kv_synth_t *kv_synth_learn(const kv_trace_t *t, uint32_t block_size, char *err, size_t errlen)
{
    kv_synth_t *s = calloc(1, sizeof(*s));

    if (s == NULL) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    s->trace = t;
    s->block_size = block_size ? block_size : 512;
    if (t->n == 0) {
        snprintf(err, errlen, "the trace has no requests");
        goto fail;
    }
    if (build_tree(s, err, errlen) != 0) {
        goto fail;
    }
    if (build_tuples(s) != 0 || build_choices(s) != 0 || build_gaps(s) != 0) {
        snprintf(err, errlen, "out of memory");
        goto fail;
    }
    return s;
fail:
    kv_synth_free(s);
    return NULL;
}

void kv_synth_free(kv_synth_t *s)
{
    if (s == NULL) {
        return;
    }
    free(s->nodes);
    free(s->map_id);
    free(s->map_node);
    free(s->choices);
    free(s->choice_off);
    free(s->tuples);
    free(s->tuple_off);
    free(s->gaps);
    free(s);
}

/* --- sampling ------------------------------------------------------------ */

static uint64_t rnd(uint64_t *st)
{
    uint64_t x = *st;

    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *st = x;
    return x * 0x2545f4914f6cdd1dULL;
}

static uint32_t choose(const kv_synth_t *s, uint32_t v, uint64_t *st)
{
    uint32_t a = s->choice_off[v], b = s->choice_off[v + 1], lo = a, hi = b - 1;
    uint64_t total = s->choices[b - 1].cum, r;

    if (total == 0) {
        return SUPER;
    }
    r = rnd(st) % total;
    while (lo < hi) {
        uint32_t mid = (lo + hi) / 2;

        if (s->choices[mid].cum > r) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    return s->choices[lo].node;
}

/* How many ids core node v stands for under the prefix length multiplier:
 * fixed per node, so requests that share v still share its ids. */
static uint32_t expand(uint64_t id, double m)
{
    double   whole = floor(m), frac = m - whole;
    double   u = (double) (mix(id ^ 0x5bd1e995) >> 11) / 9007199254740992.0;

    return (uint32_t) whole + (u < frac ? 1 : 0);
}

typedef struct {
    uint64_t   *ids;
    size_t      n, cap;
} idbuf_t;

static int push(idbuf_t *b, uint64_t id)
{
    if (b->n == b->cap) {
        size_t    cap = b->cap ? b->cap * 2 : 256;
        uint64_t *p = realloc(b->ids, cap * sizeof(uint64_t));

        if (p == NULL) {
            return -1;
        }
        b->ids = p;
        b->cap = cap;
    }
    b->ids[b->n++] = id;
    return 0;
}

static int core_ids(const kv_synth_t *s, const kv_synth_knobs_t *k, uint32_t v,
                    uint64_t copy, idbuf_t *b)
{
    uint64_t id = s->nodes[v].id, base = copy * (s->max_id + 1);
    uint32_t n = k->prefix_len_multiplier == 1 ? 1 : expand(id, k->prefix_len_multiplier), j;

    for (j = 0; j < n; j++) {
        uint64_t x = j == 0 ? id + base
                            : EXPAND_BIT | (mix(id * 31 + j + (copy << 40)) & (EXPAND_BIT - 1));

        if (push(b, x) != 0) {
            return -1;
        }
    }
    return 0;
}

int kv_synth_sample(const kv_synth_t *s, const kv_synth_knobs_t *k, kv_trace_t *out)
{
    uint64_t  st = mix(k->seed + 1) | 1, n = k->num_requests ? k->num_requests : s->trace->n;
    uint64_t  fresh = (s->max_id + 1) * (k->prefix_root_multiplier ? k->prefix_root_multiplier : 1);
    uint32_t  bs = k->block_size ? k->block_size : s->block_size, roots;
    double    clock = 0, speed = k->speedup_ratio > 0 ? k->speedup_ratio : 1;
    idbuf_t   b = { NULL, 0, 0 };
    uint64_t  i;

    roots = k->prefix_root_multiplier ? k->prefix_root_multiplier : 1;
    for (i = 0; i < n; i++) {
        uint32_t  v = s->n_nodes, next, leaf, res, tn;
        uint64_t  copy = roots > 1 ? rnd(&st) % roots : 0, out_len;
        tuple_t   tp;

        b.n = 0;
        while ((next = choose(s, v, &st)) != SUPER) {
            if (core_ids(s, k, next, copy, &b) != 0) {
                goto nomem;
            }
            v = next;
        }
        tn = s->tuple_off[v + 1] - s->tuple_off[v];
        tp = s->tuples[s->tuple_off[v] + (tn > 1 ? rnd(&st) % tn : 0)];
        leaf = tp.leaf;
        res = tp.residual;
        if (leaf > 0 && k->prompt_len_multiplier != 1) {
            double tokens = ((double) (leaf - 1) * bs + res) * k->prompt_len_multiplier;
            uint64_t t2 = tokens < 1 ? 1 : (uint64_t) llround(tokens);

            leaf = (uint32_t) ((t2 + bs - 1) / bs);
            res = (uint32_t) (t2 - (uint64_t) (leaf - 1) * bs);
        }
        for (uint32_t j = 0; j < leaf; j++) {
            if (push(&b, fresh++) != 0) {
                goto nomem;
            }
        }
        out_len = (uint64_t) llround(tp.output * k->osl_multiplier);
        if (out_len < 1) out_len = 1;
        if (i > 0) {
            clock += (double) s->gaps[rnd(&st) % s->n_gaps] / speed;
        }
        if (kv_trace_add(out, (uint64_t) llround(clock),
                         b.n ? (uint32_t) ((b.n - 1) * bs + res) : res,
                         (uint32_t) out_len, b.ids, (uint32_t) b.n) != 0)
        {
            goto nomem;
        }
    }
    free(b.ids);
    return 0;
nomem:
    free(b.ids);
    return -1;
}

/* --- statistics ---------------------------------------------------------- */

int kv_synth_stats(const kv_trace_t *t, uint32_t block_size, kv_synth_stats_t *st,
                   char *err, size_t errlen)
{
    kv_synth_t *s;
    double      si = 0, si2 = 0, so = 0, so2 = 0;
    uint64_t    inner = 0, inner_children = 0;
    size_t      i;

    memset(st, 0, sizeof(*st));
    s = kv_synth_learn(t, block_size, err, errlen);
    if (s == NULL) {
        return -1;
    }
    st->requests = t->n;
    st->blocks = s->n_nodes;
    st->ideal_reuse = kv_trace_ideal_reuse(t);
    for (i = 0; i < t->n; i++) {
        const kv_trace_req_t *r = &t->reqs[i];
        uint32_t              d = core_depth(s, r);

        si += r->input_length;
        si2 += (double) r->input_length * r->input_length;
        so += r->output_length;
        so2 += (double) r->output_length * r->output_length;
        st->unique_leaves += d < r->n_hash;
        if (d > st->depth) st->depth = d;
    }
    st->mean_input_length = si / t->n;
    st->std_input_length = sqrt(fmax(0, si2 / t->n - st->mean_input_length * st->mean_input_length));
    st->mean_output_length = so / t->n;
    st->std_output_length = sqrt(fmax(0, so2 / t->n - st->mean_output_length * st->mean_output_length));
    st->mean_interarrival_ms = t->n > 1
        ? (double) (t->reqs[t->n - 1].timestamp_ms - t->reqs[0].timestamp_ms) / (double) (t->n - 1)
        : 0;
    /* radix nodes: core nodes that begin a contracted chain, i.e. whose
     * parent is the super-root or branches or has requests ending there */
    for (uint32_t v = 0; v < s->n_nodes; v++) {
        uint32_t p, pc, kids;

        if (s->nodes[v].visits < 2) continue;
        st->core_nodes++;
        p = s->nodes[v].parent == SUPER ? s->n_nodes : s->nodes[v].parent;
        pc = s->choice_off[p + 1] - s->choice_off[p] - 1;
        if (p == s->n_nodes || pc != 1 || s->tuple_off[p + 1] > s->tuple_off[p]) {
            st->radix_nodes++;
        }
        kids = s->choice_off[v + 1] - s->choice_off[v] - 1;
        if (kids > 0) {
            inner++;
            inner_children += kids;
        }
    }
    st->branching = inner ? (double) inner_children / (double) inner : 0;
    kv_synth_free(s);
    return 0;
}
