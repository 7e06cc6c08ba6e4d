/*
 * Fuzzes the vLLM / SGLang KVEventBatch decoder: events or a clean error,
 * never a crash, leak or hang. The first byte picks the sequence step
 * (next, repeat, restart, gap); the rest is the payload, fed through
 * kv_zmq_feed to one index that lives across inputs, so sequence handling,
 * tier bookkeeping and index application are fuzzed too.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_index.h"
#include "kv_registry.h"
#include "kv_vllm_event.h"
#include "kv_zmq.h"

static kv_zmq_t *z;
static uint64_t  seq;

static void rig(void)
{
    static kv_index_config_t   ic = { .max_workers = 4 };
    static kv_zmq_pub_config_t pc = { "tcp://127.0.0.1:1", NULL, "127.0.0.1:8000", NULL, 0 };
    kv_zmq_config_t            zc = { 0 };
    char                       err[256];
    size_t                     n;
    uint32_t                   gen;
    kv_index_t                *ix;
    kv_registry_t             *reg;

    /* the smallest index (1024 entries): a restart or gap clears the
     * worker by one pass over the table, which at 1 MB was most of the
     * time per input; a small one also exercises eviction */
    n = kv_index_min_size(&ic);
    ix = kv_index_create(calloc(1, n), n, &ic, err, sizeof(err));
    n = kv_registry_min_size(4);
    reg = kv_registry_create(calloc(1, n), n, 4, err, sizeof(err));
    if (ix == NULL || reg == NULL) {
        abort();
    }
    kv_registry_lease_acquire(reg, 1, &gen);
    zc.pubs = &pc;
    zc.n_pubs = 1;
    zc.block_size = 4;
    z = kv_zmq_create(&zc, ix, reg, err, sizeof(err));
    if (z == NULL) {
        abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kv_vllm_batch_t b;
    char            err[256];

    if (size == 0) {
        return 0;
    }
    kv_vllm_batch_init(&b);
    err[0] = 0;
    if (kv_vllm_decode(&b, data + 1, size - 1, err, sizeof(err)) != 0) {
        if (err[0] == 0 || b.n_events != 0) {
            abort();
        }
    }
    kv_vllm_batch_free(&b);

    if (z == NULL) {
        rig();
    }
    switch (data[0] & 3) {
    case 0: seq++; break;
    case 1: break;
    case 2: seq = 0; break;
    case 3: seq += 2 + data[0] / 4; break;
    }
    kv_zmq_feed(z, 0, seq, data + 1, size - 1, 1000);
    return 0;
}
