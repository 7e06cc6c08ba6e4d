/* KV event decoders (kv_event.h): both JSON shapes, batches, tiers, the
 * MessagePack envelope (built here by hand, by rmp_serde's to_vec_named
 * rules) and malformed input. */
#include <stdlib.h>

#include "kv_event.h"
#include "kvtest.h"

static char err[256];

static int json(kv_event_batch_t *b, const char *s)
{
    err[0] = 0;
    return kv_event_decode(b, s, strlen(s), err, sizeof(err));
}

TEST(json_newer_stored_removed_cleared)
{
    kv_event_batch_t b;

    kv_event_batch_init(&b);
    CHECK(json(&b, "{\"worker_id\":7587886123456789,\"storage_tier\":\"device\",\"event\":"
                   "{\"event_id\":1,\"data\":{\"stored\":{\"parent_hash\":null,\"start_position\":"
                   "null,\"blocks\":[{\"block_hash\":4117275816416024698,\"tokens_hash\":"
                   "4117275816416024698,\"mm_extra_info\":null},{\"block_hash\":"
                   "18446744073709551615,\"tokens_hash\":6081346995852963768,\"mm_extra_info\""
                   ":null}]}},\"dp_rank\":3}}") == 0);
    CHECK_EQ_U64(b.n_events, 1);
    CHECK_EQ_U64(b.events[0].kind, KV_EVENT_STORED);
    CHECK_EQ_U64(b.events[0].worker_id, 7587886123456789ULL);
    CHECK_EQ_U64(b.events[0].dp_rank, 3);
    CHECK_EQ_U64(b.events[0].event_id, 1);
    CHECK(!b.events[0].has_parent);
    CHECK(!b.events[0].has_start_position);
    CHECK_EQ_U64(b.events[0].n_blocks, 2);
    CHECK_EQ_U64(b.events[0].blocks[0].tokens_hash, 4117275816416024698ULL);
    CHECK_EQ_U64(b.events[0].blocks[1].block_hash, UINT64_MAX);   /* all 64 bits */
    CHECK_EQ_U64(b.events[0].blocks[1].tokens_hash, 6081346995852963768ULL);

    CHECK(json(&b, "{\"worker_id\":1,\"storage_tier\":\"device\",\"event\":{\"event_id\":9,"
                   "\"data\":{\"stored\":{\"parent_hash\":77,\"start_position\":16,\"blocks\":"
                   "[{\"block_hash\":5,\"tokens_hash\":6,\"mm_extra_info\":null}]}},"
                   "\"dp_rank\":0}}") == 0);
    CHECK(b.events[0].has_parent);
    CHECK_EQ_U64(b.events[0].parent_hash, 77);
    CHECK(b.events[0].has_start_position);
    CHECK_EQ_U64(b.events[0].start_position, 16);

    CHECK(json(&b, "{\"worker_id\":7,\"storage_tier\":\"device\",\"event\":{\"event_id\":2,"
                   "\"data\":{\"removed\":{\"block_hashes\":[5947898228081096063,1]}},"
                   "\"dp_rank\":1}}") == 0);
    CHECK_EQ_U64(b.n_events, 1);
    CHECK_EQ_U64(b.events[0].kind, KV_EVENT_REMOVED);
    CHECK_EQ_U64(b.events[0].n_hashes, 2);
    CHECK_EQ_U64(b.events[0].hashes[0], 5947898228081096063ULL);
    CHECK_EQ_U64(b.events[0].dp_rank, 1);

    CHECK(json(&b, "{\"worker_id\":7,\"storage_tier\":\"device\",\"event\":{\"event_id\":3,"
                   "\"data\":\"cleared\",\"dp_rank\":0}}") == 0);
    CHECK_EQ_U64(b.events[0].kind, KV_EVENT_CLEARED);
    kv_event_batch_free(&b);
}

TEST(json_older_shape)
{
    kv_event_batch_t b;

    kv_event_batch_init(&b);
    /* signed worker_id and hashes, no storage_tier, dp_rank or start_position */
    CHECK(json(&b, "  {\"worker_id\":-5,\"event\":{\"event_id\":4,\"data\":{\"stored\":"
                   "{\"parent_hash\":-2,\"blocks\":[{\"block_hash\":-1,\"tokens_hash\":"
                   "-9223372036854775808}]}}}}") == 0);
    CHECK_EQ_U64(b.n_events, 1);
    CHECK_EQ_U64(b.events[0].worker_id, (uint64_t) -5);
    CHECK_EQ_U64(b.events[0].dp_rank, 0);
    CHECK(b.events[0].has_parent);
    CHECK_EQ_U64(b.events[0].parent_hash, (uint64_t) -2);
    CHECK(!b.events[0].has_start_position);
    CHECK_EQ_U64(b.events[0].blocks[0].block_hash, UINT64_MAX);
    CHECK_EQ_U64(b.events[0].blocks[0].tokens_hash, 1ULL << 63);
    kv_event_batch_free(&b);
}

TEST(json_batch_and_tiers)
{
    kv_event_batch_t b;

    kv_event_batch_init(&b);
    CHECK(json(&b, "[{\"worker_id\":1,\"event\":{\"event_id\":1,\"data\":{\"stored\":"
                   "{\"parent_hash\":null,\"blocks\":[{\"block_hash\":1,\"tokens_hash\":1}]}}}},"
                   "{\"worker_id\":1,\"storage_tier\":\"host_pinned\",\"event\":{\"event_id\":2,"
                   "\"data\":{\"stored\":{\"parent_hash\":null,\"blocks\":[{\"block_hash\":2,"
                   "\"tokens_hash\":2},{\"block_hash\":3,\"tokens_hash\":3}]}}}},"
                   "{\"worker_id\":2,\"storage_tier\":\"device\",\"event\":{\"event_id\":3,"
                   "\"data\":{\"removed\":{\"block_hashes\":[1]}}}},"
                   "{\"worker_id\":2,\"storage_tier\":\"disk\",\"event\":{\"event_id\":4,"
                   "\"data\":\"cleared\"}}]") == 0);
    CHECK_EQ_U64(b.n_events, 2);
    CHECK_EQ_U64(b.skipped_tier, 2);
    CHECK_EQ_U64(b.events[0].kind, KV_EVENT_STORED);
    CHECK_EQ_U64(b.events[0].n_blocks, 1);
    CHECK_EQ_U64(b.events[0].blocks[0].block_hash, 1);
    CHECK_EQ_U64(b.events[1].kind, KV_EVENT_REMOVED);
    CHECK_EQ_U64(b.events[1].hashes[0], 1);
    CHECK_EQ_U64(b.events[1].event_id, 3);
    /* a store of no blocks is valid (an empty Vec) */
    CHECK(json(&b, "{\"worker_id\":1,\"event\":{\"event_id\":1,\"data\":{\"stored\":"
                   "{\"parent_hash\":null,\"blocks\":[]}}}}") == 0);
    CHECK_EQ_U64(b.n_events, 1);
    CHECK_EQ_U64(b.events[0].n_blocks, 0);
    /* an empty batch is fine and holds nothing */
    CHECK(json(&b, "[]") == 0);
    CHECK_EQ_U64(b.n_events, 0);
    CHECK_EQ_U64(b.skipped_tier, 0);
    kv_event_batch_free(&b);
}

static const char *bad_json[] = {
    "",
    "{",
    "{\"worker_id\":1}",
    "{\"event\":{\"event_id\":1,\"data\":\"cleared\"}}",
    "{\"worker_id\":\"1\",\"event\":{\"event_id\":1,\"data\":\"cleared\"}}",
    "{\"worker_id\":1,\"event\":{\"data\":\"cleared\"}}",
    "{\"worker_id\":1,\"event\":{\"event_id\":1}}",
    "{\"worker_id\":1,\"event\":{\"event_id\":1,\"data\":\"flushed\"}}",
    "{\"worker_id\":1,\"event\":{\"event_id\":1,\"data\":{\"stored\":{\"blocks\":[1]}}}}",
    "{\"worker_id\":1,\"event\":{\"event_id\":1,\"data\":{\"stored\":{\"blocks\":"
    "[{\"block_hash\":1}]}}}}",
    "{\"worker_id\":1,\"event\":{\"event_id\":1,\"data\":{\"stored\":{\"blocks\":"
    "[{\"block_hash\":1.5,\"tokens_hash\":1}]}}}}",
    "{\"worker_id\":1,\"event\":{\"event_id\":1,\"data\":{\"removed\":{}}}}",
    "{\"worker_id\":1,\"event\":{\"event_id\":1,\"data\":{\"removed\":{\"block_hashes\":[\"x\"]}}}}",
    "{\"worker_id\":18446744073709551616,\"event\":{\"event_id\":1,\"data\":\"cleared\"}}",
    "{\"worker_id\":1,\"event\":{\"event_id\":1,\"data\":\"cleared\"}} x",
    "{\"worker_id\":1,\"storage_tier\":5,\"event\":{\"event_id\":1,\"data\":\"cleared\"}}",
    "{\"worker_id\":1,\"event\":{\"event_id\":1,\"data\":{\"stored\":{},\"removed\":{}}}}",
    "[{\"worker_id\":1,\"event\":{\"event_id\":1,\"data\":\"cleared\"}},3]",
    "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]"
    "]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]",
    "{\"worker_id\":1,\"event\":{\"event_id\":1,\"data\":\"clea",
};

TEST(json_malformed_fails_whole)
{
    kv_event_batch_t b;
    size_t           i;

    kv_event_batch_init(&b);
    for (i = 0; i < sizeof(bad_json) / sizeof(bad_json[0]); i++) {
        /* a good message first, so a failure visibly empties the batch */
        CHECK(json(&b, "{\"worker_id\":1,\"event\":{\"event_id\":1,\"data\":\"cleared\"}}") == 0);
        CHECK_EQ_U64(b.n_events, 1);
        err[0] = 0;
        if (kv_event_decode_json(&b, bad_json[i], strlen(bad_json[i]), err, sizeof(err)) != -1) {
            fprintf(stderr, "  accepted: %s\n", bad_json[i]);
            CHECK(0);
        }
        CHECK(err[0] != 0);
        CHECK_EQ_U64(b.n_events, 0);
    }
    /* a good event then a bad one: nothing of the message survives */
    CHECK(json(&b, "[{\"worker_id\":1,\"event\":{\"event_id\":1,\"data\":\"cleared\"}},"
                   "{\"worker_id\":1,\"event\":{\"event_id\":1,\"data\":7}}]") == -1);
    CHECK_EQ_U64(b.n_events, 0);
    CHECK(strstr(err, "data") != NULL);
    kv_event_batch_free(&b);
}

/* --- MessagePack, written by rmp_serde::to_vec_named's rules -------------- */

typedef struct {
    uint8_t buf[4096];
    size_t  n;
} mp_t;

static void put(mp_t *m, const void *p, size_t n)
{
    memcpy(m->buf + m->n, p, n);
    m->n += n;
}

static void byte(mp_t *m, uint8_t c)
{
    put(m, &c, 1);
}

static void be(mp_t *m, uint64_t v, int n)
{
    while (n--) {
        byte(m, (uint8_t) (v >> (8 * n)));
    }
}

/* the smallest uint encoding */
static void mp_uint(mp_t *m, uint64_t v)
{
    if (v < 128) {
        byte(m, (uint8_t) v);
    } else if (v < 256) {
        byte(m, 0xcc), be(m, v, 1);
    } else if (v < 65536) {
        byte(m, 0xcd), be(m, v, 2);
    } else if (v < (1ULL << 32)) {
        byte(m, 0xce), be(m, v, 4);
    } else {
        byte(m, 0xcf), be(m, v, 8);
    }
}

static void mp_str(mp_t *m, const char *s)
{
    size_t n = strlen(s);

    byte(m, (uint8_t) (0xa0 | n));
    put(m, s, n);
}

static void mp_map(mp_t *m, int n) { byte(m, (uint8_t) (0x80 | n)); }
static void mp_arr(mp_t *m, int n) { byte(m, (uint8_t) (0x90 | n)); }
static void mp_nil(mp_t *m) { byte(m, 0xc0); }

static void router_event_stored(mp_t *m, uint64_t worker, const char *tier, int parent)
{
    mp_map(m, 3);
    mp_str(m, "worker_id"), mp_uint(m, worker);
    mp_str(m, "storage_tier"), mp_str(m, tier);
    mp_str(m, "event"), mp_map(m, 3);
    mp_str(m, "event_id"), mp_uint(m, 300);
    mp_str(m, "data"), mp_map(m, 1), mp_str(m, "stored"), mp_map(m, 3);
    mp_str(m, "parent_hash");
    if (parent) {
        mp_uint(m, 0xfedcba9876543210ULL);
    } else {
        mp_nil(m);
    }
    mp_str(m, "start_position"), mp_nil(m);
    mp_str(m, "blocks"), mp_arr(m, 2);
    mp_map(m, 3), mp_str(m, "block_hash"), mp_uint(m, 200);
    mp_str(m, "tokens_hash"), mp_uint(m, 70000), mp_str(m, "mm_extra_info"), mp_nil(m);
    mp_map(m, 3), mp_str(m, "block_hash"), mp_uint(m, UINT64_MAX);
    mp_str(m, "tokens_hash"), mp_uint(m, 5), mp_str(m, "mm_extra_info"), mp_nil(m);
    mp_str(m, "dp_rank"), mp_uint(m, 2);
}

static void envelope(mp_t *m, const mp_t *payload)
{
    mp_map(m, 5);
    mp_str(m, "publisher_id"), mp_uint(m, 123456789012ULL);
    mp_str(m, "sequence"), mp_uint(m, 41);
    mp_str(m, "published_at"), mp_uint(m, 1763856000000ULL);
    mp_str(m, "topic"), mp_str(m, "kv-events");
    mp_str(m, "payload"), byte(m, 0xc5), be(m, payload->n, 2);    /* bin 16 */
    put(m, payload->buf, payload->n);
}

TEST(msgpack_envelope_stored)
{
    kv_event_batch_t b;
    mp_t             ev = { .n = 0 }, env = { .n = 0 };

    kv_event_batch_init(&b);
    router_event_stored(&ev, 9000000000ULL, "device", 1);
    envelope(&env, &ev);
    CHECK(kv_event_decode(&b, env.buf, env.n, err, sizeof(err)) == 0);
    CHECK(b.has_envelope);
    CHECK_EQ_U64(b.publisher_id, 123456789012ULL);
    CHECK_EQ_U64(b.sequence, 41);
    CHECK_EQ_U64(b.published_at, 1763856000000ULL);
    CHECK_EQ_U64(b.n_events, 1);
    CHECK_EQ_U64(b.events[0].kind, KV_EVENT_STORED);
    CHECK_EQ_U64(b.events[0].worker_id, 9000000000ULL);
    CHECK_EQ_U64(b.events[0].dp_rank, 2);
    CHECK_EQ_U64(b.events[0].event_id, 300);
    CHECK(b.events[0].has_parent);
    CHECK_EQ_U64(b.events[0].parent_hash, 0xfedcba9876543210ULL);
    CHECK(!b.events[0].has_start_position);
    CHECK_EQ_U64(b.events[0].n_blocks, 2);
    CHECK_EQ_U64(b.events[0].blocks[0].block_hash, 200);
    CHECK_EQ_U64(b.events[0].blocks[0].tokens_hash, 70000);
    CHECK_EQ_U64(b.events[0].blocks[1].block_hash, UINT64_MAX);
    kv_event_batch_free(&b);
}

TEST(msgpack_removed_cleared_tier)
{
    kv_event_batch_t b;
    mp_t             ev = { .n = 0 }, env = { .n = 0 };

    kv_event_batch_init(&b);
    mp_map(&ev, 3);
    mp_str(&ev, "worker_id"), mp_uint(&ev, 4);
    mp_str(&ev, "storage_tier"), mp_str(&ev, "device");
    mp_str(&ev, "event"), mp_map(&ev, 3);
    mp_str(&ev, "event_id"), mp_uint(&ev, 1);
    mp_str(&ev, "data"), mp_map(&ev, 1), mp_str(&ev, "removed"), mp_map(&ev, 1);
    mp_str(&ev, "block_hashes"), mp_arr(&ev, 3);
    mp_uint(&ev, 1), mp_uint(&ev, 300), mp_uint(&ev, 1ULL << 40);
    mp_str(&ev, "dp_rank"), mp_uint(&ev, 0);
    envelope(&env, &ev);
    CHECK(kv_event_decode_msgpack(&b, env.buf, env.n, err, sizeof(err)) == 0);
    CHECK_EQ_U64(b.n_events, 1);
    CHECK_EQ_U64(b.events[0].kind, KV_EVENT_REMOVED);
    CHECK_EQ_U64(b.events[0].n_hashes, 3);
    CHECK_EQ_U64(b.events[0].hashes[2], 1ULL << 40);

    ev.n = env.n = 0;
    mp_map(&ev, 3);
    mp_str(&ev, "worker_id"), mp_uint(&ev, 4);
    mp_str(&ev, "storage_tier"), mp_str(&ev, "device");
    mp_str(&ev, "event"), mp_map(&ev, 3);
    mp_str(&ev, "event_id"), mp_uint(&ev, 2);
    mp_str(&ev, "data"), mp_str(&ev, "cleared");
    mp_str(&ev, "dp_rank"), mp_uint(&ev, 0);
    envelope(&env, &ev);
    CHECK(kv_event_decode_msgpack(&b, env.buf, env.n, err, sizeof(err)) == 0);
    CHECK_EQ_U64(b.n_events, 1);
    CHECK_EQ_U64(b.events[0].kind, KV_EVENT_CLEARED);

    ev.n = env.n = 0;
    router_event_stored(&ev, 4, "disk", 0);
    envelope(&env, &ev);
    CHECK(kv_event_decode_msgpack(&b, env.buf, env.n, err, sizeof(err)) == 0);
    CHECK_EQ_U64(b.n_events, 0);
    CHECK_EQ_U64(b.skipped_tier, 1);
    kv_event_batch_free(&b);
}

TEST(msgpack_malformed)
{
    kv_event_batch_t b;
    mp_t             ev = { .n = 0 }, env = { .n = 0 }, x;
    size_t           cut;

    kv_event_batch_init(&b);
    router_event_stored(&ev, 1, "device", 0);
    envelope(&env, &ev);
    /* every truncation of a good message fails cleanly */
    for (cut = 0; cut < env.n; cut++) {
        err[0] = 0;
        CHECK(kv_event_decode_msgpack(&b, env.buf, cut, err, sizeof(err)) == -1);
        CHECK(err[0] != 0);
        CHECK_EQ_U64(b.n_events, 0);
    }
    /* a payload that is not bytes */
    x.n = 0;
    mp_map(&x, 1), mp_str(&x, "payload"), mp_uint(&x, 3);
    CHECK(kv_event_decode_msgpack(&b, x.buf, x.n, err, sizeof(err)) == -1);
    CHECK(strstr(err, "payload") != NULL);
    /* a bin length past the end */
    x.n = 0;
    mp_map(&x, 1), mp_str(&x, "payload"), byte(&x, 0xc6), be(&x, 0xffffffff, 4);
    CHECK(kv_event_decode_msgpack(&b, x.buf, x.n, err, sizeof(err)) == -1);
    /* a huge declared array */
    x.n = 0;
    byte(&x, 0xdd), be(&x, 0xffffffff, 4);
    CHECK(kv_event_decode_msgpack(&b, x.buf, x.n, err, sizeof(err)) == -1);
    /* a reserved byte */
    x.n = 0;
    byte(&x, 0xc1);
    CHECK(kv_event_decode_msgpack(&b, x.buf, x.n, err, sizeof(err)) == -1);
    /* a negative integer where a u64 hash belongs is bit-cast, a float is not */
    x.n = 0;
    mp_map(&x, 2), mp_str(&x, "worker_id"), byte(&x, 0xcb), be(&x, 0, 8);
    mp_str(&x, "event"), mp_map(&x, 2), mp_str(&x, "event_id"), mp_uint(&x, 1);
    mp_str(&x, "data"), mp_str(&x, "cleared");
    CHECK(kv_event_decode_msgpack(&b, x.buf, x.n, err, sizeof(err)) == -1);
    CHECK(strstr(err, "worker_id") != NULL);
    x.n = 0;
    mp_map(&x, 2), mp_str(&x, "worker_id"), byte(&x, 0xff);       /* fixint -1 */
    mp_str(&x, "event"), mp_map(&x, 2), mp_str(&x, "event_id"), mp_uint(&x, 1);
    mp_str(&x, "data"), mp_str(&x, "cleared");
    CHECK(kv_event_decode_msgpack(&b, x.buf, x.n, err, sizeof(err)) == 0);
    CHECK_EQ_U64(b.events[0].worker_id, UINT64_MAX);
    kv_event_batch_free(&b);
}

/* Events with no block and no hash at all: their arrays are NULL, never
 * NULL + 0 (undefined behaviour found by fuzz_event_json; UBSan here). */
TEST(json_empty_stored_and_removed)
{
    kv_event_batch_t b;

    kv_event_batch_init(&b);
    CHECK(json(&b, "{\"worker_id\":1,\"event\":{\"event_id\":1,\"data\":{\"stored\":"
                   "{\"parent_hash\":null,\"blocks\":[]}}}}") == 0);
    CHECK(b.n_events == 1 && b.events[0].n_blocks == 0);
    CHECK(json(&b, "{\"worker_id\":1,\"event\":{\"event_id\":2,\"data\":{\"removed\":"
                   "{\"block_hashes\":[]}}}}") == 0);
    CHECK(b.n_events == 1 && b.events[0].n_hashes == 0);
    kv_event_batch_free(&b);
}

int main(void)
{
    RUN(json_empty_stored_and_removed);
    RUN(json_newer_stored_removed_cleared);
    RUN(json_older_shape);
    RUN(json_batch_and_tiers);
    RUN(json_malformed_fails_whole);
    RUN(msgpack_envelope_stored);
    RUN(msgpack_removed_cleared_tier);
    RUN(msgpack_malformed);
    return kvt_done();
}
