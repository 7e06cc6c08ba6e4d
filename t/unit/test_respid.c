/* kv_respid: a Responses API response's id, read from a JSON body or an SSE
 * stream split anywhere, and not faked by the same letters in text. */
#include <stdlib.h>

#include "kv_respid.h"
#include "kvtest.h"

/* Feeds s split at every position, and byte by byte: same answer.
 * want NULL: no id. */
static void scan_all_splits(const char *s, const char *want)
{
    size_t n = strlen(s);

    for (size_t cut = 0; cut <= n + 1; cut++) {
        kv_respid_scan_t r;
        int              rc;

        kv_respid_init(&r);
        if (cut <= n) {
            rc = kv_respid_feed(&r, s, cut);
            if (rc == 0)
                rc = kv_respid_feed(&r, s + cut, n - cut);
        } else {
            rc = 0;
            for (size_t k = 0; k < n && rc == 0; k++)
                rc = kv_respid_feed(&r, s + k, 1);
        }
        if (want) {
            CHECK(rc == 1);
            CHECK(r.len == strlen(want) && memcmp(r.id, want, r.len) == 0);
        } else {
            CHECK(rc != 1);
        }
    }
}

TEST(response_object)
{
    scan_all_splits("{\"id\":\"resp_3f2a\",\"object\":\"response\",\"output\":[{\"type\":"
                    "\"message\",\"id\":\"msg_1\"}]}", "resp_3f2a");
    scan_all_splits("{ \"id\" :\n \"resp_x\" }", "resp_x");
}

/* vLLM's event puts the response first; kvworker's after type and number */
TEST(stream_first_event)
{
    scan_all_splits("event: response.created\ndata: {\"response\":{\"id\":\"resp_9\","
                    "\"status\":\"in_progress\"},\"sequence_number\":0,\"type\":"
                    "\"response.created\"}\n\n", "resp_9");
    scan_all_splits("data: {\"type\":\"response.created\",\"sequence_number\":0,"
                    "\"response\":{\"id\":\"resp_7\",\"output\":[]}}\n\n"
                    "data: {\"type\":\"response.output_text.delta\",\"item_id\":\"msg_7\"}\n\n",
                    "resp_7");
}

/* an "id" key inside text is escaped; a value with an escape is not read */
TEST(not_fooled_by_text)
{
    scan_all_splits("{\"text\":\"say \\\"id\\\": \\\"resp_fake\\\"\",\"id\":\"resp_real\"}",
                    "resp_real");
    scan_all_splits("{\"id\":\"resp_\\u0041\"}", NULL);
    scan_all_splits("{\"id\":\"\"}", NULL);
    scan_all_splits("{\"ids\":\"a\",\"xid\":\"b\",\"id\":7,\"id\":\"c\"}", "c");
    scan_all_splits("{\"object\":\"response\"}", NULL);
}

/* too long an id, or none within the scan's reach: given up on */
TEST(bounds)
{
    char   *big = malloc(KV_RESPID_SCAN + 64);
    char    id[KV_RESPID_MAX + 16];
    char    body[KV_RESPID_MAX + 64];
    size_t  n;

    memset(id, 'a', sizeof(id) - 1);
    id[sizeof(id) - 1] = '\0';
    snprintf(body, sizeof(body), "{\"id\":\"%s\"}", id);
    scan_all_splits(body, NULL);
    id[KV_RESPID_MAX] = '\0';
    snprintf(body, sizeof(body), "{\"id\":\"%s\"}", id);
    scan_all_splits(body, id);

    n = (size_t) snprintf(big, 32, "{\"text\":\"");
    memset(big + n, 'x', KV_RESPID_SCAN);
    strcpy(big + n + KV_RESPID_SCAN, "\",\"id\":\"resp_late\"}");
    {
        kv_respid_scan_t r;

        kv_respid_init(&r);
        CHECK(kv_respid_feed(&r, big, strlen(big)) == -1);
        CHECK(kv_respid_feed(&r, "{\"id\":\"x\"}", 10) == -1);     /* stays given up */
    }
    free(big);
}

int main(void)
{
    RUN(response_object);
    RUN(stream_first_event);
    RUN(not_fooled_by_text);
    RUN(bounds);
    return kvt_done();
}
