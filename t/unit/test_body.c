/* The request-body scanner: every prompt shape, escapes, and bad input. */
#include <stdlib.h>
#include "kvtest.h"
#include "kv_body.h"

static int parse(kv_body_t *b, const char *s)
{
    char err[128];
    return kv_body_parse(b, s, strlen(s), err, sizeof(err));
}

TEST(text_prompt_and_fields)
{
    kv_body_t b;
    CHECK(parse(&b, " {\"model\":\"m1\",\"stream\":true,\"max_tokens\":7,"
                    "\"x\":{\"a\":[1,{\"b\":null}]},\"prompt\":\"hi \\\"there\\\"\\n\","
                    "\"cache_salt\":\"tenant-a\"} ") == 0);
    CHECK(b.kind == KV_BODY_TEXT);
    CHECK_STR(b.text, "hi \"there\"\n");
    CHECK_STR(b.model, "m1");
    CHECK_STR(b.salt, "tenant-a");
    CHECK(b.stream == 1);
    CHECK(b.max_tokens == 7);
    kv_body_free(&b);
}

TEST(unicode_escapes)
{
    kv_body_t b;
    CHECK(parse(&b, "{\"prompt\":\"\\u00e9\\ud83d\\ude00\\ud800x\"}") == 0);
    CHECK_STR(b.text, "\xc3\xa9\xf0\x9f\x98\x80\xef\xbf\xbdx");
    kv_body_free(&b);
}

TEST(id_prompts)
{
    kv_body_t b;
    CHECK(parse(&b, "{\"prompt\":[1, 2 ,4294967295]}") == 0);
    CHECK(b.kind == KV_BODY_IDS);
    CHECK_EQ_U64(b.n_ids, 3);
    CHECK_EQ_U64(b.ids[2], 4294967295ULL);
    kv_body_free(&b);
    CHECK(parse(&b, "{\"prompt\":[[5,6],[7]]}") == 0);
    CHECK(b.kind == KV_BODY_IDS);
    CHECK_EQ_U64(b.n_ids, 2);
    CHECK_EQ_U64(b.ids[1], 6);
    kv_body_free(&b);
    CHECK(parse(&b, "{\"prompt\":[\"first\",\"second\"]}") == 0);
    CHECK(b.kind == KV_BODY_TEXT);
    CHECK_STR(b.text, "first");
    kv_body_free(&b);
    CHECK(parse(&b, "{\"prompt\":[]}") == 0);
    CHECK(b.kind == KV_BODY_IDS && b.n_ids == 0);
    kv_body_free(&b);
}

/* Id arrays in every spacing and with every defect: the fast loop of
 * kv_body.c and the general scanner it hands odd items to agree. */
TEST(id_arrays_every_spacing)
{
    static const char *seps[] = { ",", ", ", " ,", " , ", ",\n", ",  ", "\t,", ",\r\n " };
    static const char *defects[] = { "-5", "1.5", "4294967296", "1e2", "", "1 2", "x", "01.0",
                                     "99999999999", "-0" };
    uint64_t  x = 88172645463325252ULL;
    char     *buf = malloc(1 << 16);
    uint32_t  want[600];
    size_t    round, i, n, len;
    kv_body_t b;

    for (round = 0; round < 3000; round++) {
        int bad = round % 3 == 2, at;

        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
        n = x % 600;
        at = n ? (int) ((x >> 20) % n) : -1;
        len = (size_t) sprintf(buf, "{\"prompt\":[%s", x >> 40 & 1 ? " " : "");
        for (i = 0; i < n; i++) {
            x ^= x << 13; x ^= x >> 7; x ^= x << 17;
            want[i] = (uint32_t) (x % 5 == 0 ? x >> 32 : x % 3 == 0 ? x % 10 : x % 152000);
            if (i) {
                len += (size_t) sprintf(buf + len, "%s", x % 4 ? seps[x >> 8 & 1] : seps[x >> 8 & 7]);
            }
            if (bad && (int) i == at) {
                len += (size_t) sprintf(buf + len, "%s", defects[x >> 12 & 7 ? (x >> 16) % 10 : 0]);
            } else {
                len += (size_t) sprintf(buf + len, x % 17 == 0 ? "00%u" : "%u", want[i]);
            }
        }
        len += (size_t) sprintf(buf + len, "%s]}", x >> 41 & 1 ? " " : "");
        if (parse(&b, buf) != (bad && n ? -1 : 0)) {
            fprintf(stderr, "  round %zu: %s\n", round, buf);
            CHECK(0);
            kv_body_free(&b);
            break;
        }
        if (!(bad && n)) {
            CHECK_EQ_U64(b.n_ids, n);
            for (i = 0; i < n && i < b.n_ids; i++) {
                if (b.ids[i] != want[i]) {
                    fprintf(stderr, "  round %zu id %zu: %u, want %u\n", round, i, b.ids[i], want[i]);
                    CHECK(0);
                    break;
                }
            }
        }
        kv_body_free(&b);
        /* cut short anywhere: an error, never a crash */
        buf[x % (len + 1)] = '\0';
        if (strlen(buf) < len) {
            CHECK(parse(&b, buf) == -1);
            kv_body_free(&b);
        }
    }
    /* a trailing comma and a missing one, at the fast loop's edges */
    CHECK(parse(&b, "{\"prompt\":[1,2,]}") == -1);
    kv_body_free(&b);
    CHECK(parse(&b, "{\"prompt\":[1,2 3]}") == -1);
    kv_body_free(&b);
    CHECK(parse(&b, "{\"prompt\":[,1]}") == -1);
    kv_body_free(&b);
    CHECK(parse(&b, "{\"prompt\":[0000000001,00000000001,4294967295]}") == 0);
    CHECK(b.n_ids == 3 && b.ids[0] == 1 && b.ids[1] == 1 && b.ids[2] == 4294967295u);
    kv_body_free(&b);
    free(buf);
}

/* The fast loop reads 8 bytes at a time and takes the digits at their
 * head whole, and in long arrays classifies 64 bytes at once: ids of 1 to
 * 10 digits (leading zeros too), then every byte value (the digit class's
 * edges '/' ':' and bytes whose carry spills), then 5, alone or amid long
 * runs of ids before and after (pad 3, 4): only a comma makes more ids,
 * any other byte is an error. */
TEST(id_digits_then_every_byte)
{
    static const char *heads[] = { "7", "42", "150", "9999", "12345", "151643", "1234567",
                                   "12345678", "123456789", "4294967295", "0", "007",
                                   "0000042", "00000042" };
    char      buf[512], err[128];
    kv_body_t b;
    size_t    h, len, i, before;
    unsigned  c, pad;
    int       rc, bad;

    for (h = 0; h < sizeof(heads) / sizeof(heads[0]); h++) {
        for (c = 0; c < 256; c++) {
            if (c >= '0' && c <= '9') {
                continue;
            }
            for (pad = 0; pad < 5; pad++) {
                len = (size_t) sprintf(buf, "{\"prompt\":[%s", pad == 1 ? "3," : "");
                before = pad == 1;
                for (i = 0; pad >= 3 && i < 5 + pad * 3; i++) {
                    len += (size_t) sprintf(buf + len, i % 3 ? "%zu," : "%zu, ", i * 37);
                    before++;
                }
                len += (size_t) sprintf(buf + len, "%s", heads[h]);
                buf[len++] = (char) c;
                len += (size_t) sprintf(buf + len, "5");
                for (i = 0; pad >= 3 && i < 40; i++) {
                    len += (size_t) sprintf(buf + len, ",%zu", i);
                }
                len += (size_t) sprintf(buf + len, "]%s", pad == 2 ? "}     " : "}");
                rc = kv_body_parse(&b, buf, len, err, sizeof(err));
                if (c == ',') {
                    CHECK(rc == 0);
                    CHECK_EQ_U64(b.n_ids, before + 2 + (pad >= 3 ? 40 : 0));
                    bad = rc != 0 || b.n_ids != before + 2 + (pad >= 3 ? 40 : 0);
                    for (i = 0; !bad && i < before; i++) {
                        bad = b.ids[i] != (pad == 1 ? 3 : i * 37);
                    }
                    bad = bad || b.ids[before] != strtoull(heads[h], NULL, 10)
                              || b.ids[before + 1] != 5;
                    for (i = 0; !bad && pad >= 3 && i < 40; i++) {
                        bad = b.ids[before + 2 + i] != i;
                    }
                    if (bad) {
                        fprintf(stderr, "  wrong ids: %.*s\n", (int) len, buf);
                        CHECK(0);
                    }
                } else if (rc != -1) {
                    fprintf(stderr, "  %s then byte %u accepted\n", heads[h], c);
                    CHECK(0);
                }
                kv_body_free(&b);
            }
        }
    }
}

TEST(messages_span)
{
    kv_body_t b;
    const char *s = "{\"messages\":[{\"role\":\"user\",\"content\":\"a]b\"}],\"model\":\"q\"}";
    CHECK(parse(&b, s) == 0);
    CHECK(b.kind == KV_BODY_MESSAGES);
    CHECK(b.chat.messages_len == strlen("[{\"role\":\"user\",\"content\":\"a]b\"}]"));
    CHECK(strncmp(b.chat.messages, "[{\"role\"", 8) == 0);
    kv_body_free(&b);
}

TEST(malformed_rejected)
{
    static const char *bad[] = {
        "", "[]", "{", "{\"prompt\":", "{\"prompt\":\"abc}", "{\"prompt\":[1,2,]}",
        "{\"prompt\":[1.5]}", "{\"prompt\":[-1]}", "{\"prompt\":[99999999999]}",
        "{\"a\":1,}", "{\"a\" 1}", "{\"a\":tru}", "{} x", "{\"prompt\":\"\\q\"}",
        "{\"prompt\":\"\x01\"}", "{\"prompt\":7}", "{\"prompt\":[{}]}",
        "{\"model\":\"" "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
        "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\"}",
    };
    kv_body_t b;
    size_t    i;

    for (i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        int rc = parse(&b, bad[i]);
        if (rc == 0) fprintf(stderr, "  accepted: %s\n", bad[i]);
        CHECK(rc == -1);
        CHECK(b.kind == KV_BODY_NONE && b.text == NULL && b.ids == NULL);
        kv_body_free(&b);
    }
}

TEST(deep_nesting_refused)
{
    char      buf[512];
    kv_body_t b;
    int       i;

    strcpy(buf, "{\"x\":");
    for (i = 0; i < 200; i++) strcat(buf, "[");
    CHECK(parse(&b, buf) == -1);
    kv_body_free(&b);
}

TEST(no_prompt)
{
    kv_body_t b;
    CHECK(parse(&b, "{\"model\":\"m\"}") == 0);
    CHECK(b.kind == KV_BODY_NONE);
    kv_body_free(&b);
}

/* Session hints: strings hashed (escapes undone first), other types and
 * empty strings ignored, both fields kept apart. */
TEST(session_hints)
{
    kv_body_t b;

    CHECK(parse(&b, "{\"prompt\":\"x\",\"user\":\"alice\","
                    "\"prompt_cache_key\":\"conv-\\u0031\"}") == 0);
    CHECK(b.user == kv_body_session_key("alice", 5));
    CHECK(b.cache_key == kv_body_session_key("conv-1", 6));
    CHECK(b.user != 0 && b.cache_key != 0 && b.user != b.cache_key);
    kv_body_free(&b);

    CHECK(parse(&b, "{\"user\":42,\"prompt_cache_key\":null,\"prompt\":[1]}") == 0);
    CHECK(b.user == 0 && b.cache_key == 0);
    kv_body_free(&b);

    CHECK(parse(&b, "{\"user\":\"\"}") == 0);
    CHECK(b.user == 0);
    kv_body_free(&b);
    /* the Anthropic API's metadata.user_id (Claude Code's session) */
    CHECK(parse(&b, "{\"metadata\":{\"x\":[1,{}],\"user_id\":\"user_1_session_9\"},"
                    "\"messages\":[]}") == 0);
    CHECK(b.user == kv_body_session_key("user_1_session_9", 16));
    kv_body_free(&b);
    CHECK(parse(&b, "{\"metadata\":{\"user_idX\":\"a\",\"user_i\":\"b\"}}") == 0);
    CHECK(b.user == 0);
    kv_body_free(&b);
    CHECK(parse(&b, "{\"metadata\":{\"user_id\":}}") == -1);
    kv_body_free(&b);
    CHECK(kv_body_session_key(NULL, 0) == 0);
    CHECK(kv_body_session_key("a", 1) == kv_body_session_key("ab", 1));
}

/* n and best_of: the output sequences the engine decodes (the larger;
 * absent, not a positive integer: 1; capped). */
TEST(sequences)
{
    static const struct { const char *body; long want; } cases[] = {
        { "{\"prompt\":[1]}", 1 },
        { "{\"prompt\":[1],\"n\":4}", 4 },
        { "{\"n\":2,\"prompt\":[1],\"best_of\":8}", 8 },
        { "{\"best_of\":3,\"n\":5,\"prompt\":[1]}", 5 },
        { "{\"prompt\":[1],\"n\":0}", 1 },
        { "{\"prompt\":[1],\"n\":null}", 1 },
        { "{\"prompt\":[1],\"n\":\"4\"}", 1 },
        { "{\"prompt\":[1],\"n\":2.5}", 1 },
        { "{\"prompt\":[1],\"n\":-3}", 1 },
        { "{\"prompt\":[1],\"n\":99999999999}", KV_BODY_SEQUENCES_MAX },
    };
    kv_body_t b;

    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        CHECK(parse(&b, cases[i].body) == 0);
        if (b.sequences != cases[i].want) fprintf(stderr, "  %s: %ld\n", cases[i].body, b.sequences);
        CHECK(b.sequences == cases[i].want);
        kv_body_free(&b);
    }
}

/* A batch of prompts: counted, and each one after the first measured past
 * its common prefix with the first (ids, or raw bytes of text). */
TEST(batch_counted)
{
    static const struct { const char *body; long prompts; size_t ids, bytes; } cases[] = {
        { "{\"prompt\":\"one\"}", 1, 0, 0 },
        { "{\"prompt\":[1,2,3]}", 1, 0, 0 },
        { "{\"prompt\":[[1,2,3]]}", 1, 0, 0 },
        { "{\"prompt\":[[1,2,3],[1,2,3]]}", 2, 0, 0 },          /* the same prompt twice */
        { "{\"prompt\":[[1,2,35],[1,2,36,4]]}", 2, 2, 0 },      /* 36 differs from 35 */
        { "{\"prompt\":[[1,2],[1,2,3],[9]]}", 3, 2, 0 },
        { "{\"prompt\":[[12],[1]]}", 2, 1, 0 },
        { "{\"prompt\":[[1,2,3,4],[1,2,3]]}", 2, 0, 0 },        /* a prefix of the first */
        { "{\"prompt\":[\"abcdef\",\"abcxyz\",\"q\"]}", 3, 0, 4 + 2 },
        { "{\"prompt\":[\"ab\",[1,2]]}", 2, 2, 0 },
        { "{\"prompt\":[[1,2],\"ab\"]}", 2, 0, 4 },
        { "{\"prompt\":[\"a\"],\"prompt\":[\"a\",\"b\"]}", 2, 0, 2 },   /* the last wins */
        { "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}", 1, 0, 0 },
    };
    kv_body_t b;

    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        CHECK(parse(&b, cases[i].body) == 0);
        if (b.prompts != cases[i].prompts || b.batch_ids != cases[i].ids
            || b.batch_bytes != cases[i].bytes)
        {
            fprintf(stderr, "  %s: %ld %zu %zu\n", cases[i].body, b.prompts, b.batch_ids,
                    b.batch_bytes);
        }
        CHECK(b.prompts == cases[i].prompts);
        CHECK_EQ_U64(b.batch_ids, cases[i].ids);
        CHECK_EQ_U64(b.batch_bytes, cases[i].bytes);
        kv_body_free(&b);
    }
}

/* SGLang's native /generate: `text` or `input_ids` (one prompt or a
 * batch) and `sampling_params` (an object, or one per prompt: the largest
 * max_new_tokens and n); the Responses API's `text` object is no prompt
 * (its `input` is). */
TEST(sglang_generate)
{
    kv_body_t b;

    CHECK(parse(&b, "{\"text\":\"hello\",\"sampling_params\":{\"temperature\":0.5,"
                    "\"stop\":[\"x\"],\"max_new_tokens\":64,\"n\":4},\"stream\":true}") == 0);
    CHECK(b.kind == KV_BODY_TEXT);
    CHECK_STR(b.text, "hello");
    CHECK(b.max_tokens == 64 && b.sequences == 4 && b.stream && b.prompts == 1);
    kv_body_free(&b);
    CHECK(parse(&b, "{\"input_ids\":[1,2,3],\"sampling_params\":{\"max_new_tokens\":8}}") == 0);
    CHECK(b.kind == KV_BODY_IDS && b.n_ids == 3 && b.max_tokens == 8 && b.sequences == 1);
    kv_body_free(&b);
    CHECK(parse(&b, "{\"sampling_params\":[{\"max_new_tokens\":8},{\"max_new_tokens\":16,"
                    "\"n\":2},null],\"input_ids\":[[1,2],[1,3]]}") == 0);
    CHECK(b.kind == KV_BODY_IDS && b.n_ids == 2 && b.prompts == 2 && b.batch_ids == 1);
    CHECK(b.max_tokens == 16 && b.sequences == 2);
    kv_body_free(&b);
    CHECK(parse(&b, "{\"text\":[\"a\",\"b\"],\"sampling_params\":null}") == 0);
    CHECK(b.kind == KV_BODY_TEXT && b.prompts == 2 && b.batch_bytes == 2);
    kv_body_free(&b);
    CHECK(parse(&b, "{\"model\":\"m\",\"input\":\"x\",\"text\":{\"format\":{\"type\":\"text\"}}}")
          == 0);
    CHECK(b.kind == KV_BODY_MESSAGES && b.responses != NULL);     /* its `input` */
    kv_body_free(&b);
    CHECK(parse(&b, "{\"prompt\":\"p\",\"text\":\"t\"}") == 0);      /* the first one */
    CHECK_STR(b.text, "p");
    kv_body_free(&b);
    CHECK(parse(&b, "{\"text\":\"a\",\"sampling_params\":{\"n\":}}") == -1);
    kv_body_free(&b);
    CHECK(parse(&b, "{\"text\":\"a\",\"sampling_params\":[{\"n\":1},]}") == -1);
    kv_body_free(&b);
}

/* The Responses API: `instructions` and `input` made into the messages
 * vLLM makes of them; items without a role left out, `tools` dropped. */
TEST(responses_messages)
{
    static const struct { const char *body, *messages; } cases[] = {
        { "{\"input\":\"hi\"}", "[{\"role\":\"user\",\"content\":\"hi\"}]" },
        { "{\"input\":\"hi\",\"instructions\":\"be \\\"kind\\\"\"}",
          "[{\"role\":\"system\",\"content\":\"be \\\"kind\\\"\"},{\"role\":\"user\",\"content\":\"hi\"}]" },
        { "{\"instructions\":\"\",\"input\":[ {\"role\" : \"user\",\"content\":\"a\"}, 7,"
          "{\"type\":\"reasoning\",\"role\":\"assistant\"},{\"type\":\"message\",\"role\":\"assistant\","
          "\"content\":[]},{\"type\":\"function_call_output\",\"output\":\"{}\"},{\"content\":\"x\"}]}",
          "[{\"role\" : \"user\",\"content\":\"a\"},{\"type\":\"message\",\"role\":\"assistant\","
          "\"content\":[]}]" },
        { "{\"input\":[],\"tools\":[{\"type\":\"function\",\"name\":\"f\"}]}", "[]" },
    };
    kv_body_t b;

    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        CHECK(parse(&b, cases[i].body) == 0);
        CHECK(b.kind == KV_BODY_MESSAGES);
        CHECK(b.chat.tools == NULL);
        if (b.chat.messages_len != strlen(cases[i].messages)
            || memcmp(b.chat.messages, cases[i].messages, b.chat.messages_len) != 0)
        {
            fprintf(stderr, "  %s: %.*s\n", cases[i].body, (int) b.chat.messages_len,
                    b.chat.messages);
            CHECK(0);
        }
        kv_body_free(&b);
    }
    /* a prompt or messages come first; `input` that is neither is no prompt */
    CHECK(parse(&b, "{\"messages\":[{\"role\":\"user\",\"content\":\"m\"}],\"input\":\"i\"}") == 0);
    CHECK(b.kind == KV_BODY_MESSAGES && b.responses == NULL);
    kv_body_free(&b);
    CHECK(parse(&b, "{\"input\":{\"a\":1},\"max_output_tokens\":9}") == 0);
    CHECK(b.kind == KV_BODY_NONE && b.max_tokens == 9);
    kv_body_free(&b);
    CHECK(parse(&b, "{\"input\":[{\"role\":\"user\"]}") == -1);
    kv_body_free(&b);
    /* the response it continues: its id's key, as the response scan keys it */
    CHECK(parse(&b, "{\"input\":\"and?\",\"previous_response_id\":\"resp_\\u0061b\"}") == 0);
    CHECK(b.prev_response == kv_body_session_key("resp_ab", 7));
    kv_body_free(&b);
    CHECK(parse(&b, "{\"input\":\"x\",\"previous_response_id\":null}") == 0);
    CHECK(b.prev_response == 0);
    kv_body_free(&b);
}

/*
 * A member given twice: Python's json.loads keeps the last value (at the
 * first one's place), so the engine reads the last; so must the router,
 * for every member it reads, whatever the earlier value was.
 */
TEST(duplicates_last_wins)
{
    static const char *msg_a = "[{\"role\":\"user\",\"content\":\"a\"}]";
    static const char *msg_b = "[{\"role\":\"user\",\"content\":\"b\"}]";
    char      buf[512];
    kv_body_t b;

    CHECK(parse(&b, "{\"prompt\":\"a\",\"prompt\":\"b\"}") == 0);
    CHECK(b.kind == KV_BODY_TEXT);
    CHECK_STR(b.text, "b");
    kv_body_free(&b);
    CHECK(parse(&b, "{\"prompt\":[1,2],\"model\":\"m\",\"prompt\":\"b\"}") == 0);
    CHECK(b.kind == KV_BODY_TEXT && b.n_ids == 0);
    CHECK_STR(b.text, "b");
    kv_body_free(&b);
    CHECK(parse(&b, "{\"prompt\":\"a\",\"prompt\":[[3],[4,5]]}") == 0);
    CHECK(b.kind == KV_BODY_IDS && b.text == NULL && b.n_ids == 1 && b.ids[0] == 3);
    CHECK(b.prompts == 2 && b.batch_ids == 2);
    kv_body_free(&b);
    CHECK(parse(&b, "{\"input_ids\":[1],\"input_ids\":[7,8]}") == 0);
    CHECK(b.kind == KV_BODY_IDS && b.n_ids == 2 && b.ids[0] == 7);
    kv_body_free(&b);

    snprintf(buf, sizeof(buf), "{\"messages\":%s,\"messages\":%s}", msg_a, msg_b);
    CHECK(parse(&b, buf) == 0);
    CHECK(b.kind == KV_BODY_MESSAGES && b.chat.messages_len == strlen(msg_b)
          && memcmp(b.chat.messages, msg_b, strlen(msg_b)) == 0);
    kv_body_free(&b);
    snprintf(buf, sizeof(buf), "{\"messages\":%s,\"messages\":null}", msg_a);
    CHECK(parse(&b, buf) == 0);
    CHECK(b.kind == KV_BODY_NONE && b.chat.messages == NULL);
    kv_body_free(&b);
    /* which prompt member routes is decided on the members as Python
     * holds them: each at its first place, with its last value */
    snprintf(buf, sizeof(buf), "{\"messages\":null,\"prompt\":\"p\",\"messages\":%s}", msg_b);
    CHECK(parse(&b, buf) == 0);
    CHECK(b.kind == KV_BODY_MESSAGES && b.text == NULL
          && memcmp(b.chat.messages, msg_b, strlen(msg_b)) == 0);
    kv_body_free(&b);
    snprintf(buf, sizeof(buf), "{\"messages\":%s,\"text\":\"t\",\"messages\":7}", msg_a);
    CHECK(parse(&b, buf) == 0);
    CHECK(b.kind == KV_BODY_TEXT && b.chat.messages == NULL);
    CHECK_STR(b.text, "t");
    kv_body_free(&b);

    /* the members rendered with the messages */
    snprintf(buf, sizeof(buf), "{\"messages\":%s,\"tools\":[{}],\"tools\":null,"
             "\"chat_template_kwargs\":{\"a\":1},\"chat_template_kwargs\":{\"b\":2},"
             "\"add_generation_prompt\":false,\"add_generation_prompt\":null,"
             "\"continue_final_message\":true,\"continue_final_message\":false,"
             "\"add_special_tokens\":true,\"add_special_tokens\":\"x\"}", msg_a);
    CHECK(parse(&b, buf) == 0);
    CHECK(b.chat.tools == NULL);
    CHECK(b.chat.kwargs_len == 7 && memcmp(b.chat.kwargs, "{\"b\":2}", 7) == 0);
    CHECK(b.chat.add_generation_prompt == 1 && b.chat.continue_final_message == 0);
    CHECK(b.add_special_tokens == -1);
    kv_body_free(&b);

    /* the other members the router reads */
    CHECK(parse(&b, "{\"prompt\":\"p\",\"model\":\"a\",\"model\":null,\"cache_salt\":\"s1\","
                    "\"cache_salt\":\"s2\",\"user\":\"u\",\"user\":null,\"stream\":true,"
                    "\"stream\":false,\"max_tokens\":5,\"max_tokens\":null,\"n\":4,\"n\":2,"
                    "\"prompt_cache_key\":\"k\",\"prompt_cache_key\":7}") == 0);
    CHECK_STR(b.model, "");
    CHECK_STR(b.salt, "s2");
    CHECK(b.n_salts == 2);
    CHECK(b.user == 0 && b.cache_key == 0 && b.stream == 0);
    CHECK(b.max_tokens == -1 && b.sequences == 2);
    kv_body_free(&b);
    CHECK(parse(&b, "{\"prompt\":\"p\",\"cache_salt\":\"s1\",\"cache_salt\":null}") == 0);
    CHECK(b.salt == NULL);
    kv_body_free(&b);
    CHECK(parse(&b, "{\"text\":\"p\",\"sampling_params\":{\"max_new_tokens\":64,\"n\":4},"
                    "\"sampling_params\":{\"max_new_tokens\":8,\"max_new_tokens\":9}}") == 0);
    CHECK(b.max_tokens == 9 && b.sequences == 1);
    kv_body_free(&b);
    CHECK(parse(&b, "{\"metadata\":{\"user_id\":\"u1\"},\"metadata\":{}}") == 0);
    CHECK(b.user == 0);
    kv_body_free(&b);
    CHECK(parse(&b, "{\"metadata\":{\"user_id\":\"u1\",\"user_id\":null}}") == 0);
    CHECK(b.user == 0);
    kv_body_free(&b);

    /* the Responses API's and the Anthropic API's members */
    CHECK(parse(&b, "{\"input\":\"a\",\"input\":null}") == 0);
    CHECK(b.kind == KV_BODY_NONE && b.responses == NULL);
    kv_body_free(&b);
    CHECK(parse(&b, "{\"instructions\":\"s\",\"instructions\":null,\"input\":\"x\"}") == 0);
    CHECK(b.kind == KV_BODY_MESSAGES
          && strncmp(b.chat.messages, "[{\"role\":\"user\"", 15) == 0);
    kv_body_free(&b);
    snprintf(buf, sizeof(buf), "{\"system\":\"s\",\"system\":null,\"messages\":%s}", msg_a);
    CHECK(parse(&b, buf) == 0);
    CHECK(b.system == NULL && b.anthropic.messages == NULL);
    kv_body_free(&b);
    /* an input item's members too: the last `type` and `role` say */
    CHECK(parse(&b, "{\"input\":[{\"type\":\"reasoning\",\"role\":\"user\",\"type\":\"message\","
                    "\"content\":\"a\"},{\"role\":\"user\",\"content\":\"b\",\"role\":7}]}") == 0);
    CHECK(b.kind == KV_BODY_MESSAGES
          && memmem(b.chat.messages, b.chat.messages_len, "\"a\"", 3) != NULL
          && memmem(b.chat.messages, b.chat.messages_len, "\"b\"", 3) == NULL);
    kv_body_free(&b);
}

static int parse_api(kv_body_t *b, kv_api_t api, const char *s)
{
    char err[128];
    return kv_body_parse_api(b, api, s, strlen(s), err, sizeof(err));
}

/* Paths to APIs, by their last segments; what no path names is ANY. */
TEST(api_of_path)
{
    static const struct { const char *path; kv_api_t api; } cases[] = {
        { "/v1/completions", KV_API_GENERATE },
        { "/v1/chat/completions", KV_API_GENERATE },
        { "/llm/v1/responses", KV_API_GENERATE },
        { "/generate", KV_API_GENERATE },
        { "/v1/embeddings", KV_API_POOLING },
        { "/v1/embeddings/", KV_API_POOLING },
        { "/pooling", KV_API_POOLING },
        { "/classify", KV_API_POOLING },
        { "/v1/score", KV_API_SCORE },
        { "/v2/rerank", KV_API_SCORE },
        { "/tokenize", KV_API_TOKENIZE },
        { "/detokenize", KV_API_TOKENIZE },
        { "/v1/models", KV_API_ANY },
        { "/", KV_API_ANY },
        { "", KV_API_ANY },
        { "/v1/myembeddings", KV_API_ANY },
        { "/v1/embeddings/x", KV_API_ANY },
    };

    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        if (kv_api_of_path(cases[i].path, strlen(cases[i].path)) != cases[i].api) {
            fprintf(stderr, "  %s\n", cases[i].path);
            CHECK(0);
        }
    }
}

/*
 * An embeddings (pooling, classify) request: `input` is its prompt, read
 * as a completion's (one, a batch, token ids), with nothing decoded; its
 * `messages` are rendered without the generation prompt unless it asks.
 * On a path that says nothing, `encoding_format`, `dimensions` or an
 * `input` list of prompts make it one; a string `input` alone stays the
 * Responses API's.
 */
TEST(pooling_requests)
{
    kv_body_t b;

    CHECK(parse_api(&b, KV_API_POOLING, "{\"model\":\"e\",\"input\":\"hello\"}") == 0);
    CHECK(b.kind == KV_BODY_TEXT && b.prefill_only && b.responses == NULL);
    CHECK_STR(b.text, "hello");
    kv_body_free(&b);
    CHECK(parse_api(&b, KV_API_POOLING, "{\"input\":[\"abcd\",\"abxy\"]}") == 0);
    CHECK(b.kind == KV_BODY_TEXT && b.prompts == 2 && b.batch_bytes == 3 && b.prefill_only);
    kv_body_free(&b);
    CHECK(parse_api(&b, KV_API_POOLING, "{\"input\":[[1,2,3],[1,2,4]]}") == 0);
    CHECK(b.kind == KV_BODY_IDS && b.n_ids == 3 && b.prompts == 2 && b.batch_ids == 1);
    kv_body_free(&b);
    CHECK(parse_api(&b, KV_API_POOLING, "{\"messages\":[{\"role\":\"user\",\"content\":\"q\"}]}")
          == 0);
    CHECK(b.kind == KV_BODY_MESSAGES && b.chat.add_generation_prompt == 0 && b.prefill_only);
    kv_body_free(&b);
    CHECK(parse_api(&b, KV_API_POOLING, "{\"add_generation_prompt\":true,"
                    "\"messages\":[{\"role\":\"user\",\"content\":\"q\"}]}") == 0);
    CHECK(b.chat.add_generation_prompt == 1);
    kv_body_free(&b);
    CHECK(parse_api(&b, KV_API_POOLING, "{\"input\":{\"a\":1}}") == 0);
    CHECK(b.kind == KV_BODY_NONE && b.prefill_only);      /* no prompt: routed by load */
    kv_body_free(&b);

    /* unknown paths: the members say */
    CHECK(parse(&b, "{\"input\":\"hello\",\"model\":\"e\",\"encoding_format\":\"base64\"}") == 0);
    CHECK(b.kind == KV_BODY_TEXT && b.prefill_only);
    kv_body_free(&b);
    CHECK(parse(&b, "{\"dimensions\":64,\"input\":[5,6]}") == 0);
    CHECK(b.kind == KV_BODY_IDS && b.n_ids == 2 && b.prefill_only);
    kv_body_free(&b);
    CHECK(parse(&b, "{\"input\":[ \"a\",\"b\"]}") == 0);
    CHECK(b.kind == KV_BODY_TEXT && b.prompts == 2 && b.prefill_only);
    kv_body_free(&b);
    CHECK(parse(&b, "{\"input\":\"hello\"}") == 0);
    CHECK(b.kind == KV_BODY_MESSAGES && !b.prefill_only && b.chat.add_generation_prompt == 1);
    kv_body_free(&b);
    CHECK(parse(&b, "{\"messages\":[{\"role\":\"user\",\"content\":\"q\"}]}") == 0);
    CHECK(b.chat.add_generation_prompt == 1 && !b.prefill_only);
    kv_body_free(&b);

    /* a generation path: its members never make it an embedding */
    CHECK(parse_api(&b, KV_API_GENERATE, "{\"input\":\"x\",\"encoding_format\":\"float\"}") == 0);
    CHECK(b.kind == KV_BODY_MESSAGES && !b.prefill_only);
    kv_body_free(&b);
    /* scores and tokenizes decode nothing and read no `input` */
    CHECK(parse_api(&b, KV_API_SCORE, "{\"query\":\"q\",\"documents\":[\"a\"],\"input\":\"x\"}")
          == 0);
    CHECK(b.prefill_only && b.kind == KV_BODY_NONE);
    kv_body_free(&b);
    CHECK(parse_api(&b, KV_API_TOKENIZE, "{\"prompt\":\"x\"}") == 0);
    CHECK(b.prefill_only);
    kv_body_free(&b);
}

/* kv_body_model: only `model`, as kv_body_parse reads it (the last one,
 * escapes undone); malformed bodies and names too long fail alike. */
TEST(model_alone)
{
    static const char *bad[] = {
        "", "[]", "{\"model\":\"m\"", "{\"prompt\":[1,]}", "{\"model\":\"m\"} x",
        "{\"model\":\"" "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
        "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\"}",
    };
    static const struct { const char *body, *model; } good[] = {
        { "{\"prompt\":[1,2]}", "" },
        { "{\"model\":\"a\",\"prompt\":\"x\"}", "a" },
        { "{\"extra\":{\"model\":\"inner\"},\"model\":\"a\",\"model\":\"b\"}", "b" },
        { "{\"mod\\u0065l\":\"sql-\\u006cora\"}", "sql-lora" },
        { "{\"model\":null}", "" },
        { "{\"model\":\"a\",\"model\":7}", "" },
        { "{\"model\":\"" "\\u0061\\u0061\\u0061\\u0061\\u0061\\u0061\\u0061\\u0061"
          "\\u0061\\u0061\\u0061\\u0061\\u0061\\u0061\\u0061\\u0061\\u0061\\u0061"
          "\\u0061\\u0061\\u0061\\u0061\\u0061\\u0061\"}", "aaaaaaaaaaaaaaaaaaaaaaaa" },
    };
    char      model[128], err[128];
    kv_body_t b;
    size_t    i;

    for (i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
        CHECK(kv_body_model(good[i].body, strlen(good[i].body), model, sizeof(model), err,
                            sizeof(err)) == 0);
        CHECK(strcmp(model, good[i].model) == 0);
        CHECK(parse(&b, good[i].body) == 0);
        CHECK(strcmp(b.model, model) == 0);     /* as the whole parse reads it */
        kv_body_free(&b);
    }
    for (i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        CHECK(kv_body_model(bad[i], strlen(bad[i]), model, sizeof(model), err, sizeof(err))
              == -1);
        CHECK(err[0] != '\0');
    }
}

/* the response id a Responses API path names, for routing it home */
TEST(response_id_of_path)
{
    const char *id = NULL;
    size_t      n;

    n = kv_api_response_id("/v1/responses/resp_12", 21, &id);
    CHECK(n == 7 && memcmp(id, "resp_12", 7) == 0);
    n = kv_api_response_id("/llm/v1/responses/resp_9/cancel", 31, &id);
    CHECK(n == 6 && memcmp(id, "resp_9", 6) == 0);
    CHECK(kv_api_response_id("/v1/responses", 13, &id) == 0);
    CHECK(kv_api_response_id("/v1/responses/", 14, &id) == 0);
    CHECK(kv_api_response_id("/v1/chat/completions", 20, &id) == 0);
}

int main(void)
{
    RUN(response_id_of_path);
    RUN(session_hints);
    RUN(text_prompt_and_fields);
    RUN(unicode_escapes);
    RUN(id_prompts);
    RUN(id_arrays_every_spacing);
    RUN(id_digits_then_every_byte);
    RUN(messages_span);
    RUN(malformed_rejected);
    RUN(deep_nesting_refused);
    RUN(no_prompt);
    RUN(model_alone);
    RUN(sequences);
    RUN(batch_counted);
    RUN(duplicates_last_wins);
    RUN(sglang_generate);
    RUN(responses_messages);
    RUN(api_of_path);
    RUN(pooling_requests);
    return kvt_done();
}
