/*
 * The product's core invariant: the router and kvworker turn the same
 * request body into the same token ids, so the router's block hashes name
 * the blocks the worker caches. For every shipped tokenizer (conf/tokenizers)
 * and its chat template, a completion and a chat go through the router's
 * path (kv_prompt_compute, block size 1: one chained hash per token) and the
 * worker's (kvworker's request parser on kvw_text_load), and must agree.
 */
#include <stdlib.h>
#include <unistd.h>

#include "kv_hash.h"
#include "kv_prompt.h"
#include "kvtest.h"
#include "kvw_openai.h"
#include "kvw_text.h"

static const char *names[] = {
    "gpt2", "phi-3-mini-4k-instruct", "qwen2.5-instruct", "smollm3-3b",
    "tinyllama-1.1b-chat-v1.0",
};

static const char *completion =
    "{\"model\":\"m\",\"max_tokens\":4,"
    "\"prompt\":\"The cache holds blocks of sixteen tokens.\\nCaf\\u00e9 \\ud83d\\ude00 done.\"}";

static const char *chat =
    "{\"model\":\"m\",\"max_tokens\":4,\"messages\":["
    "{\"role\":\"system\",\"content\":\"You answer in one line.\"},"
    "{\"role\":\"user\",\"content\":\"Which worker holds my prefix? Caf\\u00e9.\"}]}";

/* an agent's turn: tools, a call with JSON-text arguments, a tool result,
 * template kwargs; and the same asking for the tokenizer's special tokens */
static const char *agent =
    "{\"model\":\"m\",\"max_tokens\":4,\"tool_choice\":\"auto\","
    "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"lookup\","
    "\"description\":\"Find a policy.\",\"parameters\":{\"type\":\"object\","
    "\"properties\":{\"id\":{\"type\":\"string\"},\"w\":{\"type\":\"number\",\"default\":0.5}}}}}],"
    "\"chat_template_kwargs\":{\"enable_thinking\":false},"
    "\"messages\":[{\"role\":\"user\",\"content\":\"Find 44.\"},"
    "{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"c1\","
    "\"type\":\"function\",\"function\":{\"name\":\"lookup\",\"arguments\":\"{\\\"id\\\":\\\"44\\\"}\"}}]},"
    "{\"role\":\"tool\",\"tool_call_id\":\"c1\",\"content\":\"found\"}]}";

static const char *completion_plain =
    "{\"add_special_tokens\":false,\"prompt\":\"no BOS for this one\"}";

static const char *agent_special =
    "{\"add_special_tokens\":true,\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}";

/* 1 when both paths give the same ids (compared through their hashes). */
static int same_ids(const kv_tokenizer_t *tok, const kv_chat_template_t *tpl,
                    const kvw_text_t *tx, const char *body, int is_chat)
{
    kv_prompt_config_t cfg = { tok, tpl, NULL, 1, 0, NULL, 0, KV_CHAT_VLLM, NULL, NULL, KV_API_ANY };      /* no tokenize cap */
    kv_prompt_t        router;
    kvw_req_t          worker = { 0 };
    kvw_openai_err_t   refusal;
    uint64_t          *hashes;
    int                same;

    CHECK(kv_prompt_compute(&cfg, body, strlen(body), NULL, 0, &router) == KV_PROMPT_OK);
    CHECK(kvw_openai_parse_text(&worker, is_chat, body, strlen(body), tx, 0, &refusal) == 0);
    CHECK(worker.n_prompt > 0);
    hashes = calloc(worker.n_prompt, sizeof(uint64_t));
    kv_hash_blocks(worker.prompt, worker.n_prompt, 1, kv_hash_seed(NULL, 0), NULL, hashes);
    same = router.prompt_tokens == worker.n_prompt && router.nseq == worker.n_prompt
           && memcmp(router.seq, hashes, worker.n_prompt * sizeof(uint64_t)) == 0;
    if (!same)
        fprintf(stderr, "  router %zu tokens, worker %zu\n", (size_t)router.prompt_tokens,
                worker.n_prompt);
    free(hashes);
    kv_prompt_free(&router);
    kvw_req_clear(&worker);
    return same;
}

TEST(router_and_worker_agree_on_every_shipped_pair)
{
    int completions = 0, chats = 0, agents = 0;

    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        char tok_path[256], tpl_path[256], err[512];
        snprintf(tok_path, sizeof(tok_path), "conf/tokenizers/%s/tokenizer.json", names[i]);
        snprintf(tpl_path, sizeof(tpl_path), "conf/tokenizers/%s/tokenizer_config.json",
                 names[i]);

        kv_tokenizer_t *tok = kv_tokenizer_load(tok_path, err, sizeof(err));
        if (tok == NULL) {
            /* a tokenizer the loader refuses (documented in t/data/tokenizer) */
            fprintf(stderr, "  %s: tokenizer refused: %s\n", names[i], err);
            continue;
        }
        kv_chat_template_t *tpl = kv_chat_load(tpl_path, NULL, err, sizeof(err));
        const kvw_text_t *tx = kvw_text_load(tok_path, tpl ? tpl_path : NULL, KV_CHAT_VLLM, NULL,
                                             err, sizeof(err));
        CHECK(tx != NULL);
        if (tx == NULL) {
            kv_tokenizer_free(tok);
            continue;
        }
        if (!same_ids(tok, tpl, tx, completion, 0) || !same_ids(tok, tpl, tx, completion_plain, 0))
            fprintf(stderr, "  %s: completion ids differ\n", names[i]);
        else
            completions++;
        if (tpl) {
            if (!same_ids(tok, tpl, tx, chat, 1))
                fprintf(stderr, "  %s: chat ids differ\n", names[i]);
            else
                chats++;
            if (!same_ids(tok, tpl, tx, agent, 1) || !same_ids(tok, tpl, tx, agent_special, 1))
                fprintf(stderr, "  %s: agent ids differ\n", names[i]);
            else
                agents++;
            kv_chat_free(tpl);
        }
        kv_tokenizer_free(tok);
        kvw_text_free(tx);
    }
    fprintf(stderr, "  %d completions, %d chats, %d agent turns agree\n", completions, chats,
            agents);
    CHECK(completions >= 4);
    CHECK(chats >= 3);
    CHECK(agents == chats);
}

int main(void)
{
    RUN(router_and_worker_agree_on_every_shipped_pair);
    return kvt_done();
}
