/* Model and LoRA adapter names (see kv_model.h). */
#include <string.h>

#include "kv_model.h"

int kv_model_next(const char **p, const char **name, size_t *len)
{
    const char *comma;

    if (*p == NULL) {
        return 0;
    }
    comma = strchr(*p, ',');
    *name = *p;
    *len = comma ? (size_t) (comma - *p) : strlen(*p);
    *p = comma ? comma + 1 : NULL;
    return 1;
}

/* Whether name is one of the comma-separated names of list. */
static int in_list(const char *list, const char *name, size_t n)
{
    const char *p = list, *s;
    size_t      len;

    while (kv_model_next(&p, &s, &len)) {
        if (len == n && memcmp(s, name, n) == 0) {
            return 1;
        }
    }
    return 0;
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
