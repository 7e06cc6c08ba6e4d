/* Model and LoRA adapter names (see kv_model.h). */
#include <string.h>

#include "kv_model.h"

kv_model_role_t kv_model_role(const char *model, const char *lora, const char *name)
{
    size_t      n = strlen(name);
    const char *p, *comma;

    if (n == 0 || model == NULL || model[0] == '\0' || strcmp(model, name) == 0) {
        return KV_MODEL_BASE;
    }
    if (lora == NULL) {
        return KV_MODEL_OTHER;
    }
    if (strcmp(lora, "*") == 0) {
        return KV_MODEL_LORA;
    }
    for (p = lora; ; p = comma + 1) {
        comma = strchr(p, ',');
        if ((size_t) ((comma ? comma : p + strlen(p)) - p) == n && memcmp(p, name, n) == 0) {
            return KV_MODEL_LORA;
        }
        if (comma == NULL) {
            return KV_MODEL_OTHER;
        }
    }
}
