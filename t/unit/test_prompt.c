/*
 * kv_prompt: the cap on text tokenized per request (max_tokenize). Past it
 * the prompt routes on the blocks of the part tokenized, which are the
 * whole text's first blocks, and the rest's tokens are estimated.
 */
#include <stdlib.h>
#include <unistd.h>

#include <jansson.h>

#include "kvtest.h"
#include "kv_prompt.h"

static kv_tokenizer_t     *qwen;
static kv_chat_template_t *qwen_chat;

/* {"prompt": text} or {"messages": [{"role": "user", "content": text}]} */
static char *body_of(const char *text, size_t len, int chat)
{
    json_t *s = json_stringn(text, len), *o;
    char   *out;

    if (chat) {
        o = json_pack("{s:[{s:s,s:o}]}", "messages", "role", "user", "content", s);
    } else {
        o = json_pack("{s:o}", "prompt", s);
    }
    out = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    return out;
}

static kv_prompt_status_t compute(const char *text, size_t len, int chat, size_t cap,
                                  kv_prompt_t *out)
{
    kv_prompt_config_t cfg = { qwen, qwen_chat, NULL, 16, cap, NULL, 0, KV_CHAT_VLLM, NULL, NULL, KV_API_ANY };
    char              *body = body_of(text, len, chat);
    kv_prompt_status_t st = kv_prompt_compute(&cfg, body, strlen(body), NULL, 0, out);

    free(body);
    return st;
}

static char *prose(size_t *len)
{
    FILE *f = fopen("t/data/prose_en.txt", "rb");
    char *s = malloc(1 << 20);

    *len = f ? fread(s, 1, 1 << 20, f) : 0;
    if (f) fclose(f);
    while (*len && ((unsigned char) s[*len - 1] & 0x80)) {
        (*len)--;           /* whole characters only */
    }
    return s;
}

static void check_capped(const char *text, size_t len, int chat, size_t cap)
{
    kv_prompt_t whole, part;
    size_t      i, same = 0;

    CHECK(compute(text, len, chat, 0, &whole) == KV_PROMPT_OK);
    CHECK(compute(text, len, chat, cap, &part) == KV_PROMPT_OK);
    CHECK(!whole.capped && whole.estimated_tokens == 0);
    CHECK(part.capped);
    /* the blocks hashed are the whole text's first blocks */
    CHECK(part.nseq > 0 && part.nseq < whole.nseq);
    CHECK(part.nseq * 16 + KV_PROMPT_CAP_MARGIN + 16 >= part.prompt_tokens - part.estimated_tokens);
    for (i = 0; i < part.nseq && i < whole.nseq; i++) {
        same += part.seq[i] == whole.seq[i];
    }
    CHECK_EQ_U64(same, part.nseq);
    /* the estimate of the rest: within 10 % of the real count */
    fprintf(stderr, "  %zu bytes, cap %zu: %llu tokens (%llu estimated), really %llu\n",
            len, cap, (unsigned long long) part.prompt_tokens,
            (unsigned long long) part.estimated_tokens,
            (unsigned long long) whole.prompt_tokens);
    CHECK(part.estimated_tokens > 0);
    CHECK(part.prompt_tokens * 10 >= whole.prompt_tokens * 9);
    CHECK(part.prompt_tokens * 10 <= whole.prompt_tokens * 11);
    kv_prompt_free(&whole);
    kv_prompt_free(&part);
}

TEST(text_prompt_past_the_cap_routes_on_its_prefix)
{
    size_t len;
    char  *text = prose(&len);

    CHECK(len > 500000);
    check_capped(text, len, 0, 100000);
    check_capped(text, len, 1, 100000);     /* chat: the rendered text is capped */
    free(text);
}

TEST(cap_cuts_between_characters)
{
    size_t n = 30000, i;
    char  *text = malloc(2 * n);

    for (i = 0; i < n; i++) {               /* "é" is 2 bytes: the cap falls inside one */
        memcpy(text + 2 * i, i % 7 == 6 ? " x" : "\xc3\xa9", 2);
    }
    check_capped(text, 2 * n, 0, 20001);
    free(text);
}

TEST(under_the_cap_nothing_changes)
{
    kv_prompt_t p;
    size_t      len;
    char       *text = prose(&len);

    CHECK(compute(text, 4096, 0, 4096, &p) == KV_PROMPT_OK);
    CHECK(!p.capped && p.estimated_tokens == 0 && p.nseq == p.prompt_tokens / 16);
    kv_prompt_free(&p);
    /* an empty prompt: nothing to cap */
    CHECK(compute("", 0, 0, 1, &p) == KV_PROMPT_OK);
    CHECK(!p.capped);
    kv_prompt_free(&p);
    free(text);
}

/* The work one request costs is bounded by the cap, not by the body: a
 * 4 MB word with a 256 KB cap merges 256 KB of symbols (counts, not time). */
TEST(cap_bounds_the_work)
{
    size_t        n = 4 << 20, cap = 256 << 10, i;
    char         *text = malloc(n);
    kv_prompt_t   p;
    kv_tok_work_t w;

    for (i = 0; i < n; i++) {
        text[i] = "abcdefghijklmnopqrstuvwxyz"[(i * 7919 + i / 13) % 26];
    }
    kv_tokenizer_work(NULL, 1);
    CHECK(compute(text, n, 0, cap, &p) == KV_PROMPT_OK);
    kv_tokenizer_work(&w, 1);
    CHECK(p.capped);
    CHECK(w.symbols <= cap);
    CHECK(p.prompt_tokens > p.estimated_tokens && p.estimated_tokens > 0);
    kv_prompt_free(&p);
    free(text);
}

/* Qwen2.5's tokenizer with a post-processor that adds <|endoftext|> first,
 * as a BOS-adding tokenizer does (none of the shipped ones that load do). */
static kv_tokenizer_t *bos_tokenizer(void)
{
    char path[] = "/tmp/kvtest-bos-XXXXXX", err[512];
    json_t *t = json_load_file("conf/tokenizers/qwen2.5-instruct/tokenizer.json", 0, NULL);
    json_t *post = json_pack("{s:s, s:[{s:{s:s, s:i}}, {s:{s:s, s:i}}], s:{s:{s:s, s:[i], s:[s]}}}",
                             "type", "TemplateProcessing",
                             "single", "SpecialToken", "id", "<|endoftext|>", "type_id", 0,
                             "Sequence", "id", "A", "type_id", 0,
                             "special_tokens", "<|endoftext|>", "id", "<|endoftext|>",
                             "ids", 151643, "tokens", "<|endoftext|>");
    kv_tokenizer_t *tok = NULL;
    int fd = mkstemp(path);

    if (t && post && fd >= 0 && json_object_set_new(t, "post_processor", post) == 0
        && json_dumpfd(t, fd, 0) == 0)
        tok = kv_tokenizer_load(path, err, sizeof(err));
    if (fd >= 0) {
        close(fd);
        unlink(path);
    }
    json_decref(t);
    return tok;
}

/* add_special_tokens as vLLM reads it: a prompt gets the tokenizer's
 * special tokens unless it says false; a chat only when it says true. */
TEST(add_special_tokens)
{
    kv_tokenizer_t *tok = bos_tokenizer();
    kv_prompt_config_t cfg = { tok, qwen_chat, NULL, 1, 0, NULL, 0, KV_CHAT_VLLM, NULL, NULL, KV_API_ANY };
    static const char *const bodies[] = {
        "{\"prompt\":\"hello there\"}",
        "{\"prompt\":\"hello there\",\"add_special_tokens\":false}",
        "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}",
        "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"add_special_tokens\":true}",
    };
    uint64_t n[4] = { 0 };

    CHECK(tok != NULL);
    for (int i = 0; tok && i < 4; i++) {
        kv_prompt_t p;
        CHECK(kv_prompt_compute(&cfg, bodies[i], strlen(bodies[i]), NULL, 0, &p) == KV_PROMPT_OK);
        n[i] = p.prompt_tokens;
        kv_prompt_free(&p);
    }
    CHECK(n[0] == n[1] + 1);            /* the added token */
    CHECK(n[3] == n[2] + 1);
    kv_tokenizer_free(tok);
}

/* x[0..nx) then y[0..ny), as a JSON string */
static json_t *joined(const char *x, size_t nx, const char *y, size_t ny)
{
    char   *t = malloc(nx + ny);
    json_t *j;

    memcpy(t, x, nx);
    memcpy(t + nx, y, ny);
    j = json_stringn(t, nx + ny);
    free(t);
    return j;
}

static uint64_t tokens_of(const char *text, size_t len)
{
    kv_prompt_t p;
    uint64_t    n;

    CHECK(compute(text, len, 0, 0, &p) == KV_PROMPT_OK);
    n = p.prompt_tokens;
    kv_prompt_free(&p);
    return n;
}

/* A batch of prompts is one request for the first's blocks, and load for
 * every prompt: each sequence decodes, and each prompt's part past its
 * common prefix with the first is prefilled (text estimated at the first's
 * tokens per byte, within 10 % on prose; ids exact). */
TEST(batch_counted_for_load)
{
    kv_prompt_config_t cfg = { qwen, qwen_chat, NULL, 16, 0, NULL, 0, KV_CHAT_VLLM, NULL, NULL, KV_API_ANY };
    size_t      len;
    char       *text = prose(&len), *body;
    const char *shared = text, *a = text + 4000, *b = text + 12000, *c = text + 20000;
    json_t     *o;
    kv_prompt_t p, first;
    uint64_t    want;

    CHECK(len > 30000);
    o = json_pack("{s:[o,o,o,o],s:i,s:i}", "prompt", joined(shared, 4000, a, 3000),
                  joined(shared, 4000, b, 3000), joined(shared, 4000, c, 5000),
                  json_stringn(c + 5000, 6000), "n", 2, "max_tokens", 100);
    body = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    CHECK(kv_prompt_compute(&cfg, body, strlen(body), NULL, 0, &p) == KV_PROMPT_OK);
    CHECK(compute(text, 7000, 0, 0, &first) == KV_PROMPT_OK);
    /* routed on the first prompt alone */
    CHECK_EQ_U64(p.prompt_tokens, first.prompt_tokens);
    CHECK_EQ_U64(p.nseq, first.nseq);
    CHECK(p.sequences == 8);
    want = tokens_of(b, 3000) + tokens_of(c, 5000) + tokens_of(c + 5000, 6000);
    fprintf(stderr, "  batch: %llu tokens estimated, %llu really\n",
            (unsigned long long) p.batch_tokens, (unsigned long long) want);
    CHECK(p.batch_tokens * 10 >= want * 9 && p.batch_tokens * 10 <= want * 11);
    kv_prompt_free(&p);
    kv_prompt_free(&first);
    free(body);
    free(text);

    body = "{\"prompt\":[[1,2,3,4],[1,2,3,5,6],[7]],\"max_tokens\":99999999999999999}";
    CHECK(kv_prompt_compute(&cfg, body, strlen(body), NULL, 0, &p) == KV_PROMPT_OK);
    CHECK_EQ_U64(p.prompt_tokens, 4);
    CHECK_EQ_U64(p.batch_tokens, 3);
    CHECK(p.sequences == 3);
    CHECK(p.max_tokens == KV_PROMPT_MAX_TOKENS);   /* bounded: max_tokens x n fits */
    kv_prompt_free(&p);
}

/* A Responses API request is the chat request vLLM makes of it: the same
 * tokens and blocks ("instructions" a system message, "input" a user
 * message or the messages; items without a role and `tools` left out). */
TEST(responses_as_chat)
{
    kv_prompt_config_t cfg = { qwen, qwen_chat, NULL, 16, 0, NULL, 0, KV_CHAT_VLLM, NULL, NULL, KV_API_ANY };
    static const struct { const char *responses, *chat; } pairs[] = {
        { "{\"model\":\"m\",\"input\":\"Hello there, how is the weather in Paris today?\"}",
          "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":"
          "\"Hello there, how is the weather in Paris today?\"}]}" },
        { "{\"instructions\":\"Be brief and answer in French, please, always.\",\"input\":["
          "{\"role\":\"user\",\"content\":[{\"type\":\"input_text\",\"text\":\"Hi\"}]},"
          "{\"type\":\"message\",\"id\":\"msg_1\",\"status\":\"completed\",\"role\":\"assistant\","
          "\"content\":[{\"type\":\"output_text\",\"text\":\"Bonjour !\",\"annotations\":[]}]},"
          "{\"type\":\"function_call\",\"call_id\":\"c1\",\"name\":\"f\",\"arguments\":\"{}\"},"
          "{\"type\":\"function_call_output\",\"call_id\":\"c1\",\"output\":\"42\"},"
          "{\"role\":\"user\",\"content\":\"And tomorrow, what will the weather be?\"}],"
          "\"tools\":[{\"type\":\"function\",\"name\":\"f\",\"parameters\":{}}],"
          "\"max_output_tokens\":50,\"stream\":true}",
          "{\"messages\":[{\"role\":\"system\",\"content\":\"Be brief and answer in French, "
          "please, always.\"},{\"role\":\"user\",\"content\":[{\"type\":\"input_text\","
          "\"text\":\"Hi\"}]},{\"role\":\"assistant\",\"content\":[{\"type\":\"output_text\","
          "\"text\":\"Bonjour !\"}]},{\"role\":\"user\",\"content\":\"And tomorrow, what will the "
          "weather be?\"}],\"max_tokens\":50,\"stream\":true}" },
        { "{\"instructions\":\"\",\"input\":\"x\"}",
          "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}" },
    };

    for (size_t i = 0; i < sizeof(pairs) / sizeof(pairs[0]); i++) {
        kv_prompt_t r, c;

        CHECK(kv_prompt_compute(&cfg, pairs[i].responses, strlen(pairs[i].responses), NULL, 0,
                                &r) == KV_PROMPT_OK);
        CHECK(kv_prompt_compute(&cfg, pairs[i].chat, strlen(pairs[i].chat), NULL, 0, &c)
              == KV_PROMPT_OK);
        if (r.prompt_tokens != c.prompt_tokens) {
            fprintf(stderr, "  pair %zu: %llu against %llu tokens\n", i,
                    (unsigned long long) r.prompt_tokens, (unsigned long long) c.prompt_tokens);
        }
        CHECK_EQ_U64(r.prompt_tokens, c.prompt_tokens);
        CHECK(r.prompt_tokens > 0);
        CHECK(r.max_tokens == c.max_tokens && r.stream == c.stream);
        CHECK(r.nseq == c.nseq && (r.nseq == 0 || memcmp(r.seq, c.seq, r.nseq * 8) == 0));
        kv_prompt_free(&r);
        kv_prompt_free(&c);
    }
}

/* An Anthropic Messages API request is the chat request vLLM makes of it
 * (kv_anthropic.h): the same tokens and blocks, by its path or, on an
 * unknown one, by its `system` member; Claude Code's per-request billing
 * header is left out, so two requests differing only there hash alike. */
TEST(anthropic_as_chat)
{
    kv_prompt_config_t cfg = { qwen, qwen_chat, NULL, 16, 0, NULL, 0, KV_CHAT_VLLM, NULL, NULL,
                               KV_API_ANTHROPIC };
    static const struct { const char *anthropic, *chat; kv_api_t api; } pairs[] = {
        { "{\"model\":\"m\",\"max_tokens\":64,\"system\":[{\"type\":\"text\",\"text\":"
          "\"x-anthropic-billing-header: cch=93af\"},{\"type\":\"text\",\"text\":\"You are an "
          "agent that edits code in this repository.\"}],\"messages\":[{\"role\":\"user\","
          "\"content\":[{\"type\":\"text\",\"text\":\"Fix the failing test, please.\"}]},"
          "{\"role\":\"assistant\",\"content\":[{\"type\":\"text\",\"text\":\"Running it.\"},"
          "{\"type\":\"tool_use\",\"id\":\"toolu_01\",\"name\":\"bash\",\"input\":{\"command\":"
          "\"make test\"}}]},{\"role\":\"user\",\"content\":[{\"type\":\"tool_result\","
          "\"tool_use_id\":\"toolu_01\",\"content\":\"1 failed\"}]}],\"tools\":[{\"name\":\"bash\","
          "\"description\":\"Run a command\",\"input_schema\":{\"type\":\"object\",\"properties\":"
          "{\"command\":{\"type\":\"string\"}},\"required\":[\"command\"]}}],\"stream\":true}",
          "{\"messages\":[{\"role\":\"system\",\"content\":\"You are an agent that edits code in "
          "this repository.\"},{\"role\":\"user\",\"content\":\"Fix the failing test, please.\"},"
          "{\"role\":\"assistant\",\"content\":\"Running it.\",\"tool_calls\":[{\"id\":\"toolu_01\","
          "\"type\":\"function\",\"function\":{\"name\":\"bash\",\"arguments\":"
          "\"{\\\"command\\\": \\\"make test\\\"}\"}}]},{\"role\":\"tool\",\"tool_call_id\":"
          "\"toolu_01\",\"content\":\"1 failed\"}],\"tools\":[{\"type\":\"function\",\"function\":"
          "{\"name\":\"bash\",\"description\":\"Run a command\",\"parameters\":{\"type\":\"object\","
          "\"properties\":{\"command\":{\"type\":\"string\"}},\"required\":[\"command\"]}}}],"
          "\"max_tokens\":64,\"stream\":true}", KV_API_ANTHROPIC },
        { "{\"system\":\"Answer in French, please, always and only.\",\"messages\":[{\"role\":"
          "\"user\",\"content\":\"What will the weather be like tomorrow in Paris?\"}]}",
          "{\"messages\":[{\"role\":\"system\",\"content\":\"Answer in French, please, always and "
          "only.\"},{\"role\":\"user\",\"content\":\"What will the weather be like tomorrow in "
          "Paris?\"}]}", KV_API_ANY },
    };

    for (size_t i = 0; i < sizeof(pairs) / sizeof(pairs[0]); i++) {
        kv_prompt_t a, c;

        cfg.api = pairs[i].api;
        CHECK(kv_prompt_compute(&cfg, pairs[i].anthropic, strlen(pairs[i].anthropic), NULL, 0,
                                &a) == KV_PROMPT_OK);
        cfg.api = KV_API_GENERATE;
        CHECK(kv_prompt_compute(&cfg, pairs[i].chat, strlen(pairs[i].chat), NULL, 0, &c)
              == KV_PROMPT_OK);
        if (a.prompt_tokens != c.prompt_tokens) {
            fprintf(stderr, "  pair %zu: %llu against %llu tokens\n", i,
                    (unsigned long long) a.prompt_tokens, (unsigned long long) c.prompt_tokens);
        }
        CHECK(a.prompt_tokens > 0 && a.prompt_tokens == c.prompt_tokens);
        CHECK(a.max_tokens == c.max_tokens && a.stream == c.stream);
        CHECK(a.nseq == c.nseq && (a.nseq == 0 || memcmp(a.seq, c.seq, a.nseq * 8) == 0));
        kv_prompt_free(&a);
        kv_prompt_free(&c);
    }
}

int main(void)
{
    char err[512];

    qwen = kv_tokenizer_load("conf/tokenizers/qwen2.5-instruct/tokenizer.json", err, sizeof(err));
    qwen_chat = kv_chat_load("conf/tokenizers/qwen2.5-instruct/tokenizer_config.json", NULL,
                             err, sizeof(err));
    if (qwen == NULL || qwen_chat == NULL) {
        fprintf(stderr, "  %s\n", err);
        return 1;
    }
    RUN(text_prompt_past_the_cap_routes_on_its_prefix);
    RUN(cap_cuts_between_characters);
    RUN(under_the_cap_nothing_changes);
    RUN(cap_bounds_the_work);
    RUN(add_special_tokens);
    RUN(batch_counted_for_load);
    RUN(responses_as_chat);
    RUN(anthropic_as_chat);
    kv_tokenizer_free(qwen);
    kv_chat_free(qwen_chat);
    return kvt_done();
}
