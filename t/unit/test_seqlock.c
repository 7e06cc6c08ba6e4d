/* kv_seqlock: whole copies under a racing writer, and a bounded wait on a
 * record whose writer stalled or died mid-write. */
#include <pthread.h>

#include "kv_seqlock.h"
#include "kvtest.h"

typedef struct {
    kv_seqlock_t    lock;
    uint64_t        a, b;       /* the writer keeps b == ~a */
    int             stop;
} shared_t;

static void *writer(void *arg)
{
    shared_t *sh = arg;

    for (uint64_t i = 1; !__atomic_load_n(&sh->stop, __ATOMIC_RELAXED); i++) {
        kv_seqlock_write_begin(&sh->lock);
        __atomic_store_n(&sh->a, i, __ATOMIC_RELAXED);
        __atomic_store_n(&sh->b, ~i, __ATOMIC_RELAXED);
        kv_seqlock_write_end(&sh->lock);
    }
    return NULL;
}

TEST(reader_never_sees_a_torn_record)
{
    shared_t sh = { 0, 0, ~(uint64_t)0, 0 };
    pthread_t t;
    long whole = 0, torn = 0, gave_up = 0;

    pthread_create(&t, NULL, writer, &sh);
    for (int n = 0; n < 200000; n++) {
        kv_seqread_t rd = { 0, 0 };
        uint64_t a, b;
        int ok = 1;
        do {
            if (!kv_seqlock_read_begin(&sh.lock, &rd)) {
                ok = 0;
                break;
            }
            a = __atomic_load_n(&sh.a, __ATOMIC_RELAXED);
            b = __atomic_load_n(&sh.b, __ATOMIC_RELAXED);
        } while (!kv_seqlock_read_end(&sh.lock, &rd));
        if (!ok)
            gave_up++;
        else if (b == ~a)
            whole++;
        else
            torn++;
    }
    __atomic_store_n(&sh.stop, 1, __ATOMIC_RELAXED);
    pthread_join(t, NULL);
    fprintf(stderr, "  %ld whole, %ld torn, %ld gave up\n", whole, torn, gave_up);
    CHECK(torn == 0);
    CHECK(whole > 0);
}

TEST(stalled_writer_bounds_the_wait)
{
    kv_seqlock_t lock = 0;
    kv_seqread_t rd = { 0, 0 };

    kv_seqlock_write_begin(&lock);          /* the writer never ends */
    CHECK(kv_seqlock_read_begin(&lock, &rd) == 0);
    CHECK(rd.tries >= KV_SEQLOCK_READ_TRIES);

    kv_seqlock_unstick(&lock);              /* a new writer closes it */
    CHECK((lock & 1) == 0);
    rd = (kv_seqread_t){ 0, 0 };
    CHECK(kv_seqlock_read_begin(&lock, &rd) == 1);
    CHECK(kv_seqlock_read_end(&lock, &rd) == 1);

    kv_seqlock_unstick(&lock);              /* no-op on an even count */
    CHECK(kv_seqlock_read_end(&lock, &rd) == 1);
}

int main(void)
{
    RUN(reader_never_sees_a_torn_record);
    RUN(stalled_writer_bounds_the_wait);
    return kvt_done();
}
