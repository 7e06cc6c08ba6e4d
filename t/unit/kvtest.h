/*
 * A minimal unit-test harness. Each test is a function; a test fails if any
 * CHECK in it fails. Output is one line per test, "ok NAME" or "not ok NAME",
 * which t/run.py counts, then "N passed, N failed".
 *
 *   TEST(adds) { CHECK(1 + 1 == 2); CHECK_EQ_U64(x, 3); }
 *   int main(void) { RUN(adds); return kvt_done(); }
 */
#ifndef KVTEST_H
#define KVTEST_H

#include <inttypes.h>
#include <stdio.h>
#include <string.h>

static int kvt_test_failed, kvt_passed, kvt_failed;

#define TEST(name) static void name(void)

#define CHECK(cond)                                                         \
    do {                                                                    \
        if (!(cond)) {                                                      \
            fprintf(stderr, "  %s:%d: CHECK(%s) failed\n", __FILE__,        \
                    __LINE__, #cond);                                       \
            kvt_test_failed = 1;                                            \
        }                                                                   \
    } while (0)

#define CHECK_EQ_U64(a, b)                                                  \
    do {                                                                    \
        uint64_t a_ = (uint64_t)(a), b_ = (uint64_t)(b);                    \
        if (a_ != b_) {                                                     \
            fprintf(stderr, "  %s:%d: %s == %" PRIu64 ", expected %"        \
                    PRIu64 "\n", __FILE__, __LINE__, #a, a_, b_);           \
            kvt_test_failed = 1;                                            \
        }                                                                   \
    } while (0)

#define CHECK_STR(a, b)                                                     \
    do {                                                                    \
        const char *a_ = (a), *b_ = (b);                                    \
        if (a_ == NULL || b_ == NULL || strcmp(a_, b_) != 0) {              \
            fprintf(stderr, "  %s:%d: %s == \"%s\", expected \"%s\"\n",     \
                    __FILE__, __LINE__, #a, a_ ? a_ : "(null)",             \
                    b_ ? b_ : "(null)");                                    \
            kvt_test_failed = 1;                                            \
        }                                                                   \
    } while (0)

#define RUN(name)                                                           \
    do {                                                                    \
        kvt_test_failed = 0;                                                \
        name();                                                             \
        printf("%s %s\n", kvt_test_failed ? "not ok" : "ok", #name);        \
        fflush(stdout);                                                     \
        if (kvt_test_failed) kvt_failed++; else kvt_passed++;               \
    } while (0)

static inline int kvt_done(void)
{
    printf("%d passed, %d failed\n", kvt_passed, kvt_failed);
    return kvt_failed != 0;
}

#endif
