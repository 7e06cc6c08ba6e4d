/*
 * Builds the synthesizer model from a trace: prefix trie, tree-property
 * check, unique-node marking, radix contraction of the core tree and the
 * per-node exit records (see kv_synth.h for the why).
 */
#include "kv_synth_model.h"

#include <stdlib.h>
#include <string.h>

#define ROOT 0u

typedef struct {
    uint64_t    id;
    uint32_t    parent;
    uint32_t    count;          /* requests through this block */
    uint32_t    n_core_child;   /* children with count >= 2 */
    uint32_t    n_exit;         /* requests leaving the core tree here */
    uint32_t    radix;          /* radix node holding this (core) block */
} trie_node_t;

typedef struct {
    trie_node_t    *node;
    uint32_t        n;
    uint32_t       *slot;       /* node index, 0 = empty (root is never stored) */
    size_t          mask;
} trie_t;

typedef struct {                /* where one source request left the core */
    uint32_t    radix;
    uint8_t     tail;
    kv_synth_exit_t rec;
} req_exit_t;

static size_t mix(uint64_t a, uint64_t b)
{
    uint64_t h = (a ^ (b * 0x9e3779b97f4a7c15ull)) * 0xbf58476d1ce4e5b9ull;
    return (size_t)(h ^ (h >> 31));
}

static size_t pow2_at_least(size_t n)
{
    size_t c = 1024;
    while (c < n)
        c *= 2;
    return c;
}

/* The child of parent for id, created if absent. */
static uint32_t trie_step(trie_t *t, uint32_t parent, uint64_t id)
{
    for (size_t i = mix(parent, id) & t->mask; ; i = (i + 1) & t->mask) {
        uint32_t v = t->slot[i];
        if (v == 0) {
            v = t->n++;
            t->node[v] = (trie_node_t){ .id = id, .parent = parent };
            t->slot[i] = v;
            return v;
        }
        if (t->node[v].parent == parent && t->node[v].id == id)
            return v;
    }
}

static int trie_build(trie_t *t, const kv_trace_t *tr)
{
    size_t cap = tr->n_hash_ids + 1;
    t->node = calloc(cap, sizeof(*t->node));
    t->mask = pow2_at_least(2 * cap) - 1;
    t->slot = calloc(t->mask + 1, sizeof(uint32_t));
    if (t->node == NULL || t->slot == NULL)
        return -1;
    t->n = 1;                   /* node 0: the super-root */
    t->node[ROOT].count = (uint32_t)tr->n;
    for (size_t r = 0; r < tr->n; r++) {
        const uint64_t *ids = kv_trace_ids(tr, &tr->reqs[r]);
        uint32_t v = ROOT;
        for (uint32_t j = 0; j < tr->reqs[r].n_hash; j++) {
            v = trie_step(t, v, ids[j]);
            t->node[v].count++;
        }
    }
    return 0;
}

/*
 * The tree property: an id names one block after one prefix, so it has one
 * parent id. Counts ids seen under two parents, and the distinct ids.
 */
static int check_tree(const trie_t *t, uint64_t *violations, uint64_t *distinct)
{
    size_t mask = pow2_at_least(2 * (size_t)t->n) - 1;
    uint64_t *key = malloc((mask + 1) * sizeof(uint64_t));
    uint64_t *par = malloc((mask + 1) * sizeof(uint64_t));
    uint8_t *used = calloc(mask + 1, 1);
    if (key == NULL || par == NULL || used == NULL) {
        free(key), free(par), free(used);
        return -1;
    }
    *violations = *distinct = 0;
    for (uint32_t v = 1; v < t->n; v++) {
        uint64_t id = t->node[v].id;
        uint32_t p = t->node[v].parent;
        uint64_t pid = p == ROOT ? UINT64_MAX : t->node[p].id;
        for (size_t i = mix(id, 0) & mask; ; i = (i + 1) & mask) {
            if (!used[i]) {
                used[i] = 1, key[i] = id, par[i] = pid;
                (*distinct)++;
                break;
            }
            if (key[i] == id) {
                *violations += par[i] != pid;
                break;
            }
        }
    }
    free(key), free(par), free(used);
    return 0;
}

/* Records where each request leaves the core tree (count >= 2 blocks). */
static void find_exits(trie_t *t, const kv_trace_t *tr, uint32_t bs, req_exit_t *ex)
{
    for (size_t r = 0; r < tr->n; r++) {
        const kv_trace_req_t *q = &tr->reqs[r];
        const uint64_t *ids = kv_trace_ids(tr, q);
        uint32_t v = ROOT, d = 0;
        for (; d < q->n_hash; d++) {
            uint32_t w = trie_step(t, v, ids[d]);
            if (t->node[w].count < 2)
                break;
            v = w;
        }
        t->node[v].n_exit++;
        ex[r].radix = v;        /* a trie node for now; mapped to radix later */
        ex[r].rec.osl = q->output_length;
        ex[r].tail = d < q->n_hash;
        int64_t in = q->input_length, lo, hi, tok;
        if (ex[r].tail) {       /* unique tokens, kept consistent with the ids */
            int64_t tb = q->n_hash - d;
            lo = (tb - 1) * bs + 1, hi = tb * bs, tok = in - (int64_t)d * bs;
        } else if (d > 0) {     /* tokens in the last, maybe partial, block */
            lo = 1, hi = bs, tok = in - (int64_t)(d - 1) * bs;
        } else {
            lo = hi = tok = 0;  /* an empty prompt */
        }
        tok = tok < lo ? lo : tok > hi ? hi : tok;
        ex[r].rec.tokens = (uint32_t)tok;
    }
}

/* Contracts unary core chains: parents come before children in the trie. */
static int contract(trie_t *t, kv_synth_model_t *m, uint32_t **rparent_out)
{
    uint32_t n = 1, cap = 1024;
    kv_synth_node_t *node = calloc(cap, sizeof(*node));
    uint32_t *rparent = calloc(cap, sizeof(uint32_t)), *level = calloc(cap, sizeof(uint32_t));
    if (node == NULL || rparent == NULL || level == NULL)
        goto nomem;
    node[0].count = t->node[ROOT].count;
    for (uint32_t v = 1; v < t->n; v++)
        if (t->node[v].count >= 2)
            t->node[t->node[v].parent].n_core_child++;
    for (uint32_t v = 1; v < t->n; v++) {
        trie_node_t *tv = &t->node[v], *tp = &t->node[tv->parent];
        if (tv->count < 2)
            continue;
        if (tv->parent != ROOT && tp->n_core_child == 1 && tp->n_exit == 0) {
            tv->radix = tp->radix;          /* the chain goes on */
            node[tv->radix].len++;
            node[tv->radix].depth_blocks++;
            continue;
        }
        if (n == cap) {
            cap *= 2;
            void *a = realloc(node, cap * sizeof(*node)), *b = NULL, *c = NULL;
            if (a) node = a;
            if (a && (b = realloc(rparent, cap * sizeof(uint32_t))) != NULL) rparent = b;
            if (b && (c = realloc(level, cap * sizeof(uint32_t))) != NULL) level = c;
            if (c == NULL)
                goto nomem;
        }
        uint32_t pr = tv->parent == ROOT ? 0 : tp->radix;
        node[n] = (kv_synth_node_t){ .len = 1, .count = tv->count,
                                     .depth_blocks = node[pr].depth_blocks + 1 };
        rparent[n] = pr;
        level[n] = level[pr] + 1;
        if (level[n] > m->info.core_depth)
            m->info.core_depth = level[n];
        if (node[n].depth_blocks > m->info.core_max_blocks)
            m->info.core_max_blocks = node[n].depth_blocks;
        tv->radix = n++;
    }
    for (uint32_t r = 1; r < n; r++)    /* chains grew after their max was taken */
        if (node[r].depth_blocks > m->info.core_max_blocks)
            m->info.core_max_blocks = node[r].depth_blocks;
    free(level);
    m->node = node;
    m->n_node = n;
    *rparent_out = rparent;
    return 0;
nomem:
    free(node), free(rparent), free(level);
    return -1;
}

/* Lays out children (with cumulative counts) and exits per radix node. */
static int layout(kv_synth_model_t *m, const uint32_t *rparent, const req_exit_t *ex, size_t n_req)
{
    uint32_t n = m->n_node, *fill = calloc(n, sizeof(uint32_t));
    m->child = malloc((n ? n : 1) * sizeof(uint32_t));
    m->child_cum = malloc((n ? n : 1) * sizeof(uint32_t));
    m->exits = malloc((n_req ? n_req : 1) * sizeof(kv_synth_exit_t));
    if (fill == NULL || m->child == NULL || m->child_cum == NULL || m->exits == NULL) {
        free(fill);
        return -1;
    }
    for (uint32_t r = 1; r < n; r++)
        m->node[rparent[r]].n_child++;
    for (size_t i = 0; i < n_req; i++) {
        if (ex[i].tail)
            m->node[ex[i].radix].n_tail++;
        else
            m->node[ex[i].radix].n_cache++;
    }
    uint32_t c = 0, e = 0;
    for (uint32_t r = 0; r < n; r++) {
        kv_synth_node_t *x = &m->node[r];
        x->first_child = c, c += x->n_child;
        x->first_exit = e, e += x->n_tail + x->n_cache;
    }
    for (uint32_t r = 1; r < n; r++) {
        kv_synth_node_t *p = &m->node[rparent[r]];
        uint32_t k = p->first_child + fill[rparent[r]]++;
        p->child_sum += m->node[r].count;
        m->child[k] = r;
        m->child_cum[k] = p->child_sum;
    }
    uint32_t *cfill = calloc(n, sizeof(uint32_t));
    if (cfill == NULL) {
        free(fill);
        return -1;
    }
    memset(fill, 0, n * sizeof(uint32_t));
    for (size_t i = 0; i < n_req; i++) {    /* tail exits first, then cache ends */
        uint32_t r = ex[i].radix;
        kv_synth_node_t *x = &m->node[r];
        uint32_t at = ex[i].tail ? fill[r]++ : x->n_tail + cfill[r]++;
        m->exits[x->first_exit + at] = ex[i].rec;
    }
    free(cfill);
    m->tail_exits = malloc((n_req ? n_req : 1) * sizeof(uint32_t));
    if (m->tail_exits == NULL)
        return -1;
    for (uint32_t r = 0; r < n; r++)
        for (uint32_t i = 0; i < m->node[r].n_tail; i++)
            m->tail_exits[m->n_tail_exits++] = m->node[r].first_exit + i;
    free(fill);
    return 0;
}

static void gaps(kv_synth_model_t *m, const kv_trace_t *t)
{
    m->n_gaps = 0;
    for (size_t i = 1; i < t->n; i++) {
        uint64_t a = t->reqs[i - 1].timestamp_ms, b = t->reqs[i].timestamp_ms;
        m->gaps[m->n_gaps++] = b > a ? b - a : 0;   /* unsorted input: no gap */
    }
}

int kv_synth_build(const kv_trace_t *t, uint32_t block_size, kv_synth_model_t **out,
                   char *err, size_t errlen)
{
    trie_t trie = {0};
    req_exit_t *ex = NULL;
    uint32_t *rparent = NULL;
    kv_synth_model_t *m = calloc(1, sizeof(*m));

    *out = NULL;
    if (block_size == 0) {
        snprintf(err, errlen, "block size must be positive");
        free(m);
        return -1;
    }
    if (t->n >= UINT32_MAX || t->n_hash_ids >= UINT32_MAX / 4) {
        snprintf(err, errlen, "trace too large for the synthesizer");
        free(m);
        return -1;
    }
    if (m == NULL || trie_build(&trie, t)
        || (ex = calloc(t->n ? t->n : 1, sizeof(*ex))) == NULL
        || (m->gaps = malloc((t->n ? t->n : 1) * sizeof(uint64_t))) == NULL)
        goto nomem;
    m->block_size = block_size;
    m->n_requests = t->n;
    if (check_tree(&trie, &m->info.tree_violations, &m->info.blocks))
        goto nomem;
    find_exits(&trie, t, block_size, ex);
    if (contract(&trie, m, &rparent))
        goto nomem;
    for (size_t i = 0; i < t->n; i++) {
        uint32_t v = ex[i].radix;
        ex[i].radix = v == ROOT ? 0 : trie.node[v].radix;
    }
    if (layout(m, rparent, ex, t->n))
        goto nomem;
    gaps(m, t);

    m->info.requests = t->n;
    m->info.core_nodes = m->n_node - 1;
    for (uint32_t v = 1; v < trie.n; v++) {
        m->info.core_blocks += trie.node[v].count >= 2;
        m->info.unique_nodes += trie.node[v].count < 2;
    }
    uint64_t internal = 0, kids = 0;
    for (uint32_t r = 0; r < m->n_node; r++)
        if (m->node[r].n_child)
            internal++, kids += m->node[r].n_child;
    m->info.branching = internal ? (double)kids / (double)internal : 0.0;

    free(trie.node), free(trie.slot), free(ex), free(rparent);
    *out = m;
    return 0;
nomem:
    free(trie.node), free(trie.slot), free(ex), free(rparent);
    kv_synth_free(m);
    snprintf(err, errlen, "out of memory");
    return -1;
}

void kv_synth_free(kv_synth_model_t *m)
{
    if (m == NULL)
        return;
    free(m->node), free(m->child), free(m->child_cum), free(m->exits), free(m->gaps);
    free(m->tail_exits);
    free(m);
}

void kv_synth_info(const kv_synth_model_t *m, kv_synth_info_t *info)
{
    *info = m->info;
}
