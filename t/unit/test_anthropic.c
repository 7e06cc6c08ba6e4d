/* Anthropic Messages API requests as the OpenAI chat requests vLLM makes
 * of them (kv_anthropic.h); the expected texts follow vLLM's
 * entrypoints/anthropic/serving.py, block by block. */
#include <stdlib.h>
#include "kvtest.h"
#include "kv_anthropic.h"

/* messages (and tools) of a request's system, messages and tools JSON */
static int convert(const char *system, const char *messages, const char *tools,
                   const char *want_messages, const char *want_tools)
{
    kv_anthropic_t a;
    char           err[128];
    int            ok;

    if (kv_anthropic_chat(system, system ? strlen(system) : 0, messages, strlen(messages), tools,
                          tools ? strlen(tools) : 0, &a, err, sizeof(err)) != 0)
    {
        fprintf(stderr, "  %s\n", err);
        return 0;
    }
    ok = strcmp(a.messages, want_messages) == 0
         && (want_tools ? a.tools && strcmp(a.tools, want_tools) == 0 : a.tools == NULL);
    if (!ok) {
        fprintf(stderr, "  got %s\n  and %s\n", a.messages, a.tools ? a.tools : "(no tools)");
    }
    kv_anthropic_free(&a);
    return ok;
}

TEST(system_joined_first)
{
    CHECK(convert("\"be brief\"", "[{\"role\":\"user\",\"content\":\"hi\"}]", NULL,
                  "[{\"role\":\"system\",\"content\":\"be brief\"},"
                  "{\"role\":\"user\",\"content\":\"hi\"}]", NULL));
    /* text blocks joined with nothing between; Claude Code's billing header
     * (a per-request hash) and empty blocks left out; a system-role message
     * joins them; an empty system string adds nothing */
    CHECK(convert("[{\"type\":\"text\",\"text\":\"x-anthropic-billing-header: cc=1a2b\"},"
                    "{\"type\":\"text\",\"text\":\"You are Claude Code.\","
                    "\"cache_control\":{\"type\":\"ephemeral\"}},{\"type\":\"text\",\"text\":\"\"},"
                    "{\"type\":\"text\",\"text\":\" Be careful.\"}]",
                  "[{\"role\":\"system\",\"content\":[{\"type\":\"text\",\"text\":\"!\"}]},"
                  "{\"role\":\"user\",\"content\":\"hi\"}]", NULL,
                  "[{\"role\":\"system\",\"content\":\"You are Claude Code. Be careful.!\"},"
                  "{\"role\":\"user\",\"content\":\"hi\"}]", NULL));
    CHECK(convert("\"\"", "[{\"role\":\"user\",\"content\":\"hi\"}]", NULL,
                  "[{\"role\":\"user\",\"content\":\"hi\"}]", NULL));
}

/* An agent's turn: text and tool_use from the assistant; the user's
 * tool_result becomes a tool message placed before what is left of the
 * user's message, which is dropped when nothing is left. */
TEST(tool_use_and_results)
{
    CHECK(convert(NULL,
                  "[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"list files\"}]},"
                  "{\"role\":\"assistant\",\"content\":[{\"type\":\"thinking\",\"thinking\":\"hm\","
                  "\"signature\":\"s\"},{\"type\":\"text\",\"text\":\"Looking.\"},"
                  "{\"type\":\"tool_use\",\"id\":\"toolu_1\",\"name\":\"ls\","
                  "\"input\":{\"path\":\".\",\"all\":true}}]},"
                  "{\"role\":\"user\",\"content\":[{\"type\":\"tool_result\","
                  "\"tool_use_id\":\"toolu_1\",\"content\":[{\"type\":\"text\",\"text\":\"a\"},"
                  "{\"type\":\"text\",\"text\":\"b\"}]}]},"
                  "{\"role\":\"assistant\",\"content\":[{\"type\":\"tool_use\",\"id\":\"toolu_2\","
                  "\"name\":\"cat\",\"input\":{}}]},"
                  "{\"role\":\"user\",\"content\":[{\"type\":\"tool_result\","
                  "\"tool_use_id\":\"toolu_2\",\"content\":\"text\"},"
                  "{\"type\":\"text\",\"text\":\"thanks\"}]}]",
                  NULL,
                  "[{\"role\":\"user\",\"content\":\"list files\"},"
                  "{\"role\":\"assistant\",\"reasoning\":\"hm\",\"tool_calls\":[{\"id\":\"toolu_1\","
                  "\"type\":\"function\",\"function\":{\"name\":\"ls\","
                  "\"arguments\":\"{\\\"path\\\": \\\".\\\", \\\"all\\\": true}\"}}],"
                  "\"content\":\"Looking.\"},"
                  "{\"role\":\"tool\",\"tool_call_id\":\"toolu_1\",\"content\":\"a\\nb\"},"
                  "{\"role\":\"assistant\",\"tool_calls\":[{\"id\":\"toolu_2\",\"type\":\"function\","
                  "\"function\":{\"name\":\"cat\",\"arguments\":\"{}\"}}]},"
                  "{\"role\":\"tool\",\"tool_call_id\":\"toolu_2\",\"content\":\"text\"},"
                  "{\"role\":\"user\",\"content\":\"thanks\"}]",
                  NULL));
    /* a tool result an assistant carries: text of its own */
    CHECK(convert(NULL, "[{\"role\":\"assistant\",\"content\":[{\"type\":\"tool_result\","
                  "\"tool_use_id\":\"t\",\"content\":\"42\"},{\"type\":\"redacted_thinking\","
                  "\"data\":\"x\"}]},{\"role\":\"assistant\",\"content\":[]}]", NULL,
                  "[{\"role\":\"assistant\",\"content\":\"Tool result: 42\"},"
                  "{\"role\":\"assistant\"}]", NULL));
}

/* Images as image_url parts (a data URI of base64 data); several parts
 * stay a list; tools as OpenAI functions. */
TEST(parts_and_tools)
{
    CHECK(convert(NULL,
                  "[{\"role\":\"user\",\"content\":[{\"type\":\"image\",\"source\":{\"type\":"
                  "\"base64\",\"media_type\":\"image/png\",\"data\":\"AAAA\"}},"
                  "{\"type\":\"text\",\"text\":\"what is it?\"}]}]",
                  "[{\"name\":\"ls\",\"description\":\"list\",\"input_schema\":{\"type\":\"object\"}},"
                  "{\"name\":\"x\",\"input_schema\":{},\"defer_loading\":true}]",
                  "[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\",\"image_url\":{\"url\":"
                  "\"data:image/png;base64,AAAA\"}},{\"type\":\"text\",\"text\":\"what is it?\"}]}]",
                  "[{\"type\":\"function\",\"function\":{\"name\":\"ls\",\"description\":\"list\","
                  "\"parameters\":{\"type\":\"object\"}}},{\"type\":\"function\",\"function\":"
                  "{\"name\":\"x\",\"description\":null,\"parameters\":{},\"defer_loading\":true}}]"));
}

/* Every value as Python's json reads it, and `arguments` as its json.dumps
 * writes it: integers past 64 bits kept digit for digit (jansson, which
 * this was built on, refused them, and the request routed by load), floats
 * by their shortest repr, non-ASCII text as UTF-8 (the chat path parses
 * arguments again, as vLLM does, so only the values matter there); NUL
 * bytes are characters; text that is not JSON fails with a reason. */
TEST(limits)
{
    kv_anthropic_t a;
    char           err[128];

    CHECK(convert(NULL, "[{\"role\":\"assistant\",\"content\":[{\"type\":\"tool_use\",\"id\":\"t\","
                        "\"name\":\"n\",\"input\":{\"v\":123456789012345678901234567890,"
                        "\"w\":-98765432109876543210,\"f\":0.7,\"e\":1E5,\"c\":\"Z\\u00fcrich\"}}]}]",
                  NULL,
                  "[{\"role\":\"assistant\",\"tool_calls\":[{\"id\":\"t\",\"type\":\"function\","
                  "\"function\":{\"name\":\"n\",\"arguments\":\"{\\\"v\\\": "
                  "123456789012345678901234567890, \\\"w\\\": -98765432109876543210, "
                  "\\\"f\\\": 0.7, \\\"e\\\": 100000.0, \\\"c\\\": \\\"Z\u00fcrich\\\"}\"}}]}]",
                  NULL));
    CHECK(convert(NULL, "[{\"role\":\"user\",\"content\":\"a\\u0000b\"}]", NULL,
                  "[{\"role\":\"user\",\"content\":\"a\\u0000b\"}]", NULL));
    CHECK(kv_anthropic_chat(NULL, 0, "[{\"role\":", 9, NULL, 0, &a, err, sizeof(err)) == -1);
    CHECK(a.messages == NULL && strstr(err, "anthropic request") != NULL);
}

int main(void)
{
    RUN(system_joined_first);
    RUN(tool_use_and_results);
    RUN(parts_and_tools);
    RUN(limits);
    return kvt_done();
}
