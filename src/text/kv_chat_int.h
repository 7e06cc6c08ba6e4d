/*
 * What kv_chat.c shares with kv_chat_request.c (and kv_anthropic.c): values
 * already in an arena rendered by a template, and JSON text turned into such
 * values.
 */
#ifndef KV_CHAT_INT_H
#define KV_CHAT_INT_H

#include "kv_chat.h"
#include "kv_jinja.h"

/* 1 when the template loops over a message's content (vLLM's "openai"
 * content format): content then stays, or becomes, a list of parts. */
int kv_chat_content_parts(const kv_chat_template_t *t);

/* 1 if a content part is text (kv_chat.c says which are); *text: its text,
 * NULL when null or absent. */
int kv_chat_part_text(jj_value p, int text_only, const jj_value **text);

/* A list of content parts as the "string" content format has it: the text
 * of its text parts joined with sep (vLLM "\n", SGLang ' ', text_only),
 * empty texts left out when drop_empty (vLLM's string format). */
jj_value kv_chat_join_parts(jj_arena *a, jj_value parts, char sep, int text_only, int drop_empty);

/*
 * Renders values already in a (freed here, whatever the outcome). tools and
 * documents may be jv_none(); kwargs is a dict of extra template variables
 * or jv_none(). List content is joined into text first unless the template
 * takes parts.
 */
char *kv_chat_render_values(const kv_chat_template_t *t, jj_arena *a, jj_value msgs,
                            jj_value tools, jj_value documents, jj_value kwargs,
                            int add_generation_prompt, long long now, size_t *len, char *err,
                            size_t errlen);

/*
 * JSON text to values in a, as jansson + jv_from_json would give them. The
 * common JSON takes a fast path; the rest goes through jansson, whose tree
 * then holds the values' strings: *held is set to it (decref it once the
 * values are no longer used) or to NULL. 0, or -1 with a reason (not JSON,
 * out of memory).
 */
int kv_chat_parse_value(jj_arena *a, const char *json, size_t len, jj_value *out,
                        json_t **held, char *err, size_t errlen);

/* jansson trees that hold strings of values being rendered (one per member
 * or call arguments the fast JSON path left to jansson) */
typedef struct {
    json_t **held;
    size_t   n, cap;
} kv_chat_holds_t;

void kv_chat_holds_free(kv_chat_holds_t *h);

/* kv_chat_parse_value keeping the jansson tree, if any, in h; json NULL
 * (absent) gives jv_none(). */
int kv_chat_parse_held(jj_arena *a, kv_chat_holds_t *h, const char *json, size_t len,
                       jj_value *out, char *err, size_t errlen);

/* d[key] of a dict (NULL: none, or d not a dict); d[key] = v. */
const jj_value *kv_chat_get(jj_value d, const char *key);
void kv_chat_set(jj_arena *a, jj_value d, const char *key, jj_value v);

/* What the template gets by vLLM's rules (kv_chat_vllm.c): messages and
 * tools rewritten in place. */
void kv_chat_as_vllm(const kv_chat_template_t *t, jj_arena *a, kv_chat_holds_t *h,
                     jj_value *msgs, jj_value *tools);

/*
 * What the template gets by SGLang's rules (kv_chat_sglang.c): messages,
 * tools and kwargs rewritten in place, from the request's tool_choice and
 * reasoning_effort; cont leaves a final assistant message out. 0, or -1
 * with the reason SGLang refuses the request for.
 */
int kv_chat_as_sglang(const kv_chat_template_t *t, jj_arena *a, kv_chat_holds_t *h,
                      jj_value *msgs, jj_value *tools, jj_value *kwargs, jj_value tool_choice,
                      jj_value effort, int cont, char *err, size_t errlen);

#endif
