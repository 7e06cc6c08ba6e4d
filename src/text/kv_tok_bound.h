/*
 * Where a text can be cut so that tokenizing the two halves apart gives
 * exactly the ids of tokenizing it whole: the ends of added tokens that
 * nothing can straddle. The turn-delta cache (src/route/kv_turn.c) keeps a
 * conversation's ids up to such a cut and tokenizes only what follows.
 *
 * For a text s (valid UTF-8) and a cut b that kv_tok_bounds_find returns:
 *
 *   encode(s, 0) == encode(s[0..b), 0) ++ encode(s[b..), 0)
 *
 * and for any other text s' with s'[0..b) == s[0..b), b is a cut of s'
 * too (when s' gives it) with the same ids before it. The proof is at
 * safe() in kv_tok_bound.c; t/unit/test_turn.c checks it differentially on
 * every shipped tokenizer and template.
 */
#ifndef KV_TOK_BOUND_H
#define KV_TOK_BOUND_H

#include <stddef.h>
#include <stdint.h>

#include "kv_tokenizer.h"

typedef struct kv_tok_bounds kv_tok_bounds_t;

/* The cut tokens of t (immutable, shared by threads). NULL: no memory. A
 * tokenizer with no safe added token gets an object that finds no cuts. */
kv_tok_bounds_t *kv_tok_bounds_new(const kv_tokenizer_t *t);
void kv_tok_bounds_free(kv_tok_bounds_t *b);

/* Number of added tokens usable as cuts. */
size_t kv_tok_bounds_count(const kv_tok_bounds_t *b);

/*
 * A fingerprint of everything encode depends on (vocabulary, merges, added
 * tokens, normalizer, pre-tokenizer, post-processor): equal tokenizers give
 * equal fingerprints in every process, so cached ids are keyed by it.
 */
uint64_t kv_tok_bounds_ident(const kv_tok_bounds_t *b);

/*
 * The cuts of s[0..n) (valid UTF-8), ascending, through *out (malloc'ed,
 * count returned; *out NULL when 0). -1: no memory.
 */
long kv_tok_bounds_find(const kv_tok_bounds_t *b, const char *s, size_t n, size_t **out);

/* The ids encode(..., add_special=1) puts before and after the text. */
void kv_tok_bounds_special(const kv_tok_bounds_t *b, const uint32_t **prefix, size_t *nprefix,
                           const uint32_t **suffix, size_t *nsuffix);

#endif
