/* The HTTP front of one engine: OpenAI routes on one listening port. */
#ifndef KVW_HTTP_H
#define KVW_HTTP_H

#include "kvw_engine.h"
#include "kvw_openai.h"
#include "kvw_text.h"

typedef struct kvw_http kvw_http_t;

/* Binds host:port for engine e. On failure returns NULL with a reason. */
kvw_http_t *kvw_http_start(kvw_engine_t *e, const char *host, int port,
                           kvw_tokenize_fn tok, void *tok_ctx,
                           char *err, size_t errlen);
void kvw_http_stop(kvw_http_t *h);

#endif
