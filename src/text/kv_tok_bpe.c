/*
 * BPE merging of one word, as HF tokenizers' Word::merge_all does: the
 * applicable merge of lowest rank is applied first, ties to the leftmost
 * position, until none applies. Short words use a direct scan; long ones
 * (a 1 MB prompt with no spaces is one word for SentencePiece models) a
 * heap of candidate merges over a linked list, O(n log n).
 */
#include <stdlib.h>
#include <string.h>

#include "kv_tok_int.h"

#define SHORT_WORD  48

static const kv_tok_merge_t *merge_of(const kv_tokenizer_t *t, uint32_t a, uint32_t b)
{
    uint64_t key = (uint64_t) a << 32 | b, h = key * 0x9e3779b97f4a7c15ULL;
    uint32_t i = (uint32_t) (h >> 32) & t->merges_mask;

    for (;; i = (i + 1) & t->merges_mask) {
        if (t->merges[i].key == key) {
            return &t->merges[i];
        }
        if (t->merges[i].key == UINT64_MAX) {
            return NULL;
        }
    }
}

/* Ranks of adjacent pairs kept in an array: each merge re-reads only the
 * two pairs it changed, so a word costs O(n) merge lookups. */
static int merge_short(const kv_tokenizer_t *t, uint32_t *id, size_t n, kv_ids_t *out)
{
    uint32_t rank[SHORT_WORD], mid[SHORT_WORD];
    size_t   i, best;
    const kv_tok_merge_t *m;

    for (i = 0; i + 1 < n; i++) {
        m = merge_of(t, id[i], id[i + 1]);
        rank[i] = m ? m->rank : UINT32_MAX;
        mid[i] = m ? m->id : 0;
    }
    while (n > 1) {
        best = 0;
        for (i = 1; i + 1 < n; i++) {
            if (rank[i] < rank[best]) {
                best = i;
            }
        }
        if (rank[best] == UINT32_MAX) {
            break;
        }
        id[best] = mid[best];
        memmove(&id[best + 1], &id[best + 2], (n - best - 2) * sizeof(uint32_t));
        if (best + 2 < n) {
            memmove(&rank[best + 1], &rank[best + 2], (n - best - 3) * sizeof(uint32_t));
            memmove(&mid[best + 1], &mid[best + 2], (n - best - 3) * sizeof(uint32_t));
        }
        n--;
        if (best > 0) {
            m = merge_of(t, id[best - 1], id[best]);
            rank[best - 1] = m ? m->rank : UINT32_MAX;
            mid[best - 1] = m ? m->id : 0;
        }
        if (best + 1 < n) {
            m = merge_of(t, id[best], id[best + 1]);
            rank[best] = m ? m->rank : UINT32_MAX;
            mid[best] = m ? m->id : 0;
        }
    }
    for (i = 0; i < n; i++) {
        if (kv_ids_push(out, id[i]) != 0) {
            return -1;
        }
    }
    return 0;
}

typedef struct {
    uint32_t rank;
    uint32_t pos;       /* left symbol */
    uint32_t left, right, id;
} cand_t;

static int cand_less(const cand_t *a, const cand_t *b)
{
    return a->rank != b->rank ? a->rank < b->rank : a->pos < b->pos;
}

static void heap_push(cand_t *h, size_t *n, cand_t c)
{
    size_t i = (*n)++;

    while (i > 0 && cand_less(&c, &h[(i - 1) / 2])) {
        h[i] = h[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    h[i] = c;
}

static cand_t heap_pop(cand_t *h, size_t *n)
{
    cand_t top = h[0], last = h[--(*n)];
    size_t i = 0, c;

    while ((c = 2 * i + 1) < *n) {
        if (c + 1 < *n && cand_less(&h[c + 1], &h[c])) {
            c++;
        }
        if (!cand_less(&h[c], &last)) {
            break;
        }
        h[i] = h[c];
        i = c;
    }
    h[i] = last;
    return top;
}

static void consider(const kv_tokenizer_t *t, const uint32_t *id, uint32_t l, uint32_t r,
                     cand_t *h, size_t *hn)
{
    const kv_tok_merge_t *m = merge_of(t, id[l], id[r]);

    if (m) {
        cand_t c = { m->rank, l, id[l], id[r], m->id };

        heap_push(h, hn, c);
    }
}

static int merge_long(const kv_tokenizer_t *t, uint32_t *id, size_t n, kv_ids_t *out)
{
    uint32_t *next = malloc(n * sizeof(uint32_t)), *prev = malloc(n * sizeof(uint32_t));
    cand_t   *h = malloc(2 * n * sizeof(cand_t));
    size_t    hn = 0, i;
    int       rc = -1;

    if (!next || !prev || !h) {
        goto done;
    }
    for (i = 0; i < n; i++) {
        next[i] = i + 1 < n ? (uint32_t) i + 1 : UINT32_MAX;
        prev[i] = i ? (uint32_t) i - 1 : UINT32_MAX;
    }
    for (i = 0; i + 1 < n; i++) {
        consider(t, id, (uint32_t) i, (uint32_t) i + 1, h, &hn);
    }
    while (hn) {
        cand_t   c = heap_pop(h, &hn);
        uint32_t r = next[c.pos];

        /* stale: the pair changed since this candidate was pushed */
        if (id[c.pos] != c.left || r == UINT32_MAX || id[r] != c.right) {
            continue;
        }
        id[c.pos] = c.id;
        next[c.pos] = next[r];
        if (next[r] != UINT32_MAX) {
            prev[next[r]] = c.pos;
        }
        id[r] = UINT32_MAX;     /* dead */
        if (prev[c.pos] != UINT32_MAX) {
            consider(t, id, prev[c.pos], c.pos, h, &hn);
        }
        if (next[c.pos] != UINT32_MAX) {
            consider(t, id, c.pos, next[c.pos], h, &hn);
        }
    }
    for (i = 0; i != UINT32_MAX && i < n; i = next[i]) {
        if (kv_ids_push(out, id[i]) != 0) {
            goto done;
        }
    }
    rc = 0;
done:
    free(next);
    free(prev);
    free(h);
    return rc;
}

int kv_tok_bpe_word(const kv_tokenizer_t *t, const uint32_t *syms, size_t n, kv_ids_t *out)
{
    uint32_t  local[SHORT_WORD], *id = local;
    int       rc;

    if (n == 0) {
        return 0;
    }
    if (n == 1) {
        return kv_ids_push(out, syms[0]);
    }
    if (n > SHORT_WORD) {
        id = malloc(n * sizeof(uint32_t));
        if (id == NULL) {
            return -1;
        }
    }
    memcpy(id, syms, n * sizeof(uint32_t));
    rc = n > SHORT_WORD ? merge_long(t, id, n, out) : merge_short(t, id, n, out);
    if (id != local) {
        free(id);
    }
    return rc;
}
