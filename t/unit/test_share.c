/* The decision ring (kv_dring) and the shared-decisions wire (kv_share):
 * bounded drop, many producers, round trip through a receiver, refusals,
 * load as absolutes with a lease. No NATS: messages go through a callback. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include "kvtest.h"
#include "kv_dring.h"
#include "kv_share.h"

static kv_dring_t *ring_new(uint32_t cap)
{
    size_t sz = kv_dring_size(cap);
    return kv_dring_init(calloc(1, sz), sz, cap, 0);
}

TEST(ring_drops_when_full_and_keeps_order)
{
    kv_dring_t      *r = ring_new(16);
    kv_dring_rec_t   rec = { 0 }, out;
    kv_dring_stats_t st;
    int              i, n = 0;

    rec.n = 1;
    for (i = 0; i < 20; i++) {
        rec.worker_id = (uint64_t) i;
        n += kv_dring_push(r, &rec) == 0;
    }
    kv_dring_stats(r, &st);
    CHECK_EQ_U64(n, 16);
    CHECK_EQ_U64(st.dropped, 4);
    for (i = 0; i < 16; i++) {
        CHECK(kv_dring_pop(r, &out) == 1);
        CHECK_EQ_U64(out.worker_id, i);
    }
    CHECK(kv_dring_pop(r, &out) == 0);
    CHECK(kv_dring_push(r, &rec) == 0);     /* room again */
    free(r);
}

static kv_dring_t *shared_ring;

static void *producer(void *arg)
{
    kv_dring_rec_t rec = { 0 };
    uint64_t       i, base = (uint64_t) (uintptr_t) arg << 32;

    rec.n = 1;
    for (i = 0; i < 20000; i++) {
        rec.worker_id = base | i;
        rec.seq[0] = ~rec.worker_id;
        while (kv_dring_push(shared_ring, &rec) != 0) {
            /* a full ring: the consumer catches up */
        }
    }
    return NULL;
}

TEST(ring_many_producers_nothing_torn)
{
    pthread_t       t[4];
    kv_dring_rec_t  out;
    uint64_t        got = 0, last[4] = { 0 }, p, i;
    int             ok = 1;

    shared_ring = ring_new(64);
    for (p = 0; p < 4; p++) {
        pthread_create(&t[p], NULL, producer, (void *) (uintptr_t) p);
    }
    while (got < 4 * 20000) {
        if (kv_dring_pop(shared_ring, &out)) {
            p = out.worker_id >> 32;
            i = out.worker_id & 0xffffffff;
            /* whole records, and each producer's in its order */
            ok &= out.seq[0] == ~out.worker_id && p < 4;
            ok &= i == 0 ? last[p] == 0 : i == last[p] + 1;
            last[p] = i;
            got++;
        }
    }
    for (p = 0; p < 4; p++) {
        pthread_join(t[p], NULL);
    }
    CHECK(ok);
    free(shared_ring);
}

/* A producer stalled between its claim and its write until the consumer
 * gave its cell up and the ring lapped: its late write lands over the
 * next lap's record. The consumer must count that cell lost, never hand
 * out the stale record as the next lap's decision. */
TEST(ring_late_writer_cannot_pass_for_the_next_lap)
{
    kv_dring_t      *r = ring_new(16);
    kv_dring_rec_t   rec = { 0 }, late = { 0 }, out;
    kv_dring_stats_t st;
    uint64_t         pos, i;
    int              popped = 0, stale = 0;

    CHECK(kv_dring_claim_pos(r, &pos) == 0 && pos == 0);
    rec.n = 1;
    rec.worker_id = 100;
    CHECK(kv_dring_push(r, &rec) == 0);
    /* waits on the condition: the consumer gives position 0 up after
     * its stuck timeout and pops position 1 */
    while (kv_dring_pop(r, &out) == 0) {
    }
    CHECK_EQ_U64(out.worker_id, 100);
    for (i = 2; i <= 16; i++) {         /* 16 lands in cell 0 again */
        rec.worker_id = 100 + i;
        CHECK(kv_dring_push(r, &rec) == 0);
    }
    late.n = 1;
    late.worker_id = 666;
    CHECK(kv_dring_fill(r, 0, &late) == -1);    /* too late, refused */
    while (kv_dring_pop(r, &out) == 1) {
        popped++;
        stale += out.worker_id == 666;
    }
    CHECK_EQ_U64(stale, 0);
    CHECK_EQ_U64(popped, 14);           /* 2..15; 16's cell was torn */
    kv_dring_stats(r, &st);
    CHECK_EQ_U64(st.lost, 2);           /* position 0, and 16 */
    free(r);
}

/* --- the wire -------------------------------------------------------- */

static unsigned char sent[65536];
static size_t        sent_len;
static int save(void *arg, const void *buf, size_t len)
{
    memcpy(sent, buf, len);
    sent_len = len;
    return 0;
}

static uint64_t got_wid, got_seq[KV_DRING_HASHES];
static uint32_t got_first, got_n, got_calls;
static void blocks(void *arg, uint64_t wid, const uint64_t *seq, uint32_t first, uint32_t n)
{
    got_wid = wid;
    got_first = first;
    got_n = n;
    memcpy(got_seq, seq, n * sizeof(uint64_t));
    got_calls++;
}

static kv_load_t *load_new(void)
{
    size_t     sz = kv_load_size(8, 4, 2);
    kv_load_t *ld = kv_load_init(calloc(1, sz), sz, 8, 4, 2, 0);

    kv_load_server(ld, "llm/127.0.0.1:1", 15);
    kv_load_server(ld, "llm/127.0.0.1:2", 15);
    return ld;
}

TEST(share_round_trip_and_lease)
{
    char              err[128];
    kv_dring_t       *ra = ring_new(16), *rb = ring_new(16);
    kv_load_t        *la = load_new(), *lb = load_new();
    kv_share_config_t ca = { 0 }, cb = { 0 };
    kv_share_t       *a, *b;
    kv_dring_rec_t    rec = { 0 };
    kv_load_server_t  s;
    int               rowa = kv_load_claim_row(la, 1), rowb = kv_load_claim_row(lb, 2);

    ca.instance_id = 11;
    ca.publish = save;
    ca.lease_ms = 1000;
    cb = ca;
    cb.instance_id = 22;
    cb.on_blocks = blocks;
    a = kv_share_create(&ca, ra, la, rowa, err, sizeof(err));
    b = kv_share_create(&cb, rb, lb, rowb, err, sizeof(err));
    CHECK(a && b);

    /* A routed a request to server 1 and decided worker 7 holds 3 blocks */
    kv_load_add(la, -1, 1, KV_LOAD_REQUESTS, 1);
    rec.worker_id = 7;
    rec.first = 0;
    rec.n = 3;
    rec.seq[0] = 100, rec.seq[1] = 101, rec.seq[2] = 102;
    CHECK(kv_dring_push(ra, &rec) == 0);
    kv_share_tick(a, 1000);
    CHECK(sent_len > 0);
    CHECK(kv_share_receive(b, sent, sent_len, 1000) == 0);
    CHECK_EQ_U64(got_calls, 1);
    CHECK_EQ_U64(got_wid, 7);
    CHECK_EQ_U64(got_n, 3);
    CHECK_EQ_U64(got_seq[2], 102);
    kv_load_get(lb, 1, &s);
    CHECK_EQ_U64(s.active[KV_LOAD_REQUESTS], 1);
    CHECK_EQ_U64(kv_dring_share(rb)->remote_requests, 1);

    /* its own message is ignored; B's load does not echo back as B's own */
    CHECK(kv_share_receive(a, sent, sent_len, 1000) == 0);
    kv_load_get(la, 1, &s);
    CHECK_EQ_U64(s.active[KV_LOAD_REQUESTS], 1);
    sent_len = 0;
    kv_share_tick(b, 1100);
    CHECK_EQ_U64(sent_len, 0);      /* B holds nothing of its own */

    /* a replay is idempotent (absolutes) */
    kv_share_tick(a, 1400);     /* a refresh: nonzero, a third of a lease on */
    CHECK(sent_len > 0);
    CHECK(kv_share_receive(b, sent, sent_len, 1400) == 0);
    CHECK(kv_share_receive(b, sent, sent_len, 1400) == 0);
    kv_load_get(lb, 1, &s);
    CHECK_EQ_U64(s.active[KV_LOAD_REQUESTS], 1);

    /* received a ms after the tick read its clock (the receiving thread
     * stamps its own): fresh, not expired */
    CHECK(kv_share_receive(b, sent, sent_len, 1401) == 0);
    kv_share_tick(b, 1400);
    kv_load_get(lb, 1, &s);
    CHECK_EQ_U64(s.active[KV_LOAD_REQUESTS], 1);

    /* A falls silent: its load at B lasts the lease, not longer */
    kv_share_tick(b, 2300);
    kv_load_get(lb, 1, &s);
    CHECK_EQ_U64(s.active[KV_LOAD_REQUESTS], 1);
    kv_share_tick(b, 2500);
    kv_load_get(lb, 1, &s);
    CHECK_EQ_U64(s.active[KV_LOAD_REQUESTS], 0);
    CHECK_EQ_U64(kv_dring_share(rb)->remote_requests, 0);
    CHECK(kv_dring_share(rb)->expired >= 1);

    kv_share_destroy(a);
    kv_share_destroy(b);
    free(ra); free(rb); free(la); free(lb);
}

TEST(share_refuses_malformed)
{
    char              err[128];
    kv_dring_t       *r = ring_new(16);
    kv_load_t        *ld = load_new();
    kv_share_config_t c = { 0 };
    kv_share_t       *s;
    unsigned char     m[256];
    size_t            i;

    c.instance_id = 5;
    c.on_blocks = blocks;
    s = kv_share_create(&c, r, ld, -1, err, sizeof(err));
    CHECK(s != NULL);
    got_calls = 0;

    /* every prefix of a valid one-record message, and bytes flipped */
    memset(m, 0, sizeof(m));
    memcpy(m, "KVD1", 4);
    m[4] = 1;               /* version */
    m[8] = 9;               /* instance */
    m[16] = 1;              /* one record */
    m[32] = 7;              /* worker */
    m[32 + 12] = 2;         /* n = 2 */
    CHECK(kv_share_receive(s, m, 32 + 16 + 16, 0) == 0);
    CHECK_EQ_U64(got_calls, 1);
    for (i = 0; i < 32 + 16 + 16; i++) {
        CHECK(kv_share_receive(s, m, i, 0) == -1);
    }
    CHECK(kv_share_receive(s, m, 32 + 16 + 16 + 1, 0) == -1);
    m[32 + 12] = KV_DRING_HASHES + 1;
    CHECK(kv_share_receive(s, m, sizeof(m), 0) == -1);
    m[32 + 12] = 0;
    CHECK(kv_share_receive(s, m, 32 + 16, 0) == -1);
    CHECK_EQ_U64(got_calls, 1);
    CHECK_EQ_U64(kv_dring_share(r)->rejected, 32 + 16 + 16 + 3);
    kv_share_destroy(s);
    free(r); free(ld);
}

static uint64_t resp_wid, resp_key;
static uint32_t resp_calls;
static void response(void *arg, uint64_t wid, uint64_t key)
{
    resp_wid = wid;
    resp_key = key;
    resp_calls++;
}

/* A response record reaches on_response, never on_blocks. */
TEST(share_response_record)
{
    char              err[128];
    kv_dring_t       *ra = ring_new(16), *rb = ring_new(16);
    kv_load_t        *la = load_new(), *lb = load_new();
    kv_share_config_t ca = { 0 }, cb = { 0 };
    kv_share_t       *a, *b;
    kv_dring_rec_t    rec = { 0 };

    ca.instance_id = 31;
    ca.publish = save;
    cb = ca;
    cb.instance_id = 32;
    cb.on_blocks = blocks;
    cb.on_response = response;
    a = kv_share_create(&ca, ra, la, kv_load_claim_row(la, 1), err, sizeof(err));
    b = kv_share_create(&cb, rb, lb, kv_load_claim_row(lb, 2), err, sizeof(err));
    CHECK(a && b);
    rec.worker_id = 9;
    rec.first = KV_SHARE_RESPONSE;
    rec.n = 1;
    rec.seq[0] = 0xabcdef;
    CHECK(kv_dring_push(ra, &rec) == 0);
    sent_len = 0;
    kv_share_tick(a, 1000);
    CHECK(sent_len > 0);
    got_calls = resp_calls = 0;
    CHECK(kv_share_receive(b, sent, sent_len, 1000) == 0);
    CHECK_EQ_U64(resp_calls, 1);
    CHECK_EQ_U64(resp_wid, 9);
    CHECK_EQ_U64(resp_key, 0xabcdef);
    CHECK_EQ_U64(got_calls, 0);
    kv_share_destroy(a);
    kv_share_destroy(b);
    free(ra); free(rb); free(la); free(lb);
}

int main(void)
{
    RUN(share_response_record);
    RUN(ring_drops_when_full_and_keeps_order);
    RUN(ring_many_producers_nothing_torn);
    RUN(ring_late_writer_cannot_pass_for_the_next_lap);
    RUN(share_round_trip_and_lease);
    RUN(share_refuses_malformed);
    return kvt_done();
}
