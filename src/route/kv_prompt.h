/*
 * From an OpenAI request body to the router's view of the prompt: its
 * token count and the sequence hashes of its full blocks. Tokenizes the
 * way the engines do: a completion's text prompt with the tokenizer's
 * special tokens (HF encode default, as vLLM does), chat messages rendered
 * by the chat template and encoded without adding specials again (the
 * template writes them, as vLLM does). Pure and thread-safe: nginx runs it
 * on the event loop or in a thread pool.
 */
#ifndef KV_PROMPT_H
#define KV_PROMPT_H

#include <stddef.h>
#include <stdint.h>

#include "kv_api.h"
#include "kv_chat.h"
#include "kv_chat_request.h"
#include "kv_model.h"
#include "kv_tokenizer.h"
#include "kv_turn.h"

typedef enum {
    KV_PROMPT_OK = 0,
    KV_PROMPT_PARSE,            /* body is not valid JSON / not an object */
    KV_PROMPT_NO_PROMPT,        /* neither prompt nor messages */
    KV_PROMPT_NO_TOKENIZER,     /* text prompt, no tokenizer configured */
    KV_PROMPT_NO_TEMPLATE,      /* messages, no chat template configured */
    KV_PROMPT_TEMPLATE,         /* the template failed on these messages */
    KV_PROMPT_TOKENIZE,
    KV_PROMPT_MODEL,            /* body names another model */
    KV_PROMPT_NO_MEMORY
} kv_prompt_status_t;

typedef struct {
    const kv_tokenizer_t        *tokenizer;     /* may be NULL */
    const kv_chat_template_t    *chat;          /* may be NULL */
    const char                  *model;         /* NULL or "": any model */
    uint32_t                     block_size;
    /*
     * The most text (bytes) one request may have tokenized; 0: no cap.
     * Past it, the prompt is routed on the blocks of the part tokenized
     * and the tokens of the rest are estimated from its bytes at the
     * part's bytes per token (out->capped is set).
     */
    size_t                       max_tokenize;
    /* the turn-delta cache (kv_turn.h) for text prompts; NULL: off */
    const kv_turn_t             *turns;
    /*
     * 0: the body's `cache_salt` replaces the salt argument (a client's
     * choice). 1: the salt argument is the operator's and is combined with
     * the client's: the engine must see kv_prompt_salt(operator, client)
     * as the body's only `cache_salt` (out->salt; the caller rewrites the
     * body at out->salt_off/obj_open), so no client can pick another
     * tenant's salt. An empty operator salt with no client salt is no
     * salt at all (out->salt NULL; other `cache_salt` values become null).
     */
    int                          salt_combine;
    /* whose rules chat requests are rendered by (kv_chat_request.h) */
    kv_chat_engine_t             chat_engine;
    /* the operator's default chat_template_kwargs (a JSON object) or NULL */
    const char                  *chat_kwargs;
    /*
     * The LoRA adapters served beside `model` (vLLM's --lora-modules):
     * NULL none, "*" any other name, else names separated by commas. A
     * request naming one is hashed with the adapter's seed, as the engine
     * tags its blocks (kv_hash_seed of the name), unless it has a salt.
     */
    const char                  *lora;
    /* the request's API, by its path (kv_api.h); KV_API_ANY: the body says */
    kv_api_t                     api;
} kv_prompt_config_t;


/* Tokens before the cut that may differ from the whole text's (a word cut
 * in two): counted, not hashed into blocks. */
#define KV_PROMPT_CAP_MARGIN  64

/* max_tokens and sequences (n x a batch's prompts) are counted at most
 * this: far above any engine's limits, and their product fits 64 bits */
#define KV_PROMPT_MAX_TOKENS     (1L << 26)
#define KV_PROMPT_SEQUENCES_MAX  (1L << 20)

typedef struct {
    kv_prompt_status_t  status;
    uint64_t            prompt_tokens;
    uint64_t           *seq;            /* malloc'ed; nseq entries */
    size_t              nseq;
    int                 stream;
    long                max_tokens;
    long                sequences;      /* n / best_of, times a batch's prompts: >= 1 */
    uint64_t            batch_tokens;   /* a batch's other prompts, past their common
                                           prefix with the first (estimated for text);
                                           a score's pairs, from their bytes */
    int                 prefill_only;   /* nothing decoded (kv_body_t's) */
    int                 preamble;       /* a Responses API request: its stream opens
                                           before the engine runs (kv_preamble.h) */
    int                 capped;         /* text past max_tokenize: estimated */
    uint64_t            estimated_tokens;   /* of prompt_tokens, when capped */
    uint64_t            turn_cached_tokens; /* ids reused from cfg->turns */

    uint64_t            session;        /* prompt_cache_key's key, else user's; 0: none */
    uint64_t            prev_response;  /* previous_response_id's key; 0: none */
    char                err[160];

    /* salt_combine: the body parsed (a rewrite is possible), the salt the
     * blocks were hashed with (malloc'ed), and where the body holds
     * `cache_salt` values (see kv_body_t) */
    int                 parsed;
    char               *salt;
    size_t              salt_len;
    size_t              obj_open;
    size_t              n_salts;
    size_t              salt_off[16];
    size_t              salt_len_raw[16];
} kv_prompt_t;

/*
 * The combined salt: the operator's length, ':', the operator's salt, then
 * the client's. Injective (the length says where the operator's part ends),
 * so no client salt makes another operator salt's value. malloc'ed; NULL
 * when out of memory.
 */
char *kv_prompt_salt(const char *op, size_t op_len, const char *client, size_t client_len,
                     size_t *out_len);
/* Writes s as a JSON string (quotes included) into out (NULL: only
 * measures); returns its length. */
size_t kv_prompt_json_string(const char *s, size_t len, char *out);

/*
 * Fills out from body. salt (may be NULL) is used when the body has no
 * cache_salt. Returns out->status.
 */
kv_prompt_status_t kv_prompt_compute(const kv_prompt_config_t *cfg, const char *body,
                                     size_t len, const char *salt, size_t salt_len,
                                     kv_prompt_t *out);
void kv_prompt_free(kv_prompt_t *p);

#endif
