/* kv_jscan, the one JSON reader: exact u64, negatives bit-cast, bad input
 * fails cleanly, and one nesting bound for every reader built on it. */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "kv_body.h"
#include "kv_jscan.h"
#include "kv_tree.h"
#include "kvtest.h"

static int scan_u64(const char *s, uint64_t *v)
{
    kv_jscan_t j;
    kv_jscan_init(&j, s, strlen(s));
    return kv_jscan_u64(&j, v);
}

TEST(u64_full_range_and_negative)
{
    uint64_t v;
    CHECK(scan_u64("18446744073709551615", &v) == 0);
    CHECK_EQ_U64(v, UINT64_MAX);
    CHECK(scan_u64("18446744073709551616", &v) < 0);    /* overflow */
    CHECK(scan_u64("-1", &v) == 0);
    CHECK_EQ_U64(v, UINT64_MAX);
    CHECK(scan_u64("-9223372036854775808", &v) == 0);
    CHECK_EQ_U64(v, 1ull << 63);
    CHECK(scan_u64("-9223372036854775809", &v) < 0);
    CHECK(scan_u64("1.5", &v) < 0);
    CHECK(scan_u64("x", &v) < 0);
    CHECK(scan_u64("", &v) < 0);
}

TEST(object_keys_and_skip)
{
    const char *s = "{\"a\": [1, {\"x\": \"y\\\"z\"}, null, true], \"b\" :\"h\\u00e9\", \"c\": 7}";
    kv_jscan_t j;
    char key[16], str[16];
    int first = 1;
    uint64_t c = 0;
    kv_jscan_init(&j, s, strlen(s));
    CHECK(kv_jscan_expect(&j, '{') == 0);
    CHECK(kv_jscan_key(&j, &first, key, sizeof(key)) == 1);
    CHECK_STR(key, "a");
    CHECK(kv_jscan_skip(&j) == 0);
    CHECK(kv_jscan_key(&j, &first, key, sizeof(key)) == 1);
    CHECK_STR(key, "b");
    CHECK(kv_jscan_string(&j, str, sizeof(str)) == 0);
    CHECK_STR(str, "h\xc3\xa9");
    CHECK(kv_jscan_key(&j, &first, key, sizeof(key)) == 1);
    CHECK(kv_jscan_u64(&j, &c) == 0);
    CHECK_EQ_U64(c, 7);
    CHECK(kv_jscan_key(&j, &first, key, sizeof(key)) == 0);
}

TEST(bad_input_fails_without_crash)
{
    const char *bad[] = {"{", "{\"a\"", "{\"a\":", "[[[[", "\"abc", "{\"a\":1,}", "{\"a\" 1}",
                         "\"\\", "\"\\u12\""};
    for (size_t k = 0; k < sizeof(bad) / sizeof(bad[0]); k++) {
        kv_jscan_t j;
        kv_jscan_init(&j, bad[k], strlen(bad[k]));
        CHECK(kv_jscan_skip(&j) < 0 || kv_jscan_peek(&j) == 0);
    }
    /* nesting beyond the bound fails instead of recursing forever */
    size_t n = 100000;
    char *deep = malloc(n + 1);
    memset(deep, '[', n);
    deep[n] = '\0';
    kv_jscan_t j;
    kv_jscan_init(&j, deep, n);
    CHECK(kv_jscan_skip(&j) < 0);
    free(deep);
}

static char *nested(int depth)
{
    char *s = malloc((size_t)depth * 2 + 16), *p = s;
    p += sprintf(p, "{\"x\":");
    for (int i = 0; i < depth - 1; i++)
        *p++ = '[';
    for (int i = 0; i < depth - 1; i++)
        *p++ = ']';
    strcpy(p, "}");
    return s;
}

/* KV_JSON_MAX_DEPTH containers deep is read by all three users; one more is
 * refused by all three. */
TEST(one_depth_bound)
{
    for (int extra = 0; extra <= 1; extra++) {
        char *doc = nested(KV_JSON_MAX_DEPTH + extra), err[128];
        size_t n = strlen(doc);
        kv_jscan_t j;
        kv_tree_t t = {0};
        kv_body_t b;
        int want = extra ? -1 : 0;

        kv_jscan_init(&j, doc, n);
        CHECK((kv_jscan_skip(&j) < 0 ? -1 : 0) == want);
        CHECK(kv_tree_json(&t, doc, n, err, sizeof(err)) == want);
        CHECK(kv_body_parse(&b, doc, n, err, sizeof(err)) == want);
        if (extra)
            CHECK(strstr(err, "nested deeper") != NULL);
        kv_body_free(&b);
        kv_tree_free(&t);
        free(doc);
    }
}

typedef struct {
    uint64_t  id;
    char      name[8];
    struct {
        uint64_t  n;
    } inner;
} rec_t;

static const kv_jfield_t inner_fields[] = {
    { "n", KV_JF_U64, 0, 0, NULL },
    { NULL, 0, 0, 0, NULL }
};

static const kv_jfield_t rec_fields[] = {
    { "id", KV_JF_U64, offsetof(rec_t, id), 0, NULL },
    { "name", KV_JF_STRING, offsetof(rec_t, name), 8, NULL },
    { "inner", KV_JF_OBJECT, offsetof(rec_t, inner), 0, inner_fields },
    { "flag", KV_JF_SKIP, 0, 0, NULL },
    { NULL, 0, 0, 0, NULL }
};

static int scan_rec(const char *s, rec_t *r, uint32_t *seen)
{
    kv_jscan_t j;
    memset(r, 0, sizeof(*r));
    *seen = 0;
    kv_jscan_init(&j, s, strlen(s));
    return kv_jscan_fields(&j, rec_fields, r, seen);
}

TEST(object_read_by_table)
{
    rec_t r;
    uint32_t seen;
    CHECK(scan_rec("{\"x\":[1,{}],\"id\":18446744073709551615,\"name\":\"abcdefghij\","
                   "\"inner\":{\"n\":7,\"z\":null},\"flag\":{\"deep\":[true]}}", &r, &seen) == 0);
    CHECK_EQ_U64(r.id, UINT64_MAX);
    CHECK(strcmp(r.name, "abcdefg") == 0);          /* truncated, terminated */
    CHECK_EQ_U64(r.inner.n, 7);
    CHECK_EQ_U64(seen, 0xf);
    CHECK(scan_rec("{\"name\":\"a\"}", &r, &seen) == 0);
    CHECK_EQ_U64(seen, 2);                          /* only name present */
    CHECK(scan_rec("{\"id\":\"1\"}", &r, &seen) < 0);  /* wrong type */
    CHECK(scan_rec("{\"inner\":[]}", &r, &seen) < 0);
    CHECK(scan_rec("{\"id\":1", &r, &seen) < 0);        /* unclosed */
    CHECK(scan_rec("[]", &r, &seen) < 0);
}

int main(void)
{
    RUN(u64_full_range_and_negative);
    RUN(object_keys_and_skip);
    RUN(bad_input_fails_without_crash);
    RUN(one_depth_bound);
    RUN(object_read_by_table);
    return kvt_done();
}
