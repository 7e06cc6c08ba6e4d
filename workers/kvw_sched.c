#include "kvw_sched.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kv_hash.h"
#include "kv_clock.h"
#include "kvw_text.h"

/* A request as the scheduler sees it. */
typedef struct sreq {
    kvw_req_t          *req;        /* NULL once cancelled */
    struct sreq        *prev, *next;
    int                 queue;      /* Q_NONE, Q_WAITING, Q_RUNNING */
    uint32_t           *tokens;     /* prompt, then generated tokens */
    size_t              n_tokens, cap;
    size_t              n_computed; /* tokens whose KV is in the cache */
    size_t              n_out;
    int                 decoding;   /* prompt (and any recompute) done */
    int                 in_batch;
    int                 admitted_once;
    int                 given;      /* tokens[req->n_prompt], sampled by a prefill worker, not yet delivered */
    uint64_t            submit_us;      /* when the engine was given it */
    kvw_seq_blocks_t    blocks;
    kvw_seq_blocks_t    pin;        /* transferred blocks held until admission (kvw_xfer.h) */
    uint64_t            seed;       /* local hash seed (cache salt) */
    uint64_t            rng;
    char               *text;       /* output text, kept while stop strings may match */
    size_t              text_len, text_cap, text_sent;
    struct stopm       *stops;      /* one matcher per stop string */
    size_t              n_stops;
} sreq_t;

/*
 * Stop strings are matched incrementally (Knuth-Morris-Pratt): each matcher
 * keeps how much of its string the output currently ends with, so a new
 * byte costs O(1) amortized per stop string, whatever their lengths (the
 * old rescan cost their total length on every token: four 4 MB stops made
 * 200 tokens take 10 times longer). The state is also exactly how many
 * bytes must be held back from streaming.
 */
typedef struct stopm {
    const char *str;
    size_t      len;
    uint32_t   *fail;       /* fail[k]: longest proper border of str[0..k] */
    size_t      state;      /* output ends with str[0..state) */
} stopm_t;

enum { Q_NONE, Q_WAITING, Q_RUNNING };

typedef struct {
    sreq_t     *head, *tail;
    uint32_t    n;
} queue_t;

typedef struct {
    sreq_t     *s;
    uint32_t    n;
    int         sample;
} item_t;

#define CATCH_UP_US  50000     /* how far behind a simulated step schedule may run */

typedef struct {
    kvw_engine_t        base;
    kvw_backend_t      *be;
    kvw_blocks_t       *bm;
    const kvw_text_t   *text;
    queue_t             waiting, running;
    struct event       *kick;       /* schedule soon: batches submits of one loop turn */
    struct event       *done;       /* the step's time is up */
    item_t             *batch;
    kvw_step_seq_t     *seqs;
    uint32_t            n_batch, batch_cap;
    int                 busy;       /* a step is in flight */
    uint64_t            due_us;     /* when the in-flight step ends (simulated) */
    size_t              max_len;    /* longest sequence this engine can ever hold */
    kvw_step_hook_fn    hook;
    void               *hook_ctx;
    uint32_t            n_given;    /* requests with a given token to deliver (at least) */
    kvw_sched_load_t    st;
} sched_t;

/* --- queues --------------------------------------------------------------- */

static void q_remove(queue_t *q, sreq_t *s)
{
    if (s->prev) s->prev->next = s->next; else q->head = s->next;
    if (s->next) s->next->prev = s->prev; else q->tail = s->prev;
    s->prev = s->next = NULL;
    q->n--;
}

static void q_push_back(queue_t *q, sreq_t *s)
{
    s->next = NULL;
    s->prev = q->tail;
    if (q->tail) q->tail->next = s; else q->head = s;
    q->tail = s;
    q->n++;
}

static void q_push_front(queue_t *q, sreq_t *s)
{
    s->prev = NULL;
    s->next = q->head;
    if (q->head) q->head->prev = s; else q->tail = s;
    q->head = s;
    q->n++;
}

/* s goes right after `after` (at the front if NULL). */
static void q_insert_after(queue_t *q, sreq_t *after, sreq_t *s)
{
    if (after == NULL) {
        q_push_front(q, s);
        return;
    }
    s->prev = after;
    s->next = after->next;
    if (after->next) after->next->prev = s; else q->tail = s;
    after->next = s;
    q->n++;
}

static void unqueue(sched_t *sc, sreq_t *s)
{
    if (s->queue == Q_WAITING)
        q_remove(&sc->waiting, s);
    else if (s->queue == Q_RUNNING)
        q_remove(&sc->running, s);
    s->queue = Q_NONE;
}

static void sreq_free(sreq_t *s)
{
    for (size_t i = 0; i < s->n_stops; i++)
        free(s->stops[i].fail);
    free(s->stops);
    free(s->tokens);
    free(s->text);
    free(s);
}

static int stops_init(sreq_t *s, const kvw_req_t *r)
{
    if (r->n_stop == 0)
        return 0;
    s->stops = calloc(r->n_stop, sizeof(*s->stops));
    if (s->stops == NULL)
        return -1;
    s->n_stops = r->n_stop;
    for (size_t i = 0; i < r->n_stop; i++) {
        stopm_t *m = &s->stops[i];
        m->str = r->stop[i];
        m->len = strlen(r->stop[i]);
        if (m->len == 0)
            continue;
        if (m->len > UINT32_MAX || (m->fail = malloc(m->len * sizeof(uint32_t))) == NULL)
            return -1;
        m->fail[0] = 0;
        for (size_t k = 1, b = 0; k < m->len; k++) {
            while (b > 0 && m->str[k] != m->str[b])
                b = m->fail[b - 1];
            if (m->str[k] == m->str[b])
                b++;
            m->fail[k] = (uint32_t)b;
        }
    }
    return 0;
}

/* Feeds one output byte at text offset pos; the start of a match it
 * completes, or -1. */
static long stop_feed(stopm_t *m, char c, size_t pos)
{
    if (m->len == 0)
        return -1;
    while (m->state > 0 && c != m->str[m->state])
        m->state = m->fail[m->state - 1];
    if (c == m->str[m->state])
        m->state++;
    if (m->state < m->len)
        return -1;
    m->state = m->fail[m->len - 1];
    return (long)(pos + 1 - m->len);
}

/* --- output: text, stop strings, finishing ------------------------------- */

/* Lets go of the blocks a transfer filled: admission has referenced them, or the request ends. */
static void drop_pin(sched_t *sc, sreq_t *s)
{
    if (s->pin.table)
        kvw_blocks_release(sc->bm, &s->pin);
}

static void finish(sched_t *sc, sreq_t *s, kvw_finish_t why)
{
    kvw_req_t *r = s->req;

    if (why != KVW_FINISH_STOP && s->text_sent < s->text_len)
        kvw_req_emit_text(r, s->text + s->text_sent, s->text_len - s->text_sent);
    kvw_blocks_release(sc->bm, &s->blocks);
    drop_pin(sc, s);
    unqueue(sc, s);
    r->engine_data = NULL;
    sc->st.finished++;
    sreq_free(s);
    kvw_req_finish(r, why);
}

/* Delivers one sampled token; returns 1 when the request is done. */
static int deliver(sched_t *sc, sreq_t *s, uint32_t tok)
{
    kvw_req_t *r = s->req;
    char buf[256];

    s->n_out++;
    sc->st.generation_tokens++;
    r->rng = s->rng;
    if (kvw_backend_is_eos(sc->be, tok) && !r->ignore_eos) {
        kvw_req_emit(r, tok, "", 0);
        finish(sc, s, KVW_FINISH_STOP);
        return 1;
    }
    size_t n = sc->text->detok(sc->text->ctx, tok, buf, sizeof(buf));
    if (r->n_stop == 0) {
        kvw_req_emit(r, tok, buf, n);
    } else {
        size_t base = s->text_len, hold = 0;
        if (kvw_text_append(&s->text, &s->text_len, &s->text_cap, buf, n)) {
            finish(sc, s, KVW_FINISH_ABORT);
            return 1;
        }
        /* earliest start among the matches this token's bytes complete */
        long at = -1;
        for (size_t k = 0; k < n; k++)
            for (size_t i = 0; i < r->n_stop; i++) {
                long m = stop_feed(&s->stops[i], buf[k], base + k);
                if (m >= 0 && (at < 0 || m < at))
                    at = m;
            }
        for (size_t i = 0; i < r->n_stop; i++)
            if (s->stops[i].state > hold)
                hold = s->stops[i].state;
        size_t upto = at >= 0 ? (size_t)at : s->text_len - hold;
        if (upto < s->text_sent)
            upto = s->text_sent;
        kvw_req_emit(r, tok, s->text + s->text_sent, upto - s->text_sent);
        s->text_sent = upto;
        if (at >= 0) {
            finish(sc, s, KVW_FINISH_STOP);
            return 1;
        }
    }
    if (s->n_out >= (size_t)r->max_tokens || s->n_tokens + 1 > sc->max_len) {
        finish(sc, s, KVW_FINISH_LENGTH);
        return 1;
    }
    return 0;
}

/* --- scheduling ----------------------------------------------------------- */

static int batch_add(sched_t *sc, sreq_t *s, uint32_t n)
{
    if (sc->n_batch == sc->batch_cap) {
        uint32_t c = sc->batch_cap ? sc->batch_cap * 2 : 64;
        item_t *b = realloc(sc->batch, c * sizeof(*b));
        if (b == NULL)
            return -1;
        sc->batch = b;
        kvw_step_seq_t *q = realloc(sc->seqs, c * sizeof(*q));
        if (q == NULL)
            return -1;
        sc->seqs = q;
        sc->batch_cap = c;
    }
    item_t *it = &sc->batch[sc->n_batch++];
    it->s = s;
    it->n = n;
    it->sample = s->n_computed + n == s->n_tokens;
    s->in_batch = 1;
    return 0;
}

/* The last of the pinned requests at the head of the waiting queue, before
 * stop; NULL if there is none. */
static sreq_t *last_pinned(sched_t *sc, const sreq_t *stop)
{
    sreq_t *after = NULL;

    for (sreq_t *w = sc->waiting.head; w && w != stop && w->pin.table; w = w->next)
        after = w;
    return after;
}

/* Recompute: drop the blocks, back to the waiting queue, first among the
 * requests to compute: after the pinned ones, which hold their prompts'
 * blocks and need almost none (ahead of them, a preempted prompt waits for
 * blocks their pins hold, and they for it, for good). */
static void preempt(sched_t *sc, sreq_t *s)
{
    kvw_blocks_release(sc->bm, &s->blocks);
    unqueue(sc, s);
    s->n_computed = 0;
    s->decoding = 0;
    q_insert_after(&sc->waiting, last_pinned(sc, NULL), s);
    s->queue = Q_WAITING;
    sc->st.preemptions++;
}

/* How many of the remaining tokens go into this step. */
static uint32_t chunk_for(sched_t *sc, const sreq_t *s, uint32_t budget)
{
    size_t left = s->n_tokens - s->n_computed;
    if (left <= budget)
        return (uint32_t)left;
    if (sc->base.cfg->enable_chunked_prefill)
        return budget;
    /* unchunked: a prompt over the budget runs alone rather than never */
    return budget == (uint32_t)sc->base.cfg->max_num_batched_tokens ? (uint32_t)left : 0;
}

/*
 * A request whose prompt KV arrived by transfer (pinned) needs about a block
 * of compute before it decodes. It waits ahead of the waiting prompts (behind
 * earlier pinned ones), and the prompt chunks of running requests leave room
 * for it (pinned_reserve): it then waits one step for its first token, not
 * every chunk of a local prefill running or queued before it, at the cost of
 * a few tokens of those chunks. Without this a decode worker that prefills
 * one long prompt locally holds every pulled request for the whole prefill.
 */
static void queue_pinned(sched_t *sc, sreq_t *s)
{
    sreq_t *after;

    if (s->queue != Q_WAITING)
        return;
    after = last_pinned(sc, s);
    if (after == s->prev)
        return;
    q_remove(&sc->waiting, s);
    q_insert_after(&sc->waiting, after, s);
}

/* An admitted pinned request runs ahead of the running requests still
 * prefilling: from its next step it decodes, and running requests are given
 * tokens in order, so behind a long prompt's chunks it would get none until
 * that prompt is done (a decode worker's stall, the ITL the split exists to
 * keep low). Decoding requests stay first, as they were admitted. */
static void run_before_prompts(sched_t *sc, sreq_t *s)
{
    sreq_t *p = sc->running.head;

    while (p && p->decoding)
        p = p->next;
    if (p == NULL)
        q_push_back(&sc->running, s);
    else
        q_insert_after(&sc->running, p->prev, s);
}

/* The tokens the pinned requests at the head of the waiting queue need to be
 * admitted this step (at most half the budget: running prompts progress). */
static uint32_t pinned_reserve(sched_t *sc, uint32_t budget)
{
    uint32_t bs = kvw_blocks_block_size(sc->bm), need = 0;
    uint32_t room = (uint32_t)sc->base.cfg->max_num_seqs > sc->running.n
                    ? (uint32_t)sc->base.cfg->max_num_seqs - sc->running.n : 0;

    if (!sc->base.cfg->enable_chunked_prefill)
        return 0;
    for (sreq_t *w = sc->waiting.head; w && w->pin.table && room > 0; w = w->next, room--) {
        size_t have = (size_t)w->pin.n * bs;
        need += have < w->n_tokens ? (uint32_t)(w->n_tokens - have) : 1;
        if (need >= budget / 2)
            return budget / 2;
    }
    return need;
}

/* Running requests first; returns 1 if one had to be preempted. */
static int schedule_running(sched_t *sc, uint32_t *budget)
{
    int preempted = 0;
    sreq_t *s = sc->running.head;
    uint32_t reserve = pinned_reserve(sc, *budget);

    while (s != NULL && *budget > 0) {
        sreq_t *next = s->next;
        /* a prompt's chunk leaves the pinned requests their room */
        uint32_t room = !s->decoding && reserve ? (*budget > reserve ? *budget - reserve : 0)
                                                : *budget;
        uint32_t n = room ? chunk_for(sc, s, room) : 0;
        if (n == 0) {
            s = next;
            continue;
        }
        while (kvw_blocks_reserve(sc->bm, &s->blocks, s->n_computed + n) != 0) {
            sreq_t *victim = sc->running.tail;
            preempted = 1;
            if (victim == s) {
                preempt(sc, s);
                return 1;
            }
            if (victim == next)
                next = NULL;   /* the list ends before the victim */
            preempt(sc, victim);
        }
        if (batch_add(sc, s, n))
            return preempted;
        *budget -= n;
        s = next;
    }
    return preempted;
}

/*
 * Admits waiting requests in order. The watermark check covers the whole
 * prompt, so an admitted prompt is unlikely to be preempted mid-prefill;
 * reused inactive blocks count against capacity as new ones do. A pinned
 * request is not held to the watermark: its blocks are taken already (by
 * its transfer, which may have dipped into the watermark) and it computes
 * about one more, where held back it would keep them from everyone.
 */
static void schedule_waiting(sched_t *sc, uint32_t *budget)
{
    const kvw_config_t *cfg = sc->base.cfg;
    uint32_t bs = kvw_blocks_block_size(sc->bm);
    uint32_t reserve = (uint32_t)(cfg->watermark * kvw_blocks_total(sc->bm));

    while (sc->waiting.head && *budget > 0 && sc->running.n < (uint32_t)cfg->max_num_seqs) {
        sreq_t *s = sc->waiting.head;
        uint32_t idle = 0, hits = 0;
        if (cfg->enable_prefix_caching)
            hits = kvw_blocks_lookup(sc->bm, s->seed, s->tokens, s->n_tokens, &idle);
        uint32_t need = (uint32_t)((s->n_tokens + bs - 1) / bs) - hits + idle;
        if ((uint64_t)need + (s->pin.table ? 0 : reserve) > kvw_blocks_available(sc->bm))
            break;
        size_t cached = 0;
        if (cfg->enable_prefix_caching)
            cached = kvw_blocks_acquire_prefix(sc->bm, &s->blocks, s->seed, s->tokens,
                                               s->n_tokens);
        else
            s->blocks.seed = s->seed;
        s->n_computed = cached;
        uint32_t n = chunk_for(sc, s, *budget);
        if (n == 0 || kvw_blocks_reserve(sc->bm, &s->blocks, s->n_computed + n) != 0) {
            kvw_blocks_release(sc->bm, &s->blocks);
            s->n_computed = 0;
            break;
        }
        int pinned = s->pin.table != NULL;
        drop_pin(sc, s);
        if (!s->admitted_once) {
            s->admitted_once = 1;
            s->req->cached_tokens = cached;
            sc->st.cached_tokens += cached;
        }
        unqueue(sc, s);
        if (pinned)
            run_before_prompts(sc, s);
        else
            q_push_back(&sc->running, s);
        s->queue = Q_RUNNING;
        if (batch_add(sc, s, n))
            return;
        *budget -= n;
    }
}

static void start_step(sched_t *sc)
{
    uint32_t budget = (uint32_t)sc->base.cfg->max_num_batched_tokens;
    double ms = 0;
    int prefill = 0;

    sc->n_batch = 0;
    /* after a preemption nothing new is admitted, unless nothing runs: the
     * preempted request (the only one) would wait for a kick never coming */
    if (!schedule_running(sc, &budget) || sc->n_batch == 0)
        schedule_waiting(sc, &budget);
    if (sc->n_batch == 0)
        return;
    for (uint32_t i = 0; i < sc->n_batch; i++) {
        item_t *it = &sc->batch[i];
        sreq_t *s = it->s;
        kvw_step_seq_t *q = &sc->seqs[i];
        memset(q, 0, sizeof(*q));
        q->tokens = s->tokens + s->n_computed;
        q->n_tokens = it->n;
        q->pos = (uint32_t)s->n_computed;
        q->block_table = s->blocks.table;
        q->n_blocks = s->blocks.n;
        q->cached = (uint32_t)s->req->cached_tokens;
        q->sample = it->sample;
        q->decode = s->decoding;
        prefill |= !s->decoding;
        q->sampling.temperature = (float)s->req->temperature;
        q->sampling.top_p = (float)s->req->top_p;
        q->sampling.top_k = s->req->top_k;
        q->sampling.rng = &s->rng;
    }
    if (sc->be->step(sc->be, sc->seqs, sc->n_batch, &ms) != 0)
        ms = -1;
    sc->base.unhealthy = sc->be->unhealthy;     /* a lost device: health checks fail from now */
    sc->st.steps++;
    sc->st.prefill_steps += prefill;
    if (ms > 0)
        sc->st.busy_ms += ms;
    sc->busy = 1;

    /*
     * A simulated step starts where the previous one was due to end, not
     * when its timer callback ran, so loop latency does not pile up over
     * a generation: a loop behind catches up (the next steps' timers are
     * shorter) unless it is more than CATCH_UP_US behind, when it restarts
     * from now and that time is lost (late_ms). One loop runs every engine
     * of the process and their streams, so on a busy host a step end
     * routinely waits a few ms behind the others'.
     */
    uint64_t now = kv_clock_us();
    int behind = sc->due_us && now >= sc->due_us + CATCH_UP_US;     /* too far to catch up */
    uint64_t start = sc->due_us && !behind ? sc->due_us : now;
    if (behind && sc->be->simulated)
        sc->st.late_ms += (double)(now - sc->due_us) / 1e3;     /* the host starved the loop */
    uint64_t wait = 0;
    if (sc->be->simulated && ms > 0) {
        sc->due_us = start + (uint64_t)(ms * 1000.0);
        wait = sc->due_us > now ? sc->due_us - now : 0;
    } else {
        sc->due_us = now;
    }
    struct timeval tv = { (time_t)(wait / 1000000), (suseconds_t)(wait % 1000000) };
    if (ms < 0)
        sc->due_us = 0;     /* failed: abort the batch when the timer fires */
    evtimer_add(sc->done, &tv);
}

/*
 * The time to first token as the engine scheduled it: from submit to the
 * end of the step that produced the first token, that step's due time on
 * a simulated engine (not when the loop got round to it). Routing is what
 * sets it; a host short of CPU delays the delivery after it, which the
 * client's own TTFT also counts, so the two side by side tell the router's
 * share from the host's. end: when the token was out (for a token a prefill
 * worker sampled, its delivery here).
 */
static void first_token(sched_t *sc, sreq_t *s, uint64_t end)
{
    sc->st.first_tokens++;
    if (end > s->submit_us)
        sc->st.first_token_ms += (double)(end - s->submit_us) / 1e3;
}

/*
 * The first token a prefill worker sampled (kvw_sched_submit_pinned): the
 * client gets it now, as it would have from an aggregated engine at the end
 * of the step that finished the prompt, not after this engine's next step,
 * which computes the prompt's last partial block and the token itself to
 * sample the second one. Returns 1 when the request is done (a stop, eos,
 * or max_tokens 1).
 */
static int deliver_given(sched_t *sc, sreq_t *s)
{
    s->given = 0;
    first_token(sc, s, kv_clock_us());      /* now: no step of this engine produced it */
    return deliver(sc, s, s->tokens[s->req->n_prompt]);
}

/* Every given token not yet delivered, of requests outside a step's batch. */
static void deliver_all_given(sched_t *sc)
{
    queue_t *qs[2] = { &sc->waiting, &sc->running };
    uint32_t left = 0;

    for (int i = 0; i < 2; i++) {
        for (sreq_t *s = qs[i]->head, *next; s; s = next) {
            next = s->next;             /* deliver may finish and free s */
            if (s->given && !s->in_batch)
                deliver_given(sc, s);
            else
                left += s->given;
        }
    }
    sc->n_given = left;
}

static void end_step(evutil_socket_t fd, short what, void *arg)
{
    sched_t *sc = arg;
    int failed = sc->due_us == 0;

    sc->busy = 0;
    for (uint32_t i = 0; i < sc->n_batch; i++) {
        item_t *it = &sc->batch[i];
        sreq_t *s = it->s;
        s->in_batch = 0;
        if (s->req == NULL) {       /* cancelled meanwhile; blocks already freed */
            sreq_free(s);
            continue;
        }
        if (failed) {
            finish(sc, s, KVW_FINISH_ABORT);
            continue;
        }
        if (s->given && deliver_given(sc, s))
            continue;
        if (s->queue != Q_RUNNING)  /* preempted after this step was planned: cannot be */
            continue;
        s->n_computed += it->n;
        if (sc->base.cfg->enable_prefix_caching)
            kvw_blocks_commit(sc->bm, &s->blocks, s->tokens, s->n_computed);
        if (!it->sample)
            continue;
        s->decoding = 1;
        if (s->n_tokens == s->req->n_prompt)    /* none generated yet (a recompute keeps them) */
            first_token(sc, s, sc->be->simulated && sc->due_us ? sc->due_us : kv_clock_us());
        uint32_t tok = sc->seqs[i].next_token;
        if (s->n_tokens + 1 > s->cap) {
            size_t c = s->cap * 2 + 16;
            uint32_t *t = realloc(s->tokens, c * sizeof(uint32_t));
            if (t == NULL) {
                finish(sc, s, KVW_FINISH_ABORT);
                continue;
            }
            s->tokens = t;
            s->cap = c;
        }
        s->tokens[s->n_tokens++] = tok;
        deliver(sc, s, tok);
    }
    sc->n_batch = 0;
    kvw_blocks_flush(sc->bm);
    if (sc->hook)
        sc->hook(sc->hook_ctx, &sc->base);
    if (sc->waiting.n || sc->running.n)
        start_step(sc);
    if (!sc->busy)
        sc->due_us = 0;     /* idle: the next step starts from now */
}

static void on_kick(evutil_socket_t fd, short what, void *arg)
{
    sched_t *sc = arg;

    if (sc->n_given)
        deliver_all_given(sc);
    if (!sc->busy)
        start_step(sc);
    if (!sc->busy)
        sc->due_us = 0;
}

/* --- engine ops ------------------------------------------------------------ */

static int sched_submit(kvw_engine_t *e, kvw_req_t *r)
{
    sched_t *sc = (sched_t *)e;

    if (r->n_prompt == 0 || r->n_prompt + 1 > sc->max_len)
        return KVW_SUBMIT_TOO_LONG;

    sreq_t *s = calloc(1, sizeof(*s));
    if (s == NULL)
        return -1;
    s->cap = r->n_prompt + (size_t)(r->max_tokens < 4096 ? r->max_tokens : 4096) + 1;
    s->tokens = malloc(s->cap * sizeof(uint32_t));
    if (s->tokens == NULL) {
        free(s);
        return -1;
    }
    memcpy(s->tokens, r->prompt, r->n_prompt * sizeof(uint32_t));
    s->n_tokens = r->n_prompt;
    s->req = r;
    s->submit_us = kv_clock_us();
    if (stops_init(s, r) < 0) {
        sreq_free(s);
        return -1;
    }
    s->seed = kvw_blocks_seed(r->cache_salt, r->lora ? r->model : NULL);
    /* tokens depend on the request's seed and position only: reruns agree */
    s->rng = r->seed ? r->seed : kv_hash_block(r->prompt, r->n_prompt, 7);
    r->engine_data = s;
    q_push_back(&sc->waiting, s);
    s->queue = Q_WAITING;
    sc->st.requests++;
    sc->st.prompt_tokens += r->n_prompt;
    if (!sc->busy)
        event_active(sc->kick, EV_TIMEOUT, 0);
    if (sc->hook)           /* the load changed: --load-ms reports it now */
        sc->hook(sc->hook_ctx, &sc->base);
    return 0;
}

static void sched_cancel(kvw_engine_t *e, kvw_req_t *r)
{
    sched_t *sc = (sched_t *)e;
    sreq_t *s = r->engine_data;

    if (s == NULL)
        return;
    r->engine_data = NULL;
    kvw_blocks_release(sc->bm, &s->blocks);
    drop_pin(sc, s);
    unqueue(sc, s);
    s->req = NULL;
    sc->st.cancelled++;
    if (!s->in_batch)
        sreq_free(s);
}

static void drop_queue(sched_t *sc, queue_t *q)
{
    while (q->head) {
        sreq_t *s = q->head;
        q_remove(q, s);
        drop_pin(sc, s);
        if (s->req) {
            s->req->engine_data = NULL;
            kvw_req_finish(s->req, KVW_FINISH_ABORT);
        }
        if (!s->in_batch)
            sreq_free(s);
    }
}

static void sched_destroy(kvw_engine_t *e)
{
    sched_t *sc = (sched_t *)e;

    /* requests cancelled mid-step are freed here; the rest leave the batch
     * and are freed with their queue (touching a freed one was a
     * use-after-free at shutdown) */
    for (uint32_t i = 0; i < sc->n_batch; i++) {
        if (sc->batch[i].s->req == NULL)
            sreq_free(sc->batch[i].s);
        else
            sc->batch[i].s->in_batch = 0;
    }
    drop_queue(sc, &sc->waiting);
    drop_queue(sc, &sc->running);
    event_free(sc->kick);
    event_free(sc->done);
    kvw_blocks_free(sc->bm);
    sc->be->destroy(sc->be);
    free(sc->batch);
    free(sc->seqs);
    free(sc);
}

static const kvw_engine_ops_t sched_ops = {
    .name = "sched",
    .submit = sched_submit,
    .cancel = sched_cancel,
    .destroy = sched_destroy,
};

kvw_engine_t *kvw_sched_create(const kvw_config_t *cfg, struct event_base *base, int index,
                               kvw_backend_t *backend)
{
    sched_t *sc = calloc(1, sizeof(*sc));

    if (sc == NULL || backend == NULL) {
        free(sc);
        return NULL;
    }
    sc->base.ops = &sched_ops;
    sc->base.cfg = cfg;
    sc->base.base = base;
    sc->base.index = index;
    sc->base.port = cfg->port + index;
    sc->be = backend;
    sc->text = cfg->text ? cfg->text : kvw_text_bytes();
    sc->bm = kvw_blocks_new(backend->num_blocks ? backend->num_blocks : (uint32_t)cfg->num_blocks,
                            backend->block_size ? backend->block_size : (uint32_t)cfg->block_size);
    sc->kick = event_new(base, -1, 0, on_kick, sc);
    sc->done = evtimer_new(base, end_step, sc);
    if (sc->bm == NULL || sc->kick == NULL || sc->done == NULL) {
        kvw_blocks_free(sc->bm);
        if (sc->kick) event_free(sc->kick);
        if (sc->done) event_free(sc->done);
        free(sc);
        return NULL;
    }
    /* the longest sequence that passes admission with nothing else running */
    uint32_t bs = kvw_blocks_block_size(sc->bm), nb = kvw_blocks_total(sc->bm);
    uint32_t reserve = (uint32_t)(cfg->watermark * nb);
    sc->max_len = (size_t)(nb > reserve ? nb - reserve : 1) * bs;
    if (backend->max_model_len && backend->max_model_len < sc->max_len)
        sc->max_len = backend->max_model_len;
    if (cfg->max_model_len > 0 && (size_t)cfg->max_model_len < sc->max_len)
        sc->max_len = (size_t)cfg->max_model_len;
    return &sc->base;
}

kvw_blocks_t *kvw_sched_blocks(kvw_engine_t *e) { return ((sched_t *)e)->bm; }
kvw_backend_t *kvw_sched_backend(kvw_engine_t *e) { return ((sched_t *)e)->be; }

int kvw_sched_submit_pinned(kvw_engine_t *e, kvw_req_t *r, kvw_seq_blocks_t *pin,
                            const uint32_t *first, uint64_t rng)
{
    sched_t *sc = (sched_t *)e;
    int rc = sched_submit(e, r);
    sreq_t *s = r->engine_data;

    if (rc != 0 || s == NULL) {
        kvw_blocks_release(sc->bm, pin);
        return rc;
    }
    s->pin = *pin;
    memset(pin, 0, sizeof(*pin));
    queue_pinned(sc, s);
    if (first) {
        /* the sequence goes on from the given token (its KV is computed in the
         * next step with the prompt's tail), the sampler from its state after
         * it; the token itself goes out from the kick, after the caller has
         * sent the reply's headers */
        s->tokens[s->n_tokens++] = *first;
        s->rng = rng;
        s->given = 1;
        sc->n_given++;
        event_active(sc->kick, EV_TIMEOUT, 0);
    }
    return 0;
}

void kvw_sched_set_step_hook(kvw_engine_t *e, kvw_step_hook_fn fn, void *ctx)
{
    sched_t *sc = (sched_t *)e;
    sc->hook = fn;
    sc->hook_ctx = ctx;
}

void kvw_sched_load(kvw_engine_t *e, kvw_sched_load_t *out)
{
    sched_t *sc = (sched_t *)e;
    const kvw_blocks_stats_t *bs = kvw_blocks_stats(sc->bm);

    *out = sc->st;
    out->waiting = sc->waiting.n;
    out->running = sc->running.n;
    out->active_prefill_tokens = 0;
    for (sreq_t *s = sc->waiting.head; s; s = s->next)
        out->active_prefill_tokens += s->n_tokens - s->n_computed;
    for (sreq_t *s = sc->running.head; s; s = s->next)
        if (!s->decoding)
            out->active_prefill_tokens += s->n_tokens - s->n_computed;
    out->kv_active_blocks = kvw_blocks_active(sc->bm);
    out->active_decode_blocks = out->kv_active_blocks;
    out->kv_used_blocks = kvw_blocks_used(sc->bm);
    out->num_blocks = kvw_blocks_total(sc->bm);
    out->block_size = kvw_blocks_block_size(sc->bm);
    out->prefix_query_tokens = bs->lookups_tokens;
    out->prefix_hit_tokens = bs->hit_tokens;
}
