/*
 * The mock engine: no model, only time. Each request waits the predicted
 * prefill time, then emits max_tokens tokens at the predicted decode step
 * time, using Dynamo's polynomial perf model divided by --speedup.
 */
#include <stdlib.h>
#include <string.h>

#include "kvw_engine.h"

typedef struct {
    kvw_engine_t    base;
} kvw_mock_t;

typedef struct {
    kvw_req_t      *req;
    struct event   *timer;
    int             emitted;
} kvw_mock_req_t;

static const char *const words[] = {
    " the", " quick", " brown", " fox", " jumps", " over", " a", " lazy", " dog", ".",
};

static double prefill_ms(size_t tokens)
{
    double t = (double)tokens;
    return 4.209989e-07 * t * t + 1.518344e-02 * t + 1.650142e+01;
}

static double decode_ms(void)
{
    return 5.74;     /* p = 0: an idle engine */
}

static struct timeval ms_to_tv(double ms, double speedup)
{
    long us = (long)(ms * 1000.0 / (speedup > 0 ? speedup : 1.0));
    struct timeval tv = { us / 1000000, us % 1000000 };
    return tv;
}

static void on_step(evutil_socket_t fd, short what, void *arg)
{
    kvw_mock_req_t *m = arg;
    kvw_req_t *r = m->req;
    const kvw_config_t *cfg = r->engine->cfg;
    size_t w = (size_t)m->emitted % (sizeof(words) / sizeof(words[0]));

    kvw_req_emit(r, (uint32_t)w, words[w], strlen(words[w]));
    if (++m->emitted >= r->max_tokens) {
        event_free(m->timer);
        r->engine_data = NULL;
        free(m);
        kvw_req_finish(r, KVW_FINISH_LENGTH);
        return;
    }
    struct timeval tv = ms_to_tv(decode_ms(), cfg->speedup);
    evtimer_add(m->timer, &tv);
}

static int mock_submit(kvw_engine_t *e, kvw_req_t *r)
{
    kvw_mock_req_t *m = calloc(1, sizeof(*m));

    if (m == NULL)
        return -1;
    m->req = r;
    m->timer = evtimer_new(e->base, on_step, m);
    if (m->timer == NULL) {
        free(m);
        return -1;
    }
    r->engine_data = m;
    struct timeval tv = ms_to_tv(prefill_ms(r->n_prompt), e->cfg->speedup);
    evtimer_add(m->timer, &tv);
    return 0;
}

static void mock_cancel(kvw_engine_t *e, kvw_req_t *r)
{
    kvw_mock_req_t *m = r->engine_data;

    if (m) {
        event_free(m->timer);
        free(m);
        r->engine_data = NULL;
    }
}

static void mock_destroy(kvw_engine_t *e)
{
    free(e);
}

static const kvw_engine_ops_t mock_ops = {
    .name = "mock",
    .submit = mock_submit,
    .cancel = mock_cancel,
    .destroy = mock_destroy,
};

kvw_engine_t *kvw_mock_create(const kvw_config_t *cfg, struct event_base *base, int index)
{
    kvw_mock_t *m = calloc(1, sizeof(*m));

    if (m == NULL)
        return NULL;
    m->base.ops = &mock_ops;
    m->base.cfg = cfg;
    m->base.base = base;
    m->base.index = index;
    m->base.port = cfg->port + index;
    return &m->base;
}
