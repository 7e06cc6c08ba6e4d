/*
 * The engine interface. One engine owns one KV cache and one scheduler; a
 * kvworker process hosts one or more (--engines N), all on one event loop.
 * Engines run on that loop: submit() and cancel() are called from it, and
 * engines call kvw_req_emit()/kvw_req_finish() from it.
 */
#ifndef KVW_ENGINE_H
#define KVW_ENGINE_H

#include <event2/event.h>

#include "kvw_req.h"

typedef struct kvw_config kvw_config_t;

typedef struct {
    const char *name;
    /* Takes ownership of nothing; r stays valid until kvw_req_finish. */
    int  (*submit)(kvw_engine_t *e, kvw_req_t *r);
    /* The client went away: drop r without calling kvw_req_finish. */
    void (*cancel)(kvw_engine_t *e, kvw_req_t *r);
    void (*destroy)(kvw_engine_t *e);
} kvw_engine_ops_t;

struct kvw_engine {
    const kvw_engine_ops_t *ops;
    const kvw_config_t     *cfg;
    struct event_base      *base;
    int                     index;      /* 0..engines-1 in this process */
    uint64_t                worker_id;
    int                     port;
};

struct kvw_config {
    const char *engine;         /* mock | cpu | cuda */
    const char *host;
    int         port;
    int         engines;
    const char *nats_url;       /* NULL: no events */
    uint64_t    worker_id;      /* 0: derived from host:port */
    const char *model;
    int         block_size;
    int         num_blocks;
    double      speedup;
    int         max_body;
};

kvw_engine_t *kvw_mock_create(const kvw_config_t *cfg, struct event_base *base,
                              int index);

#endif
