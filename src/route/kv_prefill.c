/* The prefill half of a disaggregated decision (see kv_prefill.h). */
#include <string.h>

#include "kv_prefill.h"

void kv_prefill_config_init(kv_prefill_config_t *pc)
{
    pc->min_tokens = KV_PREFILL_MIN_TOKENS;
}

const char *kv_prefill_why_name(kv_prefill_why_t why)
{
    static const char *names[] = { "remote", "short", "none", "busy" };

    return (unsigned) why < sizeof(names) / sizeof(names[0]) ? names[why] : "";
}

int kv_prefill_pick(kv_route_server_t *s, size_t n, const kv_route_request_t *rq,
                    uint32_t decode_overlap, const kv_prefill_config_t *pc,
                    const kv_route_config_t *cfg, uint64_t rnd, kv_prefill_result_t *out)
{
    uint32_t           bs = cfg->block_size ? cfg->block_size : 16;
    uint64_t           cached = (uint64_t) decode_overlap * bs;
    kv_route_config_t  c = *cfg;
    size_t             i;

    memset(out, 0, sizeof(*out));
    out->route.pick = KV_ROUTE_NONE;
    out->uncached_local = rq->prompt_tokens > cached ? rq->prompt_tokens - cached : 0;

    if (out->uncached_local <= pc->min_tokens) {
        out->why = KV_PREFILL_LOCAL_SHORT;
        return -1;
    }

    /* a prefill worker decodes nothing: its estimate is the ttft alone */
    c.decode_pace = 0;
    c.max_tokens = 1;
    for (i = 0; i < n; i++) {
        s[i].decode_pace = 0;
    }

    (void) kv_route_pick(s, n, rq, &c, rnd, &out->route);

    if (out->route.pick == KV_ROUTE_BUSY) {
        out->why = KV_PREFILL_LOCAL_BUSY;
        return -1;
    }
    if (out->route.pick < 0) {
        out->why = KV_PREFILL_LOCAL_NONE;
        return -1;
    }
    /* it holds the blocks only until the decode worker has them */
    out->route.decode_blocks = 0;
    out->route.decode_tokens = 0;
    out->why = KV_PREFILL_REMOTE;
    return out->route.pick;
}
