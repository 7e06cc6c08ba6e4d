/*
 * The Responses API's store: the responses an engine made, kept so that a
 * later request can continue one (`previous_response_id`) or fetch it
 * (GET /v1/responses/{id}). vLLM keeps them in the serving process when its
 * store is turned on (VLLM_ENABLE_RESPONSES_API_STORE), off by default, and
 * any other process answers 404: kvworker --responses-store N does the same
 * per engine, keeping the newest N (vLLM keeps all, a leak it documents).
 *
 * A response's conversation is kept as input items: the items it continued
 * (its own history), then its input. Continuing it sends this request's
 * `instructions` as a system message, the kept items, the kept output as an
 * assistant message, and the new input, as OpenAI describes it (a previous
 * response's instructions are not carried over).
 */
#ifndef KVW_RESPSTORE_H
#define KVW_RESPSTORE_H

#include <jansson.h>

#include "kvw_openai.h"

typedef struct kvw_respstore kvw_respstore_t;

/* A store of at most `capacity` responses; 0: NULL (the store is off). */
kvw_respstore_t *kvw_respstore_new(size_t capacity);
void kvw_respstore_free(kvw_respstore_t *s);

/*
 * Reads a Responses API body's `previous_response_id` (doc: its jansson
 * document) and, when there is one, replaces the body's `input` by the
 * whole conversation and removes the id. 0: done (or nothing to do); -1
 * with e filled: not a string (400), or no such response here or the store
 * is off (404, before any work, as vLLM answers). s may be NULL.
 */
int kvw_respstore_expand(const kvw_respstore_t *s, json_t *doc, kvw_openai_err_t *e);

/*
 * What to keep of a request about to run: its conversation as input items
 * (after kvw_respstore_expand; a string input is one user message), new
 * reference; NULL when the store is off, the body says "store": false, or
 * out of memory.
 */
json_t *kvw_respstore_conversation(const kvw_respstore_t *s, const json_t *doc);

/*
 * Keeps a finished response: its id, its conversation (the reference is
 * taken), its output text, and the Response JSON that GET returns (taken,
 * malloc'ed). The oldest response goes when the store is full. -1: out of
 * memory (what was given is freed).
 */
int kvw_respstore_put(kvw_respstore_t *s, const char *id, json_t *conversation,
                      const char *text, size_t len, char *response);

/* The Response JSON kept under id; NULL: none. */
const char *kvw_respstore_get(const kvw_respstore_t *s, const char *id);

/* How many responses are kept now. */
size_t kvw_respstore_count(const kvw_respstore_t *s);

#endif
