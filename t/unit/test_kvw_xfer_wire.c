/* The KV transfer's wire format: frames round-trip, and every check refuses with a reason. */
#include "kvtest.h"
#include "kvw_xfer_wire.h"

#include <stdlib.h>

#define BB 40       /* payload bytes per block */
#define NB 3

static uint64_t seq[8] = {11, 12, 13, 14, 15, 16, 17, 18};
static uint64_t loc[8] = {21, 22, 23, 24, 25, 26, 27, 28};

/* A well-formed stream of blocks 1..3 of a prompt. */
static size_t stream(uint8_t *out, kvx_header_t *h)
{
    uint8_t payload[BB];
    size_t n = 0;

    h->version = KVX_VERSION;
    h->model_fp = kvx_model_fp("m", 1000);
    h->layout_fp = kvx_layout_fp(16, BB, 0);
    h->block_size = 16;
    h->first = 1;
    h->count = NB;
    h->block_bytes = BB;
    h->kv_bytes_per_token = 0;
    h->flags = 0;
    kvx_header_encode(h, out);
    n += KVX_HDR_LEN;
    for (uint32_t i = 1; i <= NB; i++) {
        kvx_block_t b = { .index = i, .seq_hash = seq[i], .local_hash = loc[i] };
        memset(payload, (int)i, sizeof(payload));
        b.checksum = kvx_checksum(payload, BB);
        kvx_block_encode(&b, out + n);
        n += KVX_BLK_LEN;
        memcpy(out + n, payload, BB);
        n += BB;
    }
    kvx_end_encode(NB, out + n);
    return n + KVX_END_LEN;
}

static void expect(kvx_rx_t *rx)
{
    memset(rx, 0, sizeof(*rx));
    rx->model_fp = kvx_model_fp("m", 1000);
    rx->layout_fp = kvx_layout_fp(16, BB, 0);
    rx->block_bytes = BB;
    rx->block_size = 16;
    rx->first = 1;
    rx->count = NB;
    rx->seq = seq;
    rx->local = loc;
}

/* Feeds buf whole, frame by frame; returns the last event, blocks seen in *blocks. */
static kvx_rx_ev_t feed_all(kvx_rx_t *rx, const uint8_t *buf, size_t len, int *blocks,
                            char *why, size_t wn)
{
    size_t off = 0, used;
    kvx_rx_ev_t ev = KVX_MORE;

    *blocks = 0;
    why[0] = '\0';
    while (off <= len) {
        kvx_block_t b;
        const uint8_t *payload;
        ev = kvx_rx_feed(rx, buf + off, len - off, &used, &b, &payload, why, wn);
        if (ev == KVX_BLOCK) {
            (*blocks)++;
            CHECK(payload[0] == (uint8_t)b.index);
        }
        if (ev == KVX_MORE || ev == KVX_ERROR || ev == KVX_DONE)
            return ev;
        off += used;
    }
    return ev;
}

TEST(round_trip)
{
    uint8_t buf[1024];
    kvx_header_t h;
    kvx_rx_t rx;
    char why[256];
    int blocks;
    size_t n = stream(buf, &h);

    expect(&rx);
    CHECK(feed_all(&rx, buf, n, &blocks, why, sizeof(why)) == KVX_DONE);
    CHECK_EQ_U64(blocks, NB);
    CHECK_EQ_U64(rx.hdr.kv_bytes_per_token, 0);
    /* one byte at a time: nothing is handed out before a frame is whole */
    expect(&rx);
    size_t off = 0, used;
    int done = 0;
    blocks = 0;
    for (size_t have = 0; have <= n && !done; have++) {
        kvx_block_t b;
        const uint8_t *p;
        kvx_rx_ev_t ev = kvx_rx_feed(&rx, buf + off, have - off, &used, &b, &p, why,
                                     sizeof(why));
        CHECK(ev != KVX_ERROR);
        off += used;
        blocks += ev == KVX_BLOCK;
        done = ev == KVX_DONE;
    }
    CHECK(done);
    CHECK_EQ_U64(blocks, NB);
}

/* Re-encodes the header after a change (a peer that is consistent but wrong). */
static void reheader(uint8_t *buf, void (*edit)(kvx_header_t *))
{
    kvx_header_t h;
    stream(buf, &h);
    edit(&h);
    kvx_header_encode(&h, buf);
}

static void other_model(kvx_header_t *h) { h->model_fp = kvx_model_fp("other", 1000); }
static void other_bs(kvx_header_t *h) { h->block_size = 32; }
static void other_layout(kvx_header_t *h) { h->layout_fp ^= 1; }
static void other_bytes(kvx_header_t *h) { h->block_bytes = BB + 8; }
static void other_first(kvx_header_t *h) { h->first = 0; }
static void other_version(kvx_header_t *h) { h->version = 9; }

static void refused(uint8_t *buf, size_t n, const char *reason)
{
    kvx_rx_t rx;
    char why[256];
    int blocks;

    expect(&rx);
    CHECK(feed_all(&rx, buf, n, &blocks, why, sizeof(why)) == KVX_ERROR);
    if (strstr(why, reason) == NULL) {
        fprintf(stderr, "  reason '%s' lacks '%s'\n", why, reason);
        CHECK(0);
    }
}

TEST(mismatches_refused_with_reason)
{
    uint8_t buf[1024];
    kvx_header_t h;
    size_t n = stream(buf, &h);

    reheader(buf, other_model);
    refused(buf, n, "model fingerprint");
    reheader(buf, other_bs);
    refused(buf, n, "block size");
    reheader(buf, other_layout);
    refused(buf, n, "layout fingerprint");
    reheader(buf, other_bytes);
    refused(buf, n, "block bytes");
    reheader(buf, other_first);
    refused(buf, n, "not the ones asked for");
    reheader(buf, other_version);
    refused(buf, n, "version");
}

TEST(corruption_refused_with_reason)
{
    uint8_t buf[1024];
    kvx_header_t h;
    size_t n = stream(buf, &h);

    buf[10] ^= 1;                                   /* header bit flip */
    refused(buf, n, "header checksum");
    stream(buf, &h);
    buf[0] = 'X';
    refused(buf, n, "magic");
    stream(buf, &h);
    buf[KVX_HDR_LEN + 8] ^= 1;                      /* first block's sequence hash */
    refused(buf, n, "not the prompt's");
    stream(buf, &h);
    buf[KVX_HDR_LEN + KVX_BLK_LEN + 5] ^= 1;        /* first block's payload */
    refused(buf, n, "checksum");
    stream(buf, &h);
    buf[KVX_HDR_LEN + 4] = 2;                       /* block 2 where block 1 is due */
    refused(buf, n, "was due");
    stream(buf, &h);
    buf[n - KVX_END_LEN + 4] = 7;                   /* end frame's count */
    refused(buf, n, "end frame");
}

TEST(truncated_and_trailing)
{
    uint8_t buf[1024];
    kvx_header_t h;
    kvx_rx_t rx;
    char why[256];
    int blocks;
    size_t n = stream(buf, &h);

    /* cut inside the second block: one block out, then more is wanted */
    expect(&rx);
    CHECK(feed_all(&rx, buf, KVX_HDR_LEN + (KVX_BLK_LEN + BB) + 10, &blocks, why,
                   sizeof(why)) == KVX_MORE);
    CHECK_EQ_U64(blocks, 1);
    /* bytes after the end are an error */
    expect(&rx);
    CHECK(feed_all(&rx, buf, n, &blocks, why, sizeof(why)) == KVX_DONE);
    size_t used;
    kvx_block_t b;
    const uint8_t *p;
    CHECK(kvx_rx_feed(&rx, buf, 4, &used, &b, &p, why, sizeof(why)) == KVX_ERROR);
}

TEST(fingerprints_differ)
{
    CHECK(kvx_model_fp("a", 10) != kvx_model_fp("b", 10));
    CHECK(kvx_model_fp("a", 10) != kvx_model_fp("a", 11));
    CHECK(kvx_layout_fp(16, 100, 0) != kvx_layout_fp(32, 100, 0));
    CHECK(kvx_layout_fp(16, 0, 1000) != kvx_layout_fp(16, 0, 2000));
}

/* A CUDA IPC stream of blocks 1..3: header with KVX_F_IPC, the pool, offsets, the end. */
static size_t ipc_stream(uint8_t *out, uint64_t pool_bytes, uint64_t off2)
{
    kvx_header_t h;
    kvx_ipc_t pool = { .device = 0, .pool_bytes = pool_bytes };
    size_t n = 0;

    stream(out, &h);
    h.flags = KVX_F_IPC;
    kvx_header_encode(&h, out);
    n += KVX_HDR_LEN;
    memset(pool.handle, 0xab, sizeof(pool.handle));
    kvx_ipc_encode(&pool, out + n);
    n += KVX_IPC_LEN;
    for (uint32_t i = 1; i <= NB; i++) {
        kvx_block_t b = { .index = i, .seq_hash = seq[i], .local_hash = loc[i],
                          .checksum = i == 2 ? off2 : (uint64_t)i * 7 * BB };
        kvx_block_encode(&b, out + n);
        n += KVX_BLK_LEN;
    }
    kvx_end_encode(NB, out + n);
    return n + KVX_END_LEN;
}

/* Feeds an IPC stream; the last event, the offsets seen in offs. */
static kvx_rx_ev_t feed_ipc(kvx_rx_t *rx, const uint8_t *buf, size_t len, uint64_t *offs,
                            int *saw_pool, char *why, size_t wn)
{
    size_t off = 0, used;
    kvx_rx_ev_t ev;

    *saw_pool = 0;
    why[0] = '\0';
    for (;;) {
        kvx_block_t b;
        const uint8_t *payload = (const uint8_t *)"x";
        ev = kvx_rx_feed(rx, buf + off, len - off, &used, &b, &payload, why, wn);
        if (ev == KVX_IPC)
            *saw_pool = rx->pool.pool_bytes > 0 && rx->pool.handle[63] == 0xab;
        if (ev == KVX_BLOCK) {
            CHECK(payload == NULL);
            offs[b.index] = b.checksum;
        }
        if (ev == KVX_MORE || ev == KVX_ERROR || ev == KVX_DONE)
            return ev;
        off += used;
    }
}

TEST(ipc_offsets_checked_and_only_when_offered)
{
    uint8_t buf[1024];
    uint64_t offs[8] = {0};
    kvx_rx_t rx;
    char why[256];
    int pool;
    size_t n = ipc_stream(buf, 64 * BB, 5 * BB);

    /* not offered: refused at the header */
    expect(&rx);
    CHECK(feed_ipc(&rx, buf, n, offs, &pool, why, sizeof(why)) == KVX_ERROR);
    CHECK(strstr(why, "not offered") != NULL);
    expect(&rx);
    rx.ipc_offered = 1;
    CHECK(feed_ipc(&rx, buf, n, offs, &pool, why, sizeof(why)) == KVX_DONE);
    CHECK(pool);
    CHECK_EQ_U64(offs[1], 7 * BB);
    CHECK_EQ_U64(offs[2], 5 * BB);
    CHECK_EQ_U64(offs[3], 21 * BB);
    /* an offset that is not a whole block of the pool */
    n = ipc_stream(buf, 64 * BB, 5 * BB + 1);
    expect(&rx);
    rx.ipc_offered = 1;
    CHECK(feed_ipc(&rx, buf, n, offs, &pool, why, sizeof(why)) == KVX_ERROR);
    CHECK(strstr(why, "offset") != NULL);
    n = ipc_stream(buf, 64 * BB, 64 * BB);
    expect(&rx);
    rx.ipc_offered = 1;
    CHECK(feed_ipc(&rx, buf, n, offs, &pool, why, sizeof(why)) == KVX_ERROR);
    /* a corrupt IPC frame */
    n = ipc_stream(buf, 64 * BB, 5 * BB);
    buf[KVX_HDR_LEN + 20] ^= 1;
    expect(&rx);
    rx.ipc_offered = 1;
    CHECK(feed_ipc(&rx, buf, n, offs, &pool, why, sizeof(why)) == KVX_ERROR);
    CHECK(strstr(why, "IPC frame") != NULL);
    /* block hashes still checked */
    n = ipc_stream(buf, 64 * BB, 5 * BB);
    buf[KVX_HDR_LEN + KVX_IPC_LEN + KVX_BLK_LEN + 8] ^= 1;
    expect(&rx);
    rx.ipc_offered = 1;
    CHECK(feed_ipc(&rx, buf, n, offs, &pool, why, sizeof(why)) == KVX_ERROR);
    CHECK(strstr(why, "hash") != NULL);
}

/* The stream of stream() with a token frame after the header. */
static size_t token_stream(uint8_t *buf, const kvx_token_t *t)
{
    uint8_t plain[1024];
    kvx_header_t h;
    size_t n = stream(plain, &h);

    h.flags = KVX_F_TOKEN;
    kvx_header_encode(&h, buf);
    kvx_token_encode(t, buf + KVX_HDR_LEN);
    memcpy(buf + KVX_HDR_LEN + KVX_TOK_LEN, plain + KVX_HDR_LEN, n - KVX_HDR_LEN);
    return n + KVX_TOK_LEN;
}

TEST(first_token_frame_checked_and_only_when_asked)
{
    uint8_t buf[1100];
    kvx_token_t t = { .token = 151643, .rng = 0x0123456789abcdefULL };
    kvx_rx_t rx;
    char why[256];
    int blocks;
    size_t n = token_stream(buf, &t);

    expect(&rx);
    rx.token_asked = 1;
    CHECK(feed_all(&rx, buf, n, &blocks, why, sizeof(why)) == KVX_DONE);
    CHECK_EQ_U64(blocks, NB);
    CHECK(rx.has_token);
    CHECK_EQ_U64(rx.token.token, 151643);
    CHECK_EQ_U64(rx.token.rng, 0x0123456789abcdefULL);
    /* a peer that sends it unasked is refused */
    expect(&rx);
    CHECK(feed_all(&rx, buf, n, &blocks, why, sizeof(why)) == KVX_ERROR);
    CHECK(strstr(why, "not asked") != NULL);
    /* asked and not sent: a stream as before, no token */
    n = stream(buf, &(kvx_header_t){0});
    expect(&rx);
    rx.token_asked = 1;
    CHECK(feed_all(&rx, buf, n, &blocks, why, sizeof(why)) == KVX_DONE);
    CHECK(!rx.has_token);
    /* a flipped bit in the token or its state fails the frame's checksum */
    for (size_t at = 4; at < 16; at += 11) {
        n = token_stream(buf, &t);
        buf[KVX_HDR_LEN + at] ^= 4;
        expect(&rx);
        rx.token_asked = 1;
        CHECK(feed_all(&rx, buf, n, &blocks, why, sizeof(why)) == KVX_ERROR);
        CHECK(strstr(why, "first-token frame") != NULL);
        CHECK(!rx.has_token);
    }
}

int main(void)
{
    RUN(round_trip);
    RUN(mismatches_refused_with_reason);
    RUN(corruption_refused_with_reason);
    RUN(truncated_and_trailing);
    RUN(fingerprints_differ);
    RUN(ipc_offsets_checked_and_only_when_offered);
    RUN(first_token_frame_checked_and_only_when_asked);
    return kvt_done();
}
