/*
 * kv_tokenizer_cancel_on: an encode on a thread whose flag is set stops
 * early with -1 (the router's pool task whose client went); a flag that
 * stays 0 changes nothing; the flag is per thread and can be cleared.
 */
#include <stdlib.h>

#include "kvtest.h"
#include "kv_prompt.h"

static kv_tokenizer_t *qwen, *phi3;

static char *text_of(size_t words)
{
    char   *s = malloc(words * 8 + 1), *p = s;
    size_t  i;

    for (i = 0; i < words; i++) {
        p += sprintf(p, "w%zu ", (i * 7919) % 100003);
    }
    return s;
}

TEST(flag_left_zero_changes_nothing)
{
    int       flag = 0;
    char     *t = text_of(5000);
    kv_ids_t  a = { 0 }, b = { 0 };

    CHECK(kv_tokenizer_encode(qwen, t, strlen(t), 1, &a) > 0);
    kv_tokenizer_cancel_on(&flag);
    CHECK_EQ_U64(kv_tokenizer_encode(qwen, t, strlen(t), 1, &b), a.n);
    kv_tokenizer_cancel_on(NULL);
    CHECK(memcmp(a.ids, b.ids, a.n * sizeof(uint32_t)) == 0);
    kv_ids_free(&a);
    kv_ids_free(&b);
    free(t);
}

TEST(flag_set_stops_the_encode)
{
    int       flag = 1;
    char     *t = text_of(5000);
    kv_ids_t  a = { 0 }, whole = { 0 };

    CHECK(kv_tokenizer_encode(qwen, t, strlen(t), 1, &whole) > 0);
    kv_tokenizer_cancel_on(&flag);
    CHECK(kv_tokenizer_encode(qwen, t, strlen(t), 1, &a) == -1);
    CHECK(a.n < whole.n / 2);           /* stopped within the first 1024 words */
    kv_ids_free(&a);
    kv_ids_free(&whole);
    /* through kv_prompt: a failed prompt, nothing to route */
    {
        kv_prompt_config_t cfg = { qwen, NULL, NULL, 16, 0, NULL, 0, KV_CHAT_VLLM, NULL, NULL, KV_API_ANY };
        kv_prompt_t        out;
        char              *body = malloc(strlen(t) + 32);

        sprintf(body, "{\"prompt\":\"%s\"}", t);
        CHECK(kv_prompt_compute(&cfg, body, strlen(body), NULL, 0, &out) == KV_PROMPT_NO_MEMORY);
        CHECK_EQ_U64(out.nseq, 0);
        kv_prompt_free(&out);
        free(body);
    }
    kv_tokenizer_cancel_on(NULL);
    CHECK(kv_tokenizer_encode(qwen, t, strlen(t), 1, &a) > 0);
    kv_ids_free(&a);
    free(t);
}

/* SentencePiece-style tokenizers (Phi-3: no pre-tokenizer) stop too, both
 * on words split at "\u2581" and on one long word (no space at all) */
TEST(flag_set_stops_a_sentencepiece_encode)
{
    int       flag = 1;
    char     *t = text_of(5000), *word = malloc(20000);
    kv_ids_t  a = { 0 }, whole = { 0 };

    CHECK(kv_tokenizer_encode(phi3, t, strlen(t), 1, &whole) > 0);
    kv_tokenizer_cancel_on(&flag);
    CHECK(kv_tokenizer_encode(phi3, t, strlen(t), 1, &a) == -1);
    CHECK(a.n < whole.n / 2);
    kv_ids_free(&a);
    memset(word, 'x', 20000);
    CHECK(kv_tokenizer_encode(phi3, word, 20000, 0, &a) == -1);
    kv_ids_free(&a);
    flag = 0;
    CHECK_EQ_U64(kv_tokenizer_encode(phi3, t, strlen(t), 1, &a), whole.n);
    kv_tokenizer_cancel_on(NULL);
    kv_ids_free(&a);
    kv_ids_free(&whole);
    free(word);
    free(t);
}

int main(void)
{
    char err[512];

    qwen = kv_tokenizer_load("conf/tokenizers/qwen2.5-instruct/tokenizer.json", err, sizeof(err));
    if (qwen == NULL) {
        fprintf(stderr, "  %s\n", err);
        return 1;
    }
    phi3 = kv_tokenizer_load("conf/tokenizers/phi-3-mini-4k-instruct/tokenizer.json",
                             err, sizeof(err));
    if (phi3 == NULL) {
        fprintf(stderr, "  %s\n", err);
        return 1;
    }
    RUN(flag_left_zero_changes_nothing);
    RUN(flag_set_stops_the_encode);
    RUN(flag_set_stops_a_sentencepiece_encode);
    kv_tokenizer_free(qwen);
    kv_tokenizer_free(phi3);
    return kvt_done();
}
