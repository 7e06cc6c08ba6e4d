/*
 * Disaggregated prefill and decode between kvworkers (docs/PROTOCOL.md,
 * "Disaggregated prefill"). A decode worker given `X-KVRoute-Prefill:
 * host:port` pulls the prompt's KV blocks it lacks from that prefill worker
 * over HTTP (POST /kvroute/v1/prefill, answered with the binary stream of
 * kvw_xfer_wire.h), then decodes as if they had been its own prefix cache.
 *
 *   kvw_xfer_serve.c   the prefill side: compute, pin, stream
 *   kvw_xfer_pull.c    the decode side: decide, allocate, receive, verify,
 *                      commit, or fall back to a local prefill
 */
#ifndef KVW_XFER_H
#define KVW_XFER_H

#include <event2/http.h>

#include "kvw_blocks.h"
#include "kvw_engine.h"
#include "kvw_xfer_wire.h"

#define KVW_HDR_PREFILL     "X-KVRoute-Prefill"
#define KVW_HDR_PREFILLED   "X-KVRoute-Prefilled-By"
#define KVW_HDR_FALLBACK    "X-KVRoute-Prefill-Fallback"

/* Per engine, in /metrics. */
typedef struct {
    /* prefill side */
    uint64_t    served, served_blocks, served_bytes, refused, overloaded;
    uint64_t    served_ipc;         /* of served: by CUDA IPC (offsets, no payload) */
    uint32_t    computing;          /* prefills computing for a transfer now */
    /* decode side */
    uint64_t    pulled, pulled_blocks, pulled_bytes, fallbacks, local;
    uint64_t    pulled_ipc;         /* of pulled: copied device to device by CUDA IPC */
    uint64_t    first_given;        /* of pulled: the first token came with the KV */
    uint64_t    ipc_fallbacks;      /* IPC failed (open, copy): pulled again as bytes */
    char        ipc_off[8][64];     /* prefill addresses whose IPC failed: not offered again */
    unsigned    n_ipc_off;
    double      link_s;             /* mock: modelled link time charged */
    double      pull_s;             /* wall time of successful pulls, request to verified */
} kvw_xfer_stats_t;

/* Answers POST /kvroute/v1/prefill on engine e. */
void kvw_xfer_serve(kvw_engine_t *e, kvw_xfer_stats_t *st, struct evhttp_request *req);

typedef struct kvw_pull kvw_pull_t;

/*
 * The end of a pull, called once, never from inside kvw_pull_start. pin:
 * the prompt's blocks, filled, verified and registered, to hand to
 * kvw_sched_submit_pinned (ownership passes), with first, the first output
 * token the prefill worker sampled (NULL if it sent none); pin NULL:
 * prefill locally, why says why.
 */
typedef void (*kvw_pull_done_fn)(void *arg, kvw_seq_blocks_t *pin, const kvx_token_t *first,
                                 const char *why);

/*
 * Starts pulling r's prompt blocks from the prefill worker at addr
 * (host:port). NULL when the decode worker should prefill locally at once
 * (*why says why: the uncached part is short, no free blocks, a bad
 * address...).
 */
kvw_pull_t *kvw_pull_start(kvw_engine_t *e, kvw_xfer_stats_t *st, const kvw_req_t *r,
                           const char *addr, kvw_pull_done_fn done, void *arg,
                           const char **why);

/* The client went away: stops the pull and frees everything; done is not called. */
void kvw_pull_cancel(kvw_pull_t *p);

/* The fingerprints this engine's KV carries (kvw_xfer_wire.h). */
uint64_t kvw_xfer_model_fp(kvw_engine_t *e);
uint64_t kvw_xfer_layout_fp(kvw_engine_t *e);
/* Bytes one block moves: its payload (real engines) or its modelled size (mock). */
double kvw_xfer_block_bytes(kvw_engine_t *e);

const char *kvw_role_name(int role);

/* This machine's identity for CUDA IPC (the boot id), "" if unknown. */
const char *kvw_xfer_node_id(void);

#endif
