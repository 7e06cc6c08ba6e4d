/*
 * The KV transfer's wire format (docs/PROTOCOL.md, "Disaggregated prefill:
 * the KV transfer"): what a prefill worker streams back to a decode worker
 * in answer to POST /kvroute/v1/prefill. Pure encode/decode, no I/O, so the
 * checks every block goes through on arrival are unit-tested on their own.
 *
 *   header   64 bytes   "KVX1", version, model and layout fingerprints,
 *                       block size, first block index, block count,
 *                       payload bytes per block, checksum of the header
 *   block    32 bytes + payload: "KVB1", index, sequence hash, local hash,
 *                       XXH3-64 of the payload; then block_bytes bytes in
 *                       the engine's layout (kvw_backend.h); none for the
 *                       mock, whose transfer is a manifest
 *   end      16 bytes   "KVXE", block count, checksum of the end frame
 *
 * With the first output token (flag KVX_F_TOKEN, only when the request asked
 * for it and the prefill side sampled it): a token frame follows the header
 * (24 bytes: "KVT1", the token, the sampler's state after it, checksum), so
 * the decode side can send the client that token as soon as the KV is in.
 *
 * With CUDA IPC (flag KVX_F_IPC in the header, only when the request offered
 * it): an IPC frame follows the header (and the token frame) (96 bytes: "KVI1", device, pool
 * bytes, the pool's cudaIpcMemHandle_t, checksum), and block frames carry no
 * payload: their last field is the block's byte offset in that pool, which
 * the decode side copies device to device.
 *
 * All integers little-endian.
 */
#ifndef KVW_XFER_WIRE_H
#define KVW_XFER_WIRE_H

#include <stddef.h>
#include <stdint.h>

#define KVX_VERSION     1
#define KVX_HDR_LEN     64
#define KVX_BLK_LEN     32
#define KVX_END_LEN     16
#define KVX_IPC_LEN     96
#define KVX_IPC_HANDLE  64
#define KVX_TOK_LEN     24
#define KVX_F_IPC       1u      /* header flag: blocks are read from the prefill side's pool */
#define KVX_F_TOKEN     2u      /* header flag: a token frame follows (the first output token) */
#define KVX_PATH        "/kvroute/v1/prefill"
#define KVX_CTYPE       "application/x-kvroute-kv"
/* a block's payload is refused above this (a corrupt length must not allocate 4 GB) */
#define KVX_MAX_BLOCK_BYTES (256u << 20)

typedef struct {
    uint32_t    version;
    uint64_t    model_fp;           /* kvx_model_fp */
    uint64_t    layout_fp;          /* kvx_layout_fp */
    uint32_t    block_size;         /* tokens per block */
    uint32_t    first;              /* index in the prompt of the first block sent */
    uint32_t    count;              /* blocks that follow */
    uint32_t    flags;              /* KVX_F_IPC, KVX_F_TOKEN or 0 */
    uint64_t    block_bytes;        /* payload bytes per block (0: a manifest) */
    uint64_t    kv_bytes_per_token; /* the mock's modelled KV size (0 for real engines) */
} kvx_header_t;

typedef struct {
    uint32_t    index;
    uint64_t    seq_hash, local_hash;
    uint64_t    checksum;           /* XXH3-64 of the payload (0 when empty); with
                                       KVX_F_IPC, the block's byte offset in the pool */
} kvx_block_t;

/* The prefill side's pool, exported for CUDA IPC. */
typedef struct {
    uint32_t    device;             /* the prefill side's CUDA device ordinal */
    uint64_t    pool_bytes;         /* size of the exported allocation */
    uint8_t     handle[KVX_IPC_HANDLE];
} kvx_ipc_t;

/* The first output token, sampled where the prompt was prefilled. */
typedef struct {
    uint32_t    token;
    uint64_t    rng;                /* the sampler's state after drawing it */
} kvx_token_t;

/* Identity of the model's KV: the served name and vocabulary size. */
uint64_t kvx_model_fp(const char *model, uint32_t vocab_size);
/* Identity of the block layout: block size, bytes per block, modelled bytes per token. */
uint64_t kvx_layout_fp(uint32_t block_size, uint64_t block_bytes, uint64_t kv_bytes_per_token);
uint64_t kvx_checksum(const void *p, size_t n);

void kvx_header_encode(const kvx_header_t *h, uint8_t out[KVX_HDR_LEN]);
void kvx_block_encode(const kvx_block_t *b, uint8_t out[KVX_BLK_LEN]);
void kvx_end_encode(uint32_t count, uint8_t out[KVX_END_LEN]);
void kvx_ipc_encode(const kvx_ipc_t *ipc, uint8_t out[KVX_IPC_LEN]);
void kvx_token_encode(const kvx_token_t *t, uint8_t out[KVX_TOK_LEN]);

/*
 * The receiving side: what it expects, then frames fed in as they arrive.
 * Every check failure names its reason; nothing is handed out before its
 * checks passed (a block's payload is checksummed before it is returned).
 */
typedef struct {
    /* expectations, set by the receiver */
    uint64_t        model_fp, layout_fp, block_bytes;
    uint32_t        block_size, first, count;
    const uint64_t *seq, *local;    /* the prompt's own hashes, indexed by block */
    int             ipc_offered;    /* the request offered CUDA IPC: KVX_F_IPC is acceptable */
    int             token_asked;    /* the request asked for the first token: KVX_F_TOKEN is */
    /* state */
    int             state;          /* 0 header, 5 token, 4 IPC frame, 1 blocks, 2 end, 3 done */
    int             has_token;      /* the token frame arrived and passed its check */
    kvx_token_t     token;
    int             ipc;            /* the header chose IPC: blocks carry offsets, no payload */
    kvx_ipc_t       pool;           /* with ipc: the prefill side's pool */
    uint32_t        got;
    kvx_header_t    hdr;
} kvx_rx_t;

typedef enum { KVX_MORE, KVX_HEADER, KVX_TOKEN, KVX_IPC, KVX_BLOCK, KVX_DONE, KVX_ERROR } kvx_rx_ev_t;

/*
 * Reads at most one frame from buf[0..len). *used gets the bytes it took
 * (0 with KVX_MORE: feed it more). KVX_BLOCK: *blk and *payload (inside buf,
 * block_bytes long) are the verified block (with IPC: *payload is NULL and
 * blk->checksum the verified offset in rx->pool). KVX_TOKEN: rx->token is
 * the first output token (rx->has_token). KVX_IPC: rx->pool is the
 * prefill side's exported pool. KVX_ERROR: why says what.
 */
kvx_rx_ev_t kvx_rx_feed(kvx_rx_t *rx, const uint8_t *buf, size_t len, size_t *used,
                        kvx_block_t *blk, const uint8_t **payload, char *why, size_t whylen);

/*
 * The same check of a block frame whose payload is elsewhere (received
 * straight into the block it is meant for): hdr is the frame's 32 bytes,
 * payload block_bytes. KVX_BLOCK or KVX_ERROR; only while a block frame of
 * the byte stream is due (kvx_rx_next_block says which block that is).
 */
kvx_rx_ev_t kvx_rx_block(kvx_rx_t *rx, const uint8_t hdr[KVX_BLK_LEN], const uint8_t *payload,
                         kvx_block_t *blk, char *why, size_t whylen);
/* The prompt index of the block frame due next, or -1 if none is. */
int64_t kvx_rx_next_block(const kvx_rx_t *rx);

/* Bytes the next frame needs in one piece (to pull up a buffer). */
size_t kvx_rx_need(const kvx_rx_t *rx);

#endif
