/*
 * How many events a server-sent event stream carried, fed in pieces of any
 * size: an event ends at a blank line ("\n\n", "\r\n\r\n", or mixed), and
 * further blank lines end nothing (the SSE rules dispatch no empty event).
 *
 * The router learns a server's decode pace from a stream's time after its
 * first byte over the tokens it made. max_tokens says how many a request
 * could make; a stream that stopped early (end of sequence, a stop string)
 * made fewer, and counting max_tokens taught a pace as many times too fast
 * (a chat asking for 4,096 that answers in 300: 13x). Engines stream one
 * token an event by default (one delta a step), so the
 * events bound what was made; the router takes the smaller of the two.
 */
#ifndef KV_SSE_H
#define KV_SSE_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint64_t    events;
    uint8_t     state;      /* 0: in a line; 1: a line ended; 2: an event ended */
} kv_sse_count_t;

void kv_sse_count_init(kv_sse_count_t *c);
void kv_sse_count_feed(kv_sse_count_t *c, const char *p, size_t n);

#endif
