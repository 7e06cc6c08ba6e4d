/* Counting a server-sent event stream's events (kv_sse.h), fed whole and
 * in every split. */
#include "kvtest.h"
#include "kv_sse.h"

static uint64_t count(const char *s, size_t cut)
{
    kv_sse_count_t c;

    kv_sse_count_init(&c);
    kv_sse_count_feed(&c, s, cut);
    kv_sse_count_feed(&c, s + cut, strlen(s) - cut);
    return c.events;
}

/* every way of cutting s in two gives n */
static int always(const char *s, uint64_t n)
{
    size_t cut;

    for (cut = 0; cut <= strlen(s); cut++) {
        if (count(s, cut) != n)
            return 0;
    }
    return 1;
}

TEST(events_end_at_blank_lines)
{
    CHECK(always("data: {\"a\":1}\n\ndata: {\"b\":2}\n\ndata: [DONE]\n\n", 3));
    CHECK(always("data: a\r\n\r\ndata: b\r\n\r\n", 2));
    CHECK(always("data: a\n\r\ndata: b\r\n\n", 2));
    /* an event: line and a data: line are one event */
    CHECK(always("event: response.created\ndata: {}\n\nevent: x\ndata: {}\n\n", 2));
    /* not ended yet */
    CHECK(always("data: a\n\ndata: b\n", 1));
    CHECK(always("data: a\n\ndata: b", 1));
}

TEST(blank_lines_alone_end_nothing)
{
    CHECK(always("\n\n\r\n", 0));
    CHECK(always("data: a\n\n\n\n\r\n\ndata: b\n\n", 2));
    CHECK(always("", 0));
    /* a CR inside a line is content */
    CHECK(always("data: a\rb\n\n", 1));
}

TEST(byte_by_byte)
{
    const char    *s = "data: x\r\n\r\n\r\ndata: y\n\ndata: [DONE]\n\n";
    kv_sse_count_t c;
    size_t         i;

    kv_sse_count_init(&c);
    for (i = 0; s[i]; i++)
        kv_sse_count_feed(&c, s + i, 1);
    CHECK_EQ_U64(c.events, 3);
}

int main(void)
{
    RUN(events_end_at_blank_lines);
    RUN(blank_lines_alone_end_nothing);
    RUN(byte_by_byte);
    return kvt_done();
}
