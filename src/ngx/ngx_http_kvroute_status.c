
/*
 * Copyright (C) kvroute authors
 *
 * kvroute_status: a snapshot of every kvroute zone as JSON, or as
 * Prometheus text ("kvroute_status prometheus;", or ?format=prometheus).
 *
 * Both writers are generated from the tables below (X-macros), so a field
 * is added once and appears in both, under its JSON key and its Prometheus
 * family. Each table row is
 *
 *     X(json key, kind, Prometheus name, Prometheus type, help)
 *
 * with kind S (string: a label of a gauge whose value is 1), B (boolean),
 * L (a string that is already one of the labels: 1 in Prometheus),
 * U (unsigned), I (signed), D (double) or M (milliseconds: an integer in
 * JSON, whose keys say _ms, and seconds in Prometheus, whose base unit they
 * are). A snapshot struct per table has a
 * member per row, named by its JSON key; a group's snapshots are taken
 * first, then written: JSON object by object, Prometheus family by family
 * (every sample of a family together, as the exposition formats require).
 */


#include "ngx_http_kvroute.h"
#include "kv_ingest.h"


/* the histogram's upper bounds in microseconds (+Inf after the last) */
const uint64_t  ngx_http_kvroute_hist_le[NGX_HTTP_KVROUTE_HIST - 1] = {
    NGX_HTTP_KVROUTE_HIST_BOUNDS
};


/* labels {zone} */
#define NGX_HTTP_KVROUTE_ZONE_STATS(X)                                        \
    X(mode, S, "kvroute_mode", gauge,                                         \
      "The zone's routing mode (label mode: events or approximate)")          \
    X(requests, U, "kvroute_requests_total", counter,                         \
      "Requests to a kvroute upstream")                                       \
    X(decisions, U, "kvroute_decisions_total", counter,                       \
      "Routing decisions taken")                                              \
    X(busy_rejects, U, "kvroute_busy_rejects_total", counter,                 \
      "Requests answered 503 because every server was busy")                  \
    X(threaded, U, "kvroute_threaded_total", counter,                         \
      "Prompts prepared in the thread pool")                                  \
    X(threaded_cancelled, U, "kvroute_threaded_cancelled_total", counter,     \
      "Prompts dropped from the thread pool unprepared: the client had gone") \
    X(tokenize_interrupted, U, "kvroute_tokenize_interrupted_total", counter, \
      "Prompts whose tokenizing stopped part way: the client had gone")       \
    X(tokenize_queued, U, "kvroute_tokenize_queued", gauge,                   \
      "Prompts waiting in kvroute's queue for the thread pool")               \
    X(tokenize_bytes, U, "kvroute_tokenize_bytes", gauge,                     \
      "Body bytes of prompts in the thread pool (all worker processes)")      \
    X(tokenize_bytes_peak, U, "kvroute_tokenize_bytes_peak", gauge,           \
      "Most body bytes one worker process has had in the thread pool")        \
    X(load_rows_reaped, U, "kvroute_load_rows_reaped_total", counter,         \
      "Load rows of exited nginx processes reclaimed")                        \
    X(ttl_samples, U, "kvroute_ttl_samples_total", counter,                   \
      "Responses whose cached tokens were checked against the blocks "        \
      "credited (approximate mode, ttl_learn)")

/* labels {zone}, JSON "index" */
#define NGX_HTTP_KVROUTE_INDEX_STATS(X)                                       \
    X(blocks, U, "kvroute_index_blocks", gauge,                               \
      "Blocks in the prefix index")                                           \
    X(capacity, U, "kvroute_index_capacity_blocks", gauge,                    \
      "Blocks the prefix index can hold")                                     \
    X(bytes, U, "kvroute_index_bytes", gauge,                                 \
      "Size of the prefix index region")                                      \
    X(workers, U, "kvroute_index_workers", gauge,                             \
      "Worker slots (worker, dp rank) in use in the index")                   \
    X(stored, U, "kvroute_index_stored_total", counter,                       \
      "Blocks stored by events or routing records")                           \
    X(removed, U, "kvroute_index_removed_total", counter,                     \
      "Blocks removed by events")                                             \
    X(cleared, U, "kvroute_index_cleared_total", counter,                     \
      "Cleared events and worker removals")                                   \
    X(evicted, U, "kvroute_index_evicted_total", counter,                     \
      "Blocks evicted for lack of space")                                     \
    X(expired, U, "kvroute_index_expired_total", counter,                     \
      "Blocks expired by the TTL (approximate mode)")                         \
    X(pruned, U, "kvroute_index_pruned_total", counter,                       \
      "Blocks pruned over the cap (approximate mode)")                        \
    X(ttl_ms, U, "kvroute_index_ttl_ms", gauge,                               \
      "How long a decision's blocks are believed (approximate mode): ttl=, "  \
      "or less where the engines' cached tokens show they keep less")         \
    X(unknown_parent, U, "kvroute_index_unknown_parent_total", counter,       \
      "Stores dropped because their parent block was not indexed")            \
    X(unknown_remove, U, "kvroute_index_unknown_remove_total", counter,       \
      "Removals of blocks that were not indexed")                             \
    X(lost_slots, U, "kvroute_index_lost_slots", gauge,                       \
      "Worker slots whose holes did not fit: every match walks meanwhile")   \
    X(writer_died, U, "kvroute_index_writer_died_total", counter,             \
      "Index writers killed inside a change: the index was cleared")

/* labels {zone}, JSON "pending" (events mode only) */
#define NGX_HTTP_KVROUTE_PENDING_STATS(X)                                     \
    X(blocks, U, "kvroute_pending_blocks", gauge,                             \
      "Blocks of recent decisions not yet confirmed by events")               \
    X(expired, U, "kvroute_pending_expired_total", counter,                   \
      "Pending blocks expired unconfirmed")                                   \
    X(evicted, U, "kvroute_pending_evicted_total", counter,                   \
      "Pending blocks dropped for room before their TTL (a full pending index)")

/* labels {zone}, JSON "share" (zones with kvroute_share) */
#define NGX_HTTP_KVROUTE_SHARE_STATS(X)                                       \
    X(connected, U, "kvroute_share_connected", gauge,                         \
      "1 when the share helper is connected to NATS")                         \
    X(queued, U, "kvroute_share_queued_total", counter,                       \
      "Decision records queued in the ring by nginx workers")                 \
    X(dropped, U, "kvroute_share_dropped_total", counter,                     \
      "Decision records dropped: the ring was full")                          \
    X(published, U, "kvroute_share_published_records_total", counter,         \
      "Decision records published to other instances")                        \
    X(messages_out, U, "kvroute_share_messages_out_total", counter,           \
      "Messages published")                                                   \
    X(messages_in, U, "kvroute_share_messages_in_total", counter,             \
      "Messages from other instances applied")                                \
    X(records_in, U, "kvroute_share_records_in_total", counter,               \
      "Decision records from other instances applied")                        \
    X(rejected, U, "kvroute_share_rejected_total", counter,                   \
      "Malformed messages refused")                                           \
    X(instances, U, "kvroute_share_instances", gauge,                         \
      "Other instances heard within the lease")                               \
    X(remote_requests, I, "kvroute_share_remote_requests", gauge,             \
      "Requests in flight through other instances, as they last said")        \
    X(expired, U, "kvroute_share_expired_total", counter,                     \
      "Remote load entries dropped at the end of their lease")

/* labels {zone}, JSON "turn_cache" (zones with turn_cache) */
#define NGX_HTTP_KVROUTE_TURN_STATS(X)                                        \
    X(lookups, U, "kvroute_turn_cache_lookups_total", counter,                \
      "Text prompts looked up in the turn cache")                             \
    X(hits, U, "kvroute_turn_cache_hits_total", counter,                      \
      "Text prompts whose prefix ids came from the turn cache")               \
    X(misses, U, "kvroute_turn_cache_misses_total", counter,                  \
      "Text prompts tokenized without a cached prefix")                       \
    X(hit_tokens, U, "kvroute_turn_cache_hit_tokens_total", counter,          \
      "Token ids served from the turn cache")                                 \
    X(stored, U, "kvroute_turn_cache_stored_total", counter,                  \
      "Prompt prefixes stored")                                               \
    X(skipped, U, "kvroute_turn_cache_skipped_total", counter,                \
      "Stores skipped (writer busy or prefix too large)")                     \
    X(evicted, U, "kvroute_turn_cache_evicted_total", counter,                \
      "Stored prefixes overwritten by newer ones")                            \
    X(expired, U, "kvroute_turn_cache_expired_total", counter,                \
      "Lookups that found a prefix older than the TTL")                       \
    X(bytes, U, "kvroute_turn_cache_bytes", gauge,                            \
      "Bytes of the turn cache's ring")

/* labels {zone}, JSON "responses" (zones with a response map) */
#define NGX_HTTP_KVROUTE_RESP_STATS(X)                                        \
    X(capacity, U, "kvroute_responses_capacity", gauge,                       \
      "Response ids the response map holds")                                  \
    X(stored, U, "kvroute_responses_stored_total", counter,                   \
      "Response ids recorded with the server that made them")                 \
    X(skipped, U, "kvroute_responses_skipped_total", counter,                 \
      "Response ids not recorded (writer busy)")                              \
    X(hits, U, "kvroute_responses_hits_total", counter,                       \
      "Continued responses whose server was known")                           \
    X(misses, U, "kvroute_responses_misses_total", counter,                   \
      "Continued responses whose server was not known")

/* labels {zone}, JSON "events" (zones with kvroute_events) */
#define NGX_HTTP_KVROUTE_EVENTS_STATS(X)                                      \
    X(helper_pid, I, "kvroute_events_helper_pid", gauge,                      \
      "Process id of the nginx worker running the event helper")              \
    X(nats, S, "kvroute_events_nats", gauge,                                  \
      "State of the NATS connection (label nats)")                            \
    X(connects, U, "kvroute_events_connects_total", counter,                  \
      "Successful NATS (re)connects")                                         \
    X(disconnects, U, "kvroute_events_disconnects_total", counter,            \
      "NATS disconnects")                                                     \
    X(messages, U, "kvroute_events_messages_total", counter,                  \
      "Event messages received")                                              \
    X(events, U, "kvroute_events_applied_total", counter,                     \
      "Events applied to the index")                                          \
    X(blocks, U, "kvroute_events_blocks_total", counter,                      \
      "Blocks stored or removed by applied events")                           \
    X(events_per_s, D, "kvroute_events_per_second", gauge,                    \
      "Events applied per second over the last second")                       \
    X(blocks_per_s, D, "kvroute_events_blocks_per_second", gauge,             \
      "Blocks applied per second over the last second")                       \
    X(decode_errors, U, "kvroute_events_decode_errors_total", counter,        \
      "Malformed event messages dropped")                                     \
    X(apply_errors, U, "kvroute_events_apply_errors_total", counter,          \
      "Events the index refused")                                             \
    X(gaps, U, "kvroute_events_gaps_total", counter,                          \
      "Gaps detected in event sequences")                                     \
    X(resyncs, U, "kvroute_events_resyncs_total", counter,                    \
      "Index dumps requested from workers")                                   \
    X(dumps, U, "kvroute_events_dumps_total", counter,                        \
      "Index dumps applied whole")                                            \
    X(dump_failures, U, "kvroute_events_dump_failures_total", counter,        \
      "Index dumps that timed out or were malformed")                         \
    X(duplicates, U, "kvroute_events_duplicates_total", counter,              \
      "Events received twice")                                                \
    X(buffer_overflows, U, "kvroute_events_buffer_overflows_total", counter,  \
      "Events dropped while a resync buffer was full")                        \
    X(heartbeats, U, "kvroute_events_heartbeats_total", counter,              \
      "Worker heartbeats received")                                           \
    X(timeouts, U, "kvroute_events_timeouts_total", counter,                  \
      "Workers declared gone after silence")                                  \
    X(rejected, U, "kvroute_events_rejected_total", counter,                  \
      "Implausible events, heartbeats and dump chunks rejected")              \
    X(removed, U, "kvroute_events_workers_removed_total", counter,            \
      "Workers removed (left, replaced, gone for long, evicted)")             \
    X(event_lag_ms, M, "kvroute_events_lag_seconds", gauge,                   \
      "Delay of the last event from its publication")                         \
    X(since_last_event_ms, M, "kvroute_events_last_event_age_seconds", gauge, \
      "Time since the last event was applied")                                \
    X(zmq_publishers, U, "kvroute_events_zmq_publishers", gauge,              \
      "vLLM/SGLang ZMQ publishers configured")                                \
    X(zmq_connected, U, "kvroute_events_zmq_connected", gauge,                \
      "ZMQ publishers currently connected")                                   \
    X(block_size_mismatch, U, "kvroute_events_block_size_mismatch", gauge,    \
      "ZMQ publishers whose block size is not the configured one")            \
    X(engine_restarts, U, "kvroute_events_engine_restarts_total", counter,    \
      "ZMQ sequences that went back (engine restarts)")                       \
    X(cleared_workers, U, "kvroute_events_cleared_workers_total", counter,    \
      "Workers whose blocks were cleared after a restart or lost gap")        \
    X(skipped_events, U, "kvroute_events_skipped_total", counter,             \
      "ZMQ events skipped: unknown kinds, a hybrid model's other KV groups")

/* labels {zone, worker_id, dp_rank}, JSON "events": {"workers": [...]} */
#define NGX_HTTP_KVROUTE_WORKER_STATS(X)                                      \
    X(address, S, "kvroute_worker_address", gauge,                            \
      "Address the worker announced (label address)")                         \
    X(state, S, "kvroute_worker_state", gauge,                                \
      "The worker's state in the registry (label state)")                     \
    X(announced, B, "kvroute_worker_announced", gauge,                        \
      "1 if the worker announced itself (speaks the kvroute protocol)")       \
    X(block_size, U, "kvroute_worker_block_size", gauge,                      \
      "Tokens per KV block the worker announced (0: unknown)")                \
    X(last_event_applied, U, "kvroute_worker_last_event_applied", gauge,      \
      "Sequence number of the worker's last applied event")                   \
    X(last_event_announced, U, "kvroute_worker_last_event_announced", gauge,  \
      "Sequence number of the worker's last event, as it announced")          \
    X(seen_ms_ago, M, "kvroute_worker_last_seen_age_seconds", gauge,          \
      "Time since the worker's last heartbeat")                               \
    X(active_prefill_tokens, U, "kvroute_worker_active_prefill_tokens", gauge,\
      "Prompt tokens the worker reported not yet computed")                   \
    X(active_decode_blocks, U, "kvroute_worker_active_decode_blocks", gauge,  \
      "KV blocks the worker reported held by running requests")               \
    X(kv_used_blocks, U, "kvroute_worker_kv_used_blocks", gauge,              \
      "KV blocks the worker reported holding data")                           \
    X(events, U, "kvroute_worker_events_total", counter,                      \
      "Events of the worker applied")                                         \
    X(gaps, U, "kvroute_worker_gaps_total", counter,                          \
      "Gaps in the worker's event sequence")                                  \
    X(resyncs, U, "kvroute_worker_resyncs_total", counter,                    \
      "Dumps of the worker applied")                                          \
    X(apply_errors, U, "kvroute_worker_apply_errors_total", counter,          \
      "Events of the worker the index refused")                               \
    X(selfcheck_samples, U, "kvroute_worker_selfcheck_samples_total", counter,\
      "Responses whose reported cached tokens were compared with the index")  \
    X(selfcheck_over, U, "kvroute_worker_selfcheck_over_total", counter,      \
      "Responses with fewer cached tokens than the index predicted")          \
    X(selfcheck_under, U, "kvroute_worker_selfcheck_under_total", counter,    \
      "Responses with more cached tokens than the index predicted")           \
    X(selfcheck_predicted_tokens, U,                                          \
      "kvroute_worker_selfcheck_predicted_tokens_total", counter,             \
      "Cached prompt tokens the index predicted, over the samples")           \
    X(selfcheck_cached_tokens, U,                                             \
      "kvroute_worker_selfcheck_cached_tokens_total", counter,                \
      "Cached prompt tokens the worker reported, over the samples")           \
    X(selfcheck_error, D, "kvroute_worker_selfcheck_error", gauge,            \
      "Moving average of |predicted - cached| / max(predicted, cached)")      \
    X(selfcheck_drifts, U, "kvroute_worker_selfcheck_drifts_total", counter,  \
      "Times the worker's predictions were found drifting")                   \
    X(selfcheck_resyncs, U, "kvroute_worker_selfcheck_resyncs_total", counter,\
      "Resyncs the self-check asked for")                                     \
    X(selfcheck_load_only, B, "kvroute_worker_selfcheck_load_only", gauge,    \
      "1 while the worker is routed by load because its predictions drift")   \
    X(selfcheck_recoveries, U, "kvroute_worker_selfcheck_recoveries_total",   \
      counter, "Times cache-aware routing was restored after a drift")

/* labels {upstream, server}, JSON "upstreams": {"NAME": [...]} */
#define NGX_HTTP_KVROUTE_SERVER_STATS(X)                                      \
    X(server, L, "kvroute_server_info", gauge,                                \
      "An upstream server as written in the config (label server)")           \
    X(backup, B, "kvroute_server_backup", gauge,                              \
      "1 for a backup server")                                                \
    X(worker_id, U, "kvroute_server_worker_id", gauge,                        \
      "Worker id events name the server by (may exceed 2^53)")                \
    X(active_requests, I, "kvroute_server_active_requests", gauge,            \
      "Requests in flight to the server")                                     \
    X(active_prefill_tokens, I, "kvroute_server_active_prefill_tokens", gauge,\
      "Prompt tokens sent to the server and not yet prefilled")               \
    X(active_decode_blocks, I, "kvroute_server_active_decode_blocks", gauge,  \
      "KV blocks held by requests in flight to the server")                   \
    X(active_decode_tokens, I, "kvroute_server_active_decode_tokens", gauge,  \
      "Output tokens asked by requests in flight (max_tokens times n)")       \
    X(prefill_rate, D, "kvroute_server_prefill_rate", gauge,                  \
      "Learned prompt tokens prefilled per ms (0: no sample yet)")            \
    X(prefill_base, D, "kvroute_server_prefill_base_ms", gauge,               \
      "Learned ms of time to first token that no token adds")                 \
    X(decode_pace, D, "kvroute_server_decode_pace_ms", gauge,                 \
      "Learned ms per output token (0: no sample yet)")                       \
    X(requests, U, "kvroute_server_requests_total", counter,                  \
      "Requests sent to the server")                                          \
    X(overlap_hits, U, "kvroute_server_overlap_hits_total", counter,          \
      "Requests sent to the server with a cached prefix")                     \
    X(overlap_blocks, U, "kvroute_server_overlap_blocks_total", counter,      \
      "Cached prompt blocks of the requests sent to the server")              \
    X(prompt_blocks, U, "kvroute_server_prompt_blocks_total", counter,        \
      "Prompt blocks of the requests sent to the server")                     \
    X(indexed_blocks, U, "kvroute_server_indexed_blocks", gauge,              \
      "Blocks the index holds for the server")                                \
    X(worker_block_size, U, "kvroute_server_worker_block_size", gauge,        \
      "Block size the server's worker announced (0: unknown)")                \
    X(block_size_mismatch, B, "kvroute_server_block_size_mismatch", gauge,    \
      "1 if the worker's block size is not the upstream's block_size=: "      \
      "the server is routed by load only")


#define NGX_HTTP_KVROUTE_T_S  u_char *
#define NGX_HTTP_KVROUTE_T_B  ngx_uint_t
#define NGX_HTTP_KVROUTE_T_U  uint64_t
#define NGX_HTTP_KVROUTE_T_I  int64_t
#define NGX_HTTP_KVROUTE_T_D  double
#define NGX_HTTP_KVROUTE_T_M  uint64_t
#define NGX_HTTP_KVROUTE_T_L  u_char *

#define NGX_HTTP_KVROUTE_MEMBER(key, kind, name, type, help)                  \
    NGX_HTTP_KVROUTE_T_##kind  key;

#define NGX_HTTP_KVROUTE_COUNT(key, kind, name, type, help)  + 1


typedef struct {
    NGX_HTTP_KVROUTE_ZONE_STATS(NGX_HTTP_KVROUTE_MEMBER)
} ngx_http_kvroute_zone_snap_t;

typedef struct {
    NGX_HTTP_KVROUTE_INDEX_STATS(NGX_HTTP_KVROUTE_MEMBER)
} ngx_http_kvroute_index_snap_t;

typedef struct {
    NGX_HTTP_KVROUTE_PENDING_STATS(NGX_HTTP_KVROUTE_MEMBER)
} ngx_http_kvroute_pending_snap_t;

typedef struct {
    NGX_HTTP_KVROUTE_TURN_STATS(NGX_HTTP_KVROUTE_MEMBER)
} ngx_http_kvroute_turn_snap_t;

typedef struct {
    NGX_HTTP_KVROUTE_SHARE_STATS(NGX_HTTP_KVROUTE_MEMBER)
} ngx_http_kvroute_share_snap_t;

typedef struct {
    NGX_HTTP_KVROUTE_RESP_STATS(NGX_HTTP_KVROUTE_MEMBER)
} ngx_http_kvroute_resp_snap_t;

typedef struct {
    NGX_HTTP_KVROUTE_EVENTS_STATS(NGX_HTTP_KVROUTE_MEMBER)
} ngx_http_kvroute_events_snap_t;

typedef struct {
    NGX_HTTP_KVROUTE_WORKER_STATS(NGX_HTTP_KVROUTE_MEMBER)
} ngx_http_kvroute_worker_snap_t;

typedef struct {
    NGX_HTTP_KVROUTE_SERVER_STATS(NGX_HTTP_KVROUTE_MEMBER)
} ngx_http_kvroute_server_snap_t;


/* A worker of the registry and a server of an upstream, with their labels. */
typedef struct {
    u_char                           *labels;  /* zone, worker_id, dp_rank */
    uint64_t                          worker_id;
    uint32_t                          dp_rank;
    ngx_http_kvroute_worker_snap_t    s;
} ngx_http_kvroute_worker_item_t;

typedef struct {
    u_char                           *labels;      /* upstream, server */
    ngx_uint_t                        upstream;  /* in zone->upstreams */
    ngx_http_kvroute_server_snap_t    s;
} ngx_http_kvroute_server_item_t;


/* Everything about one zone, read once per request. */
typedef struct {
    ngx_http_kvroute_zone_t          *zone;
    u_char                           *name;
    u_char                           *labels;      /* zone="..." */
    ngx_http_kvroute_zone_snap_t      z;
    ngx_http_kvroute_index_snap_t     index;
    ngx_http_kvroute_pending_snap_t   pending;
    ngx_http_kvroute_turn_snap_t      turn;
    ngx_http_kvroute_share_snap_t     share;
    ngx_uint_t                        has_share;
    ngx_http_kvroute_events_snap_t    events;
    ngx_uint_t                        has_pending;
    ngx_uint_t                        has_turn;
    ngx_http_kvroute_resp_snap_t      resp;
    ngx_uint_t                        has_resp;
    ngx_uint_t                        has_events;
    kv_retain_t                       retain;       /* approximate mode, */
    ngx_uint_t                        has_retain;   /* ttl_learn=on */
    uint64_t                          fallbacks[NGX_HTTP_KVROUTE_FB_N];
    uint64_t                          hist[NGX_HTTP_KVROUTE_HIST];
    uint64_t                          decision_us_sum;

    ngx_http_kvroute_worker_item_t   *workers;
    ngx_uint_t                        nworkers;
    ngx_http_kvroute_server_item_t   *servers;
    ngx_uint_t                        nservers;
} ngx_http_kvroute_snap_t;


static ngx_int_t ngx_http_kvroute_status_handler(ngx_http_request_t *r);


char *
ngx_http_kvroute_status_directive(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf)
{
    ngx_http_kvroute_loc_conf_t *klcf = conf;

    ngx_str_t                 *value;
    ngx_http_core_loc_conf_t  *clcf;

    value = cf->args->elts;

    klcf->status = NGX_HTTP_KVROUTE_STATUS_ANY;

    if (cf->args->nelts > 1) {
        if (ngx_strcmp(value[1].data, "json") == 0) {
            klcf->status = NGX_HTTP_KVROUTE_STATUS_JSON;

        } else if (ngx_strcmp(value[1].data, "prometheus") == 0) {
            klcf->status = NGX_HTTP_KVROUTE_STATUS_PROMETHEUS;

        } else {
            ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                               "invalid format \"%V\" in \"kvroute_status\": "
                               "expected json or prometheus", &value[1]);
            return NGX_CONF_ERROR;
        }
    }

    clcf = ngx_http_conf_get_module_loc_conf(cf, ngx_http_core_module);
    clcf->handler = ngx_http_kvroute_status_handler;

    return NGX_CONF_OK;
}


/* --- strings ------------------------------------------------------------ */

/*
 * JSON: quotes, backslashes and every byte outside printable ASCII are
 * escaped (\u00XX), so that whatever a worker announced, the document
 * stays valid JSON and valid UTF-8. At most 6 bytes per input byte.
 */

u_char *
ngx_http_kvroute_json_strn(u_char *b, u_char *s, size_t len)
{
    u_char         *end = s + len;
    static u_char   hex[] = "0123456789abcdef";

    *b++ = '"';

    for ( /* void */ ; s < end; s++) {
        if (*s == '"' || *s == '\\') {
            *b++ = '\\';
            *b++ = *s;

        } else if (*s < 0x20 || *s >= 0x7f) {
            b = ngx_cpymem(b, "\\u00", 4);
            *b++ = hex[*s >> 4];
            *b++ = hex[*s & 0xf];

        } else {
            *b++ = *s;
        }
    }

    *b++ = '"';

    return b;
}


static u_char *
ngx_http_kvroute_json_str(u_char *b, u_char *s)
{
    return ngx_http_kvroute_json_strn(b, s, ngx_strlen(s));
}


/*
 * Prometheus label values: \\, \" and \n are the format's escapes; other
 * control bytes and bytes outside ASCII (which could be invalid UTF-8)
 * become '?'. At most 2 bytes per input byte.
 */

static u_char *
ngx_http_kvroute_prom_str(u_char *b, u_char *s, size_t len)
{
    u_char  *end = s + len;

    for ( /* void */ ; s < end; s++) {
        if (*s == '"' || *s == '\\') {
            *b++ = '\\';
            *b++ = *s;

        } else if (*s == '\n') {
            *b++ = '\\';
            *b++ = 'n';

        } else if (*s < 0x20 || *s >= 0x7f) {
            *b++ = '?';

        } else {
            *b++ = *s;
        }
    }

    return b;
}


/* A NUL-terminated copy of len bytes, for the snapshots. */

static u_char *
ngx_http_kvroute_strdup(ngx_pool_t *pool, u_char *s, size_t len)
{
    u_char  *p;

    p = ngx_pnalloc(pool, len + 1);
    if (p == NULL) {
        return NULL;
    }

    *ngx_cpymem(p, s, len) = '\0';

    return p;
}


/* name1="v1",name2="v2" from NUL-terminated pairs, escaped. */

static u_char *
ngx_http_kvroute_labels(ngx_pool_t *pool, ngx_uint_t n, ...)
{
    u_char      *buf, *b, *name, *v;
    size_t       size;
    va_list      args;
    ngx_uint_t   i;

    size = 1;

    va_start(args, n);
    for (i = 0; i < n; i++) {
        size += ngx_strlen(va_arg(args, u_char *)) + 4;
        size += 2 * ngx_strlen(va_arg(args, u_char *));
    }
    va_end(args);

    buf = ngx_pnalloc(pool, size);
    if (buf == NULL) {
        return NULL;
    }

    b = buf;

    va_start(args, n);
    for (i = 0; i < n; i++) {
        name = va_arg(args, u_char *);
        v = va_arg(args, u_char *);
        b = ngx_sprintf(b, "%s%s=\"", i ? "," : "", name);
        b = ngx_http_kvroute_prom_str(b, v, ngx_strlen(v));
        *b++ = '"';
    }
    va_end(args);

    *b = '\0';

    return buf;
}


/* --- one value, by kind --------------------------------------------------- */

#define NGX_HTTP_KVROUTE_JSON_KEY(b, first, key)                              \
    ngx_sprintf(b, "%s\"%s\":", first ? "" : ",", key)

static u_char *
ngx_http_kvroute_json_S(u_char *b, ngx_uint_t first, char *key, u_char *v)
{
    b = NGX_HTTP_KVROUTE_JSON_KEY(b, first, key);
    return ngx_http_kvroute_json_str(b, v);
}

static u_char *
ngx_http_kvroute_json_B(u_char *b, ngx_uint_t first, char *key, ngx_uint_t v)
{
    b = NGX_HTTP_KVROUTE_JSON_KEY(b, first, key);
    return ngx_sprintf(b, "%s", v ? "true" : "false");
}

static u_char *
ngx_http_kvroute_json_U(u_char *b, ngx_uint_t first, char *key, uint64_t v)
{
    b = NGX_HTTP_KVROUTE_JSON_KEY(b, first, key);
    return ngx_sprintf(b, "%uL", v);
}

static u_char *
ngx_http_kvroute_json_I(u_char *b, ngx_uint_t first, char *key, int64_t v)
{
    b = NGX_HTTP_KVROUTE_JSON_KEY(b, first, key);
    return ngx_sprintf(b, "%L", v);
}

static u_char *
ngx_http_kvroute_json_D(u_char *b, ngx_uint_t first, char *key, double v)
{
    b = NGX_HTTP_KVROUTE_JSON_KEY(b, first, key);
    return ngx_sprintf(b, "%s%.3f", v < 0 ? "-" : "", v < 0 ? -v : v);
}


static u_char *
ngx_http_kvroute_json_L(u_char *b, ngx_uint_t first, char *key, u_char *v)
{
    return ngx_http_kvroute_json_S(b, first, key, v);
}


static u_char *
ngx_http_kvroute_json_M(u_char *b, ngx_uint_t first, char *key, uint64_t v)
{
    return ngx_http_kvroute_json_U(b, first, key, v);
}


static u_char *
ngx_http_kvroute_prom_S(u_char *b, char *name, u_char *labels, char *key,
    u_char *v)
{
    b = ngx_sprintf(b, "%s{%s%s%s=\"", name, labels, *labels ? "," : "", key);
    b = ngx_http_kvroute_prom_str(b, v, ngx_strlen(v));
    return ngx_sprintf(b, "\"} 1\n");
}

static u_char *
ngx_http_kvroute_prom_B(u_char *b, char *name, u_char *labels, char *key,
    ngx_uint_t v)
{
    return ngx_sprintf(b, "%s{%s} %d\n", name, labels, v ? 1 : 0);
}

static u_char *
ngx_http_kvroute_prom_U(u_char *b, char *name, u_char *labels, char *key,
    uint64_t v)
{
    return ngx_sprintf(b, "%s{%s} %uL\n", name, labels, v);
}

static u_char *
ngx_http_kvroute_prom_I(u_char *b, char *name, u_char *labels, char *key,
    int64_t v)
{
    return ngx_sprintf(b, "%s{%s} %L\n", name, labels, v);
}

static u_char *
ngx_http_kvroute_prom_D(u_char *b, char *name, u_char *labels, char *key,
    double v)
{
    return ngx_sprintf(b, "%s{%s} %s%.3f\n", name, labels, v < 0 ? "-" : "",
                       v < 0 ? -v : v);
}


static u_char *
ngx_http_kvroute_prom_L(u_char *b, char *name, u_char *labels, char *key,
    u_char *v)
{
    return ngx_sprintf(b, "%s{%s} 1\n", name, labels);
}


static u_char *
ngx_http_kvroute_prom_M(u_char *b, char *name, u_char *labels, char *key,
    uint64_t v)
{
    return ngx_sprintf(b, "%s{%s} %uL.%03uL\n", name, labels, v / 1000,
                       v % 1000);
}


/* the writers of a whole table */

#define NGX_HTTP_KVROUTE_JSON_ROW(key, kind, name, type, help)                \
    b = ngx_http_kvroute_json_##kind(b, first, #key, snap->key);              \
    first = 0;

/* the members of *s (of type t) as "key":value pairs */
#define NGX_HTTP_KVROUTE_JSON(b, table, t, s)                                 \
    do {                                                                      \
        ngx_uint_t   first = 1;                                               \
        t           *snap = (s);                                              \
        table(NGX_HTTP_KVROUTE_JSON_ROW)                                      \
    } while (0)

#define NGX_HTTP_KVROUTE_HEADER(b, name, type, help)                          \
    ngx_sprintf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type)

/* one family per row; items[i].member for i < n where present */
#define NGX_HTTP_KVROUTE_PROM_ROW(key, kind, name, type, help)                \
    b = NGX_HTTP_KVROUTE_HEADER(b, name, #type, help);                        \
    for (i = 0; i < n; i++) {                                                 \
        if (PRESENT(i)) {                                                     \
            b = ngx_http_kvroute_prom_##kind(b, name, LABELS(i), #key,        \
                                             ITEM(i).key);                    \
        }                                                                     \
    }


/* --- snapshots ------------------------------------------------------------ */

/*
 * Blocks the index holds for peer k: a primary by the slot the decisions
 * map it to (ngx_http_kvroute_tree_blocks: one pass over the slots when the
 * index's workers change), a backup, which they do not map, by a search.
 * A search per server reads the slots one by one, all of them for a server
 * the index does not hold: a page of 4,096 servers read 4,096 x 4,096 slots
 * (two thirds of a 20 ms page; docs/BENCHMARKS.md, "Scale-out round 8").
 */

static uint64_t
ngx_http_kvroute_indexed(ngx_http_kvroute_srv_conf_t *kcf, ngx_uint_t k)
{
    int          slot;
    kv_index_t  *ix = kcf->zone->sh->index;

    if (k < kcf->nprimary) {
        return ngx_http_kvroute_tree_blocks(kcf, ix, &kcf->peers[k]);
    }

    slot = kv_index_worker_find(ix, kcf->peers[k].worker_id, 0);

    return slot < 0 ? 0 : kv_index_worker_blocks(ix, slot);
}


#define NGX_HTTP_KVROUTE_COPY(key, kind, name, type, help)  d->key = st.key;

static ngx_int_t
ngx_http_kvroute_snap_events(ngx_pool_t *pool, ngx_http_kvroute_snap_t *s)
{
    int                              i, n;
    u_char                           id[NGX_INT64_LEN + 1];
    u_char                           rank[NGX_INT_T_LEN + 1];
    uint64_t                         now;
    kv_worker_rec_t                  w;
    kv_selfcheck_t                   sc;
    kv_ingest_status_t               st;
    kv_registry_t                   *reg = s->zone->sh->registry;
    ngx_http_kvroute_events_snap_t  *e = &s->events;
    ngx_http_kvroute_worker_snap_t  *ws;
    ngx_http_kvroute_worker_item_t  *it;

    kv_registry_status(reg, &st);
    now = kv_ingest_now_ms();

    e->helper_pid = kv_registry_lease_owner(reg, NULL);
    e->nats = (u_char *) kv_nats_state_name(st.nats_state);
    e->connects = st.connects;
    e->disconnects = st.disconnects;
    e->messages = st.messages;
    e->events = st.events;
    e->blocks = st.blocks;
    e->events_per_s = s->zone->events_per_s;
    e->blocks_per_s = s->zone->blocks_per_s;
    e->decode_errors = st.decode_errors;
    e->apply_errors = st.apply_errors;
    e->gaps = st.gaps;
    e->resyncs = st.resyncs;
    e->dumps = st.dumps;
    e->dump_failures = st.dump_failures;
    e->duplicates = st.duplicates;
    e->buffer_overflows = st.buffer_overflows;
    e->heartbeats = st.heartbeats;
    e->timeouts = st.timeouts;
    e->rejected = st.rejected;
    e->removed = st.removed;
    e->event_lag_ms = st.last_event_lag_ms;
    e->since_last_event_ms = st.last_event_ms && now > st.last_event_ms
                             ? now - st.last_event_ms : 0;
    e->zmq_publishers = st.zmq_publishers;
    e->zmq_connected = st.zmq_connected;
    e->block_size_mismatch = st.block_size_mismatch;
    e->engine_restarts = st.engine_restarts;
    e->cleared_workers = st.cleared_workers;
    e->skipped_events = st.skipped_events;

    n = (int) kv_registry_max_workers(reg);

    s->workers = ngx_palloc(pool, n * sizeof(ngx_http_kvroute_worker_item_t));
    if (s->workers == NULL) {
        return NGX_ERROR;
    }

    for (i = 0; i < n; i++) {
        /* waits out a preempted writer: a worker that vanished from
         * the page for a moment would read as gone */
        if (kv_registry_read_wait(reg, i, &w) != 0) {
            continue;
        }

        w.address[KV_REGISTRY_ADDR_MAX - 1] = '\0';

        it = &s->workers[s->nworkers];
        ws = &it->s;

        it->worker_id = w.worker_id;
        it->dp_rank = w.dp_rank;

        *ngx_sprintf(id, "%uL", w.worker_id) = '\0';
        *ngx_sprintf(rank, "%uD", w.dp_rank) = '\0';

        it->labels = ngx_http_kvroute_labels(pool, 3, "zone", s->name,
                                             "worker_id", id, "dp_rank", rank);
        ws->address = ngx_http_kvroute_strdup(pool, (u_char *) w.address,
                                              ngx_strlen(w.address));
        if (it->labels == NULL || ws->address == NULL) {
            return NGX_ERROR;
        }

        ws->state = (u_char *) kv_worker_state_name(w.state);
        ws->announced = w.announced ? 1 : 0;
        ws->block_size = w.block_size;
        ws->last_event_applied = w.last_event_applied;
        ws->last_event_announced = w.last_event_announced;
        ws->seen_ms_ago = now > w.last_seen_ms ? now - w.last_seen_ms : 0;
        ws->active_prefill_tokens = w.load.active_prefill_tokens;
        ws->active_decode_blocks = w.load.active_decode_blocks;
        ws->kv_used_blocks = w.load.kv_used_blocks;
        ws->events = w.events;
        ws->gaps = w.gaps;
        ws->resyncs = w.resyncs;
        ws->apply_errors = w.apply_errors;

        kv_selfcheck_read(reg, i, &sc);

        if (sc.worker_id == w.worker_id) {
            ws->selfcheck_samples = sc.samples;
            ws->selfcheck_over = sc.over;
            ws->selfcheck_under = sc.under;
            ws->selfcheck_predicted_tokens = sc.predicted_tokens;
            ws->selfcheck_cached_tokens = sc.cached_tokens;
            ws->selfcheck_error = sc.error_ppm / 1e6;
            ws->selfcheck_drifts = sc.drifts;
            ws->selfcheck_resyncs = sc.resyncs;
            ws->selfcheck_load_only = sc.load_only ? 1 : 0;
            ws->selfcheck_recoveries = sc.recoveries;
        }

        s->nworkers++;
    }

    return NGX_OK;
}


static ngx_int_t
ngx_http_kvroute_snap_servers(ngx_pool_t *pool, ngx_http_kvroute_snap_t *s)
{
    u_char                          *up;
    ngx_uint_t                       i, j, n;
    kv_load_server_t                 ls;
    ngx_http_kvroute_peer_t         *p;
    ngx_http_kvroute_zone_t         *zone = s->zone;
    ngx_http_kvroute_server_snap_t  *ss;
    ngx_http_kvroute_server_item_t  *it;
    ngx_http_kvroute_srv_conf_t    **kcfs;

    kcfs = zone->upstreams.elts;

    for (i = 0, n = 0; i < zone->upstreams.nelts; i++) {
        n += kcfs[i]->npeers;
    }

    s->servers = ngx_palloc(pool,
                            (n + 1) * sizeof(ngx_http_kvroute_server_item_t));
    if (s->servers == NULL) {
        return NGX_ERROR;
    }

    for (i = 0; i < zone->upstreams.nelts; i++) {
        up = ngx_http_kvroute_strdup(pool, kcfs[i]->upstream_name.data,
                                     kcfs[i]->upstream_name.len);
        if (up == NULL) {
            return NGX_ERROR;
        }

        /*
         * a small upstream's maps follow announced ids per routed request
         * (large ones from the zone timer): until one, a worker announcing
         * its own id showed 0 indexed blocks here, however many it held
         */

        if (kcfs[i]->nprimary <= NGX_HTTP_KVROUTE_SCAN_ALL) {
            ngx_http_kvroute_candidates_refresh(kcfs[i]);
        }

        for (j = 0; j < kcfs[i]->npeers; j++) {
            p = &kcfs[i]->peers[j];
            it = &s->servers[s->nservers];
            ss = &it->s;

            ngx_memzero(&ls, sizeof(ls));
            if (p->load >= 0) {
                kv_load_get(zone->sh->load, p->load, &ls);
            }

            ss->server = ngx_http_kvroute_strdup(pool, p->server.data,
                                                 p->server.len);
            if (ss->server == NULL) {
                return NGX_ERROR;
            }

            it->labels = ngx_http_kvroute_labels(pool, 2, "upstream", up,
                                                 "server", ss->server);
            if (it->labels == NULL) {
                return NGX_ERROR;
            }

            it->upstream = i;

            ss->backup = p->backup;
            ss->worker_id = p->worker_id;
            ss->active_requests = ls.active[KV_LOAD_REQUESTS];
            ss->active_prefill_tokens = ls.active[KV_LOAD_PREFILL_TOKENS];
            ss->active_decode_blocks = ls.active[KV_LOAD_DECODE_BLOCKS];
            ss->active_decode_tokens = ls.active[KV_LOAD_DECODE_TOKENS];
            ss->prefill_rate = ls.prefill_rate;
            ss->prefill_base = ls.prefill_base;
            ss->decode_pace = ls.decode_pace;
            ss->requests = ls.requests_total;
            ss->overlap_hits = ls.overlap_hits;
            ss->overlap_blocks = ls.overlap_blocks;
            ss->prompt_blocks = ls.prompt_blocks;
            ss->indexed_blocks = ngx_http_kvroute_indexed(kcfs[i], j);
            ss->worker_block_size = ngx_http_kvroute_worker_block_size(kcfs[i],
                                                                       p);
            ss->block_size_mismatch = ss->worker_block_size
                                   && ss->worker_block_size
                                      != kcfs[i]->block_size;

            s->nservers++;
        }
    }

    return NGX_OK;
}


static ngx_int_t
ngx_http_kvroute_snap(ngx_pool_t *pool, ngx_http_kvroute_zone_t *zone,
    ngx_http_kvroute_snap_t *s)
{
    ngx_uint_t                        i;
    kv_index_stats_t                  st;
    ngx_http_kvroute_sh_t            *sh = zone->sh;
    ngx_http_kvroute_index_snap_t    *d;

    ngx_memzero(s, sizeof(ngx_http_kvroute_snap_t));

    s->zone = zone;
    s->name = ngx_http_kvroute_strdup(pool, zone->name.data, zone->name.len);
    if (s->name == NULL) {
        return NGX_ERROR;
    }

    s->labels = ngx_http_kvroute_labels(pool, 1, "zone", s->name);
    if (s->labels == NULL) {
        return NGX_ERROR;
    }

    s->z.mode = (u_char *) (sh->approximate ? "approximate" : "events");
    s->z.requests = sh->requests;
    s->z.decisions = sh->decisions;
    s->z.busy_rejects = sh->busy_rejects;
    s->z.threaded = sh->threaded;
    s->z.threaded_cancelled = sh->threaded_cancelled;
    s->z.tokenize_interrupted = sh->tokenize_interrupted;
    s->z.tokenize_queued = sh->tokenize_queued;
    s->z.tokenize_bytes = sh->tokenize_bytes;
    s->z.tokenize_bytes_peak = sh->tokenize_bytes_peak;
    s->z.load_rows_reaped = kv_load_reaped(sh->load);
    s->z.ttl_samples = __atomic_load_n(&sh->retain.samples, __ATOMIC_RELAXED);

    kv_index_stats(sh->index, &st);
    d = &s->index;
    NGX_HTTP_KVROUTE_INDEX_STATS(NGX_HTTP_KVROUTE_COPY)

    if (sh->approximate && zone->ttl_learn) {
        for (i = 0; i < KV_RETAIN_BUCKETS; i++) {
            s->retain.right[i] = __atomic_load_n(&sh->retain.right[i],
                                                 __ATOMIC_RELAXED);
            s->retain.wrong[i] = __atomic_load_n(&sh->retain.wrong[i],
                                                 __ATOMIC_RELAXED);
            s->retain.n[i] = __atomic_load_n(&sh->retain.n[i],
                                             __ATOMIC_RELAXED);
        }

        s->has_retain = 1;
    }

    if (sh->pending) {
        ngx_http_kvroute_pending_snap_t  *d;

        kv_index_stats(sh->pending, &st);
        d = &s->pending;
        NGX_HTTP_KVROUTE_PENDING_STATS(NGX_HTTP_KVROUTE_COPY)
        s->has_pending = 1;
    }

    if (sh->turns) {
        kv_tcache_stats_t              tst;
        ngx_http_kvroute_turn_snap_t  *td = &s->turn;

        kv_tcache_stats(sh->turns, &tst);
#define NGX_HTTP_KVROUTE_TURN_COPY(key, kind, name, type, help)  td->key = tst.key;
        NGX_HTTP_KVROUTE_TURN_STATS(NGX_HTTP_KVROUTE_TURN_COPY)
#undef NGX_HTTP_KVROUTE_TURN_COPY
        s->has_turn = 1;
    }

    if (sh->responses) {
        kv_respmap_stats_t             rst;
        ngx_http_kvroute_resp_snap_t  *rd = &s->resp;

        kv_respmap_stats(sh->responses, &rst);
#define NGX_HTTP_KVROUTE_RESP_COPY(key, kind, name, type, help)  rd->key = rst.key;
        NGX_HTTP_KVROUTE_RESP_STATS(NGX_HTTP_KVROUTE_RESP_COPY)
#undef NGX_HTTP_KVROUTE_RESP_COPY
        s->has_resp = 1;
    }

    if (sh->share) {
        kv_dring_stats_t   rst;
        kv_dring_share_t  *sst = kv_dring_share(sh->share);

        kv_dring_stats(sh->share, &rst);
        s->share = (ngx_http_kvroute_share_snap_t) { sst->connected,
            rst.pushed, rst.dropped, sst->records_out, sst->messages_out,
            sst->messages_in, sst->records_in, sst->rejected, sst->instances,
            sst->remote_requests, sst->expired };
        s->has_share = 1;
    }

    for (i = 0; i < NGX_HTTP_KVROUTE_FB_N; i++) {
        s->fallbacks[i] = sh->fallbacks[i];
    }

    for (i = 0; i < NGX_HTTP_KVROUTE_HIST; i++) {
        s->hist[i] = sh->hist[i];
    }

    s->decision_us_sum = sh->decision_us_sum;

    if (zone->events_conf) {
        s->has_events = 1;

        if (ngx_http_kvroute_snap_events(pool, s) != NGX_OK) {
            return NGX_ERROR;
        }
    }

    return ngx_http_kvroute_snap_servers(pool, s);
}


/* --- Prometheus: the learned memory's buckets ----------------------------- */

/* The JSON's ttl_learn buckets, one family per field, labelled by age. */

static u_char *
ngx_http_kvroute_prom_retain(u_char *b, ngx_http_kvroute_snap_t *zs,
    ngx_uint_t nz)
{
    int          i;
    double       v;
    ngx_uint_t   f, z;

    static char  *names[] = { "kvroute_ttl_learn_samples",
                              "kvroute_ttl_learn_right_tokens",
                              "kvroute_ttl_learn_wrong_tokens" };
    static char  *helps[] = {
        "Responses checked, by the age of the deepest block credited "
        "(decayed; approximate mode, ttl_learn)",
        "Credited tokens the engine had, by age (decayed)",
        "Credited tokens the engine no longer had, by age (decayed)" };

    for (f = 0; f < 3; f++) {
        b = NGX_HTTP_KVROUTE_HEADER(b, names[f], "gauge", helps[f]);

        for (z = 0; z < nz; z++) {
            for (i = 0; zs[z].has_retain && i < KV_RETAIN_BUCKETS; i++) {
                if (zs[z].retain.n[i] == 0) {
                    continue;
                }

                v = f == 0 ? (double) zs[z].retain.n[i] / KV_RETAIN_ONE
                    : f == 1 ? (double) zs[z].retain.right[i]
                    : (double) zs[z].retain.wrong[i];

                b = ngx_sprintf(b, "%s{%s,age_ms=\"%uL\"} %.1f\n", names[f],
                                zs[z].labels, kv_retain_edge_ms(i), v);
            }
        }
    }

    return b;
}


/* --- JSON --------------------------------------------------------------- */

/*
 * Approximate mode's learned memory: each age bucket that has samples, with
 * the credited tokens its engines had and had not (kv_retain.h), so an
 * operator can see why index.ttl_ms is what it is.
 */

static u_char *
ngx_http_kvroute_json_retain(u_char *b, kv_retain_t *r)
{
    int         i;
    ngx_uint_t  first = 1;

    b = ngx_sprintf(b, ",\"ttl_learn\":{\"buckets\":[");

    for (i = 0; i < KV_RETAIN_BUCKETS; i++) {
        if (r->n[i] == 0) {
            continue;
        }

        b = ngx_sprintf(b, "%s{\"age_ms\":%uL,\"samples\":%.1f,"
                        "\"right_tokens\":%uL,\"wrong_tokens\":%uL}",
                        first ? "" : ",", kv_retain_edge_ms(i),
                        (double) r->n[i] / KV_RETAIN_ONE, r->right[i],
                        r->wrong[i]);
        first = 0;
    }

    return ngx_sprintf(b, "]}");
}


static u_char *
ngx_http_kvroute_json_zone(u_char *b, ngx_http_kvroute_snap_t *s)
{
    ngx_uint_t                     i, k, u;
    ngx_http_kvroute_srv_conf_t  **kcfs;

    b = ngx_http_kvroute_json_str(b, s->name);
    b = ngx_sprintf(b, ":{");

    NGX_HTTP_KVROUTE_JSON(b, NGX_HTTP_KVROUTE_ZONE_STATS,
                          ngx_http_kvroute_zone_snap_t, &s->z);

    b = ngx_sprintf(b, ",\"index\":{");
    NGX_HTTP_KVROUTE_JSON(b, NGX_HTTP_KVROUTE_INDEX_STATS,
                          ngx_http_kvroute_index_snap_t, &s->index);
    b = ngx_sprintf(b, "}");

    if (s->has_retain) {
        b = ngx_http_kvroute_json_retain(b, &s->retain);
    }

    if (s->has_pending) {
        b = ngx_sprintf(b, ",\"pending\":{");
        NGX_HTTP_KVROUTE_JSON(b, NGX_HTTP_KVROUTE_PENDING_STATS,
                          ngx_http_kvroute_pending_snap_t, &s->pending);
        b = ngx_sprintf(b, "}");
    }

    if (s->has_turn) {
        b = ngx_sprintf(b, ",\"turn_cache\":{");
        NGX_HTTP_KVROUTE_JSON(b, NGX_HTTP_KVROUTE_TURN_STATS,
                          ngx_http_kvroute_turn_snap_t, &s->turn);
        b = ngx_sprintf(b, "}");
    }

    if (s->has_resp) {
        b = ngx_sprintf(b, ",\"responses\":{");
        NGX_HTTP_KVROUTE_JSON(b, NGX_HTTP_KVROUTE_RESP_STATS,
                          ngx_http_kvroute_resp_snap_t, &s->resp);
        b = ngx_sprintf(b, "}");
    }

    if (s->has_share) {
        b = ngx_sprintf(b, ",\"share\":{");
        NGX_HTTP_KVROUTE_JSON(b, NGX_HTTP_KVROUTE_SHARE_STATS,
                          ngx_http_kvroute_share_snap_t, &s->share);
        b = ngx_sprintf(b, "}");
    }

    b = ngx_sprintf(b, ",\"fallbacks\":{");
    for (i = 1; i < NGX_HTTP_KVROUTE_FB_N; i++) {
        b = ngx_sprintf(b, "%s\"%s\":%uL", i > 1 ? "," : "",
                        ngx_http_kvroute_fallback_names[i], s->fallbacks[i]);
    }

    b = ngx_sprintf(b, "},\"decision_us\":{\"sum\":%uL,\"count\":%uL,"
                    "\"buckets\":[", s->decision_us_sum, s->z.decisions);
    for (i = 0; i < NGX_HTTP_KVROUTE_HIST; i++) {
        if (i < NGX_HTTP_KVROUTE_HIST - 1) {
            b = ngx_sprintf(b, "%s{\"le\":%uL,\"count\":%uL}", i ? "," : "",
                            ngx_http_kvroute_hist_le[i], s->hist[i]);
        } else {
            b = ngx_sprintf(b, ",{\"le\":\"+Inf\",\"count\":%uL}", s->hist[i]);
        }
    }

    b = ngx_sprintf(b, "]}");

    if (s->has_events) {
        b = ngx_sprintf(b, ",\"events\":{");
        NGX_HTTP_KVROUTE_JSON(b, NGX_HTTP_KVROUTE_EVENTS_STATS,
                          ngx_http_kvroute_events_snap_t, &s->events);
        b = ngx_sprintf(b, ",\"workers\":[");

        for (i = 0; i < s->nworkers; i++) {
            /* labels in Prometheus, the first keys here */
            b = ngx_sprintf(b, "%s{\"worker_id\":%uL,\"dp_rank\":%uD,",
                            i ? "," : "", s->workers[i].worker_id,
                            s->workers[i].dp_rank);
            NGX_HTTP_KVROUTE_JSON(b, NGX_HTTP_KVROUTE_WORKER_STATS,
                          ngx_http_kvroute_worker_snap_t,
                                  &s->workers[i].s);
            b = ngx_sprintf(b, "}");
        }

        b = ngx_sprintf(b, "]}");
    }

    b = ngx_sprintf(b, ",\"upstreams\":{");

    kcfs = s->zone->upstreams.elts;

    for (u = 0, k = 0; u < s->zone->upstreams.nelts; u++) {
        b = ngx_sprintf(b, "%s", u ? "," : "");
        b = ngx_http_kvroute_json_strn(b, kcfs[u]->upstream_name.data,
                                       kcfs[u]->upstream_name.len);
        b = ngx_sprintf(b, ":[");

        for (i = 0; k < s->nservers && s->servers[k].upstream == u; i++, k++) {
            b = ngx_sprintf(b, "%s{", i ? "," : "");
            NGX_HTTP_KVROUTE_JSON(b, NGX_HTTP_KVROUTE_SERVER_STATS,
                          ngx_http_kvroute_server_snap_t,
                                  &s->servers[k].s);
            b = ngx_sprintf(b, "}");
        }

        b = ngx_sprintf(b, "]");
    }

    return ngx_sprintf(b, "}}");
}


/* --- Prometheus --------------------------------------------------------- */

/*
 * Family by family, each with every zone's (or server's, or worker's)
 * samples, so that no family is interleaved with another.
 */

static u_char *
ngx_http_kvroute_prom(u_char *b, ngx_http_kvroute_snap_t *zs, ngx_uint_t nz)
{
    uint64_t     cum;
    ngx_uint_t   i, k, z;

#define PRESENT(i)  1
#define LABELS(i)   zs[i].labels
#define ITEM(i)     zs[i].z
    {
        ngx_uint_t  n = nz;
        NGX_HTTP_KVROUTE_ZONE_STATS(NGX_HTTP_KVROUTE_PROM_ROW)
    }
#undef ITEM
#define ITEM(i)     zs[i].index
    {
        ngx_uint_t  n = nz;
        NGX_HTTP_KVROUTE_INDEX_STATS(NGX_HTTP_KVROUTE_PROM_ROW)
    }
#undef ITEM
#undef PRESENT
#define PRESENT(i)  zs[i].has_pending
#define ITEM(i)     zs[i].pending
    {
        ngx_uint_t  n = nz;
        NGX_HTTP_KVROUTE_PENDING_STATS(NGX_HTTP_KVROUTE_PROM_ROW)
    }
#undef ITEM
#undef PRESENT
#define PRESENT(i)  zs[i].has_turn
#define ITEM(i)     zs[i].turn
    {
        ngx_uint_t  n = nz;
        NGX_HTTP_KVROUTE_TURN_STATS(NGX_HTTP_KVROUTE_PROM_ROW)
    }
#undef ITEM
#undef PRESENT
#define PRESENT(i)  zs[i].has_resp
#define ITEM(i)     zs[i].resp
    {
        ngx_uint_t  n = nz;
        NGX_HTTP_KVROUTE_RESP_STATS(NGX_HTTP_KVROUTE_PROM_ROW)
    }
#undef ITEM
#undef PRESENT
#define PRESENT(i)  zs[i].has_share
#define ITEM(i)     zs[i].share
    {
        ngx_uint_t  n = nz;
        NGX_HTTP_KVROUTE_SHARE_STATS(NGX_HTTP_KVROUTE_PROM_ROW)
    }
#undef ITEM
#undef PRESENT
#define PRESENT(i)  zs[i].has_events
#define ITEM(i)     zs[i].events
    {
        ngx_uint_t  n = nz;
        NGX_HTTP_KVROUTE_EVENTS_STATS(NGX_HTTP_KVROUTE_PROM_ROW)
    }
#undef ITEM
#undef LABELS
#undef PRESENT

    b = NGX_HTTP_KVROUTE_HEADER(b, "kvroute_fallbacks_total", "counter",
                                "Requests routed by load alone, by reason");
    for (z = 0; z < nz; z++) {
        for (i = 1; i < NGX_HTTP_KVROUTE_FB_N; i++) {
            b = ngx_sprintf(b,
                            "kvroute_fallbacks_total{%s,reason=\"%s\"} %uL\n",
                            zs[z].labels, ngx_http_kvroute_fallback_names[i],
                            zs[z].fallbacks[i]);
        }
    }

    b = NGX_HTTP_KVROUTE_HEADER(b, "kvroute_decision_seconds", "histogram",
                                "Time from reading the prompt to the choice "
                                "of a server, tokenization included");
    for (z = 0; z < nz; z++) {
        for (i = 0, cum = 0; i < NGX_HTTP_KVROUTE_HIST; i++) {
            cum += zs[z].hist[i];

            if (i < NGX_HTTP_KVROUTE_HIST - 1) {
                b = ngx_sprintf(b, "kvroute_decision_seconds_bucket{%s,"
                                "le=\"%.6f\"} %uL\n", zs[z].labels,
                                (double) ngx_http_kvroute_hist_le[i] / 1e6,
                                cum);
            } else {
                b = ngx_sprintf(b, "kvroute_decision_seconds_bucket{%s,"
                                "le=\"+Inf\"} %uL\n", zs[z].labels, cum);
            }
        }

        b = ngx_sprintf(b, "kvroute_decision_seconds_sum{%s} %.6f\n",
                        zs[z].labels, (double) zs[z].decision_us_sum / 1e6);
        b = ngx_sprintf(b, "kvroute_decision_seconds_count{%s} %uL\n",
                        zs[z].labels, cum);
    }

    b = ngx_http_kvroute_prom_retain(b, zs, nz);

    /* per worker and per server: every zone's items within each family */

#define PRESENT(k)  1
#define LABELS(k)   zs[z].workers[k].labels
#define ITEM(k)     zs[z].workers[k].s
#undef NGX_HTTP_KVROUTE_PROM_ROW
#define NGX_HTTP_KVROUTE_PROM_ROW(key, kind, name, type, help)                \
    b = NGX_HTTP_KVROUTE_HEADER(b, name, #type, help);                        \
    for (z = 0; z < nz; z++) {                                                \
        for (k = 0; k < NITEMS(z); k++) {                                     \
            b = ngx_http_kvroute_prom_##kind(b, name, LABELS(k), #key,        \
                                             ITEM(k).key);                    \
        }                                                                     \
    }
#define NITEMS(z)   zs[z].nworkers

    NGX_HTTP_KVROUTE_WORKER_STATS(NGX_HTTP_KVROUTE_PROM_ROW)

#undef NITEMS
#undef ITEM
#undef LABELS
#define NITEMS(z)   zs[z].nservers
#define LABELS(k)   zs[z].servers[k].labels
#define ITEM(k)     zs[z].servers[k].s

    NGX_HTTP_KVROUTE_SERVER_STATS(NGX_HTTP_KVROUTE_PROM_ROW)

#undef NITEMS
#undef ITEM
#undef LABELS
#undef PRESENT

    return b;
}


/* --- the handler -------------------------------------------------------- */

/* An upper bound of the output, from the snapshots' sizes. */

static size_t
ngx_http_kvroute_status_size(ngx_http_kvroute_snap_t *zs, ngx_uint_t nz)
{
    size_t      size, row;
    ngx_uint_t  z, k;

    /* every family's header, once */
    size = 1024 + 512 * (0
        NGX_HTTP_KVROUTE_ZONE_STATS(NGX_HTTP_KVROUTE_COUNT)
        NGX_HTTP_KVROUTE_INDEX_STATS(NGX_HTTP_KVROUTE_COUNT)
        NGX_HTTP_KVROUTE_PENDING_STATS(NGX_HTTP_KVROUTE_COUNT)
        NGX_HTTP_KVROUTE_TURN_STATS(NGX_HTTP_KVROUTE_COUNT)
        NGX_HTTP_KVROUTE_RESP_STATS(NGX_HTTP_KVROUTE_COUNT)
        NGX_HTTP_KVROUTE_EVENTS_STATS(NGX_HTTP_KVROUTE_COUNT)
        NGX_HTTP_KVROUTE_WORKER_STATS(NGX_HTTP_KVROUTE_COUNT)
        NGX_HTTP_KVROUTE_SERVER_STATS(NGX_HTTP_KVROUTE_COUNT)
        + 2);

    /* a sample: name (< 64), labels, a string value escaped (x6), a number */
    row = 64 + 6 * KV_REGISTRY_ADDR_MAX + 64;

    for (z = 0; z < nz; z++) {
        size += (ngx_strlen(zs[z].labels) * 2 + row)
                * (NGX_HTTP_KVROUTE_FB_N + 2 * NGX_HTTP_KVROUTE_HIST
                   + 4 * KV_RETAIN_BUCKETS + 3 + 0
                   NGX_HTTP_KVROUTE_ZONE_STATS(NGX_HTTP_KVROUTE_COUNT)
                   NGX_HTTP_KVROUTE_INDEX_STATS(NGX_HTTP_KVROUTE_COUNT)
                   NGX_HTTP_KVROUTE_PENDING_STATS(NGX_HTTP_KVROUTE_COUNT)
                   NGX_HTTP_KVROUTE_TURN_STATS(NGX_HTTP_KVROUTE_COUNT)
                   NGX_HTTP_KVROUTE_RESP_STATS(NGX_HTTP_KVROUTE_COUNT)
                   NGX_HTTP_KVROUTE_SHARE_STATS(NGX_HTTP_KVROUTE_COUNT)
                   NGX_HTTP_KVROUTE_EVENTS_STATS(NGX_HTTP_KVROUTE_COUNT));

        for (k = 0; k < zs[z].nworkers; k++) {
            size += (ngx_strlen(zs[z].workers[k].labels) + row) * (2 + 0
                     NGX_HTTP_KVROUTE_WORKER_STATS(NGX_HTTP_KVROUTE_COUNT));
        }

        for (k = 0; k < zs[z].nservers; k++) {
            /* JSON escapes the server name up to 6 times its size */
            size += (3 * ngx_strlen(zs[z].servers[k].labels) + row) * (2 + 0
                     NGX_HTTP_KVROUTE_SERVER_STATS(NGX_HTTP_KVROUTE_COUNT));
        }

        size += 6 * ngx_strlen(zs[z].labels) + 6 * 256
                * zs[z].zone->upstreams.nelts;
    }

    return size;
}


static ngx_int_t
ngx_http_kvroute_status_handler(ngx_http_request_t *r)
{
    ngx_int_t                       rc, prom;
    ngx_uint_t                      i, nz;
    ngx_buf_t                      *b;
    ngx_str_t                       fmt;
    ngx_chain_t                     out;
    ngx_http_kvroute_snap_t        *zs;
    ngx_http_kvroute_zone_t       **zones;
    ngx_http_kvroute_loc_conf_t    *klcf;
    ngx_http_kvroute_main_conf_t   *kmcf;

    if (!(r->method & (NGX_HTTP_GET|NGX_HTTP_HEAD))) {
        return NGX_HTTP_NOT_ALLOWED;
    }

    rc = ngx_http_discard_request_body(r);
    if (rc != NGX_OK) {
        return rc;
    }

    klcf = ngx_http_get_module_loc_conf(r, ngx_http_kvroute_module);

    if (klcf->status == NGX_HTTP_KVROUTE_STATUS_ANY) {
        prom = ngx_http_arg(r, (u_char *) "format", 6, &fmt) == NGX_OK
               && fmt.len == 10
               && ngx_strncmp(fmt.data, "prometheus", 10) == 0;

    } else {
        prom = (klcf->status == NGX_HTTP_KVROUTE_STATUS_PROMETHEUS);
    }

    kmcf = ngx_http_get_module_main_conf(r, ngx_http_kvroute_module);
    zones = kmcf->zones.elts;

    zs = ngx_palloc(r->pool, (kmcf->zones.nelts + 1)
                             * sizeof(ngx_http_kvroute_snap_t));
    if (zs == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    for (i = 0, nz = 0; i < kmcf->zones.nelts; i++) {
        if (zones[i]->sh == NULL) {
            continue;
        }

        if (ngx_http_kvroute_snap(r->pool, zones[i], &zs[nz]) != NGX_OK) {
            return NGX_HTTP_INTERNAL_SERVER_ERROR;
        }

        nz++;
    }

    b = ngx_create_temp_buf(r->pool, ngx_http_kvroute_status_size(zs, nz));
    if (b == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    if (prom) {
        b->last = ngx_http_kvroute_prom(b->last, zs, nz);
        ngx_str_set(&r->headers_out.content_type,
                    "text/plain; version=0.0.4; charset=utf-8");

    } else {
        b->last = ngx_sprintf(b->last, "{\"zones\":{");

        for (i = 0; i < nz; i++) {
            if (i) {
                *b->last++ = ',';
            }

            b->last = ngx_http_kvroute_json_zone(b->last, &zs[i]);
        }

        b->last = ngx_sprintf(b->last, "}}\n");
        ngx_str_set(&r->headers_out.content_type, "application/json");
    }

    r->headers_out.content_type_len = r->headers_out.content_type.len;
    r->headers_out.status = NGX_HTTP_OK;
    r->headers_out.content_length_n = b->last - b->pos;

    b->last_buf = (r == r->main) ? 1 : 0;
    b->last_in_chain = 1;

    rc = ngx_http_send_header(r);

    if (rc == NGX_ERROR || rc > NGX_OK || r->header_only) {
        return rc;
    }

    out.buf = b;
    out.next = NULL;

    return ngx_http_output_filter(r, &out);
}
