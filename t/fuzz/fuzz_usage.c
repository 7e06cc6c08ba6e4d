/* libFuzzer target: the response scanners (kv_usage, kv_preamble, kv_sse,
 * kv_respid). Any
 * bytes, fed whole or split at any point, give the same answer and never
 * crash. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_preamble.h"
#include "kv_respid.h"
#include "kv_sse.h"
#include "kv_usage.h"

static void preamble(const uint8_t *data, size_t size, size_t cut)
{
    kv_preamble_t  a, b;
    int            whole, split;

    kv_preamble_init(&a);
    whole = kv_preamble_feed(&a, (const char *) data, size);
    kv_preamble_init(&b);
    split = kv_preamble_feed(&b, (const char *) data, cut);
    split = kv_preamble_feed(&b, (const char *) data + cut, size - cut) || split;
    if (whole != split) {
        abort();
    }
}

static void sse(const uint8_t *data, size_t size, size_t cut)
{
    kv_sse_count_t  a, b;

    kv_sse_count_init(&a);
    kv_sse_count_feed(&a, (const char *) data, size);
    kv_sse_count_init(&b);
    kv_sse_count_feed(&b, (const char *) data, cut);
    kv_sse_count_feed(&b, (const char *) data + cut, size - cut);
    if (a.events != b.events || a.events > size / 2) {
        abort();
    }
}

static void respid(const uint8_t *data, size_t size, size_t cut)
{
    kv_respid_scan_t  a, b;
    int               whole, split;

    kv_respid_init(&a);
    whole = kv_respid_feed(&a, (const char *) data, size);
    kv_respid_init(&b);
    split = kv_respid_feed(&b, (const char *) data, cut);
    if (split == 0) {
        split = kv_respid_feed(&b, (const char *) data + cut, size - cut);
    }
    if (whole != split || (whole == 1 && (a.len != b.len || a.len == 0 || a.len > KV_RESPID_MAX
                                          || memcmp(a.id, b.id, a.len) != 0)))
    {
        abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kv_usage_scan_t  a, b;
    size_t           cut = size ? data[0] % (size + 1) : 0;

    kv_usage_init(&a);
    kv_usage_feed(&a, (const char *) data, size);
    kv_usage_end(&a);

    kv_usage_init(&b);
    kv_usage_feed(&b, (const char *) data, cut);
    kv_usage_feed(&b, (const char *) data + cut, size - cut);
    kv_usage_end(&b);

    if (a.prompt_tokens != b.prompt_tokens || a.cached_tokens != b.cached_tokens) {
        abort();
    }
    preamble(data, size, cut);
    sse(data, size, cut);
    respid(data, size, cut);
    return 0;
}
