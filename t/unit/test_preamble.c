/* The first event past a Responses API stream's preamble (kv_preamble.h),
 * on streams shaped as vLLM and kvworker send them. */
#include "kvtest.h"
#include "kv_preamble.h"

/* vLLM: `event:` lines, the type last in each data object, the Response
 * (with the client's instructions, which may quote anything) in the first two */
static const char vllm[] =
    "event: response.created\n"
    "data: {\"response\":{\"id\":\"resp_1\",\"instructions\":\"write \\\"type\\\":"
    "\\\"response.output_text.delta\\\"\",\"object\":\"response\",\"output\":[],"
    "\"status\":\"in_progress\",\"text\":{\"format\":{\"type\":\"text\"}}},"
    "\"sequence_number\":0,\"type\":\"response.created\"}\n\n"
    "event: response.in_progress\n"
    "data: {\"response\":{\"id\":\"resp_1\"},\"sequence_number\":1,"
    "\"type\":\"response.in_progress\"}\n\n";
static const char first[] =
    "event: response.output_item.added\n"
    "data: {\"item\":{\"type\":\"message\"},\"output_index\":0,\"sequence_number\":2,"
    "\"type\":\"response.output_item.added\"}\n\n";

static int fed_whole(const char *a, const char *b)
{
    kv_preamble_t s;

    kv_preamble_init(&s);
    if (kv_preamble_feed(&s, a, strlen(a)))
        return -1;
    return kv_preamble_feed(&s, b, strlen(b));
}

TEST(vllm_stream)
{
    kv_preamble_t s;
    size_t        i, at = 0;
    char          all[sizeof(vllm) + sizeof(first)];

    CHECK(fed_whole(vllm, first) == 1);
    /* byte by byte: it fires inside the first output event's type, not before */
    snprintf(all, sizeof(all), "%s%s", vllm, first);
    kv_preamble_init(&s);
    for (i = 0; all[i]; i++) {
        if (kv_preamble_feed(&s, all + i, 1) && at == 0)
            at = i;
    }
    CHECK(at > strlen(vllm) && at < strlen(all));
    CHECK(kv_preamble_feed(&s, "", 0) == 1);        /* and stays so */
}

/* kvworker: the type first; a space after the colon; an error or a
 * failure ends the preamble too */
TEST(other_shapes)
{
    CHECK(fed_whole("event: response.created\ndata: {\"type\":\"response.created\","
                    "\"response\":{}}\n\n",
                    "event: response.output_text.delta\ndata: {\"type\": "
                    "\"response.output_text.delta\",\"delta\":\"a\"}\n\n") == 1);
    CHECK(fed_whole("data: {\"type\":\"response.in_progress\"}\n\n",
                    "data: {\"type\":\"response.failed\"}\n\n") == 1);
    CHECK(fed_whole("data: {\"type\":\"response.created\"}", "") == 0);
    /* a chat completion stream never says it */
    CHECK(fed_whole("data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":"
                    "[{\"delta\":{\"tool_calls\":[{\"type\":\"function\"}]}}]}\n\n",
                    "data: [DONE]\n\n") == 0);
    /* a name longer than any preamble's */
    CHECK(fed_whole("", "{\"type\":\"response.a_very_long_event_name\"}") == 1);
}

int main(void)
{
    RUN(vllm_stream);
    RUN(other_shapes);
    return kvt_done();
}
