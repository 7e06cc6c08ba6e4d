/*
 * A small pull scanner for the JSON of heartbeats and dumps.
 *
 * Why not jansson: ids and hashes are full unsigned 64-bit integers, which
 * jansson rejects above INT64_MAX. The scanner reads them exactly (and
 * bit-casts negative ones, as docs/PROTOCOL.md asks), never allocates and
 * bounds its nesting, so bad input fails cleanly.
 */
#ifndef KV_JSCAN_H
#define KV_JSCAN_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    const char *p, *end;
    int         err;        /* sticky: set by the first failure */
} kv_jscan_t;

void kv_jscan_init(kv_jscan_t *s, const char *buf, size_t len);
/* Next non-space byte without consuming it; 0 at the end. */
int  kv_jscan_peek(kv_jscan_t *s);
/* Consumes c (after spaces) or fails. */
int  kv_jscan_expect(kv_jscan_t *s, char c);
/* Consumes c if it is next; 1 if it was. */
int  kv_jscan_accept(kv_jscan_t *s, char c);
/* A string into out (NUL-terminated, truncated to cap; escapes kept as
 * their escaped character, \uXXXX as '?'). */
int  kv_jscan_string(kv_jscan_t *s, char *out, size_t cap);
/* An integer as u64 (negative: two's complement); fractions fail. */
int  kv_jscan_u64(kv_jscan_t *s, uint64_t *v);
/* null: 1 (consumed), else 0 and nothing consumed. */
int  kv_jscan_null(kv_jscan_t *s);
/* Skips any value (depth-limited). */
int  kv_jscan_skip(kv_jscan_t *s);
/* Iterates an object's keys: after consuming '{', set first = 1 and call
 * until it returns 0 (the closing '}' consumed); 1: "key": read, now read
 * or skip the value; -1 on error. */
int  kv_jscan_key(kv_jscan_t *s, int *first, char *key, size_t cap);

#endif
