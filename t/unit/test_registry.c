/* Worker registry: records, seqlock readers against a writer, lease. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kv_registry.h"
#include "kvtest.h"

static void *region_for(uint32_t workers, size_t *size)
{
    *size = kv_registry_min_size(workers);
    return aligned_alloc(64, (*size + 63) / 64 * 64);
}

TEST(records_add_find_remove)
{
    size_t size;
    void *mem = region_for(4, &size);
    char err[128];
    kv_registry_t *reg = kv_registry_create(mem, size, 4, err, sizeof(err));
    CHECK(reg != NULL);
    CHECK(kv_registry_create(mem, size - 1, 4, err, sizeof(err)) == NULL);
    reg = kv_registry_create(mem, size, 4, err, sizeof(err));

    int a = kv_registry_add(reg, 7, 0), b = kv_registry_add(reg, 7, 1);
    CHECK(a == 0 && b == 1);
    CHECK(kv_registry_add(reg, 7, 0) == a);
    kv_worker_rec_t *w = kv_registry_write_begin(reg, b);
    snprintf(w->address, sizeof(w->address), "127.0.0.1:8001");
    w->block_size = 16;
    kv_registry_write_end(reg, b);

    kv_worker_rec_t r;
    CHECK(kv_registry_read(reg, b, &r) == 0);
    CHECK_STR(r.address, "127.0.0.1:8001");
    CHECK_EQ_U64(r.state, KV_WORKER_LIVE);
    CHECK(kv_registry_find(reg, 7, 1) == b);
    CHECK(kv_registry_find(reg, 8, 0) == -1);
    int from = 0;
    CHECK(kv_registry_find_address(reg, "127.0.0.1:8001", &from, &r) == b);
    CHECK(kv_registry_find_address(reg, "127.0.0.1:8001", &from, &r) == -1);
    CHECK(kv_registry_find_address(reg, "127.0.0.1:9", NULL, NULL) == -1);

    CHECK(kv_registry_add(reg, 9, 0) == 2 && kv_registry_add(reg, 10, 0) == 3);
    CHECK(kv_registry_add(reg, 11, 0) == -1);           /* full */
    kv_registry_remove(reg, a);
    CHECK(kv_registry_read(reg, a, &r) == -1);
    CHECK(kv_registry_add(reg, 11, 0) == a);            /* reuses the freed record */

    /* reopen (nginx reload): same content */
    kv_registry_t *again = kv_registry_open(mem, size);
    CHECK(again == reg);
    CHECK(kv_registry_find(again, 7, 1) == b);
    CHECK(kv_registry_open(mem, size + 8) == NULL);

    kv_registry_status_add(reg, KV_STATUS_OFF(gaps), 3);
    kv_registry_status_set(reg, KV_STATUS_OFF(nats_state), KV_NATS_CONNECTED);
    kv_ingest_status_t st;
    kv_registry_status(reg, &st);
    CHECK_EQ_U64(st.gaps, 3);
    CHECK_STR(kv_nats_state_name(st.nats_state), "connected");
    free(mem);
}

/* A writer keeps every word of the record equal to one counter; readers must
 * never see two different values in one copy. */
static kv_registry_t *sl_reg;
static volatile int sl_stop;

static void *sl_reader(void *arg)
{
    long *torn = arg;
    kv_worker_rec_t r;
    while (!sl_stop) {
        if (kv_registry_read(sl_reg, 0, &r) != 0)
            continue;
        if (r.events != r.gaps || r.events != r.last_event_applied
            || r.load.running != r.events)
            (*torn)++;
    }
    return NULL;
}

TEST(seqlock_readers_never_torn)
{
    size_t size;
    void *mem = region_for(2, &size);
    char err[128];
    sl_reg = kv_registry_create(mem, size, 2, err, sizeof(err));
    int i = kv_registry_add(sl_reg, 1, 0);
    long torn[2] = {0, 0};
    pthread_t t[2];
    sl_stop = 0;
    for (int k = 0; k < 2; k++)
        pthread_create(&t[k], NULL, sl_reader, &torn[k]);
    for (uint64_t v = 1; v <= 200000; v++) {
        kv_worker_rec_t *w = kv_registry_write_begin(sl_reg, i);
        w->events = v;
        w->gaps = v;
        w->last_event_applied = v;
        w->load.running = v;
        kv_registry_write_end(sl_reg, i);
    }
    sl_stop = 1;
    for (int k = 0; k < 2; k++)
        pthread_join(t[k], NULL);
    CHECK_EQ_U64(torn[0] + torn[1], 0);
    free(mem);
}

/* A writer preempted inside its section (a loaded machine) makes the
 * routing read give up, but not the status page's: it waits and gets the
 * record (a test_selfcheck run once saw a live worker missing from the
 * status list). */
static kv_registry_t *pw_reg;

static void *pw_reader(void *arg)
{
    kv_worker_rec_t *r = arg;
    r->events = kv_registry_read_wait(pw_reg, 0, r) == 0 ? r->events : 0;
    return NULL;
}

TEST(status_read_waits_out_a_preempted_writer)
{
    size_t size;
    void *mem = region_for(2, &size);
    char err[128];
    pw_reg = kv_registry_create(mem, size, 2, err, sizeof(err));
    int i = kv_registry_add(pw_reg, 1, 0);
    CHECK(i == 0);
    kv_worker_rec_t *w = kv_registry_write_begin(pw_reg, i);
    kv_worker_rec_t seen;
    memset(&seen, 0, sizeof(seen));
    CHECK(kv_registry_read(pw_reg, i, &seen) == -1);     /* gives up */
    pthread_t t;
    pthread_create(&t, NULL, pw_reader, &seen);
    struct timespec held = { 0, 5 * 1000 * 1000 };       /* the writer "preempted" */
    nanosleep(&held, NULL);
    w->events = 42;
    kv_registry_write_end(pw_reg, i);
    pthread_join(t, NULL);
    CHECK_EQ_U64(seen.events, 42);
    CHECK(kv_registry_read_wait(pw_reg, 1, &seen) == -1); /* free: no wait */
    CHECK(kv_registry_read_wait(pw_reg, 99, &seen) == -1);
    free(mem);
}

TEST(lease_excludes_live_and_takes_over_dead)
{
    size_t size;
    void *mem = region_for(2, &size);
    char err[128];
    kv_registry_t *reg = kv_registry_create(mem, size, 2, err, sizeof(err));

    /* a child takes the lease and dies without releasing it */
    pid_t child = fork();
    if (child == 0) {
        uint32_t g;
        _exit(kv_registry_lease_acquire(reg, getpid(), &g) == 0 ? 0 : 1);
    }
    /* the region is not shared with the child: simulate its write here */
    uint32_t g1 = 0;
    CHECK(kv_registry_lease_acquire(reg, child, &g1) == 0);
    CHECK_EQ_U64(g1, 1);
    uint32_t g;
    CHECK(kv_registry_lease_acquire(reg, getpid(), &g) == -1);   /* child still alive */
    int status;
    waitpid(child, &status, 0);                                 /* reaped: ESRCH now */
    CHECK(kv_registry_lease_acquire(reg, getpid(), &g) == 0);
    CHECK_EQ_U64(g, 2);
    CHECK(kv_registry_lease_held(reg, getpid(), g));
    CHECK(!kv_registry_lease_held(reg, child, g1));

    /* release, then a "second helper" (pid 1 is alive) takes it; we cannot */
    kv_registry_lease_release(reg, getpid(), g);
    CHECK(kv_registry_lease_owner(reg, NULL) == 0);
    uint32_t g3;
    CHECK(kv_registry_lease_acquire(reg, 1, &g3) == 0);
    CHECK_EQ_U64(g3, 3);
    CHECK(kv_registry_lease_acquire(reg, getpid(), &g) == -1);
    CHECK(!kv_registry_lease_held(reg, getpid(), 2));
    /* a stale release by the old holder does nothing */
    kv_registry_lease_release(reg, getpid(), 2);
    CHECK(kv_registry_lease_owner(reg, NULL) == 1);
    free(mem);
}

/* A writer killed inside write_begin/write_end: readers give up instead
 * of spinning forever, and the next lease holder closes the record. */
/* A 2-slot registry whose lease a process now dead holds: the writer
 * killed mid-write of the tests below. */
static kv_registry_t *held_by_the_dead(void **mem)
{
    size_t size;
    char err[128];
    *mem = region_for(2, &size);
    kv_registry_t *reg = kv_registry_create(*mem, size, 2, err, sizeof(err));
    pid_t child = fork();
    if (child == 0)
        _exit(0);
    int status;
    waitpid(child, &status, 0);
    uint32_t g;
    if (kv_registry_lease_acquire(reg, child, &g) != 0)
        return NULL;
    return reg;
}

TEST(killed_writer_repaired_on_takeover)
{
    void *mem;
    kv_registry_t *reg = held_by_the_dead(&mem);       /* the dead child was the writer */
    uint32_t g;
    CHECK(reg != NULL);
    int i = kv_registry_add(reg, 3, 0);
    kv_worker_rec_t *w = kv_registry_write_begin(reg, i);
    w->events = 99;                                            /* ...and died here */
    kv_worker_rec_t r;
    CHECK(kv_registry_read(reg, i, &r) == -1);
    CHECK(kv_registry_lease_acquire(reg, getpid(), &g) == 0);  /* child is dead */
    CHECK(kv_registry_read(reg, i, &r) == 0);
    CHECK_EQ_U64(r.events, 99);
    free(mem);
}

/* The same, for a writer killed while adding a record in a slot never used
 * before (before `high` covers it): the next holder closes that one too,
 * so the next add there leaves a readable record, not an inverted seq. */
TEST(killed_adder_of_a_new_slot_repaired_on_takeover)
{
    void *mem;
    kv_registry_t *reg = held_by_the_dead(&mem);
    uint32_t g;
    CHECK(reg != NULL);
    CHECK_EQ_U64(kv_registry_add(reg, 3, 0), 0);
    kv_registry_write_begin(reg, 1);                           /* adding into slot 1: died */
    CHECK(kv_registry_lease_acquire(reg, getpid(), &g) == 0);
    CHECK_EQ_U64(kv_registry_add(reg, 4, 0), 1);
    kv_worker_rec_t r;
    CHECK(kv_registry_read(reg, 1, &r) == 0);
    CHECK_EQ_U64(r.worker_id, 4);
    CHECK(kv_registry_read(reg, 0, &r) == 0);
    CHECK_EQ_U64(r.worker_id, 3);
    free(mem);
}

/* The self-check: samples for the record's worker only; the verdict needs
 * KV_SELFCHECK_MIN_SAMPLES informative ones; a new record starts clean. */
TEST(selfcheck_samples_and_verdict)
{
    size_t size;
    void *mem = region_for(4, &size);
    char err[128];
    kv_registry_t *reg = kv_registry_create(mem, size, 4, err, sizeof(err));
    int i = kv_registry_add(reg, 7, 0);
    kv_selfcheck_t sc;

    kv_selfcheck_sample(reg, i, 8, 128, 0);         /* another worker's: ignored */
    kv_selfcheck_sample(reg, i, 7, 0, 0);           /* no information */
    kv_selfcheck_read(reg, i, &sc);
    CHECK_EQ_U64(sc.worker_id, 7);
    CHECK_EQ_U64(sc.samples, 1);
    CHECK_EQ_U64(sc.window, 0);
    for (int k = 0; k < KV_SELFCHECK_MIN_SAMPLES - 1; k++)
        kv_selfcheck_sample(reg, i, 7, 128, 0);
    kv_selfcheck_read(reg, i, &sc);
    CHECK(kv_selfcheck_verdict(&sc) == KV_SELFCHECK_UNKNOWN);
    kv_selfcheck_sample(reg, i, 7, 128, 0);
    kv_selfcheck_read(reg, i, &sc);
    CHECK_EQ_U64(sc.over, KV_SELFCHECK_MIN_SAMPLES);
    CHECK(kv_selfcheck_verdict(&sc) == KV_SELFCHECK_DRIFT);

    kv_selfcheck_restart(reg, i);
    kv_selfcheck_note(reg, i, 1, 0, 1);
    CHECK(kv_selfcheck_load_only(reg, i));
    for (int k = 0; k < KV_SELFCHECK_MIN_SAMPLES; k++)
        kv_selfcheck_sample(reg, i, 7, 128, 128);
    kv_selfcheck_sample(reg, i, 7, 64, 80);         /* under; one small miss */
    kv_selfcheck_read(reg, i, &sc);
    CHECK_EQ_U64(sc.under, 1);
    CHECK(kv_selfcheck_verdict(&sc) == KV_SELFCHECK_OK);
    kv_selfcheck_note(reg, i, 0, 0, 0);
    kv_selfcheck_read(reg, i, &sc);
    CHECK_EQ_U64(sc.recoveries, 1);
    CHECK_EQ_U64(sc.drifts, 1);
    CHECK(!kv_selfcheck_load_only(reg, i));

    /* a removed record's successor starts clean */
    kv_registry_remove(reg, i);
    CHECK(kv_registry_add(reg, 9, 0) == i);
    kv_selfcheck_read(reg, i, &sc);
    CHECK_EQ_U64(sc.worker_id, 9);
    CHECK_EQ_U64(sc.samples, 0);
    CHECK_EQ_U64(sc.drifts, 0);
    free(mem);
}

int main(void)
{
    RUN(selfcheck_samples_and_verdict);
    RUN(records_add_find_remove);
    RUN(seqlock_readers_never_torn);
    RUN(status_read_waits_out_a_preempted_writer);
    RUN(lease_excludes_live_and_takes_over_dead);
    RUN(killed_writer_repaired_on_takeover);
    RUN(killed_adder_of_a_new_slot_repaired_on_takeover);
    return kvt_done();
}
