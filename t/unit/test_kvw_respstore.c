/* The Responses API store: continuing a kept response, eviction, refusals. */
#include "kvtest.h"
#include "kvw_respstore.h"

#include <stdlib.h>
#include <string.h>

static json_t *body(const char *json)
{
    return json_loads(json, 0, NULL);
}

/* Keeps the response `id` of body `json`, with output text `out`. */
static void keep(kvw_respstore_t *s, const char *id, const char *json, const char *out)
{
    json_t *doc = body(json);
    kvw_openai_err_t e;

    CHECK(kvw_respstore_expand(s, doc, &e) == 0);
    CHECK(kvw_respstore_put(s, id, kvw_respstore_conversation(s, doc), out, strlen(out),
                            strdup(id)) == 0);
    json_decref(doc);
}

static char *input_of(json_t *doc)
{
    return json_dumps(json_object_get(doc, "input"), JSON_COMPACT);
}

TEST(continuation_is_history_then_output_then_input)
{
    kvw_respstore_t *s = kvw_respstore_new(4);
    kvw_openai_err_t e;
    json_t *doc;
    char *in;

    keep(s, "r1", "{\"input\":\"hi\",\"instructions\":\"be brief\"}", "hello");
    keep(s, "r2", "{\"input\":[{\"role\":\"user\",\"content\":\"more\"}],"
                  "\"previous_response_id\":\"r1\"}", "sure");
    doc = body("{\"input\":\"last\",\"previous_response_id\":\"r2\",\"instructions\":\"x\"}");
    CHECK(kvw_respstore_expand(s, doc, &e) == 0);
    in = input_of(doc);
    /* the first turn's instructions are not carried over; this one's stay a field */
    CHECK_STR(in, "[{\"role\":\"user\",\"content\":\"hi\"},"
                  "{\"role\":\"assistant\",\"content\":\"hello\"},"
                  "{\"role\":\"user\",\"content\":\"more\"},"
                  "{\"role\":\"assistant\",\"content\":\"sure\"},"
                  "{\"role\":\"user\",\"content\":\"last\"}]");
    CHECK(json_object_get(doc, "previous_response_id") == NULL);
    CHECK_STR(json_string_value(json_object_get(doc, "instructions")), "x");
    free(in);
    json_decref(doc);
    kvw_respstore_free(s);
}

TEST(unknown_or_off_is_404_and_bad_type_400)
{
    kvw_respstore_t *s = kvw_respstore_new(2);
    kvw_openai_err_t e;
    json_t *doc = body("{\"input\":\"a\",\"previous_response_id\":\"nope\"}");

    CHECK(kvw_respstore_expand(s, doc, &e) == -1);
    CHECK(e.status == 404);
    CHECK(strstr(e.message, "'nope' not found") != NULL);
    CHECK(kvw_respstore_expand(NULL, doc, &e) == -1 && e.status == 404);
    json_decref(doc);
    doc = body("{\"input\":\"a\",\"previous_response_id\":7}");
    CHECK(kvw_respstore_expand(s, doc, &e) == -1 && e.status == 400);
    json_decref(doc);
    doc = body("{\"input\":\"a\",\"previous_response_id\":null}");
    CHECK(kvw_respstore_expand(NULL, doc, &e) == 0);
    json_decref(doc);
    CHECK(kvw_respstore_new(0) == NULL);
    kvw_respstore_free(s);
}

TEST(store_false_keeps_nothing)
{
    kvw_respstore_t *s = kvw_respstore_new(2);
    json_t *doc = body("{\"input\":\"a\",\"store\":false}");

    CHECK(kvw_respstore_conversation(s, doc) == NULL);
    CHECK(kvw_respstore_conversation(NULL, doc) == NULL);
    json_decref(doc);
    kvw_respstore_free(s);
}

TEST(the_oldest_goes_first)
{
    kvw_respstore_t *s = kvw_respstore_new(3);
    char id[16];

    for (int i = 0; i < 10; i++) {
        snprintf(id, sizeof(id), "r%d", i);
        keep(s, id, "{\"input\":\"a\"}", "b");
    }
    CHECK_EQ_U64(kvw_respstore_count(s), 3);
    for (int i = 0; i < 10; i++) {
        snprintf(id, sizeof(id), "r%d", i);
        CHECK((kvw_respstore_get(s, id) != NULL) == (i >= 7));
        if (i >= 7)
            CHECK_STR(kvw_respstore_get(s, id), id);
    }
    keep(s, "r9", "{\"input\":\"again\"}", "c");       /* the same id again: the newer */
    CHECK(kvw_respstore_get(s, "r9") != NULL);
    keep(s, "x1", "{\"input\":\"a\"}", "b");
    keep(s, "x2", "{\"input\":\"a\"}", "b");
    CHECK(kvw_respstore_get(s, "r9") != NULL);
    CHECK(kvw_respstore_get(s, "r8") == NULL);
    kvw_respstore_free(s);
}

TEST(output_that_is_not_utf8_is_kept_clean)
{
    kvw_respstore_t *s = kvw_respstore_new(1);
    kvw_openai_err_t e;
    json_t *doc = body("{\"input\":\"a\"}");
    char *in;

    CHECK(kvw_respstore_put(s, "r", kvw_respstore_conversation(s, doc), "ok\xff", 3,
                            strdup("{}")) == 0);
    json_decref(doc);
    doc = body("{\"input\":\"b\",\"previous_response_id\":\"r\"}");
    CHECK(kvw_respstore_expand(s, doc, &e) == 0);
    in = input_of(doc);
    CHECK(strstr(in, "\"ok\\ufffd\"") != NULL || strstr(in, "ok\xef\xbf\xbd") != NULL);
    free(in);
    json_decref(doc);
    kvw_respstore_free(s);
}

int main(void)
{
    RUN(continuation_is_history_then_output_then_input);
    RUN(unknown_or_off_is_404_and_bad_type_400);
    RUN(store_false_keeps_nothing);
    RUN(the_oldest_goes_first);
    RUN(output_that_is_not_utf8_is_kept_clean);
    return kvt_done();
}
