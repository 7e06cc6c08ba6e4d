/* Shared by the event fuzzers: applies a decoded batch to a small fresh
 * index and checks that the per-worker counts add up. */
#ifndef FUZZ_EVENT_COMMON_H
#define FUZZ_EVENT_COMMON_H

static void fuzz_apply(const kv_event_batch_t *b)
{
    static char        region[64 * 1024] __attribute__((aligned(64)));
    kv_index_config_t  cfg = { .max_workers = 4 };
    kv_index_stats_t   st;
    kv_index_t        *ix;
    char               err[256];
    uint64_t           sum = 0;
    uint32_t           s;
    size_t             i;

    ix = kv_index_create(region, sizeof(region), &cfg, err, sizeof(err));
    if (ix == NULL) {
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
