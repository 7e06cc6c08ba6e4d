/*
 * The monotonic clock in milliseconds, for deadlines and ages that must not
 * jump with the wall clock (NTP steps, an operator's date). One definition,
 * so every layer measures ages the same way.
 */
#ifndef KV_CLOCK_H
#define KV_CLOCK_H

#include <stdint.h>
#include <time.h>

static inline uint64_t kv_clock_ms(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t) ts.tv_sec * 1000 + (uint64_t) ts.tv_nsec / 1000000;
}

static inline uint64_t kv_clock_us(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t) ts.tv_sec * 1000000 + (uint64_t) ts.tv_nsec / 1000;
}

#endif
