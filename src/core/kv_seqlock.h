/*
 * A sequence lock for records in shared memory that one writer changes and
 * readers in other processes copy without ever blocking it: the prefix
 * index's entries (src/index/kv_index.c) and the worker registry's records
 * (src/index/kv_registry.c).
 *
 *   writer:  write_begin (count goes odd) ... write ... write_end (even)
 *   reader:  read_begin (waits for an even count) ... copy ... read_end
 *            (1 if the count did not move: the copy is whole; else again)
 *
 * A seqlock rather than a mutex or epochs because readers live in other
 * processes that may die at any moment, and a reader must never make the
 * writer wait. The copy races with the writer, so it must use relaxed
 * atomic word loads (never torn words); the count check throws away any
 * mix of old and new.
 *
 * A writer holds a record for nanoseconds, but one descheduled mid-write
 * (a busy box) or killed there could hold it for milliseconds or forever:
 * a reader gives up after KV_SEQLOCK_READ_TRIES rounds and treats the
 * record as absent, which costs routing at most one cache hit.
 *
 * Atomics: GCC/Clang __atomic builtins, the one dialect of src/ (they act
 * on the plain words a shared region holds).
 */
#ifndef KV_SEQLOCK_H
#define KV_SEQLOCK_H

#include <stdint.h>

#define KV_SEQLOCK_READ_TRIES  4096u

typedef uint32_t kv_seqlock_t;

typedef struct {
    uint32_t    seq;        /* the even count the copy started at */
    uint32_t    tries;
} kv_seqread_t;

static inline void kv_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Only one writer at a time (the caller serialises writers), so the count
 * is a plain load + store, never a locked read-modify-write. */
static inline void kv_seqlock_write_begin(kv_seqlock_t *l)
{
    __atomic_store_n(l, __atomic_load_n(l, __ATOMIC_RELAXED) + 1, __ATOMIC_RELAXED);
    /* the odd count is visible before any change to the record */
    __atomic_thread_fence(__ATOMIC_RELEASE);
}

static inline void kv_seqlock_write_end(kv_seqlock_t *l)
{
    __atomic_store_n(l, __atomic_load_n(l, __ATOMIC_RELAXED) + 1, __ATOMIC_RELEASE);
}

/* A writer killed between begin and end left the count odd: a new writer
 * closes it (the record's content must then be re-validated). */
static inline void kv_seqlock_unstick(kv_seqlock_t *l)
{
    uint32_t seq = __atomic_load_n(l, __ATOMIC_RELAXED);

    if (seq & 1)
        __atomic_store_n(l, seq + 1, __ATOMIC_RELEASE);
}

/* Starts (or restarts) a read; rd starts zeroed. 1: copy the record now;
 * 0: the record stayed locked or moving for too long, give up. */
static inline int kv_seqlock_read_begin(const kv_seqlock_t *l, kv_seqread_t *rd)
{
    for (;;) {
        if (rd->tries++ >= KV_SEQLOCK_READ_TRIES)
            return 0;
        rd->seq = __atomic_load_n(l, __ATOMIC_ACQUIRE);
        if (!(rd->seq & 1))
            return 1;
        kv_cpu_relax();
    }
}

/* 1 if the copy made since read_begin is whole. */
static inline int kv_seqlock_read_end(const kv_seqlock_t *l, const kv_seqread_t *rd)
{
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    return __atomic_load_n(l, __ATOMIC_RELAXED) == rd->seq;
}

#endif
