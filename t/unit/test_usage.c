/* kv_usage: the response scanner finds usage's prompt_tokens and
 * cached_tokens in JSON bodies and SSE streams, split anywhere, and is not
 * fooled by the same words in generated text. */
#include <stdlib.h>

#include "kv_usage.h"
#include "kvtest.h"

/* Feeds s split at every position (and byte by byte): same answer. */
static void scan_all_splits(const char *s, int64_t prompt, int64_t cached)
{
    size_t n = strlen(s);
    for (size_t cut = 0; cut <= n; cut++) {
        kv_usage_scan_t u;
        kv_usage_init(&u);
        kv_usage_feed(&u, s, cut);
        kv_usage_feed(&u, s + cut, n - cut);
        kv_usage_end(&u);
        CHECK(u.prompt_tokens == prompt);
        CHECK(u.cached_tokens == cached);
    }
    kv_usage_scan_t u;
    kv_usage_init(&u);
    for (size_t k = 0; k < n; k++)
        kv_usage_feed(&u, s + k, 1);
    kv_usage_end(&u);
    CHECK(u.prompt_tokens == prompt);
    CHECK(u.cached_tokens == cached);
}

TEST(json_body)
{
    scan_all_splits("{\"id\":\"x\",\"choices\":[{\"text\":\"hi\"}],\"usage\":{\"prompt_tokens\":"
                    "1234,\"total_tokens\":1240,\"completion_tokens\":6,"
                    "\"prompt_tokens_details\":{\"cached_tokens\":1216}}}", 1234, 1216);
    scan_all_splits("{\"usage\" : { \"prompt_tokens\" :\n 7 , \"prompt_tokens_details\": "
                    "{ \"cached_tokens\"\t:\t0 } } }", 7, 0);
}

/* a Response (the Responses API): input_tokens, in a body or the
 * response.completed event of a stream */
TEST(responses_usage)
{
    scan_all_splits("{\"id\":\"resp-1\",\"object\":\"response\",\"output\":[],\"usage\":"
                    "{\"input_tokens\":512,\"input_tokens_details\":{\"cached_tokens\":496},"
                    "\"output_tokens\":4,\"total_tokens\":516}}", 512, 496);
    scan_all_splits("event: response.output_text.delta\ndata: {\"delta\":\"input_tokens\"}\n\n"
                    "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":"
                    "{\"usage\":{\"input_tokens\":9,\"input_tokens_details\":{\"cached_tokens\":0}}}}"
                    "\n\n", 9, 0);
}

TEST(sse_last_chunk_wins)
{
    scan_all_splits("data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}],\"usage\":null}\n\n"
                    "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,"
                    "\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\ndata: [DONE]\n\n",
                    40, 32);
    /* continuous usage: every chunk carries it, the last one counts */
    scan_all_splits("data: {\"usage\":{\"prompt_tokens\":5,\"prompt_tokens_details\":"
                    "{\"cached_tokens\":1}}}\n\ndata: {\"usage\":{\"prompt_tokens\":5,"
                    "\"prompt_tokens_details\":{\"cached_tokens\":3}}}\n\n", 5, 3);
}

TEST(absent_null_and_text_not_fooled)
{
    scan_all_splits("{\"usage\":{\"prompt_tokens\":9,\"prompt_tokens_details\":null}}", 9, -1);
    scan_all_splits("{\"usage\":{\"prompt_tokens\":9,\"prompt_tokens_details\":"
                    "{\"cached_tokens\":null}}}", 9, -1);
    /* the model writes the keys in its text: escaped, never matched */
    scan_all_splits("{\"choices\":[{\"text\":\"{\\\"cached_tokens\\\": 999, "
                    "\\\"prompt_tokens\\\":999}\"}]}", -1, -1);
    /* a string value that equals a key name is not a key */
    scan_all_splits("{\"a\":\"cached_tokens\",\"b\":\"prompt_tokens\"}", -1, -1);
    /* prefixes and longer keys */
    scan_all_splits("{\"prompt_tokens_details\":{},\"cached\":1,\"prompt_token\":2}", -1, -1);
    /* absurdly long numbers are no counts */
    scan_all_splits("{\"cached_tokens\":12345678901234567890123}", -1, -1);
    scan_all_splits("", -1, -1);
}

TEST(number_at_end_of_body)
{
    scan_all_splits("\"cached_tokens\":77", -1, 77);
}

int main(void)
{
    RUN(json_body);
    RUN(responses_usage);
    RUN(sse_last_chunk_wins);
    RUN(absent_null_and_text_not_fooled);
    RUN(number_at_end_of_body);
    return kvt_done();
}
