/*
 * Encoding and decoding (kv_tokenizer.h), in HF tokenizers' order: added
 * tokens are split out of the raw text first (leftmost, longest), then each
 * remaining segment is normalized, pre-tokenized and BPE-merged; the
 * post-processor's special tokens go around the whole.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include <utf8proc.h>
#include <xxhash.h>

#include "kv_tok_int.h"
#include "kv_unicode.h"

int kv_ids_push(kv_ids_t *out, uint32_t id)
{
    uint32_t *grown;

    if (out->n == out->cap) {
        size_t cap = out->cap ? out->cap * 2 : 256;

        grown = realloc(out->ids, cap * sizeof(uint32_t));
        if (grown == NULL) {
            return -1;
        }
        out->ids = grown;
        out->cap = cap;
    }
    out->ids[out->n++] = id;
    return 0;
}

void kv_ids_free(kv_ids_t *out)
{
    free(out->ids);
    memset(out, 0, sizeof(*out));
}

/* --- one pre-token ------------------------------------------------------- */

/*
 * A small per-thread cache of words already encoded: text is Zipfian, so
 * most pre-tokens are words seen a moment ago, and an L2-resident cache
 * beats both the vocab table and merging. Per thread (nginx tokenizes on
 * its event loop and in thread pools), so the tokenizer stays immutable
 * and shared without locks; entries carry their tokenizer's tag.
 *
 * An entry is 32 bytes: a word of up to WCACHE_BYTES is its key (its bytes
 * zero-padded to 16, its length in the last byte), so a hit is two word
 * compares and the hash two multiplies; up to WCACHE_IDS ids. That covers
 * 99.6 % of English prose's pre-tokens (92.7 % are one token), and 64k
 * entries in 2 MB keep about all of a 2.4 MB text's 47k distinct words
 * (32k entries of 64 bytes hit 91 % of pieces on a second pass of it).
 * Sets of 4 ways (two cache lines), newest first; a hit moves up one way.
 */
#define WCACHE_SETS   16384       /* x 4 ways x 32 bytes: 2 MB per tokenizing thread */
#define WCACHE_WAYS   4
#define WCACHE_BYTES  15
#define WCACHE_IDS    3

typedef struct {
    uint64_t    key[2];
    uint32_t    ids[WCACHE_IDS];
    uint32_t    tag;            /* the tokenizer's cache_tag << 2 | ids; 0: empty */
} wcache_t;

static __thread wcache_t *wcache;
static pthread_key_t      wcache_key;     /* frees a thread's cache when it exits */
static pthread_once_t     wcache_once = PTHREAD_ONCE_INIT;

static void wcache_key_make(void)
{
    (void) pthread_key_create(&wcache_key, free);
}

/* The key of p[0..n), n <= WCACHE_BYTES; end: the end of the text (loads
 * of whole words stay inside it). */
static void word_key(const char *p, size_t n, const char *end, uint64_t key[2])
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    if (end - p >= 16) {
        memcpy(key, p, 16);
        key[0] &= n >= 8 ? ~0ULL : (1ULL << (8 * n)) - 1;
        key[1] &= n <= 8 ? 0 : (1ULL << (8 * (n - 8))) - 1;
        key[1] |= (uint64_t) n << 56;
        return;
    }
#endif
    {
        uint8_t b[16] = { 0 };
        size_t  i;

        (void) end;
        for (i = 0; i < n; i++) {
            b[i] = (uint8_t) p[i];
        }
        b[15] = (uint8_t) n;
        memcpy(key, b, 16);
    }
}

/* The first entry of the word's set. */
static uint32_t word_set(const uint64_t key[2])
{
    uint64_t h = key[0] * 0x9e3779b97f4a7c15ULL;

    h = (h ^ h >> 32 ^ key[1]) * 0xc2b2ae3d27d4eb4fULL;
    return ((uint32_t) (h ^ h >> 32) & (WCACHE_SETS - 1)) * WCACHE_WAYS;
}

/* The ids of a cached word (moved up one way), or NULL. */
static const wcache_t *wcache_find(const kv_tokenizer_t *t, uint32_t set, const uint64_t key[2])
{
    wcache_t *c = &wcache[set], x;
    uint32_t  k;

    for (k = 0; k < WCACHE_WAYS; k++) {
        if (((c[k].key[0] ^ key[0]) | (c[k].key[1] ^ key[1])) == 0
            && c[k].tag >> 2 == t->cache_tag)
        {
            if (k == 0) {
                return c;
            }
            x = c[k - 1];
            c[k - 1] = c[k];
            c[k] = x;
            return &c[k - 1];
        }
    }
    return NULL;
}

static void wcache_put(const kv_tokenizer_t *t, uint32_t set, const uint64_t key[2],
                       const uint32_t *ids, size_t n)
{
    wcache_t *c = &wcache[set];

    memmove(&c[1], &c[0], (WCACHE_WAYS - 1) * sizeof(wcache_t));     /* the oldest goes */
    c->key[0] = key[0];
    c->key[1] = key[1];
    memcpy(c->ids, ids, n * sizeof(uint32_t));
    c->tag = t->cache_tag << 2 | (uint32_t) n;
}

/* Appends ids[0..k) (a handful: one growth check, no call per id). */
static int ids_append(kv_ids_t *out, const uint32_t *ids, size_t k)
{
    size_t i;

    if (out->cap - out->n < k) {
        for (i = 0; i < k; i++) {
            if (kv_ids_push(out, ids[i]) != 0) {
                return -1;
            }
        }
        return 0;
    }
    for (i = 0; i < k; i++) {
        out->ids[out->n + i] = ids[i];
    }
    out->n += k;
    return 0;
}

/*
 * Byte-level pieces wait in a small batch: their word-cache sets are
 * prefetched as they arrive and looked up when the batch is full, so the
 * cache misses of a batch overlap instead of stalling one after another
 * (the 2 MB cache does not fit in L2); the pieces the cache lacks then get
 * their vocab slot prefetched before any of them is encoded.
 */
#define BATCH  16

typedef struct {
    const char       *p;
    size_t            n;
    uint32_t          set;          /* word-cache set; UINT32_MAX: not cacheable */
    uint32_t          nids;         /* found in the cache: its ids (0: not found) */
    uint32_t          ids[WCACHE_IDS];
    uint64_t          key[2];
} piece_t;

typedef struct {
    const kv_tokenizer_t *t;
    kv_ids_t             *out;
    uint32_t             *syms;
    size_t                cap;
    const char           *end;          /* of the segment being split */
    piece_t               batch[BATCH];
    size_t                nbatch;
} enc_t;

static int reserve(enc_t *e, size_t n)
{
    if (n > e->cap) {
        uint32_t *s = realloc(e->syms, n * sizeof(uint32_t));

        if (s == NULL) {
            return -1;
        }
        e->syms = s;
        e->cap = n;
    }
    return 0;
}

/* kv_tokenizer_cancel_on: polled every 1024 units of work (a byte-level
 * pre-token, or a byte of a SentencePiece word), so a cancel costs an
 * atomic load per thousand words and stops within about a ms */
static __thread const int *cancel_flag;
static __thread size_t     cancel_tick;

void kv_tokenizer_cancel_on(const int *flag)
{
    cancel_flag = flag;
}

/* 1: this thread's encode is to stop; work: what was done since the last call */
static inline int cancelled(size_t work)
{
    if (cancel_flag == NULL || (cancel_tick += work) < 1024) {
        return 0;
    }
    cancel_tick = 0;
    return __atomic_load_n(cancel_flag, __ATOMIC_RELAXED);
}

/* A piece the word cache lacks: one token (the words table), else BPE. */
static int byte_level_word(enc_t *e, const piece_t *pc)
{
    const kv_tokenizer_t *t = e->t;
    const char           *p = pc->p;
    size_t                n = pc->n, before = e->out->n;
    int64_t               id;
    int                   rc;

    /* a word that is a single token which merging would rebuild anyway, or
     * any token with ignore_merges (Llama-3 style) */
    id = kv_tok_word_get(t, p, n);
    if (id >= 0) {
        rc = kv_ids_push(e->out, (uint32_t) id);
    } else {
        rc = kv_tok_bpe_bytes(t, (const uint8_t *) p, n, e->out);
    }
    if (rc == 0 && pc->set != UINT32_MAX && e->out->n - before <= WCACHE_IDS) {
        wcache_put(t, pc->set, pc->key, e->out->ids + before, e->out->n - before);
    }
    return rc;
}

/* SentencePiece-style: one symbol per character, bytes for unknown ones. */
static int char_word(enc_t *e, const char *p, size_t n)
{
    const kv_tokenizer_t *t = e->t;
    size_t                i = 0, k = 0, len, b;
    uint32_t              cp;
    int                   last_unk = 0;

    /* SentencePiece-style text has no pre-tokenizer: emit_piece sees a
     * whole segment, so the poll is here, by bytes (spm_words calls this
     * per word, else it is the segment) */
    if (cancelled(n) || reserve(e, n) != 0) {
        return -1;
    }
    while (i < n) {
        int64_t id;

        len = kv_utf8_next((const uint8_t *) p + i, n - i, &cp);
        id = kv_tok_map_get(t, p + i, len);
        if (id >= 0) {
            e->syms[k++] = (uint32_t) id;
            last_unk = 0;
        } else if (t->byte_fallback && t->byte_id[(uint8_t) p[i]] != UINT32_MAX) {
            for (b = 0; b < len; b++) {
                e->syms[k++] = t->byte_id[(uint8_t) p[i + b]];
            }
            last_unk = 0;
        } else if (t->unk_id >= 0) {
            if (!(t->fuse_unk && last_unk)) {
                e->syms[k++] = (uint32_t) t->unk_id;
            }
            last_unk = 1;
        }
        i += len;
    }
    return kv_tok_bpe_word(t, e->syms, k, e->out);
}

/* SentencePiece text split at word starts ("▁" after another character),
 * where the vocab allows it (kv_tok_load.c: spm_words_independent). */
static int spm_words(enc_t *e, const char *p, size_t n)
{
    size_t start = 0, i;

    for (i = 3; i + 3 <= n; i++) {
        if (memcmp(p + i, "\xe2\x96\x81", 3) == 0
            && !(i >= 3 && memcmp(p + i - 3, "\xe2\x96\x81", 3) == 0))
        {
            if (char_word(e, p + start, i - start) != 0) {
                return -1;
            }
            start = i;
        }
    }
    return char_word(e, p + start, n - start);
}

static int flush_batch(enc_t *e)
{
    piece_t *b;
    size_t   i;
    int      rc = 0;

    for (i = 0; i < e->nbatch; i++) {
        const wcache_t *c;

        b = &e->batch[i];
        c = b->set != UINT32_MAX ? wcache_find(e->t, b->set, b->key) : NULL;
        b->nids = c ? c->tag & 3 : 0;
        if (c) {
            memcpy(b->ids, c->ids, sizeof(b->ids));     /* later puts move entries */
        } else {
            kv_tok_word_prefetch(e->t, b->p, b->n);
        }
    }
    for (i = 0; i < e->nbatch && rc == 0; i++) {
        b = &e->batch[i];
        rc = b->nids ? ids_append(e->out, b->ids, b->nids) : byte_level_word(e, b);
    }
    e->nbatch = 0;
    return rc;
}

static int emit_piece(void *ctx, const char *p, size_t n)
{
    enc_t   *e = ctx;
    piece_t *b;

    if (cancelled(1)) {
        return -1;
    }

    if (e->t->byte_level) {
        if (wcache == NULL) {
            /* a set is two whole cache lines */
            wcache = aligned_alloc(128, WCACHE_SETS * WCACHE_WAYS * sizeof(wcache_t));
            if (wcache) {
                memset(wcache, 0, WCACHE_SETS * WCACHE_WAYS * sizeof(wcache_t));
                pthread_once(&wcache_once, wcache_key_make);
                (void) pthread_setspecific(wcache_key, wcache);
            }
        }
        b = &e->batch[e->nbatch++];
        b->p = p;
        b->n = n;
        b->set = UINT32_MAX;
        if (wcache && n <= WCACHE_BYTES) {
            word_key(p, n, e->end, b->key);
            b->set = word_set(b->key);
            __builtin_prefetch(&wcache[b->set]);
            __builtin_prefetch(&wcache[b->set + 2]);
        }
        return e->nbatch == BATCH ? flush_batch(e) : 0;
    }
    return e->t->spm_split ? spm_words(e, p, n) : char_word(e, p, n);
}

/* --- one segment between added tokens ------------------------------------ */

/* Bytes s[0..n) appended to *out as they are. */
static int raw_append(const char *s, size_t n, char **out, size_t *len)
{
    char *grown = realloc(*out, *len + n + 1);

    if (grown == NULL) {
        return -1;
    }
    memcpy(grown + *len, s, n);
    grown[*len + n] = '\0';
    *out = grown;
    *len += n;
    return 0;
}

/* utf8proc's NFC of s[0..n) appended to *out (malloc'ed, grown). By length,
 * not utf8proc_NFC: a prompt may hold NUL bytes, which are text to HF
 * (U+0000) and must not end the segment. */
static int nfc_append(const char *s, size_t n, char **out, size_t *len)
{
    utf8proc_uint8_t *z = NULL;
    utf8proc_ssize_t  zn;
    char             *grown;

    if (n == 0) {                               /* between two such marks */
        return *out ? 0 : raw_append("", 0, out, len);
    }
    zn = utf8proc_map((const utf8proc_uint8_t *) s, (utf8proc_ssize_t) n, &z,
                      UTF8PROC_STABLE | UTF8PROC_COMPOSE);
    if (zn < 0) {
        return -1;
    }
    if (*out == NULL) {
        *out = (char *) z;
        *len = (size_t) zn;
        return 0;
    }
    grown = realloc(*out, *len + (size_t) zn + 1);
    if (grown == NULL) {
        free(z);
        return -1;
    }
    memcpy(grown + *len, z, (size_t) zn + 1);
    *out = grown;
    *len += (size_t) zn;
    free(z);
    return 0;
}

/*
 * NFC as HF computes it, which is with Unicode 9.0 data: utf8proc's newer
 * data would reorder or compose the marks assigned since, which HF leaves
 * alone and which split its normalization (kv_uni_is_nfc_new). NULL: no
 * memory. s is valid UTF-8.
 */
static char *nfc_as_hf(const char *s, size_t n, size_t *out_len)
{
    char    *out = NULL;
    size_t   i = 0, from = 0, len = 0, k;
    uint32_t cp;

    while (i < n) {
        /* every such mark is >= U+07FD, led by a byte >= 0xdf; no
         * continuation byte is that high */
        if ((uint8_t) s[i] < 0xdf) {
            i++;
            continue;
        }
        k = kv_utf8_next((const uint8_t *) s + i, n - i, &cp);
        if (kv_uni_is_nfc_new(cp)) {
            if (nfc_append(s + from, i - from, &out, &len) != 0
                || raw_append(s + i, k, &out, &len) != 0)
            {
                free(out);
                return NULL;
            }
            from = i + k;
        }
        i += k;
    }
    if (nfc_append(s + from, n - from, &out, &len) != 0) {
        free(out);
        return NULL;
    }
    *out_len = len;
    return out;
}

static int segment(enc_t *e, const char *s, size_t n)
{
    const kv_tokenizer_t *t = e->t;
    char                 *norm = NULL;
    size_t                i, k;
    int                   rc;

    if (n == 0) {
        return 0;
    }
    if (t->norm == NORM_NFC) {
        /* text without a byte >= 0xcc is below U+0300, which is all NFC */
        for (i = 0; i < n && (uint8_t) s[i] < 0xcc; i++) {
            /* void */
        }
        if (i < n) {
            norm = nfc_as_hf(s, n, &n);
            if (norm == NULL) {
                return -1;
            }
            s = norm;
        }
    } else if (t->norm == NORM_SENTENCEPIECE) {
        /* Prepend "▁", then every " " becomes "▁" */
        norm = malloc(3 * n + 3);
        if (norm == NULL) {
            return -1;
        }
        memcpy(norm, "\xe2\x96\x81", 3);
        for (i = 0, k = 3; i < n; i++) {
            if (s[i] == ' ') {
                memcpy(norm + k, "\xe2\x96\x81", 3);
                k += 3;
            } else {
                norm[k++] = s[i];
            }
        }
        s = norm;
        n = k;
    }
    e->end = s + n;
    rc = kv_tok_pretokenize(t->pre, s, n, emit_piece, e);
    if (flush_batch(e) != 0) {       /* its pieces point into norm */
        rc = -1;
    }
    free(norm);
    return rc;
}

/* --- added tokens -------------------------------------------------------- */

static int is_space_at(const char *s, size_t n, size_t i, size_t *len)
{
    uint32_t cp;

    *len = kv_utf8_next((const uint8_t *) s + i, n - i, &cp);
    return kv_uni_class(cp) == KV_UNI_SPACE;
}

/* First k in v[lo..hi) whose byte d is above c (above: 1) or at least c
 * (above: 0); every v[k] there is longer than d. */
static size_t added_bound(const kv_added_t *const *v, size_t lo, size_t hi, size_t d,
                          uint8_t c, int above)
{
    while (lo < hi) {
        size_t  mid = lo + (hi - lo) / 2;
        uint8_t b = (uint8_t) v[mid]->content[d];

        if (b < c || (above && b == c)) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    return lo;
}

/*
 * The tokens in added_sorted starting with s[i..i+d) are a range, narrowed
 * one byte at a time by two binary searches: O(length x log n_added) a
 * position where comparing every added token was O(n_added) (smollm3's
 * 256 tokens starting "<|", on a prompt of "<|<|<|..."). A token ending
 * at depth d sorts first in its range, so the last one met is the longest,
 * and of equal ones the first in the file: what the linear scan chose.
 */
const kv_added_t *kv_tok_added_at(const kv_tokenizer_t *t, const char *s, size_t n, size_t i)
{
    const kv_added_t *const *v = t->added_sorted;
    const kv_added_t        *best = NULL;
    size_t                   lo, hi, d;

    if (!t->added_first[(uint8_t) s[i]]) {
        return NULL;
    }
    /* the first byte's range is a table lookup */
    lo = t->added_start[(uint8_t) s[i]];
    hi = t->added_start[(uint8_t) s[i] + 1];
    for (d = 1; lo < hi; d++) {
        if (v[lo]->len == d) {
            best = v[lo];
            while (lo < hi && v[lo]->len == d) {
                lo++;
            }
        }
        if (i + d >= n) {
            break;
        }
        lo = added_bound(v, lo, hi, d, (uint8_t) s[i + d], 0);
        hi = added_bound(v, lo, hi, d, (uint8_t) s[i + d], 1);
    }
    return best;
}

static int encode_valid(const kv_tokenizer_t *t, const char *s, size_t n, enc_t *e)
{
    size_t            i = 0, seg = 0, start, end, len;
    const kv_added_t *a;

    while (i < n) {
        /* most bytes start no added token: no call for them (the search
         * is shared with kv_tok_bound.c, so not inlined here) */
        if (!t->added_first[(uint8_t) s[i]]) {
            i++;
            continue;
        }
        a = kv_tok_added_at(t, s, n, i);
        if (a == NULL) {
            i++;
            continue;
        }
        start = i;
        end = i + a->len;
        if (a->lstrip) {
            /* the token takes the whitespace before it */
            while (start > seg) {
                size_t p = start - 1;

                while (p > seg && ((uint8_t) s[p] & 0xc0) == 0x80) {
                    p--;
                }
                if (!is_space_at(s, n, p, &len)) {
                    break;
                }
                start = p;
            }
        }
        if (a->rstrip) {
            while (end < n && is_space_at(s, n, end, &len)) {
                end += len;
            }
        }
        if (segment(e, s + seg, start - seg) != 0 || kv_ids_push(e->out, a->id) != 0) {
            return -1;
        }
        i = seg = end;
    }
    return segment(e, s + seg, n - seg);
}

long kv_tokenizer_encode(const kv_tokenizer_t *t, const char *text, size_t len,
                         int add_special, kv_ids_t *out)
{
    enc_t   e = { .t = t, .out = out };
    size_t  before = out->n, n2, i;
    char   *clean = NULL;
    int     rc = 0;

    if (!kv_utf8_valid((const uint8_t *) text, len)) {
        clean = kv_utf8_clean(text, len, &n2);  /* as Python decodes it */
        if (clean == NULL) {
            return -1;
        }
        text = clean;
        len = n2;
    }
    if (add_special) {
        for (i = 0; i < t->n_prefix && rc == 0; i++) {
            rc = kv_ids_push(out, t->prefix_ids[i]);
        }
    }
    if (rc == 0) {
        rc = encode_valid(t, text, len, &e);
    }
    if (add_special) {
        for (i = 0; i < t->n_suffix && rc == 0; i++) {
            rc = kv_ids_push(out, t->suffix_ids[i]);
        }
    }
    free(e.syms);
    free(clean);
    return rc == 0 ? (long) (out->n - before) : -1;
}

/* --- decoding ------------------------------------------------------------ */

typedef struct {
    char   *p;
    size_t  n, cap;
} buf_t;

static int put(buf_t *b, const void *s, size_t n)
{
    if (b->n + n + 1 > b->cap) {
        size_t cap = (b->n + n + 1) * 2;
        char  *p = realloc(b->p, cap);

        if (p == NULL) {
            return -1;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    return 0;
}

static int fallback_byte(const char *s, size_t n)
{
    static const char hex[] = "0123456789ABCDEF";
    const char       *h1, *h2;

    if (n != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>') {
        return -1;
    }
    h1 = memchr(hex, s[3], 16);
    h2 = memchr(hex, s[4], 16);
    return h1 && h2 && s[3] && s[4] ? (int) ((h1 - hex) * 16 + (h2 - hex)) : -1;
}

/* Bytes of one token as the decoder sees them, before joining. */
static int token_raw(const kv_tokenizer_t *t, uint32_t id, buf_t *b)
{
    const char *s = t->arena + t->tok_off[id];
    size_t      n = t->tok_len[id], i, len, start = b->n;
    uint32_t    cp;

    if (t->dec == DEC_BYTELEVEL) {
        for (i = 0; i < n; i += len) {
            char c;

            len = kv_utf8_next((const uint8_t *) s + i, n - i, &cp);
            if (cp >= 512 || t->char_byte[cp] < 0) {
                b->n = start;   /* not byte-level text: the token as it is */
                return put(b, s, n);
            }
            c = (char) t->char_byte[cp];
            if (put(b, &c, 1) != 0) {
                return -1;
            }
        }
        return 0;
    }
    for (i = 0; i < n;) {
        if (n - i >= 3 && memcmp(s + i, "\xe2\x96\x81", 3) == 0) {
            if (put(b, " ", 1) != 0) return -1;
            i += 3;
        } else {
            if (put(b, s + i, 1) != 0) return -1;
            i++;
        }
    }
    return 0;
}

static char *decode_sp(const kv_tokenizer_t *t, const uint32_t *ids, size_t n,
                       int skip_special, size_t *len)
{
    buf_t  out = { NULL, 0, 0 }, bytes = { NULL, 0, 0 };
    size_t i, j, nbytes;
    char   rep[4];

    for (i = 0; i < n; i++) {
        int byte;

        if (ids[i] >= t->vocab_size || (skip_special && t->is_special[ids[i]])) {
            continue;
        }
        byte = fallback_byte(t->arena + t->tok_off[ids[i]], t->tok_len[ids[i]]);
        if (byte < 0) {
            if (token_raw(t, ids[i], &out) != 0) goto fail;
            continue;
        }
        /* a run of byte tokens: valid UTF-8 as is, else one U+FFFD per byte */
        bytes.n = 0;
        for (j = i; j < n; j++) {
            int b2;

            if (ids[j] >= t->vocab_size || (skip_special && t->is_special[ids[j]])) {
                continue;
            }
            b2 = fallback_byte(t->arena + t->tok_off[ids[j]], t->tok_len[ids[j]]);
            if (b2 < 0) break;
            char c = (char) b2;
            if (put(&bytes, &c, 1) != 0) goto fail;
        }
        nbytes = bytes.n;
        if (kv_utf8_valid((const uint8_t *) bytes.p, nbytes)) {
            if (put(&out, bytes.p, nbytes) != 0) goto fail;
        } else {
            for (size_t k = 0; k < nbytes; k++) {
                if (put(&out, rep, kv_utf8_put(rep, 0xfffd)) != 0) goto fail;
            }
        }
        i = j - 1;
    }
    if (put(&out, "", 0) != 0) goto fail;
    free(bytes.p);
    {
        size_t skip = 0;

        while ((int) skip < t->dec_strip_left && skip < out.n && out.p[skip] == ' ') {
            skip++;
        }
        memmove(out.p, out.p + skip, out.n - skip);
        out.n -= skip;
    }
    out.p[out.n] = '\0';
    *len = out.n;
    return out.p;
fail:
    free(out.p);
    free(bytes.p);
    return NULL;
}

char *kv_tokenizer_decode(const kv_tokenizer_t *t, const uint32_t *ids, size_t n,
                          int skip_special, size_t *len)
{
    buf_t  raw = { NULL, 0, 0 };
    char  *out;
    size_t i;

    if (t->dec == DEC_SENTENCEPIECE) {
        return decode_sp(t, ids, n, skip_special, len);
    }
    for (i = 0; i < n; i++) {
        if (ids[i] >= t->vocab_size || (skip_special && t->is_special[ids[i]])) {
            continue;
        }
        if (t->dec == DEC_NONE && raw.n && put(&raw, " ", 1) != 0) {
            goto fail;
        }
        if ((t->dec == DEC_NONE ? put(&raw, t->arena + t->tok_off[ids[i]], t->tok_len[ids[i]])
                                : token_raw(t, ids[i], &raw)) != 0)
        {
            goto fail;
        }
    }
    /* the bytes joined may be invalid UTF-8: lossy, as HF's decode is */
    out = kv_utf8_clean(raw.p ? raw.p : "", raw.n, len);
    free(raw.p);
    return out;
fail:
    free(raw.p);
    return NULL;
}

long kv_tokenizer_token_bytes(const kv_tokenizer_t *t, uint32_t id, char *dst, size_t cap)
{
    buf_t b = { NULL, 0, 0 };
    int   byte;
    long  n;

    if (id >= t->vocab_size) {
        return -1;
    }
    if (t->dec == DEC_SENTENCEPIECE
        && (byte = fallback_byte(t->arena + t->tok_off[id], t->tok_len[id])) >= 0)
    {
        if (cap < 1) return 0;
        dst[0] = (char) byte;
        return 1;
    }
    if (token_raw(t, id, &b) != 0) {
        free(b.p);
        return -1;
    }
    n = (long) (b.n < cap ? b.n : cap);
    if (n) memcpy(dst, b.p, (size_t) n);
    free(b.p);
    return n;
}

uint32_t kv_tokenizer_vocab_size(const kv_tokenizer_t *t)
{
    return t->vocab_size;
}

size_t kv_tokenizer_memory(const kv_tokenizer_t *t)
{
    return t->memory;
}
