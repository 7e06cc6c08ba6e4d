/*
 * kvzmq-bench: vLLM-format KV events over a real libzmq PUB socket (and a
 * ROUTER replay socket) on loopback into kv_zmq, the ingester the nginx
 * helper runs, applying into a live kv_index.
 *
 *   --mode throughput  a publisher thread sends KVEventBatch messages of
 *                      --events BlockStored events of --blocks blocks (16
 *                      token ids each, a new chain per event; past --window
 *                      chains the oldest is removed in the same batch) as
 *                      fast as the ingester keeps up (at most 256 messages
 *                      in flight); prints block ops applied per second
 *   --mode latency     one 32-block event per message at --rate blocks/s;
 *                      after each send the publisher polls kv_index_match
 *                      for the new chain: publish-to-visible p50/p99/max
 *   --mode replay      --gap messages (one 32-block event each) are kept in
 *                      the replay buffer but not sent, then one is sent:
 *                      the time from that send until the ingester has
 *                      replayed the gap and the last chain is visible
 */
#include <dirent.h>
#include <getopt.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sched.h>

#include <zmq.h>

#include "kv_hash.h"
#include "kv_index.h"
#include "kv_registry.h"
#include "kv_zmq.h"

#define BS 16

static int      blocks = 32, events = 8, window = 64, gap = 10000;
static double   seconds = 5, rate = 100000;
static const char *mode = "throughput";

static kv_index_t    *ix;
static kv_registry_t *reg;
static kv_zmq_t      *z;
static void          *ctx, *pub, *router;
static uint64_t       seqno;

/* replay buffer: every message's payload by seq */
static uint8_t      **rbuf;
static size_t        *rlen;
static size_t         rcap;
static pthread_mutex_t rmu = PTHREAD_MUTEX_INITIALIZER;
static volatile int   stop_all;

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t) ts.tv_sec * 1000000000ull + (uint64_t) ts.tv_nsec;
}

static double wall_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double) ts.tv_sec + ts.tv_nsec / 1e9;
}

/* --- msgpack ------------------------------------------------------------------ */

typedef struct {
    uint8_t *b;
    size_t   n, cap;
} mp_t;

static void need(mp_t *m, size_t k)
{
    if (m->n + k > m->cap) {
        m->cap = (m->cap + k) * 2;
        m->b = realloc(m->b, m->cap);
    }
}

static void be(mp_t *m, uint64_t v, int bytes)
{
    int i;
    need(m, (size_t) bytes);
    for (i = bytes - 1; i >= 0; i--) {
        m->b[m->n++] = (uint8_t) (v >> (8 * i));
    }
}

static void mp_byte(mp_t *m, uint8_t c) { need(m, 1); m->b[m->n++] = c; }

static void mp_arr(mp_t *m, uint32_t n)
{
    if (n < 16) mp_byte(m, (uint8_t) (0x90 | n));
    else if (n < 65536) { mp_byte(m, 0xdc); be(m, n, 2); }
    else { mp_byte(m, 0xdd); be(m, n, 4); }
}

static void mp_uint(mp_t *m, uint64_t v)
{
    if (v < 128) mp_byte(m, (uint8_t) v);
    else if (v < 65536) { mp_byte(m, 0xcd); be(m, v, 2); }
    else if (v <= UINT32_MAX) { mp_byte(m, 0xce); be(m, v, 4); }
    else { mp_byte(m, 0xcf); be(m, v, 8); }
}

static void mp_str(mp_t *m, const char *s)
{
    size_t n = strlen(s);
    mp_byte(m, (uint8_t) (0xa0 | n));
    need(m, n);
    memcpy(m->b + m->n, s, n);
    m->n += n;
}

static void mp_f64(mp_t *m, double d)
{
    uint64_t v;
    memcpy(&v, &d, 8);
    mp_byte(m, 0xcb);
    be(m, v, 8);
}

/* Chain c: blocks engine hashes c*blocks+1.., tokens from c*blocks*BS. */
static void ev_stored(mp_t *m, uint64_t c)
{
    uint64_t i;
    uint32_t t0 = (uint32_t) (c * (uint64_t) blocks * BS);

    mp_arr(m, 7);
    mp_str(m, "BlockStored");
    mp_arr(m, (uint32_t) blocks);
    for (i = 0; i < (uint64_t) blocks; i++) {
        mp_uint(m, c * blocks + i + 1);
    }
    mp_byte(m, 0xc0);
    mp_arr(m, (uint32_t) (blocks * BS));
    for (i = 0; i < (uint64_t) blocks * BS; i++) {
        mp_uint(m, (t0 + i) & 0x7fffffff);
    }
    mp_uint(m, BS);
    mp_byte(m, 0xc0);
    mp_str(m, "GPU");
}

static void ev_removed(mp_t *m, uint64_t c)
{
    uint64_t i;

    mp_arr(m, 3);
    mp_str(m, "BlockRemoved");
    mp_arr(m, (uint32_t) blocks);
    for (i = 0; i < (uint64_t) blocks; i++) {
        mp_uint(m, c * blocks + i + 1);
    }
    mp_str(m, "GPU");
}

/* One message: chains [c0, c0 + n) stored, and removals past the window. */
static void message(mp_t *m, uint64_t c0, int n, int *removed)
{
    int k, nrm = 0;

    for (k = 0; k < n; k++) {
        nrm += c0 + (uint64_t) k >= (uint64_t) window;
    }
    m->n = 0;
    mp_arr(m, 2);
    mp_f64(m, wall_s());
    mp_arr(m, (uint32_t) (n + nrm));
    for (k = 0; k < n; k++) {
        ev_stored(m, c0 + (uint64_t) k);
        if (c0 + (uint64_t) k >= (uint64_t) window) {
            ev_removed(m, c0 + (uint64_t) k - (uint64_t) window);
        }
    }
    *removed = nrm;
}

static void send_msg(const mp_t *m, int live)
{
    uint8_t  s[8];
    uint64_t v = seqno;
    int      i;

    for (i = 7; i >= 0; i--) {
        s[i] = (uint8_t) v;
        v >>= 8;
    }
    pthread_mutex_lock(&rmu);
    if (seqno >= rcap) {
        rcap = rcap ? rcap * 2 : 65536;
        rbuf = realloc(rbuf, rcap * sizeof(*rbuf));
        rlen = realloc(rlen, rcap * sizeof(*rlen));
    }
    rbuf[seqno] = malloc(m->n);
    memcpy(rbuf[seqno], m->b, m->n);
    rlen[seqno] = m->n;
    pthread_mutex_unlock(&rmu);
    if (live) {
        zmq_send(pub, "", 0, ZMQ_SNDMORE);
        zmq_send(pub, s, 8, ZMQ_SNDMORE);
        zmq_send(pub, m->b, m->n, 0);
    }
    seqno++;
}

/* vLLM's _service_replay */
static void *replay_thread(void *arg)
{
    zmq_pollitem_t it = { router, 0, ZMQ_POLLIN, 0 };
    uint8_t        id[256], s[8], start_b[8];
    uint64_t       start, k, v;
    int            idn, i;

    (void) arg;
    while (!stop_all) {
        if (zmq_poll(&it, 1, 50) <= 0) {
            continue;
        }
        idn = zmq_recv(router, id, sizeof(id), 0);
        zmq_recv(router, s, 8, 0);              /* empty delimiter */
        zmq_recv(router, start_b, 8, 0);
        for (start = 0, i = 0; i < 8; i++) {
            start = start << 8 | start_b[i];
        }
        pthread_mutex_lock(&rmu);
        for (k = start; k < seqno; k++) {
            for (v = k, i = 7; i >= 0; i--) {
                s[i] = (uint8_t) v;
                v >>= 8;
            }
            zmq_send(router, id, (size_t) idn, ZMQ_SNDMORE);
            zmq_send(router, "", 0, ZMQ_SNDMORE);
            zmq_send(router, s, 8, ZMQ_SNDMORE);
            zmq_send(router, rbuf[k], rlen[k], 0);
        }
        pthread_mutex_unlock(&rmu);
        memset(s, 0xff, 8);
        zmq_send(router, id, (size_t) idn, ZMQ_SNDMORE);
        zmq_send(router, "", 0, ZMQ_SNDMORE);
        zmq_send(router, s, 8, ZMQ_SNDMORE);
        zmq_send(router, "", 0, 0);
    }
    return NULL;
}

/* CPU seconds of this process's threads whose name starts with prefix. */
static double threads_cpu(const char *prefix)
{
    DIR           *d = opendir("/proc/self/task");
    struct dirent *de;
    char           path[300], buf[1024], *p;
    double         total = 0;
    FILE          *f;
    unsigned long  ut, st;
    int            i;

    if (d == NULL) {
        return 0;
    }
    while ((de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.') {
            continue;
        }
        snprintf(path, sizeof(path), "/proc/self/task/%s/comm", de->d_name);
        if ((f = fopen(path, "r")) == NULL) {
            continue;
        }
        buf[0] = 0;
        if (fgets(buf, sizeof(buf), f) == NULL) {
            buf[0] = 0;
        }
        fclose(f);
        if (strncmp(buf, prefix, strlen(prefix)) != 0) {
            continue;
        }
        snprintf(path, sizeof(path), "/proc/self/task/%s/stat", de->d_name);
        if ((f = fopen(path, "r")) == NULL) {
            continue;
        }
        if (fgets(buf, sizeof(buf), f) != NULL && (p = strrchr(buf, ')')) != NULL) {
            /* fields after ") ": state is field 3; utime 14, stime 15 */
            for (i = 0; i < 11 && p; i++) {
                p = strchr(p + 1, ' ');
            }
            if (p && sscanf(p + 1, "%lu %lu", &ut, &st) == 2) {
                total += (double) (ut + st) / (double) sysconf(_SC_CLK_TCK);
            }
        }
        fclose(f);
    }
    closedir(d);
    return total;
}

static uint64_t applied_msgs(void)
{
    kv_ingest_status_t st;
    kv_registry_status(reg, &st);
    return st.messages;
}

/* Whether chain c is fully visible in the index. */
static int visible(uint64_t c)
{
    static uint32_t tok[4096];
    static uint64_t seq[256];
    kv_overlap_t    out[4];
    uint32_t        t0 = (uint32_t) (c * (uint64_t) blocks * BS);
    size_t          i, n;

    for (i = 0; i < (size_t) blocks * BS; i++) {
        tok[i] = (t0 + (uint32_t) i) & 0x7fffffff;
    }
    n = kv_hash_blocks(tok, (size_t) blocks * BS, BS, KV_HASH_SEED, NULL, seq);
    return kv_index_match(ix, seq, n, out, 4) == 1 && out[0].blocks == n;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *) a, y = *(const uint64_t *) b;
    return x < y ? -1 : x > y;
}

/* Until the ingester has joined: a message whose chain becomes visible. */
static uint64_t warm_up(mp_t *m)
{
    uint64_t c = 0, t;
    int      rm;

    for (;;) {
        message(m, c, 1, &rm);
        send_msg(m, 1);
        t = mono_ns();
        while (mono_ns() - t < 200000000ull) {
            if (visible(c)) {
                return c + 1;
            }
            usleep(1000);
        }
        c++;
    }
}

int main(int argc, char **argv)
{
    static struct option opts[] = {
        { "mode", required_argument, 0, 'm' }, { "seconds", required_argument, 0, 's' },
        { "blocks", required_argument, 0, 'b' }, { "events", required_argument, 0, 'e' },
        { "window", required_argument, 0, 'w' }, { "rate", required_argument, 0, 'r' },
        { "gap", required_argument, 0, 'g' }, { 0, 0, 0, 0 }
    };
    kv_index_config_t   ic = { 0 };
    kv_zmq_pub_config_t pc = { 0 };
    kv_zmq_config_t     zc = { 0 };
    char                err[256], ep[64], rp[64];
    size_t              n, len;
    uint32_t            gen;
    int                 c, zero = 0, port, rport;
    pthread_t           rt;
    mp_t                m = { 0 };
    uint64_t            chain, t0, t1, ops = 0, stored = 0, sent = 0;
    struct timespec     cpu0, cpu1;
    double              el, cpu, zcpu0, zcpu1, iocpu0, iocpu1;
    void               *ixmem, *regmem;
    uint64_t            q;

    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'm': mode = optarg; break;
        case 's': seconds = atof(optarg); break;
        case 'b': blocks = atoi(optarg); break;
        case 'e': events = atoi(optarg); break;
        case 'w': window = atoi(optarg); break;
        case 'r': rate = atof(optarg); break;
        case 'g': gap = atoi(optarg); break;
        default:
            fprintf(stderr, "usage: kvzmq-bench [--mode throughput|latency|replay] "
                    "[--seconds S] [--blocks N] [--events N] [--window N] [--rate R] "
                    "[--gap N]\n");
            return 2;
        }
    }
    if (blocks < 1 || blocks > 256) {
        fprintf(stderr, "kvzmq-bench: --blocks must be 1..256\n");
        return 2;
    }

    ctx = zmq_ctx_new();
    pub = zmq_socket(ctx, ZMQ_PUB);
    router = zmq_socket(ctx, ZMQ_ROUTER);
    zmq_setsockopt(pub, ZMQ_SNDHWM, &zero, sizeof(zero));
    zmq_setsockopt(router, ZMQ_SNDHWM, &zero, sizeof(zero));
    zmq_setsockopt(pub, ZMQ_LINGER, &zero, sizeof(zero));
    zmq_setsockopt(router, ZMQ_LINGER, &zero, sizeof(zero));
    if (zmq_bind(pub, "tcp://127.0.0.1:*") != 0 || zmq_bind(router, "tcp://127.0.0.1:*") != 0) {
        fprintf(stderr, "kvzmq-bench: bind: %s\n", zmq_strerror(zmq_errno()));
        return 1;
    }
    len = sizeof(ep);
    zmq_getsockopt(pub, ZMQ_LAST_ENDPOINT, ep, &len);
    len = sizeof(rp);
    zmq_getsockopt(router, ZMQ_LAST_ENDPOINT, rp, &len);
    (void) port;
    (void) rport;
    pthread_create(&rt, NULL, replay_thread, NULL);

    ic.max_workers = 8;
    n = kv_index_min_size(&ic) + (512u << 20);
    ixmem = calloc(1, n);
    ix = kv_index_create(ixmem, n, &ic, err, sizeof(err));
    n = kv_registry_min_size(8);
    regmem = calloc(1, n);
    reg = kv_registry_create(regmem, n, 8, err, sizeof(err));
    if (ix == NULL || reg == NULL) {
        fprintf(stderr, "kvzmq-bench: %s\n", err);
        return 1;
    }
    kv_registry_lease_acquire(reg, getpid(), &gen);
    pc.endpoint = ep;
    pc.replay = rp;
    pc.server = "127.0.0.1:8000";
    zc.pubs = &pc;
    zc.n_pubs = 1;
    zc.block_size = BS;
    zc.replay_timeout_ms = 30000;
    zc.hold_messages = 1000000;
    z = kv_zmq_create(&zc, ix, reg, err, sizeof(err));
    if (z == NULL || kv_zmq_start(z, err, sizeof(err)) != 0) {
        fprintf(stderr, "kvzmq-bench: %s\n", err);
        return 1;
    }
    chain = warm_up(&m);
    while (applied_msgs() < seqno) {
        usleep(1000);
    }

    if (strcmp(mode, "throughput") == 0) {
        int rm;

        clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &cpu0);
        zcpu0 = threads_cpu("kvroute-zmq");
        iocpu0 = threads_cpu("ZMQbg");
        t0 = mono_ns();
        sent = seqno;
        while ((el = (mono_ns() - t0) / 1e9) < seconds) {
            while (seqno - applied_msgs() > 256) {
                sched_yield();
            }
            message(&m, chain, events, &rm);
            chain += (uint64_t) events;
            send_msg(&m, 1);
            stored += (uint64_t) events * blocks;
            ops += (uint64_t) (events + rm) * blocks;
        }
        while (applied_msgs() < seqno) {
            sched_yield();
        }
        t1 = mono_ns();
        clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &cpu1);
        zcpu1 = threads_cpu("kvroute-zmq");
        iocpu1 = threads_cpu("ZMQbg");
        el = (t1 - t0) / 1e9;
        cpu = (cpu1.tv_sec - cpu0.tv_sec) + (cpu1.tv_nsec - cpu0.tv_nsec) / 1e9;
        printf("{\"mode\":\"throughput\",\"seconds\":%.2f,\"messages\":%" PRIu64
               ",\"block_ops_per_s\":%.0f,\"stored_blocks_per_s\":%.0f,"
               "\"process_cpu_cores\":%.2f,\"ingest_thread_cpu\":%.2f,"
               "\"zmq_io_threads_cpu\":%.2f,\"block_ops_per_ingest_cpu_s\":%.0f,"
               "\"bytes_per_message\":%zu}\n",
               el, seqno - sent, ops / el, stored / el, cpu / el, (zcpu1 - zcpu0) / el,
               (iocpu1 - iocpu0) / el, zcpu1 > zcpu0 ? ops / (zcpu1 - zcpu0) : 0, m.n);
    } else if (strcmp(mode, "latency") == 0) {
        size_t    k, cnt = (size_t) (rate / blocks * seconds), warm = cnt / 10;
        uint64_t *lat = calloc(cnt, sizeof(uint64_t));
        uint64_t  period = (uint64_t) (1e9 * blocks / rate), next = mono_ns();
        int       rm;

        for (k = 0; k < cnt; k++) {
            while (mono_ns() < next) {
                sched_yield();
            }
            next += period;
            message(&m, chain, 1, &rm);
            t0 = mono_ns();
            send_msg(&m, 1);
            while (!visible(chain) && mono_ns() - t0 < 1000000000ull) {
                sched_yield();
            }
            lat[k] = mono_ns() - t0;
            chain++;
        }
        qsort(lat + warm, cnt - warm, sizeof(uint64_t), cmp_u64);
        n = cnt - warm;
        printf("{\"mode\":\"latency\",\"rate_blocks_per_s\":%.0f,\"samples\":%zu,"
               "\"p50_ms\":%.3f,\"p99_ms\":%.3f,\"max_ms\":%.3f}\n", rate, n,
               lat[warm + n / 2] / 1e6, lat[warm + n * 99 / 100] / 1e6, lat[cnt - 1] / 1e6);
        free(lat);
    } else if (strcmp(mode, "replay") == 0) {
        int                rm, k;
        kv_zmq_pub_stats_t st;

        window = 1 << 30;                       /* stores only */
        for (k = 0; k < gap; k++) {
            message(&m, chain++, 1, &rm);
            send_msg(&m, 0);                    /* lost on the way */
        }
        message(&m, chain, 1, &rm);
        t0 = mono_ns();
        send_msg(&m, 1);
        while (!visible(chain) || !visible(chain - 1)) {
            usleep(100);
            if (mono_ns() - t0 > 60000000000ull) {
                fprintf(stderr, "kvzmq-bench: replay not done in 60 s\n");
                return 1;
            }
        }
        t1 = mono_ns();
        kv_zmq_pub_stats(z, 0, &st);
        printf("{\"mode\":\"replay\",\"gap_messages\":%d,\"gap_blocks\":%d,"
               "\"recovery_ms\":%.1f,\"replays\":%" PRIu64 ",\"replay_failures\":%" PRIu64
               ",\"cleared\":%" PRIu64 "}\n", gap, gap * blocks, (t1 - t0) / 1e6, st.replays,
               st.replay_failures, st.restarts);
    } else {
        fprintf(stderr, "kvzmq-bench: unknown mode %s\n", mode);
        return 2;
    }
    fflush(stdout);
    stop_all = 1;
    kv_zmq_destroy(z);
    pthread_join(rt, NULL);
    zmq_close(pub);
    zmq_close(router);
    zmq_ctx_term(ctx);
    for (q = 0; q < seqno; q++) {
        free(rbuf[q]);
    }
    free(rbuf);
    free(rlen);
    free(m.b);
    free(ixmem);
    free(regmem);
    return 0;
}
