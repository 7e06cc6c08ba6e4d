/* Shared by the heartbeat and dump fuzzers: one kv_ingest (never
 * connected: no NATS is needed, the sync logic runs on its own), a real
 * registry of 4 records and the smallest real index, living across inputs
 * so that state built by earlier inputs (announces, resyncs, timeouts,
 * evictions) meets later ones. Checks that hold after every message. */
#ifndef FUZZ_SYNC_COMMON_H
#define FUZZ_SYNC_COMMON_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_index.h"
#include "kv_ingest_int.h"
#include "kv_registry.h"

#define FUZZ_WORKERS 4

static kv_ingest_t   *fz_ing;
static kv_registry_t *fz_reg;
static kv_index_t    *fz_ix;
static uint64_t       fz_now = 1000000;

static void fuzz_sync_rig(void)
{
    kv_index_config_t  ic = { .max_workers = FUZZ_WORKERS };
    kv_ingest_config_t cfg;
    char               err[256];
    size_t             n;

    n = kv_index_min_size(&ic);
    fz_ix = kv_index_create(aligned_alloc(64, (n + 63) / 64 * 64), n, &ic, err, sizeof(err));
    n = kv_registry_min_size(FUZZ_WORKERS);
    fz_reg = kv_registry_create(aligned_alloc(64, (n + 63) / 64 * 64), n, FUZZ_WORKERS, err,
                                sizeof(err));
    if (fz_ix == NULL || fz_reg == NULL) {
        abort();
    }
    memset(&cfg, 0, sizeof(cfg));
    cfg.servers = "nats://127.0.0.1:1";
    cfg.buffer_events = 64;
    fz_ing = kv_ingest_create(&cfg, fz_ix, fz_reg, err, sizeof(err));
    if (fz_ing == NULL) {
        abort();
    }
}

/* What no message may break: the record table stays within its size,
 * reported load within the clamp, strings terminated, the index within
 * its capacity and its per-worker counts consistent. */
static void fuzz_sync_check(void)
{
    kv_worker_rec_t  r;
    kv_index_stats_t st;
    uint64_t         sum = 0;
    uint32_t         s;
    int              i, used = 0;

    for (i = 0; i < FUZZ_WORKERS; i++) {
        if (kv_registry_read(fz_reg, i, &r) != 0) {
            continue;
        }
        used++;
        if (r.load.waiting > (1u << 20) || r.load.running > (1u << 20)
            || r.load.active_prefill_tokens > 4 * (1ull << 26)
            || (r.num_blocks && r.num_blocks < (1ull << 26)
                && (r.load.active_decode_blocks > r.num_blocks
                    || r.load.kv_used_blocks > r.num_blocks))
            || memchr(r.address, 0, sizeof(r.address)) == NULL
            || memchr(r.model, 0, sizeof(r.model)) == NULL) {
            abort();
        }
    }
    if (used > FUZZ_WORKERS) {
        abort();
    }
    kv_index_stats(fz_ix, &st);
    for (s = 0; s < kv_index_max_workers(fz_ix); s++) {
        sum += kv_index_worker_blocks(fz_ix, s);
    }
    if (st.blocks > sum || st.blocks > st.capacity) {
        abort();
    }
}

#endif
