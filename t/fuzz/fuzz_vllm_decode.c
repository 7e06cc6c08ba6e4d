/*
 * Fuzzes the vLLM / SGLang KVEventBatch decoder alone (kv_vllm_decode):
 * events or a clean error, never a crash, leak or hang. fuzz_vllm_event
 * feeds the same bytes through the sequence handling and the index too,
 * at a few thousand inputs a second; this one reaches the 10M executions
 * docs/BENCHMARKS.md asks of every event decoder.
 */
#include <stdint.h>
#include <stdlib.h>

#include "kv_vllm_event.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kv_vllm_batch_t b;
    char            err[256];

    kv_vllm_batch_init(&b);
    err[0] = 0;
    if (kv_vllm_decode(&b, data, size, err, sizeof(err)) != 0) {
        if (err[0] == 0 || b.n_events != 0) {
            abort();
        }
    }
    kv_vllm_batch_free(&b);
    return 0;
}
