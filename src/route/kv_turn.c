/* Turn-delta tokenization (see kv_turn.h). */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <xxhash.h>

#include "kv_turn.h"
#include "kv_unicode.h"

static int push_all(kv_ids_t *ids, const uint32_t *src, size_t n)
{
    uint32_t *grown;
    size_t    cap;

    if (ids->n + n > ids->cap) {
        cap = ids->cap ? ids->cap : 256;
        while (cap < ids->n + n) {
            cap *= 2;
        }
        grown = realloc(ids->ids, cap * sizeof(uint32_t));
        if (grown == NULL) {
            return -1;
        }
        ids->ids = grown;
        ids->cap = cap;
    }
    if (n) {
        memcpy(ids->ids + ids->n, src, n * sizeof(uint32_t));
    }
    ids->n += n;
    return 0;
}

/*
 * Keys of the prefixes text[0..cut) for the last nprobe cuts, longest
 * first: one streaming hash over the text, read at each of those cuts.
 */
static int probe_keys(uint64_t ident, const char *text, const size_t *cuts, size_t ncuts,
                      kv_tcache_probe_t *probes, size_t nprobe)
{
    XXH3_state_t *st = XXH3_createState();
    size_t        i, from = 0, first = ncuts - nprobe;

    if (st == NULL) {
        return -1;
    }
    XXH3_64bits_reset_withSeed(st, ident);
    for (i = first; i < ncuts; i++) {
        XXH3_64bits_update(st, text + from, cuts[i] - from);
        from = cuts[i];
        probes[ncuts - 1 - i].key = XXH3_64bits_digest(st);
        probes[ncuts - 1 - i].len = cuts[i];
    }
    XXH3_freeState(st);
    return 0;
}

long kv_turn_encode(const kv_turn_t *tc, const kv_tokenizer_t *tok, kv_request_kind_t kind,
                    const char *text, size_t len, uint64_t now_ms, kv_ids_t *ids,
                    kv_turn_info_t *info)
{
    kv_tcache_probe_t  probes[KV_TURN_MAX_PROBES];
    const uint32_t    *pre, *suf;
    size_t            *cuts = NULL, npre, nsuf, nprobe, hit_len = 0, last, body, at_last;
    size_t             before = ids->n, ncached = 0;
    uint32_t          *cached = NULL;
    long               ncuts, hit;
    kv_turn_info_t     dummy;

    if (info == NULL) {
        info = &dummy;
    }
    memset(info, 0, sizeof(*info));
    if (tc == NULL || tc->cache == NULL || tc->bounds == NULL
        || !kv_utf8_valid((const uint8_t *) text, len))
    {
        /* invalid UTF-8 is replaced before encoding: positions would move */
        return kv_request_encode(tok, kind, text, len, ids);
    }
    ncuts = kv_tok_bounds_find(tc->bounds, text, len, &cuts);
    if (ncuts < 0) {
        return -1;
    }
    if (ncuts == 0) {
        return kv_request_encode(tok, kind, text, len, ids);
    }
    nprobe = (size_t) ncuts < KV_TURN_MAX_PROBES ? (size_t) ncuts : KV_TURN_MAX_PROBES;
    last = cuts[ncuts - 1];
    if (probe_keys(kv_tok_bounds_ident(tc->bounds), text, cuts, (size_t) ncuts, probes,
                   nprobe) != 0)
    {
        free(cuts);
        return -1;
    }
    free(cuts);

    hit = kv_tcache_get(tc->cache, probes, nprobe, text, now_ms, &cached, &ncached);
    if (hit == -2) {
        return -1;
    }
    if (hit >= 0) {
        hit_len = probes[hit].len;
        info->reused_bytes = hit_len;
        info->reused_ids = ncached;
    }

    kv_tok_bounds_special(tc->bounds, &pre, &npre, &suf, &nsuf);
    if (kind == KV_REQUEST_COMPLETION && push_all(ids, pre, npre) != 0) {
        goto fail;
    }
    body = ids->n;
    if (push_all(ids, cached, ncached) != 0) {
        goto fail;
    }
    free(cached);
    cached = NULL;
    if (last > hit_len) {
        if (kv_tokenizer_encode(tok, text + hit_len, last - hit_len, 0, ids) < 0) {
            goto fail;
        }
        at_last = ids->n;
        if (kv_tokenizer_encode(tok, text + last, len - last, 0, ids) < 0) {
            goto fail;
        }
        /* probes[0] is the last cut's */
        info->stored = kv_tcache_put(tc->cache, probes[0].key, text, last, ids->ids + body,
                                     at_last - body, now_ms) == 0;
    } else if (kv_tokenizer_encode(tok, text + hit_len, len - hit_len, 0, ids) < 0) {
        goto fail;
    }
    if (kind == KV_REQUEST_COMPLETION && push_all(ids, suf, nsuf) != 0) {
        goto fail;
    }
    return (long) (ids->n - before);

fail:
    free(cached);
    return -1;
}
