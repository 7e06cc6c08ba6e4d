/*
 * ZMQ ingestion: keeps a kv_index and a kv_registry in step with vLLM /
 * SGLang KV event publishers (kv_vllm_event.h for the format, docs/PROTOCOL.md
 * for the whole contract), one publisher per upstream server.
 *
 * Per publisher: a SUB socket on the PUB endpoint, a DEALER on the
 * optional ROUTER replay endpoint, and a monitor that tells when the
 * publisher is reachable. One thread polls them all and is the index's only
 * writer for these workers (a zone fed by ZMQ has no NATS ingester).
 *
 * Hashes: kvroute recomputes its own local block hashes from each
 * BlockStored's token_ids (kv_hash.h, the LoRA seed for LoRA blocks) and
 * gives the index the engine's hashes as block ids, so the index chains
 * parents and applies BlockRemoved by the engine's ids.
 *
 * Sequence numbers (8-byte big-endian, from 0 per publisher process):
 *   next            applied
 *   a gap           replay from last + 1 (live messages held meanwhile and
 *                   applied after, in order, skipping what replay gave);
 *                   no replay endpoint, or replay failed: the worker's
 *                   blocks are cleared and ingestion goes on from here
 *   not above last  the engine restarted: the worker's blocks are cleared
 *   first seen > 0  (joined late) replay from 0: whatever the publisher's
 *                   buffer still holds
 * A replay of a stream we follow (after a gap, a reconnect or a reload) is
 * asked from the last applied seq itself: its first reply must be the
 * message we applied last, byte for byte (a fingerprint; a restarted engine
 * reuses the numbers, not the batches, whose ts differs). Anything else (a
 * restarted engine already past our seq, a buffer that no longer reaches
 * back) clears the worker, and the stream is replayed from 0. A reconnect
 * with no replay socket to ask cannot tell a blip from a restart: it clears.
 * A worker is LIVE in the registry only while its publisher is connected,
 * no replay runs and its block size matches; otherwise STALE (load only).
 *
 * Tiers (BlockStored/BlockRemoved medium): a block counts for routing while
 * any tier holds it (device, host or disk: reloading from host or disk is
 * far cheaper than recomputing); a removal from one tier drops it from the
 * index only when no other tier still holds it.
 */
#ifndef KV_ZMQ_H
#define KV_ZMQ_H

#include <stddef.h>
#include <stdint.h>

#include "kv_index.h"
#include "kv_registry.h"
#include "kv_vllm_event.h"

typedef struct kv_zmq kv_zmq_t;

typedef struct {
    const char *endpoint;       /* "tcp://h:p" (or ipc://...): the PUB socket */
    const char *replay;         /* the ROUTER replay socket, or NULL */
    const char *server;         /* "host:port" of the upstream server it serves */
    const char *topic;          /* subscription prefix; NULL or "": everything */
    uint32_t    block_size;     /* its upstream's, the router's; 0: the zone's below */
} kv_zmq_pub_config_t;

typedef struct {
    const kv_zmq_pub_config_t *pubs;
    size_t      n_pubs;
    uint32_t    block_size;         /* the router's, for publishers that name none;
                                       0: accept the engine's */
    uint32_t    replay_timeout_ms;  /* no end marker this long: failed; default 2000 */
    uint32_t    hold_messages;      /* live messages held during a replay; default 100000 */
    int         verbose;            /* log progress, not just trouble, to stderr */
    /* Optional: every batch applied, in sequence order, after the index
     * took it (b), and every time a publisher's worker is cleared for a
     * restart or an unrecoverable gap (b NULL). Runs on kv_zmq's thread.
     * tools/kvrelay republishes from here. */
    void      (*sink)(void *arg, size_t pub, const kv_vllm_batch_t *b);
    void       *sink_arg;
    /* Optional: the index dropped blocks of worker_id on the engine's word
     * (their sequence hashes; n 0: all of them), as kv_ingest's on_drop:
     * the router's own guesses for that worker must go too. Runs on
     * kv_zmq's thread, before the index forgets them. */
    void      (*on_drop)(void *arg, uint64_t worker_id, const uint64_t *seq, size_t n);
    void       *on_drop_arg;
} kv_zmq_config_t;

typedef struct {
    int         connected;
    int         replaying;
    int         have_seq;
    uint64_t    last_seq;
    uint32_t    engine_block_size;  /* learned from BlockStored; 0 until then */
    int         block_size_mismatch;
    uint64_t    messages, events, malformed, gaps, replays, replay_failures,
                restarts, apply_errors, unresolved,
                other_groups;       /* events of a hybrid model's other KV cache groups */
} kv_zmq_pub_stats_t;

kv_zmq_t *kv_zmq_create(const kv_zmq_config_t *cfg, kv_index_t *ix, kv_registry_t *reg,
                        char *err, size_t errlen);
/* Starts the polling thread; connects in the background, forever. */
int  kv_zmq_start(kv_zmq_t *z, char *err, size_t errlen);
/* Status upkeep; call every 50-250 ms. */
void kv_zmq_tick(kv_zmq_t *z, uint64_t now_ms);
void kv_zmq_stop(kv_zmq_t *z);
void kv_zmq_destroy(kv_zmq_t *z);

/* Without the thread (tests, benchmarks): one live message of publisher i. */
void kv_zmq_feed(kv_zmq_t *z, size_t i, uint64_t seq, const void *payload, size_t len,
                 uint64_t now_ms);
void kv_zmq_pub_stats(kv_zmq_t *z, size_t i, kv_zmq_pub_stats_t *out);

#endif
