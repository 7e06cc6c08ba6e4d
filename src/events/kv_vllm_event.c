/* vLLM / SGLang KVEventBatch decoding (see kv_vllm_event.h). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include <xxhash.h>

#include "kv_buf.h"
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
    free(b->events);
    free(b->hashes);
    free(b->tokens);
    memset(b, 0, sizeof(*b));
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

int kv_vllm_salted(const kv_vllm_event_t *e)
{
    return e->salt != NULL
           && !(e->salt_first && e->lora_name && e->lora_name_len == e->salt_len
                && memcmp(e->lora_name, e->salt, e->salt_len) == 0);
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

/* --- a msgpack reader for exactly this schema ----------------------------------
 * Streaming, no tree: token id arrays are the bulk of a batch, and a node
 * per token would cost more than hashing them. */

typedef struct {
    const uint8_t *p, *end;
} rd_t;

#define MAX_SKIP_DEPTH 32

static int rd_need(rd_t *r, size_t n)
{
    return (size_t) (r->end - r->p) >= n ? 0 : -1;
}

/*
 * A container header: fix is the fixed-size type's high nibble (0x90
 * array, 0x80 map), c16 its 16-bit form (c16 + 1: 32-bit); per is the
 * fewest bytes an element takes, so a length the input cannot hold fails
 * here and not after a huge allocation. Its length in *n.
 */
static int rd_hdr(rd_t *r, uint8_t fix, uint8_t c16, size_t per, uint32_t *n)
{
    uint8_t c;
    int     k;

    if (rd_need(r, 1) != 0) {
        return -1;
    }
    c = *r->p;
    if ((c & 0xf0) == fix) {
        r->p++;
        *n = c & 0x0f;
        return 0;
    }
    if (c != c16 && c != c16 + 1) {
        return -1;
    }
    k = c == c16 ? 2 : 4;
    if (rd_need(r, 1 + (size_t) k) != 0) {
        return -1;
    }
    *n = (uint32_t) kv_be(r->p + 1, k);
    r->p += 1 + k;
    return *n <= (size_t) (r->end - r->p) / per ? 0 : -1;
}

/* An array header: its length in *n. */
static int rd_arr(rd_t *r, uint32_t *n)
{
    return rd_hdr(r, 0x90, 0xdc, 1, n);
}

/* A map header: its number of pairs in *n (a pair takes two bytes). */
static int rd_map(rd_t *r, uint32_t *n)
{
    return rd_hdr(r, 0x80, 0xde, 2, n);
}

static int rd_nil(rd_t *r)
{
    if (r->p < r->end && *r->p == 0xc0) {
        r->p++;
        return 1;
    }
    return 0;
}

/* An integer: *v as two's complement, *neg when negative. */
static int rd_int(rd_t *r, uint64_t *v, int *neg)
{
    uint8_t c;
    int     k;

    if (rd_need(r, 1) != 0) {
        return -1;
    }
    c = *r->p;
    *neg = 0;
    if (c <= 0x7f) {
        r->p++;
        *v = c;
        return 0;
    }
    if (c >= 0xe0) {
        r->p++;
        *v = (uint64_t) (int64_t) (int8_t) c;
        *neg = 1;
        return 0;
    }
    if (c >= 0xcc && c <= 0xcf) {
        k = 1 << (c - 0xcc);
        if (rd_need(r, 1 + (size_t) k) != 0) {
            return -1;
        }
        *v = kv_be(r->p + 1, k);
        r->p += 1 + k;
        return 0;
    }
    if (c >= 0xd0 && c <= 0xd3) {
        int64_t sv;
        k = 1 << (c - 0xd0);
        if (rd_need(r, 1 + (size_t) k) != 0) {
            return -1;
        }
        *v = kv_be(r->p + 1, k);
        sv = k == 8 ? (int64_t) *v : (int64_t) (*v << (64 - 8 * k)) >> (64 - 8 * k);
        *v = (uint64_t) sv;
        *neg = sv < 0;
        r->p += 1 + k;
        return 0;
    }
    return -1;
}

/* A str (is_bin 0) or bin (is_bin 1). */
static int rd_bytes(rd_t *r, const char **s, size_t *len, int *is_bin)
{
    uint8_t  c;
    int      k = 0;
    uint64_t n = 0;

    if (rd_need(r, 1) != 0) {
        return -1;
    }
    c = *r->p;
    if ((c & 0xe0) == 0xa0) {
        n = c & 0x1f;
        *is_bin = 0;
    } else if (c >= 0xd9 && c <= 0xdb) {
        k = 1 << (c - 0xd9);
        *is_bin = 0;
    } else if (c >= 0xc4 && c <= 0xc6) {
        k = 1 << (c - 0xc4);
        *is_bin = 1;
    } else {
        return -1;
    }
    if (k) {
        if (rd_need(r, 1 + (size_t) k) != 0) {
            return -1;
        }
        n = kv_be(r->p + 1, k);
    }
    r->p += 1 + k;
    if (rd_need(r, n) != 0) {
        return -1;
    }
    *s = (const char *) r->p;
    *len = (size_t) n;
    r->p += n;
    return 0;
}

static int rd_str(rd_t *r, const char **s, size_t *len)
{
    int is_bin;
    return rd_bytes(r, s, len, &is_bin) == 0 && !is_bin ? 0 : -1;
}

/* Skips one value of any type. */
static int rd_skip(rd_t *r, int depth)
{
    uint8_t     c;
    uint64_t    v, n, i;
    int         neg, k;
    const char *s;
    size_t      len;

    if (depth > MAX_SKIP_DEPTH || rd_need(r, 1) != 0) {
        return -1;
    }
    c = *r->p;
    if (c <= 0x7f || c >= 0xe0 || (c >= 0xcc && c <= 0xd3)) {
        return rd_int(r, &v, &neg);
    }
    if (c == 0xc0 || c == 0xc2 || c == 0xc3) {
        r->p++;
        return 0;
    }
    if (c == 0xca || c == 0xcb) {
        k = c == 0xca ? 4 : 8;
        if (rd_need(r, 1 + (size_t) k) != 0) {
            return -1;
        }
        r->p += 1 + k;
        return 0;
    }
    if ((c & 0xe0) == 0xa0 || (c >= 0xd9 && c <= 0xdb) || (c >= 0xc4 && c <= 0xc6)) {
        return rd_bytes(r, &s, &len, &neg);
    }
    if ((c & 0xf0) == 0x90 || c == 0xdc || c == 0xdd || (c & 0xf0) == 0x80
        || c == 0xde || c == 0xdf)
    {
        int map = (c & 0xf0) == 0x80 || c == 0xde || c == 0xdf;

        if ((c & 0xf0) == 0x90 || (c & 0xf0) == 0x80) {
            n = c & 0x0f;
            r->p++;
        } else {
            k = (c == 0xdc || c == 0xde) ? 2 : 4;
            if (rd_need(r, 1 + (size_t) k) != 0) {
                return -1;
            }
            n = kv_be(r->p + 1, k);
            r->p += 1 + k;
        }
        if (map) {
            n *= 2;
        }
        if (n > (uint64_t) (r->end - r->p)) {
            return -1;
        }
        for (i = 0; i < n; i++) {
            if (rd_skip(r, depth + 1) != 0) {
                return -1;
            }
        }
        return 0;
    }
    return -1;      /* ext types and 0xc1 */
}

/* One block hash: int bit-cast, bytes hashed. */
static int rd_hash(rd_t *r, uint64_t *out)
{
    uint64_t    v;
    int         neg, is_bin;
    const char *s;
    size_t      len;

    if (rd_int(r, &v, &neg) == 0) {
        *out = v;
        return 0;
    }
    if (rd_bytes(r, &s, &len, &is_bin) == 0 && len > 0) {
        *out = XXH3_64bits(s, len);
        return 0;
    }
    return -1;
}

/* Appends a list of hashes; their offset in *off, count in *n. */
static int rd_hash_list(kv_vllm_batch_t *b, rd_t *r, size_t *off, size_t *n)
{
    uint32_t k, i;

    if (rd_arr(r, &k) != 0
        || kv_grow((void **) &b->hashes, &b->cap_h, b->n_h + k, sizeof(uint64_t)) != 0)
    {
        return -1;
    }
    *off = b->n_h;
    for (i = 0; i < k; i++) {
        if (rd_hash(r, &b->hashes[b->n_h]) != 0) {
            return -1;
        }
        b->n_h++;
    }
    *n = k;
    return 0;
}

/* Offsets of an event's arrays while they may still move, and the fields
 * seen (bit per field_t). */
typedef struct {
    size_t      h_off, t_off;
    unsigned    seen;
} pending_t;

/* medium: str or nil. */
static int rd_medium(rd_t *r, uint32_t *tier)
{
    const char *s;
    size_t      len;

    if (rd_nil(r)) {
        *tier = KV_TIER_DEVICE;
        return 0;
    }
    if (rd_str(r, &s, &len) != 0) {
        return -1;
    }
    *tier = kv_vllm_tier(s, len);
    return 0;
}

/*
 * The event fields kvroute reads. Publishers differ in how they send them:
 *
 *   - a tagged array, fields by position, trailing defaults omitted: SGLang
 *     and vLLM 0.9 send BlockStored with 5 fields (up to lora_id), vLLM 0.10
 *     adds medium and lora_name, later ones extra_keys, group_idx and the
 *     group's kv_cache_spec_kind;
 *   - a map with the tag under "type" (vLLM since its events dropped
 *     msgspec's array_like), fields by name, defaults omitted.
 *
 * Both go through read_field(); unknown fields are skipped either way.
 */
typedef enum {
    F_SKIP = 0,
    F_HASHES,
    F_PARENT,
    F_TOKENS,
    F_BLOCK_SIZE,
    F_LORA_ID,
    F_MEDIUM,
    F_LORA_NAME,
    F_GROUP_IDX,
    F_SPEC_KIND,
    F_EXTRA_KEYS,
    F_N
} field_t;

static const char *const field_name[F_N] = {
    "", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
    "medium", "lora_name", "group_idx", "kv_cache_spec_kind", "extra_keys"
};

/* Array positions after the tag, in vllm/distributed/kv_events.py's order. */
static const field_t stored_order[] = {
    F_HASHES, F_PARENT, F_TOKENS, F_BLOCK_SIZE, F_LORA_ID, F_MEDIUM, F_LORA_NAME,
    F_EXTRA_KEYS, F_GROUP_IDX, F_SPEC_KIND
};
static const field_t removed_order[] = { F_HASHES, F_MEDIUM, F_GROUP_IDX };

#define STORED_MIN_FIELDS   4       /* block_hashes .. block_size */
#define NELEM(a)            (sizeof(a) / sizeof((a)[0]))

/* Whether s[0..len) is the string lit. */
static int is(const char *s, size_t len, const char *lit)
{
    return strlen(lit) == len && memcmp(s, lit, len) == 0;
}

int kv_vllm_full_attention(const kv_vllm_event_t *e)
{
    const char *k = e->spec_kind;
    size_t      n = e->spec_kind_len;

    return k != NULL && (is(k, n, "full_attention") || is(k, n, "mla_attention")
                         || is(k, n, "sink_full_attention"));
}

/* An event's name in messages. */
static const char *kind_name(const kv_vllm_event_t *e)
{
    return e->kind == KV_VLLM_STORED ? "BlockStored"
         : e->kind == KV_VLLM_REMOVED ? "BlockRemoved" : "event";
}

static field_t field_by_name(const char *s, size_t len)
{
    int f;

    for (f = 1; f < F_N; f++) {
        if (is(s, len, field_name[f])) {
            return (field_t) f;
        }
    }
    return F_SKIP;
}

/* A str or nil; *s NULL for nil. */
static int rd_opt_str(rd_t *r, const char **s, size_t *len)
{
    if (rd_nil(r)) {
        *s = NULL;
        *len = 0;
        return 0;
    }
    return rd_str(r, s, len);
}

/* One token id: an int, or an EAGLE bigram [id, next id] (SGLang with
 * speculative decoding keys its cache by pairs), whose first id is the
 * token at that place, which is what the router hashes. */
static int rd_token(rd_t *r, uint32_t *id)
{
    const uint8_t *at = r->p;
    uint64_t       v, next;
    uint32_t       n;
    int            neg, neg_next;

    if (rd_arr(r, &n) == 0) {
        if (n != 2 || rd_int(r, &v, &neg) != 0 || rd_int(r, &next, &neg_next) != 0) {
            r->p = at;
            return -1;
        }
    } else if (rd_int(r, &v, &neg) != 0) {
        return -1;
    }
    if (neg || v > UINT32_MAX) {
        return -1;
    }
    *id = (uint32_t) v;
    return 0;
}

static int rd_tokens(kv_vllm_batch_t *b, rd_t *r, kv_vllm_event_t *e, pending_t *pe,
                     char *err, size_t errlen)
{
    uint32_t nt, i;

    if (rd_nil(r)) {
        return 0;
    }
    if (rd_arr(r, &nt) != 0) {
        return fail(b, err, errlen, "%s token_ids is not a list", kind_name(e));
    }
    if (kv_grow((void **) &b->tokens, &b->cap_t, b->n_t + nt, sizeof(uint32_t)) != 0) {
        return fail(b, err, errlen, "out of memory");
    }
    pe->t_off = b->n_t;
    for (i = 0; i < nt; i++) {
        if (rd_token(r, &b->tokens[b->n_t]) != 0) {
            return fail(b, err, errlen, "%s token id %u is not a u32 or a pair of them",
                        kind_name(e), i);
        }
        b->n_t++;
    }
    e->n_tokens = nt;
    return 0;
}

/*
 * extra_keys: one tuple (or nil) per block, what vLLM hashed beside the
 * tokens: the LoRA name, multimodal keys, the request's cache_salt (first
 * block of a prompt only), a prompt-embeds digest (bytes). The salt is the
 * first block's last str, unless that str is the LoRA name it starts with.
 */
static int rd_extra_keys(rd_t *r, kv_vllm_event_t *e)
{
    uint32_t    n, k, i, j;
    const char *s;
    size_t      len;
    int         is_bin;

    if (rd_nil(r)) {
        return 0;
    }
    if (rd_arr(r, &n) != 0) {
        return -1;
    }
    for (i = 0; i < n; i++) {
        if (i > 0 || rd_nil(r)) {
            if (i > 0 && rd_skip(r, 0) != 0) {
                return -1;
            }
            continue;
        }
        if (rd_arr(r, &k) != 0) {
            return -1;
        }
        for (j = 0; j < k; j++) {
            if (rd_bytes(r, &s, &len, &is_bin) != 0) {
                if (rd_skip(r, 0) != 0) {
                    return -1;
                }
                continue;
            }
            if (is_bin) {
                continue;
            }
            e->salt = s;
            e->salt_len = len;
            e->salt_first = j == 0;
        }
    }
    return 0;
}

/* Reads field f of the event into e; a wrong type fails the batch. */
static int read_field(kv_vllm_batch_t *b, rd_t *r, kv_vllm_event_t *e, pending_t *pe,
                      field_t f, char *err, size_t errlen)
{
    const char *what = field_name[f];
    uint64_t    v;
    int         neg;

    pe->seen |= 1u << f;
    switch (f) {
    case F_HASHES:
        if (rd_hash_list(b, r, &pe->h_off, &e->n_hashes) != 0) {
            return fail(b, err, errlen, "%s block_hashes is not a list of int or bytes",
                        kind_name(e));
        }
        return 0;
    case F_PARENT:
        if (rd_nil(r)) {
            return 0;
        }
        e->has_parent = 1;
        if (rd_hash(r, &e->parent) == 0) {
            return 0;
        }
        return fail(b, err, errlen, "%s parent_block_hash is not int, bytes or nil", kind_name(e));
    case F_TOKENS:
        return rd_tokens(b, r, e, pe, err, errlen);
    case F_BLOCK_SIZE:
        if (rd_int(r, &v, &neg) != 0 || neg || v == 0 || v > MAX_BLOCK_SIZE) {
            return fail(b, err, errlen, "%s block_size is not a positive int", kind_name(e));
        }
        e->block_size = (uint32_t) v;
        return 0;
    case F_LORA_ID:
        if (rd_nil(r)) {
            return 0;
        }
        if (rd_int(r, &v, &neg) != 0) {
            break;
        }
        e->has_lora_id = 1;
        e->lora_id = (int64_t) v;
        return 0;
    case F_MEDIUM:
        if (rd_medium(r, &e->tier) == 0) {
            return 0;
        }
        break;
    case F_LORA_NAME:
        if (rd_opt_str(r, &e->lora_name, &e->lora_name_len) == 0) {
            return 0;
        }
        break;
    case F_GROUP_IDX:
        if (rd_nil(r)) {
            return 0;
        }
        if (rd_int(r, &v, &neg) != 0 || neg || v > UINT32_MAX) {
            break;
        }
        e->has_group = 1;
        e->group_idx = (uint32_t) v;
        return 0;
    case F_SPEC_KIND:
        if (rd_opt_str(r, &e->spec_kind, &e->spec_kind_len) == 0) {
            return 0;
        }
        break;
    case F_EXTRA_KEYS:
        if (rd_extra_keys(r, e) == 0) {
            return 0;
        }
        break;
    default:
        if (rd_skip(r, 0) == 0) {
            return 0;
        }
        return fail(b, err, errlen, "%s has a malformed field", kind_name(e));
    }
    return fail(b, err, errlen, "%s %s is of the wrong type", kind_name(e), what);
}

static kv_vllm_kind_t kind_of(const char *tag, size_t len)
{
    return is(tag, len, "BlockStored") ? KV_VLLM_STORED
         : is(tag, len, "BlockRemoved") ? KV_VLLM_REMOVED
         : is(tag, len, "AllBlocksCleared") ? KV_VLLM_CLEARED : 0;
}

/* ["Tag", field...]: nf counts the tag. */
static int decode_array_event(kv_vllm_batch_t *b, rd_t *r, kv_vllm_event_t *e, pending_t *pe,
                              uint32_t nf, char *err, size_t errlen)
{
    const field_t *order = NULL;
    size_t         n_order = 0;
    const char    *tag;
    size_t         tag_len;
    uint32_t       i;

    if (rd_str(r, &tag, &tag_len) != 0) {
        return fail(b, err, errlen, "event has no tag");
    }
    e->kind = kind_of(tag, tag_len);
    if (e->kind == KV_VLLM_STORED) {
        order = stored_order;
        n_order = NELEM(stored_order);
        if (nf - 1 < STORED_MIN_FIELDS) {
            return fail(b, err, errlen, "BlockStored has %u fields, expected at least %u",
                        nf - 1, STORED_MIN_FIELDS);
        }
    } else if (e->kind == KV_VLLM_REMOVED) {
        order = removed_order;
        n_order = NELEM(removed_order);
    }
    for (i = 1; i < nf; i++) {
        if (read_field(b, r, e, pe, i - 1 < n_order ? order[i - 1] : F_SKIP, err, errlen) != 0) {
            return -1;
        }
    }
    return 0;
}

/* {"type": "Tag", "field": value, ...}, the pairs in any order. */
static int decode_map_event(kv_vllm_batch_t *b, rd_t *r, kv_vllm_event_t *e, pending_t *pe,
                            uint32_t np, char *err, size_t errlen)
{
    const char *key, *tag = NULL;
    size_t      key_len, tag_len = 0;
    uint32_t    i;
    field_t     f;

    for (i = 0; i < np; i++) {
        if (rd_str(r, &key, &key_len) != 0) {
            return fail(b, err, errlen, "%s has a key that is not a str", kind_name(e));
        }
        if (is(key, key_len, "type")) {
            if (rd_str(r, &tag, &tag_len) != 0) {
                return fail(b, err, errlen, "event type is not a str");
            }
            e->kind = kind_of(tag, tag_len);
            continue;
        }
        /* msgspec writes the tag first: past it, the fields of a kind
         * without any (AllBlocksCleared) or unknown here are skipped unread,
         * as in the array form */
        f = tag == NULL || e->kind == KV_VLLM_STORED || e->kind == KV_VLLM_REMOVED
            ? field_by_name(key, key_len) : F_SKIP;
        if (read_field(b, r, e, pe, f, err, errlen) != 0) {
            return -1;
        }
    }
    if (tag == NULL) {
        return fail(b, err, errlen, "event has no tag (\"type\")");
    }
    return 0;
}

/* The fields an event cannot do without, once all are read. */
static int check_event(kv_vllm_batch_t *b, const kv_vllm_event_t *e, const pending_t *pe,
                       char *err, size_t errlen)
{
    unsigned need;

    if (e->kind == KV_VLLM_STORED) {
        need = 1u << F_HASHES | 1u << F_BLOCK_SIZE;
    } else if (e->kind == KV_VLLM_REMOVED) {
        need = 1u << F_HASHES;
    } else {
        return 0;
    }
    if ((pe->seen & need) != need) {
        return fail(b, err, errlen, "%s lacks %s", kind_name(e),
                    (pe->seen & 1u << F_HASHES) ? "block_size" : "block_hashes");
    }
    if (e->kind == KV_VLLM_STORED && e->n_tokens
        && e->n_tokens != e->n_hashes * e->block_size)
    {
        return fail(b, err, errlen, "BlockStored has %zu token ids for %zu blocks of %u",
                    e->n_tokens, e->n_hashes, e->block_size);
    }
    return 0;
}

/* One event, either form; an unknown tag is skipped (its arrays dropped). */
static int decode_event(kv_vllm_batch_t *b, rd_t *r, pending_t *pe, uint32_t i,
                        char *err, size_t errlen)
{
    kv_vllm_event_t *e = &b->events[b->n_events];
    size_t           n_h = b->n_h, n_t = b->n_t;
    uint32_t         n;

    memset(e, 0, sizeof(*e));
    memset(pe, 0, sizeof(*pe));
    if (rd_arr(r, &n) == 0) {
        if (n == 0) {
            return fail(b, err, errlen, "event %u is not a tagged array or map", i);
        }
        if (decode_array_event(b, r, e, pe, n, err, errlen) != 0) {
            return -1;
        }
    } else if (rd_map(r, &n) == 0) {
        if (decode_map_event(b, r, e, pe, n, err, errlen) != 0) {
            return -1;
        }
    } else {
        return fail(b, err, errlen, "event %u is not a tagged array or map", i);
    }
    if (e->kind == 0) {
        b->n_h = n_h;
        b->n_t = n_t;
        b->unknown++;
        return 0;
    }
    if (check_event(b, e, pe, err, errlen) != 0) {
        return -1;
    }
    b->n_events++;
    return 0;
}

/* ts: float64, float32 or an int. */
static int rd_ts(rd_t *r, double *ts)
{
    uint64_t v;
    uint32_t w;
    float    f;
    int      neg;

    if (rd_need(r, 1) != 0) {
        return -1;
    }
    if (*r->p == 0xcb && rd_need(r, 9) == 0) {
        v = kv_be(r->p + 1, 8);
        memcpy(ts, &v, 8);
        r->p += 9;
        return 0;
    }
    if (*r->p == 0xca && rd_need(r, 5) == 0) {
        w = (uint32_t) kv_be(r->p + 1, 4);
        memcpy(&f, &w, 4);
        *ts = f;
        r->p += 5;
        return 0;
    }
    if (rd_int(r, &v, &neg) == 0 && !neg) {
        *ts = (double) v;
        return 0;
    }
    return -1;
}

/* The events list into b; *pend gets their pending offsets. */
static int decode_events(kv_vllm_batch_t *b, rd_t *r, pending_t **pend, char *err, size_t errlen)
{
    uint32_t n, i;

    if (*pend != NULL) {
        return fail(b, err, errlen, "KVEventBatch has two events lists");
    }
    if (rd_arr(r, &n) != 0) {
        return fail(b, err, errlen, "KVEventBatch events is not a list");
    }
    if (kv_grow((void **) &b->events, &b->cap_events, n ? n : 1, sizeof(kv_vllm_event_t)) != 0
        || (*pend = malloc((n ? n : 1) * sizeof(pending_t))) == NULL)
    {
        return fail(b, err, errlen, "out of memory");
    }
    for (i = 0; i < n; i++) {
        if (decode_event(b, r, &(*pend)[b->n_events], i, err, errlen) != 0) {
            return -1;
        }
    }
    return 0;
}

static int rd_dp_rank(kv_vllm_batch_t *b, rd_t *r, char *err, size_t errlen)
{
    uint64_t v;
    int      neg;

    if (rd_nil(r)) {
        return 0;
    }
    if (rd_int(r, &v, &neg) != 0 || neg || v > UINT32_MAX) {
        return fail(b, err, errlen, "KVEventBatch data_parallel_rank is not an int or nil");
    }
    b->has_dp_rank = 1;
    b->dp_rank = (uint32_t) v;
    return 0;
}

/* [ts, events, data_parallel_rank?, ...] */
static int decode_array_batch(kv_vllm_batch_t *b, rd_t *r, uint32_t nt, pending_t **pend,
                              char *err, size_t errlen)
{
    uint32_t k;

    if (nt < 2) {
        return fail(b, err, errlen, "KVEventBatch is not an array [ts, events, dp_rank?] "
                    "or a map");
    }
    if (rd_ts(r, &b->ts) != 0) {
        return fail(b, err, errlen, "KVEventBatch ts is not a number");
    }
    if (decode_events(b, r, pend, err, errlen) != 0
        || (nt > 2 && rd_dp_rank(b, r, err, errlen) != 0))
    {
        return -1;
    }
    for (k = 3; k < nt; k++) {
        if (rd_skip(r, 0) != 0) {
            return fail(b, err, errlen, "KVEventBatch field %u is malformed", k);
        }
    }
    return 0;
}

/* {"ts": ..., "events": [...], "data_parallel_rank": ...}, any order. */
static int decode_map_batch(kv_vllm_batch_t *b, rd_t *r, uint32_t np, pending_t **pend,
                            char *err, size_t errlen)
{
    const char *key;
    size_t      len;
    uint32_t    k;

    for (k = 0; k < np; k++) {
        if (rd_str(r, &key, &len) != 0) {
            return fail(b, err, errlen, "KVEventBatch has a key that is not a str");
        }
        if (is(key, len, "ts")) {
            if (rd_ts(r, &b->ts) != 0) {
                return fail(b, err, errlen, "KVEventBatch ts is not a number");
            }
        } else if (is(key, len, "events")) {
            if (decode_events(b, r, pend, err, errlen) != 0) {
                return -1;
            }
        } else if (is(key, len, "data_parallel_rank")) {
            if (rd_dp_rank(b, r, err, errlen) != 0) {
                return -1;
            }
        } else if (rd_skip(r, 0) != 0) {
            return fail(b, err, errlen, "KVEventBatch field \"%.*s\" is malformed",
                        (int) (len < 40 ? len : 40), key);
        }
    }
    if (*pend == NULL) {
        return fail(b, err, errlen, "KVEventBatch has no events");
    }
    return 0;
}

int kv_vllm_decode(kv_vllm_batch_t *b, const void *buf, size_t len,
                   char *err, size_t errlen)
{
    rd_t              r = { buf, (const uint8_t *) buf + len };
    kv_vllm_event_t  *e;
    pending_t        *pend = NULL;
    uint32_t          n;
    int               rc = -1;
    size_t            j;

    b->n_events = 0;
    b->n_h = b->n_t = 0;
    b->unknown = 0;
    b->has_dp_rank = 0;
    b->dp_rank = 0;
    b->ts = 0;

    if (len == 0 || (*r.p == 0xc1)) {
        return fail(b, err, errlen, "bad msgpack (byte 0x%02x)", len ? *r.p : 0);
    }
    if (rd_arr(&r, &n) == 0) {
        if (decode_array_batch(b, &r, n, &pend, err, errlen) != 0) {
            goto done;
        }
    } else if (rd_map(&r, &n) == 0) {
        if (decode_map_batch(b, &r, n, &pend, err, errlen) != 0) {
            goto done;
        }
    } else {
        fail(b, err, errlen, "KVEventBatch is not an array [ts, events, dp_rank?] or a map");
        goto done;
    }
    if (r.p != r.end) {
        fail(b, err, errlen, "trailing data after the batch");
        goto done;
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
