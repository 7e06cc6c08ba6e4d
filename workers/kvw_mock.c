/*
 * The mock engine: the shared scheduler (kvw_sched.c) over the mock
 * backend (kvw_mock_model.c), and the configuration defaults, which mirror
 * Dynamo's mocker (docs/mocker/mocker.md) except block_size, where 16 is
 * what kvroute's tests and the nginx side default to.
 */
#include <stdio.h>

#include "kvw_engine.h"
#include "kvw_text.h"
#include "kvw_sched.h"

void kvw_config_defaults(kvw_config_t *cfg)
{
    cfg->engine = "mock";
    cfg->host = "127.0.0.1";
    cfg->port = 8001;
    cfg->engines = 1;
    cfg->model = "kvroute-mock";
    cfg->block_size = 16;
    cfg->num_blocks = 16384;
    cfg->speedup = 1.0;
    cfg->decode_speedup = 1.0;
    cfg->max_num_seqs = 256;
    cfg->max_num_batched_tokens = 8192;
    cfg->watermark = 0.01;
    cfg->enable_prefix_caching = 1;
    cfg->enable_chunked_prefill = 1;
    cfg->heartbeat_ms = 1000;
    cfg->load_ms = 50;                  /* load fresh while it changes: Scale-out round 4 */
    cfg->idle_timeout_s = 60;
    cfg->stream_backlog_kb = 32768;
    cfg->ns = "dynamo";
    cfg->component = "backend";
    cfg->role = KVW_ROLE_AGGREGATED;
    cfg->disagg_min_tokens = 512;
    cfg->prefill_queue_limit = 16;
    cfg->link_gbps = 400;               /* one 400 Gb/s RDMA NIC (docs/PROTOCOL.md) */
    cfg->kv_bytes_per_token = 131072;   /* Llama-3-8B, fp16: 2 x 32 layers x 8 x 128 x 2 B */
    cfg->xfer_timeout_ms = 30000;
}

kvw_engine_t *kvw_mock_create(const kvw_config_t *cfg, struct event_base *base, int index)
{
    kvw_backend_config_t bc = {
        .profile = cfg->perf_profile,
        .block_size = (uint32_t)cfg->block_size,
        .num_blocks = (uint32_t)cfg->num_blocks,
        .speedup = cfg->speedup,
        .decode_speedup = cfg->decode_speedup,
    };
    char err[256];
    kvw_backend_t *b = kvw_mock_backend_create(&bc, err, sizeof(err));

    if (b == NULL) {
        fprintf(stderr, "kvworker: %s\n", err);
        return NULL;
    }
    /* with a real tokenizer the mock generates real token ids */
    if (cfg->text && cfg->text->vocab_size)
        b->vocab_size = cfg->text->vocab_size;
    kvw_engine_t *e = kvw_sched_create(cfg, base, index, b);
    if (e == NULL)
        b->destroy(b);
    return e;
}
