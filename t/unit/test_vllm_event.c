/* vLLM / SGLang KV events (kv_vllm_event.h): the decoder on messages built
 * here by msgpack's rules (as msgspec's array_like structs encode them),
 * malformed input, and kv_zmq's sequence and tier logic fed directly
 * (kv_zmq_feed, no sockets). */
#include <stdlib.h>

#include "kv_hash.h"
#include "kv_index.h"
#include "kv_registry.h"
#include "kv_vllm_event.h"
#include "kv_zmq.h"
#include "kvtest.h"

/* --- a small msgpack writer ---------------------------------------------- */

typedef struct {
    uint8_t b[65536];
    size_t  n;
} mp_t;

static void put(mp_t *m, const void *p, size_t n)
{
    memcpy(m->b + m->n, p, n);
    m->n += n;
}

static void be(mp_t *m, uint64_t v, int bytes)
{
    int i;

    for (i = bytes - 1; i >= 0; i--) {
        m->b[m->n++] = (uint8_t) (v >> (8 * i));
    }
}

static void mp_arr(mp_t *m, uint32_t n)
{
    if (n < 16) {
        m->b[m->n++] = (uint8_t) (0x90 | n);
    } else {
        m->b[m->n++] = 0xdc;
        be(m, n, 2);
    }
}

static void mp_map(mp_t *m, uint32_t n)
{
    m->b[m->n++] = (uint8_t) (0x80 | n);        /* n < 16 here */
}

static void mp_nil(mp_t *m) { m->b[m->n++] = 0xc0; }

static void mp_uint(mp_t *m, uint64_t v)
{
    if (v < 128) {
        m->b[m->n++] = (uint8_t) v;
    } else {
        m->b[m->n++] = 0xcf;
        be(m, v, 8);
    }
}

static void mp_int(mp_t *m, int64_t v)
{
    if (v >= 0) {
        mp_uint(m, (uint64_t) v);
    } else {
        m->b[m->n++] = 0xd3;
        be(m, (uint64_t) v, 8);
    }
}

static void mp_str(mp_t *m, const char *s)
{
    size_t n = strlen(s);

    m->b[m->n++] = (uint8_t) (0xa0 | n);
    put(m, s, n);
}

static void mp_bin(mp_t *m, const void *p, size_t n)
{
    m->b[m->n++] = 0xc4;
    m->b[m->n++] = (uint8_t) n;
    put(m, p, n);
}

static void mp_f64(mp_t *m, double d)
{
    uint64_t v;

    memcpy(&v, &d, 8);
    m->b[m->n++] = 0xcb;
    be(m, v, 8);
}

/* ["BlockStored", [h...], parent, tokens, bs, lora_id, medium(, lora_name)]
 * with int hashes base, base+1, ...; tokens t0, t0+1, ... */
static void stored(mp_t *m, uint64_t base, size_t n, int64_t parent, uint32_t t0, uint32_t bs,
                   int64_t lora_id, const char *medium, const char *lora_name)
{
    size_t i;

    mp_arr(m, lora_name ? 8 : 7);
    mp_str(m, "BlockStored");
    mp_arr(m, (uint32_t) n);
    for (i = 0; i < n; i++) {
        mp_uint(m, base + i);
    }
    if (parent < 0) mp_nil(m); else mp_uint(m, (uint64_t) parent);
    mp_arr(m, (uint32_t) (n * bs));
    for (i = 0; i < n * bs; i++) {
        mp_uint(m, t0 + i);
    }
    mp_uint(m, bs);
    if (lora_id < 0) mp_nil(m); else mp_int(m, lora_id);
    if (medium) mp_str(m, medium); else mp_nil(m);
    if (lora_name) mp_str(m, lora_name);
}

/* ["BlockStored", [base..base+n-1], nil, [], bs, nil, medium, ...]: blocks
 * without token ids (moved to another tier), nf fields with the tag; the
 * caller writes those past medium. */
static void tokenless(mp_t *m, uint32_t nf, uint64_t base, size_t n, uint32_t bs,
                      const char *medium)
{
    size_t i;

    mp_arr(m, nf);
    mp_str(m, "BlockStored");
    mp_arr(m, (uint32_t) n);
    for (i = 0; i < n; i++) {
        mp_uint(m, base + i);
    }
    mp_nil(m);
    mp_arr(m, 0);
    mp_uint(m, bs);
    mp_nil(m);
    mp_str(m, medium);
}

static void removed(mp_t *m, uint64_t base, size_t n, const char *medium)
{
    size_t i;

    mp_arr(m, 3);
    mp_str(m, "BlockRemoved");
    mp_arr(m, (uint32_t) n);
    for (i = 0; i < n; i++) {
        mp_uint(m, base + i);
    }
    if (medium) mp_str(m, medium); else mp_nil(m);
}

/* [ts, [one event]] */
static void batch1(mp_t *m)
{
    m->n = 0;
    mp_arr(m, 2);
    mp_f64(m, 1795362575.25);
    mp_arr(m, 1);
}

static char err[256];

static int dec(kv_vllm_batch_t *b, const mp_t *m)
{
    err[0] = 0;
    return kv_vllm_decode(b, m->b, m->n, err, sizeof(err));
}

/* Every truncation of a good message m (of n_events) fails cleanly, and
 * every single-bit flip decodes or fails, never crashes. */
static void mutations_are_clean(kv_vllm_batch_t *b, mp_t *m, size_t n_events)
{
    size_t  i, n = m->n;
    uint8_t save;
    int     bit;

    CHECK(dec(b, m) == 0);
    CHECK_EQ_U64(b->n_events, n_events);
    for (i = 0; i < n; i++) {
        m->n = i;
        CHECK(dec(b, m) == -1);
        CHECK(b->n_events == 0);
    }
    m->n = n;
    for (i = 0; i < n; i++) {
        for (bit = 0; bit < 8; bit++) {
            save = m->b[i];
            m->b[i] ^= (uint8_t) (1 << bit);
            (void) dec(b, m);
            m->b[i] = save;
        }
    }
}

/* --- decoder ---------------------------------------------------------------- */

/* A message that must fail whole, with needle in its reason. */
#define BAD(build, needle)                                              \
    do {                                                                \
        build;                                                          \
        CHECK(dec(&b, &m) == -1);                                       \
        CHECK(b.n_events == 0);                                         \
        if (strstr(err, needle) == NULL) {                              \
            fprintf(stderr, "  reason \"%s\" lacks \"%s\"\n", err, needle); \
            kvt_test_failed = 1;                                        \
        }                                                               \
    } while (0)


TEST(decodes_stored_removed_cleared)
{
    kv_vllm_batch_t b;
    mp_t            m;
    uint8_t         h[32];

    kv_vllm_batch_init(&b);
    m.n = 0;
    mp_arr(&m, 3);
    mp_f64(&m, 1795362575.25);
    mp_arr(&m, 4);
    stored(&m, 100, 2, 7, 1, 4, -1, "GPU", NULL);
    removed(&m, 100, 1, "CPU");
    mp_arr(&m, 1);
    mp_str(&m, "AllBlocksCleared");
    mp_arr(&m, 2);                      /* a tag from a newer vLLM: skipped */
    mp_str(&m, "BlockMoved");
    mp_nil(&m);
    mp_uint(&m, 3);                     /* data_parallel_rank */
    CHECK(dec(&b, &m) == 0);
    CHECK(b.ts == 1795362575.25);
    CHECK(b.has_dp_rank && b.dp_rank == 3);
    CHECK_EQ_U64(b.n_events, 3);
    CHECK_EQ_U64(b.unknown, 1);
    CHECK_EQ_U64(b.events[0].kind, KV_VLLM_STORED);
    CHECK_EQ_U64(b.events[0].n_hashes, 2);
    CHECK_EQ_U64(b.events[0].hashes[1], 101);
    CHECK(b.events[0].has_parent && b.events[0].parent == 7);
    CHECK_EQ_U64(b.events[0].n_tokens, 8);
    CHECK_EQ_U64(b.events[0].tokens[7], 8);
    CHECK_EQ_U64(b.events[0].block_size, 4);
    CHECK(!b.events[0].has_lora_id && b.events[0].lora_name == NULL);
    CHECK_EQ_U64(b.events[0].tier, KV_TIER_DEVICE);
    CHECK_EQ_U64(b.events[1].kind, KV_VLLM_REMOVED);
    CHECK_EQ_U64(b.events[1].tier, KV_TIER_HOST);
    CHECK_EQ_U64(b.events[1].hashes[0], 100);
    CHECK_EQ_U64(b.events[2].kind, KV_VLLM_CLEARED);

    /* bytes and negative int hashes; lora; nil parent; no dp rank */
    batch1(&m);
    memset(h, 0xab, sizeof(h));
    mp_arr(&m, 8);
    mp_str(&m, "BlockStored");
    mp_arr(&m, 2);
    mp_bin(&m, h, 32);
    mp_int(&m, -5);
    mp_nil(&m);
    mp_arr(&m, 2);
    mp_uint(&m, 9);
    mp_uint(&m, 10);
    mp_uint(&m, 1);
    mp_int(&m, 3);
    mp_nil(&m);
    mp_str(&m, "sql");
    CHECK(dec(&b, &m) == 0);
    CHECK(!b.has_dp_rank);
    CHECK_EQ_U64(b.events[0].n_hashes, 2);
    CHECK(b.events[0].hashes[0] != 0);
    CHECK_EQ_U64(b.events[0].hashes[1], (uint64_t) -5);
    CHECK(!b.events[0].has_parent);
    CHECK(b.events[0].has_lora_id && b.events[0].lora_id == 3);
    CHECK(b.events[0].lora_name_len == 3 && memcmp(b.events[0].lora_name, "sql", 3) == 0);
    CHECK(kv_vllm_lora_seed(&b.events[0]) == kv_hash_seed("sql", 3));
    CHECK(kv_vllm_lora_seed(&b.events[0]) != KV_HASH_SEED);

    /* the same bytes give the same hash; other bytes another */
    {
        uint64_t first = b.events[0].hashes[0];

        CHECK(dec(&b, &m) == 0);
        CHECK_EQ_U64(b.events[0].hashes[0], first);
        m.b[m.n - 40] ^= 1;         /* inside the 32-byte digest */
        CHECK(dec(&b, &m) == 0);
        CHECK(b.events[0].hashes[0] != first);
    }

    /* lora_id only: its own seed, not the base model's */
    batch1(&m);
    stored(&m, 1, 1, -1, 0, 2, 7, NULL, NULL);
    CHECK(dec(&b, &m) == 0);
    CHECK(kv_vllm_lora_seed(&b.events[0]) != KV_HASH_SEED);
    /* offloaded blocks come without token ids */
    batch1(&m);
    tokenless(&m, 7, 5, 1, 16, "CPU");
    CHECK(dec(&b, &m) == 0);
    CHECK_EQ_U64(b.events[0].n_tokens, 0);
    CHECK(b.events[0].tokens == NULL);
    kv_vllm_batch_free(&b);
}

TEST(malformed_batches_fail_whole)
{
    kv_vllm_batch_t b;
    mp_t            m;

    kv_vllm_batch_init(&b);


    BAD((m.n = 0, mp_uint(&m, 3)), "not an array");
    BAD((m.n = 0, mp_arr(&m, 1), mp_f64(&m, 1)), "not an array");
    BAD((m.n = 0, mp_arr(&m, 2), mp_str(&m, "x"), mp_arr(&m, 0)), "ts");
    BAD((m.n = 0, mp_arr(&m, 2), mp_f64(&m, 1), mp_uint(&m, 1)), "events");
    BAD((m.n = 0, mp_arr(&m, 3), mp_f64(&m, 1), mp_arr(&m, 0), mp_str(&m, "x")), "rank");
    BAD((batch1(&m), mp_uint(&m, 1)), "tagged array");
    BAD((batch1(&m), mp_arr(&m, 0)), "tagged array");
    BAD((batch1(&m), mp_arr(&m, 1), mp_uint(&m, 1)), "no tag");
    BAD((batch1(&m), mp_arr(&m, 3), mp_str(&m, "BlockStored"), mp_arr(&m, 0), mp_nil(&m)),
        "fields");
    BAD((batch1(&m), mp_arr(&m, 1), mp_str(&m, "BlockRemoved")), "block_hashes");
    BAD((batch1(&m), mp_arr(&m, 3), mp_str(&m, "BlockRemoved"), mp_uint(&m, 1), mp_nil(&m)),
        "block_hashes");
    BAD((batch1(&m), mp_arr(&m, 3), mp_str(&m, "BlockRemoved"), mp_arr(&m, 1), mp_f64(&m, 1),
         mp_nil(&m)), "block_hashes");
    BAD((batch1(&m), mp_arr(&m, 3), mp_str(&m, "BlockRemoved"), mp_arr(&m, 1), mp_bin(&m, "", 0),
         mp_nil(&m)), "block_hashes");
    BAD((batch1(&m), mp_arr(&m, 3), mp_str(&m, "BlockRemoved"), mp_arr(&m, 0), mp_uint(&m, 1)),
        "medium");
    /* stored: block_size 0, token count, token too big / negative, parent, lora, medium */
    BAD((batch1(&m), stored(&m, 1, 1, -1, 0, 4, -1, NULL, NULL), m.b[m.n - 3] = 0),
        "block_size");
    BAD((batch1(&m), mp_arr(&m, 7), mp_str(&m, "BlockStored"), mp_arr(&m, 1), mp_uint(&m, 1),
         mp_nil(&m), mp_arr(&m, 3), mp_uint(&m, 1), mp_uint(&m, 2), mp_uint(&m, 3),
         mp_uint(&m, 4), mp_nil(&m), mp_nil(&m)), "token ids");
    BAD((batch1(&m), mp_arr(&m, 7), mp_str(&m, "BlockStored"), mp_arr(&m, 1), mp_uint(&m, 1),
         mp_nil(&m), mp_arr(&m, 1), mp_uint(&m, 1ULL << 33), mp_uint(&m, 1), mp_nil(&m),
         mp_nil(&m)), "u32");
    BAD((batch1(&m), mp_arr(&m, 7), mp_str(&m, "BlockStored"), mp_arr(&m, 1), mp_uint(&m, 1),
         mp_nil(&m), mp_arr(&m, 1), mp_int(&m, -1), mp_uint(&m, 1), mp_nil(&m),
         mp_nil(&m)), "u32");
    BAD((batch1(&m), mp_arr(&m, 7), mp_str(&m, "BlockStored"), mp_arr(&m, 1), mp_uint(&m, 1),
         mp_str(&m, ""), mp_arr(&m, 0), mp_uint(&m, 1), mp_nil(&m), mp_nil(&m)), "parent");
    BAD((batch1(&m), mp_arr(&m, 7), mp_str(&m, "BlockStored"), mp_arr(&m, 1), mp_uint(&m, 1),
         mp_nil(&m), mp_arr(&m, 0), mp_uint(&m, 1), mp_str(&m, "x"), mp_nil(&m)), "lora_id");
    BAD((batch1(&m), mp_arr(&m, 7), mp_str(&m, "BlockStored"), mp_arr(&m, 1), mp_uint(&m, 1),
         mp_nil(&m), mp_arr(&m, 0), mp_uint(&m, 1), mp_nil(&m), mp_uint(&m, 1)), "medium");
    BAD((batch1(&m), mp_arr(&m, 8), mp_str(&m, "BlockStored"), mp_arr(&m, 1), mp_uint(&m, 1),
         mp_nil(&m), mp_arr(&m, 0), mp_uint(&m, 1), mp_nil(&m), mp_nil(&m), mp_uint(&m, 2)),
        "lora_name");
    BAD((batch1(&m), stored(&m, 1, 1, -1, 0, 2, -1, NULL, NULL), m.b[m.n++] = 0xc0),
        "trailing");
    BAD((m.n = 0, m.b[m.n++] = 0xc1), "msgpack");

    /* every truncation of a good message fails cleanly */
    m.n = 0;
    mp_arr(&m, 3);
    mp_f64(&m, 2.5);
    mp_arr(&m, 2);
    stored(&m, 10, 3, 4, 100, 4, 1, "GPU", "x");
    removed(&m, 10, 2, NULL);
    mp_uint(&m, 0);
    mutations_are_clean(&b, &m, 2);
    kv_vllm_batch_free(&b);
}

/* vLLM's newer map form: {"type": "BlockStored", "block_hashes": ...} */
static void map_stored(mp_t *m, uint64_t base, size_t n, uint32_t t0, uint32_t bs,
                       int group, const char *kind)
{
    size_t i;

    mp_map(m, group >= 0 ? 11 : 9);
    mp_str(m, "type");
    mp_str(m, "BlockStored");
    mp_str(m, "block_hashes");
    mp_arr(m, (uint32_t) n);
    for (i = 0; i < n; i++) {
        mp_uint(m, base + i);
    }
    mp_str(m, "parent_block_hash");
    mp_nil(m);
    mp_str(m, "token_ids");
    mp_arr(m, (uint32_t) (n * bs));
    for (i = 0; i < n * bs; i++) {
        mp_uint(m, t0 + i);
    }
    mp_str(m, "block_size");
    mp_uint(m, bs);
    mp_str(m, "lora_id");
    mp_nil(m);
    mp_str(m, "medium");
    mp_str(m, "GPU");
    mp_str(m, "lora_name");
    mp_nil(m);
    mp_str(m, "extra_keys");                /* read by nobody here: skipped */
    mp_arr(m, 1);
    mp_nil(m);
    if (group >= 0) {
        mp_str(m, "group_idx");
        mp_uint(m, (uint64_t) group);
        mp_str(m, "kv_cache_spec_kind");
        mp_str(m, kind);
    }
}

static void map_removed(mp_t *m, uint64_t base, size_t n, int group)
{
    size_t i;

    mp_map(m, group >= 0 ? 4 : 3);
    mp_str(m, "type");
    mp_str(m, "BlockRemoved");
    mp_str(m, "block_hashes");
    mp_arr(m, (uint32_t) n);
    for (i = 0; i < n; i++) {
        mp_uint(m, base + i);
    }
    mp_str(m, "medium");
    mp_nil(m);
    if (group >= 0) {
        mp_str(m, "group_idx");
        mp_uint(m, (uint64_t) group);
    }
}

/* {"ts": .., "events": [n events follow]} */
static void map_batch(mp_t *m, uint32_t n)
{
    m->n = 0;
    mp_map(m, 2);
    mp_str(m, "ts");
    mp_f64(m, 1795362575.5);
    mp_str(m, "events");
    mp_arr(m, n);
}

TEST(decodes_short_arrays_and_maps)
{
    kv_vllm_batch_t b;
    mp_t            m;
    size_t          i;

    kv_vllm_batch_init(&b);

    /* SGLang and vLLM 0.9: BlockStored stops at lora_id, BlockRemoved at
     * block_hashes; with lora_id left at its default it stops at block_size */
    batch1(&m);
    mp_arr(&m, 6);
    mp_str(&m, "BlockStored");
    mp_arr(&m, 2);
    mp_uint(&m, 1);
    mp_uint(&m, 2);
    mp_nil(&m);
    mp_arr(&m, 8);
    for (i = 0; i < 8; i++) {
        mp_uint(&m, i);
    }
    mp_uint(&m, 4);
    mp_nil(&m);
    CHECK(dec(&b, &m) == 0);
    CHECK_EQ_U64(b.n_events, 1);
    CHECK_EQ_U64(b.events[0].n_hashes, 2);
    CHECK_EQ_U64(b.events[0].n_tokens, 8);
    CHECK_EQ_U64(b.events[0].tier, KV_TIER_DEVICE);
    CHECK(!b.events[0].has_group && b.events[0].spec_kind == NULL);
    m.b[11] = 0x95;                     /* the same without lora_id */
    m.n--;
    CHECK(dec(&b, &m) == 0);
    CHECK_EQ_U64(b.events[0].block_size, 4);
    batch1(&m);
    mp_arr(&m, 2);
    mp_str(&m, "BlockRemoved");
    mp_arr(&m, 1);
    mp_uint(&m, 2);
    CHECK(dec(&b, &m) == 0);
    CHECK_EQ_U64(b.events[0].kind, KV_VLLM_REMOVED);

    /* SGLang with EAGLE: token ids as bigrams [id, next id], the first kept */
    batch1(&m);
    mp_arr(&m, 6);
    mp_str(&m, "BlockStored");
    mp_arr(&m, 1);
    mp_uint(&m, 1);
    mp_nil(&m);
    mp_arr(&m, 4);
    for (i = 0; i < 4; i++) {
        mp_arr(&m, 2);
        mp_uint(&m, 10 + i);
        mp_uint(&m, 11 + i);
    }
    mp_uint(&m, 4);
    mp_nil(&m);
    CHECK(dec(&b, &m) == 0);
    CHECK_EQ_U64(b.events[0].n_tokens, 4);
    CHECK_EQ_U64(b.events[0].tokens[0], 10);
    CHECK_EQ_U64(b.events[0].tokens[3], 13);
    m.b[m.n - 5] = 0x93;                /* a triple is no token */
    CHECK(dec(&b, &m) == -1);
    CHECK(strstr(err, "pair") != NULL);

    /* a hybrid model's array form: extra_keys, group_idx, the group's kind */
    batch1(&m);
    tokenless(&m, 11, 1, 1, 16, "GPU");
    mp_nil(&m);
    mp_nil(&m);
    mp_uint(&m, 3);
    mp_str(&m, "full_attention");
    CHECK(dec(&b, &m) == 0);
    CHECK(b.events[0].has_group && b.events[0].group_idx == 3);
    CHECK(b.events[0].spec_kind_len == 14
          && memcmp(b.events[0].spec_kind, "full_attention", 14) == 0);

    /* the map form: batch and events by name, unknown keys and tags skipped */
    m.n = 0;
    mp_map(&m, 4);
    mp_str(&m, "events");               /* before ts: any order */
    mp_arr(&m, 4);
    map_stored(&m, 10, 2, 100, 4, 1, "sliding_window");
    map_removed(&m, 10, 1, 0);
    mp_map(&m, 1);
    mp_str(&m, "type");
    mp_str(&m, "AllBlocksCleared");
    mp_map(&m, 3);
    mp_str(&m, "type");
    mp_str(&m, "BlockMoved");
    mp_str(&m, "block_hashes");
    mp_arr(&m, 1);
    mp_uint(&m, 77);
    mp_str(&m, "block_size");           /* a kind of its own: not read, not checked */
    mp_str(&m, "large");
    mp_str(&m, "ts");
    mp_f64(&m, 1795362575.5);
    mp_str(&m, "data_parallel_rank");
    mp_uint(&m, 2);
    mp_str(&m, "locality");
    mp_str(&m, "node");
    CHECK(dec(&b, &m) == 0);
    CHECK(b.ts == 1795362575.5);
    CHECK(b.has_dp_rank && b.dp_rank == 2);
    CHECK_EQ_U64(b.n_events, 3);
    CHECK_EQ_U64(b.unknown, 1);
    CHECK_EQ_U64(b.events[0].kind, KV_VLLM_STORED);
    CHECK_EQ_U64(b.events[0].n_hashes, 2);
    CHECK_EQ_U64(b.events[0].hashes[1], 11);
    CHECK_EQ_U64(b.events[0].tokens[7], 107);
    CHECK(b.events[0].has_group && b.events[0].group_idx == 1);
    CHECK(b.events[0].spec_kind_len == 14);
    CHECK_EQ_U64(b.events[1].kind, KV_VLLM_REMOVED);
    CHECK_EQ_U64(b.events[1].hashes[0], 10);
    CHECK(b.events[1].has_group && b.events[1].group_idx == 0);
    CHECK_EQ_U64(b.events[2].kind, KV_VLLM_CLEARED);
    CHECK_EQ_U64(b.n_h, 3);             /* the unknown event's hash dropped */

    /* bad map forms fail the whole batch with a reason */
    BAD((map_batch(&m, 1), mp_map(&m, 1), mp_str(&m, "block_hashes"), mp_arr(&m, 0)), "no tag");
    BAD((map_batch(&m, 1), mp_map(&m, 1), mp_uint(&m, 1), mp_nil(&m)), "key");
    BAD((map_batch(&m, 1), mp_map(&m, 1), mp_str(&m, "type"), mp_uint(&m, 1)), "type");
    BAD((map_batch(&m, 1), mp_map(&m, 2), mp_str(&m, "type"), mp_str(&m, "BlockStored"),
         mp_str(&m, "block_hashes"), mp_arr(&m, 0)), "lacks block_size");
    BAD((map_batch(&m, 1), mp_map(&m, 1), mp_str(&m, "type"), mp_str(&m, "BlockRemoved")),
        "lacks block_hashes");
    BAD((map_batch(&m, 1), mp_map(&m, 3), mp_str(&m, "type"), mp_str(&m, "BlockRemoved"),
         mp_str(&m, "block_hashes"), mp_arr(&m, 0), mp_str(&m, "group_idx"), mp_int(&m, -1)),
        "group_idx");
    BAD((map_batch(&m, 1), mp_map(&m, 3), mp_str(&m, "type"), mp_str(&m, "BlockRemoved"),
         mp_str(&m, "block_hashes"), mp_arr(&m, 0), mp_str(&m, "kv_cache_spec_kind"),
         mp_uint(&m, 5)), "kv_cache_spec_kind");
    BAD((m.n = 0, mp_map(&m, 1), mp_str(&m, "ts"), mp_f64(&m, 1)), "no events");
    BAD((m.n = 0, mp_map(&m, 2), mp_str(&m, "events"), mp_arr(&m, 0), mp_str(&m, "events"),
         mp_arr(&m, 0)), "two events");
    BAD((m.n = 0, mp_map(&m, 1), mp_str(&m, "ts"), mp_str(&m, "x")), "ts");

    /* every truncation and single-bit flip of a good map message: clean */
    map_batch(&m, 2);
    map_stored(&m, 10, 3, 4, 4, 0, "full_attention");
    map_removed(&m, 10, 2, 0);
    mutations_are_clean(&b, &m, 2);
    kv_vllm_batch_free(&b);
}

TEST(seq_frames_and_tiers)
{
    uint8_t  f[8] = { 0, 0, 0, 0, 0, 0, 1, 2 };
    uint64_t s = 0;

    CHECK(kv_vllm_seq(f, 8, &s) == 0 && s == 258);
    memset(f, 0xff, 8);
    CHECK(kv_vllm_seq(f, 8, &s) == 0 && s == UINT64_MAX);
    CHECK(kv_vllm_seq(f, 7, &s) == -1);
    CHECK(kv_vllm_seq(f, 9, &s) == -1);
    CHECK_EQ_U64(kv_vllm_tier(NULL, 0), KV_TIER_DEVICE);
    CHECK_EQ_U64(kv_vllm_tier("GPU", 3), KV_TIER_DEVICE);
    CHECK_EQ_U64(kv_vllm_tier("cuda", 4), KV_TIER_DEVICE);
    CHECK_EQ_U64(kv_vllm_tier("CPU", 3), KV_TIER_HOST);
    CHECK_EQ_U64(kv_vllm_tier("cpu", 3), KV_TIER_HOST);
    CHECK_EQ_U64(kv_vllm_tier("DISK", 4), KV_TIER_DISK);
    CHECK_EQ_U64(kv_vllm_tier("lmcache-remote", 14), KV_TIER_DISK);
}

/* --- kv_zmq fed directly -------------------------------------------------------- */

typedef struct {
    void           *ixmem, *regmem;
    kv_index_t     *ix;
    kv_registry_t  *reg;
    kv_zmq_t       *z;
} rig_t;

/* A zone of block_size whose one publisher's upstream has pub_bs (0: none). */
static void rig_open_pub(rig_t *r, uint32_t block_size, uint32_t pub_bs)
{
    kv_index_config_t   ic = { 0 };
    kv_zmq_pub_config_t pc = { "tcp://127.0.0.1:1", NULL, "127.0.0.1:8000", NULL, pub_bs };
    kv_zmq_config_t     zc = { 0 };
    size_t              n;
    uint32_t            gen;

    ic.max_workers = 8;
    n = kv_index_min_size(&ic) + (4u << 20);
    r->ixmem = calloc(1, n);
    r->ix = kv_index_create(r->ixmem, n, &ic, err, sizeof(err));
    n = kv_registry_min_size(8);
    r->regmem = calloc(1, n);
    r->reg = kv_registry_create(r->regmem, n, 8, err, sizeof(err));
    kv_registry_lease_acquire(r->reg, 1, &gen);
    zc.pubs = &pc;
    zc.n_pubs = 1;
    zc.block_size = block_size;
    r->z = kv_zmq_create(&zc, r->ix, r->reg, err, sizeof(err));
}

static void rig_open(rig_t *r, uint32_t block_size)
{
    rig_open_pub(r, block_size, 0);
}

static void rig_close(rig_t *r)
{
    kv_zmq_destroy(r->z);
    free(r->ixmem);
    free(r->regmem);
}

/* Blocks the index matches for tokens t0.. (n full blocks of bs), seed. */
static uint32_t matched(rig_t *r, uint32_t t0, size_t n, uint32_t bs, uint64_t seed)
{
    uint32_t     tok[4096];
    uint64_t     seq[256];
    kv_overlap_t out[8];
    size_t       i, k;

    for (i = 0; i < n * bs; i++) {
        tok[i] = t0 + (uint32_t) i;
    }
    k = kv_hash_blocks(tok, n * bs, bs, seed, NULL, seq);
    return kv_index_match(r->ix, seq, k, out, 8) ? out[0].blocks : 0;
}

static void feed(rig_t *r, uint64_t seq, const mp_t *m)
{
    kv_zmq_feed(r->z, 0, seq, m->b, m->n, 1000);
}

TEST(feed_sequence_gap_restart_and_malformed)
{
    rig_t              r;
    mp_t               m;
    kv_zmq_pub_stats_t st;

    rig_open(&r, 4);
    batch1(&m);
    stored(&m, 100, 3, -1, 0, 4, -1, "GPU", NULL);
    feed(&r, 0, &m);
    CHECK_EQ_U64(matched(&r, 0, 3, 4, KV_HASH_SEED), 3);
    /* a child by its parent's engine hash */
    batch1(&m);
    stored(&m, 200, 1, 102, 12, 4, -1, "GPU", NULL);
    feed(&r, 1, &m);
    CHECK_EQ_U64(matched(&r, 0, 4, 4, KV_HASH_SEED), 4);
    /* removal by engine hash */
    batch1(&m);
    removed(&m, 102, 1, NULL);
    feed(&r, 2, &m);
    CHECK_EQ_U64(matched(&r, 0, 4, 4, KV_HASH_SEED), 2);
    /* a malformed payload is counted and keeps its place in the sequence */
    m.n = 1;
    m.b[0] = 0xc1;
    feed(&r, 3, &m);
    kv_zmq_pub_stats(r.z, 0, &st);
    CHECK_EQ_U64(st.malformed, 1);
    CHECK_EQ_U64(st.gaps, 0);
    /* a gap with no replay socket: the worker is cleared, then goes on */
    batch1(&m);
    stored(&m, 300, 1, -1, 50, 4, -1, NULL, NULL);
    feed(&r, 9, &m);
    kv_zmq_pub_stats(r.z, 0, &st);
    CHECK_EQ_U64(st.gaps, 1);
    CHECK_EQ_U64(matched(&r, 0, 2, 4, KV_HASH_SEED), 0);
    CHECK_EQ_U64(matched(&r, 50, 1, 4, KV_HASH_SEED), 1);
    /* back to 0: an engine restart clears it */
    batch1(&m);
    stored(&m, 400, 1, -1, 70, 4, -1, NULL, NULL);
    feed(&r, 0, &m);
    kv_zmq_pub_stats(r.z, 0, &st);
    CHECK_EQ_U64(st.restarts, 1);
    CHECK_EQ_U64(st.last_seq, 0);
    CHECK_EQ_U64(matched(&r, 50, 1, 4, KV_HASH_SEED), 0);
    CHECK_EQ_U64(matched(&r, 70, 1, 4, KV_HASH_SEED), 1);
    /* AllBlocksCleared */
    batch1(&m);
    mp_arr(&m, 1);
    mp_str(&m, "AllBlocksCleared");
    feed(&r, 1, &m);
    CHECK_EQ_U64(matched(&r, 70, 1, 4, KV_HASH_SEED), 0);
    rig_close(&r);
}

TEST(feed_tiers_lora_and_block_size)
{
    rig_t              r;
    mp_t               m;
    kv_zmq_pub_stats_t st;

    rig_open(&r, 4);
    /* on the GPU, then offloaded to CPU (no token ids): still one block */
    batch1(&m);
    stored(&m, 100, 2, -1, 0, 4, -1, "GPU", NULL);
    feed(&r, 0, &m);
    batch1(&m);
    tokenless(&m, 7, 100, 2, 4, "CPU");
    feed(&r, 1, &m);
    /* the GPU evicts it: the CPU copy still counts */
    batch1(&m);
    removed(&m, 100, 2, "GPU");
    feed(&r, 2, &m);
    CHECK_EQ_U64(matched(&r, 0, 2, 4, KV_HASH_SEED), 2);
    /* then the CPU drops block 101 too */
    batch1(&m);
    removed(&m, 101, 1, "CPU");
    feed(&r, 3, &m);
    CHECK_EQ_U64(matched(&r, 0, 2, 4, KV_HASH_SEED), 1);
    /* an offload of a block never indexed cannot be credited */
    batch1(&m);
    tokenless(&m, 7, 999, 1, 4, "DISK");
    feed(&r, 4, &m);
    kv_zmq_pub_stats(r.z, 0, &st);
    CHECK_EQ_U64(st.unresolved, 1);

    /* LoRA blocks match only the adapter's seed */
    batch1(&m);
    stored(&m, 500, 2, -1, 40, 4, 1, "GPU", "sql");
    feed(&r, 5, &m);
    CHECK_EQ_U64(matched(&r, 40, 2, 4, KV_HASH_SEED), 0);
    CHECK_EQ_U64(matched(&r, 40, 2, 4, kv_hash_seed("sql", 3)), 2);

    /* an engine with another block size: refused, flagged */
    batch1(&m);
    stored(&m, 600, 1, -1, 80, 8, -1, "GPU", NULL);
    feed(&r, 6, &m);
    kv_zmq_pub_stats(r.z, 0, &st);
    CHECK(st.block_size_mismatch);
    CHECK_EQ_U64(st.engine_block_size, 8);
    CHECK_EQ_U64(matched(&r, 80, 1, 8, KV_HASH_SEED), 0);
    rig_close(&r);
}

/* Upstreams of other block sizes may share a zone: a publisher is checked
 * against its own upstream's, not the zone's first. */
TEST(feed_checks_the_publishers_own_block_size)
{
    rig_t              r;
    mp_t               m;
    kv_zmq_pub_stats_t st;

    rig_open_pub(&r, 4, 8);
    batch1(&m);
    stored(&m, 100, 2, -1, 0, 8, -1, "GPU", NULL);
    feed(&r, 0, &m);
    kv_zmq_pub_stats(r.z, 0, &st);
    CHECK(!st.block_size_mismatch);
    CHECK_EQ_U64(matched(&r, 0, 2, 8, KV_HASH_SEED), 2);
    batch1(&m);
    stored(&m, 200, 1, -1, 50, 4, -1, "GPU", NULL);
    feed(&r, 1, &m);
    kv_zmq_pub_stats(r.z, 0, &st);
    CHECK(st.block_size_mismatch);
    CHECK_EQ_U64(matched(&r, 50, 1, 4, KV_HASH_SEED), 0);
    rig_close(&r);
}

/* A hybrid model: the sliding-window group's evictions do not remove the
 * blocks its full-attention group still holds. */
/* what on_drop was told */
static uint64_t drop_seq[8];
static size_t   drop_n, drop_calls;

static void on_drop(void *arg, uint64_t worker_id, const uint64_t *seq, size_t n)
{
    (void) arg;
    (void) worker_id;
    drop_calls++;
    drop_n = n;
    for (size_t i = 0; i < n && i < 8; i++) {
        drop_seq[i] = seq[i];
    }
}

/* The engine's removals and clears reach on_drop as the router's sequence
 * hashes (what the pending index holds), before the index forgets them. */
TEST(feed_drops_reach_on_drop)
{
    kv_index_config_t   ic = { 0 };
    kv_zmq_pub_config_t pc = { "tcp://127.0.0.1:1", NULL, "127.0.0.1:8000", NULL, 0 };
    kv_zmq_config_t     zc = { 0 };
    rig_t               r;
    mp_t                m;
    uint32_t            tok[12], gen;
    uint64_t            seq[3];
    size_t              n;

    ic.max_workers = 8;
    n = kv_index_min_size(&ic) + (4u << 20);
    r.ixmem = calloc(1, n);
    r.ix = kv_index_create(r.ixmem, n, &ic, err, sizeof(err));
    n = kv_registry_min_size(8);
    r.regmem = calloc(1, n);
    r.reg = kv_registry_create(r.regmem, n, 8, err, sizeof(err));
    kv_registry_lease_acquire(r.reg, 1, &gen);
    zc.pubs = &pc;
    zc.n_pubs = 1;
    zc.block_size = 4;
    zc.on_drop = on_drop;
    r.z = kv_zmq_create(&zc, r.ix, r.reg, err, sizeof(err));
    for (n = 0; n < 12; n++) {
        tok[n] = (uint32_t) n;
    }
    kv_hash_blocks(tok, 12, 4, KV_HASH_SEED, NULL, seq);
    batch1(&m);
    stored(&m, 100, 3, -1, 0, 4, -1, "GPU", NULL);
    feed(&r, 0, &m);
    batch1(&m);
    removed(&m, 101, 2, NULL);
    feed(&r, 1, &m);
    CHECK_EQ_U64(drop_calls, 1);
    CHECK_EQ_U64(drop_n, 2);
    CHECK(drop_seq[0] == seq[1] && drop_seq[1] == seq[2]);
    batch1(&m);
    mp_arr(&m, 1);
    mp_str(&m, "AllBlocksCleared");
    feed(&r, 2, &m);
    CHECK_EQ_U64(drop_calls, 2);
    CHECK_EQ_U64(drop_n, 0);
    rig_close(&r);
}

/* ["BlockStored", hashes, parent, tokens, 4, lora_id, "GPU", lora_name,
 * extra_keys]: the first block's tuple holds first_keys (strs; "#x" a
 * multimodal (hash, offset) pair, "%x" a prompt-embeds digest, bytes), the
 * other blocks nil. */
static void salted(mp_t *m, uint64_t base, size_t n, int64_t parent, uint32_t t0,
                   const char *lora_name, const char *const *first_keys, size_t nk)
{
    size_t i, k;

    mp_arr(m, 9);
    mp_str(m, "BlockStored");
    mp_arr(m, (uint32_t) n);
    for (i = 0; i < n; i++) {
        mp_uint(m, base + i);
    }
    if (parent < 0) mp_nil(m); else mp_uint(m, (uint64_t) parent);
    mp_arr(m, (uint32_t) (n * 4));
    for (i = 0; i < n * 4; i++) {
        mp_uint(m, t0 + i);
    }
    mp_uint(m, 4);
    if (lora_name) mp_uint(m, 1); else mp_nil(m);
    mp_str(m, "GPU");
    if (lora_name) mp_str(m, lora_name); else mp_nil(m);
    mp_arr(m, (uint32_t) n);
    for (i = 0; i < n; i++) {
        if (i > 0 || nk == 0) {
            mp_nil(m);
            continue;
        }
        mp_arr(m, (uint32_t) nk);
        for (k = 0; k < nk; k++) {
            if (first_keys[k][0] == '#') {
                mp_arr(m, 2);
                mp_str(m, first_keys[k] + 1);
                mp_uint(m, 0);
            } else if (first_keys[k][0] == '%') {
                mp_bin(m, first_keys[k] + 1, strlen(first_keys[k] + 1));
            } else {
                mp_str(m, first_keys[k]);
            }
        }
    }
}

/* A cache_salt lives in the first block's extra keys only; every block of
 * the salted prompt, and the children of its blocks, match the salt's seed,
 * as the router hashes a salted request. */
TEST(feed_salted_prompts)
{
    static const char *const salt_only[] = { "tenant-a" };
    static const char *const lora_and_salt[] = { "sql", "#mmhash", "tenant-b", "%digest" };
    static const char *const lora_only[] = { "sql" };
    uint64_t a = kv_hash_seed("tenant-a", 8), b = kv_hash_seed("tenant-b", 8);
    rig_t    r;
    mp_t     m;

    rig_open(&r, 4);
    batch1(&m);
    salted(&m, 100, 2, -1, 0, NULL, salt_only, 1);
    feed(&r, 0, &m);
    CHECK_EQ_U64(matched(&r, 0, 2, 4, a), 2);
    CHECK_EQ_U64(matched(&r, 0, 2, 4, KV_HASH_SEED), 0);
    /* a later block of the same prompt: no salt of its own, its parent's */
    batch1(&m);
    salted(&m, 102, 1, 101, 8, NULL, NULL, 0);
    feed(&r, 1, &m);
    CHECK_EQ_U64(matched(&r, 0, 3, 4, a), 3);
    /* LoRA name first, a multimodal pair, the salt, a digest: the salt */
    batch1(&m);
    salted(&m, 200, 1, -1, 40, "sql", lora_and_salt, 4);
    feed(&r, 2, &m);
    CHECK_EQ_U64(matched(&r, 40, 1, 4, b), 1);
    /* the LoRA name alone is no salt */
    batch1(&m);
    salted(&m, 300, 1, -1, 60, "sql", lora_only, 1);
    feed(&r, 3, &m);
    CHECK_EQ_U64(matched(&r, 60, 1, 4, kv_hash_seed("sql", 3)), 1);
    /* removed, the salted parent no longer seeds a child */
    batch1(&m);
    removed(&m, 102, 1, NULL);
    feed(&r, 4, &m);
    batch1(&m);
    removed(&m, 101, 1, NULL);
    feed(&r, 5, &m);
    batch1(&m);
    salted(&m, 101, 1, 100, 4, NULL, NULL, 0);     /* stored again, by its parent */
    feed(&r, 6, &m);
    CHECK_EQ_U64(matched(&r, 0, 2, 4, a), 2);
    rig_close(&r);
}

TEST(feed_hybrid_groups)
{
    rig_t              r;
    mp_t               m;
    kv_zmq_pub_stats_t st;

    rig_open(&r, 4);
    map_batch(&m, 2);
    map_stored(&m, 100, 3, 0, 4, 0, "sliding_window");
    map_stored(&m, 100, 3, 0, 4, 1, "full_attention");
    feed(&r, 0, &m);
    CHECK_EQ_U64(matched(&r, 0, 3, 4, KV_HASH_SEED), 3);
    map_batch(&m, 1);                   /* the window moved on */
    map_removed(&m, 100, 2, 0);
    feed(&r, 1, &m);
    CHECK_EQ_U64(matched(&r, 0, 3, 4, KV_HASH_SEED), 3);
    kv_zmq_pub_stats(r.z, 0, &st);
    CHECK_EQ_U64(st.other_groups, 2);
    map_batch(&m, 1);                   /* the full-attention group evicts */
    map_removed(&m, 102, 1, 1);
    feed(&r, 2, &m);
    CHECK_EQ_U64(matched(&r, 0, 3, 4, KV_HASH_SEED), 2);
    /* events without a group still apply */
    batch1(&m);
    removed(&m, 101, 1, NULL);
    feed(&r, 3, &m);
    CHECK_EQ_U64(matched(&r, 0, 3, 4, KV_HASH_SEED), 1);
    /* after an engine restart the group is learned again: until a
     * full-attention group is named, every group's events apply */
    map_batch(&m, 1);
    map_stored(&m, 300, 2, 40, 4, 0, "sliding_window");
    feed(&r, 0, &m);
    CHECK_EQ_U64(matched(&r, 40, 2, 4, KV_HASH_SEED), 2);
    kv_zmq_pub_stats(r.z, 0, &st);
    CHECK_EQ_U64(st.restarts, 1);
    CHECK_EQ_U64(st.other_groups, 2);
    rig_close(&r);
}

/* vLLM with a port per data-parallel rank: rank 3's engine, its server's
 * only publisher, is that server (routing reads a server's rank 0). */
TEST(feed_dp_rank_of_a_sole_publisher)
{
    rig_t        r;
    mp_t         m;
    uint32_t     tok[8], dp = 9;
    uint64_t     seq[2], wid = 0;
    kv_overlap_t out[8];
    size_t       i;

    rig_open(&r, 4);
    m.n = 0;
    mp_arr(&m, 3);
    mp_f64(&m, 1795362575.25);
    mp_arr(&m, 1);
    stored(&m, 100, 2, -1, 0, 4, -1, "GPU", NULL);
    mp_uint(&m, 3);                     /* data_parallel_rank */
    feed(&r, 0, &m);
    for (i = 0; i < 8; i++) {
        tok[i] = (uint32_t) i;
    }
    CHECK_EQ_U64(kv_hash_blocks(tok, 8, 4, KV_HASH_SEED, NULL, seq), 2);
    CHECK_EQ_U64(kv_index_match(r.ix, seq, 2, out, 8), 1);
    CHECK_EQ_U64(out[0].blocks, 2);
    CHECK(kv_index_worker_info(r.ix, out[0].slot, &wid, &dp) == 0);
    CHECK_EQ_U64(dp, 0);
    CHECK(wid != 0);
    rig_close(&r);
}

int main(void)
{
    RUN(decodes_stored_removed_cleared);
    RUN(malformed_batches_fail_whole);
    RUN(decodes_short_arrays_and_maps);
    RUN(seq_frames_and_tiers);
    RUN(feed_sequence_gap_restart_and_malformed);
    RUN(feed_tiers_lora_and_block_size);
    RUN(feed_checks_the_publishers_own_block_size);
    RUN(feed_salted_prompts);
    RUN(feed_drops_reach_on_drop);
    RUN(feed_hybrid_groups);
    RUN(feed_dp_rank_of_a_sole_publisher);
    return kvt_done();
}
