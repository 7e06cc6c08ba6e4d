/* vLLM / SGLang KVEventBatch decoding (see kv_vllm_event.h). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include <xxhash.h>

#include "kv_hash.h"
#include "kv_vllm_event.h"

/* Limits that keep a hostile message from asking for absurd work. */
#define MAX_BLOCK_SIZE  (1u << 20)

static int fail(kv_vllm_batch_t *b, char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static int fail(kv_vllm_batch_t *b, char *err, size_t errlen, const char *fmt, ...)
{
    va_list ap;

    if (err && errlen) {
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    b->n_events = 0;
    b->n_h = b->n_t = 0;
    return -1;
}

void kv_vllm_batch_init(kv_vllm_batch_t *b)
{
    memset(b, 0, sizeof(*b));
}

void kv_vllm_batch_free(kv_vllm_batch_t *b)
{
    kv_tree_free(&b->tree);
    free(b->events);
    free(b->hashes);
    free(b->tokens);
    memset(b, 0, sizeof(*b));
}

static int grow(void **p, size_t *cap, size_t need, size_t size)
{
    size_t  n;
    void   *q;

    if (need <= *cap) {
        return 0;
    }
    n = *cap ? *cap : 64;
    while (n < need) {
        n *= 2;
    }
    q = realloc(*p, n * size);
    if (q == NULL) {
        return -1;
    }
    *p = q;
    *cap = n;
    return 0;
}

int kv_vllm_seq(const void *frame, size_t len, uint64_t *seq)
{
    const uint8_t *p = frame;
    uint64_t       v = 0;
    size_t         i;

    if (len != 8) {
        return -1;
    }
    for (i = 0; i < 8; i++) {
        v = v << 8 | p[i];
    }
    *seq = v;
    return 0;
}

static int ieq(const char *s, size_t len, const char *lit)
{
    return strlen(lit) == len && strncasecmp(s, lit, len) == 0;
}

kv_tier_t kv_vllm_tier(const char *m, size_t len)
{
    if (m == NULL || len == 0 || ieq(m, len, "gpu") || ieq(m, len, "cuda")
        || ieq(m, len, "device") || ieq(m, len, "hbm"))
    {
        return KV_TIER_DEVICE;
    }
    if (ieq(m, len, "cpu") || ieq(m, len, "host") || ieq(m, len, "cpu_pinned")
        || ieq(m, len, "dram"))
    {
        return KV_TIER_HOST;
    }
    return KV_TIER_DISK;
}

uint64_t kv_vllm_lora_seed(const kv_vllm_event_t *e)
{
    char buf[32];
    int  n;

    if (e->lora_name && e->lora_name_len) {
        return kv_hash_seed(e->lora_name, e->lora_name_len);
    }
    if (e->has_lora_id) {
        n = snprintf(buf, sizeof(buf), "lora-%lld", (long long) e->lora_id);
        return kv_hash_seed(buf, (size_t) n);
    }
    return KV_HASH_SEED;
}

/* One block hash: int bit-cast, bytes hashed. */
static int node_hash(const kv_tnode_t *x, uint64_t *out)
{
    switch (x->type) {
    case KV_T_UINT:
    case KV_T_NEG:
        *out = x->u;
        return 0;
    case KV_T_BIN:
    case KV_T_STR:
        if (x->len == 0) {
            return -1;
        }
        *out = XXH3_64bits(x->s, x->len);
        return 0;
    default:
        return -1;
    }
}

/* Appends the hashes of array node a; their offset in *off. */
static int hash_list(kv_vllm_batch_t *b, uint32_t a, size_t *off, size_t *n)
{
    const kv_tree_t *t = &b->tree;
    uint32_t         i, k;

    if (t->nodes[a].type != KV_T_ARR) {
        return -1;
    }
    if (grow((void **) &b->hashes, &b->cap_h, b->n_h + t->nodes[a].n, sizeof(uint64_t)) != 0) {
        return -1;
    }
    *off = b->n_h;
    for (i = 0, k = kv_tree_first(a); i < t->nodes[a].n; i++, k = kv_tree_next(t, k)) {
        if (node_hash(&t->nodes[k], &b->hashes[b->n_h]) != 0) {
            return -1;
        }
        b->n_h++;
    }
    *n = t->nodes[a].n;
    return 0;
}

/* The children of array node a, up to max, into kids; their count. */
static uint32_t children(const kv_tree_t *t, uint32_t a, uint32_t *kids, uint32_t max)
{
    uint32_t i, k, n = t->nodes[a].n < max ? t->nodes[a].n : max;

    for (i = 0, k = kv_tree_first(a); i < n; i++, k = kv_tree_next(t, k)) {
        kids[i] = k;
    }
    return n;
}

static const char *str_of(const kv_tnode_t *x, size_t *len)
{
    if (x->type == KV_T_STR) {
        *len = x->len;
        return x->s;
    }
    *len = 0;
    return NULL;
}

/* Offsets of an event's arrays while they may still move. */
typedef struct {
    size_t h_off, t_off;
} pending_t;

static int decode_stored(kv_vllm_batch_t *b, kv_vllm_event_t *e, pending_t *pe,
                         const uint32_t *f, uint32_t nf, char *err, size_t errlen)
{
    const kv_tree_t  *t = &b->tree;
    const kv_tnode_t *x;
    uint32_t          i, k, a;
    size_t            len;
    const char       *s;

    if (nf < 7) {
        return fail(b, err, errlen, "BlockStored has %u fields, expected at least 7", nf - 1);
    }
    e->kind = KV_VLLM_STORED;
    if (hash_list(b, f[1], &pe->h_off, &e->n_hashes) != 0) {
        return fail(b, err, errlen, "BlockStored block_hashes is not a list of int or bytes");
    }
    x = &t->nodes[f[2]];
    if (x->type != KV_T_NULL) {
        if (node_hash(x, &e->parent) != 0) {
            return fail(b, err, errlen, "BlockStored parent_block_hash is not int, bytes or nil");
        }
        e->has_parent = 1;
    }
    x = &t->nodes[f[4]];
    if (x->type != KV_T_UINT || x->u == 0 || x->u > MAX_BLOCK_SIZE) {
        return fail(b, err, errlen, "BlockStored block_size is not a positive int");
    }
    e->block_size = (uint32_t) x->u;

    a = f[3];
    if (t->nodes[a].type != KV_T_ARR) {
        return fail(b, err, errlen, "BlockStored token_ids is not a list");
    }
    e->n_tokens = t->nodes[a].n;
    if (e->n_tokens && e->n_tokens != e->n_hashes * e->block_size) {
        return fail(b, err, errlen, "BlockStored has %zu token ids for %zu blocks of %u",
                    e->n_tokens, e->n_hashes, e->block_size);
    }
    if (grow((void **) &b->tokens, &b->cap_t, b->n_t + e->n_tokens, sizeof(uint32_t)) != 0) {
        return fail(b, err, errlen, "out of memory");
    }
    pe->t_off = b->n_t;
    for (i = 0, k = kv_tree_first(a); i < e->n_tokens; i++, k = kv_tree_next(t, k)) {
        x = &t->nodes[k];
        if (x->type != KV_T_UINT || x->u > UINT32_MAX) {
            return fail(b, err, errlen, "BlockStored token id %u is not a u32", i);
        }
        b->tokens[b->n_t++] = (uint32_t) x->u;
    }

    x = &t->nodes[f[5]];
    if (x->type == KV_T_UINT || x->type == KV_T_NEG) {
        e->has_lora_id = 1;
        e->lora_id = (int64_t) x->u;
    } else if (x->type != KV_T_NULL) {
        return fail(b, err, errlen, "BlockStored lora_id is not int or nil");
    }
    x = &t->nodes[f[6]];
    if (x->type != KV_T_NULL && x->type != KV_T_STR) {
        return fail(b, err, errlen, "BlockStored medium is not str or nil");
    }
    s = str_of(x, &len);
    e->tier = kv_vllm_tier(s, len);
    if (nf > 7) {
        x = &t->nodes[f[7]];
        if (x->type == KV_T_STR) {
            e->lora_name = str_of(x, &e->lora_name_len);
        } else if (x->type != KV_T_NULL) {
            return fail(b, err, errlen, "BlockStored lora_name is not str or nil");
        }
    }
    return 0;
}

static int decode_removed(kv_vllm_batch_t *b, kv_vllm_event_t *e, pending_t *pe,
                          const uint32_t *f, uint32_t nf, char *err, size_t errlen)
{
    const kv_tnode_t *x;
    const char       *s;
    size_t            len;

    if (nf < 2) {
        return fail(b, err, errlen, "BlockRemoved has no block_hashes");
    }
    e->kind = KV_VLLM_REMOVED;
    if (hash_list(b, f[1], &pe->h_off, &e->n_hashes) != 0) {
        return fail(b, err, errlen, "BlockRemoved block_hashes is not a list of int or bytes");
    }
    if (nf > 2) {
        x = &b->tree.nodes[f[2]];
        if (x->type != KV_T_NULL && x->type != KV_T_STR) {
            return fail(b, err, errlen, "BlockRemoved medium is not str or nil");
        }
        s = str_of(x, &len);
        e->tier = kv_vllm_tier(s, len);
    }
    return 0;
}

/* ts: the tree keeps no float values, so read the first element's bytes. */
static double read_ts(const uint8_t *p, size_t len)
{
    size_t   at;
    uint64_t v = 0;
    uint32_t w = 0;
    double   d;
    float    fl;
    int      i;

    if (len == 0) {
        return 0;
    }
    at = (p[0] & 0xf0) == 0x90 ? 1 : p[0] == 0xdc ? 3 : p[0] == 0xdd ? 5 : len;
    if (at + 9 <= len && p[at] == 0xcb) {
        for (i = 1; i <= 8; i++) {
            v = v << 8 | p[at + i];
        }
        memcpy(&d, &v, 8);
        return d;
    }
    if (at + 5 <= len && p[at] == 0xca) {
        for (i = 1; i <= 4; i++) {
            w = w << 8 | p[at + i];
        }
        memcpy(&fl, &w, 4);
        return fl;
    }
    return 0;
}

int kv_vllm_decode(kv_vllm_batch_t *b, const void *buf, size_t len,
                   char *err, size_t errlen)
{
    kv_tree_t        *t = &b->tree;
    const kv_tnode_t *x;
    kv_vllm_event_t  *e;
    pending_t        *pend = NULL;
    uint32_t          top[3], f[8], nf, nt, ev, i, k;
    size_t            j, n;
    int               rc = -1;

    b->n_events = 0;
    b->n_h = b->n_t = 0;
    b->unknown = 0;
    b->has_dp_rank = 0;
    b->dp_rank = 0;
    b->ts = 0;

    if (kv_tree_msgpack(t, buf, len, err, errlen) != 0) {
        return fail(b, NULL, 0, "bad msgpack");
    }
    if (t->nodes[0].type != KV_T_ARR || t->nodes[0].n < 2) {
        return fail(b, err, errlen, "KVEventBatch is not an array [ts, events, dp_rank?]");
    }
    nt = children(t, 0, top, 3);
    x = &t->nodes[top[0]];
    if (x->type != KV_T_FLOAT && x->type != KV_T_UINT) {
        return fail(b, err, errlen, "KVEventBatch ts is not a number");
    }
    b->ts = x->type == KV_T_UINT ? (double) x->u : read_ts(buf, len);
    if (nt > 2) {
        x = &t->nodes[top[2]];
        if (x->type == KV_T_UINT && x->u <= UINT32_MAX) {
            b->has_dp_rank = 1;
            b->dp_rank = (uint32_t) x->u;
        } else if (x->type != KV_T_NULL) {
            return fail(b, err, errlen, "KVEventBatch data_parallel_rank is not an int or nil");
        }
    }
    ev = top[1];
    if (t->nodes[ev].type != KV_T_ARR) {
        return fail(b, err, errlen, "KVEventBatch events is not a list");
    }
    n = t->nodes[ev].n;
    if (grow((void **) &b->events, &b->cap_events, n ? n : 1, sizeof(kv_vllm_event_t)) != 0
        || (pend = malloc((n ? n : 1) * sizeof(pending_t))) == NULL)
    {
        return fail(b, err, errlen, "out of memory");
    }

    for (i = 0, k = kv_tree_first(ev); i < n; i++, k = kv_tree_next(t, k)) {
        if (t->nodes[k].type != KV_T_ARR || t->nodes[k].n == 0) {
            fail(b, err, errlen, "event %u is not a tagged array", i);
            goto done;
        }
        nf = children(t, k, f, 8);
        if (t->nodes[f[0]].type != KV_T_STR) {
            fail(b, err, errlen, "event %u has no tag", i);
            goto done;
        }
        e = &b->events[b->n_events];
        memset(e, 0, sizeof(*e));
        memset(&pend[b->n_events], 0, sizeof(pending_t));
        if (kv_tree_streq(t, f[0], "BlockStored")) {
            if (decode_stored(b, e, &pend[b->n_events], f, nf, err, errlen) != 0) {
                goto done;
            }
        } else if (kv_tree_streq(t, f[0], "BlockRemoved")) {
            if (decode_removed(b, e, &pend[b->n_events], f, nf, err, errlen) != 0) {
                goto done;
            }
        } else if (kv_tree_streq(t, f[0], "AllBlocksCleared")) {
            e->kind = KV_VLLM_CLEARED;
        } else {
            b->unknown++;
            continue;
        }
        b->n_events++;
    }

    /* the arrays are final now: point into them */
    for (j = 0; j < b->n_events; j++) {
        e = &b->events[j];
        e->hashes = e->n_hashes ? b->hashes + pend[j].h_off : NULL;
        e->tokens = e->n_tokens ? b->tokens + pend[j].t_off : NULL;
    }
    rc = 0;

done:
    free(pend);
    return rc;
}
