/*
 * The Anthropic Messages API (/v1/messages, what Claude Code and the
 * Anthropic SDKs send, which vLLM serves) as the OpenAI chat request vLLM
 * makes of it before rendering (entrypoints/anthropic/serving.py,
 * _convert_anthropic_to_openai_request):
 *
 *   - `system` (a string, or text blocks) and the text of any system-role
 *     message are joined into one system message first; a text block
 *     starting "x-anthropic-billing-header" is left out (Claude Code puts a
 *     per-request hash there, which would defeat every prefix cache);
 *   - each other message keeps its role; string content stays a string,
 *     blocks become parts: text (non-empty) as text parts, a single one as
 *     a string; images as image_url parts; thinking joined as `reasoning`;
 *     tool_use as `tool_calls` (`arguments` json.dumps(input)); a user's
 *     tool_result as a tool message of its own, placed before the message
 *     that carried it (its text parts joined with "\n"), its images as a
 *     user message after it; a user message left with no content is dropped;
 *   - `tools` as {"type": "function", "function": {name, description,
 *     parameters: input_schema}}.
 *
 * Not followed: a tool_use without an `id` gets "" (vLLM makes one from
 * the clock), a tool_result inside an assistant message is kept only when
 * its content is a string, `defer_loading` is passed only when the client
 * sends it (the newest vLLM also writes it as null), tool_reference items
 * are left out.
 */
#ifndef KV_ANTHROPIC_H
#define KV_ANTHROPIC_H

#include <stddef.h>

typedef struct {
    char   *messages;       /* a JSON array */
    size_t  messages_len;
    char   *tools;          /* a JSON array, or NULL */
    size_t  tools_len;
} kv_anthropic_t;

/*
 * From the raw JSON of `system` (NULL: absent), `messages` (an array) and
 * `tools` (NULL: absent), already validated; values are read as Python's
 * json reads them (integers past 64 bits kept whole) and a tool_use's
 * `arguments` written as its json.dumps writes them. 0, or -1 with a reason
 * in err: exactly "out of memory", or one starting "anthropic request: "
 * (text that is not JSON, a request past the renderer's memory bound); out
 * is then empty.
 */
int  kv_anthropic_chat(const char *system, size_t system_len, const char *messages,
                       size_t messages_len, const char *tools, size_t tools_len,
                       kv_anthropic_t *out, char *err, size_t errlen);
void kv_anthropic_free(kv_anthropic_t *a);

#endif
