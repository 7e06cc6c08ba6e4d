/* A fleet of idle, usable, trusted servers of weight 1 for the routing
 * tests. Each test file gives its own worker ids (first, step): the
 * rendezvous order depends on them, and each file's cases were written
 * against its own ids. */
#ifndef ROUTE_FLEET_H
#define ROUTE_FLEET_H

#include <string.h>

#include "kv_route.h"

static inline void route_fleet_idle(kv_route_server_t *s, size_t n, uint64_t first,
                                    uint64_t step)
{
    memset(s, 0, n * sizeof(*s));
    for (size_t i = 0; i < n; i++) {
        s[i].usable = 1;
        s[i].weight = 1;
        s[i].trusted = 1;
        s[i].id = first + step * i;
    }
}

/* the default configuration at block size bs */
static inline kv_route_config_t route_fleet_config(uint32_t bs)
{
    kv_route_config_t cfg;

    kv_route_config_init(&cfg);
    cfg.block_size = bs;
    return cfg;
}

#endif
