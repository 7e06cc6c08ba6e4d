/*
 * kvworker: an OpenAI-compatible inference worker. One process hosts one or
 * more engines (--engines N), each on its own port, all on one event loop,
 * sharing one NATS connection.
 */
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <event2/event.h>
#include <event2/thread.h>

#include "kvw_engine.h"
#include "kvw_text.h"
#include "kvw_backend.h"
#include "kvw_sched.h"
#include "kv_chat.h"
#include "kv_model.h"
#include "kvw_http.h"
#include "kvw_nats.h"
#include "kvw_xfer.h"

static void usage(FILE *f)
{
    fprintf(f,
        "usage: kvworker --engine mock --port PORT [options]\n"
        "  --engine NAME                 mock (default), cpu, cuda (--model DIR: an HF model directory)\n"
        "  --device N                    cuda: the GPU to run on (default 0)\n"
        "  --host ADDR                   listen address (default 127.0.0.1)\n"
        "  --port PORT                   first port (default 8001)\n"
        "  --engines N                   engines in this process, on PORT..PORT+N-1 (default 1)\n"
        "  --nats URL                    publish KV events and heartbeats to NATS\n"
        "  --namespace NS                subject prefix namespace.NS... (default dynamo)\n"
        "  --component NAME              ...component.NAME (default backend)\n"
        "  --heartbeat-ms N              heartbeat interval (default 1000)\n"
        "  --load-ms N                   also a heartbeat when an engine's load changed, at most\n"
        "                                one per N ms per engine (default 50; 0: off)\n"
        "  --idle-timeout SEC            close a connection idle or sending headers this long\n"
        "                                (default 60; 0: never)\n"
        "  --stream-backlog-kb N         cancel a stream whose client lets this much output\n"
        "                                pile up unread (default 32768)\n"
        "  --responses-store N           keep each engine's newest N Responses API responses,\n"
        "                                for previous_response_id and GET /v1/responses/ID\n"
        "                                (default 0: off; vLLM's store, off by default too)\n"
        "  --nats-subjects per-worker    publish on P.kv-events.<id>, P.kvroute.heartbeat.<id>\n"
        "                                (NATS permissions per worker; default shared)\n"
        "  --worker-id ID                event worker id; engine i gets ID+i\n"
        "                                (default: a hash of host:port)\n"
        "  --model NAME                  model name served (default kvroute-mock)\n"
        "  --block-size N                KV block size in tokens (default 16)\n"
        "  --num-blocks N                KV blocks per engine (default 16384)\n"
        "  --max-num-seqs N              running requests per engine (default 256)\n"
        "  --max-num-batched-tokens N    tokens per step (default 8192)\n"
        "  --max-model-len N             longest sequence (default: the KV pool)\n"
        "  --watermark X                 share of blocks admission keeps free (default 0.01)\n"
        "  --enable-prefix-caching BOOL  (default true)\n"
        "  --enable-chunked-prefill BOOL (default true)\n"
        "  --speedup X                   divide all simulated times by X (default 1)\n"
        "  --decode-speedup X            further divide decode times by X (default 1)\n"
        "  --perf-profile FILE           interpolated timing profile (JSON, see\n"
        "                                workers/kvw_mock_model.c); default: polynomial\n"
        "  --tokenizer FILE              tokenizer.json (default: one token per byte)\n"
        "  --chat-template FILE          chat template (default: \"role: content\" lines)\n"
        "  --chat-engine vllm|sglang     render chat requests (tools, tool calls, kwargs) by\n"
        "                                vLLM's rules (default) or SGLang's\n"
        "  --lora-modules NAMES          mock: LoRA adapter names served beside --model\n"
        "                                (a,b,...): their requests' KV blocks are kept apart\n"
        "                                and tagged with the name, as vLLM's are\n"
        "  --default-chat-template-kwargs JSON  template variables every chat request gets\n"
        "                                (its own chat_template_kwargs over them), as vLLM's\n"
        "disaggregated prefill/decode (docs/PROTOCOL.md):\n"
        "  --role ROLE                   aggregated (default), prefill or decode: a decode worker\n"
        "                                pulls a prompt's KV from the worker its request's\n"
        "                                X-KVRoute-Prefill header names\n"
        "  --disagg-min-tokens N         decode: prefill locally when fewer prompt tokens than\n"
        "                                this are uncached (default 512)\n"
        "  --prefill-queue-limit N       prefill: refuse transfers (the decode side prefills\n"
        "                                itself) at N queued prefills (default 16)\n"
        "  --xfer-timeout-ms N           a transfer's deadline, either side (default 30000)\n"
        "  --link-gbps X|nvlink|pcie|rdma  mock: the link KV crosses, Gb/s (default rdma = 400;\n"
        "                                nvlink = 3600, pcie = 512)\n"
        "  --kv-bytes-per-token N        mock: modelled KV bytes per token (default 131072)\n"
        "  --xfer-fault KIND:N           TESTING ONLY (off by default): prefill side, fail every\n"
        "                                transfer after N blocks: read (a block read fails),\n"
        "                                alloc (a send buffer cannot be allocated), stall (send\n"
        "                                nothing more until --xfer-timeout-ms cuts the stream)\n");
}

static void on_signal(evutil_socket_t sig, short what, void *arg)
{
    event_base_loopbreak(arg);
}

static int parse_bool(const char *v, int *out)
{
    if (!strcmp(v, "true") || !strcmp(v, "1") || !strcmp(v, "on") || !strcmp(v, "yes"))
        *out = 1;
    else if (!strcmp(v, "false") || !strcmp(v, "0") || !strcmp(v, "off") || !strcmp(v, "no"))
        *out = 0;
    else
        return -1;
    return 0;
}

enum {
    O_NS = 256, O_COMPONENT, O_HEARTBEAT, O_LOAD_MS, O_MAX_SEQS, O_MAX_BATCHED, O_MAX_LEN, O_WATERMARK,
    O_PREFIX, O_CHUNKED, O_DECODE_SPEEDUP, O_PROFILE, O_TOKENIZER, O_TEMPLATE, O_SUBJECTS, O_IDLE,
    O_DEVICE, O_ROLE, O_DISAGG_MIN, O_PREFILL_LIMIT, O_XFER_TIMEOUT, O_LINK, O_KVBPT,
    O_XFER_FAULT, O_CHAT_ENGINE, O_CHAT_KWARGS, O_LORA, O_BACKLOG, O_RESP_STORE,
};

/* --xfer-fault KIND:N (testing only, kvw_engine.h). */
static int parse_fault(const char *v, int *kind, uint32_t *at)
{
    static const char *kinds[] = { "read", "alloc", "stall" };
    const char *colon = strchr(v, ':');
    char *end;

    if (colon == NULL)
        return -1;
    for (int i = 0; i < 3; i++) {
        if ((size_t)(colon - v) == strlen(kinds[i]) && !strncmp(v, kinds[i], colon - v)) {
            unsigned long n = strtoul(colon + 1, &end, 10);
            if (colon[1] < '0' || colon[1] > '9' || *end != '\0' || n > UINT32_MAX)
                return -1;
            *kind = KVW_FAULT_READ + i;
            *at = (uint32_t)n;
            return 0;
        }
    }
    return -1;
}

/* Link bandwidths by name, Gb/s per direction (docs/PROTOCOL.md). */
static int parse_link(const char *v, double *out)
{
    char *end;

    if (!strcmp(v, "nvlink"))
        *out = 3600;        /* H100 NVLink 4: 450 GB/s each way */
    else if (!strcmp(v, "pcie"))
        *out = 512;         /* PCIe 5.0 x16: 64 GB/s each way */
    else if (!strcmp(v, "rdma"))
        *out = 400;         /* one 400 Gb/s InfiniBand NDR / RoCE NIC */
    else {
        *out = strtod(v, &end);
        if (*end != '\0' || !(*out > 0))
            return -1;
    }
    return 0;
}

/* --lora-modules a,b,...: names of 1-127 bytes, none empty, no '*' */
static int lora_names_ok(const char *list)
{
    const char *p = list, *name;
    size_t      n;

    while (kv_model_next(&p, &name, &n)) {
        if (n == 0 || n > 127 || memchr(name, '*', n)) {
            return 0;
        }
    }
    return 1;
}

static int parse_args(int argc, char **argv, kvw_config_t *cfg)
{
    static const struct option opts[] = {
        {"engine", 1, 0, 'e'}, {"host", 1, 0, 'H'}, {"port", 1, 0, 'p'},
        {"engines", 1, 0, 'n'}, {"nats", 1, 0, 'N'}, {"worker-id", 1, 0, 'w'},
        {"model", 1, 0, 'm'}, {"block-size", 1, 0, 'b'}, {"num-blocks", 1, 0, 'B'},
        {"speedup", 1, 0, 's'}, {"help", 0, 0, 'h'},
        {"namespace", 1, 0, O_NS}, {"component", 1, 0, O_COMPONENT},
        {"heartbeat-ms", 1, 0, O_HEARTBEAT}, {"load-ms", 1, 0, O_LOAD_MS}, {"max-num-seqs", 1, 0, O_MAX_SEQS},
        {"max-num-batched-tokens", 1, 0, O_MAX_BATCHED}, {"max-model-len", 1, 0, O_MAX_LEN},
        {"watermark", 1, 0, O_WATERMARK}, {"enable-prefix-caching", 1, 0, O_PREFIX},
        {"enable-chunked-prefill", 1, 0, O_CHUNKED}, {"decode-speedup", 1, 0, O_DECODE_SPEEDUP},
        {"perf-profile", 1, 0, O_PROFILE}, {"tokenizer", 1, 0, O_TOKENIZER},
        {"chat-template", 1, 0, O_TEMPLATE}, {"nats-subjects", 1, 0, O_SUBJECTS},
        {"idle-timeout", 1, 0, O_IDLE}, {"device", 1, 0, O_DEVICE},
        {"role", 1, 0, O_ROLE}, {"disagg-min-tokens", 1, 0, O_DISAGG_MIN},
        {"prefill-queue-limit", 1, 0, O_PREFILL_LIMIT}, {"xfer-timeout-ms", 1, 0, O_XFER_TIMEOUT},
        {"link-gbps", 1, 0, O_LINK}, {"kv-bytes-per-token", 1, 0, O_KVBPT},
        {"xfer-fault", 1, 0, O_XFER_FAULT}, {"chat-engine", 1, 0, O_CHAT_ENGINE},
        {"default-chat-template-kwargs", 1, 0, O_CHAT_KWARGS}, {"lora-modules", 1, 0, O_LORA},
        {"stream-backlog-kb", 1, 0, O_BACKLOG}, {"responses-store", 1, 0, O_RESP_STORE},
        {0, 0, 0, 0}
    };
    int c;

    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'e': cfg->engine = optarg; break;
        case 'H': cfg->host = optarg; break;
        case 'p': cfg->port = atoi(optarg); break;
        case 'n': cfg->engines = atoi(optarg); break;
        case 'N': cfg->nats_url = optarg; break;
        case 'w': cfg->worker_id = strtoull(optarg, NULL, 10); break;
        case 'm': cfg->model = optarg; break;
        case 'b': cfg->block_size = atoi(optarg); break;
        case 'B': cfg->num_blocks = atoi(optarg); break;
        case 's': cfg->speedup = atof(optarg); break;
        case O_NS: cfg->ns = optarg; break;
        case O_COMPONENT: cfg->component = optarg; break;
        case O_HEARTBEAT: cfg->heartbeat_ms = atoi(optarg); break;
        case O_LOAD_MS: cfg->load_ms = atoi(optarg); break;
        case O_MAX_SEQS: cfg->max_num_seqs = atoi(optarg); break;
        case O_MAX_BATCHED: cfg->max_num_batched_tokens = atoi(optarg); break;
        case O_MAX_LEN: cfg->max_model_len = atoi(optarg); break;
        case O_WATERMARK: cfg->watermark = atof(optarg); break;
        case O_DECODE_SPEEDUP: cfg->decode_speedup = atof(optarg); break;
        case O_PROFILE: cfg->perf_profile = optarg; break;
        case O_TOKENIZER: cfg->tokenizer = optarg; break;
        case O_TEMPLATE: cfg->chat_template = optarg; break;
        case O_CHAT_KWARGS: cfg->chat_kwargs = optarg; break;
        case O_LORA: cfg->lora_modules = optarg; break;
        case O_CHAT_ENGINE:
            if (strcmp(optarg, "vllm") && strcmp(optarg, "sglang")) {
                fprintf(stderr, "kvworker: --chat-engine takes vllm or sglang\n");
                return -1;
            }
            cfg->chat_engine = strcmp(optarg, "sglang") ? KV_CHAT_VLLM : KV_CHAT_SGLANG;
            break;
        case O_IDLE: cfg->idle_timeout_s = atoi(optarg); break;
        case O_SUBJECTS:
            if (strcmp(optarg, "per-worker") && strcmp(optarg, "shared")) {
                fprintf(stderr, "kvworker: --nats-subjects takes per-worker or shared\n");
                return -1;
            }
            cfg->nats_per_worker = !strcmp(optarg, "per-worker");
            break;
        case O_DEVICE: cfg->device = atoi(optarg); break;
        case O_ROLE:
            if (!strcmp(optarg, "aggregated"))
                cfg->role = KVW_ROLE_AGGREGATED;
            else if (!strcmp(optarg, "prefill"))
                cfg->role = KVW_ROLE_PREFILL;
            else if (!strcmp(optarg, "decode"))
                cfg->role = KVW_ROLE_DECODE;
            else {
                fprintf(stderr, "kvworker: --role takes aggregated, prefill or decode\n");
                return -1;
            }
            break;
        case O_DISAGG_MIN: cfg->disagg_min_tokens = atoi(optarg); break;
        case O_PREFILL_LIMIT: cfg->prefill_queue_limit = atoi(optarg); break;
        case O_XFER_TIMEOUT: cfg->xfer_timeout_ms = atoi(optarg); break;
        case O_BACKLOG: cfg->stream_backlog_kb = atoi(optarg); break;
        case O_RESP_STORE: cfg->responses_store = atoi(optarg); break;
        case O_KVBPT: cfg->kv_bytes_per_token = atof(optarg); break;
        case O_XFER_FAULT:
            if (parse_fault(optarg, &cfg->xfer_fault, &cfg->xfer_fault_at)) {
                fprintf(stderr, "kvworker: --xfer-fault takes read:N, alloc:N or stall:N\n");
                return -1;
            }
            break;
        case O_LINK:
            if (parse_link(optarg, &cfg->link_gbps)) {
                fprintf(stderr, "kvworker: --link-gbps takes a positive number, nvlink, pcie "
                        "or rdma\n");
                return -1;
            }
            break;
        case O_PREFIX:
            if (parse_bool(optarg, &cfg->enable_prefix_caching))
                return -1;
            break;
        case O_CHUNKED:
            if (parse_bool(optarg, &cfg->enable_chunked_prefill))
                return -1;
            break;
        case 'h': usage(stdout); exit(0);
        default: return -1;
        }
    }
    if (optind != argc) {
        fprintf(stderr, "kvworker: unexpected argument '%s'\n", argv[optind]);
        return -1;
    }
    if (strcmp(cfg->engine, "mock") && strcmp(cfg->engine, "cpu") && strcmp(cfg->engine, "cuda")) {
        fprintf(stderr, "kvworker: unknown engine '%s' (mock, cpu, cuda)\n", cfg->engine);
        return -1;
    }
    /* the mock keeps an adapter's blocks apart as vLLM does, in every
     * role (a transfer names the adapter: docs/PROTOCOL.md); the real
     * engines have no adapter weights to apply */
    if (cfg->lora_modules && (strcmp(cfg->engine, "mock") || !lora_names_ok(cfg->lora_modules))) {
        fprintf(stderr, "kvworker: --lora-modules takes names (a,b,...) and needs --engine "
                "mock\n");
        return -1;
    }
    if (cfg->port <= 0 || cfg->port > 65535 || cfg->engines < 1 || cfg->engines > 4096
        || cfg->port + cfg->engines - 1 > 65535) {
        fprintf(stderr, "kvworker: bad --port/--engines\n");
        return -1;
    }
    if (cfg->block_size < 1 || cfg->num_blocks < 1 || cfg->speedup <= 0
        || cfg->decode_speedup <= 0 || cfg->max_num_seqs < 1
        || cfg->max_num_batched_tokens < 1 || cfg->heartbeat_ms < 1 || cfg->load_ms < 0
        || cfg->watermark < 0 || cfg->watermark >= 1 || cfg->max_model_len < 0
        || cfg->device < 0 || cfg->disagg_min_tokens < 0 || cfg->prefill_queue_limit < 1
        || cfg->xfer_timeout_ms < 1 || !(cfg->kv_bytes_per_token > 0)
        || cfg->stream_backlog_kb < 1 || cfg->stream_backlog_kb > (1 << 22)
        || cfg->responses_store < 0 || cfg->responses_store > (1 << 24)) {
        fprintf(stderr, "kvworker: numeric options must be positive (--watermark in [0, 1))\n");
        return -1;
    }
    return 0;
}

/*
 * cpu and cuda engines: --model is the model directory; the served model
 * name is its last component, and its tokenizer.json (and chat template)
 * are used unless --tokenizer says otherwise (set up in main).
 */
static kvw_engine_t *real_engine(const kvw_config_t *cfg, struct event_base *base, int index)
{
    kvw_backend_config_t bc;
    kvw_backend_t       *b;
    kvw_engine_t        *e;
    char                 err[512];

    memset(&bc, 0, sizeof(bc));
    bc.model_dir = cfg->model_dir;
    bc.block_size = (uint32_t)cfg->block_size;
    bc.num_blocks = (uint32_t)cfg->num_blocks;
    bc.device = cfg->device;
    /* cuda sizes its scratch (before the pool) for the scheduler's largest step */
    bc.max_batched_tokens = (uint32_t)cfg->max_num_batched_tokens;
    bc.max_seqs = (uint32_t)cfg->max_num_seqs;
    b = strcmp(cfg->engine, "cuda") ? kvw_cpu_backend_create(&bc, err, sizeof(err))
                                    : kvw_cuda_backend_create(&bc, err, sizeof(err));
    if (b == NULL) {
        fprintf(stderr, "kvworker: %s\n", err);
        return NULL;
    }
    e = kvw_sched_create(cfg, base, index, b);
    if (e == NULL)
        b->destroy(b);
    return e;
}

static int exists(const char *path)
{
    return access(path, R_OK) == 0;
}

/* --model DIR for real engines: name, tokenizer and template from it. */
static int real_model(kvw_config_t *cfg)
{
    static char tok[1100], tpl[1100];
    const char *slash;

    if (strcmp(cfg->engine, "mock") == 0)
        return 0;
    if (cfg->model == NULL || strcmp(cfg->model, "kvroute-mock") == 0) {
        fprintf(stderr, "kvworker: --engine %s needs --model DIR\n", cfg->engine);
        return -1;
    }
    cfg->model_dir = cfg->model;
    slash = strrchr(cfg->model_dir, '/');
    cfg->model = slash && slash[1] ? slash + 1 : cfg->model_dir;
    snprintf(tok, sizeof(tok), "%s/tokenizer.json", cfg->model_dir);
    snprintf(tpl, sizeof(tpl), "%s/tokenizer_config.json", cfg->model_dir);
    if (cfg->tokenizer == NULL && exists(tok))
        cfg->tokenizer = tok;
    if (cfg->chat_template == NULL && exists(tpl) && cfg->tokenizer == tok) {
        /* only if it holds a template: kv_chat_load says so */
        char err[256];
        kv_chat_template_t *t = kv_chat_load(tpl, NULL, err, sizeof(err));
        if (t) {
            kv_chat_free(t);
            cfg->chat_template = tpl;
        }
    }
    return 0;
}

int main(int argc, char **argv)
{
    kvw_config_t cfg;
    char err[256];
    int rc = 1;

    memset(&cfg, 0, sizeof(cfg));
    kvw_config_defaults(&cfg);
    if (parse_args(argc, argv, &cfg)) {
        usage(stderr);
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    evthread_use_pthreads();
    if (real_model(&cfg) != 0)
        return 2;
    if (cfg.tokenizer || cfg.chat_template) {
        if (cfg.tokenizer == NULL) {
            fprintf(stderr, "kvworker: --chat-template needs --tokenizer\n");
            return 2;
        }
        cfg.text = kvw_text_load(cfg.tokenizer, cfg.chat_template, cfg.chat_engine,
                                 cfg.chat_kwargs, err, sizeof(err));
        if (cfg.text == NULL) {
            fprintf(stderr, "kvworker: %s\n", err);
            return 2;
        }
    }

    /* precise timers: mock steps last a few ms and must be kept to within 5% */
    struct event_config *ec = event_config_new();
    event_config_set_flag(ec, EVENT_BASE_FLAG_PRECISE_TIMER);
    struct event_base *base = event_base_new_with_config(ec);
    event_config_free(ec);
    kvw_engine_t **engines = calloc((size_t)cfg.engines, sizeof(*engines));
    kvw_http_t **fronts = calloc((size_t)cfg.engines, sizeof(*fronts));
    kvw_nats_t *nats = NULL;
    struct event *sigint = NULL, *sigterm = NULL;
    if (base == NULL || engines == NULL || fronts == NULL) {
        fprintf(stderr, "kvworker: out of memory\n");
        return 1;
    }
    for (int i = 0; i < cfg.engines; i++) {
        engines[i] = strcmp(cfg.engine, "mock") ? real_engine(&cfg, base, i)
                                                : kvw_mock_create(&cfg, base, i);
        if (engines[i] == NULL) {
            fprintf(stderr, "kvworker: cannot create engine %d\n", i);
            goto out;
        }
        engines[i]->worker_id = cfg.worker_id ? cfg.worker_id + (uint64_t)i
                                              : kvw_worker_id_for(cfg.host, cfg.port + i);
        fronts[i] = kvw_http_start(engines[i], cfg.host, cfg.port + i, NULL, NULL,
                                   err, sizeof(err));
        if (fronts[i] == NULL) {
            fprintf(stderr, "kvworker: %s\n", err);
            goto out;
        }
    }
    if (cfg.nats_url) {
        nats = kvw_nats_start(&cfg, base, engines, cfg.engines, err, sizeof(err));
        if (nats == NULL) {
            fprintf(stderr, "kvworker: %s\n", err);
            goto out;
        }
    }
    sigint = evsignal_new(base, SIGINT, on_signal, base);
    sigterm = evsignal_new(base, SIGTERM, on_signal, base);
    evsignal_add(sigint, NULL);
    evsignal_add(sigterm, NULL);

    char safe_url[512] = "";
    if (cfg.nats_url)
        kvw_nats_redact(cfg.nats_url, safe_url, sizeof(safe_url));
    fprintf(stderr, "kvworker: %d %s engine(s) on %s:%d..%d, role %s%s%s\n", cfg.engines,
            cfg.engine, cfg.host, cfg.port, cfg.port + cfg.engines - 1, kvw_role_name(cfg.role),
            cfg.nats_url ? ", nats " : "", safe_url);
    event_base_dispatch(base);
    rc = 0;
out:
    kvw_nats_stop(nats);
    for (int i = 0; i < cfg.engines; i++) {
        kvw_http_stop(fronts[i]);
        if (engines[i])
            engines[i]->ops->destroy(engines[i]);
    }
    if (sigint)
        event_free(sigint);
    if (sigterm)
        event_free(sigterm);
    event_base_free(base);
    free(engines);
    free(fronts);
    return rc;
}
