/*
 * The decision ring (kv_dring.h): Dmitry Vyukov's bounded queue. Every cell
 * holds a sequence number: pos when free for the producer that claims
 * position pos, pos + 1 once that producer has written it, pos + capacity
 * once the consumer has read it (free for the next lap). Producers claim
 * positions by CAS on the tail; the one consumer owns the head.
 *
 * A cell also holds a check: the record's hash seeded with its position.
 * A producer stalled between its claim and its write past the consumer's
 * patience (the cell given up, the ring lapped) still copies its record
 * in late, over the next lap's; the check then fails (another position's
 * seed, or a record half of one and half of the other), and the consumer
 * counts the cell lost instead of crediting a decision to a wrong worker.
 */
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "kv_clock.h"
#include "kv_dring.h"

#define KV_DRING_MAGIC  0x6b766472696e6732ULL   /* "kvdring2": cells with a check */
#define STUCK_MS        2000    /* a claimed cell unwritten this long: lost */

typedef struct {
    uint64_t        seq;
    uint64_t        check;          /* check_of(rec, the position written) */
    kv_dring_rec_t  rec;
} cell_t;

struct kv_dring {
    uint64_t            magic;
    uint64_t            mask;
    uint64_t            tail;           /* producers (CAS) */
    char                pad1[40];
    uint64_t            head;           /* the consumer */
    uint64_t            stuck;          /* when head was first seen claimed, unwritten */
    uint64_t            stuck_pos;
    int64_t             owner;          /* the consumer's pid */
    uint64_t            pushed, dropped, popped, lost;
    kv_dring_share_t    share;
    /* followed by the cells */
};

/* never 0: r->stuck == 0 means "no stuck cell seen" */
static uint64_t now_ms(void)
{
    return kv_clock_ms() + 1;
}

static cell_t *cells(const kv_dring_t *r)
{
    return (cell_t *) (void *) ((char *) r + sizeof(kv_dring_t));
}

static uint64_t pow2(uint32_t n)
{
    uint64_t c = 16;

    while (c < n) {
        c *= 2;
    }
    return c;
}

static uint64_t check_of(const kv_dring_rec_t *rec, uint64_t pos)
{
    return XXH3_64bits_withSeed(rec, sizeof(*rec), pos);
}

size_t kv_dring_size(uint32_t capacity)
{
    return sizeof(kv_dring_t) + pow2(capacity) * sizeof(cell_t);
}

kv_dring_t *kv_dring_init(void *region, size_t size, uint32_t capacity, int reuse)
{
    kv_dring_t *r = region;
    uint64_t    i, c = pow2(capacity);

    if (size < kv_dring_size(capacity)) {
        return NULL;
    }
    if (reuse && r->magic == KV_DRING_MAGIC && r->mask == c - 1) {
        return r;
    }
    memset(r, 0, sizeof(*r));
    r->mask = c - 1;
    for (i = 0; i < c; i++) {
        cells(r)[i].seq = i;
    }
    __atomic_store_n(&r->magic, KV_DRING_MAGIC, __ATOMIC_RELEASE);
    return r;
}

int kv_dring_push(kv_dring_t *r, const kv_dring_rec_t *rec)
{
    uint64_t pos;

    if (kv_dring_claim_pos(r, &pos) != 0) {
        return -1;
    }
    return kv_dring_fill(r, pos, rec);
}

int kv_dring_claim_pos(kv_dring_t *r, uint64_t *claimed)
{
    cell_t   *c;
    uint64_t  pos, seq;
    int64_t   dif;

    pos = __atomic_load_n(&r->tail, __ATOMIC_RELAXED);
    for (;;) {
        c = &cells(r)[pos & r->mask];
        seq = __atomic_load_n(&c->seq, __ATOMIC_ACQUIRE);
        dif = (int64_t) (seq - pos);
        if (dif == 0) {
            if (__atomic_compare_exchange_n(&r->tail, &pos, pos + 1, 1,
                                            __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            {
                *claimed = pos;
                return 0;
            }
        } else if (dif < 0) {
            __atomic_fetch_add(&r->dropped, 1, __ATOMIC_RELAXED);
            return -1;
        } else {
            pos = __atomic_load_n(&r->tail, __ATOMIC_RELAXED);
        }
    }
}

int kv_dring_fill(kv_dring_t *r, uint64_t pos, const kv_dring_rec_t *rec)
{
    cell_t   *c = &cells(r)[pos & r->mask];
    uint64_t  seq;

    c->rec = *rec;
    c->check = check_of(rec, pos);
    /* a CAS, not a store: the consumer may have given this cell up (we
     * were descheduled that long); then the record is lost, not the ring */
    seq = pos;
    if (!__atomic_compare_exchange_n(&c->seq, &seq, pos + 1, 0, __ATOMIC_RELEASE,
                                     __ATOMIC_RELAXED))
    {
        __atomic_fetch_add(&r->dropped, 1, __ATOMIC_RELAXED);
        return -1;
    }
    __atomic_fetch_add(&r->pushed, 1, __ATOMIC_RELAXED);
    return 0;
}

int kv_dring_pop(kv_dring_t *r, kv_dring_rec_t *out)
{
    cell_t   *c;
    uint64_t  pos = r->head, seq;

    for (;;) {
        c = &cells(r)[pos & r->mask];
        seq = __atomic_load_n(&c->seq, __ATOMIC_ACQUIRE);
        if (seq == pos + 1) {
            uint64_t check;

            *out = c->rec;
            check = c->check;
            __atomic_store_n(&c->seq, pos + r->mask + 1, __ATOMIC_RELEASE);
            r->head = ++pos;
            r->stuck = 0;
            if (check != check_of(out, pos - 1)) {
                __atomic_fetch_add(&r->lost, 1, __ATOMIC_RELAXED);
                continue;       /* torn by a producer that wrote too late */
            }
            __atomic_fetch_add(&r->popped, 1, __ATOMIC_RELAXED);
            return 1;
        }
        /* claimed but not written: its producer is between the claim and
         * the write (a few instructions), or died there; after a long
         * while, give the cell up, by CAS so that a producer finishing
         * just now is read instead */
        if (__atomic_load_n(&r->tail, __ATOMIC_RELAXED) == pos) {
            return 0;
        }
        if (r->stuck == 0 || r->stuck_pos != pos) {
            r->stuck = now_ms();
            r->stuck_pos = pos;
            return 0;
        }
        if (now_ms() - r->stuck < STUCK_MS) {
            return 0;
        }
        if (!__atomic_compare_exchange_n(&c->seq, &seq, pos + r->mask + 1, 0,
                                         __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        {
            continue;       /* written meanwhile */
        }
        r->head = ++pos;
        r->stuck = 0;
        __atomic_fetch_add(&r->lost, 1, __ATOMIC_RELAXED);
    }
}

void kv_dring_stats(const kv_dring_t *r, kv_dring_stats_t *st)
{
    st->capacity = r->mask + 1;
    st->pushed = __atomic_load_n(&r->pushed, __ATOMIC_RELAXED);
    st->dropped = __atomic_load_n(&r->dropped, __ATOMIC_RELAXED);
    st->popped = __atomic_load_n(&r->popped, __ATOMIC_RELAXED);
    st->lost = __atomic_load_n(&r->lost, __ATOMIC_RELAXED);
}

int kv_dring_claim(kv_dring_t *r, int64_t pid, int (*alive)(int64_t pid))
{
    int64_t cur = __atomic_load_n(&r->owner, __ATOMIC_ACQUIRE);

    if (cur == pid) {
        return 0;
    }
    if (cur != 0 && alive(cur)) {
        return -1;
    }
    return __atomic_compare_exchange_n(&r->owner, &cur, pid, 0, __ATOMIC_ACQ_REL,
                                       __ATOMIC_ACQUIRE) ? 0 : -1;
}

void kv_dring_unclaim(kv_dring_t *r, int64_t pid)
{
    int64_t cur = pid;

    __atomic_compare_exchange_n(&r->owner, &cur, 0, 0, __ATOMIC_ACQ_REL,
                                __ATOMIC_ACQUIRE);
}

kv_dring_share_t *kv_dring_share(kv_dring_t *r)
{
    return &r->share;
}
