/*
 * libFuzzer target: the decode side of the KV transfer (kvx_rx_feed in
 * workers/kvw_xfer_wire.c), which reads what a prefill peer streams back.
 * The first bytes choose the request (blocks asked for, payload size, CUDA
 * IPC offered, first token asked for); then
 *
 *   first byte odd:  a well-formed stream for that request, cut where the
 *                    input says and continued with the input's bytes (so the
 *                    checks past the header's checksum are reached), fed
 *                    whole and fed in pieces whose sizes the input picks:
 *                    the same events, the same error, no crash or
 *                    over-read either way;
 *   first byte even: a well-formed stream for that request is built, which
 *                    must be read to the end with every block as sent; then
 *                    one of its bytes is changed (where and how: the input),
 *                    and the stream must fail, unless the byte was a CUDA IPC
 *                    block offset that still names a whole block of the pool
 *                    (offsets carry no checksum: docs/PROTOCOL.md).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvw_xfer_wire.h"

#define MAX_BLOCKS 8
#define MAX_EVENTS (MAX_BLOCKS + 8)

static uint64_t seq[MAX_BLOCKS + 4], local[MAX_BLOCKS + 4];

typedef struct {
    int          n;
    kvx_rx_ev_t  ev[MAX_EVENTS];
    uint64_t     value[MAX_EVENTS];     /* block: checksum/offset; token: token */
    char         why[200];
} trace_t;

static void expect(kvx_rx_t *rx, const uint8_t *p)
{
    static const uint64_t sizes[4] = { 0, 16, 64, 200 };
    uint32_t i;

    memset(rx, 0, sizeof(*rx));
    rx->block_size = 16;
    rx->block_bytes = sizes[p[0] & 3];
    rx->count = (p[0] >> 2) % (MAX_BLOCKS + 1);
    rx->first = p[1] & 3;
    rx->ipc_offered = (p[1] >> 2) & 1;
    rx->token_asked = (p[1] >> 3) & 1;
    rx->model_fp = kvx_model_fp("m", 1000);
    rx->layout_fp = kvx_layout_fp(16, rx->block_bytes, 0);
    for (i = 0; i < MAX_BLOCKS + 4; i++) {
        seq[i] = 0x1000 + i;
        local[i] = 0x2000 + i;
    }
    rx->seq = seq;
    rx->local = local;
}

/* Feeds buf: whole when cuts is NULL, else in pieces of 1 + cuts[k] % 97 bytes. */
static void run(kvx_rx_t *rx, const uint8_t *buf, size_t len, const uint8_t *cuts, size_t ncuts,
                trace_t *t)
{
    size_t          off = 0, avail = cuts ? 0 : len, used, k = 0;
    kvx_block_t     blk;
    const uint8_t  *payload;
    kvx_rx_ev_t     ev;

    t->n = 0;
    t->why[0] = 0;
    for (;;) {
        ev = kvx_rx_feed(rx, buf + off, avail - off, &used, &blk, &payload, t->why,
                         sizeof(t->why));
        if (ev == KVX_MORE) {
            if (avail == len) {
                break;
            }
            avail += cuts && ncuts ? 1 + (size_t) (cuts[k++ % ncuts] % 97) : len;
            avail = avail > len ? len : avail;
            continue;
        }
        if (t->n == MAX_EVENTS) {
            abort();            /* more frames than a request can have */
        }
        t->ev[t->n] = ev;
        t->value[t->n++] = ev == KVX_BLOCK ? blk.checksum
                           : ev == KVX_TOKEN ? rx->token.token : 0;
        if (ev == KVX_BLOCK && payload && kvx_checksum(payload, rx->block_bytes) != blk.checksum) {
            abort();            /* a block handed out before its check */
        }
        off += used;
        if (ev == KVX_DONE || ev == KVX_ERROR) {
            break;
        }
    }
}

static int same(const trace_t *a, const trace_t *b)
{
    return a->n == b->n && memcmp(a->ev, b->ev, sizeof(a->ev[0]) * a->n) == 0
           && memcmp(a->value, b->value, sizeof(a->value[0]) * a->n) == 0
           && strcmp(a->why, b->why) == 0;
}

/* A well-formed stream for rx's request (malloc'ed); its length in *len. */
static uint8_t *build(const kvx_rx_t *rx, int ipc, int token, size_t *len)
{
    size_t       cap = KVX_HDR_LEN + KVX_TOK_LEN + KVX_IPC_LEN + KVX_END_LEN
                       + rx->count * (KVX_BLK_LEN + rx->block_bytes);
    uint8_t     *s = malloc(cap), *p = s;
    kvx_header_t h = { KVX_VERSION, rx->model_fp, rx->layout_fp, rx->block_size, rx->first,
                       rx->count, (ipc ? KVX_F_IPC : 0) | (token ? KVX_F_TOKEN : 0),
                       rx->block_bytes, 0 };
    kvx_token_t  tk = { 4242, 99 };
    kvx_ipc_t    pool = { 0, (rx->count + 2) * rx->block_bytes, { 7 } };
    kvx_block_t  b;
    uint32_t     i, j;

    kvx_header_encode(&h, p);
    p += KVX_HDR_LEN;
    if (token) {
        kvx_token_encode(&tk, p);
        p += KVX_TOK_LEN;
    }
    if (ipc) {
        kvx_ipc_encode(&pool, p);
        p += KVX_IPC_LEN;
    }
    for (i = 0; i < rx->count; i++) {
        b.index = rx->first + i;
        b.seq_hash = seq[b.index];
        b.local_hash = local[b.index];
        if (!ipc) {
            for (j = 0; j < rx->block_bytes; j++) {
                p[KVX_BLK_LEN + j] = (uint8_t) (i * 31 + j);
            }
        }
        b.checksum = ipc ? (uint64_t) (i + 1) * rx->block_bytes
                         : kvx_checksum(p + KVX_BLK_LEN, rx->block_bytes);
        kvx_block_encode(&b, p);
        p += KVX_BLK_LEN + (ipc ? 0 : rx->block_bytes);
    }
    kvx_end_encode(rx->count, p);
    p += KVX_END_LEN;
    *len = (size_t) (p - s);
    return s;
}

/* 1 if byte at of the stream is inside a block frame's offset field under IPC */
static int ipc_offset_byte(const kvx_rx_t *rx, int token, size_t at)
{
    size_t first = KVX_HDR_LEN + (token ? KVX_TOK_LEN : 0) + KVX_IPC_LEN, k;

    if (at < first || at >= first + rx->count * KVX_BLK_LEN) {
        return 0;
    }
    k = (at - first) % KVX_BLK_LEN;
    return k >= 24;
}

static void corrupt(const uint8_t *data, size_t size)
{
    kvx_rx_t  rx;
    trace_t   t;
    int       ipc, token;
    size_t    len, at;
    uint8_t  *s;

    if (size < 6) {
        return;
    }
    expect(&rx, data);
    ipc = rx.ipc_offered && rx.block_bytes > 0 && (data[2] & 1);
    token = rx.token_asked && (data[2] & 2);
    s = build(&rx, ipc, token, &len);
    run(&rx, s, len, data + 5, size - 5, &t);
    if (t.n == 0 || t.ev[t.n - 1] != KVX_DONE) {
        fprintf(stderr, "a well-formed stream failed: %s\n", t.why);
        abort();
    }
    at = ((size_t) data[3] << 8 | data[4]) % len;
    s[at] ^= (uint8_t) (1u << (data[2] >> 5));
    expect(&rx, data);
    run(&rx, s, len, data + 5, size - 5, &t);
    if (t.n > 0 && t.ev[t.n - 1] == KVX_DONE && !(ipc && ipc_offset_byte(&rx, token, at))) {
        fprintf(stderr, "a stream with byte %zu of %zu changed was accepted\n", at, len);
        abort();
    }
    free(s);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kvx_rx_t  rx;
    trace_t   whole, pieces;
    uint8_t  *buf, *head;
    size_t    n, hlen, len;

    if (size < 4) {
        return 0;
    }
    if (!(data[0] & 1)) {
        corrupt(data + 1, size - 1);
        return 0;
    }
    /* data[1..2]: the request; data[3]: how many piece sizes follow, then
     * them; then 3 bytes: IPC/token and where a well-formed stream for the
     * request is cut, the rest going on from there */
    n = data[3] % 16;
    if (size < 7 + n) {
        return 0;
    }
    expect(&rx, data + 1);
    head = build(&rx, rx.ipc_offered && rx.block_bytes > 0 && (data[4 + n] & 1),
                 rx.token_asked && (data[4 + n] & 2), &hlen);
    hlen = ((size_t) data[5 + n] << 8 | data[6 + n]) % (hlen + 1);
    len = hlen + size - 7 - n;
    buf = malloc(len + 1);
    memcpy(buf, head, hlen);
    memcpy(buf + hlen, data + 7 + n, size - 7 - n);
    free(head);
    run(&rx, buf, len, NULL, 0, &whole);
    expect(&rx, data + 1);
    run(&rx, buf, len, data + 4, n, &pieces);
    if (!same(&whole, &pieces)) {
        fprintf(stderr, "whole and in pieces differ: %s / %s\n", whole.why, pieces.why);
        abort();
    }
    free(buf);
    return 0;
}
