/*
 * OpenAI-compatible request parsing and response rendering for kvworker.
 * Pure functions over jansson; the HTTP transport lives in kvw_http.c.
 */
#ifndef KVW_OPENAI_H
#define KVW_OPENAI_H

#include <jansson.h>

#include "kvw_req.h"

/*
 * A request the worker refuses, as OpenAI describes it: the HTTP status, a
 * message for people, the request field at fault and a machine-readable
 * code (param and code may be NULL).
 */
typedef struct {
    int         status;
    char        message[256];
    const char *type;
    const char *param;
    const char *code;
} kvw_openai_err_t;

void kvw_req_clear(kvw_req_t *r);

#define KVW_MAX_PROMPTS 64

/* The `chat` argument below: which API the body is for. */
#define KVW_API_COMPLETIONS 0
#define KVW_API_CHAT        1
#define KVW_API_RESPONSES   2       /* rendered as the chat request vLLM makes of it */
#define KVW_API_ANTHROPIC   3       /* /v1/messages, likewise (kv_anthropic.h) */

/*
 * Fills r from a request body, with the tokenizer and chat renderer of tx.
 * chat selects /v1/chat/completions; `which` picks the prompt of a
 * completion request whose "prompt" is a list (r->n_prompts says how many
 * there are). On error returns -1 with e filled in; r must then be released
 * with kvw_req_clear(). Fields are type-checked; the ones kvworker does not
 * implement (n > 1, best_of > 1, logprobs, top_logprobs) are refused rather
 * than ignored.
 */
struct kvw_text;
int kvw_openai_parse_text(kvw_req_t *r, int chat, const char *body, size_t len,
                          const struct kvw_text *tx, size_t which, kvw_openai_err_t *e);

/*
 * The same in two steps, so that a body of many prompts is parsed once
 * (parsing a 54 MB body of 64 prompts per prompt stalls the event loop for
 * many seconds): load the JSON
 * document (an opaque jansson json_t *; NULL with e filled on error), then
 * read prompt `which` from it for each; free it with kvw_openai_unload.
 */
void *kvw_openai_load(const char *body, size_t len, kvw_openai_err_t *e);
int  kvw_openai_parse_doc(kvw_req_t *r, int chat, void *doc, const struct kvw_text *tx,
                          size_t which, kvw_openai_err_t *e);
void kvw_openai_unload(void *doc);

/* Fills e and returns -1 (a helper for the checks). */
int kvw_openai_fail(kvw_openai_err_t *e, int status, const char *type, const char *param,
                    const char *code, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));

/* {"error":{"message","type","param","code"}}: OpenAI's error shape. */
char *kvw_openai_error(const char *message, const char *type, const char *param,
                       const char *code);

/* {"id","object":"model","created","owned_by"}: one entry of /v1/models. */
char *kvw_openai_model(const char *id, const char *parent);
/* {"object":"list","data":[model]}: /v1/models. */
char *kvw_openai_models(const char *id, const char *loras);

/* One SSE data payload for a streamed token or the final chunk (a Response
 * has none: NULL; its end is kvw_openai_response_event's "completed"). */
char *kvw_openai_chunk(const kvw_req_t *r, const char *id, long created,
                       const char *text, size_t len, const char *finish);
/* An Anthropic message's stream event: "message_start" and
 * "content_block_start" (finish NULL), or at the end "content_block_stop",
 * "message_delta" and "message_stop", as one SSE text with their names. */
char *kvw_openai_message_events(const kvw_req_t *r, const char *id, const char *finish);
/* "response.in_progress", sent after "response.created" as vLLM does. */
char *kvw_openai_response_in_progress(const kvw_req_t *r, const char *id, long created);
/* A Response's stream event carrying the whole response: "response.created"
 * (text NULL: in progress) or "response.completed". */
char *kvw_openai_response_event(const kvw_req_t *r, const char *id, long created,
                                const char *text, size_t len, const char *finish);
/* The usage-only chunk sent when stream_options.include_usage is set. */
char *kvw_openai_usage_chunk(const kvw_req_t *r, const char *id, long created);
/* The whole non-streamed response. */
char *kvw_openai_response(const kvw_req_t *r, const char *id, long created,
                          const char *text, size_t len, const char *finish);

/* The same for n choices (a list of prompts); usage is summed. */
char *kvw_openai_response_n(const kvw_req_t *const *rs, const char *const *texts,
                            const size_t *lens, const char *const *finishes, size_t n,
                            const char *id, long created);

const char *kvw_finish_name(kvw_finish_t why);

#endif
