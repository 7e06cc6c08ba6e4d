/*
 * A writer's lock in shared memory that is never waited for: the shared
 * caches' writers (src/index/kv_tcache.c, kv_respmap.c) skip their insert
 * when another process holds it, so no request waits on another process.
 *
 * Its word is the holder's pid (high half) and when it took it (seconds of
 * CLOCK_MONOTONIC, low half); 0 is free. A holder that died is replaced,
 * and so is one holding it past stale_s: a put takes microseconds, and a
 * pid can be reused (by another process, or by a respawned worker that then
 * took the lock for its own), which would leave every put skipped for good.
 */
#ifndef KV_TRYLOCK_H
#define KV_TRYLOCK_H

#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

/* 1: taken; 0: held by a live process, skip the write */
static inline int kv_trylock(uint64_t *word, uint32_t stale_s)
{
    struct timespec ts;
    uint64_t        pid = (uint64_t) getpid(), holder = 0, me;
    uint32_t        now;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    now = (uint32_t) ts.tv_sec;
    me = pid << 32 | now;
    if (__atomic_compare_exchange_n(word, &holder, me, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
        return 1;
    if ((int32_t) (now - (uint32_t) holder) > (int32_t) stale_s
        || (holder >> 32 != pid && kill((pid_t) (holder >> 32), 0) == -1 && errno == ESRCH))
    {
        return __atomic_compare_exchange_n(word, &holder, me, 0, __ATOMIC_ACQUIRE,
                                           __ATOMIC_RELAXED);
    }
    return 0;
}

static inline void kv_unlock(uint64_t *word)
{
    __atomic_store_n(word, 0, __ATOMIC_RELEASE);
}

#endif
