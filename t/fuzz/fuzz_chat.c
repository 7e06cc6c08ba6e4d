/*
 * Fuzzes chat templates: odd first byte -> the rest is template source
 * (load, then render a fixed conversation); even -> the rest is a messages
 * JSON array rendered by a template that exercises most of the subset.
 * Either way: a result or a clean error, never a crash, leak or hang.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_chat.h"

static const char *const probe =
    "{%- set ns = namespace(n=0, s='') -%}"
    "{%- for m in messages if m is mapping -%}"
    "{%- set ns.n = ns.n + 1 -%}"
    "{{ m.role | default('?') | upper }}:{{ m.content if m.content is string else m.content | tojson(indent=1) }}"
    "{%- if m.tool_calls is defined %}{% for t in m.tool_calls %}{{ t | string }}{{ t.function.arguments | tojson }}{% endfor %}{% endif -%}"
    "{{ (m.content | string)[1:-1:2] | trim }}{{ m | items | list | length }}{{ m.get('name', 'x').split('a') }}"
    "{%- if loop.last %}{{ ns.n ~ loop.length }}{% endif -%}"
    "{%- endfor -%}{{ messages | selectattr('role', 'equalto', 'user') | map(attribute='content') | list }}";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    char *s = malloc(size);
    if (!s) return 0;
    memcpy(s, data + 1, size - 1);
    s[size - 1] = 0;
    char err[256];
    if (data[0] & 1) {
        json_t *msgs = json_loads("[{\"role\":\"system\",\"content\":\"sys\"},{\"role\":\"user\",\"content\":\"hi\"},"
                                  "{\"role\":\"assistant\",\"content\":[{\"type\":\"text\",\"text\":\"a\"}]}]", 0, NULL);
        kv_chat_template_t *t = kv_chat_load_string(s, "<s>", "</s>", err, sizeof err);
        if (t) free(kv_chat_render_at(t, msgs, NULL, 1, 0, NULL, err, sizeof err));
        kv_chat_free(t);
        json_decref(msgs);
    } else {
        json_t *msgs = json_loads(s, 0, NULL);
        kv_chat_template_t *t = kv_chat_load_string(probe, NULL, NULL, err, sizeof err);
        if (t && msgs) free(kv_chat_render_at(t, msgs, msgs, 0, 0, NULL, err, sizeof err));
        kv_chat_free(t);
        json_decref(msgs);
    }
    free(s);
    return 0;
}
