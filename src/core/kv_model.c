/* Model and LoRA adapter names (see kv_model.h). */
#include <string.h>

#include "kv_model.h"

/* Whether name is one of the comma-separated names of list. */
static int in_list(const char *list, const char *name, size_t n)
{
    const char *p, *comma;

    for (p = list; ; p = comma + 1) {
        comma = strchr(p, ',');
        if ((size_t) ((comma ? comma : p + strlen(p)) - p) == n && memcmp(p, name, n) == 0) {
            return 1;
        }
        if (comma == NULL) {
            return 0;
        }
    }
}

kv_model_role_t kv_model_role(const char *model, const char *lora, const char *name)
{
    size_t n = strlen(name);

    if (n == 0 || model == NULL || model[0] == '\0' || in_list(model, name, n)) {
        return KV_MODEL_BASE;
    }
    if (lora != NULL && (strcmp(lora, "*") == 0 || in_list(lora, name, n))) {
        return KV_MODEL_LORA;
    }
    return KV_MODEL_OTHER;
}
