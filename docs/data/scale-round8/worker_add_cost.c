/* cost of kv_index_worker_add for an existing worker at slot k of a full
 * 4,096-slot index (what ngx_http_kvroute_record paid per request) */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "kv_index.h"
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec/1e9;}
int main(void){
    kv_index_config_t c = {0}; c.max_workers = 4096; c.max_blocks = 1<<16;
    size_t sz = kv_index_min_size(&c); void *r = aligned_alloc(64, (sz+63)/64*64);
    kv_index_t *ix = kv_index_create(r, sz, &c, NULL, 0);
    if (!ix) { fprintf(stderr, "create failed\n"); return 1; }
    for (uint64_t w = 0; w < 4096; w++) kv_index_worker_add(ix, 1000 + w, 0);
    uint64_t ks[] = {0, 63, 1023, 2047, 4095};
    for (int j = 0; j < 5; j++) {
        int n = 200000; volatile int s = 0; double t = now();
        for (int i = 0; i < n; i++) s += kv_index_worker_add(ix, 1000 + ks[j], 0);
        t = now() - t;
        printf("worker at slot %4llu: %.3f us per kv_index_worker_add (slot %d)\n", (unsigned long long) ks[j], t / n * 1e6, kv_index_worker_add(ix, 1000 + ks[j], 0));
    }
    return 0;
}
