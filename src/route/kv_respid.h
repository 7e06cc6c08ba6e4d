/*
 * The id of a Responses API response, found while its body streams past:
 * the value of the body's first `"id"` key. A Response object starts with
 * it (`{"id":"resp_...",...}`), and a streamed one's first event,
 * response.created, carries the Response ahead of any output
 * (`data: {"response":{"id":"resp_...` in vLLM's field order, or after
 * "type" and "sequence_number" in others'); an output item's own id
 * (msg_...) always comes later.
 *
 * Keys only, as kv_usage.h: the same letters inside a JSON string are
 * escaped (\"id\") and a key is followed by ':'. An id with an escape, a
 * control byte, or longer than KV_RESPID_MAX is not read (no engine makes
 * one), and the scan gives up after KV_RESPID_SCAN bytes without one, so
 * it costs nothing on a long answer.
 */
#ifndef KV_RESPID_H
#define KV_RESPID_H

#include <stddef.h>
#include <stdint.h>

#define KV_RESPID_MAX   256
#define KV_RESPID_SCAN  16384

typedef struct {
    uint8_t     phase;
    uint8_t     pos;            /* letters of "id" matched */
    uint16_t    len;            /* of id */
    uint32_t    seen;           /* bytes scanned */
    char        id[KV_RESPID_MAX];
} kv_respid_scan_t;

void kv_respid_init(kv_respid_scan_t *s);
/* Scans p[0..n). 1: the id is in s->id[0..s->len); -1: no id will be
 * found; 0: more of the body is needed. Once not 0, it stays so. */
int  kv_respid_feed(kv_respid_scan_t *s, const char *p, size_t n);

#endif
