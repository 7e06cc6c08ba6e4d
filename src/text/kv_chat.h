/*
 * Chat templates: renders OpenAI `messages` to the prompt text exactly as
 * the model's Jinja chat template does under HF transformers
 * (apply_chat_template with tokenize=False): a small interpreter for the
 * subset of Jinja the shipped templates use. A template that uses anything
 * outside that subset is refused at load time with a message naming the
 * construct, never rendered wrongly.
 */
#ifndef KV_CHAT_H
#define KV_CHAT_H

#include <stddef.h>
#include <jansson.h>

typedef struct kv_chat_template kv_chat_template_t;

/*
 * Loads a template from a tokenizer_config.json ("chat_template" as a
 * string, or a list of {name, template} where name selects one, default
 * "default"), or from a chat_template.jinja file; bos_token/eos_token come
 * from the tokenizer_config.json in the same directory when present.
 */
kv_chat_template_t *kv_chat_load(const char *path, const char *name,
                                 char *err, size_t errlen);
/* From template source text; bos/eos may be NULL. */
kv_chat_template_t *kv_chat_load_string(const char *source, const char *bos_token,
                                        const char *eos_token, char *err, size_t errlen);
void kv_chat_free(kv_chat_template_t *t);

/*
 * Renders messages (a JSON array of OpenAI message objects). tools may be
 * NULL. Returns a malloc'ed string (length in *len), or NULL with a reason
 * in err (e.g. the template raised an exception). Thread-safe.
 */
char *kv_chat_render(const kv_chat_template_t *t, const json_t *messages,
                     const json_t *tools, int add_generation_prompt,
                     size_t *len, char *err, size_t errlen);

/*
 * kv_chat_render with the clock given: now (seconds since the epoch, shown
 * in local time as datetime.now() would) is what strftime_now() formats.
 * kv_chat_render uses time(NULL), or $KV_CHAT_NOW when set (tests).
 */
char *kv_chat_render_at(const kv_chat_template_t *t, const json_t *messages,
                        const json_t *tools, int add_generation_prompt, long long now,
                        size_t *len, char *err, size_t errlen);

/*
 * The general form: kwargs (a JSON object, or NULL) adds template variables
 * as transformers' apply_chat_template(**kwargs) / vLLM's
 * chat_template_kwargs do (e.g. {"enable_thinking": false}); they override
 * the special tokens but not messages, tools or add_generation_prompt.
 */
char *kv_chat_render_ex(const kv_chat_template_t *t, const json_t *messages,
                        const json_t *tools, int add_generation_prompt,
                        const json_t *kwargs, long long now,
                        size_t *len, char *err, size_t errlen);

/* The clock kv_chat_render uses: time(NULL), or $KV_CHAT_NOW when set. */
long long kv_chat_now(void);

#endif
