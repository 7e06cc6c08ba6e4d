/*
 * kvingest: the event ingestion engine on its own, with an index and a
 * registry in plain memory. Prints one JSON stats line every
 * --stats-interval ms (and at exit) on stdout; reads commands on stdin:
 *
 *   match H1 H2 ...   -> {"match":[{"worker_id":..,"dp_rank":..,"blocks":N}]}
 *   stats             -> a stats line now
 *
 * Used by the integration tests (t/integration/test_ingest_*.py) and by
 * operators to watch a NATS event stream without nginx.
 */

#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kv_ingest.h"

static volatile sig_atomic_t stop_flag;

static void on_signal(int sig)
{
    stop_flag = 1;
}

typedef struct {
    kv_index_t      *ix;
    kv_registry_t   *reg;
} host_t;

static void print_stats(const host_t *h, uint64_t now)
{
    kv_ingest_status_t st;
    kv_index_stats_t is;
    kv_registry_status(h->reg, &st);
    kv_index_stats(h->ix, &is);
    printf("{\"ts_ms\":%" PRIu64 ",\"nats\":\"%s\",\"connects\":%" PRIu64
           ",\"disconnects\":%" PRIu64 ",\"messages\":%" PRIu64 ",\"events\":%" PRIu64
           ",\"blocks\":%" PRIu64 ",\"decode_errors\":%" PRIu64 ",\"apply_errors\":%" PRIu64
           ",\"gaps\":%" PRIu64 ",\"resyncs\":%" PRIu64 ",\"dumps\":%" PRIu64
           ",\"dump_failures\":%" PRIu64 ",\"duplicates\":%" PRIu64
           ",\"buffer_overflows\":%" PRIu64 ",\"heartbeats\":%" PRIu64 ",\"timeouts\":%" PRIu64
           ",\"last_event_lag_ms\":%" PRIu64 ",\"rejected\":%" PRIu64 ",\"removed\":%" PRIu64
           ",\"index_blocks\":%" PRIu64 ",\"index_workers\":%" PRIu64 ",\"workers\":[",
           now, kv_nats_state_name(st.nats_state), st.connects, st.disconnects, st.messages,
           st.events, st.blocks, st.decode_errors, st.apply_errors, st.gaps, st.resyncs,
           st.dumps, st.dump_failures, st.duplicates, st.buffer_overflows, st.heartbeats,
           st.timeouts, st.last_event_lag_ms, st.rejected, st.removed, is.blocks, is.workers);
    int first = 1;
    kv_worker_rec_t r;
    for (uint32_t i = 0; i < kv_registry_max_workers(h->reg); i++) {
        if (kv_registry_read(h->reg, (int)i, &r) != 0)
            continue;
        int slot = kv_index_worker_find(h->ix, r.worker_id, r.dp_rank);
        printf("%s{\"worker_id\":%" PRIu64 ",\"dp_rank\":%u,\"state\":\"%s\",\"announced\":%d,"
               "\"address\":\"%s\",\"instance_id\":%" PRIu64 ",\"blocks\":%" PRIu64
               ",\"last_event_applied\":%" PRIu64 ",\"last_event_announced\":%" PRIu64
               ",\"events\":%" PRIu64 ",\"gaps\":%" PRIu64 ",\"resyncs\":%" PRIu64
               ",\"duplicates\":%" PRIu64 ",\"running\":%" PRIu64
               ",\"active_prefill_tokens\":%" PRIu64 "}",
               first ? "" : ",", r.worker_id, r.dp_rank, kv_worker_state_name(r.state),
               r.announced, r.address, r.instance_id,
               slot >= 0 ? kv_index_worker_blocks(h->ix, (uint32_t)slot) : 0,
               r.last_event_applied, r.last_event_announced, r.events, r.gaps, r.resyncs,
               r.duplicates, r.load.running, r.load.active_prefill_tokens);
        first = 0;
    }
    printf("]}\n");
    fflush(stdout);
}

static void do_match(const host_t *h, char *args)
{
    uint64_t seq[1024];
    size_t n = 0;
    for (char *save = NULL, *t = strtok_r(args, " \t\n", &save); t && n < 1024;
         t = strtok_r(NULL, " \t\n", &save))
        seq[n++] = strtoull(t, NULL, 0);
    kv_overlap_t out[256];
    size_t k = kv_index_match(h->ix, seq, n, out, 256);
    printf("{\"match\":[");
    for (size_t i = 0; i < k; i++) {
        uint64_t wid = 0;
        uint32_t dp = 0;
        kv_index_worker_info(h->ix, out[i].slot, &wid, &dp);
        printf("%s{\"worker_id\":%" PRIu64 ",\"dp_rank\":%u,\"blocks\":%u}", i ? "," : "", wid,
               dp, out[i].blocks);
    }
    printf("]}\n");
    fflush(stdout);
}

/* One command line from stdin; 0 on EOF. */
static int read_command(const host_t *h, uint64_t now)
{
    char line[65536];
    if (fgets(line, sizeof(line), stdin) == NULL)
        return 0;
    if (strncmp(line, "match", 5) == 0)
        do_match(h, line + 5);
    else if (strncmp(line, "stats", 5) == 0)
        print_stats(h, now);
    return 1;
}

static void usage(void)
{
    fprintf(stderr,
            "usage: kvingest --nats URL[,URL] [--prefix P] [--subject S]\n"
            "                [--jetstream STREAM --durable NAME] [--stats-interval MS]\n"
            "                [--heartbeat-timeout MS] [--dump-timeout MS] [--stale-lag MS]\n"
            "                [--user U --password P | --token T | --creds FILE]\n"
            "                [--tls-ca F] [--tls-cert F --tls-key F] [--tls-no-verify]\n"
            "                [--index-mb N] [--max-workers N] [--per-worker-only] [-v]\n"
            "       tests only: --test-exit-after-fetch (exit 3 once a JetStream fetch has\n"
            "                messages, before applying or acking them),\n"
            "                --test-drop-fetch-once (discard the first JetStream fetch that\n"
            "                has messages: neither applied nor acked)\n");
}

int main(int argc, char **argv)
{
    kv_ingest_config_t cfg;
    memset(&cfg, 0, sizeof(cfg));
    uint64_t stats_ms = 1000, index_mb = 256;
    uint32_t max_workers = 256;
    static const struct option opts[] = {
        {"nats", 1, 0, 'n'}, {"prefix", 1, 0, 'p'}, {"subject", 1, 0, 's'},
        {"jetstream", 1, 0, 'j'}, {"durable", 1, 0, 'd'}, {"stats-interval", 1, 0, 'i'},
        {"heartbeat-timeout", 1, 0, 'H'}, {"dump-timeout", 1, 0, 'D'}, {"stale-lag", 1, 0, 'L'},
        {"user", 1, 0, 'u'}, {"password", 1, 0, 'P'}, {"token", 1, 0, 't'},
        {"creds", 1, 0, 'c'}, {"tls-ca", 1, 0, 'A'}, {"tls-cert", 1, 0, 'C'},
        {"tls-key", 1, 0, 'K'}, {"tls-no-verify", 0, 0, 'N'}, {"index-mb", 1, 0, 'm'},
        {"max-workers", 1, 0, 'w'}, {"per-worker-only", 0, 0, 'W'},
        {"test-exit-after-fetch", 0, 0, 'X'}, {"test-drop-fetch-once", 0, 0, 'R'},
        {"verbose", 0, 0, 'v'}, {"help", 0, 0, 'h'}, {0, 0, 0, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "vh", opts, NULL)) != -1) {
        switch (c) {
        case 'n': cfg.servers = optarg; break;
        case 'p': cfg.prefix = optarg; break;
        case 's': cfg.event_subject = optarg; break;
        case 'j': cfg.stream = optarg; break;
        case 'd': cfg.durable = optarg; break;
        case 'i': stats_ms = strtoull(optarg, NULL, 10); break;
        case 'H': cfg.heartbeat_timeout_ms = (uint32_t)strtoul(optarg, NULL, 10); break;
        case 'D': cfg.dump_timeout_ms = (uint32_t)strtoul(optarg, NULL, 10); break;
        case 'L': cfg.stale_lag_ms = (uint32_t)strtoul(optarg, NULL, 10); break;
        case 'u': cfg.user = optarg; break;
        case 'P': cfg.password = optarg; break;
        case 't': cfg.token = optarg; break;
        case 'c': cfg.creds = optarg; break;
        case 'A': cfg.tls_ca = optarg; break;
        case 'C': cfg.tls_cert = optarg; break;
        case 'K': cfg.tls_key = optarg; break;
        case 'N': cfg.tls_no_verify = 1; break;
        case 'm': index_mb = strtoull(optarg, NULL, 10); break;
        case 'w': max_workers = (uint32_t)strtoul(optarg, NULL, 10); break;
        case 'W': cfg.per_worker_only = 1; break;
        case 'X': cfg.test_exit_after_fetch = 1; break;
        case 'R': cfg.test_drop_fetch_once = 1; break;
        case 'v': cfg.verbose++; break;
        default: usage(); return c == 'h' ? 0 : 2;
        }
    }
    if (cfg.servers == NULL) {
        usage();
        return 2;
    }
    char err[256];
    kv_index_config_t icfg;
    memset(&icfg, 0, sizeof(icfg));
    icfg.max_workers = max_workers;
    size_t isize = index_mb << 20;
    if (isize < kv_index_min_size(&icfg))
        isize = kv_index_min_size(&icfg);
    size_t rsize = kv_registry_min_size(max_workers);
    void *imem = aligned_alloc(4096, (isize + 4095) & ~(size_t)4095);
    void *rmem = aligned_alloc(4096, (rsize + 4095) & ~(size_t)4095);
    host_t h;
    h.ix = imem ? kv_index_create(imem, isize, &icfg, err, sizeof(err)) : NULL;
    if (h.ix == NULL) {
        fprintf(stderr, "kvingest: index: %s\n", imem ? err : "out of memory");
        return 1;
    }
    h.reg = rmem ? kv_registry_create(rmem, rsize, max_workers, err, sizeof(err)) : NULL;
    if (h.reg == NULL) {
        fprintf(stderr, "kvingest: registry: %s\n", rmem ? err : "out of memory");
        return 1;
    }
    uint32_t gen;
    kv_registry_lease_acquire(h.reg, getpid(), &gen);   /* fresh region: always free */
    kv_ingest_t *ing = kv_ingest_create(&cfg, h.ix, h.reg, err, sizeof(err));
    if (ing == NULL || kv_ingest_start(ing, err, sizeof(err)) < 0) {
        fprintf(stderr, "kvingest: %s\n", err);
        return 1;
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_signal;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);

    int stdin_open = 1;
    uint64_t next_stats = kv_ingest_now_ms() + stats_ms;
    while (!stop_flag) {
        struct pollfd pfd = {.fd = 0, .events = POLLIN};
        int r = poll(&pfd, stdin_open ? 1 : 0, 50);
        uint64_t now = kv_ingest_now_ms();
        if (r > 0 && (pfd.revents & (POLLIN | POLLHUP)))
            stdin_open = read_command(&h, now);
        kv_ingest_tick(ing, now);
        if (stats_ms && now >= next_stats) {
            print_stats(&h, now);
            next_stats = now + stats_ms;
        }
    }
    kv_ingest_stop(ing);
    print_stats(&h, kv_ingest_now_ms());
    kv_ingest_destroy(ing);
    kv_registry_lease_release(h.reg, getpid(), gen);
    free(imem);
    free(rmem);
    return 0;
}
