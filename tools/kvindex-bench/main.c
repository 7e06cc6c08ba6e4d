/*
 * kvindex-bench: the prefix index (kv_index.h) and the event decoder under
 * a synthetic load; prints one JSON line.
 *
 *   --blocks N          blocks to index (default 1000000); the region is
 *                       sized so that its capacity just covers N
 *   --capacity N        size the region for N blocks instead (>= --blocks):
 *                       the table's load is blocks / entries, and entries
 *                       are a power of two, so this sets the load a match
 *                       probes at (1M blocks: 2^21 entries, load 0.48, by
 *                       default; --capacity 2000000 gives 2^22, load 0.24)
 *   --workers N         worker slots in use (default 64)
 *   --request-blocks N  blocks per document and per match (default 256)
 *   --readers N         reader threads matching while the writer ingests (1)
 *   --seconds S         length of the match-under-write phase (default 2)
 *   --hugepages         madvise(MADV_HUGEPAGE) the regions (transparent huge
 *                       pages for private memory; nginx's shared zones get
 *                       them only where shmem_enabled allows, so off by default)
 *   --hot-request       copy each request's hashes to the reader's own buffer
 *                       before the clock starts, as nginx's caller has them
 *                       (just computed by kv_hash_blocks) when it matches;
 *                       without it the match also pays for reading a random
 *                       2 KB request out of an 8 MB array (the figures
 *                       before 2026-11-24 07:00 UTC)
 *   --write-rate N      pace phase 3's writer to N blocks/s (default 0: as
 *                       fast as it can, one core's worth; a fleet of 64
 *                       engines storing 10k tokens/s each in 16-token
 *                       blocks sends 40k blocks/s)
 *   --churn N           before phase 3, N times a document is removed whole
 *                       by its owner, deepest block first (as an engine
 *                       evicts a finished conversation), and stored by the
 *                       next worker (where the conversation lands next): an
 *                       index that keeps state for what is gone shows it
 *                       here (holes, lost_slots, a match that walks)
 *
 * The load: N / request-blocks documents, each a chain of request-blocks
 * sequence hashes. Events are kvworker-style stores of 16 blocks with a
 * parent link (block_hash == sequence hash). Phases:
 *   1. ingest: every document stored by one worker, then other workers
 *      store prefixes of them (decoded events applied; blocks per second);
 *   2. decode+apply: the same first stream rendered as JSON messages, each
 *      decoded and applied into a second, empty index;
 *   3. match under write: readers match whole documents (each held whole
 *      by its owner, so every match walks all request blocks) while the
 *      writer keeps storing and removing other workers' prefixes; per-call
 *      latency percentiles;
 *   4. the host's floor: a loop of arithmetic that touches no memory, sized
 *      so its median equals the match's, timed as often with the same clock
 *      and the writer stopped. Its tail is what the machine adds to any
 *      operation that long (a hypervisor taking the core, interrupts): the
 *      match's p99 cannot be below it on this machine.
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "kv_event.h"
#include "kv_hash.h"
#include "kv_index.h"

#define CHUNK 16

static uint64_t blocks_n = 1000000, room_n = 0, workers_n = 64, req_n = 256, readers_n = 1;
static double   seconds = 2.0, write_rate = 0;
static int      hugepages;
static int      hot_request;
static uint64_t churn_n;

static uint64_t *docs;          /* [ndocs][req_n] sequence hashes */
static uint64_t *toks;          /* the local hashes they chain */
static uint64_t  ndocs;
static kv_index_t *ix;
static atomic_int  stop;

static double now_s(void)
{
    struct timespec t;

    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double) t.tv_sec + (double) t.tv_nsec / 1e9;
}

static uint64_t rnd(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static kv_index_t *make_index(uint64_t want, size_t *size_out)
{
    kv_index_config_t cfg = { .max_workers = (uint32_t) workers_n };
    kv_index_stats_t  st;
    char              err[256];
    size_t            size = kv_index_min_size(&cfg);

    /* the smallest power-of-two-ish region whose capacity covers want */
    for (;;) {
        size_t      alloc = (size + (2 << 20) - 1) & ~(size_t) ((2 << 20) - 1);
        void       *r = aligned_alloc(2 << 20, alloc);
        kv_index_t *x;

        if (r == NULL) {
            fprintf(stderr, "out of memory\n");
            exit(1);
        }
        if (hugepages) {
            madvise(r, alloc, MADV_HUGEPAGE);
        }
        x = kv_index_create(r, size, &cfg, err, sizeof(err));
        if (x == NULL) {
            fprintf(stderr, "kv_index_create: %s\n", err);
            exit(1);
        }
        kv_index_stats(x, &st);
        if (st.capacity >= want) {
            *size_out = size;
            return x;
        }
        free(r);
        size += size / 8;
    }
}

/* One store event of blocks [from, from + CHUNK) of doc d by worker w. */
static void make_store(kv_event_t *ev, kv_stored_block_t *b, uint64_t w, uint64_t d,
                       uint64_t from)
{
    uint64_t i;

    memset(ev, 0, sizeof(*ev));
    ev->worker_id = w;
    ev->kind = KV_EVENT_STORED;
    ev->has_parent = from > 0;
    ev->parent_hash = from > 0 ? docs[d * req_n + from - 1] : 0;
    for (i = 0; i < CHUNK; i++) {
        b[i].block_hash = docs[d * req_n + from + i];
        b[i].tokens_hash = toks[d * req_n + from + i];
    }
    ev->blocks = b;
    ev->n_blocks = CHUNK;
}

static int render_json(char *out, size_t cap, const kv_event_t *ev, uint64_t id)
{
    size_t n = 0, i;

    n += (size_t) snprintf(out + n, cap - n,
                           "{\"worker_id\":%" PRIu64 ",\"storage_tier\":\"device\",\"event\":"
                           "{\"event_id\":%" PRIu64 ",\"data\":{\"stored\":{\"parent_hash\":",
                           ev->worker_id, id);
    n += ev->has_parent ? (size_t) snprintf(out + n, cap - n, "%" PRIu64, ev->parent_hash)
                        : (size_t) snprintf(out + n, cap - n, "null");
    n += (size_t) snprintf(out + n, cap - n, ",\"start_position\":null,\"blocks\":[");
    for (i = 0; i < ev->n_blocks; i++) {
        n += (size_t) snprintf(out + n, cap - n,
                               "%s{\"block_hash\":%" PRIu64 ",\"tokens_hash\":%" PRIu64
                               ",\"mm_extra_info\":null}", i ? "," : "",
                               ev->blocks[i].block_hash, ev->blocks[i].tokens_hash);
    }
    n += (size_t) snprintf(out + n, cap - n, "]}},\"dp_rank\":0}}");
    return (int) n;
}

typedef struct {
    uint64_t  seed;
    double   *lat;          /* microseconds */
    uint32_t *doc;          /* the document each match was of */
    size_t    n, cap;
} reader_t;

static void *reader_main(void *arg)
{
    reader_t     *r = arg;
    kv_overlap_t  out[256];
    uint64_t     *req = malloc(req_n * sizeof(uint64_t)), *seq;
    volatile size_t sink = 0;

    while (!atomic_load_explicit(&stop, memory_order_relaxed) && r->n < r->cap) {
        uint64_t d = rnd(&r->seed) % ndocs;
        double   t0;

        seq = &docs[d * req_n];
        if (hot_request) {
            memcpy(req, seq, req_n * sizeof(uint64_t));
            seq = req;
        }
        t0 = now_s();
        sink += kv_index_match(ix, seq, req_n, out, 256);
        r->lat[r->n] = (now_s() - t0) * 1e6;
        r->doc[r->n++] = (uint32_t) d;
    }
    (void) sink;
    free(req);
    return NULL;
}

/* A chain of dependent multiplies: no loads, no stores, so its time is the
 * core's alone; the result is returned so the loop is not optimised away. */
static uint64_t spin(uint64_t n)
{
    uint64_t x = n, i;

    for (i = 0; i < n; i++) {
        x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    }
    return x;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *) a, y = *(const double *) b;

    return x < y ? -1 : x > y;
}

/* `n` spins of length `len`, each timed, sorted into `lat` (microseconds). */
static void time_spins(uint64_t len, double *lat, size_t n)
{
    volatile uint64_t sink = 0;
    size_t            i;
    double            t0;

    for (i = 0; i < n; i++) {
        t0 = now_s();
        sink += spin(len);
        lat[i] = (now_s() - t0) * 1e6;
    }
    qsort(lat, n, sizeof(double), cmp_d);
}

/* Phase 4: `n` timed spins sized so their median is `target_us`, sorted
 * into `lat`. Sizing: three rounds of up to 2,001 spins, each scaling the
 * length by target / median. */
static void host_floor(double target_us, double *lat, size_t n)
{
    uint64_t len = 256;
    size_t   round, m = n < 2001 ? n : 2001;

    for (round = 0; round < 3; round++) {
        time_spins(len, lat, m);
        len = (uint64_t) ((double) len * target_us / (lat[m / 2] > 0 ? lat[m / 2] : 1e-3));
        len = len ? len : 1;
    }
    time_spins(len, lat, n);
}

typedef struct {
    uint32_t doc;
    double   us;
} doc_lat_t;

static int cmp_doc_lat(const void *a, const void *b)
{
    const doc_lat_t *x = a, *y = b;

    if (x->doc != y->doc) return x->doc < y->doc ? -1 : 1;
    return x->us < y->us ? -1 : x->us > y->us;
}

/* The p99 over documents of each document's median match time. A document's
 * matches do the same work each time, so its median drops the host's random
 * stalls (phase 4) and keeps what the work itself costs, probe chains and
 * all. Documents matched fewer than 5 times are left out. */
static double doc_median_p99(reader_t *rd, size_t nrd)
{
    doc_lat_t *m;
    double    *med, p;
    size_t     i, j, n = 0, nmed = 0;

    for (i = 0; i < nrd; i++) n += rd[i].n;
    m = malloc((n + 1) * sizeof(doc_lat_t));
    med = malloc((ndocs + 1) * sizeof(double));
    for (i = 0, n = 0; i < nrd; i++) {
        for (j = 0; j < rd[i].n; j++, n++) {
            m[n].doc = rd[i].doc[j];
            m[n].us = rd[i].lat[j];
        }
    }
    qsort(m, n, sizeof(doc_lat_t), cmp_doc_lat);
    for (i = 0; i < n; i = j) {
        for (j = i; j < n && m[j].doc == m[i].doc; j++) {}
        if (j - i >= 5) med[nmed++] = m[i + (j - i) / 2].us;
    }
    qsort(med, nmed, sizeof(double), cmp_d);
    p = nmed ? med[nmed * 99 / 100] : 0.0;
    free(m);
    free(med);
    return p;
}

/* Sleep until the clock reads `until` (the paced writer's next store). */
static void pace(double until)
{
    double          left = until - now_s();
    struct timespec ts;

    if (left > 0) {
        ts.tv_sec = (time_t) left;
        ts.tv_nsec = (long) ((left - (double) ts.tv_sec) * 1e9);
        nanosleep(&ts, NULL);
    }
}

static void usage(void)
{
    fprintf(stderr, "usage: kvindex-bench [--blocks N] [--capacity N] [--workers N] "
                    "[--request-blocks N] [--readers N] [--seconds S] [--hugepages] [--hot-request]\n"
                    "       [--churn N] [--write-rate N]\n");
    exit(2);
}

int main(int argc, char **argv)
{
    kv_event_t        *evs;
    kv_stored_block_t *blk;
    kv_index_stats_t   st;
    kv_event_batch_t   batch;
    char               err[256], *json;
    size_t             size, size2, *joff, i, nev, nj, jcap;
    uint64_t           seed = 88172645463325252ULL, d, k, c, applied = 0, held_max;
    uint8_t           *held;
    double             t0, ingest_s, decode_s, decode_blocks = 0;
    pthread_t         *th;
    reader_t          *rd;
    double            *all, *floor_lat;
    size_t             nfloor;
    double             doc_p99;
    size_t             nall = 0;
    uint64_t           wrote = 0, evicted_before, first;

    for (i = 1; i < (size_t) argc; i++) {
        if (!strcmp(argv[i], "--hot-request")) {
            hot_request = 1;
            continue;
        }
        if (!strcmp(argv[i], "--hugepages")) {
            hugepages = 1;
            continue;
        }
        if (i + 1 >= (size_t) argc) usage();
        if (!strcmp(argv[i], "--blocks")) blocks_n = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--capacity")) room_n = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--workers")) workers_n = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--request-blocks")) req_n = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--readers")) readers_n = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--seconds")) seconds = strtod(argv[++i], NULL);
        else if (!strcmp(argv[i], "--churn")) churn_n = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--write-rate")) write_rate = strtod(argv[++i], NULL);
        else usage();
    }
    if (workers_n == 0 || workers_n > 4096 || req_n < CHUNK || blocks_n < req_n) usage();
    if (room_n < blocks_n) room_n = blocks_n;
    req_n = req_n / CHUNK * CHUNK;
    ndocs = blocks_n / req_n;
    docs = malloc(ndocs * req_n * sizeof(uint64_t));
    toks = malloc(ndocs * req_n * sizeof(uint64_t));
    for (d = 0; d < ndocs; d++) {
        for (k = 0; k < req_n; k++) {
            uint64_t t = rnd(&seed);

            toks[d * req_n + k] = t;
            docs[d * req_n + k] = k == 0 ? t : kv_hash_chain(docs[d * req_n + k - 1], t);
        }
    }
    ix = make_index(room_n, &size);

    /* 1. every doc stored whole by one worker (all distinct blocks), then
     * as many stores again by other workers of random prefixes */
    nev = 2 * ndocs * (req_n / CHUNK);
    evs = malloc(nev * sizeof(kv_event_t));
    blk = malloc(nev * CHUNK * sizeof(kv_stored_block_t));
    held = calloc(ndocs * workers_n, 1);
    for (i = 0, d = 0; d < ndocs; d++) {
        uint64_t w = d % workers_n;

        for (k = 0; k < req_n; k += CHUNK, i++) {
            make_store(&evs[i], &blk[i * CHUNK], w, d, k);
        }
        held[d * workers_n + w] = (uint8_t) (req_n / CHUNK);
    }
    held_max = req_n / CHUNK;
    while (i < nev) {
        uint64_t w = rnd(&seed) % workers_n, h;

        d = rnd(&seed) % ndocs;
        h = held[d * workers_n + w];
        if (h == held_max) continue;
        make_store(&evs[i], &blk[i * CHUNK], w, d, h * CHUNK);
        held[d * workers_n + w] = (uint8_t) (h + 1);
        i++;
    }
    t0 = now_s();
    for (i = 0; i < nev; i++) {
        if (kv_index_apply(ix, &evs[i], 1000 + i / 1024, err, sizeof(err)) == 0) {
            applied += evs[i].n_blocks;
        }
    }
    ingest_s = now_s() - t0;

    /* 2. JSON bytes -> decode -> apply, into a second index */
    {
        kv_index_t *saved = ix;
        size_t      limit = nev / 2 < 65536 ? nev / 2 : 65536;

        ix = make_index(room_n, &size2);
        jcap = limit * (CHUNK * 90 + 256);
        json = malloc(jcap);
        joff = malloc((limit + 1) * sizeof(size_t));
        for (i = 0, nj = 0; i < limit; i++) {
            joff[i] = nj;
            nj += (size_t) render_json(json + nj, jcap - nj, &evs[i], i);
        }
        joff[limit] = nj;
        kv_event_batch_init(&batch);
        t0 = now_s();
        for (i = 0; i < limit; i++) {
            if (kv_event_decode(&batch, json + joff[i], joff[i + 1] - joff[i], err,
                                sizeof(err)) != 0)
            {
                fprintf(stderr, "decode: %s\n", err);
                return 1;
            }
            for (k = 0; k < batch.n_events; k++) {
                kv_index_apply(ix, &batch.events[k], 1000, err, sizeof(err));
                decode_blocks += (double) batch.events[k].n_blocks;
            }
        }
        decode_s = now_s() - t0;
        kv_event_batch_free(&batch);
        free(json);
        free(joff);
        free((void *) ix);
        ix = saved;
    }

    /* churn: whole documents removed by their owners, tail first, and
     * stored by the next worker, as conversations come and go */
    for (c = 0; c < churn_n; c++) {
        kv_stored_block_t b[CHUNK];
        kv_event_t        ev;
        uint64_t          w;

        d = c % ndocs;
        w = (d + c / ndocs) % workers_n;
        for (k = req_n; k-- > 0; ) {
            memset(&ev, 0, sizeof(ev));
            ev.worker_id = w;
            ev.kind = KV_EVENT_REMOVED;
            ev.hashes = &docs[d * req_n + k];
            ev.n_hashes = 1;
            kv_index_apply(ix, &ev, 2000, err, sizeof(err));
        }
        for (k = 0; k < req_n; k += CHUNK) {
            make_store(&ev, b, (w + 1) % workers_n, d, k);
            kv_index_apply(ix, &ev, 2000, err, sizeof(err));
        }
    }

    /* 3. readers match while the writer re-stores and removes prefixes */
    kv_index_stats(ix, &st);
    evicted_before = st.evicted;
    th = calloc(readers_n, sizeof(pthread_t));
    rd = calloc(readers_n, sizeof(reader_t));
    atomic_store(&stop, 0);
    for (i = 0; i < readers_n; i++) {
        rd[i].seed = 0x9E3779B97F4A7C15ULL * (i + 1);
        rd[i].cap = 4000000;
        rd[i].lat = malloc(rd[i].cap * sizeof(double));
        rd[i].doc = malloc(rd[i].cap * sizeof(uint32_t));
        pthread_create(&th[i], NULL, reader_main, &rd[i]);
    }
    t0 = now_s();
    /* the writer replays the second stream (other workers' prefixes) and
     * removes one tail block of another such prefix per store: owners keep
     * their whole documents, so every match walks all request blocks */
    first = ndocs * (req_n / CHUNK);
    for (i = first; now_s() - t0 < seconds; i = i + 1 < nev ? i + 1 : first) {
        kv_event_t rm;
        uint64_t   j;

        kv_index_apply(ix, &evs[i], 5000, err, sizeof(err));
        memset(&rm, 0, sizeof(rm));
        j = first + (i * 7919) % (nev - first);
        rm.worker_id = evs[j].worker_id;
        rm.kind = KV_EVENT_REMOVED;
        rm.hashes = &evs[j].blocks[CHUNK - 1].block_hash;
        rm.n_hashes = 1;
        kv_index_apply(ix, &rm, 5000, err, sizeof(err));
        wrote += CHUNK + 1;
        if (write_rate > 0) {
            pace(t0 + (double) wrote / write_rate);
        }
    }
    atomic_store(&stop, 1);
    for (i = 0; i < readers_n; i++) {
        pthread_join(th[i], NULL);
        nall += rd[i].n;
    }
    all = malloc((nall + 1) * sizeof(double));
    doc_p99 = doc_median_p99(rd, readers_n);
    for (i = 0, nall = 0; i < readers_n; i++) {
        memcpy(all + nall, rd[i].lat, rd[i].n * sizeof(double));
        nall += rd[i].n;
    }
    qsort(all, nall, sizeof(double), cmp_d);
    kv_index_stats(ix, &st);

    /* 4. the host's floor for an operation as long as the median match */
    nfloor = nall < 1000000 ? nall : 1000000;
    floor_lat = malloc((nfloor + 1) * sizeof(double));
    if (nfloor) host_floor(all[nall / 2], floor_lat, nfloor);

    printf("{\"blocks\":%" PRIu64 ",\"workers\":%" PRIu64 ",\"request_blocks\":%" PRIu64
           ",\"readers\":%" PRIu64 ",\"write_rate\":%.0f,\"churn\":%" PRIu64 ",\"hugepages\":%d,\"hot_request\":%d,\"ingest_blocks_per_s\":%.0f,"
           "\"decode_apply_blocks_per_s\":%.0f,\"match_p50_us\":%.3f,\"match_p99_us\":%.3f,"
           "\"match_p999_us\":%.3f,\"host_p50_us\":%.3f,\"host_p99_us\":%.3f,"
           "\"host_p999_us\":%.3f,\"doc_median_p99_us\":%.3f,\"matches\":%zu,\"write_blocks_per_s_during_match\":%.0f,"
           "\"bytes_per_block\":%.1f,\"region_bytes\":%zu,\"capacity\":%" PRIu64
           ",\"indexed\":%" PRIu64 ",\"evictions\":%" PRIu64 ",\"evictions_during_match\":%"
           PRIu64 ",\"holes\":%" PRIu64 ",\"lost_slots\":%" PRIu64 "}\n",
           blocks_n, workers_n, req_n, readers_n, write_rate, churn_n, hugepages, hot_request, (double) applied / ingest_s,
           decode_blocks / decode_s, nall ? all[nall / 2] : 0.0,
           nall ? all[nall * 99 / 100] : 0.0, nall ? all[nall * 999 / 1000] : 0.0,
           nfloor ? floor_lat[nfloor / 2] : 0.0, nfloor ? floor_lat[nfloor * 99 / 100] : 0.0,
           nfloor ? floor_lat[nfloor * 999 / 1000] : 0.0, doc_p99, nall,
           (double) wrote / seconds, (double) size / (double) st.capacity, size,
           st.capacity, st.blocks, st.evicted, st.evicted - evicted_before, st.holes,
           st.lost_slots);
    return 0;
}
