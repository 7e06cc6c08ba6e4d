/*
 * kvworker: an OpenAI-compatible inference worker. One process hosts one or
 * more engines (--engines N), each on its own port, all on one event loop.
 */
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <event2/event.h>
#include <event2/thread.h>

#include "kvw_engine.h"
#include "kvw_http.h"

static void usage(FILE *f)
{
    fprintf(f,
        "usage: kvworker --engine mock --port PORT [options]\n"
        "  --engine NAME       mock (default)\n"
        "  --host ADDR         listen address (default 127.0.0.1)\n"
        "  --port PORT         first port (default 8001)\n"
        "  --engines N         engines in this process, on PORT..PORT+N-1 (default 1)\n"
        "  --nats URL          publish KV events and heartbeats to NATS\n"
        "  --worker-id ID      event worker id (default: derived from host:port)\n"
        "  --model NAME        model name served (default kvroute-mock)\n"
        "  --block-size N      KV block size in tokens (default 16)\n"
        "  --num-blocks N      KV blocks per engine (default 16384)\n"
        "  --speedup X         divide all simulated times by X (default 1)\n");
}

/* Stand-in until the shared tokenizer lands: one token per byte. */
static long byte_tokenize(void *ctx, const char *text, size_t len, uint32_t **ids)
{
    *ids = malloc((len ? len : 1) * sizeof(uint32_t));
    if (*ids == NULL)
        return -1;
    for (size_t i = 0; i < len; i++)
        (*ids)[i] = (unsigned char)text[i];
    return (long)len;
}

static void on_signal(evutil_socket_t sig, short what, void *arg)
{
    event_base_loopbreak(arg);
}

static int parse_args(int argc, char **argv, kvw_config_t *cfg)
{
    static const struct option opts[] = {
        {"engine", 1, 0, 'e'}, {"host", 1, 0, 'H'}, {"port", 1, 0, 'p'},
        {"engines", 1, 0, 'n'}, {"nats", 1, 0, 'N'}, {"worker-id", 1, 0, 'w'},
        {"model", 1, 0, 'm'}, {"block-size", 1, 0, 'b'}, {"num-blocks", 1, 0, 'B'},
        {"speedup", 1, 0, 's'}, {"help", 0, 0, 'h'}, {0, 0, 0, 0}
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
        case 'h': usage(stdout); exit(0);
        default: return -1;
        }
    }
    if (optind != argc) {
        fprintf(stderr, "kvworker: unexpected argument '%s'\n", argv[optind]);
        return -1;
    }
    if (strcmp(cfg->engine, "mock") != 0) {
        fprintf(stderr, "kvworker: unknown engine '%s'\n", cfg->engine);
        return -1;
    }
    if (cfg->port <= 0 || cfg->port > 65535 || cfg->engines < 1
        || cfg->port + cfg->engines - 1 > 65535) {
        fprintf(stderr, "kvworker: bad --port/--engines\n");
        return -1;
    }
    if (cfg->block_size < 1 || cfg->num_blocks < 1 || cfg->speedup <= 0) {
        fprintf(stderr, "kvworker: --block-size, --num-blocks and --speedup must be positive\n");
        return -1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    kvw_config_t cfg = {
        .engine = "mock", .host = "127.0.0.1", .port = 8001, .engines = 1,
        .model = "kvroute-mock", .block_size = 16, .num_blocks = 16384,
        .speedup = 1.0,
    };
    char err[256];

    if (parse_args(argc, argv, &cfg)) {
        usage(stderr);
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    evthread_use_pthreads();

    struct event_base *base = event_base_new();
    kvw_engine_t **engines = calloc((size_t)cfg.engines, sizeof(*engines));
    kvw_http_t **fronts = calloc((size_t)cfg.engines, sizeof(*fronts));
    if (base == NULL || engines == NULL || fronts == NULL) {
        fprintf(stderr, "kvworker: out of memory\n");
        return 1;
    }
    for (int i = 0; i < cfg.engines; i++) {
        engines[i] = kvw_mock_create(&cfg, base, i);
        if (engines[i] == NULL) {
            fprintf(stderr, "kvworker: cannot create engine %d\n", i);
            return 1;
        }
        fronts[i] = kvw_http_start(engines[i], cfg.host, cfg.port + i, byte_tokenize,
                                   NULL, err, sizeof(err));
        if (fronts[i] == NULL) {
            fprintf(stderr, "kvworker: %s\n", err);
            return 1;
        }
    }
    struct event *sigint = evsignal_new(base, SIGINT, on_signal, base);
    struct event *sigterm = evsignal_new(base, SIGTERM, on_signal, base);
    evsignal_add(sigint, NULL);
    evsignal_add(sigterm, NULL);

    fprintf(stderr, "kvworker: %d %s engine(s) on %s:%d..%d\n", cfg.engines, cfg.engine,
            cfg.host, cfg.port, cfg.port + cfg.engines - 1);
    event_base_dispatch(base);

    for (int i = 0; i < cfg.engines; i++) {
        kvw_http_stop(fronts[i]);
        engines[i]->ops->destroy(engines[i]);
    }
    event_free(sigint);
    event_free(sigterm);
    event_base_free(base);
    free(engines);
    free(fronts);
    return 0;
}
