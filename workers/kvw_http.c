/*
 * evhttp transport for the OpenAI routes. A request's life: parse the body,
 * hand one kvw_req_t per prompt to the engine, then either stream each
 * token as an SSE event or collect the text and answer once all prompts are
 * done. If the client disconnects first, the connection's close callback
 * cancels the requests in the engine, which frees their KV blocks: libevent
 * calls it when a write fails, and watch_hangup's peek at the socket calls
 * it when nothing is being written (a reply not streamed, a stream not yet
 * started).
 */
#include "kvw_http.h"

#include <errno.h>

#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/listener.h>
#include <event2/keyvalq_struct.h>
#include <stddef.h>
#include <stdio.h>
#include <sys/socket.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>

#include "kvw_respstore.h"
#include "kvw_sched.h"
#include "kv_clock.h"
#include "kv_model.h"
#include "kvw_text.h"
#include "kvw_xfer.h"
#include "kvw_xfer_wire.h"

#define KVW_MAX_BODY (64 << 20)
#define KVW_MAX_HEADERS (64 << 10)      /* request line + headers */

struct kvw_http {
    struct evhttp          *http;
    struct evconnlistener  *listener;
    struct event           *accept_retry;   /* re-enables accept after EMFILE */
    int                     backoff_ms;
    uint64_t                last_accept_error_us;
    uint64_t                accept_errors;
    struct kvw_http        *next;           /* all fronts: the listener's error callback
                                               gets evhttp's argument, not ours */
    kvw_engine_t           *engine;
    kvw_text_t              text;
    uint64_t                next_id;
    kvw_xfer_stats_t        xs;             /* disaggregation, both sides */
    uint64_t                bodies_parsed;  /* JSON documents loaded (one per request) */
    kvw_respstore_t        *store;          /* --responses-store; NULL: off */
};

typedef struct group group_t;

/* One prompt's request. */
typedef struct {
    kvw_req_t       req;
    group_t        *g;
    char           *text;       /* non-streamed output */
    size_t          len, cap;
    int             done;
    kvw_finish_t    why;
    char            held[4];    /* streamed bytes of a character not yet complete */
    size_t          n_held;
    kvw_pull_t     *pull;       /* decode role: the prompt's KV on its way (kvw_xfer.h) */
} part_t;

/* One HTTP request: one or more prompts. */
struct group {
    kvw_http_t                  *h;
    struct evhttp_request       *http;
    struct evhttp_connection    *conn;
    char                         id[48];
    long                         created;
    size_t                       n, pending;
    int                          started;   /* SSE headers sent */
    struct event                *hangup;    /* watch_hangup's read event */
    struct event                *overrun;   /* cuts a stream its client does not read */
    part_t                     **parts;
    json_t                      *conversation;  /* a Response to keep: its input items */
};

/*
 * A HEAD request gets the headers a GET would, Content-Length included, and
 * no body (evhttp sends whatever buffer it is given).
 */
static void send_reply(struct evhttp_request *req, int code, const char *reason,
                       struct evbuffer *b)
{
    if (evhttp_request_get_command(req) == EVHTTP_REQ_HEAD) {
        char n[32];
        snprintf(n, sizeof(n), "%zu", evbuffer_get_length(b));
        evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Length", n);
        evbuffer_drain(b, evbuffer_get_length(b));
    }
    evhttp_send_reply(req, code, reason, b);
}

static void reply_body(struct evhttp_request *req, int code, const char *reason,
                       const char *ctype, char *body)
{
    struct evbuffer *b = evbuffer_new();
    evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type", ctype);
    if (body) {
        evbuffer_add(b, body, strlen(body));
        if (strcmp(ctype, "application/json") == 0)
            evbuffer_add(b, "\n", 1);
    }
    send_reply(req, code, reason, b);
    evbuffer_free(b);
    free(body);
}

static void reply_json(struct evhttp_request *req, int code, const char *reason, char *json)
{
    reply_body(req, code, reason, "application/json", json);
}

static const char *reason_of(int code)
{
    switch (code) {
    case 400: return "Bad Request";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 500: return "Internal Server Error";
    case 503: return "Service Unavailable";
    default:  return "Error";
    }
}

static void reply_error(struct evhttp_request *req, int code, const char *msg,
                        const char *type, const char *param, const char *errcode)
{
    reply_json(req, code, reason_of(code), kvw_openai_error(msg, type, param, errcode));
}

static void reply_err(struct evhttp_request *req, const kvw_openai_err_t *e)
{
    reply_error(req, e->status, e->message, e->type, e->param, e->code);
}

static void group_free(group_t *g)
{
    if (g->conn)
        evhttp_connection_set_closecb(g->conn, NULL, NULL);
    if (g->hangup)
        event_free(g->hangup);
    if (g->overrun)
        event_free(g->overrun);
    for (size_t i = 0; i < g->n; i++) {
        if (g->parts[i] == NULL)
            continue;
        if (g->parts[i]->pull)
            kvw_pull_cancel(g->parts[i]->pull);
        kvw_req_clear(&g->parts[i]->req);
        free(g->parts[i]->text);
        free(g->parts[i]);
    }
    free(g->parts);
    json_decref(g->conversation);
    free(g);
}

/* The client went away: cancel what is still running. */
static void on_close(struct evhttp_connection *conn, void *arg)
{
    group_t *g = arg;

    /*
     * libevent frees the connection, and the requests still queued on it;
     * a request it has detached because the client went away mid-reply
     * (no connection any more) is ours to free.
     */
    g->conn = NULL;
    if (evhttp_request_get_connection(g->http) == NULL)
        evhttp_request_free(g->http);
    for (size_t i = 0; i < g->n; i++) {
        part_t *p = g->parts[i];
        if (p && !p->done && p->req.engine)
            p->req.engine->ops->cancel(p->req.engine, &p->req);
    }
    group_free(g);
}

/*
 * libevent stops reading a connection once its request is in, so a client
 * that leaves while nothing is written to it (a reply not streamed, a
 * stream queued or waiting for its KV) went unnoticed until the reply: its
 * prompts ran to the end, holding their KV blocks. A peek at the socket
 * tells, as nginx's own check does: end of file or an error is the client
 * gone (freeing the connection runs on_close); data is a pipelined request,
 * left to libevent, and the watch stops.
 */
static void on_readable(evutil_socket_t fd, short what, void *arg)
{
    group_t *g = arg;
    char c;
    ssize_t n = recv(fd, &c, 1, MSG_PEEK);

    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
        return;
    if (n > 0) {
        event_free(g->hangup);
        g->hangup = NULL;
        return;
    }
    evhttp_connection_free(g->conn);        /* on_close frees g */
}

static void watch_hangup(group_t *g)
{
    struct bufferevent *bev = evhttp_connection_get_bufferevent(g->conn);
    evutil_socket_t fd = bev ? bufferevent_getfd(bev) : -1;

    if (fd < 0)
        return;
    g->hangup = event_new(g->h->engine->base, fd, EV_READ | EV_PERSIST, on_readable, g);
    if (g->hangup)
        event_add(g->hangup, NULL);
}

static void on_overrun(evutil_socket_t fd, short what, void *arg)
{
    group_t *g = arg;

    fprintf(stderr, "kvworker: a stream's client left over %d KB unread: cancelled\n",
            g->h->engine->cfg->stream_backlog_kb);
    evhttp_connection_free(g->conn);        /* on_close cancels and frees g */
}

/*
 * The engine does not wait for a stream's client (nor does vLLM's): what the
 * client does not read piles up in the connection's buffer. Past
 * --stream-backlog-kb the stream is cut and its requests cancelled, as if
 * the client had left. Not here: this runs inside the engine's token
 * delivery, which must finish before the requests can be cancelled.
 */
static void check_backlog(group_t *g)
{
    struct bufferevent *bev = g->conn ? evhttp_connection_get_bufferevent(g->conn) : NULL;

    if (bev == NULL || g->overrun
        || evbuffer_get_length(bufferevent_get_output(bev))
           <= (size_t)g->h->engine->cfg->stream_backlog_kb * 1024)
        return;
    g->overrun = event_new(g->h->engine->base, -1, 0, on_overrun, g);
    if (g->overrun)
        event_active(g->overrun, EV_TIMEOUT, 0);
}

/* One SSE event (a Response's events are named); payload NULL: none. */
static void send_event(group_t *g, const char *event, char *payload)
{
    if (payload == NULL)
        return;
    struct evbuffer *b = evbuffer_new();
    if (event)
        evbuffer_add_printf(b, "event: %s\n", event);
    evbuffer_add_printf(b, "data: %s\n\n", payload);
    evhttp_send_reply_chunk(g->http, b);
    evbuffer_free(b);
    free(payload);
    check_backlog(g);
}

/* Whole SSE events (an Anthropic message's start and end come several at once). */
static void send_raw(group_t *g, char *events)
{
    if (events == NULL)
        return;
    struct evbuffer *b = evbuffer_new();
    evbuffer_add(b, events, strlen(events));
    evhttp_send_reply_chunk(g->http, b);
    evbuffer_free(b);
    free(events);
}

static void send_sse(group_t *g, char *payload)
{
    const kvw_req_t *r = &g->parts[0]->req;

    send_event(g, r->responses ? "response.output_text.delta"
                  : r->anthropic ? "content_block_delta" : NULL, payload);
}

static void start_stream(group_t *g)
{
    struct evkeyvalq *hd = evhttp_request_get_output_headers(g->http);
    evhttp_add_header(hd, "Content-Type", "text/event-stream");
    evhttp_add_header(hd, "Cache-Control", "no-cache");
    evhttp_send_reply_start(g->http, 200, "OK");
    g->started = 1;
    if (g->parts[0]->req.responses) {
        send_event(g, "response.created",
                   kvw_openai_response_event(&g->parts[0]->req, g->id, g->created, NULL, 0,
                                             NULL));
        send_event(g, "response.in_progress",
                   kvw_openai_response_in_progress(&g->parts[0]->req, g->id, g->created));
    }
    if (g->parts[0]->req.anthropic)
        send_raw(g, kvw_openai_message_events(&g->parts[0]->req, g->id, NULL));
}

static void collect(part_t *p, const char *text, size_t len)
{
    if (p->len + len + 1 > p->cap) {
        size_t c = p->cap ? p->cap * 2 : 256;
        while (c < p->len + len + 1)
            c *= 2;
        char *q = realloc(p->text, c);
        if (q == NULL)
            return;
        p->text = q;
        p->cap = c;
    }
    memcpy(p->text + p->len, text, len);
    p->len += len;
    p->text[p->len] = '\0';
}

void kvw_req_emit_text(kvw_req_t *r, const char *text, size_t len)
{
    part_t *p = r->front;

    if (r->hooks) {
        r->hooks->emit_text(r, text, len);
        return;
    }
    if (len == 0)
        return;
    if (r->stream) {
        /* a character split across tokens goes out whole, with the later token */
        char buf[512], *all = buf;
        size_t n = p->n_held + len, keep;

        if (n > sizeof(buf) && (all = malloc(n)) == NULL)
            return;
        memcpy(all, p->held, p->n_held);
        memcpy(all + p->n_held, text, len);
        keep = kvw_utf8_hold(all, n);
        memcpy(p->held, all + n - keep, keep);
        p->n_held = keep;
        if (!p->g->started)
            start_stream(p->g);
        send_sse(p->g, kvw_openai_chunk(r, p->g->id, p->g->created, all, n - keep, NULL));
        if (r->responses)       /* its last event carries the whole text */
            collect(p, all, n - keep);
        if (all != buf)
            free(all);
    } else {
        collect(p, text, len);
    }
}

void kvw_req_emit(kvw_req_t *r, uint32_t token, const char *text, size_t len)
{
    if (r->hooks) {
        r->hooks->emit(r, token, text, len);
        return;
    }
    if (r->n_output++ == 0)
        r->first_token_us = kv_clock_us();
    /* an empty delta still goes out when streaming: clients time tokens by events */
    if (r->stream && len == 0) {
        part_t *p = r->front;
        if (!p->g->started)
            start_stream(p->g);
        send_sse(p->g, kvw_openai_chunk(r, p->g->id, p->g->created, "", 0, NULL));
        return;
    }
    kvw_req_emit_text(r, text, len);
}

/* A finished Response goes into the engine's store (when kept: g->conversation). */
static void keep_response(group_t *g)
{
    part_t *p = g->parts[0];
    const char *finish = kvw_finish_name(p->why);

    if (g->conversation == NULL || p->why == KVW_FINISH_ABORT)
        return;
    kvw_respstore_put(g->h->store, g->id, g->conversation, p->text, p->len,
                      kvw_openai_response(&p->req, g->id, g->created, p->text, p->len, finish));
    g->conversation = NULL;
}

static void group_done(group_t *g)
{
    if (g->parts[0]->req.responses)
        keep_response(g);
    if (g->parts[0]->req.stream && g->parts[0]->req.responses) {
        part_t *p = g->parts[0];

        if (!g->started)
            start_stream(g);
        send_event(g, p->why == KVW_FINISH_ABORT ? "response.failed" : "response.completed",
                   kvw_openai_response_event(&p->req, g->id, g->created, p->text, p->len,
                                             kvw_finish_name(p->why)));
        evhttp_send_reply_end(g->http);
        group_free(g);
        return;
    }
    if (g->parts[0]->req.stream && g->parts[0]->req.anthropic) {
        part_t *p = g->parts[0];

        if (!g->started)
            start_stream(g);
        send_raw(g, kvw_openai_message_events(&p->req, g->id, kvw_finish_name(p->why)));
        evhttp_send_reply_end(g->http);
        group_free(g);
        return;
    }
    if (g->parts[0]->req.stream) {
        if (!g->started)
            start_stream(g);
        if (g->parts[0]->req.include_usage) {
            kvw_req_t sum = g->parts[0]->req;
            sum.n_prompt = sum.n_output = sum.cached_tokens = 0;
            for (size_t i = 0; i < g->n; i++) {
                sum.n_prompt += g->parts[i]->req.n_prompt;
                sum.n_output += g->parts[i]->req.n_output;
                sum.cached_tokens += g->parts[i]->req.cached_tokens;
            }
            send_sse(g, kvw_openai_usage_chunk(&sum, g->id, g->created));
        }
        struct evbuffer *b = evbuffer_new();
        evbuffer_add_printf(b, "data: [DONE]\n\n");
        evhttp_send_reply_chunk(g->http, b);
        evbuffer_free(b);
        evhttp_send_reply_end(g->http);
        group_free(g);
        return;
    }
    const kvw_req_t *rs[KVW_MAX_PROMPTS];
    const char *texts[KVW_MAX_PROMPTS], *fin[KVW_MAX_PROMPTS];
    size_t lens[KVW_MAX_PROMPTS];
    for (size_t i = 0; i < g->n; i++) {
        part_t *p = g->parts[i];
        if (p->why == KVW_FINISH_ABORT) {
            reply_error(g->http, 500, "the engine aborted the request", "server_error", NULL,
                        "engine_abort");
            group_free(g);
            return;
        }
        rs[i] = &p->req;
        texts[i] = p->text;
        lens[i] = p->len;
        fin[i] = kvw_finish_name(p->why);
    }
    reply_json(g->http, 200, "OK",
               kvw_openai_response_n(rs, texts, lens, fin, g->n, g->id, g->created));
    group_free(g);
}

void kvw_req_finish(kvw_req_t *r, kvw_finish_t why)
{
    part_t *p = r->front;

    if (r->hooks) {
        r->hooks->finish(r, why);
        return;
    }
    r->engine = NULL;
    p->done = 1;
    p->why = why;
    if (r->stream) {
        if (!p->g->started)
            start_stream(p->g);
        if (p->n_held) {    /* an incomplete character at the end: U+FFFD */
            send_sse(p->g, kvw_openai_chunk(r, p->g->id, p->g->created, p->held, p->n_held,
                                            NULL));
            if (r->responses)
                collect(p, "\xef\xbf\xbd", 3);
            p->n_held = 0;
        }
        send_sse(p->g, kvw_openai_chunk(r, p->g->id, p->g->created, NULL, 0,
                                        kvw_finish_name(why)));
    }
    if (--p->g->pending == 0)
        group_done(p->g);
}

/*
 * Parses prompt i into a new part; on error fills e and returns NULL. A
 * request without "model" gets the served model; one naming another model
 * is refused as OpenAI does (404 model_not_found).
 */
static part_t *parse_part(kvw_http_t *h, int chat, void *doc, size_t i, kvw_openai_err_t *e)
{
    part_t *p = calloc(1, sizeof(*p));
    const char *served = h->engine->cfg->model;
    kv_model_role_t role;

    if (p == NULL) {
        kvw_openai_fail(e, 503, "server_error", NULL, "out_of_memory", "out of memory");
        return NULL;
    }
    if (kvw_openai_parse_doc(&p->req, chat, doc, &h->text, i, e))
        goto fail;
    role = kv_model_role(served, h->engine->cfg->lora_modules, p->req.model);
    p->req.lora = role == KV_MODEL_LORA;
    if (role == KV_MODEL_OTHER) {
        kvw_openai_fail(e, 404, "invalid_request_error", "model", "model_not_found",
                        "The model '%.64s' does not exist; this worker serves '%.64s'.",
                        p->req.model, served);
        goto fail;
    }
    if (p->req.n_prompt == 0) {
        kvw_openai_fail(e, 400, "invalid_request_error",
                        chat == KVW_API_RESPONSES ? "input" : chat ? "messages" : "prompt",
                        "invalid_value", "the prompt is empty");
        goto fail;
    }
    p->req.index = i;
    if (p->req.model[0] == '\0') {
        free(p->req.model);
        p->req.model = strdup(served);
    }
    return p;
fail:
    kvw_req_clear(&p->req);
    free(p);
    return NULL;
}

static void submit_error(group_t *g, int rc)
{
    if (rc == KVW_SUBMIT_TOO_LONG)
        reply_error(g->http, 400,
                    "the prompt is longer than this engine's context (KV pool or max_model_len)",
                    "invalid_request_error", g->parts[0]->req.chat ? "messages" : "prompt",
                    "context_length_exceeded");
    else
        reply_error(g->http, 503, "engine cannot take the request", "server_error", NULL,
                    "server_overloaded");
}

/*
 * Disaggregated decode. The reply's headers leave only once the prompt's KV
 * is in place, and name where it came from (X-KVRoute-Prefilled-By: the
 * prefill worker's host:port, or "local"); a fallback also says why
 * (X-KVRoute-Prefill-Fallback). A router releases the prefill worker's
 * load when those headers arrive.
 */
static void prefilled_by(group_t *g, const char *who, const char *why)
{
    struct evkeyvalq *hd = evhttp_request_get_output_headers(g->http);

    evhttp_remove_header(hd, KVW_HDR_PREFILLED);
    evhttp_add_header(hd, KVW_HDR_PREFILLED, who);
    if (why) {
        char clean[200];
        size_t i;
        /* a header value: printable ASCII only */
        for (i = 0; why[i] && i + 1 < sizeof(clean); i++)
            clean[i] = why[i] >= 0x20 && why[i] < 0x7f ? why[i] : '?';
        clean[i] = '\0';
        evhttp_add_header(hd, KVW_HDR_FALLBACK, clean);
        fprintf(stderr, "kvworker: prefilling locally: %s\n", clean);
    }
}

static void on_pulled(void *arg, kvw_seq_blocks_t *pin, const kvx_token_t *first,
                      const char *why)
{
    part_t *p = arg;
    group_t *g = p->g;
    kvw_http_t *h = g->h;
    const char *addr = evhttp_find_header(evhttp_request_get_input_headers(g->http),
                                          KVW_HDR_PREFILL);
    int rc;

    p->pull = NULL;
    p->req.engine = h->engine;
    if (pin) {
        prefilled_by(g, addr ? addr : "?", NULL);
        rc = kvw_sched_submit_pinned(h->engine, &p->req, pin, first ? &first->token : NULL,
                                     first ? first->rng : 0);
        h->xs.first_given += rc == 0 && first;
    } else {
        h->xs.local++;
        prefilled_by(g, "local", why);
        rc = h->engine->ops->submit(h->engine, &p->req);
    }
    if (rc != 0) {
        p->req.engine = NULL;
        submit_error(g, rc);
        group_free(g);
        return;
    }
    g->pending++;
    /* a stream's headers go now: the KV is in place */
    if (pin && p->req.stream && !g->started)
        start_stream(g);
}

/*
 * A decode worker's request: 1 when a pull was started (the request is
 * submitted from on_pulled), 0 to prefill locally now (headers set).
 */
static int decode_start(kvw_http_t *h, group_t *g, struct evhttp_request *req)
{
    const char *addr = evhttp_find_header(evhttp_request_get_input_headers(req),
                                          KVW_HDR_PREFILL);
    const char *why = NULL;
    part_t *p = g->parts[0];

    if (addr == NULL) {
        h->xs.local++;
        prefilled_by(g, "local", NULL);
        return 0;
    }
    if (g->n > 1) {
        h->xs.local++;
        prefilled_by(g, "local", "a request with several prompts is prefilled locally");
        return 0;
    }
    p->pull = kvw_pull_start(h->engine, &h->xs, &p->req, addr, on_pulled, p, &why);
    if (p->pull == NULL) {
        h->xs.local++;
        /* a short prompt is the normal case of conditional disaggregation, not a fallback */
        prefilled_by(g, "local", why);
        return 0;
    }
    g->conn = evhttp_request_get_connection(req);
    evhttp_connection_set_closecb(g->conn, on_close, g);
    watch_hangup(g);
    return 1;
}

static void handle_generate(kvw_http_t *h, struct evhttp_request *req, int chat)
{
    struct evbuffer *in = evhttp_request_get_input_buffer(req);
    size_t len = evbuffer_get_length(in);
    kvw_openai_err_t err;

    if (evhttp_request_get_command(req) != EVHTTP_REQ_POST) {
        evhttp_add_header(evhttp_request_get_output_headers(req), "Allow", "POST");
        reply_error(req, 405, "use POST", "invalid_request_error", NULL, "method_not_allowed");
        return;
    }
    if (h->engine->unhealthy) {
        reply_error(req, 503, h->engine->unhealthy, "server_error", NULL, "engine_unhealthy");
        return;
    }
    const char *body = (const char *)evbuffer_pullup(in, -1);
    if (body == NULL)
        body = "";
    /* parsed once, however many prompts it holds (docs/SECURITY.md, section 5) */
    void *doc = kvw_openai_load(body, len, &err);
    h->bodies_parsed++;
    if (doc == NULL) {
        reply_err(req, &err);
        return;
    }
    /* a continued Response: its conversation comes from the store, or 404 */
    if (chat == KVW_API_RESPONSES && kvw_respstore_expand(h->store, doc, &err) != 0) {
        kvw_openai_unload(doc);
        reply_err(req, &err);
        return;
    }
    part_t *first = parse_part(h, chat, doc, 0, &err);
    if (first == NULL) {
        kvw_openai_unload(doc);
        reply_err(req, &err);
        return;
    }
    group_t *g = calloc(1, sizeof(*g));
    size_t n = first->req.n_prompts ? first->req.n_prompts : 1;
    if (g == NULL || (g->parts = calloc(n, sizeof(part_t *))) == NULL) {
        kvw_openai_unload(doc);
        free(g);
        kvw_req_clear(&first->req);
        free(first);
        reply_error(req, 503, "out of memory", "server_error", NULL, "out_of_memory");
        return;
    }
    g->h = h;
    g->http = req;
    g->n = n;
    g->parts[0] = first;
    for (size_t i = 1; i < n; i++) {
        if ((g->parts[i] = parse_part(h, chat, doc, i, &err)) == NULL) {
            kvw_openai_unload(doc);
            reply_err(req, &err);
            group_free(g);
            return;
        }
    }
    if (chat == KVW_API_RESPONSES)
        g->conversation = kvw_respstore_conversation(h->store, doc);
    kvw_openai_unload(doc);
    g->created = (long)time(NULL);
    snprintf(g->id, sizeof(g->id), "%s-%d-%llu",
             chat == KVW_API_RESPONSES ? "resp" : chat == KVW_API_ANTHROPIC ? "msg"
             : chat ? "chatcmpl" : "cmpl",
             h->engine->port, (unsigned long long)++h->next_id);

    for (size_t i = 0; i < n; i++) {
        g->parts[i]->g = g;
        g->parts[i]->req.front = g->parts[i];
        g->parts[i]->req.arrival_us = kv_clock_us();
    }
    if (h->engine->cfg->role == KVW_ROLE_DECODE && decode_start(h, g, req))
        return;     /* the KV is on its way: submitted when it is in place */

    for (size_t i = 0; i < n; i++) {
        part_t *p = g->parts[i];
        p->req.engine = h->engine;
        int rc = h->engine->ops->submit(h->engine, &p->req);
        if (rc != 0) {
            for (size_t j = 0; j < i; j++)
                h->engine->ops->cancel(h->engine, &g->parts[j]->req);
            submit_error(g, rc);
            group_free(g);
            return;
        }
        g->pending++;
    }
    g->conn = evhttp_request_get_connection(req);
    evhttp_connection_set_closecb(g->conn, on_close, g);
    watch_hangup(g);
    /* as vLLM does: a Response's stream opens before the engine has run it */
    if (g->parts[0]->req.stream && g->parts[0]->req.responses && !g->started)
        start_stream(g);
}

static void metric(struct evbuffer *b, const char *name, const char *type, const char *help,
                   int engine, double v)
{
    evbuffer_add_printf(b, "# HELP %s %s\n# TYPE %s %s\n%s{engine=\"%d\"} %.17g\n",
                        name, help, name, type, name, engine, v);
}

/* The transfer counters of kvw_xfer_stats_t (uint64_t, or double seconds). */
typedef struct {
    const char *name;
    const char *help;
    size_t off;
    int seconds;
} xfer_counter_t;

#define XFER_COUNT(f, name, help) {name, help, offsetof(kvw_xfer_stats_t, f), 0}
#define XFER_SECONDS(f, name, help) {name, help, offsetof(kvw_xfer_stats_t, f), 1}

static const xfer_counter_t xfer_counters[] = {
    XFER_COUNT(served, "kvworker_xfer_served_total", "KV transfers sent (prefill side)"),
    XFER_COUNT(served_blocks, "kvworker_xfer_served_blocks_total", "KV blocks sent"),
    XFER_COUNT(served_bytes, "kvworker_xfer_served_bytes_total", "KV payload bytes sent"),
    XFER_COUNT(served_ipc, "kvworker_xfer_served_ipc_total",
               "KV transfers sent as CUDA IPC offsets into this pool (of served)"),
    XFER_COUNT(refused, "kvworker_xfer_refused_total",
               "transfer requests refused (mismatch, malformed)"),
    XFER_COUNT(overloaded, "kvworker_xfer_overloaded_total",
               "transfer requests refused as overloaded (--prefill-queue-limit)"),
    XFER_COUNT(pulled, "kvworker_xfer_pulled_total", "KV transfers received (decode side)"),
    XFER_COUNT(pulled_blocks, "kvworker_xfer_pulled_blocks_total", "KV blocks received"),
    XFER_COUNT(pulled_bytes, "kvworker_xfer_pulled_bytes_total",
               "KV bytes received (modelled for the mock)"),
    XFER_SECONDS(link_s, "kvworker_xfer_link_seconds_total",
                 "modelled link time charged for transfers (mock: bytes at --link-gbps)"),
    XFER_SECONDS(pull_s, "kvworker_xfer_pull_seconds_total",
                 "wall time of successful transfers, request to verified (mock: with link time)"),
    XFER_COUNT(pulled_ipc, "kvworker_xfer_pulled_ipc_total",
               "KV transfers copied device to device by CUDA IPC (of pulled)"),
    XFER_COUNT(ipc_fallbacks, "kvworker_xfer_ipc_fallbacks_total",
               "CUDA IPC failures (open, copy) that pulled the blocks again as bytes"),
    XFER_COUNT(first_given, "kvworker_xfer_first_tokens_total",
               "first output tokens sampled by the prefill worker, sent with the KV (of pulled)"),
    XFER_COUNT(fallbacks, "kvworker_xfer_fallbacks_total",
               "transfers that failed and were prefilled locally"),
    XFER_COUNT(local, "kvworker_local_prefills_total",
               "decode-role requests prefilled locally (no prefill worker, short, fallback)"),
};

static void handle_metrics(kvw_http_t *h, struct evhttp_request *req)
{
    kvw_sched_load_t l;
    struct evbuffer *b = evbuffer_new();
    int e = h->engine->index;

    kvw_sched_load(h->engine, &l);
    metric(b, "kvworker_requests_waiting", "gauge", "requests waiting to be scheduled", e, l.waiting);
    metric(b, "kvworker_requests_running", "gauge", "requests being prefilled or decoded", e, l.running);
    metric(b, "kvworker_active_prefill_tokens", "gauge", "prompt tokens not yet computed", e,
           (double)l.active_prefill_tokens);
    metric(b, "kvworker_kv_blocks", "gauge", "KV blocks in the pool", e, l.num_blocks);
    metric(b, "kvworker_kv_blocks_active", "gauge", "KV blocks referenced by requests", e,
           l.kv_active_blocks);
    metric(b, "kvworker_kv_blocks_used", "gauge", "KV blocks holding data (active + cached)", e,
           l.kv_used_blocks);
    metric(b, "kvworker_kv_usage_ratio", "gauge", "active KV blocks / total", e,
           l.num_blocks ? (double)l.kv_active_blocks / l.num_blocks : 0);
    metric(b, "kvworker_prefix_cache_queries_tokens_total", "counter",
           "prompt tokens looked up in the prefix cache", e, (double)l.prefix_query_tokens);
    metric(b, "kvworker_prefix_cache_hits_tokens_total", "counter",
           "prompt tokens found in the prefix cache", e, (double)l.prefix_hit_tokens);
    metric(b, "kvworker_preemptions_total", "counter", "requests preempted for recompute", e,
           (double)l.preemptions);
    metric(b, "kvworker_requests_total", "counter", "requests submitted", e, (double)l.requests);
    metric(b, "kvworker_requests_finished_total", "counter", "requests finished", e,
           (double)l.finished);
    metric(b, "kvworker_requests_cancelled_total", "counter", "requests cancelled by clients", e,
           (double)l.cancelled);
    metric(b, "kvworker_prompt_tokens_total", "counter", "prompt tokens submitted", e,
           (double)l.prompt_tokens);
    metric(b, "kvworker_generation_tokens_total", "counter", "tokens generated", e,
           (double)l.generation_tokens);
    metric(b, "kvworker_cached_prompt_tokens_total", "counter",
           "prompt tokens served from the cache at first admission", e, (double)l.cached_tokens);
    metric(b, "kvworker_steps_total", "counter", "scheduler steps", e, (double)l.steps);
    metric(b, "kvworker_prefill_steps_total", "counter",
           "scheduler steps that computed prompt tokens", e, (double)l.prefill_steps);
    metric(b, "kvworker_request_bodies_parsed_total", "counter",
           "request bodies parsed as JSON (once per request, however many prompts)", e,
           (double)h->bodies_parsed);
    metric(b, "kvworker_busy_seconds_total", "counter",
           "time spent in steps (simulated time for the mock engine)", e, l.busy_ms / 1e3);
    metric(b, "kvworker_late_seconds_total", "counter",
           "mock engine: time its steps started too far behind their simulated schedule to "
           "catch up (50 ms), which the host's CPU took from it; nonzero: timings not faithful",
           e, l.late_ms / 1e3);
    metric(b, "kvworker_first_token_seconds_total", "counter",
           "sum over requests of the time from submit to the end of the step that produced "
           "the first token, as scheduled (simulated time for the mock engine)",
           e, l.first_token_ms / 1e3);
    metric(b, "kvworker_first_tokens_total", "counter",
           "requests that got their first token (the count of the sum above)", e,
           (double)l.first_tokens);
    const kvw_xfer_stats_t *x = &h->xs;
    evbuffer_add_printf(b, "# HELP kvworker_role the worker's role (--role)\n"
                        "# TYPE kvworker_role gauge\nkvworker_role{engine=\"%d\",role=\"%s\"} 1\n",
                        e, kvw_role_name(h->engine->cfg->role));
    for (size_t k = 0; k < sizeof(xfer_counters) / sizeof(xfer_counters[0]); k++) {
        const xfer_counter_t *c = &xfer_counters[k];
        const char *field = (const char *)x + c->off;
        double v = c->seconds ? *(const double *)field : (double)*(const uint64_t *)field;

        metric(b, c->name, "counter", c->help, e, v);
    }
    evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type",
                      "text/plain; version=0.0.4");
    send_reply(req, 200, "OK", b);
    evbuffer_free(b);
}

/* GET /v1/models and /v1/models/{id}: the model this worker serves and its
 * LoRA adapters (--lora-modules). */
static void handle_models(kvw_http_t *h, struct evhttp_request *req, const char *id)
{
    const char *served = h->engine->cfg->model, *loras = h->engine->cfg->lora_modules;
    char *want;
    kv_model_role_t role;

    if (id == NULL) {
        reply_json(req, 200, "OK", kvw_openai_models(served, loras));
        return;
    }
    want = evhttp_uridecode(id, 0, NULL);
    role = want && want[0] ? kv_model_role(served, loras, want) : KV_MODEL_OTHER;
    if (role != KV_MODEL_OTHER) {
        reply_json(req, 200, "OK", kvw_openai_model(want, role == KV_MODEL_LORA ? served : NULL));
    } else {
        char msg[256];
        snprintf(msg, sizeof(msg), "The model '%.64s' does not exist; this worker serves "
                 "'%.64s'.", want ? want : id, served);
        reply_error(req, 404, msg, "invalid_request_error", "model", "model_not_found");
    }
    free(want);
}

/* GET /v1/responses/{id}: a kept Response, as vLLM's store answers it. */
static void handle_get_response(kvw_http_t *h, struct evhttp_request *req, const char *id)
{
    const char *kept = kvw_respstore_get(h->store, id);
    char msg[300];

    if (evhttp_request_get_command(req) == EVHTTP_REQ_POST) {
        evhttp_add_header(evhttp_request_get_output_headers(req), "Allow", "GET, HEAD");
        reply_error(req, 405, "use GET", "invalid_request_error", NULL, "method_not_allowed");
        return;
    }
    if (kept) {
        reply_json(req, 200, "OK", strdup(kept));
        return;
    }
    snprintf(msg, sizeof(msg), "Response with id '%.200s' not found.", id);
    reply_error(req, 404, msg, "invalid_request_error", NULL, "response_not_found");
}

static void handle_request(struct evhttp_request *req, void *arg)
{
    kvw_http_t *h = arg;
    const char *uri = evhttp_request_get_uri(req);
    char path[256];
    size_t n = strcspn(uri, "?");

    if (n >= sizeof(path))
        n = sizeof(path) - 1;
    memcpy(path, uri, n);
    path[n] = '\0';

    if (strcmp(path, "/v1/chat/completions") == 0) {
        handle_generate(h, req, KVW_API_CHAT);
    } else if (strcmp(path, "/v1/completions") == 0) {
        handle_generate(h, req, KVW_API_COMPLETIONS);
    } else if (strcmp(path, "/v1/responses") == 0) {
        handle_generate(h, req, KVW_API_RESPONSES);
    } else if (strncmp(path, "/v1/responses/", 14) == 0 && path[14] != '\0'
               && strchr(path + 14, '/') == NULL) {
        handle_get_response(h, req, path + 14);
    } else if (strcmp(path, "/v1/messages") == 0) {
        handle_generate(h, req, KVW_API_ANTHROPIC);
    } else if (strcmp(path, "/v1/models") == 0) {
        handle_models(h, req, NULL);
    } else if (strncmp(path, "/v1/models/", 11) == 0 && path[11] != '\0') {
        handle_models(h, req, path + 11);
    } else if (strcmp(path, "/health") == 0 && h->engine->unhealthy) {
        json_t *j = json_pack("{s:s,s:s}", "status", "unhealthy", "reason", h->engine->unhealthy);
        reply_json(req, 503, "Service Unavailable", json_dumps(j, JSON_COMPACT));
        json_decref(j);
    } else if (strcmp(path, "/health") == 0) {
        reply_json(req, 200, "OK", strdup("{\"status\":\"ok\"}"));
    } else if (strcmp(path, "/metrics") == 0) {
        handle_metrics(h, req);
    } else if (strcmp(path, KVX_PATH) == 0) {
        kvw_xfer_serve(h->engine, &h->xs, req);
    } else {
        char msg[300];
        snprintf(msg, sizeof(msg), "Invalid URL (%s %.200s)",
                 evhttp_request_get_command(req) == EVHTTP_REQ_POST ? "POST"
                 : evhttp_request_get_command(req) == EVHTTP_REQ_HEAD ? "HEAD" : "GET", path);
        reply_error(req, 404, msg, "invalid_request_error", NULL, "unknown_url");
    }
}

/*
 * Out of file descriptors (or memory), accept() fails at once for as long
 * as the backlog holds a connection: libevent's listener then retries in
 * a loop, one warning each (a core at 100 % and 250 MB of log in 7 s).
 * Stop accepting for a while instead, doubling up to a second, and say so
 * at most once per backoff.
 */
static void on_accept_retry(evutil_socket_t fd, short what, void *arg)
{
    kvw_http_t *h = arg;
    evconnlistener_enable(h->listener);
}

static kvw_http_t *fronts;     /* one event loop per process: no locking */

static void on_accept_error(struct evconnlistener *lev, void *arg)
{
    kvw_http_t *h = fronts;
    int err = EVUTIL_SOCKET_ERROR();

    while (h && h->listener != lev)
        h = h->next;
    if (h == NULL)
        return;
    uint64_t now = kv_clock_us();

    h->accept_errors++;
    if (now > h->last_accept_error_us + 5000000)
        h->backoff_ms = 0;              /* a new episode starts small */
    h->last_accept_error_us = now;
    h->backoff_ms = h->backoff_ms ? (h->backoff_ms * 2 > 1000 ? 1000 : h->backoff_ms * 2) : 10;
    if (h->backoff_ms == 10 || h->backoff_ms == 1000)
        fprintf(stderr, "kvworker: accept: %s; pausing accepts for %d ms (%llu errors)\n",
                evutil_socket_error_to_string(err), h->backoff_ms,
                (unsigned long long)h->accept_errors);
    evconnlistener_disable(lev);
    struct timeval tv = { h->backoff_ms / 1000, (h->backoff_ms % 1000) * 1000 };
    evtimer_add(h->accept_retry, &tv);
}

kvw_http_t *kvw_http_start(kvw_engine_t *e, const char *host, int port,
                           kvw_tokenize_fn tok, void *tok_ctx, char *err, size_t errlen)
{
    kvw_http_t *h = calloc(1, sizeof(*h));

    if (h == NULL || (h->http = evhttp_new(e->base)) == NULL) {
        snprintf(err, errlen, "out of memory");
        free(h);
        return NULL;
    }
    h->engine = e;
    h->store = kvw_respstore_new((size_t)e->cfg->responses_store);
    h->text = e->cfg->text ? *e->cfg->text : *kvw_text_bytes();
    if (tok) {
        h->text.tokenize = tok;
        h->text.ctx = tok_ctx;
    }
    evhttp_set_max_body_size(h->http, e->cfg->max_body ? e->cfg->max_body : KVW_MAX_BODY);
    /* bounded headers, and no connection idle or dribbling its headers
     * kept forever (docs/SECURITY.md, section 5) */
    evhttp_set_max_headers_size(h->http, KVW_MAX_HEADERS);
    if (e->cfg->idle_timeout_s > 0)
        evhttp_set_timeout(h->http, e->cfg->idle_timeout_s);
    evhttp_set_allowed_methods(h->http, EVHTTP_REQ_GET | EVHTTP_REQ_POST | EVHTTP_REQ_HEAD);
    evhttp_set_gencb(h->http, handle_request, h);
    struct evhttp_bound_socket *bound = evhttp_bind_socket_with_handle(h->http, host,
                                                                       (ev_uint16_t)port);
    h->accept_retry = evtimer_new(e->base, on_accept_retry, h);
    if (bound == NULL || h->accept_retry == NULL) {
        snprintf(err, errlen, "cannot listen on %s:%d (port in use?)", host, port);
        kvw_http_stop(h);
        return NULL;
    }
    h->listener = evhttp_bound_socket_get_listener(bound);
    evconnlistener_set_error_cb(h->listener, on_accept_error);
    h->next = fronts;
    fronts = h;
    return h;
}

void kvw_http_stop(kvw_http_t *h)
{
    if (h) {
        for (kvw_http_t **p = &fronts; *p; p = &(*p)->next)
            if (*p == h) {
                *p = h->next;
                break;
            }
        if (h->accept_retry)
            event_free(h->accept_retry);
        kvw_respstore_free(h->store);
        evhttp_free(h->http);
        free(h);
    }
}
