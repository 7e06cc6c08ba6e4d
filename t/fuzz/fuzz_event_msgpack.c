/*
 * Fuzzes the MessagePack decoder (envelope, or a bare RouterEvent map):
 * events or a clean error, never a crash, leak or hang. Decoded events are
 * applied to a small fresh index, as in fuzz_event_json.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_event.h"
#include "kv_index.h"

#include "fuzz_event_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kv_event_batch_t b;
    char             err[256];

    kv_event_batch_init(&b);
    err[0] = 0;
    if (kv_event_decode_msgpack(&b, data, size, err, sizeof(err)) != 0) {
        if (err[0] == 0 || b.n_events != 0) {
            abort();
        }
    } else {
        fuzz_apply(&b);
    }
    kv_event_batch_free(&b);
    return 0;
}
