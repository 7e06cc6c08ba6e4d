/*
 * Trace replay against an OpenAI-compatible /v1/completions endpoint: one
 * libevent loop, one streaming HTTP connection per request in flight, so a
 * single core keeps thousands of streams going.
 */
#ifndef KVB_REPLAY_H
#define KVB_REPLAY_H

#include <stddef.h>
#include <stdint.h>

#include "kv_trace.h"

typedef struct {
    const char *url;            /* http://host:port[/path]; /v1/completions by default */
    const char *model;
    int         text;           /* prompts as text instead of token ids */
    int         chat;           /* /v1/chat/completions: the text prompt as one user message */
    double      speedup;        /* arrival times divided by this (when concurrency == 0) */
    int         concurrency;    /* > 0: keep this many in flight, ignore timestamps */
    uint32_t    block_size;     /* tokens per trace hash id */
    uint32_t    vocab;          /* token ids drawn from [100, 100 + vocab) */
    double      timeout_s;      /* a request silent this long fails */
} kvb_opts_t;

/* What happened to one request. Times are ms since the run started; -1 = never. */
typedef struct {
    double      due_ms, start_ms, first_ms, end_ms;
    uint32_t    input_length, max_tokens;
    uint32_t    chunks;             /* SSE events that carried output text */
    double      last_ms;            /* the latest such event */
    float      *gaps;               /* ms between consecutive such events (malloc) */
    uint32_t    ngaps, capgaps;
    long        prompt_tokens, completion_tokens, cached_tokens;  /* usage; -1 = absent */
    int         status;             /* HTTP status, 0 = no response */
    char       *error;              /* NULL on success */
} kvb_result_t;

/*
 * Replays t (all of it) and fills res[0..t->n). Returns the wall time of the
 * run in ms, or -1 with a reason in err when it could not start at all.
 */
double kvb_replay(const kv_trace_t *t, const kvb_opts_t *o, kvb_result_t *res,
                  char *err, size_t errlen);

#endif
