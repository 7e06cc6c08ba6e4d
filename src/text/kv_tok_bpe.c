/*
 * BPE merging of one word, as HF tokenizers' Word::merge_all does: the
 * applicable merge of lowest rank is applied first, ties to the leftmost
 * position, until none applies. Short words use a direct scan; long ones
 * (a 1 MB prompt with no spaces is one word) a bucket queue of candidate
 * merges over a linked list of symbols, O(n) queue operations.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "kv_tok_int.h"

#define SHORT_WORD  48

/* The rank of merging (a, b), UINT32_MAX if no merge applies. */
static uint32_t merge_of(const kv_tokenizer_t *t, uint32_t a, uint32_t b)
{
    uint64_t key, e;
    uint32_t i;

    if ((a | b) >> KV_TOK_ID_BITS) {
        return UINT32_MAX;
    }
    key = kv_tok_merge_key(a, b);
    for (i = kv_tok_merge_home(key, t->merges_mask);; i = (i + 1) & t->merges_mask) {
        e = t->merges[i];
        if ((e & ~KV_TOK_RANK_MASK) == key) {
            return (uint32_t) (e & KV_TOK_RANK_MASK);
        }
        if (e == UINT64_MAX) {
            return UINT32_MAX;
        }
    }
}

/* Work done by this thread (kv_tokenizer.h): counts, for tests and benchmarks. */
static __thread kv_tok_work_t work;

void kv_tokenizer_work(kv_tok_work_t *out, int reset)
{
    if (out) {
        *out = work;
    }
    if (reset) {
        memset(&work, 0, sizeof(work));
    }
}

uint32_t kv_tok_merge_rank(const kv_tokenizer_t *t, uint32_t a, uint32_t b)
{
    return merge_of(t, a, b);
}

/* Ranks of adjacent pairs kept in an array (rank[i]: of id[i], id[i + 1],
 * given): each merge re-reads only the two pairs it changed, so a word
 * costs O(n) merge lookups. */
static int merge_loop(const kv_tokenizer_t *t, uint32_t *id, uint32_t *rank, size_t n,
                      kv_ids_t *out)
{
    size_t i, best;

    work.symbols += n;
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
        work.merges++;
        id[best] = t->merge_base >= 0 ? rank[best] + (uint32_t) t->merge_base
                                      : t->merge_id[rank[best]];
        memmove(&id[best + 1], &id[best + 2], (n - best - 2) * sizeof(uint32_t));
        if (best + 2 < n) {
            memmove(&rank[best + 1], &rank[best + 2], (n - best - 3) * sizeof(uint32_t));
        }
        n--;
        if (best > 0) {
            rank[best - 1] = merge_of(t, id[best - 1], id[best]);
        }
        if (best + 1 < n) {
            rank[best] = merge_of(t, id[best], id[best + 1]);
        }
    }
    for (i = 0; i < n; i++) {
        if (kv_ids_push(out, id[i]) != 0) {
            return -1;
        }
    }
    return 0;
}

static int merge_short(const kv_tokenizer_t *t, uint32_t *id, size_t n, kv_ids_t *out)
{
    uint32_t rank[SHORT_WORD];
    size_t   i;

    for (i = 0; i + 1 < n; i++) {
        rank[i] = merge_of(t, id[i], id[i + 1]);
    }
    return merge_loop(t, id, rank, n, out);
}

/* --- long words: a bucket queue over merge ranks ----------------------------
 *
 * A binary heap of candidate merges misses the cache at every level once a
 * word has a million symbols (a 4 MB word took 5.5 s, growing faster than
 * n log n). Ranks are small integers, so candidates go into one bucket per
 * rank instead (lists of chunks in `ent`), and the lowest non-empty bucket is
 * found through a two-level bitmap: O(1) per candidate, no matter the size.
 *
 * HF's order is (rank, position). The lowest bucket is taken whole into
 * `cur` and sorted by position when its turn comes; candidates of the first
 * scan arrive in order, so most buckets need no sort. A merge may make a
 * pair whose rank is not above the bucket being worked (never with merges
 * in training order, but a file may list them so): those go to `low`, a
 * small binary heap served first, or into `cur` in order, which keeps the
 * order exact.
 */
#define DEAD  UINT32_MAX
#define NONE  UINT32_MAX

/* Buckets are lists of chunks of positions (one cache line each): taking
 * a bucket reads memory in runs rather than chasing one pointer per entry. */
#define CHUNK 14

typedef struct {
    uint32_t link, n;
    uint32_t pos[CHUNK];
} bent_t;

/* Per-rank arrays, kept per thread across calls (as the word cache is):
 * only the bitmap is cleared per word. */
typedef struct {
    uint32_t *head;             /* rank -> newest chunk (valid while its bit is set) */
    uint32_t *last;             /* rank -> last position pushed; NONE: out of order */
    uint64_t *bits;             /* rank has candidates */
    uint64_t *summary;          /* bits[i] != 0 */
    size_t    ranks;
} bq_ranks_t;

static __thread bq_ranks_t bq_ranks;
static pthread_key_t       bq_key;          /* frees a thread's arrays when it exits */
static pthread_once_t      bq_once = PTHREAD_ONCE_INIT;

static void ranks_free(void *p)
{
    bq_ranks_t *r = p;

    free(r->head);
    free(r->last);
    free(r->bits);
    free(r->summary);
    memset(r, 0, sizeof(*r));
}

static void bq_key_make(void)
{
    (void) pthread_key_create(&bq_key, ranks_free);
}

/* A symbol of the word and its neighbours, together: merges happen in rank
 * order, all over the word, so each is a cache miss; one, not three. */
typedef struct {
    uint32_t id, next, prev;
} sym_t;

typedef struct {
    const kv_tokenizer_t *t;
    bq_ranks_t *rk;
    sym_t      *sym;
    bent_t     *ent;            /* pool of chunks; free ones chained from `free_ent` */
    size_t      nent, capent;
    uint32_t    free_ent;
    uint32_t   *cur;            /* the bucket being worked, by position */
    size_t      ncur, icur, capcur;
    int64_t     rank;           /* its rank; -1 before the first */
    uint64_t   *low;            /* rank << 32 | pos, min-heap */
    size_t      nlow, caplow;
    int         oom;
} bq_t;

static int grow(void *pp, size_t *cap, size_t need, size_t size)
{
    void  **p = pp;
    size_t  c = *cap ? *cap : 64;
    void   *q;

    if (need <= *cap) {
        return 0;
    }
    while (c < need) {
        c *= 2;
    }
    q = realloc(*p, c * size);
    if (q == NULL) {
        return -1;
    }
    *p = q;
    *cap = c;
    return 0;
}

static int ranks_reserve(size_t ranks)
{
    bq_ranks_t *r = &bq_ranks;
    size_t      words = (ranks + 63) / 64, sums = (words + 63) / 64;

    if (ranks <= r->ranks) {
        return 0;
    }
    ranks_free(r);
    pthread_once(&bq_once, bq_key_make);
    (void) pthread_setspecific(bq_key, r);
    r->head = malloc(ranks * sizeof(uint32_t));
    r->last = malloc(ranks * sizeof(uint32_t));
    r->bits = calloc(words, sizeof(uint64_t));
    r->summary = calloc(sums, sizeof(uint64_t));
    if (!r->head || !r->last || !r->bits || !r->summary) {
        ranks_free(r);
        return -1;
    }
    r->ranks = ranks;
    return 0;
}

static void low_push(bq_t *q, uint64_t key)
{
    size_t i;

    if (grow(&q->low, &q->caplow, q->nlow + 1, sizeof(uint64_t)) != 0) {
        q->oom = 1;
        return;
    }
    for (i = q->nlow++; i > 0 && key < q->low[(i - 1) / 2]; i = (i - 1) / 2) {
        q->low[i] = q->low[(i - 1) / 2];
        work.queue_ops++;
    }
    q->low[i] = key;
}

static uint64_t low_pop(bq_t *q)
{
    uint64_t top = q->low[0], last = q->low[--q->nlow];
    size_t   i = 0, c;

    while ((c = 2 * i + 1) < q->nlow) {
        if (c + 1 < q->nlow && q->low[c + 1] < q->low[c]) {
            c++;
        }
        if (q->low[c] >= last) {
            break;
        }
        q->low[i] = q->low[c];
        i = c;
        work.queue_ops++;
    }
    q->low[i] = last;
    return top;
}

static uint32_t chunk_new(bq_t *q, uint32_t link)
{
    uint32_t e;

    if (q->free_ent != NONE) {
        e = q->free_ent;
        q->free_ent = q->ent[e].link;
    } else {
        if (grow(&q->ent, &q->capent, q->nent + 1, sizeof(bent_t)) != 0) {
            q->oom = 1;
            return NONE;
        }
        e = (uint32_t) q->nent++;
    }
    q->ent[e].link = link;
    q->ent[e].n = 0;
    return e;
}

static void bucket_push(bq_t *q, uint32_t rank, uint32_t pos)
{
    bq_ranks_t *rk = q->rk;
    uint64_t    bit = 1ULL << (rank & 63);
    uint32_t    e;

    if (rk->bits[rank / 64] & bit) {
        e = rk->head[rank];
        if (q->ent[e].n == CHUNK && (e = chunk_new(q, e)) == NONE) {
            return;             /* out of memory: q->oom ends the word */
        }
        if (rk->last[rank] != NONE) {
            rk->last[rank] = pos > rk->last[rank] ? pos : NONE;
        }
    } else {
        if ((e = chunk_new(q, NONE)) == NONE) {
            return;
        }
        rk->last[rank] = pos;
        rk->bits[rank / 64] |= bit;
        rk->summary[rank / 4096] |= 1ULL << (rank / 64 & 63);
    }
    q->ent[e].pos[q->ent[e].n++] = pos;
    rk->head[rank] = e;
}

/* Inserts pos into the rest of the bucket being worked, in order. */
static void cur_insert(bq_t *q, uint32_t pos)
{
    size_t lo = q->icur, hi = q->ncur, mid;

    if (grow(&q->cur, &q->capcur, q->ncur + 1, sizeof(uint32_t)) != 0) {
        q->oom = 1;
        return;
    }
    while (lo < hi) {
        mid = (lo + hi) / 2;
        if (q->cur[mid] < pos) lo = mid + 1; else hi = mid;
    }
    memmove(&q->cur[lo + 1], &q->cur[lo], (q->ncur - lo) * sizeof(uint32_t));
    q->cur[lo] = pos;
    q->ncur++;
    work.queue_ops += q->ncur - lo;
}

static void bq_consider(bq_t *q, uint32_t l, uint32_t r)
{
    uint32_t rank = merge_of(q->t, q->sym[l].id, q->sym[r].id);

    if (rank == UINT32_MAX) {
        return;
    }
    work.queue_ops++;
    if ((int64_t) rank > q->rank) {
        bucket_push(q, rank, l);
    } else if ((int64_t) rank == q->rank) {
        cur_insert(q, l);
    } else {
        low_push(q, (uint64_t) rank << 32 | l);
    }
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *) a, y = *(const uint32_t *) b;

    return x < y ? -1 : x > y;
}

/* Takes the lowest non-empty bucket into cur, by position. 0: none left. */
static int bucket_take(bq_t *q)
{
    bq_ranks_t *rk = q->rk;
    size_t      sums = (rk->ranks + 4095) / 4096, s, w, k, n = 0;
    uint32_t    rank, e, next;

    s = (size_t) (q->rank + 1) / 4096;
    for (; s < sums && rk->summary[s] == 0; s++) {
        work.queue_ops++;
    }
    if (s == sums) {
        return 0;
    }
    w = s * 64 + (size_t) __builtin_ctzll(rk->summary[s]);
    rank = (uint32_t) (w * 64 + (size_t) __builtin_ctzll(rk->bits[w]));
    for (e = rk->head[rank]; e != NONE; e = next) {
        const bent_t *c = &q->ent[e];
        uint32_t      j;

        if (grow(&q->cur, &q->capcur, n + CHUNK, sizeof(uint32_t)) != 0) {
            q->oom = 1;
            return 0;
        }
        for (j = c->n; j > 0; j--) {
            q->cur[n++] = c->pos[j - 1];
        }
        next = c->link;
        q->ent[e].link = q->free_ent;
        q->free_ent = e;
    }
    rk->bits[w] &= ~(1ULL << (rank & 63));
    if (rk->bits[w] == 0) {
        rk->summary[s] &= ~(1ULL << (w & 63));
    }
    for (k = 0; k < n / 2; k++) {           /* read newest first: reverse */
        uint32_t x = q->cur[k];

        q->cur[k] = q->cur[n - 1 - k];
        q->cur[n - 1 - k] = x;
    }
    work.queue_ops += n;
    if (rk->last[rank] == NONE) {
        qsort(q->cur, n, sizeof(uint32_t), cmp_u32);
        for (k = n; k > 1; k >>= 1) {
            work.queue_ops += n;            /* n log n comparisons */
        }
    }
    q->rank = rank;
    q->ncur = n;
    q->icur = 0;
    return 1;
}

static int merge_long(const kv_tokenizer_t *t, uint32_t *id, size_t n, kv_ids_t *out)
{
    bq_t     q;
    sym_t   *y;
    size_t   i, words;
    uint32_t pos, rank, nx;
    int      rc = -1;

    if (n >= NONE || ranks_reserve(t->n_merges ? t->n_merges : 1) != 0) {
        return -1;
    }
    memset(&q, 0, sizeof(q));
    q.t = t;
    q.rk = &bq_ranks;
    q.rank = -1;
    q.free_ent = NONE;
    words = (q.rk->ranks + 63) / 64;      /* a word cut short may leave bits */
    memset(q.rk->bits, 0, words * sizeof(uint64_t));
    memset(q.rk->summary, 0, (words + 63) / 64 * sizeof(uint64_t));
    y = q.sym = malloc(n * sizeof(sym_t));
    if (y == NULL) {
        goto done;
    }
    for (i = 0; i < n; i++) {
        y[i].id = id[i];
        y[i].next = i + 1 < n ? (uint32_t) i + 1 : NONE;
        y[i].prev = i ? (uint32_t) i - 1 : NONE;
    }
    for (i = 0; i + 1 < n && !q.oom; i++) {
        bq_consider(&q, (uint32_t) i, (uint32_t) i + 1);
    }
    work.symbols += n;
    for (;;) {

        if (q.oom) {
            goto done;
        }
        if (q.nlow) {
            uint64_t key = low_pop(&q);

            rank = (uint32_t) (key >> 32);
            pos = (uint32_t) key;
        } else if (q.icur < q.ncur || bucket_take(&q)) {
            rank = (uint32_t) q.rank;
            pos = q.cur[q.icur++];
        } else {
            break;
        }
        /* stale: the pair changed since this candidate was pushed (a pair
         * only grows, so the same rank means the same pair) */
        nx = y[pos].next;
        if (y[pos].id == DEAD || nx == NONE) {
            continue;
        }
        if (merge_of(t, y[pos].id, y[nx].id) != rank) {
            continue;
        }
        work.merges++;
        y[pos].id = t->merge_id[rank];
        y[pos].next = y[nx].next;
        if (y[nx].next != NONE) {
            y[y[nx].next].prev = pos;
        }
        y[nx].id = DEAD;
        if (y[pos].prev != NONE) {
            bq_consider(&q, y[pos].prev, pos);
        }
        if (y[pos].next != NONE) {
            bq_consider(&q, pos, y[pos].next);
        }
    }
    if (q.oom) {
        goto done;
    }
    for (i = 0; i != NONE && i < n; i = y[i].next) {
        if (kv_ids_push(out, y[i].id) != 0) {
            goto done;
        }
    }
    rc = 0;
done:
    free(q.sym);
    free(q.ent);
    free(q.cur);
    free(q.low);
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

int kv_tok_bpe_bytes(const kv_tokenizer_t *t, const uint8_t *p, size_t n, kv_ids_t *out)
{
    uint32_t id[SHORT_WORD], rank[SHORT_WORD], *syms;
    size_t   i;
    int      rc;

    if (n == 0) {
        return 0;
    }
    if (n == 1) {
        return kv_ids_push(out, t->byte_id[p[0]]);
    }
    if (n <= SHORT_WORD && t->pair_rank != NULL) {
        for (i = 0; i < n; i++) {
            id[i] = t->byte_id[p[i]];
        }
        for (i = 0; i + 1 < n; i++) {
            rank[i] = t->pair_rank[(uint32_t) p[i] << 8 | p[i + 1]];
        }
        return merge_loop(t, id, rank, n, out);
    }
    syms = malloc(n * sizeof(uint32_t));
    if (syms == NULL) {
        return -1;
    }
    for (i = 0; i < n; i++) {
        syms[i] = t->byte_id[p[i]];
    }
    rc = kv_tok_bpe_word(t, syms, n, out);
    free(syms);
    return rc;
}
