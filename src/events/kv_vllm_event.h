/*
 * vLLM / SGLang KV cache events as their ZMQ publishers send them
 * (vllm/distributed/kv_events.py; SGLang reuses the schema). One ZMQ
 * message is three frames: topic, an 8-byte big-endian sequence number,
 * and a msgpack KVEventBatch. msgspec writes it in one of two forms, and
 * omits trailing fields left at their defaults in both:
 *
 *   [ts: float, events: [event...], data_parallel_rank: int|nil]   (array)
 *   {"ts": ..., "events": [...], "data_parallel_rank": ...}        (map)
 *
 * An event is a tagged array, the tag first, or a map with the tag under
 * "type" (vLLM's newer events):
 *
 *   ["BlockStored", block_hashes: [hash], parent_block_hash: hash|nil,
 *    token_ids: [int], block_size: int, lora_id: int|nil (SGLang and
 *    vLLM 0.9 stop here), medium: str|nil, lora_name: str|nil,
 *    extra_keys, group_idx: int|nil, kv_cache_spec_kind: str|nil, ...]
 *   ["BlockRemoved", block_hashes: [hash], medium: str|nil, group_idx, ...]
 *   ["AllBlocksCleared", ...]
 *
 * group_idx names the KV cache group of a hybrid model (full attention,
 * sliding window, mamba ...); kv_zmq keeps the one that holds prefixes.
 *
 * A hash is an int (older vLLM: Python hash(), signed 64-bit) or bytes
 * (newer vLLM: a SHA-256 digest). Both become one uint64_t: an int is
 * bit-cast, bytes are XXH3-64 of the bytes; only equality matters.
 *
 * The decoder is pure: no sockets, no index. Malformed input fails the
 * whole batch with a reason and leaves it empty, so nothing is applied
 * from a bad message. Unknown event tags are skipped and counted.
 */
#ifndef KV_VLLM_EVENT_H
#define KV_VLLM_EVENT_H

#include <stddef.h>
#include <stdint.h>


typedef enum {
    KV_VLLM_STORED = 1,
    KV_VLLM_REMOVED,
    KV_VLLM_CLEARED
} kv_vllm_kind_t;

/* Storage tiers by the event's medium. */
typedef enum {
    KV_TIER_DEVICE = 0,     /* nil, "GPU", "cuda", "device", "hbm" */
    KV_TIER_HOST,           /* "CPU", "host", "cpu_pinned", "dram" */
    KV_TIER_DISK            /* anything else ("DISK", "ssd", "remote" ...) */
} kv_tier_t;

typedef struct {
    kv_vllm_kind_t  kind;
    uint32_t        tier;           /* kv_tier_t */
    const uint64_t *hashes;         /* engine block hashes */
    size_t          n_hashes;
    int             has_parent;
    uint64_t        parent;
    const uint32_t *tokens;         /* stored: n_hashes * block_size, or none */
    size_t          n_tokens;
    uint32_t        block_size;     /* stored */
    int             has_lora_id;
    int64_t         lora_id;
    const char     *lora_name;      /* into the input; NULL if absent */
    size_t          lora_name_len;
    int             has_group;
    uint32_t        group_idx;      /* the KV cache group (hybrid models) */
    const char     *spec_kind;      /* the group's kind, e.g. "full_attention";
                                       into the input; NULL if absent */
    size_t          spec_kind_len;
    const char     *salt;           /* the first block's extra_keys' last str:
                                       the cache_salt (kv_vllm_salted); into
                                       the input; NULL if none */
    size_t          salt_len;
    int             salt_first;     /* it is that tuple's first item */
} kv_vllm_event_t;

typedef struct {
    double              ts;         /* publisher's unix time, seconds */
    int                 has_dp_rank;
    uint32_t            dp_rank;
    kv_vllm_event_t    *events;
    size_t              n_events;
    size_t              unknown;    /* events with a tag we do not know */

    /* decoder storage, reused across batches */
    size_t              cap_events;
    uint64_t           *hashes;
    size_t              n_h, cap_h;
    uint32_t           *tokens;
    size_t              n_t, cap_t;
} kv_vllm_batch_t;

void kv_vllm_batch_init(kv_vllm_batch_t *b);
void kv_vllm_batch_free(kv_vllm_batch_t *b);

/* Decodes one KVEventBatch payload: 0, or -1 with a reason (batch empty). */
int kv_vllm_decode(kv_vllm_batch_t *b, const void *buf, size_t len,
                   char *err, size_t errlen);

/* The tier a medium string names (NULL: device). */
kv_tier_t kv_vllm_tier(const char *medium, size_t len);

/* The 8-byte big-endian sequence frame; -1 if it is not 8 bytes. */
int kv_vllm_seq(const void *frame, size_t len, uint64_t *seq);

/* Whether a stored event's KV cache group keeps every block of a prefix
 * (kv_cache_spec_kind full, MLA or sink attention), unlike a sliding-window
 * or mamba group. */
int kv_vllm_full_attention(const kv_vllm_event_t *e);

/* Whether a stored event starts a prompt salted with a cache_salt (e->salt),
 * rather than naming only its LoRA adapter. */
int kv_vllm_salted(const kv_vllm_event_t *e);

/* The local-hash seed for a stored event's LoRA adapter: the name when
 * given, else "lora-<id>", else the base model's seed (kv_hash.h). */
uint64_t kv_vllm_lora_seed(const kv_vllm_event_t *e);

#endif
