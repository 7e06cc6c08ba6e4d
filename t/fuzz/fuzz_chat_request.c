/*
 * libFuzzer target: a whole chat request body rendered as the router
 * renders it (kv_body's spans, then kv_chat_render_request: tools, tool
 * calls' JSON-text arguments, kwargs, documents, continue_final_message)
 * and as kvworker does (jansson, kv_chat_render_request_json), by vLLM's
 * rules or SGLang's (the body's length, odd or even), by a template that
 * prints all of it. A result or a clean error, never a
 * crash, leak or hang.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_body.h"
#include "kv_chat_request.h"

static const char *const probe =
    "{%- for m in messages -%}"
    "{{ m.role }}:{{ m.content if m.content is string else m.content | tojson }}"
    "{%- if m.tool_calls is defined %}{% for t in m.tool_calls %}"
    "{{ t.function.name }}{{ t.function.arguments | tojson }}{% endfor %}{% endif -%}"
    "{{ m.reasoning_content | default('') }}{{ m.tool_call_id | default('') }}\n"
    "{%- endfor -%}"
    "{%- if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif -%}"
    "{{ documents | tojson }}{{ enable_thinking | default('') }}"
    "{%- if add_generation_prompt %}<gen>{% endif -%}";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static kv_chat_template_t *t;
    char                       err[256];
    kv_body_t                  b;
    size_t                     len;
    kv_chat_engine_t           engine = size % 2 ? KV_CHAT_SGLANG : KV_CHAT_VLLM;

    if (t == NULL && (t = kv_chat_load_string(probe, NULL, NULL, err, sizeof err)) == NULL)
        abort();
    if (kv_body_parse(&b, (const char *) data, size, err, sizeof err) == 0
        && b.kind == KV_BODY_MESSAGES) {
        b.chat.engine = engine;
        free(kv_chat_render_request(t, &b.chat, 0, &len, err, sizeof err));
    }
    kv_body_free(&b);
    json_t *req = json_loadb((const char *) data, size, 0, NULL);
    if (req)
        free(kv_chat_render_request_json(t, req, engine, 0, &len, err, sizeof err));
    json_decref(req);
    return 0;
}
