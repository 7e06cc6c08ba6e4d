
/*
 * Copyright (C) kvroute authors
 *
 * kvroute_status: a snapshot of every kvroute zone as JSON, or as
 * Prometheus text with ?format=prometheus.
 */


#include "ngx_http_kvroute.h"
#include "kv_ingest.h"


static ngx_int_t ngx_http_kvroute_status_handler(ngx_http_request_t *r);


static const uint64_t  ngx_http_kvroute_hist_le[NGX_HTTP_KVROUTE_HIST - 1] = {
    5, 10, 25, 50, 100, 250, 500, 1000, 2500, 10000, 100000
};


char *
ngx_http_kvroute_status_directive(ngx_conf_t *cf, ngx_command_t *cmd,
    void *conf)
{
    ngx_http_core_loc_conf_t  *clcf;

    clcf = ngx_http_conf_get_module_loc_conf(cf, ngx_http_core_module);
    clcf->handler = ngx_http_kvroute_status_handler;

    return NGX_CONF_OK;
}


static uint64_t
ngx_http_kvroute_indexed(ngx_http_kvroute_zone_t *zone,
    ngx_http_kvroute_peer_t *p)
{
    int  slot;

    slot = kv_index_worker_find(zone->sh->index, p->worker_id, 0);

    return slot < 0 ? 0 : kv_index_worker_blocks(zone->sh->index, slot);
}


static u_char *
ngx_http_kvroute_json_events(u_char *b, ngx_http_kvroute_zone_t *zone)
{
    int                  i, n;
    pid_t                pid;
    uint64_t             now;
    kv_worker_rec_t      w;
    kv_ingest_status_t   st;
    kv_registry_t       *reg = zone->sh->registry;

    kv_registry_status(reg, &st);
    pid = kv_registry_lease_owner(reg, NULL);
    now = kv_ingest_now_ms();

    b = ngx_sprintf(b, "\"events\":{\"helper_pid\":%P,\"nats\":\"%s\","
                    "\"connects\":%uL,\"disconnects\":%uL,\"messages\":%uL,"
                    "\"events\":%uL,\"blocks\":%uL,\"events_per_s\":%.1f,"
                    "\"blocks_per_s\":%.1f,\"decode_errors\":%uL,"
                    "\"apply_errors\":%uL,\"gaps\":%uL,\"resyncs\":%uL,"
                    "\"dumps\":%uL,\"dump_failures\":%uL,\"duplicates\":%uL,"
                    "\"buffer_overflows\":%uL,\"heartbeats\":%uL,"
                    "\"timeouts\":%uL,\"event_lag_ms\":%uL,"
                    "\"since_last_event_ms\":%uL,\"zmq_publishers\":%uL,"
                    "\"zmq_connected\":%uL,\"block_size_mismatch\":%uL,"
                    "\"engine_restarts\":%uL,\"cleared_workers\":%uL,"
                    "\"workers\":[",
                    pid, kv_nats_state_name(st.nats_state), st.connects,
                    st.disconnects, st.messages, st.events, st.blocks,
                    zone->events_per_s, zone->blocks_per_s, st.decode_errors,
                    st.apply_errors, st.gaps, st.resyncs, st.dumps,
                    st.dump_failures, st.duplicates, st.buffer_overflows,
                    st.heartbeats, st.timeouts, st.last_event_lag_ms,
                    st.last_event_ms && now > st.last_event_ms
                        ? now - st.last_event_ms : 0,
                    st.zmq_publishers, st.zmq_connected,
                    st.block_size_mismatch, st.engine_restarts,
                    st.cleared_workers);

    n = (int) kv_registry_max_workers(reg);

    for (i = 0; i < n; i++) {
        if (kv_registry_read(reg, i, &w) != 0) {
            continue;
        }

        w.address[KV_REGISTRY_ADDR_MAX - 1] = '\0';

        b = ngx_sprintf(b, "%s{\"worker_id\":%uL,\"dp_rank\":%uD,"
                        "\"address\":\"%s\",\"state\":\"%s\","
                        "\"announced\":%s,\"last_event_applied\":%uL,"
                        "\"last_event_announced\":%uL,\"seen_ms_ago\":%uL,"
                        "\"active_prefill_tokens\":%uL,"
                        "\"active_decode_blocks\":%uL,\"kv_used_blocks\":%uL,"
                        "\"events\":%uL,\"gaps\":%uL,\"resyncs\":%uL,"
                        "\"block_size\":%uD,\"apply_errors\":%uL}",
                        b[-1] == '[' ? "" : ",", w.worker_id, w.dp_rank,
                        w.address, kv_worker_state_name(w.state),
                        w.announced ? "true" : "false", w.last_event_applied,
                        w.last_event_announced,
                        now > w.last_seen_ms ? now - w.last_seen_ms : 0,
                        w.load.active_prefill_tokens,
                        w.load.active_decode_blocks, w.load.kv_used_blocks,
                        w.events, w.gaps, w.resyncs, w.block_size,
                        w.apply_errors);
    }

    return ngx_sprintf(b, "]},");
}


static u_char *
ngx_http_kvroute_json_zone(u_char *b, ngx_http_kvroute_zone_t *zone)
{
    ngx_uint_t                     i, j, k;
    kv_index_stats_t               st;
    kv_load_server_t               ls;
    ngx_http_kvroute_sh_t         *sh = zone->sh;
    ngx_http_kvroute_peer_t       *p;
    ngx_http_kvroute_srv_conf_t  **kcfs;

    kv_index_stats(sh->index, &st);

    b = ngx_sprintf(b, "\"%V\":{\"mode\":\"%s\",\"requests\":%uA,"
                    "\"decisions\":%uA,\"busy_rejects\":%uA,"
                    "\"threaded\":%uA,\"load_rows_reaped\":%uL,",
                    &zone->name, sh->approximate ? "approximate" : "events",
                    sh->requests, sh->decisions, sh->busy_rejects, sh->threaded,
                    kv_load_reaped(sh->load));

    b = ngx_sprintf(b, "\"index\":{\"blocks\":%uL,\"capacity\":%uL,"
                    "\"bytes\":%uL,\"workers\":%uL,\"stored\":%uL,"
                    "\"removed\":%uL,\"cleared\":%uL,\"evicted\":%uL,"
                    "\"expired\":%uL,\"pruned\":%uL,\"unknown_parent\":%uL,"
                    "\"unknown_remove\":%uL},",
                    st.blocks, st.capacity, st.bytes, st.workers, st.stored,
                    st.removed, st.cleared, st.evicted, st.expired, st.pruned,
                    st.unknown_parent, st.unknown_remove);

    if (sh->pending) {
        kv_index_stats_t  ps;

        kv_index_stats(sh->pending, &ps);
        b = ngx_sprintf(b, "\"pending\":{\"blocks\":%uL,\"expired\":%uL},",
                        ps.blocks, ps.expired);
    }

    b = ngx_sprintf(b, "\"fallbacks\":{");
    for (i = 1; i < NGX_HTTP_KVROUTE_FB_N; i++) {
        b = ngx_sprintf(b, "%s\"%s\":%uA", i > 1 ? "," : "",
                        ngx_http_kvroute_fallback_names[i], sh->fallbacks[i]);
    }

    b = ngx_sprintf(b, "},\"decision_us\":{\"sum\":%uA,\"count\":%uA,"
                    "\"buckets\":[", sh->decision_us_sum, sh->decisions);
    for (i = 0; i < NGX_HTTP_KVROUTE_HIST; i++) {
        if (i < NGX_HTTP_KVROUTE_HIST - 1) {
            b = ngx_sprintf(b, "%s{\"le\":%uL,\"count\":%uA}", i ? "," : "",
                            ngx_http_kvroute_hist_le[i], sh->hist[i]);
        } else {
            b = ngx_sprintf(b, ",{\"le\":\"+Inf\",\"count\":%uA}", sh->hist[i]);
        }
    }

    b = ngx_sprintf(b, "]},");

    if (zone->events_conf) {
        b = ngx_http_kvroute_json_events(b, zone);
    }

    b = ngx_sprintf(b, "\"upstreams\":{");

    kcfs = zone->upstreams.elts;

    for (i = 0; i < zone->upstreams.nelts; i++) {
        b = ngx_sprintf(b, "%s\"%V\":[", i ? "," : "",
                        &kcfs[i]->upstream_name);

        for (j = 0, k = 0; j < kcfs[i]->npeers; j++) {
            p = &kcfs[i]->peers[j];

            ngx_memzero(&ls, sizeof(ls));
            if (p->load >= 0) {
                kv_load_get(sh->load, p->load, &ls);
            }

            b = ngx_sprintf(b, "%s{\"server\":\"%V\",\"backup\":%s,"
                            "\"worker_id\":%uL,\"active_requests\":%L,"
                            "\"active_prefill_tokens\":%L,"
                            "\"active_decode_blocks\":%L,\"requests\":%uL,"
                            "\"overlap_hits\":%uL,\"overlap_blocks\":%uL,"
                            "\"prompt_blocks\":%uL,\"indexed_blocks\":%uL}",
                            k++ ? "," : "", &p->server,
                            p->backup ? "true" : "false", p->worker_id,
                            ls.active[KV_LOAD_REQUESTS],
                            ls.active[KV_LOAD_PREFILL_TOKENS],
                            ls.active[KV_LOAD_DECODE_BLOCKS],
                            ls.requests_total, ls.overlap_hits,
                            ls.overlap_blocks, ls.prompt_blocks,
                            ngx_http_kvroute_indexed(zone, p));
        }

        b = ngx_sprintf(b, "]");
    }

    return ngx_sprintf(b, "}}");
}


static u_char *
ngx_http_kvroute_prom_zone(u_char *b, ngx_http_kvroute_zone_t *zone)
{
    uint64_t                       cum;
    ngx_uint_t                     i, j;
    kv_index_stats_t               st;
    kv_load_server_t               ls;
    ngx_http_kvroute_sh_t         *sh = zone->sh;
    ngx_http_kvroute_peer_t       *p;
    ngx_http_kvroute_srv_conf_t  **kcfs;

    kv_index_stats(sh->index, &st);

#define KV_Z  "{zone=\"%V\"}"

    b = ngx_sprintf(b, "kvroute_requests_total" KV_Z " %uA\n",
                    &zone->name, sh->requests);
    b = ngx_sprintf(b, "kvroute_busy_rejects_total" KV_Z " %uA\n",
                    &zone->name, sh->busy_rejects);
    b = ngx_sprintf(b, "kvroute_index_blocks" KV_Z " %uL\n",
                    &zone->name, st.blocks);
    b = ngx_sprintf(b, "kvroute_index_capacity_blocks" KV_Z " %uL\n",
                    &zone->name, st.capacity);
    b = ngx_sprintf(b, "kvroute_index_evicted_total" KV_Z " %uL\n",
                    &zone->name, st.evicted);
    b = ngx_sprintf(b, "kvroute_index_expired_total" KV_Z " %uL\n",
                    &zone->name, st.expired);
    b = ngx_sprintf(b, "kvroute_index_pruned_total" KV_Z " %uL\n",
                    &zone->name, st.pruned);

    for (i = 1; i < NGX_HTTP_KVROUTE_FB_N; i++) {
        b = ngx_sprintf(b, "kvroute_fallbacks_total{zone=\"%V\",reason=\"%s\"}"
                        " %uA\n", &zone->name,
                        ngx_http_kvroute_fallback_names[i], sh->fallbacks[i]);
    }

    for (i = 0, cum = 0; i < NGX_HTTP_KVROUTE_HIST; i++) {
        cum += sh->hist[i];

        if (i < NGX_HTTP_KVROUTE_HIST - 1) {
            b = ngx_sprintf(b, "kvroute_decision_seconds_bucket{zone=\"%V\","
                            "le=\"%.6f\"} %uL\n", &zone->name,
                            (double) ngx_http_kvroute_hist_le[i] / 1e6, cum);
        } else {
            b = ngx_sprintf(b, "kvroute_decision_seconds_bucket{zone=\"%V\","
                            "le=\"+Inf\"} %uL\n", &zone->name, cum);
        }
    }

    b = ngx_sprintf(b, "kvroute_decision_seconds_sum" KV_Z " %.6f\n",
                    &zone->name, (double) sh->decision_us_sum / 1e6);
    b = ngx_sprintf(b, "kvroute_decision_seconds_count" KV_Z " %uA\n",
                    &zone->name, sh->decisions);

    if (zone->events_conf) {
        kv_ingest_status_t  es;

        kv_registry_status(zone->sh->registry, &es);

        b = ngx_sprintf(b, "kvroute_events_connected" KV_Z " %d\n",
                        &zone->name, es.nats_state == KV_NATS_CONNECTED);
        b = ngx_sprintf(b, "kvroute_events_applied_total" KV_Z " %uL\n",
                        &zone->name, es.events);
        b = ngx_sprintf(b, "kvroute_events_blocks_total" KV_Z " %uL\n",
                        &zone->name, es.blocks);
        b = ngx_sprintf(b, "kvroute_events_decode_errors_total" KV_Z " %uL\n",
                        &zone->name, es.decode_errors);
        b = ngx_sprintf(b, "kvroute_events_gaps_total" KV_Z " %uL\n",
                        &zone->name, es.gaps);
        b = ngx_sprintf(b, "kvroute_events_resyncs_total" KV_Z " %uL\n",
                        &zone->name, es.resyncs);
        b = ngx_sprintf(b, "kvroute_events_lag_seconds" KV_Z " %.3f\n",
                        &zone->name, (double) es.last_event_lag_ms / 1000);
    }

#undef KV_Z

    kcfs = zone->upstreams.elts;

    for (i = 0; i < zone->upstreams.nelts; i++) {
        for (j = 0; j < kcfs[i]->npeers; j++) {
            p = &kcfs[i]->peers[j];

            ngx_memzero(&ls, sizeof(ls));
            if (p->load >= 0) {
                kv_load_get(sh->load, p->load, &ls);
            }

#define KV_S  "{upstream=\"%V\",server=\"%V\"}"

            b = ngx_sprintf(b, "kvroute_server_active_requests" KV_S " %L\n",
                            &kcfs[i]->upstream_name, &p->server,
                            ls.active[KV_LOAD_REQUESTS]);
            b = ngx_sprintf(b, "kvroute_server_active_prefill_tokens" KV_S
                            " %L\n", &kcfs[i]->upstream_name, &p->server,
                            ls.active[KV_LOAD_PREFILL_TOKENS]);
            b = ngx_sprintf(b, "kvroute_server_active_decode_blocks" KV_S
                            " %L\n", &kcfs[i]->upstream_name, &p->server,
                            ls.active[KV_LOAD_DECODE_BLOCKS]);
            b = ngx_sprintf(b, "kvroute_server_requests_total" KV_S " %uL\n",
                            &kcfs[i]->upstream_name, &p->server,
                            ls.requests_total);
            b = ngx_sprintf(b, "kvroute_server_overlap_hits_total" KV_S
                            " %uL\n", &kcfs[i]->upstream_name, &p->server,
                            ls.overlap_hits);
            b = ngx_sprintf(b, "kvroute_server_overlap_blocks_total" KV_S
                            " %uL\n", &kcfs[i]->upstream_name, &p->server,
                            ls.overlap_blocks);
            b = ngx_sprintf(b, "kvroute_server_indexed_blocks" KV_S " %uL\n",
                            &kcfs[i]->upstream_name, &p->server,
                            ngx_http_kvroute_indexed(zone, p));
#undef KV_S
        }
    }

    return b;
}


static ngx_int_t
ngx_http_kvroute_status_handler(ngx_http_request_t *r)
{
    size_t                          size;
    ngx_int_t                       rc, prom;
    ngx_uint_t                      i, j;
    ngx_buf_t                      *b;
    ngx_str_t                       fmt;
    ngx_chain_t                     out;
    ngx_http_kvroute_zone_t       **zones;
    ngx_http_kvroute_srv_conf_t   **kcfs;
    ngx_http_kvroute_main_conf_t   *kmcf;

    if (!(r->method & (NGX_HTTP_GET|NGX_HTTP_HEAD))) {
        return NGX_HTTP_NOT_ALLOWED;
    }

    rc = ngx_http_discard_request_body(r);
    if (rc != NGX_OK) {
        return rc;
    }

    prom = ngx_http_arg(r, (u_char *) "format", 6, &fmt) == NGX_OK
           && fmt.len == 10 && ngx_strncmp(fmt.data, "prometheus", 10) == 0;

    kmcf = ngx_http_get_module_main_conf(r, ngx_http_kvroute_module);
    zones = kmcf->zones.elts;

    size = 64;

    for (i = 0; i < kmcf->zones.nelts; i++) {
        size += 8192 + kv_registry_max_workers(zones[i]->sh->registry) * 640;
        kcfs = zones[i]->upstreams.elts;

        for (j = 0; j < zones[i]->upstreams.nelts; j++) {
            size += 256 + kcfs[j]->npeers * 2048;
        }
    }

    b = ngx_create_temp_buf(r->pool, size);
    if (b == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    if (!prom) {
        b->last = ngx_sprintf(b->last, "{\"zones\":{");
    }

    for (i = 0; i < kmcf->zones.nelts; i++) {
        if (zones[i]->sh == NULL) {
            continue;
        }

        if (prom) {
            b->last = ngx_http_kvroute_prom_zone(b->last, zones[i]);

        } else {
            if (i) {
                *b->last++ = ',';
            }
            b->last = ngx_http_kvroute_json_zone(b->last, zones[i]);
        }
    }

    if (!prom) {
        b->last = ngx_sprintf(b->last, "}}\n");
        ngx_str_set(&r->headers_out.content_type, "application/json");

    } else {
        ngx_str_set(&r->headers_out.content_type,
                    "text/plain; version=0.0.4");
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
