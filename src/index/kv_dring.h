/*
 * The decision ring: a bounded, lock-free queue of fixed-size records in
 * shared memory, from the nginx worker processes (many producers, which
 * must never block or allocate) to the zone's share helper (one consumer,
 * which publishes them over NATS: src/events/kv_share.c).
 *
 * Each record is one routing decision's blocks: the worker chosen and up
 * to KV_DRING_HASHES consecutive sequence hashes of its prompt, seq[0]
 * being the request's block `first` (a longer prompt takes several
 * records, each repeating the previous one's last hash as its seq[0]).
 *
 * Bounded: a full ring drops the record and counts it; nothing waits.
 * The cells carry sequence numbers (Vyukov's bounded queue), so a producer
 * that dies mid-write leaves one cell the consumer skips after two seconds
 * rather than a wedged ring: kv_dring_pop gives up on a cell that stays
 * unpublished (by CAS, as the producer publishes: one of them wins) and
 * counts it lost.
 *
 * Offsets only, no pointers: the region may be mapped at any address.
 */
#ifndef KV_DRING_H
#define KV_DRING_H

#include <stddef.h>
#include <stdint.h>

#define KV_DRING_HASHES  29

typedef struct kv_dring kv_dring_t;

typedef struct {
    uint64_t    worker_id;
    uint32_t    first;          /* the request block seq[0] is */
    uint32_t    n;              /* hashes in seq, 1..KV_DRING_HASHES */
    uint64_t    seq[KV_DRING_HASHES];
} kv_dring_rec_t;               /* 248 bytes */

typedef struct {
    uint64_t    capacity;
    uint64_t    pushed;         /* records queued */
    uint64_t    dropped;        /* records refused: the ring was full */
    uint64_t    popped;
    uint64_t    lost;           /* cells a dead producer never finished, or
                                   a late one tore */
} kv_dring_stats_t;

/* Region size for a ring of capacity records (rounded up to a power of 2). */
size_t      kv_dring_size(uint32_t capacity);
/* Lays out a fresh ring, or re-opens one of the same capacity (reuse). */
kv_dring_t *kv_dring_init(void *region, size_t size, uint32_t capacity, int reuse);

/* Producer: 0, or -1 when the ring is full (the record is dropped, counted). */
int  kv_dring_push(kv_dring_t *r, const kv_dring_rec_t *rec);
/* The producer's two steps, which kv_dring_push makes in a row; apart
 * only in tests, to stall a producer between them. */
int  kv_dring_claim_pos(kv_dring_t *r, uint64_t *pos);
int  kv_dring_fill(kv_dring_t *r, uint64_t pos, const kv_dring_rec_t *rec);
/* Consumer (one at a time): 1 with a record in out, 0 when empty. */
int  kv_dring_pop(kv_dring_t *r, kv_dring_rec_t *out);
void kv_dring_stats(const kv_dring_t *r, kv_dring_stats_t *st);

/*
 * The single consumer: a pid word taken by CAS; a holder that died (alive()
 * says no) is replaced. 0 when pid now holds it.
 */
int  kv_dring_claim(kv_dring_t *r, int64_t pid, int (*alive)(int64_t pid));
void kv_dring_unclaim(kv_dring_t *r, int64_t pid);

/* Counters the consumer keeps for the status (what it published, what it
 * applied from other instances, what it refused). */
typedef struct {
    uint64_t    messages_out;   /* NATS messages published */
    uint64_t    records_out;    /* decision records published */
    uint64_t    messages_in;    /* from other instances, accepted */
    uint64_t    records_in;     /* decision records applied */
    uint64_t    load_in;        /* load entries applied */
    uint64_t    rejected;       /* malformed messages refused */
    uint64_t    limited;        /* flushes deferred by the rate limit */
    uint64_t    instances;      /* other instances heard within the lease */
    int64_t     remote_requests;    /* in flight through other instances, summed */
    uint64_t    expired;        /* load entries dropped at the lease's end */
    uint64_t    connected;      /* 1: NATS is up */
} kv_dring_share_t;

kv_dring_share_t *kv_dring_share(kv_dring_t *r);

#endif
