/*
 * KV cache events: decoders for NVIDIA Dynamo's RouterEvent.
 *
 *   JSON, newer:  {"worker_id":u64,"storage_tier":"device","event":{"event_id":u64,
 *                  "data":{"stored":{"parent_hash":u64|null,"start_position":u32|null,
 *                  "blocks":[{"block_hash":u64,"tokens_hash":u64,"mm_extra_info":null}]}}
 *                  | {"removed":{"block_hashes":[u64]}} | "cleared", "dp_rank":u32}}
 *   JSON, older:  the same without storage_tier, start_position and dp_rank,
 *                 with a signed worker_id (and hashes possibly negative: bit-cast)
 *   MessagePack:  the envelope {publisher_id, sequence, published_at, topic,
 *                 payload: bin} whose payload is the RouterEvent as a msgpack
 *                 map with the same field names (rmp_serde::to_vec_named)
 *
 * A message may hold one event or a batch (a JSON array of events). Events
 * for a storage tier other than "device" are decoded and counted but left
 * out of the batch. Malformed input fails the whole message with a reason
 * and leaves the batch empty: nothing is applied from a bad message.
 */
#ifndef KV_EVENT_H
#define KV_EVENT_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
    KV_EVENT_STORED = 1,
    KV_EVENT_REMOVED,
    KV_EVENT_CLEARED
} kv_event_kind_t;

typedef struct {
    uint64_t            block_hash;     /* engine's opaque id: parent links, removals */
    uint64_t            tokens_hash;    /* local block hash the router matches on */
} kv_stored_block_t;

typedef struct {
    uint64_t            worker_id;
    uint32_t            dp_rank;
    uint64_t            event_id;
    kv_event_kind_t     kind;
    int                 has_parent;
    uint64_t            parent_hash;
    int                 has_start_position;
    uint32_t            start_position;
    const kv_stored_block_t *blocks;    /* stored */
    size_t              n_blocks;
    const uint64_t     *hashes;         /* removed */
    size_t              n_hashes;
} kv_event_t;

/*
 * Decoded events and the arrays they point into. Reused across messages:
 * a decode replaces the previous content; pointers stay valid until the
 * next decode or kv_event_batch_free.
 */
typedef struct {
    kv_event_t         *events;
    size_t              n_events;
    size_t              skipped_tier;   /* non-device events in this message */
    int                 has_envelope;   /* msgpack envelope fields below are set */
    uint64_t            publisher_id;
    uint64_t            sequence;
    uint64_t            published_at;   /* unix ms */
    void               *priv;           /* decoder-owned storage */
} kv_event_batch_t;

void kv_event_batch_init(kv_event_batch_t *b);
void kv_event_batch_free(kv_event_batch_t *b);

/* 0 on success; -1 with a reason in err (the batch is then empty). */
int kv_event_decode_json(kv_event_batch_t *b, const char *buf, size_t len,
                         char *err, size_t errlen);
int kv_event_decode_msgpack(kv_event_batch_t *b, const void *buf, size_t len,
                            char *err, size_t errlen);
/* Chooses by the first byte: '{' or '[' (after whitespace) is JSON. */
int kv_event_decode(kv_event_batch_t *b, const void *buf, size_t len,
                    char *err, size_t errlen);

#endif
