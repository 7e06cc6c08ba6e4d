/*
 * The OpenAI Responses API's prompt as chat messages, the way vLLM builds
 * them before rendering (serving_responses: _construct_input_messages,
 * without harmony): `instructions`, when not empty, is a system message;
 * `input` as a string is one user message, as a list its items are the
 * messages. The result goes through the chat path like a chat request's
 * `messages`, so a conversation sent through /v1/responses with its history
 * in `input` (vLLM stores no responses by default) routes on its prefix.
 *
 * Items without a `role` (function calls, their outputs, reasoning) are
 * left out: the vLLM this follows refuses tools without harmony, newer ones
 * turn such items into messages of their own. Left out the same way in
 * every turn, they keep the rendering a stable prefix key: approximate mode
 * and the pending index still place the conversation, events mode credits
 * engine blocks where the rendering matches the engine's.
 */
#ifndef KV_RESPONSES_H
#define KV_RESPONSES_H

#include <stddef.h>

/*
 * The messages (a JSON array, malloc'ed, length in *len) from the raw JSON
 * of `instructions` (a string, or NULL) and `input` (a string or an array,
 * already validated JSON). NULL when out of memory.
 */
char *kv_responses_messages(const char *instructions, size_t instructions_len,
                            const char *input, size_t input_len, size_t *len);

#endif
