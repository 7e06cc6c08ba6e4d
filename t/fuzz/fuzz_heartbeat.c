/*
 * Fuzzes the heartbeat parser and what a heartbeat does to the helper's
 * per-worker state (kv_sync_heartbeat: announce, restart, id change,
 * leave, forged-ahead detection, load clamping) and to the registry and
 * index behind it. The first byte drives the surroundings: bits 0-1 pick
 * the subject it came on (shared, or per-worker for ids 0-7 by bits 2-4),
 * bit 5 runs the helper's tick after it, bits 6-7 advance the clock by
 * 0, 1 s, 5 s or 60 s (heartbeat timeouts, record forgetting). The rest is
 * the message. Never a crash, leak or hang; the checks of
 * fuzz_sync_common.h hold after every message.
 */
#include "fuzz_sync_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const uint64_t step[4] = { 0, 1000, 5000, 60000 };
    uint64_t              subject;

    if (size == 0) {
        return 0;
    }
    if (fz_ing == NULL) {
        fuzz_sync_rig();
    }
    fz_now += step[data[0] >> 6];
    subject = (data[0] >> 2) & 7;
    kv_sync_heartbeat(fz_ing, (const char *)data + 1, size - 1,
                      (data[0] & 3) ? &subject : NULL, fz_now);
    if (data[0] & 0x20) {
        kv_sync_tick(fz_ing, fz_now, 0, 0);
    }
    fuzz_sync_check();
    return 0;
}
