#include "kvw_xfer_wire.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include <xxhash.h>

static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get32(const uint8_t *p)
{
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

static uint64_t get64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

uint64_t kvx_checksum(const void *p, size_t n)
{
    return n ? XXH3_64bits(p, n) : 0;
}

uint64_t kvx_model_fp(const char *model, uint32_t vocab_size)
{
    uint8_t v[4];
    put32(v, vocab_size);
    return XXH3_64bits_withSeed(model, strlen(model), XXH3_64bits(v, 4));
}

uint64_t kvx_layout_fp(uint32_t block_size, uint64_t block_bytes, uint64_t kv_bytes_per_token)
{
    uint8_t b[32];
    memcpy(b, "kvL1", 4);   /* [block][layer][K|V][slot][kv_head][head_dim], kvw_backend.h */
    put32(b + 4, block_size);
    put64(b + 8, block_bytes);
    put64(b + 16, kv_bytes_per_token);
    put64(b + 24, 0);
    return XXH3_64bits(b, sizeof(b));
}

void kvx_header_encode(const kvx_header_t *h, uint8_t out[KVX_HDR_LEN])
{
    memcpy(out, "KVX1", 4);
    put32(out + 4, h->version);
    put64(out + 8, h->model_fp);
    put64(out + 16, h->layout_fp);
    put32(out + 24, h->block_size);
    put32(out + 28, h->first);
    put32(out + 32, h->count);
    put32(out + 36, h->flags);
    put64(out + 40, h->block_bytes);
    put64(out + 48, h->kv_bytes_per_token);
    put64(out + 56, XXH3_64bits(out, 56));
}

void kvx_block_encode(const kvx_block_t *b, uint8_t out[KVX_BLK_LEN])
{
    memcpy(out, "KVB1", 4);
    put32(out + 4, b->index);
    put64(out + 8, b->seq_hash);
    put64(out + 16, b->local_hash);
    put64(out + 24, b->checksum);
}

void kvx_end_encode(uint32_t count, uint8_t out[KVX_END_LEN])
{
    memcpy(out, "KVXE", 4);
    put32(out + 4, count);
    put64(out + 8, XXH3_64bits(out, 8));
}

void kvx_ipc_encode(const kvx_ipc_t *ipc, uint8_t out[KVX_IPC_LEN])
{
    memcpy(out, "KVI1", 4);
    put32(out + 4, ipc->device);
    put64(out + 8, ipc->pool_bytes);
    memcpy(out + 16, ipc->handle, KVX_IPC_HANDLE);
    put64(out + 80, 0);
    put64(out + 88, XXH3_64bits(out, 88));
}

void kvx_token_encode(const kvx_token_t *t, uint8_t out[KVX_TOK_LEN])
{
    memcpy(out, "KVT1", 4);
    put32(out + 4, t->token);
    put64(out + 8, t->rng);
    put64(out + 16, XXH3_64bits(out, 16));
}

size_t kvx_rx_need(const kvx_rx_t *rx)
{
    switch (rx->state) {
    case 0:  return KVX_HDR_LEN;
    case 5:  return KVX_TOK_LEN;
    case 4:  return KVX_IPC_LEN;
    case 1:  return KVX_BLK_LEN + (rx->ipc ? 0 : (size_t)rx->block_bytes);
    case 2:  return KVX_END_LEN;
    default: return 0;
    }
}

__attribute__((format(printf, 3, 4)))
static kvx_rx_ev_t fail(char *why, size_t n, const char *fmt, ...)
{
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(why, n, fmt, ap);
    va_end(ap);
    return KVX_ERROR;
}

/* The frame due after the header and the token frame. */
static int after_token(const kvx_rx_t *rx)
{
    return rx->ipc ? 4 : rx->count ? 1 : 2;
}

static kvx_rx_ev_t read_header(kvx_rx_t *rx, const uint8_t *p, char *why, size_t wn)
{
    kvx_header_t *h = &rx->hdr;

    if (memcmp(p, "KVX1", 4) != 0)
        return fail(why, wn, "not a KV transfer stream (bad magic)");
    if (get64(p + 56) != XXH3_64bits(p, 56))
        return fail(why, wn, "transfer header checksum mismatch");
    h->version = get32(p + 4);
    h->model_fp = get64(p + 8);
    h->layout_fp = get64(p + 16);
    h->block_size = get32(p + 24);
    h->first = get32(p + 28);
    h->count = get32(p + 32);
    h->flags = get32(p + 36);
    h->block_bytes = get64(p + 40);
    h->kv_bytes_per_token = get64(p + 48);
    if (h->version != KVX_VERSION)
        return fail(why, wn, "transfer version %u, expected %d", h->version, KVX_VERSION);
    if (h->model_fp != rx->model_fp)
        return fail(why, wn, "model fingerprint mismatch (%016llx, expected %016llx)",
                    (unsigned long long)h->model_fp, (unsigned long long)rx->model_fp);
    if (h->block_size != rx->block_size)
        return fail(why, wn, "block size mismatch (%u, expected %u)", h->block_size,
                    rx->block_size);
    if (h->block_bytes != rx->block_bytes)
        return fail(why, wn, "block bytes mismatch (%llu, expected %llu)",
                    (unsigned long long)h->block_bytes, (unsigned long long)rx->block_bytes);
    if (h->layout_fp != rx->layout_fp)
        return fail(why, wn, "KV layout fingerprint mismatch (%016llx, expected %016llx)",
                    (unsigned long long)h->layout_fp, (unsigned long long)rx->layout_fp);
    if (h->first != rx->first || h->count != rx->count)
        return fail(why, wn, "blocks offered from %u (%u of them) are not the ones asked for",
                    h->first, h->count);
    if (h->flags & ~(KVX_F_IPC | KVX_F_TOKEN))
        return fail(why, wn, "unknown header flags %#x", h->flags);
    if ((h->flags & KVX_F_IPC) && (!rx->ipc_offered || rx->block_bytes == 0))
        return fail(why, wn, "CUDA IPC chosen but not offered");
    if ((h->flags & KVX_F_TOKEN) && !rx->token_asked)
        return fail(why, wn, "a first token sent but not asked for");
    rx->ipc = (h->flags & KVX_F_IPC) != 0;
    rx->state = (h->flags & KVX_F_TOKEN) ? 5 : after_token(rx);
    return KVX_HEADER;
}

static kvx_rx_ev_t read_token(kvx_rx_t *rx, const uint8_t *p, char *why, size_t wn)
{
    if (memcmp(p, "KVT1", 4) != 0 || get64(p + 16) != XXH3_64bits(p, 16))
        return fail(why, wn, "bad first-token frame");
    rx->token.token = get32(p + 4);
    rx->token.rng = get64(p + 8);
    rx->has_token = 1;
    rx->state = after_token(rx);
    return KVX_TOKEN;
}

static kvx_rx_ev_t read_ipc(kvx_rx_t *rx, const uint8_t *p, char *why, size_t wn)
{
    if (memcmp(p, "KVI1", 4) != 0 || get64(p + 88) != XXH3_64bits(p, 88) || get64(p + 80) != 0)
        return fail(why, wn, "bad CUDA IPC frame");
    rx->pool.device = get32(p + 4);
    rx->pool.pool_bytes = get64(p + 8);
    memcpy(rx->pool.handle, p + 16, KVX_IPC_HANDLE);
    if (rx->pool.pool_bytes < rx->block_bytes)
        return fail(why, wn, "CUDA IPC pool of %llu bytes holds no block",
                    (unsigned long long)rx->pool.pool_bytes);
    rx->state = rx->count ? 1 : 2;
    return KVX_IPC;
}

static kvx_rx_ev_t read_block(kvx_rx_t *rx, const uint8_t *p, const uint8_t *data,
                              kvx_block_t *b, const uint8_t **payload, char *why, size_t wn)
{
    if (memcmp(p, "KVB1", 4) != 0)
        return fail(why, wn, "block frame %llu: bad magic", (unsigned long long)rx->got);
    b->index = get32(p + 4);
    b->seq_hash = get64(p + 8);
    b->local_hash = get64(p + 16);
    b->checksum = get64(p + 24);
    uint32_t want = rx->first + rx->got;
    if (b->index != want)
        return fail(why, wn, "block %u arrived where block %u was due", b->index, want);
    if (b->seq_hash != rx->seq[want] || b->local_hash != rx->local[want])
        return fail(why, wn, "block %u: hash %016llx is not the prompt's", want,
                    (unsigned long long)b->seq_hash);
    if (rx->ipc) {
        /* an offset in the prefill side's pool: a whole block inside it */
        if (b->checksum % rx->block_bytes != 0
            || b->checksum > rx->pool.pool_bytes - rx->block_bytes)
            return fail(why, wn, "block %u: offset %llu is not a block of the %llu-byte pool",
                        want, (unsigned long long)b->checksum,
                        (unsigned long long)rx->pool.pool_bytes);
        *payload = NULL;
    } else {
        if (b->checksum != kvx_checksum(data, (size_t)rx->block_bytes))
            return fail(why, wn, "block %llu: payload checksum mismatch",
                        (unsigned long long)want);
        *payload = data;
    }
    if (++rx->got == rx->count)
        rx->state = 2;
    return KVX_BLOCK;
}

int64_t kvx_rx_next_block(const kvx_rx_t *rx)
{
    return rx->state == 1 ? (int64_t)rx->first + rx->got : -1;
}

kvx_rx_ev_t kvx_rx_block(kvx_rx_t *rx, const uint8_t hdr[KVX_BLK_LEN], const uint8_t *payload,
                         kvx_block_t *blk, char *why, size_t whylen)
{
    const uint8_t *out;

    if (rx->state != 1 || rx->ipc)
        return fail(why, whylen, "no block frame of the byte stream is due");
    if (rx->block_bytes > KVX_MAX_BLOCK_BYTES)
        return fail(why, whylen, "block payload of %llu bytes is over the %u limit",
                    (unsigned long long)rx->block_bytes, KVX_MAX_BLOCK_BYTES);
    return read_block(rx, hdr, payload, blk, &out, why, whylen);
}

kvx_rx_ev_t kvx_rx_feed(kvx_rx_t *rx, const uint8_t *buf, size_t len, size_t *used,
                        kvx_block_t *blk, const uint8_t **payload, char *why, size_t whylen)
{
    size_t need = kvx_rx_need(rx);

    *used = 0;
    if (rx->state == 3)
        return fail(why, whylen, "%llu bytes after the end of the transfer",
                    (unsigned long long)len);
    if (rx->state == 1 && rx->block_bytes > KVX_MAX_BLOCK_BYTES)
        return fail(why, whylen, "block payload of %llu bytes is over the %u limit",
                    (unsigned long long)rx->block_bytes, KVX_MAX_BLOCK_BYTES);
    if (len < need)
        return KVX_MORE;
    *used = need;
    if (rx->state == 0)
        return read_header(rx, buf, why, whylen);
    if (rx->state == 5)
        return read_token(rx, buf, why, whylen);
    if (rx->state == 4)
        return read_ipc(rx, buf, why, whylen);
    if (rx->state == 1)
        return read_block(rx, buf, buf + KVX_BLK_LEN, blk, payload, why, whylen);
    if (memcmp(buf, "KVXE", 4) != 0 || get64(buf + 8) != XXH3_64bits(buf, 8))
        return fail(why, whylen, "bad end frame after %llu blocks", (unsigned long long)rx->got);
    if (get32(buf + 4) != rx->count)
        return fail(why, whylen, "end frame counts %u blocks, %u were sent", get32(buf + 4),
                    rx->got);
    rx->state = 3;
    return KVX_DONE;
}
