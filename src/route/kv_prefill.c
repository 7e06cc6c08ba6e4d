/* The prefill half of a disaggregated decision (see kv_prefill.h). */
#include <string.h>

#include "kv_prefill.h"

void kv_prefill_config_init(kv_prefill_config_t *pc)
{
    pc->min_tokens = KV_PREFILL_MIN_TOKENS;
    pc->conditional = 1;
    pc->stall_weight = KV_PREFILL_STALL_WEIGHT;
    pc->margin = KV_PREFILL_MARGIN;
    pc->xfer_ms_per_token = 0;
}

const char *kv_prefill_why_name(kv_prefill_why_t why)
{
    static const char *names[] = { "remote", "short", "none", "busy", "faster" };

    return (unsigned) why < sizeof(names) / sizeof(names[0]) ? names[why] : "";
}

static uint32_t weight_of(const kv_route_server_t *s)
{
    return s->weight ? s->weight : 1;
}

/*
 * Rule 4's local estimate at decode worker d: its learned line, or, if it
 * has never prefilled for this router, the prefill pool's mean measured
 * server (the same engines; per unit of weight), or the configured rate.
 * Sets *rate and *base; the queue and the uncached part are the caller's.
 */
static void decode_line(const kv_route_server_t *d, const kv_route_server_t *s, size_t n,
                        double fallback_rate, double *rate, double *base)
{
    double  r = 0, b = 0;
    size_t  i, m = 0;

    if (d->prefill_rate > 0) {
        *rate = d->prefill_rate;
        *base = d->prefill_base;
        return;
    }
    for (i = 0; i < n; i++) {
        if (s[i].usable && s[i].prefill_rate > 0) {
            r += s[i].prefill_rate / weight_of(&s[i]);
            b += s[i].prefill_base;
            m++;
        }
    }
    *rate = (m ? r / m : fallback_rate) * weight_of(d);
    *base = m ? b / m : 0;
}

int kv_prefill_pick(kv_route_server_t *s, size_t n, const kv_route_request_t *rq,
                    const kv_route_server_t *d, const kv_prefill_config_t *pc,
                    const kv_route_config_t *dcfg, const kv_route_config_t *cfg,
                    uint64_t rnd, kv_prefill_result_t *out)
{
    uint32_t           bs = cfg->block_size ? cfg->block_size : 16;
    uint64_t           cached = d ? (uint64_t) kv_route_overlap(d) * bs : 0;
    kv_route_config_t  c = *cfg;
    double             rate, base, own;
    size_t             i;

    memset(out, 0, sizeof(*out));
    out->route.pick = KV_ROUTE_NONE;
    out->uncached_local = (rq->prompt_tokens > cached ? rq->prompt_tokens - cached : 0)
                          + rq->batch_tokens;

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

    if (pc->conditional && d != NULL) {
        decode_line(d, s, n, (dcfg ? dcfg : cfg)->prefill_rate, &rate, &base);
        own = (double) out->uncached_local / rate;

        out->xfer_ms = pc->xfer_ms_per_token * (double) out->uncached_local;
        out->remote_ms = out->route.estimate + out->xfer_ms;
        /* its queue as kv_route_pick weighed it (with worker_load=max, what
         * other routers sent there too), as the remote side's is */
        out->local_ttft_ms = base
                             + (double) kv_route_prefill_load(d, dcfg ? dcfg : cfg) / rate
                             + own;
        out->local_ms = out->local_ttft_ms
                        + pc->stall_weight * (double) d->requests * own;

        if (out->local_ms * (1 + pc->margin) < out->remote_ms) {
            out->why = KV_PREFILL_LOCAL_FASTER;
            out->route.pick = KV_ROUTE_NONE;
            return -1;
        }
    }

    /* it holds the blocks only until the decode worker has them */
    out->route.decode_blocks = 0;
    out->route.decode_tokens = 0;
    out->why = KV_PREFILL_REMOTE;
    return out->route.pick;
}
