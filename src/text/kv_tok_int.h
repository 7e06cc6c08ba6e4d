/* Internals shared by the tokenizer's files (loader, pre-tokenizer, BPE,
 * encode/decode). Not part of the public API: see kv_tokenizer.h. */
#ifndef KV_TOK_INT_H
#define KV_TOK_INT_H

#include <stddef.h>
#include <stdint.h>

#include "kv_tokenizer.h"

/* string -> id, open addressing over an arena of token bytes */
typedef struct {
    uint64_t    hash;
    uint32_t    off;            /* into arena */
    uint32_t    len;
    uint32_t    id;             /* UINT32_MAX: empty */
} kv_tok_slot_t;

typedef struct {
    kv_tok_slot_t  *slots;
    uint32_t        mask;
} kv_tok_map_t;

/*
 * (left id, right id) -> merge rank, packed in 8 bytes: left << 43 |
 * right << 22 | rank, UINT64_MAX empty; merge_id[rank] is the id it makes.
 * Half the bytes of a {key, rank, id} record and at twice the load, the
 * table (2 MB for Qwen2.5's 151k merges) stays in L2: a merge lookup was a
 * cache miss, and BPE of the words the word cache misses is mostly lookups.
 */
#define KV_TOK_ID_BITS      21              /* ids below 2^21 - 1 */
#define KV_TOK_RANK_BITS    22              /* merges below 2^22 */
#define KV_TOK_RANK_MASK    ((1ULL << KV_TOK_RANK_BITS) - 1)

typedef uint64_t kv_tok_merge_t;

static inline uint64_t kv_tok_merge_key(uint32_t a, uint32_t b)
{
    return (uint64_t) a << (KV_TOK_ID_BITS + KV_TOK_RANK_BITS) | (uint64_t) b << KV_TOK_RANK_BITS;
}

static inline uint32_t kv_tok_merge_home(uint64_t key, uint32_t mask)
{
    return (uint32_t) ((key >> KV_TOK_RANK_BITS) * 0x9e3779b97f4a7c15ULL >> 32) & mask;
}

typedef enum { PRE_NONE = 0, PRE_GPT2, PRE_QWEN2, PRE_LLAMA3 } kv_pre_kind_t;
typedef enum { NORM_NONE = 0, NORM_NFC, NORM_SENTENCEPIECE } kv_norm_kind_t;
typedef enum { DEC_BYTELEVEL = 0, DEC_SENTENCEPIECE, DEC_NONE } kv_dec_kind_t;

typedef struct {
    char       *content;
    uint32_t    len;
    uint32_t    id;
    int         special, lstrip, rstrip, normalized;
} kv_added_t;

#define KV_TOK_TAG_MASK     0x3fffffffu     /* cache tags: 30 bits, 0 never */

struct kv_tokenizer {
    uint32_t        cache_tag;      /* names it in per-thread caches (kv_tokenizer.c) */
    char           *arena;          /* every token's bytes */
    size_t          arena_len;
    uint32_t       *tok_off;        /* id -> arena offset */
    uint32_t       *tok_len;
    uint32_t        vocab_size;     /* ids 0..vocab_size-1 (model + added) */
    kv_tok_map_t    vocab;          /* model vocab + added tokens */

    /*
     * byte-level: raw bytes -> id of tokens that BPE turns into themselves
     * (checked at load), so a word that is one token skips merging and
     * its mapping to printable characters; with ignore_merges, every token
     */
    kv_tok_map_t    words;
    char           *words_arena;

    kv_tok_merge_t *merges;
    uint32_t       *merge_id;           /* rank -> the id the merge makes */
    int64_t         merge_base;         /* >= 0: merge_id[rank] is rank + merge_base for
                                           every rank (GPT-2, Qwen2.5): no load */
    uint32_t       *pair_rank;          /* byte-level: [a << 8 | b] the rank of merging
                                           bytes a, b (UINT32_MAX: none); 256 KB, so a
                                           word's first round of lookups stays in cache */
    uint32_t        merges_mask;
    uint32_t        n_merges;           /* ranks are 0..n_merges-1 */

    kv_added_t     *added;
    uint32_t        n_added;
    const kv_added_t **added_sorted;    /* by content (bytes), equal ones in file order:
                                           kv_tok_added_at's search */
    uint32_t        added_start[257];   /* added_sorted[added_start[b]..added_start[b + 1]):
                                           the tokens starting with byte b */
    uint8_t         added_first[256];   /* some added token starts with this byte */
    uint8_t        *is_special;         /* id -> special added token */

    kv_norm_kind_t  norm;
    kv_pre_kind_t   pre;
    int             byte_level;         /* ByteLevel pre-tokenizer: map bytes */
    int             byte_fallback;
    int             spm_split;          /* "▁" only starts tokens (or runs of it):
                                           no merge crosses a word start */
    int             ignore_merges;
    int             fuse_unk;
    int64_t         unk_id;             /* -1: none */
    kv_dec_kind_t   dec;
    int             dec_strip_left;     /* SentencePiece decoder: Strip start */

    uint32_t        byte_id[256];       /* byte-level: id of each byte's char; fallback: <0xXX> */
    uint32_t        byte_char[256];     /* byte-level: code point standing for a byte */
    int16_t         char_byte[512];     /* byte-level: code point -> byte, -1 */

    uint32_t       *prefix_ids;         /* post-processor, single sequence */
    uint32_t        n_prefix;
    uint32_t       *suffix_ids;
    uint32_t        n_suffix;

    size_t          memory;
};

/* The longest added token at s[i] (i < n), ties to the first in the file;
 * NULL if none. */
const kv_added_t *kv_tok_added_at(const kv_tokenizer_t *t, const char *s, size_t n, size_t i);

int64_t kv_tok_map_get(const kv_tokenizer_t *t, const char *s, size_t len);
int64_t kv_tok_word_get(const kv_tokenizer_t *t, const char *s, size_t len);
void    kv_tok_word_prefetch(const kv_tokenizer_t *t, const char *s, size_t len);

/* One word (pre-token) to ids; appends to out. -1 on allocation failure. */
int kv_tok_bpe_word(const kv_tokenizer_t *t, const uint32_t *syms, size_t n,
                    kv_ids_t *out);
/* The same for a byte-level word given as its raw bytes (t->pair_rank set). */
int kv_tok_bpe_bytes(const kv_tokenizer_t *t, const uint8_t *p, size_t n, kv_ids_t *out);
/* The rank of merging ids (a, b); UINT32_MAX if none applies. */
uint32_t kv_tok_merge_rank(const kv_tokenizer_t *t, uint32_t a, uint32_t b);

/* Splits text[0..len) into pre-tokens: calls emit for each piece. */
typedef int (*kv_tok_emit_fn)(void *ctx, const char *piece, size_t len);
int kv_tok_pretokenize(kv_pre_kind_t kind, const char *text, size_t len,
                       kv_tok_emit_fn emit, void *ctx);

int kv_ids_push(kv_ids_t *out, uint32_t id);

#endif
