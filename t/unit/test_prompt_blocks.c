/* kv_prompt: request body -> token count and block sequence hashes, at
 * several block sizes; salt; the fallbacks (test_prompt.c: max_tokenize). */
#include <stdlib.h>
#include "kvtest.h"
#include "kv_hash.h"
#include "kv_prompt.h"

static const char *ids_body(size_t n, const char *extra)
{
    static char buf[65536];
    size_t      len = 0;

    len += snprintf(buf + len, sizeof(buf) - len, "{\"model\":\"m\",\"prompt\":[");
    for (size_t i = 0; i < n; i++) {
        len += snprintf(buf + len, sizeof(buf) - len, "%s%zu", i ? "," : "", 1000 + i);
    }
    snprintf(buf + len, sizeof(buf) - len, "]%s}", extra);
    return buf;
}

TEST(token_ids_at_several_block_sizes)
{
    static const uint32_t sizes[] = { 16, 32, 64 };
    uint32_t ids[200];
    uint64_t want[200];

    for (size_t i = 0; i < 200; i++) {
        ids[i] = (uint32_t) (1000 + i);
    }
    for (size_t k = 0; k < 3; k++) {
        kv_prompt_config_t cfg = { NULL, NULL, NULL, sizes[k], 0, NULL };
        kv_prompt_t p;
        const char *b = ids_body(200, ",\"max_tokens\":7,\"stream\":true");

        CHECK(kv_prompt_compute(&cfg, b, strlen(b), NULL, 0, &p) == KV_PROMPT_OK);
        CHECK_EQ_U64(p.prompt_tokens, 200);
        CHECK_EQ_U64(p.nseq, 200 / sizes[k]);
        CHECK(p.max_tokens == 7 && p.stream == 1);
        kv_hash_blocks(ids, 200, sizes[k], kv_hash_seed(NULL, 0), NULL, want);
        CHECK(p.nseq && memcmp(p.seq, want, p.nseq * sizeof(uint64_t)) == 0);
        kv_prompt_free(&p);
    }
}

TEST(salt_changes_every_hash)
{
    kv_prompt_config_t cfg = { NULL, NULL, NULL, 16, 0, NULL };
    kv_prompt_t a, b, c;
    const char *body = ids_body(64, "");
    char        copy[65536];

    snprintf(copy, sizeof(copy), "%s", body);
    CHECK(kv_prompt_compute(&cfg, copy, strlen(copy), NULL, 0, &a) == KV_PROMPT_OK);
    CHECK(kv_prompt_compute(&cfg, copy, strlen(copy), "tenant", 6, &b) == KV_PROMPT_OK);
    body = ids_body(64, ",\"cache_salt\":\"tenant\"");
    CHECK(kv_prompt_compute(&cfg, body, strlen(body), "other", 5, &c) == KV_PROMPT_OK);
    CHECK(a.nseq == 4 && b.nseq == 4 && c.nseq == 4);
    for (size_t i = 0; i < 4; i++) {
        CHECK(a.seq[i] != b.seq[i]);
        CHECK(b.seq[i] == c.seq[i]);     /* the body's cache_salt wins */
    }
    kv_prompt_free(&a);
    kv_prompt_free(&b);
    kv_prompt_free(&c);
}

TEST(short_prompt_has_no_blocks)
{
    kv_prompt_config_t cfg = { NULL, NULL, NULL, 64, 0, NULL };
    kv_prompt_t p;
    const char *b = ids_body(63, "");

    CHECK(kv_prompt_compute(&cfg, b, strlen(b), NULL, 0, &p) == KV_PROMPT_OK);
    CHECK_EQ_U64(p.prompt_tokens, 63);
    CHECK(p.nseq == 0 && p.seq == NULL);
    kv_prompt_free(&p);
}

TEST(fallbacks_say_why)
{
    kv_prompt_config_t cfg = { NULL, NULL, "m", 16, 0, NULL };
    kv_prompt_t p;
    const char *b;

    b = "{\"prompt\": [1, 2";
    CHECK(kv_prompt_compute(&cfg, b, strlen(b), NULL, 0, &p) == KV_PROMPT_PARSE);
    CHECK(p.err[0] != '\0');
    kv_prompt_free(&p);
    b = "{\"model\":\"m\",\"max_tokens\":3}";
    CHECK(kv_prompt_compute(&cfg, b, strlen(b), NULL, 0, &p) == KV_PROMPT_NO_PROMPT);
    kv_prompt_free(&p);
    b = "{\"model\":\"m\",\"prompt\":\"hello\"}";
    CHECK(kv_prompt_compute(&cfg, b, strlen(b), NULL, 0, &p) == KV_PROMPT_NO_TOKENIZER);
    kv_prompt_free(&p);
    b = "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}";
    CHECK(kv_prompt_compute(&cfg, b, strlen(b), NULL, 0, &p) == KV_PROMPT_NO_TOKENIZER);
    kv_prompt_free(&p);
    b = "{\"model\":\"other\",\"prompt\":[1,2,3]}";
    CHECK(kv_prompt_compute(&cfg, b, strlen(b), NULL, 0, &p) == KV_PROMPT_MODEL);
    kv_prompt_free(&p);
    b = "[1, 2, 3]";
    CHECK(kv_prompt_compute(&cfg, b, strlen(b), NULL, 0, &p) == KV_PROMPT_PARSE);
    kv_prompt_free(&p);
}

int main(void)
{
    RUN(token_ids_at_several_block_sizes);
    RUN(salt_changes_every_hash);
    RUN(short_prompt_has_no_blocks);
    RUN(fallbacks_say_why);
    return kvt_done();
}
