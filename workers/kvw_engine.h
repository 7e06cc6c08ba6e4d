/*
 * The engine interface. One engine owns one KV cache and one scheduler; a
 * kvworker process hosts one or more (--engines N), all on one event loop.
 * Engines run on that loop: submit() and cancel() are called from it, and
 * engines call kvw_req_emit()/kvw_req_finish() from it.
 */
#ifndef KVW_ENGINE_H
#define KVW_ENGINE_H

#include <event2/event.h>

#include "kv_chat_request.h"
#include "kvw_req.h"

typedef struct kvw_config kvw_config_t;

typedef struct {
    const char *name;
    /* Takes ownership of nothing; r stays valid until kvw_req_finish. */
    int  (*submit)(kvw_engine_t *e, kvw_req_t *r);
    /* The client went away: drop r without calling kvw_req_finish. */
    void (*cancel)(kvw_engine_t *e, kvw_req_t *r);
    void (*destroy)(kvw_engine_t *e);
} kvw_engine_ops_t;

struct kvw_engine {
    const kvw_engine_ops_t *ops;
    const kvw_config_t     *cfg;
    struct event_base      *base;
    int                     index;      /* 0..engines-1 in this process */
    uint64_t                worker_id;
    int                     port;
    /* NULL while healthy; why not once the backend is lost for good (health fails, no heartbeats) */
    const char             *unhealthy;
};

struct kvw_config {
    const char *engine;         /* mock | cpu | cuda */
    const char *host;
    int         port;
    int         engines;
    const char *nats_url;       /* NULL: no events */
    uint64_t    worker_id;      /* 0: derived from host:port */
    const char *model;
    const char *lora_modules;   /* mock: adapter names served beside model, "a,b"; NULL */
    int         block_size;
    int         num_blocks;
    double      speedup;
    int         max_body;
    int         idle_timeout_s;         /* close idle/slow connections (60); 0: never */

    /* scheduler, defaults as Dynamo's mocker */
    int         max_num_seqs;           /* 256 */
    int         max_num_batched_tokens; /* 8192 */
    double      watermark;              /* 0.01: admission keeps this share of blocks free */
    int         enable_prefix_caching;  /* 1 */
    int         enable_chunked_prefill; /* 1 */
    int         max_model_len;          /* 0: no limit beyond the KV pool */
    int         device;                 /* cuda: --device N, the GPU to use (0) */

    /* mock timing */
    const char *perf_profile;           /* interpolated profile (JSON), NULL: polynomial */
    double      decode_speedup;         /* decode times are also divided by this (1) */

    /* text: src/text's tokenizer and chat template (kvw_text_hf.c) */
    const char *tokenizer;              /* --tokenizer FILE (tokenizer.json) */
    const char *model_dir;              /* cpu, cuda: --model DIR */
    const char *chat_template;          /* --chat-template FILE */
    kv_chat_engine_t chat_engine;       /* --chat-engine: whose rendering rules */
    const char *chat_kwargs;            /* --default-chat-template-kwargs JSON */
    const struct kvw_text *text;        /* NULL: byte-per-token stand-in */

    /* NATS */
    int         heartbeat_ms;           /* 1000 */
    const char *ns;                     /* "dynamo" */
    const char *component;              /* "backend" */
    int         nats_per_worker;        /* publish on P.kv-events.<id> and
                                           P.kvroute.heartbeat.<id> (docs/SECURITY.md) */
    int         load_ms;                /* 50; 0: load only in heartbeats; N: also a heartbeat
                                           when the load changed, at most one per N ms */

    int         stream_backlog_kb;      /* a stream this far behind its client is cut (32768) */
    int         responses_store;        /* Responses kept per engine (kvw_respstore.h); 0: off */

    /* disaggregated prefill/decode (kvw_xfer.h, docs/PROTOCOL.md) */
    int         role;                   /* KVW_ROLE_*: aggregated */
    int         disagg_min_tokens;      /* decode: prefill locally below this many uncached (512) */
    int         prefill_queue_limit;    /* prefill: refuse at this many queued prefills (16) */
    double      link_gbps;              /* mock: link the KV crosses, Gb/s (400: RDMA) */
    double      kv_bytes_per_token;     /* mock: modelled KV bytes per token (131072) */
    int         xfer_timeout_ms;        /* a transfer's deadline, either side (30000) */
    int         xfer_fault;             /* KVW_FAULT_*: testing only, off (none) by default */
    uint32_t    xfer_fault_at;          /* ... at the stream's block this many after the first */
};

/*
 * --xfer-fault KIND:N, for tests only: the prefill side of a transfer fails
 * on purpose once N block frames have been sent, so that the mid-stream
 * failure paths (the stream cut short, kvw_xfer_serve.c) can be driven by a
 * real process: "read" (the block's read from the pool fails), "alloc" (the
 * next window's buffer cannot be allocated), "stall" (nothing more is sent,
 * until the serve timeout cuts the stream).
 */
enum { KVW_FAULT_NONE = 0, KVW_FAULT_READ, KVW_FAULT_ALLOC, KVW_FAULT_STALL };

enum { KVW_ROLE_AGGREGATED = 0, KVW_ROLE_PREFILL, KVW_ROLE_DECODE };

/* The scheduler over the mock backend (kvw_sched.c, kvw_mock_model.c). */
kvw_engine_t *kvw_mock_create(const kvw_config_t *cfg, struct event_base *base,
                              int index);

/* Fills the defaults above into a zeroed config. */
void kvw_config_defaults(kvw_config_t *cfg);

#endif
