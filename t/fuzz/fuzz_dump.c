/*
 * Fuzzes the dump-chunk parser and its application (kv_sync_dump_chunk:
 * head validation against the request, chunk order, blocks into the
 * index, buffered events replayed after the last chunk). The helper is
 * not connected, so the fuzzer plays its part: worker 7 (rank 0,
 * instance 777, last event 100 announced) is kept in "resyncing" with a
 * dump in flight whose sequence number is the input's reply subject. The
 * first byte drives the surroundings: bit 0 sends the chunk to another
 * sequence number (a late or foreign reply), bit 1 re-announces the worker
 * first (restarts the dump), bit 2 runs the tick after (dump deadline,
 * retries), bits 3-4 advance the clock by 0, 0.5 s, 3 s or 60 s. The rest
 * is the chunk. Seeds in t/fuzz/corpus/fuzz_dump are chunks that pass
 * validation, so mutations reach the blocks.
 */
#include <stdio.h>

#include "fuzz_sync_common.h"

static const char announce[] =
    "{\"type\":\"announce\",\"worker_id\":7,\"dp_rank\":0,\"instance_id\":777,"
    "\"address\":\"127.0.0.1:8007\",\"model\":\"m\",\"block_size\":4,"
    "\"num_blocks\":100,\"last_event_id\":100,\"interval_ms\":1000}";

static int victim(void)
{
    for (uint32_t k = 0; k < fz_ing->max_workers; k++) {
        if (fz_ing->wk[k].used && fz_ing->wk[k].worker_id == 7 && fz_ing->wk[k].dp_rank == 0) {
            return (int)k;
        }
    }
    return -1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const uint64_t step[4] = { 0, 500, 3000, 60000 };
    static uint64_t       seq = 1;
    kv_wstate_t          *w;
    int                   i;

    if (size == 0) {
        return 0;
    }
    if (fz_ing == NULL) {
        fuzz_sync_rig();
    }
    fz_now += step[(data[0] >> 3) & 3];
    i = victim();
    if (i < 0 || (data[0] & 2)) {
        kv_sync_heartbeat(fz_ing, announce, sizeof(announce) - 1, NULL, fz_now);
        i = victim();
        if (i < 0) {
            abort();        /* a full table never refuses a newcomer */
        }
    }
    w = &fz_ing->wk[i];
    if (w->state != KV_WORKER_RESYNCING || w->dump_seq == 0) {
        /* what start_resync does once the request is out */
        w->state = KV_WORKER_RESYNCING;
        w->need_resync = 0;
        w->dump_seq = ++seq;
        w->dump_next_chunk = 0;
        w->dump_deadline_ms = fz_now + 2000;
    }
    kv_sync_dump_chunk(fz_ing, w->dump_seq + (data[0] & 1), (const char *)data + 1, size - 1,
                       fz_now);
    if (data[0] & 4) {
        kv_sync_tick(fz_ing, fz_now, 0, 0);
    }
    fuzz_sync_check();
    return 0;
}
