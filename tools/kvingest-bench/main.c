/*
 * kvingest-bench: event ingestion through a real nats-server into the live
 * index (the same kv_ingest the nginx helper runs; it applies on one cnats
 * delivery thread).
 *
 *   --mode throughput  publisher threads send RouterEvent JSON batches as
 *                      fast as the ingester keeps up (bounded in flight);
 *                      prints blocks applied per second
 *   --mode latency     one publisher at --rate blocks/s stamps each message;
 *                      a reader polls kv_index_match for the message's new
 *                      chain and prints publish-to-visible p50/p99/max
 *   --jetstream S --durable D  either, through a JetStream stream and
 *                      durable pull consumer (the helper's fetch loop)
 *                      instead of a core NATS subscription
 *
 * Each event stores a new chain of --blocks blocks; once --window chains
 * are held per worker, the oldest is removed in the same batch, so the
 * index stays bounded while it keeps changing.
 */

#include <dirent.h>
#include <getopt.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <nats/nats.h>

#include "kv_ingest.h"
#include "kv_proto.h"

#define SUBJECT KV_PROTO_DEFAULT_PREFIX KV_PROTO_EVENTS

static const char *url = "nats://127.0.0.1:4222";
static int publishers = 1, blocks = 32, events_per_msg = 8, window = 64;
static double seconds = 5, rate = 100000;
static kv_index_t *ix;
static kv_registry_t *reg;
static volatile int stop_all;
static uint64_t published_msgs;

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t applied_msgs(void)
{
    kv_ingest_status_t st;
    kv_registry_status(reg, &st);
    return st.messages;
}

/* Chain c of worker w: block i has engine hash and tokens hash derived from
 * (w, c mod ring, i); chains are reused only long after their removal. */
static uint64_t bhash(int w, uint64_t c, int i)
{
    return ((uint64_t)(w + 1) << 48) ^ ((c % 65536) << 16) ^ (uint64_t)i ^ 0x5bd1e995ull;
}

static uint64_t thash(int w, uint64_t c, int i)
{
    return bhash(w, c, i) * 0x9E3779B97F4A7C15ull + 1;     /* full u64, as engines send */
}

typedef struct {
    char   *buf;
    size_t  len, cap;
} sbuf_t;

static void put(sbuf_t *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(sbuf_t *s, const char *fmt, ...)
{
    va_list ap;
    for (;;) {
        va_start(ap, fmt);
        int n = vsnprintf(s->buf + s->len, s->cap - s->len, fmt, ap);
        va_end(ap);
        if ((size_t)n < s->cap - s->len) {
            s->len += (size_t)n;
            return;
        }
        s->cap *= 2;
        s->buf = realloc(s->buf, s->cap);
    }
}

/* One store event for chain c (plus, past the window, a removal of chain
 * c - window); returns the number of events written. */
static int put_events(sbuf_t *s, int w, uint64_t c, uint64_t *eid, int first)
{
    put(s, "%s{\"worker_id\":%d,\"storage_tier\":\"device\",\"event\":{\"event_id\":%" PRIu64
           ",\"data\":{\"stored\":{\"parent_hash\":null,\"start_position\":null,\"blocks\":[",
        first ? "" : ",", w + 1, ++*eid);
    for (int i = 0; i < blocks; i++)
        put(s, "%s{\"block_hash\":%" PRIu64 ",\"tokens_hash\":%" PRIu64 ",\"mm_extra_info\":null}",
            i ? "," : "", bhash(w, c, i), thash(w, c, i));
    put(s, "]}},\"dp_rank\":0}}");
    if (c < (uint64_t)window)
        return 1;
    put(s, ",{\"worker_id\":%d,\"storage_tier\":\"device\",\"event\":{\"event_id\":%" PRIu64
           ",\"data\":{\"removed\":{\"block_hashes\":[", w + 1, ++*eid);
    for (int i = 0; i < blocks; i++)
        put(s, "%s%" PRIu64, i ? "," : "", bhash(w, c - (uint64_t)window, i));
    put(s, "]}},\"dp_rank\":0}}");
    return 2;
}

static natsConnection *connect_pub(void)
{
    natsConnection *nc = NULL;
    if (natsConnection_ConnectTo(&nc, url) != NATS_OK) {
        fprintf(stderr, "kvingest-bench: cannot connect to %s\n", url);
        exit(1);
    }
    return nc;
}

/* --jetstream: the stream made before the ingester starts (as kv_ingest
 * would make it), so that what is published before its consumer is bound
 * is kept for it, not dropped (the bench counts every message). */
static void make_stream(const char *stream)
{
    natsConnection *nc = connect_pub();
    jsCtx *js = NULL;
    jsStreamConfig sc;
    const char *subjects[2] = {SUBJECT, SUBJECT ".*"};
    jsStreamConfig_Init(&sc);
    sc.Name = stream;
    sc.Subjects = subjects;
    sc.SubjectsLen = 2;
    sc.Storage = js_FileStorage;
    sc.MaxBytes = (int64_t)1 << 30;
    if (natsConnection_JetStream(&js, nc, NULL) != NATS_OK
        || js_AddStream(NULL, js, &sc, NULL, NULL) != NATS_OK) {
        fprintf(stderr, "kvingest-bench: cannot make the stream %s\n", stream);
        exit(1);
    }
    jsCtx_Destroy(js);
    natsConnection_Destroy(nc);
}

/* CPU seconds of every thread not named "kvb-*": cnats' threads, of which
 * the event subscription's delivery thread (where kv_ingest applies) is
 * the busy one. Returns the largest; *total: all of them. */
static double busiest_cnats_thread_cpu(double *total)
{
    double best = 0;
    *total = 0;
    DIR *d = opendir("/proc/self/task");
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL) {
        char path[300], buf[1024];
        if (e->d_name[0] == '.')
            continue;
        snprintf(path, sizeof(path), "/proc/self/task/%s/stat", e->d_name);
        FILE *f = fopen(path, "r");
        if (f == NULL)
            continue;
        size_t n = fread(buf, 1, sizeof(buf) - 1, f);
        fclose(f);
        buf[n] = '\0';
        char *open = strchr(buf, '('), *close = strrchr(buf, ')');
        if (!open || !close || strncmp(open + 1, "kvb-", 4) == 0)
            continue;
        unsigned long ut = 0, st = 0;
        /* fields after ')': state ppid pgrp session tty tpgid flags minflt
         * cminflt majflt cmajflt utime stime */
        if (sscanf(close + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut, &st)
            == 2) {
            double cpu = (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
            *total += cpu;
            if (cpu > best)
                best = cpu;
        }
    }
    if (d)
        closedir(d);
    return best;
}

static void *throughput_pub(void *arg)
{
    int w = (int)(intptr_t)arg;
    pthread_setname_np(pthread_self(), "kvb-pub");
    natsConnection *nc = connect_pub();
    sbuf_t s = {malloc(1 << 16), 0, 1 << 16};
    uint64_t eid = 0, c = 0;
    while (!stop_all) {
        /* keep a bounded number of messages in flight: measure the
         * ingester's sustained rate, not NATS's buffers */
        while (!stop_all && __atomic_load_n(&published_msgs, __ATOMIC_RELAXED) >
                                applied_msgs() + 256 * (uint64_t)publishers)
            usleep(50);
        s.len = 0;
        put(&s, "[");
        for (int e = 0; e < events_per_msg; e++)
            put_events(&s, w, c++, &eid, e == 0);
        put(&s, "]");
        natsConnection_Publish(nc, SUBJECT, s.buf, (int)s.len);
        __atomic_fetch_add(&published_msgs, 1, __ATOMIC_RELAXED);
    }
    natsConnection_Flush(nc);
    natsConnection_Destroy(nc);
    free(s.buf);
    return NULL;
}

static void *ticker(void *arg)
{
    kv_ingest_t *ing = arg;
    pthread_setname_np(pthread_self(), "kvb-tick");
    while (!stop_all) {
        kv_ingest_tick(ing, kv_ingest_now_ms());
        usleep(50000);
    }
    return NULL;
}

static void run_throughput(void)
{
    kv_ingest_status_t a, b;
    pthread_t th[64];
    for (int p = 0; p < publishers; p++)
        pthread_create(&th[p], NULL, throughput_pub, (void *)(intptr_t)p);
    usleep(1000000);                                /* warm up */
    kv_registry_status(reg, &a);
    double a0, a1, c0 = busiest_cnats_thread_cpu(&a0);
    uint64_t t0 = mono_ns();
    usleep((useconds_t)(seconds * 1e6));
    kv_registry_status(reg, &b);
    double c1 = busiest_cnats_thread_cpu(&a1);
    uint64_t t1 = mono_ns();
    stop_all = 1;
    for (int p = 0; p < publishers; p++)
        pthread_join(th[p], NULL);
    double dt = (double)(t1 - t0) / 1e9;
    printf("{\"bench\":\"ingest_throughput\",\"publishers\":%d,\"blocks_per_event\":%d,"
           "\"events_per_msg\":%d,\"seconds\":%.2f,\"block_ops_per_s\":%.0f,"
           "\"stored_blocks_per_s\":%.0f,\"events_per_s\":%.0f,\"msgs_per_s\":%.0f,"
           "\"ingest_thread_cpu\":%.2f,\"ingest_all_threads_cpu\":%.2f,\"block_ops_per_ingest_cpu_s\":%.0f,"
           "\"decode_errors\":%" PRIu64 ",\"apply_errors\":%" PRIu64 "}\n",
           publishers, blocks, events_per_msg, dt, (double)(b.blocks - a.blocks) / dt,
           (double)(b.blocks - a.blocks) / dt / 2, (double)(b.events - a.events) / dt,
           (double)(b.messages - a.messages) / dt, (c1 - c0) / dt, (a1 - a0) / dt,
           c1 > c0 ? (double)(b.blocks - a.blocks) / (c1 - c0) : 0.0, b.decode_errors,
           b.apply_errors);
}

/* --- latency ------------------------------------------------------------ */

#define LAT_MAX (1 << 20)
static uint64_t *pub_ns, *lat_ns;
static uint64_t lat_published, lat_seen;

static void *latency_pub(void *arg)
{
    pthread_setname_np(pthread_self(), "kvb-pub");
    natsConnection *nc = connect_pub();
    sbuf_t s = {malloc(1 << 16), 0, 1 << 16};
    uint64_t eid = 0;
    double msg_blocks = (double)blocks * events_per_msg;
    uint64_t gap_ns = (uint64_t)(1e9 * msg_blocks / rate), next = mono_ns();
    for (uint64_t m = 0; !stop_all && m < LAT_MAX; m++) {
        uint64_t now = mono_ns();
        if (now < next) {
            struct timespec ts = {(time_t)((next - now) / 1000000000u),
                                  (long)((next - now) % 1000000000u)};
            nanosleep(&ts, NULL);
        }
        next += gap_ns;
        s.len = 0;
        put(&s, "[");
        for (int e = 0; e < events_per_msg; e++)
            put_events(&s, 0, m * (uint64_t)events_per_msg + (uint64_t)e, &eid, e == 0);
        put(&s, "]");
        pub_ns[m] = mono_ns();
        natsConnection_Publish(nc, SUBJECT, s.buf, (int)s.len);
        natsConnection_Flush(nc);
        __atomic_store_n(&lat_published, m + 1, __ATOMIC_RELEASE);
    }
    natsConnection_Destroy(nc);
    free(s.buf);
    return NULL;
}

/* Polls the index for the last chain each message stores (the first event
 * of the message would be removed by a later one only far in the future). */
static void *latency_reader(void *arg)
{
    pthread_setname_np(pthread_self(), "kvb-reader");
    kv_overlap_t out[8];
    for (uint64_t m = 0; !stop_all && m < LAT_MAX;) {
        if (m >= __atomic_load_n(&lat_published, __ATOMIC_ACQUIRE)) {
            usleep(20);
            continue;
        }
        uint64_t c = m * (uint64_t)events_per_msg + (uint64_t)events_per_msg - 1;
        uint64_t seq = thash(0, c, 0);
        if (kv_index_match(ix, &seq, 1, out, 8) > 0) {
            lat_ns[m] = mono_ns() - pub_ns[m];
            __atomic_store_n(&lat_seen, m + 1, __ATOMIC_RELEASE);
            m++;
        } else {
            usleep(10);
        }
    }
    return NULL;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static void run_latency(void)
{
    pub_ns = calloc(LAT_MAX, sizeof(uint64_t));
    lat_ns = calloc(LAT_MAX, sizeof(uint64_t));
    pthread_t p, r;
    pthread_create(&r, NULL, latency_reader, NULL);
    pthread_create(&p, NULL, latency_pub, NULL);
    usleep((useconds_t)(seconds * 1e6));
    stop_all = 1;
    pthread_join(p, NULL);
    pthread_join(r, NULL);
    uint64_t n = lat_seen, skip = n / 10;          /* first 10%: warm-up */
    if (n < 20) {
        printf("{\"bench\":\"ingest_latency\",\"error\":\"only %" PRIu64 " samples\"}\n", n);
        return;
    }
    uint64_t *v = lat_ns + skip;
    n -= skip;
    qsort(v, n, sizeof(*v), cmp_u64);
    printf("{\"bench\":\"ingest_latency\",\"rate_blocks_per_s\":%.0f,\"blocks_per_event\":%d,"
           "\"events_per_msg\":%d,\"samples\":%" PRIu64 ",\"p50_ms\":%.3f,\"p99_ms\":%.3f,"
           "\"max_ms\":%.3f}\n",
           rate, blocks, events_per_msg, n, v[n / 2] / 1e6, v[n * 99 / 100] / 1e6,
           v[n - 1] / 1e6);
}

int main(int argc, char **argv)
{
    const char *mode = "throughput";
    static const struct option opts[] = {
        {"nats", 1, 0, 'n'}, {"mode", 1, 0, 'm'}, {"seconds", 1, 0, 's'},
        {"publishers", 1, 0, 'p'}, {"blocks", 1, 0, 'b'}, {"events-per-msg", 1, 0, 'e'},
        {"rate", 1, 0, 'r'}, {"window", 1, 0, 'w'}, {"jetstream", 1, 0, 'j'},
        {"durable", 1, 0, 'd'}, {0, 0, 0, 0}};
    const char *stream = NULL, *durable = NULL;
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'n': url = optarg; break;
        case 'm': mode = optarg; break;
        case 's': seconds = atof(optarg); break;
        case 'p': publishers = atoi(optarg); break;
        case 'b': blocks = atoi(optarg); break;
        case 'e': events_per_msg = atoi(optarg); break;
        case 'r': rate = atof(optarg); break;
        case 'w': window = atoi(optarg); break;
        case 'j': stream = optarg; break;
        case 'd': durable = optarg; break;
        default:
            fprintf(stderr, "usage: kvingest-bench --nats URL [--mode throughput|latency] "
                            "[--seconds S] [--publishers N] [--blocks B] [--events-per-msg E] "
                            "[--rate BLOCKS_PER_S] [--window CHAINS] "
                            "[--jetstream STREAM --durable NAME]\n");
            return 2;
        }
    }
    if (publishers < 1 || publishers > 64 || blocks < 1 || blocks > 4096 || events_per_msg < 1
        || window < 1 || (stream == NULL) != (durable == NULL)) {
        fprintf(stderr, "kvingest-bench: bad arguments\n");
        return 2;
    }
    char err[256];
    kv_index_config_t icfg;
    memset(&icfg, 0, sizeof(icfg));
    size_t isize = (size_t)512 << 20;
    if (isize < kv_index_min_size(&icfg))
        isize = kv_index_min_size(&icfg);
    size_t rsize = kv_registry_min_size(0);
    void *imem = aligned_alloc(4096, isize), *rmem = aligned_alloc(4096, (rsize + 4095) & ~4095ul);
    ix = kv_index_create(imem, isize, &icfg, err, sizeof(err));
    reg = ix ? kv_registry_create(rmem, rsize, 0, err, sizeof(err)) : NULL;
    if (reg == NULL) {
        fprintf(stderr, "kvingest-bench: %s\n", err);
        return 1;
    }
    kv_ingest_config_t cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.servers = url;
    cfg.stream = stream;
    cfg.durable = durable;
    if (stream)
        make_stream(stream);
    kv_ingest_t *ing = kv_ingest_create(&cfg, ix, reg, err, sizeof(err));
    if (ing == NULL || kv_ingest_start(ing, err, sizeof(err)) < 0) {
        fprintf(stderr, "kvingest-bench: %s\n", err);
        return 1;
    }
    for (int i = 0; i < 200; i++) {
        kv_ingest_status_t st;
        kv_registry_status(reg, &st);
        if (st.nats_state == KV_NATS_CONNECTED)
            break;
        usleep(10000);
    }
    usleep(100000);                                 /* subscriptions reach the server */
    pthread_t tk;
    pthread_create(&tk, NULL, ticker, ing);
    if (strcmp(mode, "latency") == 0)
        run_latency();
    else
        run_throughput();
    stop_all = 1;
    pthread_join(tk, NULL);
    kv_ingest_destroy(ing);
    free(imem);
    free(rmem);
    return 0;
}
