/* Shared by the event fuzzers: applies a decoded batch to a small fresh
 * index and checks that the per-worker counts add up. The region is the
 * index's own minimum plus room for about a thousand entries, so a batch
 * can fill it (a fixed 64 KiB stopped fitting the header as it grew, and
 * every input then failed at create). */
#ifndef FUZZ_EVENT_COMMON_H
#define FUZZ_EVENT_COMMON_H

#include <stdio.h>
#include <stdlib.h>

static void fuzz_apply(const kv_event_batch_t *b)
{
    static char       *region;
    static size_t      size;
    kv_index_config_t  cfg = { .max_workers = 4 };
    kv_index_stats_t   st;
    kv_index_t        *ix;
    char               err[256];
    uint64_t           sum = 0;
    uint32_t           s;
    size_t             i;

    if (region == NULL) {
        size = (kv_index_min_size(&cfg) + (32 << 10) + 63) & ~(size_t) 63;
        region = aligned_alloc(64, size);
    }
    ix = kv_index_create(region, size, &cfg, err, sizeof(err));
    if (ix == NULL) {
        fprintf(stderr, "fuzz_apply: %s\n", err);
        abort();
    }
    for (i = 0; i < b->n_events; i++) {
        kv_index_apply(ix, &b->events[i], 1000 + i, err, sizeof(err));
    }
    kv_index_stats(ix, &st);
    for (s = 0; s < kv_index_max_workers(ix); s++) {
        sum += kv_index_worker_blocks(ix, s);
    }
    /* every (block, holder) pair is counted once; blocks <= pairs */
    if (st.blocks > sum || st.blocks > st.capacity) {
        abort();
    }
}

#endif
