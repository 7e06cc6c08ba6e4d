/*
 * Turn-delta tokenization: a request's prompt text to ids, exactly as
 * kv_request_encode computes them, reusing the ids of the longest prefix
 * that any nginx worker process tokenized recently (a chat's next turn
 * repeats the whole conversation so far) and tokenizing only the rest.
 *
 * Prefixes are cut only where tokenization is provably context-free (the
 * ends of added tokens nothing can straddle: src/text/kv_tok_bound.c), are
 * keyed by a hash of the tokenizer's fingerprint and the prefix text, and
 * are compared in full on a hit (src/index/kv_tcache.h): a conversation
 * whose history was edited misses from the edit on.
 */
#ifndef KV_TURN_H
#define KV_TURN_H

#include <stddef.h>
#include <stdint.h>

#include "kv_request.h"
#include "kv_tcache.h"
#include "kv_tok_bound.h"

typedef struct {
    kv_tcache_t            *cache;      /* NULL: off */
    const kv_tok_bounds_t  *bounds;     /* of the tokenizer used; NULL: off */
} kv_turn_t;

/* Probes at most this many cuts, from the end back: a hit is near the end. */
#define KV_TURN_MAX_PROBES  64

typedef struct {
    size_t      reused_bytes;       /* prefix served from the cache (0: miss) */
    size_t      reused_ids;
    int         stored;             /* this text's prefix was stored */
} kv_turn_info_t;

/*
 * As kv_request_encode(tok, kind, text, len, ids); info may be NULL. now_ms:
 * a monotonic clock shared by the processes (kv_clock_ms()), for the TTL.
 */
long kv_turn_encode(const kv_turn_t *tc, const kv_tokenizer_t *tok, kv_request_kind_t kind,
                    const char *text, size_t len, uint64_t now_ms, kv_ids_t *ids,
                    kv_turn_info_t *info);

#endif
