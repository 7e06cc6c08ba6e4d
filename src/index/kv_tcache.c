/* Text prefix -> token ids, in shared memory (see kv_tcache.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kv_tcache.h"
#include "kv_trylock.h"

#define TC_MAGIC    0x6b76746361636831ULL   /* "kvtcach1" */
#define TC_WAYS     4
#define TC_ENT      32                      /* entry header bytes */

typedef struct {
    uint64_t    key;
    uint64_t    pos;            /* ring position + 1; 0: empty */
} slot_t;

/* An entry's header; the ids (8-aligned) and the text follow it. */
typedef struct {
    uint64_t    key;
    uint64_t    pos;            /* its own ring position: tells it from stale bytes */
    uint64_t    created_ms;
    uint32_t    text_len;
    uint32_t    nids;
} ent_t;

struct kv_tcache {
    uint64_t    magic;
    uint64_t    size;
    uint64_t    nsets;          /* a power of two */
    uint64_t    cap;            /* ring bytes, a multiple of 8 */
    uint64_t    ttl_ms;
    uint64_t    lock;           /* the writer's pid << 32 | when (s), 0: free (try_lock) */
    uint64_t    head;           /* next write position (grows forever) */
    uint64_t    reclaim;        /* entries starting below it may be overwritten */
    uint64_t    lookups, hits, misses, hit_tokens, stored, skipped, evicted, expired;
    uint64_t    pad[2];
};

#define ALIGN8(n)  (((n) + 7) & ~(uint64_t) 7)

static slot_t *slots(const kv_tcache_t *c)
{
    return (slot_t *) ((char *) c + sizeof(kv_tcache_t));
}

static char *ring(const kv_tcache_t *c)
{
    return (char *) (slots(c) + c->nsets * TC_WAYS);
}

static uint64_t ent_size(uint64_t text_len, uint64_t nids)
{
    return TC_ENT + ALIGN8(nids * 4) + ALIGN8(text_len);
}

static void count(uint64_t *ctr, uint64_t n)
{
    __atomic_fetch_add(ctr, n, __ATOMIC_RELAXED);
}

/* Copies of shared bytes race with a writer: whole words, relaxed loads
 * (kv_seqlock.h); src is 8-aligned, n a multiple of 8. */
static void load_words(void *dst, const char *src, size_t n)
{
    const uint64_t *s = (const uint64_t *) src;
    uint64_t        w;
    size_t          i;

    for (i = 0; i < n / 8; i++) {
        w = __atomic_load_n(&s[i], __ATOMIC_RELAXED);
        memcpy((char *) dst + 8 * i, &w, 8);
    }
}

/* dst 8-aligned; the last word is zero-padded. */
static void store_words(char *dst, const void *src, size_t n)
{
    uint64_t *d = (uint64_t *) dst, w;
    size_t    i;

    for (i = 0; i < n / 8; i++) {
        memcpy(&w, (const char *) src + 8 * i, 8);
        __atomic_store_n(&d[i], w, __ATOMIC_RELAXED);
    }
    if (n % 8) {
        w = 0;
        memcpy(&w, (const char *) src + 8 * i, n % 8);
        __atomic_store_n(&d[i], w, __ATOMIC_RELAXED);
    }
}

/* text[0..n) equals the shared bytes at src (racy: checked by the caller) */
static int equal_words(const char *src, const char *text, size_t n)
{
    uint64_t buf[256];
    size_t   k, chunk;

    for (k = 0; k < n; k += chunk) {
        chunk = n - k < sizeof(buf) ? n - k : sizeof(buf);
        load_words(buf, src + k, ALIGN8(chunk));
        if (memcmp(buf, text + k, chunk) != 0) {
            return 0;
        }
    }
    return 1;
}

size_t kv_tcache_min_size(void)
{
    return sizeof(kv_tcache_t) + 16 * TC_WAYS * sizeof(slot_t) + 16384;
}

kv_tcache_t *kv_tcache_create(void *mem, size_t size, uint64_t ttl_ms, char *err, size_t errlen)
{
    kv_tcache_t *c = mem;
    uint64_t     nsets = 16, rest;

    if (size < kv_tcache_min_size() || ((uintptr_t) mem & 7)) {
        snprintf(err, errlen, "turn cache: %zu bytes is too small (at least %zu)", size,
                 kv_tcache_min_size());
        return NULL;
    }
    /* about one slot per 2 KB of ring: entries are whole conversations */
    while (nsets * 2 * TC_WAYS * 2048 <= size) {
        nsets *= 2;
    }
    memset(c, 0, sizeof(*c));
    rest = size - sizeof(kv_tcache_t) - nsets * TC_WAYS * sizeof(slot_t);
    c->size = size;
    c->nsets = nsets;
    c->cap = rest & ~(uint64_t) 7;
    c->ttl_ms = ttl_ms;
    memset(slots(c), 0, nsets * TC_WAYS * sizeof(slot_t));
    __atomic_store_n(&c->magic, TC_MAGIC, __ATOMIC_RELEASE);
    return c;
}

kv_tcache_t *kv_tcache_attach(void *mem, size_t size)
{
    kv_tcache_t *c = mem;

    return c && c->magic == TC_MAGIC && c->size == size ? c : NULL;
}

void kv_tcache_set_ttl(kv_tcache_t *c, uint64_t ttl_ms)
{
    __atomic_store_n(&c->ttl_ms, ttl_ms, __ATOMIC_RELAXED);
}

/* The entry at ring position pos if it holds key and text[0..len). */
static long read_entry(kv_tcache_t *c, uint64_t key, uint64_t pos, const char *text, size_t len,
                       uint64_t now_ms, uint32_t **ids, size_t *nids)
{
    ent_t     h;
    uint64_t  off = pos % c->cap, size, ttl;
    uint32_t *out;

    if (pos < __atomic_load_n(&c->reclaim, __ATOMIC_ACQUIRE) || off + TC_ENT > c->cap) {
        return -1;
    }
    load_words(&h, ring(c) + off, TC_ENT);
    size = ent_size(h.text_len, h.nids);
    if (h.key != key || h.pos != pos || h.text_len != len || off + size > c->cap) {
        return -1;
    }
    ttl = __atomic_load_n(&c->ttl_ms, __ATOMIC_RELAXED);
    if (ttl && now_ms > h.created_ms && now_ms - h.created_ms > ttl) {
        count(&c->expired, 1);
        return -1;
    }
    if (!equal_words(ring(c) + off + TC_ENT + ALIGN8((uint64_t) h.nids * 4), text, len)) {
        return -1;
    }
    out = malloc(ALIGN8((uint64_t) h.nids * 4) + 8);
    if (out == NULL) {
        return -2;
    }
    load_words(out, ring(c) + off + TC_ENT, ALIGN8((uint64_t) h.nids * 4));
    /* everything copied is whole if no writer has claimed its bytes since */
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (__atomic_load_n(&c->reclaim, __ATOMIC_RELAXED) > pos) {
        free(out);
        return -1;
    }
    *ids = out;
    *nids = h.nids;
    return 0;
}

long kv_tcache_get(kv_tcache_t *c, const kv_tcache_probe_t *probes, size_t nprobes,
                   const char *text, uint64_t now_ms, uint32_t **ids, size_t *nids)
{
    size_t   i, w;
    slot_t  *set;
    uint64_t pos;
    long     rc;

    count(&c->lookups, 1);
    for (i = 0; i < nprobes; i++) {
        set = slots(c) + (probes[i].key & (c->nsets - 1)) * TC_WAYS;
        for (w = 0; w < TC_WAYS; w++) {
            if (__atomic_load_n(&set[w].key, __ATOMIC_RELAXED) != probes[i].key) {
                continue;
            }
            pos = __atomic_load_n(&set[w].pos, __ATOMIC_ACQUIRE);
            if (pos == 0) {
                continue;
            }
            rc = read_entry(c, probes[i].key, pos - 1, text, probes[i].len, now_ms, ids, nids);
            if (rc == -2) {
                return -2;
            }
            if (rc == 0) {
                count(&c->hits, 1);
                count(&c->hit_tokens, *nids);
                return (long) i;
            }
        }
    }
    count(&c->misses, 1);
    return -1;
}

/* The writer's lock (kv_trylock.h): a put takes microseconds. */
#define TC_LOCK_STALE_S 10

static int try_lock(kv_tcache_t *c)
{
    return kv_trylock(&c->lock, TC_LOCK_STALE_S);
}

/* Moves the reclaim mark past every entry that [.., end) will overwrite. */
static void reclaim_to(kv_tcache_t *c, uint64_t need, uint64_t limit)
{
    uint64_t t = c->reclaim, off, n = 0;
    ent_t    h;

    while (t < need) {
        off = t % c->cap;
        if (off + TC_ENT <= c->cap) {
            load_words(&h, ring(c) + off, TC_ENT);
            if (h.pos == t && off + ent_size(h.text_len, h.nids) <= c->cap) {
                t += ent_size(h.text_len, h.nids);
                n++;
                continue;
            }
        }
        t += c->cap - off;          /* the gap a wrapped entry left */
    }
    if (t > limit) {
        t = limit;
    }
    __atomic_store_n(&c->reclaim, t, __ATOMIC_RELAXED);
    /* readers see the mark move before they can see any overwritten byte */
    __atomic_thread_fence(__ATOMIC_RELEASE);
    count(&c->evicted, n);
}

int kv_tcache_put(kv_tcache_t *c, uint64_t key, const char *text, size_t len,
                  const uint32_t *ids, size_t n, uint64_t now_ms)
{
    uint64_t size = ent_size(len, n), pos, off, oldest;
    slot_t  *set, *s;
    ent_t    h;
    size_t   w;

    if (size > c->cap / 4 || len > UINT32_MAX || n > UINT32_MAX || !try_lock(c)) {
        count(&c->skipped, 1);
        return 1;
    }
    pos = c->head;
    off = pos % c->cap;
    if (off + size > c->cap) {
        pos += c->cap - off;
    }
    if (pos + size > c->cap) {
        reclaim_to(c, pos + size - c->cap, pos);
    }
    off = pos % c->cap;
    memset(&h, 0, sizeof(h));
    h.key = key;
    h.pos = pos;
    h.created_ms = now_ms;
    h.text_len = (uint32_t) len;
    h.nids = (uint32_t) n;
    store_words(ring(c) + off, &h, TC_ENT);
    store_words(ring(c) + off + TC_ENT, ids, n * 4);
    store_words(ring(c) + off + TC_ENT + ALIGN8((uint64_t) n * 4), text, len);
    __atomic_store_n(&c->head, pos + size, __ATOMIC_RELEASE);

    /* the slot: this key's, else a free or reclaimed one, else the oldest */
    set = slots(c) + (key & (c->nsets - 1)) * TC_WAYS;
    s = NULL;
    oldest = UINT64_MAX;
    for (w = 0; w < TC_WAYS; w++) {
        uint64_t p = __atomic_load_n(&set[w].pos, __ATOMIC_RELAXED);

        if (__atomic_load_n(&set[w].key, __ATOMIC_RELAXED) == key || p == 0
            || p - 1 < c->reclaim)
        {
            s = &set[w];
            break;
        }
        if (p < oldest) {
            oldest = p;
            s = &set[w];
        }
    }
    __atomic_store_n(&s->pos, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&s->key, key, __ATOMIC_RELAXED);
    __atomic_store_n(&s->pos, pos + 1, __ATOMIC_RELEASE);
    count(&c->stored, 1);
    kv_unlock(&c->lock);
    return 0;
}

void kv_tcache_stats(const kv_tcache_t *c, kv_tcache_stats_t *st)
{
    st->lookups = __atomic_load_n(&c->lookups, __ATOMIC_RELAXED);
    st->hits = __atomic_load_n(&c->hits, __ATOMIC_RELAXED);
    st->misses = __atomic_load_n(&c->misses, __ATOMIC_RELAXED);
    st->hit_tokens = __atomic_load_n(&c->hit_tokens, __ATOMIC_RELAXED);
    st->stored = __atomic_load_n(&c->stored, __ATOMIC_RELAXED);
    st->skipped = __atomic_load_n(&c->skipped, __ATOMIC_RELAXED);
    st->evicted = __atomic_load_n(&c->evicted, __ATOMIC_RELAXED);
    st->expired = __atomic_load_n(&c->expired, __ATOMIC_RELAXED);
    st->bytes = c->cap;
    st->ttl_ms = __atomic_load_n(&c->ttl_ms, __ATOMIC_RELAXED);
}
