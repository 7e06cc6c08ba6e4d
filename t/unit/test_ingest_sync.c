/*
 * kv_ingest's per-worker consistency logic without NATS: event ordering,
 * duplicates, gaps, buffering during a resync, dump application, buffer
 * overflow, heartbeat timeouts, bad heartbeats and dumps.
 *
 * The index and the event decoder are replaced by a recording fake
 * defined here (the only kv_index/kv_event symbols kv_ingest uses), so
 * this test runs whether or not src/index/kv_index.c is built; being
 * defined in this object, the fakes take precedence over the library.
 */
#include <stdlib.h>

#include "kv_ingest_int.h"
#include "kvtest.h"

/* --- fake index: records what it is asked to do ------------------------- */

typedef struct {
    uint64_t worker_id;
    uint64_t event_id;
    int      kind;
    int      has_parent;
    uint64_t parent;
    size_t   n;
    uint64_t first_block, first_tokens;
} applied_t;

static applied_t applied[1024];
static size_t n_applied, n_clears;
static uint64_t last_clear;

int kv_index_apply(kv_index_t *ix, const kv_event_t *ev, uint64_t now_ms, char *err,
                   size_t errlen)
{
    applied_t *a = &applied[n_applied++ % 1024];
    memset(a, 0, sizeof(*a));
    a->worker_id = ev->worker_id;
    a->event_id = ev->event_id;
    a->kind = ev->kind;
    a->has_parent = ev->has_parent;
    a->parent = ev->parent_hash;
    a->n = ev->kind == KV_EVENT_STORED ? ev->n_blocks : ev->n_hashes;
    if (ev->kind == KV_EVENT_STORED && ev->n_blocks) {
        a->first_block = ev->blocks[0].block_hash;
        a->first_tokens = ev->blocks[0].tokens_hash;
    }
    return 0;
}

void kv_index_worker_clear(kv_index_t *ix, uint64_t worker_id)
{
    n_clears++;
    last_clear = worker_id;
}

uint64_t kv_index_seq_of(kv_index_t *ix, uint64_t worker_id, uint32_t dp_rank,
                         uint64_t engine_hash)
{
    return engine_hash;
}

void kv_index_worker_remove(kv_index_t *ix, uint64_t worker_id)
{
    n_clears++;
    last_clear = worker_id;
}

int kv_index_reap(kv_index_t *ix)
{
    return 0;
}

void kv_event_batch_init(kv_event_batch_t *b) { memset(b, 0, sizeof(*b)); }
void kv_event_batch_free(kv_event_batch_t *b) { memset(b, 0, sizeof(*b)); }
int kv_event_decode(kv_event_batch_t *b, const void *buf, size_t len, char *err, size_t errlen)
{
    return -1;      /* unused: events are fed decoded */
}

/* --- helpers ------------------------------------------------------------ */

static void *regmem;
static kv_registry_t *reg;
static int fake_ix;     /* never dereferenced */

static kv_ingest_t *make_for(const char *servers, uint32_t buffer_events)
{
    char err[128];
    size_t size = kv_registry_min_size(8);
    free(regmem);
    regmem = aligned_alloc(64, (size + 63) / 64 * 64);
    reg = kv_registry_create(regmem, size, 8, err, sizeof(err));
    kv_ingest_config_t cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.servers = servers;
    cfg.buffer_events = buffer_events;
    n_applied = n_clears = 0;
    return kv_ingest_create(&cfg, (kv_index_t *)&fake_ix, reg, err, sizeof(err));
}

static kv_ingest_t *make(uint32_t buffer_events)
{
    return make_for("nats://127.0.0.1:1", buffer_events);
}

static kv_stored_block_t blk[4] = {{11, 111}, {12, 112}, {13, 113}, {14, 114}};

static void feed(kv_ingest_t *ing, uint64_t wid, uint64_t eid, uint64_t now)
{
    kv_event_t ev;
    memset(&ev, 0, sizeof(ev));
    ev.worker_id = wid;
    ev.event_id = eid;
    ev.kind = KV_EVENT_STORED;
    ev.blocks = blk;
    ev.n_blocks = 2;
    kv_event_batch_t b;
    memset(&b, 0, sizeof(b));
    b.events = &ev;
    b.n_events = 1;
    kv_sync_events(ing, &b, NULL, now);
}

static void heartbeat(kv_ingest_t *ing, uint64_t wid, uint64_t inst, uint64_t last, uint64_t now)
{
    char buf[512];
    int n = snprintf(buf, sizeof(buf),
                     "{\"type\":\"announce\",\"worker_id\":%llu,\"dp_rank\":0,\"instance_id\":%llu,"
                     "\"address\":\"127.0.0.1:8001\",\"model\":\"m\",\"block_size\":16,"
                     "\"num_blocks\":100,\"last_event_id\":%llu,\"interval_ms\":1000,"
                     "\"load\":{\"running\":3,\"waiting\":1,\"max_num_seqs\":256}}",
                     (unsigned long long)wid, (unsigned long long)inst,
                     (unsigned long long)last);
    kv_sync_heartbeat(ing, buf, (size_t)n, NULL, now);
}

static kv_worker_rec_t rec_of(uint64_t wid)
{
    kv_worker_rec_t r;
    memset(&r, 0, sizeof(r));
    kv_registry_read(reg, kv_registry_find(reg, wid, 0), &r);
    return r;
}

static kv_ingest_status_t status(void)
{
    kv_ingest_status_t st;
    kv_registry_status(reg, &st);
    return st;
}

/* --- tests -------------------------------------------------------------- */

TEST(unannounced_in_order_duplicates_and_gaps)
{
    kv_ingest_t *ing = make(0);
    feed(ing, 9, 1, 1000);
    feed(ing, 9, 2, 1000);
    feed(ing, 9, 2, 1000);          /* duplicate */
    feed(ing, 9, 5, 1000);          /* gap: cannot resync, applied */
    CHECK_EQ_U64(n_applied, 3);
    kv_ingest_status_t st = status();
    CHECK_EQ_U64(st.duplicates, 1);
    CHECK_EQ_U64(st.gaps, 1);
    CHECK_EQ_U64(st.resyncs, 0);
    kv_worker_rec_t r = rec_of(9);
    CHECK_EQ_U64(r.last_event_applied, 5);
    CHECK_STR(kv_worker_state_name(r.state), "live");
    /* restart of an unannounced worker: event 1 again clears it */
    feed(ing, 9, 1, 1000);
    CHECK_EQ_U64(n_clears, 1);
    CHECK_EQ_U64(rec_of(9).last_event_applied, 1);
    kv_ingest_destroy(ing);
}

static void dump_chunk(kv_ingest_t *ing, uint64_t seq, const char *json)
{
    kv_sync_dump_chunk(ing, seq, json, strlen(json), 2000);
}

TEST(announce_resyncs_buffers_and_replays_after_dump)
{
    kv_ingest_t *ing = make(0);
    heartbeat(ing, 42, 777, 3, 1000);
    kv_worker_rec_t r = rec_of(42);
    CHECK_STR(kv_worker_state_name(r.state), "resyncing");
    CHECK_STR(r.address, "127.0.0.1:8001");
    CHECK_EQ_U64(r.load.running, 3);
    /* events during the resync are held back */
    feed(ing, 42, 3, 1100);
    feed(ing, 42, 4, 1100);
    feed(ing, 42, 5, 1100);
    CHECK_EQ_U64(n_applied, 0);
    /* not connected here: pretend the request went out as dump 7 */
    int i = kv_registry_find(reg, 42, 0);
    ing->wk[i].dump_seq = 7;
    ing->wk[i].dump_next_chunk = 0;
    dump_chunk(ing, 8, "{}");                                   /* another dump: ignored */
    CHECK_EQ_U64(n_clears, 0);
    dump_chunk(ing, 7, "{\"worker_id\":42,\"dp_rank\":0,\"instance_id\":777,\"last_event_id\":4,"
                       "\"chunk\":0,\"chunks\":2,\"blocks\":[[null,18446744073709551615,5],"
                       "[18446744073709551615,2,6],[null,3,7]]}");
    CHECK_EQ_U64(n_clears, 1);
    CHECK_EQ_U64(n_applied, 2);                                 /* chain of 2, then a root */
    CHECK_EQ_U64(applied[0].n, 2);
    CHECK(!applied[0].has_parent);
    CHECK_EQ_U64(applied[0].first_block, UINT64_MAX);           /* exact u64 */
    CHECK_EQ_U64(applied[1].first_tokens, 7);
    dump_chunk(ing, 7, "{\"worker_id\":42,\"dp_rank\":0,\"instance_id\":777,\"last_event_id\":4,"
                       "\"chunk\":1,\"chunks\":2,\"blocks\":[[3,4,8]]}");
    CHECK_EQ_U64(applied[2].has_parent, 1);
    CHECK_EQ_U64(applied[2].parent, 3);
    /* whole: live, buffered 3 and 4 skipped (in the dump), 5 applied */
    CHECK_EQ_U64(n_applied, 4);
    CHECK_EQ_U64(applied[3].event_id, 5);
    r = rec_of(42);
    CHECK_STR(kv_worker_state_name(r.state), "live");
    CHECK_EQ_U64(r.last_event_applied, 5);
    CHECK_EQ_U64(r.resyncs, 1);
    CHECK_EQ_U64(status().dumps, 1);
    /* then a gap resyncs again */
    feed(ing, 42, 9, 3000);
    CHECK_STR(kv_worker_state_name(rec_of(42).state), "resyncing");
    CHECK_EQ_U64(n_applied, 4);
    kv_ingest_destroy(ing);
}

TEST(bad_dumps_and_overflow)
{
    kv_ingest_t *ing = make(2);
    heartbeat(ing, 5, 1, 0, 1000);
    int i = kv_registry_find(reg, 5, 0);
    ing->wk[i].dump_seq = 3;
    dump_chunk(ing, 3, "{\"worker_id\":5,\"chunk\":0,\"chunks\":1,\"blocks\":[[null,1]]}");
    CHECK_EQ_U64(status().dump_failures, 1);
    CHECK_EQ_U64(ing->wk[i].need_resync, 1);
    /* out of order chunk */
    ing->wk[i].dump_seq = 4;
    ing->wk[i].dump_next_chunk = 0;
    dump_chunk(ing, 4, "{\"worker_id\":5,\"dp_rank\":0,\"chunk\":1,\"chunks\":2,\"blocks\":[]}");
    /* a chunk that is not the requested one is ignored, not failed: a
     * forger answering first must not hide the real reply behind it */
    CHECK_EQ_U64(status().rejected, 1);
    CHECK_EQ_U64(ing->wk[i].dump_seq, 4);
    /* buffer of 2 events overflows: the dump that follows is not enough */
    for (uint64_t e = 1; e <= 4; e++)
        feed(ing, 5, e, 1100);
    CHECK_EQ_U64(status().buffer_overflows, 1);
    ing->wk[i].dump_seq = 5;
    ing->wk[i].dump_next_chunk = 0;
    dump_chunk(ing, 5, "{\"worker_id\":5,\"dp_rank\":0,\"last_event_id\":1,\"chunk\":0,"
                       "\"chunks\":1,\"blocks\":[]}");
    CHECK_STR(kv_worker_state_name(rec_of(5).state), "resyncing");
    CHECK_EQ_U64(status().dumps, 1);
    kv_ingest_destroy(ing);
}

TEST(heartbeat_timeout_restart_and_malformed)
{
    kv_ingest_t *ing = make(0);
    heartbeat(ing, 8, 1, 0, 1000);
    int i = kv_registry_find(reg, 8, 0);
    ing->wk[i].dump_seq = 2;
    dump_chunk(ing, 2, "{\"worker_id\":8,\"dp_rank\":0,\"last_event_id\":0,\"chunk\":0,"
                       "\"chunks\":1,\"blocks\":[]}");
    CHECK_STR(kv_worker_state_name(rec_of(8).state), "live");
    size_t clears = n_clears;
    kv_sync_tick(ing, 3500, 1, 0);                  /* 2.5 s: within 3 s */
    CHECK_STR(kv_worker_state_name(rec_of(8).state), "live");
    kv_sync_tick(ing, 4500, 0, 0);                  /* NATS down: no timeout */
    CHECK_STR(kv_worker_state_name(rec_of(8).state), "live");
    kv_sync_tick(ing, 5600, 0, 0);                  /* down past the stale lag */
    CHECK_STR(kv_worker_state_name(rec_of(8).state), "stale");
    kv_sync_tick(ing, 5700, 1, 1);                  /* back: resync, silence forgiven */
    CHECK_STR(kv_worker_state_name(rec_of(8).state), "resyncing");
    kv_sync_tick(ing, 8000, 1, 0);
    CHECK_STR(kv_worker_state_name(rec_of(8).state), "resyncing");
    kv_sync_tick(ing, 9000, 1, 0);                  /* silent 3.3 s since: gone */
    CHECK_STR(kv_worker_state_name(rec_of(8).state), "gone");
    CHECK_EQ_U64(n_clears, clears + 1);
    CHECK_EQ_U64(status().timeouts, 1);
    /* a new instance resyncs */
    heartbeat(ing, 8, 2, 0, 9100);
    CHECK_STR(kv_worker_state_name(rec_of(8).state), "resyncing");
    CHECK_EQ_U64(rec_of(8).instance_id, 2);
    /* malformed heartbeats are counted, never crash */
    const char *bad[] = {"", "{", "[]", "{\"worker_id\":-}", "{\"dp_rank\":0}",
                         "{\"worker_id\":1,\"load\":{\"running\":\"x\"}}", "\xff\xfe"};
    for (size_t k = 0; k < sizeof(bad) / sizeof(bad[0]); k++)
        kv_sync_heartbeat(ing, bad[k], strlen(bad[k]), NULL, 9200);
    CHECK_EQ_U64(status().decode_errors, sizeof(bad) / sizeof(bad[0]));
    kv_ingest_destroy(ing);
}

/* Seen from event 1 with nothing missed: the first announce needs no dump.
 * Seen from the middle: it does. */
TEST(complete_history_skips_the_first_resync)
{
    kv_ingest_t *ing = make(0);
    feed(ing, 20, 1, 1000);
    feed(ing, 20, 2, 1000);
    heartbeat(ing, 20, 5, 2, 1100);
    CHECK_STR(kv_worker_state_name(rec_of(20).state), "live");
    CHECK_EQ_U64(status().resyncs, 0);
    feed(ing, 21, 4, 1000);                         /* joined late */
    feed(ing, 21, 5, 1000);
    heartbeat(ing, 21, 6, 5, 1100);
    CHECK_STR(kv_worker_state_name(rec_of(21).state), "resyncing");
    feed(ing, 22, 1, 1000);
    feed(ing, 22, 3, 1000);                         /* gap before the announce */
    heartbeat(ing, 22, 7, 3, 1100);
    CHECK_STR(kv_worker_state_name(rec_of(22).state), "resyncing");
    kv_ingest_destroy(ing);
}

/* A start that fails (no usable server URL, unreadable TLS files) leaves
 * nothing behind: nginx's helper destroys the ingester and tries again
 * every 5 s, and each try leaked its NATS options before (with TLS, a CA
 * store); `make test SANITIZE=1` reports such a leak. */
TEST(failed_start_leaves_nothing)
{
    char err[128];
    kv_ingest_t *ing = make_for(", ", 0);
    CHECK(ing != NULL);
    CHECK(kv_ingest_start(ing, err, sizeof(err)) == -1);
    CHECK(strstr(err, "bad server list") != NULL);
    kv_ingest_destroy(ing);
}

int main(void)
{
    RUN(failed_start_leaves_nothing);
    RUN(unannounced_in_order_duplicates_and_gaps);
    RUN(announce_resyncs_buffers_and_replays_after_dump);
    RUN(bad_dumps_and_overflow);
    RUN(heartbeat_timeout_restart_and_malformed);
    RUN(complete_history_skips_the_first_resync);
    free(regmem);
    return kvt_done();
}
