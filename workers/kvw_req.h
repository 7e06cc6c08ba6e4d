/*
 * One generation request as the HTTP front hands it to an engine, and the
 * calls an engine makes back as it produces tokens.
 */
#ifndef KVW_REQ_H
#define KVW_REQ_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
    KVW_FINISH_LENGTH,          /* max_tokens reached */
    KVW_FINISH_STOP,            /* eos or a stop string */
    KVW_FINISH_ABORT            /* engine error or shutdown */
} kvw_finish_t;

typedef struct kvw_engine kvw_engine_t;
typedef struct kvw_req kvw_req_t;

struct kvw_req {
    /* what was asked */
    int         chat;           /* /v1/chat/completions (or /v1/responses), else
                                   /v1/completions */
    int         responses;      /* /v1/responses: answered as a Response */
    int         anthropic;      /* /v1/messages: answered as an Anthropic message */
    int         stream;
    int         include_usage;  /* stream_options.include_usage */
    int         ignore_eos;
    int         max_tokens;
    double      temperature;
    double      top_p;
    int         top_k;
    uint64_t    seed;
    char       *model;
    char       *cache_salt;     /* folded into block hashes */
    int         lora;           /* model names a LoRA adapter: seeds the blocks */
    uint32_t   *prompt;         /* token ids */
    size_t      n_prompt;
    char      **stop;           /* stop strings */
    size_t      n_stop;
    size_t      n_prompts;      /* prompts in the request ("prompt" as a list) */
    size_t      index;          /* this one's choice index */

    /* what happened; the engine fills these */
    size_t      n_output;
    size_t      cached_tokens;  /* prompt tokens served from the prefix cache */
    uint64_t    arrival_us;
    uint64_t    first_token_us;
    uint64_t    rng;            /* the sampler's state after the token last emitted */

    /* owned by the HTTP front */
    void       *front;
    kvw_engine_t *engine;
    void       *engine_data;
    /* set by a front other than the HTTP one (tests): kvw_req_emit/finish call these */
    const struct kvw_req_hooks *hooks;
};

typedef struct kvw_req_hooks {
    void (*emit)(kvw_req_t *r, uint32_t token, const char *text, size_t len);
    void (*emit_text)(kvw_req_t *r, const char *text, size_t len);
    void (*finish)(kvw_req_t *r, kvw_finish_t why);
} kvw_req_hooks_t;

/* Engine -> front. text is the token's decoded bytes (may be empty). */
void kvw_req_emit(kvw_req_t *r, uint32_t token, const char *text, size_t len);
void kvw_req_finish(kvw_req_t *r, kvw_finish_t why);
/* Text that belongs to tokens already emitted (held back while it might start a stop string). */
void kvw_req_emit_text(kvw_req_t *r, const char *text, size_t len);

#endif
