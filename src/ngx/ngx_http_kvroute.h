
/*
 * Copyright (C) kvroute authors
 *
 * Shared declarations of ngx_http_kvroute_module's files: the shared zone,
 * the upstream configuration, and the per-request context.
 */


#ifndef _NGX_HTTP_KVROUTE_H_INCLUDED_
#define _NGX_HTTP_KVROUTE_H_INCLUDED_


#include <ngx_config.h>
#include <ngx_core.h>
#include <ngx_http.h>

/* the precontent phase, where prompts are read and prepared, came in 1.13.4 */
#if (nginx_version < 1013004)
#error "ngx_http_kvroute_module needs nginx 1.13.4 or newer"
#endif

#include "kv_body.h"
#include "kv_chat.h"
#include "kv_dring.h"
#include "kv_index.h"
#include "kv_load.h"
#include "kv_preamble.h"
#include "kv_prefill.h"
#include "kv_registry.h"
#include "kv_respid.h"
#include "kv_respmap.h"
#include "kv_retain.h"
#include "kv_ring.h"
#include "kv_route.h"
#include "kv_sse.h"
#include "kv_tokenizer.h"
#include "kv_turn.h"
#include "kv_usage.h"


#define NGX_HTTP_KVROUTE_MAX_ROWS      128
#define NGX_HTTP_KVROUTE_ROWS_BYTES    (32 * 1024 * 1024)   /* load rows' memory */
/* upstreams with more primaries score candidates (candidates.c), not all */
#define NGX_HTTP_KVROUTE_SCAN_ALL      64
#define NGX_HTTP_KVROUTE_LEAST         8          /* least-loaded candidates */
#define NGX_HTTP_KVROUTE_RING          4          /* cold-placement candidates */
#define NGX_HTTP_KVROUTE_HIST          12
/* the decision-time histogram's bounds (µs), then +Inf: NGX_HTTP_KVROUTE_HIST */
#define NGX_HTTP_KVROUTE_HIST_BOUNDS   5, 10, 25, 50, 100, 250, 500, 1000,    \
                                       2500, 10000, 100000
#define NGX_HTTP_KVROUTE_PENDING_TTL   10000      /* ms */


/*
 * Why a request was routed by load alone, in one table: the enum's name,
 * the name $kvroute_fallback and the status show, and the kv_prompt status
 * it comes from (-1: not from kv_prompt).
 */
#define NGX_HTTP_KVROUTE_FALLBACKS(X)                                         \
    X(NONE,         "",                 KV_PROMPT_OK)                         \
    X(NO_ZONE,      "no_zone",          -1)  /* kvroute without zone= */      \
    X(NO_BODY,      "no_body",          -1)                                   \
    X(UNBUFFERED,   "unbuffered_body",  -1)                                   \
    X(BODY_READ,    "body_read_error",  -1)                                   \
    X(PARSE,        "parse_error",      KV_PROMPT_PARSE)                      \
    X(NO_PROMPT,    "no_prompt",        KV_PROMPT_NO_PROMPT)                  \
    X(NO_TOKENIZER, "no_tokenizer",     KV_PROMPT_NO_TOKENIZER)               \
    X(NO_TEMPLATE,  "no_chat_template", KV_PROMPT_NO_TEMPLATE)                \
    X(TEMPLATE,     "template_error",   KV_PROMPT_TEMPLATE)                   \
    X(TOKENIZE,     "tokenize_error",   KV_PROMPT_TOKENIZE)                   \
    X(MODEL,        "unknown_model",    KV_PROMPT_MODEL)                      \
    X(NO_MEMORY,    "no_memory",        KV_PROMPT_NO_MEMORY)                  \
    X(ALL_BUSY,     "all_busy",         -1)                                   \
    X(PROMPT_CAPPED, "prompt_capped",   -1)  /* routed on max_tokenize bytes */ \
    X(TOKENIZE_WAIT, "tokenize_wait",   -1)  /* queued past tokenize_wait */


#define NGX_HTTP_KVROUTE_FB_ENUM(name, str, prompt)  NGX_HTTP_KVROUTE_FB_##name,

typedef enum {
    NGX_HTTP_KVROUTE_FALLBACKS(NGX_HTTP_KVROUTE_FB_ENUM)
    NGX_HTTP_KVROUTE_FB_N
} ngx_http_kvroute_fallback_e;


/* The head of a kvroute_zone: everything nginx workers share. */
typedef struct {
    uint64_t                        magic;
    ngx_atomic_t                    requests;
    ngx_atomic_t                    decisions;
    ngx_atomic_t                    busy_rejects;
    ngx_atomic_t                    threaded;   /* prompts prepared in the thread pool */
    ngx_atomic_t                    threaded_cancelled; /* dropped: the client went away */
    ngx_atomic_t                    tokenize_interrupted;   /* stopped mid-way: it went */
    ngx_atomic_t                    tokenize_queued;    /* waiting in kvroute's queues now */
    ngx_atomic_t                    tokenize_bytes;     /* body bytes in the pools now */
    ngx_atomic_t                    tokenize_bytes_peak;    /* most in one worker's pool */
    ngx_atomic_t                    fallbacks[NGX_HTTP_KVROUTE_FB_N];
    ngx_atomic_t                    hist[NGX_HTTP_KVROUTE_HIST];
    ngx_atomic_t                    decision_us_sum;
    ngx_uint_t                      approximate;
    ngx_uint_t                      max_workers;
    void                           *load_region;
    void                           *index_region;
    size_t                          index_size;
    void                           *registry_region;
    void                           *pending_region;
    size_t                          pending_size;
    kv_index_t                     *pending;    /* events mode: the router's own recent
                                                   decisions, until events confirm them */
    kv_load_t                      *load;
    kv_index_t                     *index;
    kv_registry_t                  *registry;   /* workers and helper status */
    void                           *turn_region;
    size_t                          turn_size;
    kv_tcache_t                    *turns;      /* turn-delta tokenization, or NULL */
    void                           *share_region;
    size_t                          share_size;
    kv_dring_t                     *share;      /* kvroute_share's ring, or NULL */
    kv_retain_t                     retain;     /* approximate mode: what the
                                                   engines kept (kv_retain.h) */
    ngx_msec_t                      retain_ms;  /* its last step, any process */
    void                           *resp_region;
    size_t                          resp_size;
    kv_respmap_t                   *responses;  /* response id -> the server
                                                   that made it, or NULL */
} ngx_http_kvroute_sh_t;


typedef struct {
    ngx_str_t                       name;
    ngx_shm_zone_t                 *shm_zone;
    ngx_http_kvroute_sh_t          *sh;
    ngx_slab_pool_t                *shpool;         /* its mutex: approximate-mode writers */
    int                             row;            /* this process's kv_load row */
    ngx_uint_t                      approximate;    /* no kvroute_events feeds it */
    ngx_uint_t                      max_workers;
    ngx_msec_t                      ttl;
    int                             ttl_learn;      /* ttl_learn=on: ttl is a cap
                                                       (off by default) */
    size_t                          size;           /* declared */
    ngx_uint_t                      load_servers;   /* the load table's shape, */
    ngx_uint_t                      load_rows;      /* from the configuration */
    ngx_uint_t                      load_groups;
    ssize_t                         turn_size;      /* turn_cache=, -1: default */
    ngx_uint_t                      turn_default;   /* turn_cache= not given */
    ngx_msec_t                      turn_ttl;       /* turn_cache_ttl= */
    ngx_uint_t                      responses;      /* responses=N: ids kept */
    ngx_uint_t                      resp_default;   /* responses= not given */
    ngx_array_t                     upstreams;      /* ngx_http_kvroute_srv_conf_t * */
    void                           *events_conf;    /* kvroute_events for this zone */
    void                           *share_conf;     /* kvroute_share for this zone */
    ngx_str_t                       ref_file;       /* where it was first named */
    ngx_uint_t                      ref_line;
    ngx_str_t                       decl_file;      /* its kvroute_zone line */
    ngx_uint_t                      decl_line;

    /* per process: event rates over the last second, for the status */
    uint64_t                        rate_ms;
    uint64_t                        rate_events;
    uint64_t                        rate_blocks;
    double                          events_per_s;
    double                          blocks_per_s;
} ngx_http_kvroute_zone_t;


typedef struct {
    uint64_t                        worker_id;
    ngx_str_t                       address;
} ngx_http_kvroute_worker_map_t;


/* One upstream server as kvroute sees it. */
typedef struct {
    ngx_http_upstream_rr_peer_t    *peer;       /* this cycle's, in the peers list */
    ngx_str_t                       server;     /* as written in the config */
    uint64_t                        worker_id;
    uint64_t                        mapped_id;  /* its id in kcf->by_id and the ring */
    ngx_uint_t                      explicit_id;    /* from kvroute_worker_id */
    ngx_uint_t                      backup;
    ngx_uint_t                      index;      /* position in its rr list */
    ngx_int_t                       load;       /* kv_load server index, -1 if none */
    ngx_int_t                       reg;        /* registry record last seen for it */
    ngx_msec_t                      reg_miss;   /* when a lookup last found none */
    uint32_t                        reg_records;    /* the registry's records then */
    ngx_int_t                       slot;       /* index slot last seen for it */
    ngx_uint_t                      block_size_logged;  /* a mismatch, logged */
} ngx_http_kvroute_peer_t;


typedef struct ngx_http_kvroute_srv_conf_s  ngx_http_kvroute_srv_conf_t;

struct ngx_http_kvroute_srv_conf_s {
    ngx_http_kvroute_zone_t        *zone;
    ngx_str_t                       upstream_name;
    ngx_uint_t                      block_size;
    kv_tokenizer_t                 *tokenizer;
    kv_tok_bounds_t                *bounds;     /* the tokenizer's cut tokens */
    kv_turn_t                       turn;       /* set in the worker, on first use */
    kv_chat_template_t             *template;
    int                             chat_engine;    /* kv_chat_engine_t: whose
                                                       rendering rules */
    ngx_str_t                       chat_kwargs;    /* default kwargs, JSON */
    ngx_str_t                       model;          /* a,b: the model and aliases
                                                       (NUL-terminated; data NULL
                                                       when unset, as lora) */
    ngx_str_t                      *models;         /* a, b (for kvroute_models) */
    ngx_uint_t                      nmodels;
    ngx_str_t                       lora;           /* "*" or a,b,c; "" none */
    ngx_str_t                      *loras;          /* a, b, c */
    ngx_uint_t                      nloras;
    kv_route_config_t               route;
    int                             mode;           /* 0 events, 1 approximate, -1 unset;
                                                       checked in init_upstream, once
                                                       every kvroute_events is read */
    ngx_uint_t                      retry_after;
    size_t                          thread_threshold;
    size_t                          max_tokenize;       /* bytes; 0: no cap */
#if (NGX_THREADS)
    ngx_thread_pool_t              *thread_pool;
#endif
    size_t                          tokenize_budget;    /* bytes in the pool; 0: any */
    ngx_msec_t                      tokenize_wait;      /* in the queue; 0: no bound */
    /* this worker process's tokenization queue (prompt.c), set on first use */
    ngx_queue_t                     tq;
    size_t                          tq_bytes;           /* bodies in the pool now */
    ngx_atomic_t                    tq_posted;          /* tasks posted, ever */
    ngx_atomic_t                    tq_started;         /* ... a thread took (atomic) */
    ngx_event_t                     tq_retry;           /* pumps while one waits */
    ngx_http_complex_value_t       *salt;
    ngx_http_complex_value_t       *session;    /* session=VALUE, or NULL */
    ngx_uint_t                      session_off;    /* session=off */
    ngx_array_t                     worker_ids;     /* ngx_http_kvroute_worker_map_t */
    ngx_http_upstream_init_pt       original_init_upstream;

    /* disaggregated serving (prefill=): this upstream's servers decode, the
     * named upstream's prefill (ngx_http_kvroute_prefill.c) */
    ngx_str_t                       prefill_name;
    ngx_http_kvroute_srv_conf_t    *prefill;
    kv_prefill_config_t             prefill_cfg;
    double                          prefill_link_gbps;  /* 0: transfer learned */
    uint64_t                        prefill_kv_bytes;   /* KV bytes per token */
    ngx_uint_t                      group;      /* its primaries' in the load order */

    /* resolved in each worker process (the upstream zone moves peers) */
    ngx_http_upstream_srv_conf_t   *uscf;
    ngx_http_kvroute_peer_t        *peers;      /* primaries, then backups */
    ngx_uint_t                      npeers;
    ngx_uint_t                      nprimary;

    /* candidates.c: primaries by load table index and by worker id, and
     * the cold-placement ring */
    ngx_int_t                      *by_load;    /* kv_load index -> primary, -1 */
    ngx_uint_t                      nby_load;
    ngx_int_t                      *by_id;      /* open addressing: primary + 1 */
    ngx_uint_t                      id_mask;
    uint64_t                       *slot_ids;   /* index slot -> worker id this
                                                   process mapped there, 0 */
    ngx_uint_t                      nslot_ids;
    uint64_t                        slots_gen;  /* the index's slot changes
                                                   mapped (kv_index_slots_changed) */
    ngx_uint_t                      slots_read; /* 0: remap every slot */
    kv_ring_point_t                *ring;
    size_t                          nring;
};


/* A primary server the decision considers, with what it holds of the
 * prompt (candidates.c). */
typedef struct {
    ngx_uint_t                      k;          /* index in kcf->peers */
    uint32_t                        overlap;    /* the index's */
    uint32_t                        pending;    /* the recent decisions' */
} ngx_http_kvroute_cand_t;


/* A request's routing state; lives in r->pool. */
typedef struct {
    ngx_http_kvroute_srv_conf_t    *conf;
    ngx_int_t                       status;     /* precontent: re-entry result */
    unsigned                        prepared:1;
    unsigned                        matched:1;
    unsigned                        prefill_open:1;
    unsigned                        active:1;   /* an attempt holds load */
    unsigned                        stream:1;   /* the body asks for a stream */
    unsigned                        usage_on:1; /* self-check: scanning the response */
    unsigned                        prefill_active:1;   /* the prefill peer's load held */
    unsigned                        prefill_remote:1;   /* this attempt prefills remotely */
    unsigned                        no_model:1;     /* no listed upstream serves it: 404 */
    unsigned                        prefill_only:1; /* nothing decoded (kv_api.h) */
    unsigned                        preamble:1;     /* a stream with events before its
                                                       first token (kv_preamble.h) */
    unsigned                        answered_ok:1;  /* the response is a 200: its
                                                       times are rate samples */
    unsigned                        responses:1;    /* a Responses API request */
    unsigned                        home_read:1;    /* home looked up */
    unsigned                        respid_on:1;    /* scanning for the response's id */

    ngx_http_kvroute_fallback_e     fallback;
    ngx_uint_t                      salt_status;    /* salt= not applicable: refuse */
    uint64_t                       *seq;        /* sequence hashes (malloc) */
    size_t                          nseq;
    uint64_t                        prompt_tokens;
    uint64_t                        turn_cached_tokens;     /* from the turn cache */
    uint64_t                        max_tokens;     /* 0: the body names none */
    uint32_t                        sequences;      /* n / best_of, x a batch's
                                                       prompts; >= 1 */
    uint64_t                        batch_tokens;   /* a batch's other prompts */
    uint64_t                        session;        /* session key; 0: none */
    uint64_t                        prev_response;  /* previous_response_id's key */
    uint64_t                        home;       /* the worker id holding it; 0: none
                                                   or not known */
    ngx_http_kvroute_cand_t        *cand;       /* primaries holding part of the
                                                   prompt (all, in small upstreams) */
    ngx_uint_t                      ncand;
    ngx_msec_int_t                  decision_us;
    uint64_t                        t0_ns;

    /* the current attempt's accounting */
    ngx_int_t                       load;
    int64_t                         prefill_tokens;
    int64_t                         decode_blocks;
    int64_t                         decode_tokens;
    uint64_t                        queued_tokens;  /* prefill ahead of it */
    uint64_t                        open_ns;        /* sent to the server */
    uint64_t                        first_ns;       /* its first byte, 0: none yet */
    kv_route_why_t                  why;

    ngx_http_kvroute_peer_t        *chosen;
    uint32_t                        chosen_overlap;
    int64_t                         credit_age_ms;  /* approximate mode: how long
                                                       ago the deepest block credited
                                                       was recorded; -1: none */
    double                          chosen_cost;    /* the decision's estimate */

    kv_usage_scan_t                 usage;      /* the response's reported usage */
    kv_respid_scan_t               *respid;     /* its id (Responses API), or NULL */
    kv_preamble_t                   first;      /* where the first token is, when
                                                   preamble is set */
    kv_sse_count_t                  sse;        /* a stream's events: the tokens
                                                   it made, at most (kv_sse.h) */
    void                           *task;       /* its prompt, while in the thread pool */
    /* disaggregated: the current attempt's prefill decision */
    kv_prefill_why_t                prefill_why;
    uint32_t                       *prefill_overlap;    /* per prefill primary: index, */
    uint32_t                       *prefill_pending;    /* ... recent decisions */
    ngx_http_kvroute_peer_t        *prefill_peer;       /* NULL: local prefill */
    ngx_int_t                       prefill_load;
    uint32_t                        prefill_chosen_overlap;
    int64_t                         prefill_held;       /* its prefill tokens */
    uint64_t                        prefill_queued;
    uint64_t                        prefill_open_ns;
    double                          prefill_xfer_ms;    /* its transfer estimate */
    double                          prefill_remote_ms;  /* rule 4's TTFT estimates */
    double                          prefill_local_ms;   /* (stall left out); 0: none */
} ngx_http_kvroute_ctx_t;


typedef struct {
    ngx_http_upstream_rr_peer_data_t   rrp;     /* first: the rr get/free use it */
    ngx_http_request_t                *request;
    ngx_http_kvroute_srv_conf_t       *conf;
    ngx_http_kvroute_ctx_t            *ctx;
    ngx_buf_t                         *request_head;    /* the proxied request's head as
                                                           the proxy built it */
} ngx_http_kvroute_peer_data_t;


#define NGX_HTTP_KVROUTE_STATUS_ANY         1   /* JSON, ?format=prometheus */
#define NGX_HTTP_KVROUTE_STATUS_JSON        2
#define NGX_HTTP_KVROUTE_STATUS_PROMETHEUS  3

/* "kvroute_upstream NAME": resolved once the http block is parsed, since
 * the upstream may come after the location */

typedef struct {
    ngx_str_t                       name;
    u_char                         *file_name;
    ngx_uint_t                      line;
    ngx_http_kvroute_srv_conf_t    *conf;
    unsigned                        several:1;  /* one of a list: chosen by model */
    unsigned                        last:1;     /* the list's last */
    unsigned                        listed:1;   /* kvroute_models: needs model= */
} ngx_http_kvroute_upstream_ref_t;


typedef struct {
    ngx_flag_t                      debug_headers;
    ngx_uint_t                      status;     /* kvroute_status format */
    ngx_http_kvroute_upstream_ref_t  *upstream; /* kvroute_upstream, or NULL */
    ngx_array_t                    *choices;    /* its names when several: the
                                                   body's model picks (refs) */
    ngx_array_t                    *models;     /* kvroute_models (refs) */
    ngx_uint_t                      warned;     /* "no kvroute_upstream" logged
                                                   by this process */
} ngx_http_kvroute_loc_conf_t;


typedef struct {
    ngx_array_t                     zones;      /* ngx_http_kvroute_zone_t * */
    ngx_array_t                     upstreams;  /* ngx_http_kvroute_upstream_ref_t * */
} ngx_http_kvroute_main_conf_t;


extern ngx_module_t  ngx_http_kvroute_module;
extern const char   *ngx_http_kvroute_fallback_names[];
extern const uint64_t  ngx_http_kvroute_hist_le[NGX_HTTP_KVROUTE_HIST - 1];


/* directive parameters (ngx_http_kvroute_param.c) */
typedef enum {
    NGX_HTTP_KVROUTE_P_DOUBLE = 0,
    NGX_HTTP_KVROUTE_P_UINT,            /* ngx_uint_t */
    NGX_HTTP_KVROUTE_P_U64,             /* uint64_t */
    NGX_HTTP_KVROUTE_P_SIZE,            /* size_t, with k/m suffixes */
    NGX_HTTP_KVROUTE_P_MSEC,            /* ngx_msec_t, a time above 0 */
    NGX_HTTP_KVROUTE_P_MS32,            /* uint32_t ms, a time above 0 */
    NGX_HTTP_KVROUTE_P_ENUM             /* a C enum, one of names[] */
} ngx_http_kvroute_param_type_e;

typedef struct {
    ngx_str_t                       name;       /* with its "=" */
    ngx_http_kvroute_param_type_e   type;
    size_t                          offset;     /* of the field in the conf */
    double                          min;
    double                          max;
    ngx_conf_enum_t                *names;      /* P_ENUM */
} ngx_http_kvroute_param_t;

/* v is "lit..." with something after lit (lit ends with '='): value is
 * the rest */
#define ngx_http_kvroute_param_is(v, lit, value)                              \
    ngx_http_kvroute_param_match(v, (u_char *) lit, sizeof(lit) - 1, value)

/* the whole of s is lit */
#define ngx_http_kvroute_str_is(s, lit)                                       \
    ((s)->len == sizeof(lit) - 1                                              \
     && ngx_strncmp((s)->data, lit, sizeof(lit) - 1) == 0)

/* s starts with lit */
#define ngx_http_kvroute_has_prefix(s, lit)                                   \
    ((s)->len >= sizeof(lit) - 1                                              \
     && ngx_strncmp((s)->data, lit, sizeof(lit) - 1) == 0)

ngx_uint_t ngx_http_kvroute_param_match(ngx_str_t *v, u_char *name,
    size_t len, ngx_str_t *value);
ngx_int_t ngx_http_kvroute_param_set(ngx_conf_t *cf, const char *directive,
    ngx_http_kvroute_param_t *table, void *conf, ngx_str_t *v);
char *ngx_http_kvroute_param_cstr(ngx_conf_t *cf, ngx_str_t *s,
    const char **out);

/* helpers' paths (the cache manager process hosts them) */
char *ngx_http_kvroute_manager_path(ngx_conf_t *cf, const char *prefix,
    ngx_http_kvroute_zone_t *zone, ngx_str_t path, ngx_path_manager_pt manager,
    void *data, ngx_path_t **pp);

/* zone */
char *ngx_http_kvroute_zone_directive(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf);
ngx_http_kvroute_zone_t *ngx_http_kvroute_zone_find(ngx_conf_t *cf,
    ngx_str_t *name);
ngx_int_t ngx_http_kvroute_zone_size(ngx_conf_t *cf,
    ngx_http_kvroute_zone_t *zone);
void ngx_http_kvroute_zone_timer(ngx_http_kvroute_zone_t *zone);

/* events helper */
char *ngx_http_kvroute_events_directive(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf);
ngx_int_t ngx_http_kvroute_events_init_single(ngx_cycle_t *cycle,
    ngx_http_kvroute_zone_t *zone);
void ngx_http_kvroute_events_exit_single(ngx_http_kvroute_zone_t *zone);
ngx_uint_t ngx_http_kvroute_events_zmq(void *events_conf);
ngx_int_t ngx_http_kvroute_peer_record(ngx_http_kvroute_zone_t *zone,
    ngx_http_kvroute_peer_t *p, kv_worker_rec_t *rec);

/* shared decisions between instances (kvroute_share) */
char *ngx_http_kvroute_share_directive(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf);
size_t ngx_http_kvroute_share_size(ngx_http_kvroute_zone_t *zone);
ngx_int_t ngx_http_kvroute_share_zone(ngx_http_kvroute_zone_t *zone,
    ngx_slab_pool_t *shpool, ngx_log_t *log);
void ngx_http_kvroute_share_response(ngx_http_kvroute_zone_t *zone,
    uint64_t worker_id, uint64_t key);
void ngx_http_kvroute_share_push(ngx_http_kvroute_zone_t *zone,
    uint64_t worker_id, const uint64_t *seq, size_t from, size_t n);

/* balancer */
char *ngx_http_kvroute_directive(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf);
char *ngx_http_kvroute_worker_id(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf);
ngx_int_t ngx_http_kvroute_init_worker_peers(ngx_cycle_t *cycle,
    ngx_http_kvroute_srv_conf_t *kcf);
char *ngx_http_kvroute_upstream_directive(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf);
ngx_http_kvroute_srv_conf_t *ngx_http_kvroute_upstream_find(ngx_conf_t *cf,
    ngx_str_t *name);
ngx_int_t ngx_http_kvroute_upstream_resolve(ngx_conf_t *cf,
    ngx_http_kvroute_main_conf_t *kmcf);
ngx_http_kvroute_srv_conf_t *ngx_http_kvroute_upstream_of(
    ngx_http_request_t *r);
ngx_int_t ngx_http_kvroute_all_busy(ngx_http_kvroute_srv_conf_t *kcf,
    ngx_pool_t *pool);

/* prompt: body -> tokens -> block hashes */
ngx_int_t ngx_http_kvroute_precontent(ngx_http_request_t *r);
ngx_int_t ngx_http_kvroute_prepare(ngx_http_request_t *r,
    ngx_http_kvroute_ctx_t *ctx);
ngx_http_kvroute_ctx_t *ngx_http_kvroute_get_ctx(ngx_http_request_t *r,
    ngx_http_kvroute_srv_conf_t *kcf);

/* accounting */
void ngx_http_kvroute_acct_open(ngx_http_kvroute_ctx_t *ctx,
    ngx_http_kvroute_peer_t *p, const kv_route_result_t *res);
void ngx_http_kvroute_acct_learn_decode(ngx_http_kvroute_ctx_t *ctx);
void ngx_http_kvroute_acct_prefill_done(ngx_http_kvroute_ctx_t *ctx);
void ngx_http_kvroute_acct_close(ngx_http_kvroute_ctx_t *ctx);
uint64_t ngx_http_kvroute_now_ns(void);

/* disaggregated serving: the prefill decision and X-KVRoute-Prefill */
ngx_int_t ngx_http_kvroute_prefill_resolve(ngx_conf_t *cf,
    ngx_http_upstream_srv_conf_t *us, ngx_http_kvroute_srv_conf_t *kcf);
void ngx_http_kvroute_prefill_choose(ngx_http_request_t *r,
    ngx_http_kvroute_ctx_t *ctx, kv_route_result_t *res,
    const kv_route_server_t *d);
ngx_int_t ngx_http_kvroute_prefill_header(ngx_http_kvroute_peer_data_t *pd);
void ngx_http_kvroute_prefill_done(ngx_http_kvroute_ctx_t *ctx);
void ngx_http_kvroute_prefill_close(ngx_http_kvroute_ctx_t *ctx);

/* blocks the index holds for primary p, by its mapped slot (balancer.c) */
uint64_t ngx_http_kvroute_tree_blocks(ngx_http_kvroute_srv_conf_t *kcf,
    kv_index_t *ix, ngx_http_kvroute_peer_t *p);

/* the chosen server will hold the prompt's blocks (balancer.c) */
void ngx_http_kvroute_record(ngx_http_kvroute_srv_conf_t *kcf,
    ngx_http_kvroute_ctx_t *ctx, ngx_http_kvroute_peer_t *p,
    const kv_route_server_t *s);

/* misconfiguration checks */
ngx_int_t ngx_http_kvroute_check_order(ngx_conf_t *cf,
    ngx_http_upstream_srv_conf_t *uscf);
ngx_int_t ngx_http_kvroute_zone_undeclared(ngx_conf_t *cf,
    ngx_http_upstream_srv_conf_t *us, ngx_http_kvroute_zone_t *zone);
ngx_uint_t ngx_http_kvroute_worker_block_size(ngx_http_kvroute_srv_conf_t *kcf,
    ngx_http_kvroute_peer_t *p);
ngx_int_t ngx_http_kvroute_block_size_ok(ngx_http_kvroute_srv_conf_t *kcf,
    ngx_http_kvroute_peer_t *p, ngx_log_t *log);
void ngx_http_kvroute_block_size_check(ngx_http_kvroute_srv_conf_t *kcf,
    ngx_http_kvroute_cand_t *cand, ngx_uint_t n, ngx_log_t *log);

/* candidates */
ngx_int_t ngx_http_kvroute_candidates_init(ngx_cycle_t *cycle,
    ngx_http_kvroute_srv_conf_t *kcf);
void ngx_http_kvroute_candidates_refresh(ngx_http_kvroute_srv_conf_t *kcf);
void ngx_http_kvroute_candidates_slots(ngx_http_kvroute_srv_conf_t *kcf,
    kv_index_t *ix);
void ngx_http_kvroute_candidates_match(ngx_http_kvroute_srv_conf_t *kcf,
    ngx_http_kvroute_ctx_t *ctx, ngx_pool_t *pool, ngx_log_t *log);
ngx_int_t ngx_http_kvroute_peer_by_id(ngx_http_kvroute_srv_conf_t *kcf,
    uint64_t id);
ngx_http_kvroute_cand_t *ngx_http_kvroute_candidates(
    ngx_http_kvroute_srv_conf_t *kcf, ngx_http_kvroute_ctx_t *ctx,
    ngx_http_upstream_rr_peer_data_t *rrp, ngx_pool_t *pool,
    ngx_uint_t all, ngx_uint_t *n);

/* errors in the OpenAI shape */
ngx_int_t ngx_http_kvroute_busy(ngx_http_request_t *r, ngx_uint_t retry_after);
ngx_int_t ngx_http_kvroute_model_not_found(ngx_http_request_t *r);
ngx_int_t ngx_http_kvroute_send_json(ngx_http_request_t *r, ngx_uint_t status,
    ngx_str_t *body);

/* filters, variables, status */
ngx_int_t ngx_http_kvroute_filter_init(ngx_conf_t *cf);
ngx_int_t ngx_http_kvroute_add_variables(ngx_conf_t *cf);
ngx_http_kvroute_upstream_ref_t *ngx_http_kvroute_upstream_ref(ngx_conf_t *cf,
    ngx_str_t *name);
char *ngx_http_kvroute_models_directive(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf);
u_char *ngx_http_kvroute_json_strn(u_char *b, u_char *s, size_t len);
char *ngx_http_kvroute_status_directive(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf);


#endif /* _NGX_HTTP_KVROUTE_H_INCLUDED_ */
