/*
 * Worker registry in a fixed region (see kv_registry.h).
 *
 * Layout: header | records[max_workers]. Offsets only.
 *
 * Seqlock per record (kv_seqlock.h): a reader copies the record with
 * relaxed atomic word loads between two reads of an even, unchanged count
 * and gives up after a bounded number of tries.
 *
 * Lease: one 64-bit word, pid in the high half, generation in the low.
 * Acquire CASes from a free or dead holder to (pid, gen + 1), so a stale
 * helper that wakes up finds a different generation and knows it lost.
 */
#include "kv_registry.h"
#include "kv_clock.h"
#include "kv_seqlock.h"

#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>

#define REG_MAGIC   0x6b76726567310000ull   /* "kvreg1" */
#define REG_VERSION 2u

typedef struct {
    kv_seqlock_t    seq;
    uint32_t        pad;
    kv_worker_rec_t rec;
    kv_selfcheck_t  sc;             /* atomics, outside the seqlock: any process adds */
} reg_slot_t;

struct kv_registry {
    uint64_t            magic;
    uint32_t            version;
    uint32_t            max_workers;
    uint64_t            size;
    uint64_t            lease;          /* pid << 32 | generation */
    uint64_t            high;           /* records ever used: bound for scans */
    uint64_t            status[KV_REGISTRY_STATUS_FIELDS];
    reg_slot_t          slots[];
};

size_t kv_registry_min_size(uint32_t max_workers)
{
    if (max_workers == 0)
        max_workers = 256;
    return sizeof(kv_registry_t) + (size_t)max_workers * sizeof(reg_slot_t);
}

kv_registry_t *kv_registry_create(void *region, size_t size, uint32_t max_workers,
                                  char *err, size_t errlen)
{
    if (max_workers == 0)
        max_workers = 256;
    if (region == NULL || ((uintptr_t)region & 7) != 0) {
        snprintf(err, errlen, "registry region is NULL or not 8-byte aligned");
        return NULL;
    }
    if (size < kv_registry_min_size(max_workers)) {
        snprintf(err, errlen, "registry region of %zu bytes is below the %zu needed for %u workers",
                 size, kv_registry_min_size(max_workers), max_workers);
        return NULL;
    }
    kv_registry_t *reg = region;
    memset(reg, 0, kv_registry_min_size(max_workers));
    reg->version = REG_VERSION;
    reg->max_workers = max_workers;
    reg->size = size;
    __atomic_store_n(&reg->magic, REG_MAGIC, __ATOMIC_RELEASE);
    return reg;
}

kv_registry_t *kv_registry_open(void *region, size_t size)
{
    kv_registry_t *reg = region;
    if (reg == NULL || size < sizeof(*reg))
        return NULL;
    if (__atomic_load_n(&reg->magic, __ATOMIC_ACQUIRE) != REG_MAGIC
        || reg->version != REG_VERSION || reg->size != size
        || size < kv_registry_min_size(reg->max_workers))
        return NULL;
    return reg;
}

uint32_t kv_registry_max_workers(const kv_registry_t *reg)
{
    return reg->max_workers;
}

/* --- lease -------------------------------------------------------------- */

static uint32_t scan_bound(const kv_registry_t *reg);

/* A writer killed between write_begin and write_end left a record's seq
 * odd: the new writer closes it (the content is re-validated anyway). The
 * slot at `high` too: kv_registry_add writes a never-used slot before it
 * raises `high`, and one killed there would leave that seq odd, inverted
 * for good once the slot is next written (idle records unreadable). */
static void repair(kv_registry_t *reg)
{
    uint32_t n = scan_bound(reg);
    if (n < reg->max_workers)
        n++;
    for (uint32_t i = 0; i < n; i++)
        kv_seqlock_unstick(&reg->slots[i].seq);
}

static int pid_dead(pid_t pid)
{
    return kill(pid, 0) == -1 && errno == ESRCH;
}

int kv_registry_lease_acquire(kv_registry_t *reg, pid_t pid, uint32_t *gen)
{
    uint64_t cur = __atomic_load_n(&reg->lease, __ATOMIC_ACQUIRE);
    for (;;) {
        pid_t holder = (pid_t)(cur >> 32);
        uint32_t g = (uint32_t)cur;
        if (holder != 0 && holder != pid && !pid_dead(holder))
            return -1;
        uint64_t next = ((uint64_t)(uint32_t)pid << 32) | (uint32_t)(g + 1);
        if (__atomic_compare_exchange_n(&reg->lease, &cur, next, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE)) {
            if (gen)
                *gen = g + 1;
            repair(reg);
            return 0;
        }
    }
}

int kv_registry_lease_held(const kv_registry_t *reg, pid_t pid, uint32_t gen)
{
    uint64_t cur = __atomic_load_n(&reg->lease, __ATOMIC_ACQUIRE);
    return cur == (((uint64_t)(uint32_t)pid << 32) | gen);
}

void kv_registry_lease_release(kv_registry_t *reg, pid_t pid, uint32_t gen)
{
    uint64_t cur = ((uint64_t)(uint32_t)pid << 32) | gen;
    /* generation stays, so the next holder's is larger */
    __atomic_compare_exchange_n(&reg->lease, &cur, (uint64_t)gen, 0, __ATOMIC_ACQ_REL,
                                __ATOMIC_ACQUIRE);
}

pid_t kv_registry_lease_owner(const kv_registry_t *reg, uint32_t *gen)
{
    uint64_t cur = __atomic_load_n(&reg->lease, __ATOMIC_ACQUIRE);
    if (gen)
        *gen = (uint32_t)cur;
    return (pid_t)(cur >> 32);
}

/* --- records ------------------------------------------------------------ */

kv_worker_rec_t *kv_registry_write_begin(kv_registry_t *reg, int i)
{
    kv_seqlock_write_begin(&reg->slots[i].seq);
    return &reg->slots[i].rec;
}

void kv_registry_write_end(kv_registry_t *reg, int i)
{
    kv_seqlock_write_end(&reg->slots[i].seq);
}

static void copy_words(void *dst, const void *src, size_t n)
{
    uint64_t *d = dst;
    const uint64_t *sw = src;
    for (size_t k = 0; k < n / sizeof(uint64_t); k++)
        d[k] = __atomic_load_n(&sw[k], __ATOMIC_RELAXED);
}

_Static_assert(sizeof(kv_worker_rec_t) % sizeof(uint64_t) == 0, "record is whole words");

/* 1: a whole copy of a used record; 0: the record is free; -1: a writer
 * held it for all of KV_SEQLOCK_READ_TRIES rounds. */
static int read_slot(const kv_registry_t *reg, int i, kv_worker_rec_t *out)
{
    if (i < 0 || (uint32_t)i >= reg->max_workers)
        return 0;
    const reg_slot_t *s = &reg->slots[i];
    kv_seqread_t rd = { 0, 0 };
    do {
        if (!kv_seqlock_read_begin(&s->seq, &rd))
            return -1;
        copy_words(out, &s->rec, sizeof(*out));
    } while (!kv_seqlock_read_end(&s->seq, &rd));
    return out->state != KV_WORKER_FREE;
}

int kv_registry_read(const kv_registry_t *reg, int i, kv_worker_rec_t *out)
{
    /* held too long: routing then goes without this record */
    return read_slot(reg, i, out) == 1 ? 0 : -1;
}

int kv_registry_read_wait(const kv_registry_t *reg, int i, kv_worker_rec_t *out)
{
    uint64_t until = 0;
    for (;;) {
        int r = read_slot(reg, i, out);
        if (r >= 0)
            return r == 1 ? 0 : -1;
        uint64_t now = kv_clock_ms();
        if (until == 0)
            until = now + KV_REGISTRY_WAIT_MS;
        else if (now >= until)
            return -1;
        sched_yield();      /* the writer was preempted inside its section */
    }
}

static uint32_t scan_bound(const kv_registry_t *reg)
{
    uint64_t h = __atomic_load_n(&reg->high, __ATOMIC_ACQUIRE);
    return h < reg->max_workers ? (uint32_t)h : reg->max_workers;
}

uint32_t kv_registry_records(const kv_registry_t *reg)
{
    return scan_bound(reg);
}

int kv_registry_find(const kv_registry_t *reg, uint64_t worker_id, uint32_t dp_rank)
{
    kv_worker_rec_t r;
    uint32_t n = scan_bound(reg);
    for (uint32_t i = 0; i < n; i++)
        if (kv_registry_read(reg, (int)i, &r) == 0 && r.worker_id == worker_id
            && r.dp_rank == dp_rank)
            return (int)i;
    return -1;
}

int kv_registry_find_address(const kv_registry_t *reg, const char *addr, int *from,
                             kv_worker_rec_t *out)
{
    kv_worker_rec_t r;
    uint32_t n = scan_bound(reg);
    for (uint32_t i = from ? (uint32_t)*from : 0; i < n; i++) {
        if (kv_registry_read(reg, (int)i, &r) != 0)
            continue;
        r.address[KV_REGISTRY_ADDR_MAX - 1] = '\0';
        if (strcmp(r.address, addr) == 0) {
            if (from)
                *from = (int)i + 1;
            if (out)
                *out = r;
            return (int)i;
        }
    }
    if (from)
        *from = (int)n;
    return -1;
}

/* A new record's samples start from nothing; a sample that races with this
 * (a response of the record's previous worker) is at worst one sample. */
static void selfcheck_clear(kv_selfcheck_t *sc, uint64_t worker_id)
{
    uint64_t *w = (uint64_t *)sc;
    for (size_t k = 1; k < sizeof(*sc) / sizeof(uint64_t); k++)
        __atomic_store_n(&w[k], 0, __ATOMIC_RELAXED);
    __atomic_store_n(&sc->worker_id, worker_id, __ATOMIC_RELEASE);
}

int kv_registry_add(kv_registry_t *reg, uint64_t worker_id, uint32_t dp_rank)
{
    int free_i = -1;
    uint32_t n = scan_bound(reg);
    for (uint32_t i = 0; i < n; i++) {
        const kv_worker_rec_t *r = &reg->slots[i].rec;     /* the writer reads its own */
        if (r->state == KV_WORKER_FREE) {
            if (free_i < 0)
                free_i = (int)i;
        } else if (r->worker_id == worker_id && r->dp_rank == dp_rank) {
            return (int)i;
        }
    }
    if (free_i < 0) {
        if (n >= reg->max_workers)
            return -1;
        free_i = (int)n;
    }
    kv_worker_rec_t *r = kv_registry_write_begin(reg, free_i);
    memset(r, 0, sizeof(*r));
    r->worker_id = worker_id;
    r->dp_rank = dp_rank;
    r->state = KV_WORKER_LIVE;
    kv_registry_write_end(reg, free_i);
    selfcheck_clear(&reg->slots[free_i].sc, worker_id);
    if ((uint64_t)free_i >= reg->high)
        __atomic_store_n(&reg->high, (uint64_t)free_i + 1, __ATOMIC_RELEASE);
    return free_i;
}

void kv_registry_remove(kv_registry_t *reg, int i)
{
    kv_worker_rec_t *r = kv_registry_write_begin(reg, i);
    memset(r, 0, sizeof(*r));
    kv_registry_write_end(reg, i);
}

/* --- self-check ---------------------------------------------------------- */

_Static_assert(sizeof(kv_selfcheck_t) % sizeof(uint64_t) == 0, "self-check is whole words");

void kv_selfcheck_sample(kv_registry_t *reg, int i, uint64_t worker_id,
                         uint64_t predicted, uint64_t cached)
{
    if (i < 0 || (uint32_t)i >= reg->max_workers)
        return;
    kv_selfcheck_t *sc = &reg->slots[i].sc;
    if (__atomic_load_n(&sc->worker_id, __ATOMIC_ACQUIRE) != worker_id)
        return;
    __atomic_fetch_add(&sc->samples, 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&sc->predicted_tokens, predicted, __ATOMIC_RELAXED);
    __atomic_fetch_add(&sc->cached_tokens, cached, __ATOMIC_RELAXED);
    if (predicted == 0 && cached == 0)
        return;                     /* nothing predicted, nothing found: no information */
    if (cached < predicted)
        __atomic_fetch_add(&sc->over, 1, __ATOMIC_RELAXED);
    else if (cached > predicted)
        __atomic_fetch_add(&sc->under, 1, __ATOMIC_RELAXED);
    uint64_t hi = predicted > cached ? predicted : cached;
    uint64_t diff = predicted > cached ? predicted - cached : cached - predicted;
    uint64_t err = (uint64_t)((double)diff / (double)hi * 1e6);
    uint64_t old = __atomic_load_n(&sc->error_ppm, __ATOMIC_RELAXED), next;
    do {
        /* EWMA with weight 1/8: a drift shows after a handful of responses,
         * one odd response does not make one */
        next = (uint64_t)((int64_t)old + ((int64_t)err - (int64_t)old) / 8);
    } while (!__atomic_compare_exchange_n(&sc->error_ppm, &old, next, 1, __ATOMIC_RELAXED,
                                          __ATOMIC_RELAXED));
    __atomic_fetch_add(&sc->window, 1, __ATOMIC_RELAXED);
}

void kv_selfcheck_read(const kv_registry_t *reg, int i, kv_selfcheck_t *out)
{
    if (i < 0 || (uint32_t)i >= reg->max_workers) {
        memset(out, 0, sizeof(*out));
        return;
    }
    copy_words(out, &reg->slots[i].sc, sizeof(*out));
}

kv_selfcheck_verdict_t kv_selfcheck_verdict(const kv_selfcheck_t *sc)
{
    if (sc->window < KV_SELFCHECK_MIN_SAMPLES)
        return KV_SELFCHECK_UNKNOWN;
    if (sc->error_ppm >= KV_SELFCHECK_DRIFT_PPM)
        return KV_SELFCHECK_DRIFT;
    return sc->error_ppm < KV_SELFCHECK_OK_PPM ? KV_SELFCHECK_OK : KV_SELFCHECK_UNKNOWN;
}

void kv_selfcheck_restart(kv_registry_t *reg, int i)
{
    kv_selfcheck_t *sc = &reg->slots[i].sc;
    __atomic_store_n(&sc->window, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&sc->error_ppm, 0, __ATOMIC_RELAXED);
}

void kv_selfcheck_note(kv_registry_t *reg, int i, int drift, int resync, int load_only)
{
    kv_selfcheck_t *sc = &reg->slots[i].sc;
    if (drift)
        __atomic_fetch_add(&sc->drifts, 1, __ATOMIC_RELAXED);
    if (resync)
        __atomic_fetch_add(&sc->resyncs, 1, __ATOMIC_RELAXED);
    uint64_t was = __atomic_exchange_n(&sc->load_only, load_only ? 1 : 0, __ATOMIC_RELEASE);
    if (was && !load_only)
        __atomic_fetch_add(&sc->recoveries, 1, __ATOMIC_RELAXED);
}

int kv_selfcheck_load_only(const kv_registry_t *reg, int i)
{
    if (i < 0 || (uint32_t)i >= reg->max_workers)
        return 0;
    return __atomic_load_n(&reg->slots[i].sc.load_only, __ATOMIC_ACQUIRE) != 0;
}

/* --- status ------------------------------------------------------------- */

void kv_registry_status_add(kv_registry_t *reg, size_t field, uint64_t n)
{
    __atomic_fetch_add(&reg->status[field], n, __ATOMIC_RELAXED);
}

void kv_registry_status_set(kv_registry_t *reg, size_t field, uint64_t v)
{
    __atomic_store_n(&reg->status[field], v, __ATOMIC_RELAXED);
}

void kv_registry_status(const kv_registry_t *reg, kv_ingest_status_t *out)
{
    copy_words(out, reg->status, sizeof(*out));
}

const char *kv_worker_state_name(uint32_t state)
{
    static const char *names[] = {"free", "live", "resyncing", "stale", "gone"};
    return state < sizeof(names) / sizeof(names[0]) ? names[state] : "unknown";
}

const char *kv_nats_state_name(uint64_t state)
{
    static const char *names[] = {"down", "connecting", "connected", "reconnecting", "closed"};
    return state < sizeof(names) / sizeof(names[0]) ? names[state] : "unknown";
}
