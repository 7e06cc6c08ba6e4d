/*
 * Which model names a server serves: its model, and the LoRA adapters
 * served beside it (vLLM's --lora-modules). The router uses it to choose
 * an upstream by a request's `model` and to seed an adapter's blocks; the
 * mock worker, to accept and tag an adapter's requests the same way.
 */
#ifndef KV_MODEL_H
#define KV_MODEL_H

#include <stddef.h>

typedef enum {
    KV_MODEL_BASE = 0,          /* the served model (or no name, or any) */
    KV_MODEL_LORA,              /* one of its LoRA adapters */
    KV_MODEL_OTHER              /* not served here */
} kv_model_role_t;

/*
 * What a server serving `model` (its names separated by commas, as vLLM's
 * --served-model-name takes aliases; NULL or "": every name) and `lora`
 * (NULL: none, "*": any other name, else names separated by commas) makes
 * of a request naming `name` ("": none, the served model).
 */
kv_model_role_t kv_model_role(const char *model, const char *lora, const char *name);

/*
 * The names of a comma-separated list, one at a time (empty ones too):
 *     for (p = list; kv_model_next(&p, &name, &len); ) ...
 * 0 once the list (or a NULL one) is done.
 */
int kv_model_next(const char **p, const char **name, size_t *len);

#endif
