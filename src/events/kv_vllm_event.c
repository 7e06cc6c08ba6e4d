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

/* An array header: its length in *n. */
static int rd_arr(rd_t *r, uint32_t *n)
{
    uint8_t c;

    if (rd_need(r, 1) != 0) {
        return -1;
    }
    c = *r->p;
    if ((c & 0xf0) == 0x90) {
        r->p++;
        *n = c & 0x0f;
        return 0;
    }
    if (c == 0xdc || c == 0xdd) {
        int k = c == 0xdc ? 2 : 4;
        if (rd_need(r, 1 + (size_t) k) != 0) {
            return -1;
        }
        *n = (uint32_t) kv_be(r->p + 1, k);
        r->p += 1 + k;
        /* every element takes at least one byte */
        return *n <= (size_t) (r->end - r->p) ? 0 : -1;
    }
    return -1;
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

/* Offsets of an event's arrays while they may still move. */
typedef struct {
    size_t h_off, t_off;
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

static int decode_stored(kv_vllm_batch_t *b, rd_t *r, kv_vllm_event_t *e, pending_t *pe,
                         uint32_t nf, char *err, size_t errlen)
{
    uint64_t v;
    uint32_t nt, i;
    int      neg;

    if (nf < 7) {
        return fail(b, err, errlen, "BlockStored has %u fields, expected at least 7", nf - 1);
    }
    e->kind = KV_VLLM_STORED;
    if (rd_hash_list(b, r, &pe->h_off, &e->n_hashes) != 0) {
        return fail(b, err, errlen, "BlockStored block_hashes is not a list of int or bytes");
    }
    if (!rd_nil(r)) {
        if (rd_hash(r, &e->parent) != 0) {
            return fail(b, err, errlen, "BlockStored parent_block_hash is not int, bytes or nil");
        }
        e->has_parent = 1;
    }
    if (rd_arr(r, &nt) != 0) {
        return fail(b, err, errlen, "BlockStored token_ids is not a list");
    }
    if (kv_grow((void **) &b->tokens, &b->cap_t, b->n_t + nt, sizeof(uint32_t)) != 0) {
        return fail(b, err, errlen, "out of memory");
    }
    pe->t_off = b->n_t;
    for (i = 0; i < nt; i++) {
        if (rd_int(r, &v, &neg) != 0 || neg || v > UINT32_MAX) {
            return fail(b, err, errlen, "BlockStored token id %u is not a u32", i);
        }
        b->tokens[b->n_t++] = (uint32_t) v;
    }
    e->n_tokens = nt;
    if (rd_int(r, &v, &neg) != 0 || neg || v == 0 || v > MAX_BLOCK_SIZE) {
        return fail(b, err, errlen, "BlockStored block_size is not a positive int");
    }
    e->block_size = (uint32_t) v;
    if (e->n_tokens && e->n_tokens != e->n_hashes * e->block_size) {
        return fail(b, err, errlen, "BlockStored has %zu token ids for %zu blocks of %u",
                    e->n_tokens, e->n_hashes, e->block_size);
    }
    if (!rd_nil(r)) {
        if (rd_int(r, &v, &neg) != 0) {
            return fail(b, err, errlen, "BlockStored lora_id is not int or nil");
        }
        e->has_lora_id = 1;
        e->lora_id = (int64_t) v;
    }
    if (rd_medium(r, &e->tier) != 0) {
        return fail(b, err, errlen, "BlockStored medium is not str or nil");
    }
    if (nf > 7 && !rd_nil(r)) {
        if (rd_str(r, &e->lora_name, &e->lora_name_len) != 0) {
            return fail(b, err, errlen, "BlockStored lora_name is not str or nil");
        }
    }
    for (i = 8; i < nf; i++) {
        if (rd_skip(r, 0) != 0) {
            return fail(b, err, errlen, "BlockStored field %u is malformed", i);
        }
    }
    return 0;
}

static int decode_removed(kv_vllm_batch_t *b, rd_t *r, kv_vllm_event_t *e, pending_t *pe,
                          uint32_t nf, char *err, size_t errlen)
{
    uint32_t i;

    if (nf < 2) {
        return fail(b, err, errlen, "BlockRemoved has no block_hashes");
    }
    e->kind = KV_VLLM_REMOVED;
    if (rd_hash_list(b, r, &pe->h_off, &e->n_hashes) != 0) {
        return fail(b, err, errlen, "BlockRemoved block_hashes is not a list of int or bytes");
    }
    if (nf > 2 && rd_medium(r, &e->tier) != 0) {
        return fail(b, err, errlen, "BlockRemoved medium is not str or nil");
    }
    for (i = 3; i < nf; i++) {
        if (rd_skip(r, 0) != 0) {
            return fail(b, err, errlen, "BlockRemoved field %u is malformed", i);
        }
    }
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

int kv_vllm_decode(kv_vllm_batch_t *b, const void *buf, size_t len,
                   char *err, size_t errlen)
{
    rd_t              r = { buf, (const uint8_t *) buf + len };
    kv_vllm_event_t  *e;
    pending_t        *pend = NULL;
    uint32_t          nt, n, nf, i, k;
    uint64_t          v;
    int               neg, rc = -1;
    const char       *tag;
    size_t            tag_len, j;

    b->n_events = 0;
    b->n_h = b->n_t = 0;
    b->unknown = 0;
    b->has_dp_rank = 0;
    b->dp_rank = 0;
    b->ts = 0;

    if (len == 0 || (*r.p == 0xc1)) {
        return fail(b, err, errlen, "bad msgpack (byte 0x%02x)", len ? *r.p : 0);
    }
    if (rd_arr(&r, &nt) != 0 || nt < 2) {
        return fail(b, err, errlen, "KVEventBatch is not an array [ts, events, dp_rank?]");
    }
    if (rd_ts(&r, &b->ts) != 0) {
        return fail(b, err, errlen, "KVEventBatch ts is not a number");
    }
    if (rd_arr(&r, &n) != 0) {
        return fail(b, err, errlen, "KVEventBatch events is not a list");
    }
    if (kv_grow((void **) &b->events, &b->cap_events, n ? n : 1, sizeof(kv_vllm_event_t)) != 0
        || (pend = malloc((n ? n : 1) * sizeof(pending_t))) == NULL)
    {
        return fail(b, err, errlen, "out of memory");
    }

    for (i = 0; i < n; i++) {
        if (rd_arr(&r, &nf) != 0 || nf == 0) {
            fail(b, err, errlen, "event %u is not a tagged array", i);
            goto done;
        }
        if (rd_str(&r, &tag, &tag_len) != 0) {
            fail(b, err, errlen, "event %u has no tag", i);
            goto done;
        }
        e = &b->events[b->n_events];
        memset(e, 0, sizeof(*e));
        memset(&pend[b->n_events], 0, sizeof(pending_t));
        if (tag_len == 11 && memcmp(tag, "BlockStored", 11) == 0) {
            if (decode_stored(b, &r, e, &pend[b->n_events], nf, err, errlen) != 0) {
                goto done;
            }
        } else if (tag_len == 12 && memcmp(tag, "BlockRemoved", 12) == 0) {
            if (decode_removed(b, &r, e, &pend[b->n_events], nf, err, errlen) != 0) {
                goto done;
            }
        } else if (tag_len == 16 && memcmp(tag, "AllBlocksCleared", 16) == 0) {
            e->kind = KV_VLLM_CLEARED;
            for (k = 1; k < nf; k++) {
                if (rd_skip(&r, 0) != 0) {
                    fail(b, err, errlen, "event %u is malformed", i);
                    goto done;
                }
            }
        } else {
            for (k = 1; k < nf; k++) {
                if (rd_skip(&r, 0) != 0) {
                    fail(b, err, errlen, "event %u is malformed", i);
                    goto done;
                }
            }
            b->unknown++;
            continue;
        }
        b->n_events++;
    }

    if (nt > 2 && !rd_nil(&r)) {
        if (rd_int(&r, &v, &neg) != 0 || neg || v > UINT32_MAX) {
            fail(b, err, errlen, "KVEventBatch data_parallel_rank is not an int or nil");
            goto done;
        }
        b->has_dp_rank = 1;
        b->dp_rank = (uint32_t) v;
    }
    for (k = 3; k < nt; k++) {
        if (rd_skip(&r, 0) != 0) {
            fail(b, err, errlen, "KVEventBatch field %u is malformed", k);
            goto done;
        }
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
