/*
 * Cut points of a text where tokenization is context-free (kv_tok_bound.h).
 *
 * Why a cut is exact. kv_tokenizer_encode (kv_tokenizer.c, encode_valid)
 * scans the text left to right with a state of two positions (i, seg): at
 * each i it takes the longest added token starting there (kv_tok_added_at), or
 * steps one byte. A token [start, end) found at i is emitted after the
 * segment [seg, start) is normalized, pre-tokenized and BPE-merged on its
 * own (segment()); lstrip moves start back over whitespace but never before
 * seg, rstrip moves end forward over whitespace; then i = seg = end. Each
 * segment is encoded with no state from the ones before it (the
 * SentencePiece normalizer prepends its "▁" to every segment alike, the
 * word cache only memoizes). So whenever the scan reaches a state
 * i == seg == b, the ids already emitted depend only on s[0..b) and the
 * rest is exactly encode(s[b..)): a scan of s[b..) starts in that state.
 *
 * A cut is the end of an occurrence of a "safe" added token X, plus the
 * whitespace after it when X has rstrip. X is safe when
 *   (1) no other added token contains X (so no longer match at X's start,
 *       and no match starting before X can cover it whole),
 *   (2) no added token (X included) has a proper suffix that is a proper
 *       prefix of X (so no match starting before X can end inside it),
 *   (3) X's first character is not whitespace (so no rstrip of an earlier
 *       token can eat into it) and X is at least 2 bytes long.
 * Then in any valid UTF-8 text every occurrence [s, s+|X|) of X is where
 * the scan takes X: the scan cannot step over s (a match covering s would
 * contain X (1) or overlap its start (2); an rstrip run stops at X's
 * non-space first character (3)), and at s the longest match is X (1).
 * The state after it is i == seg == cut, where cut is s+|X| or, with
 * rstrip, the end of the whitespace run after it. Every decision the scan
 * made before the cut looked at bytes before it only, except rstrip's
 * look at the byte after the run (which is not whitespace, or the end, in
 * both texts because the run is maximal in each) and kv_tok_added_at's look at
 * tokens that would end past the cut (impossible by (1) and (2)). Hence a
 * second text sharing s[0..cut) has the same cut there, with the same ids
 * before it: cached ids for a prefix that ends at a cut are exact.
 *
 * Excluding a token is always safe (fewer cuts, never a wrong one), so
 * the conditions are checked conservatively on the raw token strings.
 */
#include <stdlib.h>
#include <string.h>

#include <xxhash.h>

#include "kv_tok_bound.h"
#include "kv_tok_int.h"
#include "kv_unicode.h"

struct kv_tok_bounds {
    const kv_tokenizer_t   *t;
    uint8_t                *is_cut;             /* by index in t->added: a cut token */
    size_t                  ntoks;
    uint8_t                 first[256];
    int                     one_first;          /* every cut token starts with this byte, or -1 */
    uint64_t                ident;
};

static int space_at(const char *s, size_t n, size_t i, size_t *len)
{
    uint32_t cp;

    *len = kv_utf8_next((const uint8_t *) s + i, n - i, &cp);
    return kv_uni_class(cp) == KV_UNI_SPACE;
}

static int contains(const kv_added_t *a, const kv_added_t *x)
{
    size_t i;

    if (a->len < x->len) {
        return 0;
    }
    for (i = 0; i + x->len <= a->len; i++) {
        if (memcmp(a->content + i, x->content, x->len) == 0) {
            return 1;
        }
    }
    return 0;
}

/* a proper suffix of a equals a proper prefix of x */
static int overlaps(const kv_added_t *a, const kv_added_t *x)
{
    size_t k, max = (a->len < x->len ? a->len : x->len);

    for (k = 1; k < max; k++) {
        if (memcmp(a->content + a->len - k, x->content, k) == 0) {
            return 1;
        }
    }
    return 0;
}

static int safe(const kv_tokenizer_t *t, uint32_t xi)
{
    const kv_added_t *x = &t->added[xi];
    size_t            len;
    uint32_t          k;

    if (x->len < 2 || !kv_utf8_valid((const uint8_t *) x->content, x->len)
        || space_at(x->content, x->len, 0, &len))
    {
        return 0;
    }
    for (k = 0; k < t->n_added; k++) {
        const kv_added_t *a = &t->added[k];

        if ((k != xi && contains(a, x)) || overlaps(a, x)) {
            return 0;
        }
    }
    return 1;
}

static uint64_t fingerprint(const kv_tokenizer_t *t)
{
    XXH3_state_t *st = XXH3_createState();
    uint64_t      h, w[12];
    uint32_t      k;

    if (st == NULL) {
        return 0;
    }
    XXH3_64bits_reset(st);
    w[0] = t->vocab_size;
    w[1] = t->n_merges;
    w[2] = t->n_added;
    w[3] = t->norm;
    w[4] = t->pre;
    w[5] = (uint64_t) t->byte_level | (uint64_t) t->byte_fallback << 8
           | (uint64_t) t->spm_split << 16 | (uint64_t) t->ignore_merges << 24
           | (uint64_t) t->fuse_unk << 32;
    w[6] = (uint64_t) t->unk_id;
    w[7] = t->n_prefix;
    w[8] = t->n_suffix;
    w[9] = t->arena_len;
    w[10] = t->merges ? (uint64_t) t->merges_mask + 1 : 0;
    w[11] = 0x6b76746f6b656e33ULL;     /* bump when encode's rules change (2: NUL under NFC,
                                        * 3: Unicode 16.0 classes, NFC as HF's 9.0) */
    XXH3_64bits_update(st, w, sizeof(w));
    XXH3_64bits_update(st, t->arena, t->arena_len);
    XXH3_64bits_update(st, t->tok_len, (size_t) t->vocab_size * sizeof(uint32_t));
    if (t->merges) {
        XXH3_64bits_update(st, t->merges, ((size_t) t->merges_mask + 1) * sizeof(kv_tok_merge_t));
    }
    for (k = 0; k < t->n_added; k++) {
        const kv_added_t *a = &t->added[k];

        w[0] = a->len;
        w[1] = a->id;
        w[2] = (uint64_t) a->special | (uint64_t) a->lstrip << 8 | (uint64_t) a->rstrip << 16
               | (uint64_t) a->normalized << 24;
        XXH3_64bits_update(st, w, 3 * sizeof(uint64_t));
        XXH3_64bits_update(st, a->content, a->len);
    }
    XXH3_64bits_update(st, t->prefix_ids, t->n_prefix * sizeof(uint32_t));
    XXH3_64bits_update(st, t->suffix_ids, t->n_suffix * sizeof(uint32_t));
    h = XXH3_64bits_digest(st);
    XXH3_freeState(st);
    return h ? h : 1;
}

kv_tok_bounds_t *kv_tok_bounds_new(const kv_tokenizer_t *t)
{
    kv_tok_bounds_t *b = calloc(1, sizeof(*b));
    uint32_t         k;
    int              first = -1;

    if (b == NULL) {
        return NULL;
    }
    b->t = t;
    b->is_cut = calloc(t->n_added + 1, 1);
    if (b->is_cut == NULL) {
        free(b);
        return NULL;
    }
    for (k = 0; k < t->n_added; k++) {
        const kv_added_t *a = &t->added[k];

        if (!safe(t, k)) {
            continue;
        }
        b->is_cut[k] = 1;
        b->ntoks++;
        b->first[(uint8_t) a->content[0]] = 1;
        first = first == -1 || first == (uint8_t) a->content[0]
                ? (uint8_t) a->content[0] : -2;
    }
    b->one_first = first;
    b->ident = fingerprint(t);
    return b;
}

void kv_tok_bounds_free(kv_tok_bounds_t *b)
{
    if (b) {
        free(b->is_cut);
        free(b);
    }
}

size_t kv_tok_bounds_count(const kv_tok_bounds_t *b)
{
    return b->ntoks;
}

uint64_t kv_tok_bounds_ident(const kv_tok_bounds_t *b)
{
    return b->ident;
}

/*
 * The cut token at s[i], or NULL. A cut token X matching at i is the
 * longest added token there (a longer one would contain X: safe() (1)),
 * so this is the encoder's own search, O(length x log n_added), where a
 * list of the tokens sharing two first bytes cost O(n_added) a position
 * (smollm3's 256 "<|" tokens, on "<|<|<|...").
 */
static const kv_added_t *cut_at(const kv_tok_bounds_t *b, const char *s, size_t n, size_t i)
{
    const kv_added_t *a = kv_tok_added_at(b->t, s, n, i);

    return a != NULL && b->is_cut[a - b->t->added] ? a : NULL;
}

long kv_tok_bounds_find(const kv_tok_bounds_t *b, const char *s, size_t n, size_t **out)
{
    size_t          *cuts = NULL, ncuts = 0, cap = 0, i = 0, len;
    const kv_added_t *c;
    const char      *p;

    *out = NULL;
    while (b->ntoks && i < n) {
        if (b->one_first >= 0) {
            p = memchr(s + i, b->one_first, n - i);
            if (p == NULL) {
                break;
            }
            i = (size_t) (p - s);
        } else if (!b->first[(uint8_t) s[i]]) {
            i++;
            continue;
        }
        c = cut_at(b, s, n, i);
        if (c == NULL) {
            i++;
            continue;
        }
        i += c->len;
        if (c->rstrip) {
            while (i < n && space_at(s, n, i, &len)) {
                i += len;
            }
        }
        if (ncuts == cap) {
            size_t *grown = realloc(cuts, (cap = cap ? cap * 2 : 64) * sizeof(size_t));

            if (grown == NULL) {
                free(cuts);
                return -1;
            }
            cuts = grown;
        }
        cuts[ncuts++] = i;
    }
    *out = cuts;
    return (long) ncuts;
}

void kv_tok_bounds_special(const kv_tok_bounds_t *b, const uint32_t **prefix, size_t *nprefix,
                           const uint32_t **suffix, size_t *nsuffix)
{
    *prefix = b->t->prefix_ids;
    *nprefix = b->t->n_prefix;
    *suffix = b->t->suffix_ids;
    *nsuffix = b->t->n_suffix;
}
