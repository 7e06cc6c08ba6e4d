/*
 * kvrelay: subscribes to one vLLM / SGLang ZMQ KV event publisher and
 * republishes its events on NATS in Dynamo's RouterEvent format
 * (docs/PROTOCOL.md), so several nginx instances (kvroute_events nats://)
 * consume one engine's stream.
 *
 *   kvrelay --zmq tcp://10.0.0.5:5557 [--replay tcp://10.0.0.5:5558]
 *           --server 10.0.0.5:8000 [--worker-id N] --nats nats://127.0.0.1:4222
 *           [--subject S] [--block-size N] [--verbose]
 *
 * Ingestion (sequence numbers, replay of gaps, restarts, hashes recomputed
 * from token_ids with the LoRA seed) is kv_zmq's, the same code the nginx
 * helper runs; this file only turns each applied batch into one NATS
 * message, a JSON array of RouterEvents:
 *   - worker_id: --worker-id, else the id kvroute assumes for --server
 *     (kv_hash_worker_id), so nginx matches it to that server line;
 *   - event_id: the relay's own, from 1, +1 per event; when the engine
 *     restarts or a gap cannot be recovered, the relay publishes "cleared"
 *     with event_id 1 again, which makes every consumer drop what it held
 *     for the worker (an unannounced worker's sequence restarting at 1);
 *     the relay's first event after it starts is such a "cleared";
 *   - stored blocks: block_hash = the engine's hash as kvroute reads it
 *     (int bit-cast, bytes XXH3-64), tokens_hash = the recomputed local hash;
 *   - storage_tier: device, host_pinned or disk by medium (NATS consumers
 *     route on device blocks only); blocks without token ids are dropped.
 * It exits 0 on SIGINT/SIGTERM after printing its counters.
 */
#include <getopt.h>
#include <inttypes.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <nats/nats.h>

#include "kv_hash.h"
#include "kv_index.h"
#include "kv_registry.h"
#include "kv_vllm_event.h"
#include "kv_zmq.h"

typedef struct {
    natsConnection *nc;
    const char     *subject;
    uint64_t        worker_id;
    uint32_t        block_size;
    uint64_t        event_id;       /* last published */
    int             cleared_sent;
    char           *buf;
    size_t          len, cap;
    uint64_t        messages, events, blocks, dropped, mismatched, publish_errors;
    int             verbose;
} relay_t;

static volatile sig_atomic_t quit;

static void on_signal(int sig)
{
    (void) sig;
    quit = 1;
}

static void out(relay_t *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void out(relay_t *r, const char *fmt, ...)
{
    va_list ap;
    int     n;

    for (;;) {
        va_start(ap, fmt);
        n = vsnprintf(r->buf + r->len, r->cap - r->len, fmt, ap);
        va_end(ap);
        if (n >= 0 && (size_t) n < r->cap - r->len) {
            r->len += (size_t) n;
            return;
        }
        r->cap = r->cap * 2 + (size_t) n + 64;
        r->buf = realloc(r->buf, r->cap);
        if (r->buf == NULL) {
            fprintf(stderr, "kvrelay: out of memory\n");
            exit(1);
        }
    }
}

static const char *tier_name(uint32_t tier)
{
    return tier == KV_TIER_DEVICE ? "device" : tier == KV_TIER_HOST ? "host_pinned" : "disk";
}

static void head(relay_t *r, uint32_t tier)
{
    out(r, "%s{\"worker_id\":%" PRIu64 ",\"storage_tier\":\"%s\",\"event\":{\"event_id\":%"
        PRIu64 ",\"data\":", r->len > 1 ? "," : "", r->worker_id, tier_name(tier),
        ++r->event_id);
}

static void publish(relay_t *r)
{
    if (r->len <= 1) {
        return;
    }
    out(r, "]");
    if (natsConnection_Publish(r->nc, r->subject, r->buf, (int) r->len) != NATS_OK) {
        r->publish_errors++;
    }
    r->messages++;
}

static void cleared(relay_t *r, uint32_t dp)
{
    r->event_id = 0;
    head(r, KV_TIER_DEVICE);
    out(r, "\"cleared\",\"dp_rank\":%u}}", dp);
    r->events++;
}

static void sink(void *arg, size_t pub, const kv_vllm_batch_t *b)
{
    relay_t  *r = arg;
    size_t    i, k;
    uint64_t  seed;
    /* one publisher, one --server: that engine is the server whatever
     * data-parallel rank it names (as kv_zmq credits a sole publisher),
     * and routing reads a server's rank 0 */
    uint32_t  dp = 0;

    (void) pub;
    r->len = 0;
    out(r, "[");
    if (b == NULL || !r->cleared_sent) {
        cleared(r, dp);
        r->cleared_sent = 1;
        if (b == NULL) {
            publish(r);
            return;
        }
    }
    for (i = 0; i < b->n_events; i++) {
        const kv_vllm_event_t *e = &b->events[i];

        switch (e->kind) {
        case KV_VLLM_STORED:
            if (e->n_tokens == 0) {
                r->dropped++;
                continue;
            }
            if (r->block_size && e->block_size != r->block_size) {
                if (r->mismatched++ == 0) {
                    fprintf(stderr, "kvrelay: BLOCK SIZE MISMATCH: the engine uses %u-token "
                            "blocks, --block-size is %u: its stores are not relayed\n",
                            e->block_size, r->block_size);
                }
                continue;
            }
            seed = kv_vllm_lora_seed(e);
            head(r, e->tier);
            out(r, "{\"stored\":{\"parent_hash\":");
            if (e->has_parent) {
                out(r, "%" PRIu64, e->parent);
            } else {
                out(r, "null");
            }
            out(r, ",\"start_position\":null,\"blocks\":[");
            for (k = 0; k < e->n_hashes; k++) {
                out(r, "%s{\"block_hash\":%" PRIu64 ",\"tokens_hash\":%" PRIu64
                    ",\"mm_extra_info\":null}", k ? "," : "", e->hashes[k],
                    kv_hash_block(e->tokens + k * e->block_size, e->block_size, seed));
            }
            out(r, "]}},\"dp_rank\":%u}}", dp);
            r->blocks += e->n_hashes;
            break;
        case KV_VLLM_REMOVED:
            head(r, e->tier);
            out(r, "{\"removed\":{\"block_hashes\":[");
            for (k = 0; k < e->n_hashes; k++) {
                out(r, "%s%" PRIu64, k ? "," : "", e->hashes[k]);
            }
            out(r, "]}},\"dp_rank\":%u}}", dp);
            r->blocks += e->n_hashes;
            break;
        case KV_VLLM_CLEARED:
            head(r, KV_TIER_DEVICE);
            out(r, "\"cleared\",\"dp_rank\":%u}}", dp);
            break;
        }
        r->events++;
    }
    publish(r);
}

static void usage(void)
{
    fprintf(stderr,
            "usage: kvrelay --zmq URL [--replay URL] --server HOST:PORT [--worker-id N]\n"
            "               --nats URL [--subject S] [--block-size N] [--verbose]\n"
            "  --subject defaults to namespace.dynamo.component.backend.kv-events\n");
    exit(2);
}

static const char *tcp(const char *u)
{
    char *s;

    if (strncmp(u, "zmq://", 6) != 0) {
        return u;
    }
    s = malloc(strlen(u) + 1);
    sprintf(s, "tcp://%s", u + 6);
    return s;
}

int main(int argc, char **argv)
{
    static struct option opts[] = {
        { "zmq", required_argument, 0, 'z' }, { "replay", required_argument, 0, 'r' },
        { "server", required_argument, 0, 's' }, { "worker-id", required_argument, 0, 'w' },
        { "nats", required_argument, 0, 'n' }, { "subject", required_argument, 0, 'j' },
        { "block-size", required_argument, 0, 'b' }, { "verbose", no_argument, 0, 'v' },
        { 0, 0, 0, 0 }
    };
    kv_zmq_pub_config_t pc = { 0 };
    kv_zmq_config_t     zc = { 0 };
    kv_index_config_t   ic = { 0 };
    relay_t             r = { 0 };
    const char         *nats_url = NULL;
    natsOptions        *no = NULL;
    kv_index_t         *ix;
    kv_registry_t      *reg;
    kv_zmq_t           *z;
    kv_zmq_pub_stats_t  st;
    char                err[256];
    size_t              n;
    uint32_t            gen;
    int                 c;

    r.subject = "namespace.dynamo.component.backend.kv-events";
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'z': pc.endpoint = tcp(optarg); break;
        case 'r': pc.replay = tcp(optarg); break;
        case 's': pc.server = optarg; break;
        case 'w': r.worker_id = strtoull(optarg, NULL, 10); break;
        case 'n': nats_url = optarg; break;
        case 'j': r.subject = optarg; break;
        case 'b': r.block_size = (uint32_t) atoi(optarg); break;
        case 'v': r.verbose = 1; break;
        default: usage();
        }
    }
    if (pc.endpoint == NULL || pc.server == NULL || nats_url == NULL) {
        usage();
    }
    if (r.worker_id == 0) {
        r.worker_id = kv_hash_worker_id(pc.server, strlen(pc.server));
    }

    /* NATS first, retrying: events must have somewhere to go */
    if (natsOptions_Create(&no) != NATS_OK
        || natsOptions_SetURL(no, nats_url) != NATS_OK
        || natsOptions_SetMaxReconnect(no, -1) != NATS_OK
        || natsOptions_SetReconnectWait(no, 250) != NATS_OK
        || natsOptions_SetRetryOnFailedConnect(no, true, NULL, NULL) != NATS_OK)
    {
        fprintf(stderr, "kvrelay: bad NATS options\n");
        return 1;
    }
    if (natsConnection_Connect(&r.nc, no) != NATS_OK && r.nc == NULL) {
        fprintf(stderr, "kvrelay: cannot connect to %s\n", nats_url);
        return 1;
    }

    /* kv_zmq keeps its own index of the worker (the relay's status) */
    ic.max_workers = 4;
    n = kv_index_min_size(&ic) + (64u << 20);
    ix = kv_index_create(calloc(1, n), n, &ic, err, sizeof(err));
    n = kv_registry_min_size(4);
    reg = kv_registry_create(calloc(1, n), n, 4, err, sizeof(err));
    if (ix == NULL || reg == NULL) {
        fprintf(stderr, "kvrelay: %s\n", err);
        return 1;
    }
    kv_registry_lease_acquire(reg, getpid(), &gen);
    zc.pubs = &pc;
    zc.n_pubs = 1;
    zc.verbose = r.verbose;
    zc.sink = sink;
    zc.sink_arg = &r;
    z = kv_zmq_create(&zc, ix, reg, err, sizeof(err));
    if (z == NULL || kv_zmq_start(z, err, sizeof(err)) != 0) {
        fprintf(stderr, "kvrelay: %s\n", err);
        return 1;
    }
    signal(SIGINT, on_signal);
    signal(SIGTERM, on_signal);
    fprintf(stderr, "kvrelay: %s -> %s %s (worker_id %" PRIu64 ")\n", pc.endpoint, nats_url,
            r.subject, r.worker_id);
    while (!quit) {
        struct timespec ts = { 0, 100 * 1000000 };

        nanosleep(&ts, NULL);
        kv_zmq_tick(z, 0);
    }
    kv_zmq_pub_stats(z, 0, &st);
    kv_zmq_stop(z);
    natsConnection_Flush(r.nc);
    printf("{\"messages_in\":%" PRIu64 ",\"messages_out\":%" PRIu64 ",\"events\":%" PRIu64
           ",\"blocks\":%" PRIu64 ",\"malformed\":%" PRIu64 ",\"gaps\":%" PRIu64
           ",\"replays\":%" PRIu64 ",\"restarts\":%" PRIu64 ",\"dropped\":%" PRIu64
           ",\"publish_errors\":%" PRIu64 "}\n", st.messages, r.messages, r.events, r.blocks,
           st.malformed, st.gaps, st.replays, st.restarts, r.dropped, r.publish_errors);
    fflush(stdout);
    kv_zmq_destroy(z);
    natsConnection_Destroy(r.nc);
    natsOptions_Destroy(no);
    free(r.buf);
    return 0;
}
