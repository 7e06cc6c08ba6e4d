/*
 * What kv_chat.c shares with kv_chat_request.c: values already in an arena
 * rendered by a template, and JSON text turned into such values.
 */
#ifndef KV_CHAT_INT_H
#define KV_CHAT_INT_H

#include "kv_chat.h"
#include "kv_jinja.h"

/* 1 when the template loops over a message's content (vLLM's "openai"
 * content format): content then stays, or becomes, a list of parts. */
int kv_chat_content_parts(const kv_chat_template_t *t);

/* A list of content parts as vLLM's "string" content format has it: the
 * text of its {"type": "text"} parts joined with "\n". */
jj_value kv_chat_join_parts(jj_arena *a, jj_value parts);

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

#endif
