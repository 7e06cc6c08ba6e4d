#include "kvb_replay.h"

#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvb_prompt.h"

typedef struct replay replay_t;

/* A request in flight. */
typedef struct {
    replay_t       *rp;
    struct evhttp_connection *conn;
    size_t          idx;
    kvb_buf_t       line;       /* the SSE line not yet complete */
    int             failed_stream;
} flight_t;

struct replay {
    const kv_trace_t   *t;
    const kvb_opts_t   *o;
    kvb_result_t       *res;
    struct event_base  *base;
    struct event       *pump;
    char                host[256], path[512];
    int                 port;
    double              t0;
    size_t              next, done, in_flight;
    kvb_buf_t           body;
};

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static double since(const replay_t *rp)
{
    return now_ms() - rp->t0;
}

static void set_error(kvb_result_t *r, const char *fmt, const char *detail)
{
    if (r->error)
        return;                 /* the first cause is the interesting one */
    char msg[300];
    snprintf(msg, sizeof(msg), fmt, detail ? detail : "");
    r->error = strdup(msg);
}

/* http://host[:port][/path] */
static int parse_url(replay_t *rp, const char *url, int chat, char *err, size_t errlen)
{
    const char *p = url;
    if (strncmp(p, "http://", 7) != 0) {
        snprintf(err, errlen, "--url must start with http:// (got '%s')", url);
        return -1;
    }
    p += 7;
    size_t hl = strcspn(p, ":/");
    if (hl == 0 || hl >= sizeof(rp->host)) {
        snprintf(err, errlen, "--url has no host: '%s'", url);
        return -1;
    }
    memcpy(rp->host, p, hl);
    rp->host[hl] = '\0';
    p += hl;
    rp->port = 80;
    if (*p == ':') {
        char *end;
        long port = strtol(p + 1, &end, 10);
        if (end == p + 1 || port <= 0 || port > 65535) {
            snprintf(err, errlen, "--url has a bad port: '%s'", url);
            return -1;
        }
        rp->port = (int)port;
        p = end;
    }
    if (*p == '\0' || strcmp(p, "/") == 0)
        p = chat ? "/v1/chat/completions" : "/v1/completions";
    if (*p != '/' || strlen(p) >= sizeof(rp->path)) {
        snprintf(err, errlen, "--url has a bad path: '%s'", url);
        return -1;
    }
    snprintf(rp->path, sizeof(rp->path), "%s", p);
    return 0;
}

/* Bytes of text a streamed choice carries: completions "text" or chat "delta.content". */
static size_t choice_text_len(json_t *ev)
{
    json_t *c = json_array_get(json_object_get(ev, "choices"), 0);
    json_t *s = json_object_get(c, "text");
    if (!json_is_string(s))
        s = json_object_get(json_object_get(c, "delta"), "content");
    return json_is_string(s) ? json_string_length(s) : 0;
}

static long get_long(json_t *o, const char *key)
{
    json_t *v = json_object_get(o, key);
    return json_is_integer(v) ? (long)json_integer_value(v) : -1;
}

/* One "data: ..." payload of the stream. */
static void on_event(flight_t *f, const char *data, size_t len)
{
    kvb_result_t *r = &f->rp->res[f->idx];
    if (len == 6 && memcmp(data, "[DONE]", 6) == 0)
        return;
    json_error_t je;
    /* "\u0000" is valid JSON: accept it (jansson refuses it by default) */
    json_t *ev = json_loadb(data, len, JSON_ALLOW_NUL, &je);
    if (ev == NULL) {
        /* jansson's reason (e.g. invalid UTF-8) says whose bug it is */
        set_error(r, "stream event is not JSON: %s", je.text);
        return;
    }
    json_t *e = json_object_get(ev, "error");
    if (e != NULL) {
        json_t *m = json_object_get(e, "message");
        set_error(r, "error event: %s", json_is_string(m) ? json_string_value(m) : "?");
    }
    if (choice_text_len(ev) > 0) {
        double now = since(f->rp);
        if (r->chunks++ == 0) {
            r->first_ms = now;
        } else {
            /* every inter-token gap, for the token-level ITL (a decode stall
             * shows there, averaged away in the request's mean) */
            if (r->ngaps == r->capgaps) {
                uint32_t cap = r->capgaps ? 2 * r->capgaps : 64;
                float *g = realloc(r->gaps, cap * sizeof(*g));
                if (g != NULL) {
                    r->gaps = g;
                    r->capgaps = cap;
                }
            }
            if (r->ngaps < r->capgaps)
                r->gaps[r->ngaps++] = (float)(now - r->last_ms);
        }
        r->last_ms = now;
    }
    json_t *u = json_object_get(ev, "usage");
    if (json_is_object(u)) {
        r->prompt_tokens = get_long(u, "prompt_tokens");
        r->completion_tokens = get_long(u, "completion_tokens");
        r->cached_tokens = get_long(json_object_get(u, "prompt_tokens_details"), "cached_tokens");
    }
    json_decref(ev);
}

/* Splits the received bytes into lines; SSE payloads are the "data:" lines. */
static void feed(flight_t *f, struct evbuffer *in)
{
    size_t n = evbuffer_get_length(in);
    if (n == 0)
        return;
    size_t old = f->line.len;
    if (kvb_buf_add(&f->line, (const char *)evbuffer_pullup(in, -1), n)) {
        set_error(&f->rp->res[f->idx], "out of memory%s", NULL);
        return;
    }
    evbuffer_drain(in, n);
    char *s = f->line.buf, *end = f->line.buf + f->line.len, *nl;
    char *scan = s + old;
    while ((nl = memchr(scan, '\n', (size_t)(end - scan))) != NULL) {
        char *e = nl;
        if (e > s && e[-1] == '\r')
            e--;
        if (e - s >= 5 && memcmp(s, "data:", 5) == 0) {
            char *d = s + 5;
            if (d < e && *d == ' ')
                d++;
            on_event(f, d, (size_t)(e - d));
        }
        s = scan = nl + 1;
    }
    f->line.len = (size_t)(end - s);
    memmove(f->line.buf, s, f->line.len);
}

static void on_chunk(struct evhttp_request *req, void *arg)
{
    flight_t *f = arg;
    if (evhttp_request_get_response_code(req) == 200)
        feed(f, evhttp_request_get_input_buffer(req));
}

static const char *req_error_name(enum evhttp_request_error e)
{
    switch (e) {
    case EVREQ_HTTP_TIMEOUT:        return "timeout";
    case EVREQ_HTTP_EOF:            return "connection closed early";
    case EVREQ_HTTP_INVALID_HEADER: return "invalid response header";
    case EVREQ_HTTP_BUFFER_ERROR:   return "connection failed";
    case EVREQ_HTTP_REQUEST_CANCEL: return "cancelled";
    case EVREQ_HTTP_DATA_TOO_LONG:  return "response too long";
    }
    return "unknown";
}

static void on_error(enum evhttp_request_error e, void *arg)
{
    flight_t *f = arg;
    set_error(&f->rp->res[f->idx], "%s", req_error_name(e));
}

static void launch(replay_t *rp);

static void free_conn(evutil_socket_t fd, short what, void *arg)
{
    evhttp_connection_free(arg);
}

static void finish(flight_t *f, struct evhttp_request *req)
{
    replay_t *rp = f->rp;
    kvb_result_t *r = &rp->res[f->idx];

    r->end_ms = since(rp);
    r->status = req ? evhttp_request_get_response_code(req) : 0;
    if (req && r->status == 200) {
        feed(f, evhttp_request_get_input_buffer(req));
        if (f->line.len) {      /* a last line without its newline */
            struct evbuffer *nl = evbuffer_new();
            if (nl) {
                evbuffer_add(nl, "\n", 1);
                feed(f, nl);
                evbuffer_free(nl);
            }
        }
    } else if (req && r->status != 0) {
        struct evbuffer *in = evhttp_request_get_input_buffer(req);
        size_t n = evbuffer_get_length(in);
        char body[160];
        n = n < sizeof(body) - 1 ? n : sizeof(body) - 1;
        evbuffer_copyout(in, body, n);
        body[n] = '\0';
        for (size_t i = 0; i < n; i++)
            if (body[i] == '\n' || body[i] == '\r')
                body[i] = ' ';
        char msg[200];
        snprintf(msg, sizeof(msg), "HTTP %d: %s", r->status, body);
        set_error(r, "%s", msg);
    }
    if (r->error == NULL && r->status == 0)
        set_error(r, "no response (connection refused or closed)%s", NULL);
    if (r->error == NULL && r->chunks == 0)
        set_error(r, "stream ended without output%s", NULL);
    /* libevent still uses the connection when this callback returns */
    struct timeval now = { 0, 0 };
    if (f->conn && event_base_once(rp->base, -1, EV_TIMEOUT, free_conn, f->conn, &now) != 0)
        fprintf(stderr, "kvbench: cannot schedule a connection's release\n");
    kvb_buf_free(&f->line);
    free(f);
    rp->in_flight--;
    rp->done++;
    if (rp->o->concurrency > 0)
        launch(rp);
    if (rp->done == rp->t->n)
        event_base_loopexit(rp->base, NULL);
}

static void on_done(struct evhttp_request *req, void *arg)
{
    finish(arg, req);
}

static int build_body(replay_t *rp, size_t i)
{
    const kvb_opts_t *o = rp->o;
    const kv_trace_req_t *tr = &rp->t->reqs[i];
    kvb_buf_t *b = &rp->body;
    json_t *model = json_string(o->model);
    char *m = model ? json_dumps(model, JSON_ENCODE_ANY) : NULL;
    int rc;

    json_decref(model);
    if (m == NULL)
        return -1;
    b->len = 0;
    rc = (o->chat ? kvb_buf_printf(b, "{\"model\":%s,\"messages\":[{\"role\":\"user\","
                                   "\"content\":", m)
                  : kvb_buf_printf(b, "{\"model\":%s,\"prompt\":", m))
         || kvb_prompt_json(b, rp->t, tr, i, o->block_size, o->vocab, o->text || o->chat)
         || (o->chat && kvb_buf_add(b, "}]", 2))
         || kvb_buf_printf(b, ",\"max_tokens\":%u,\"min_tokens\":%u,\"ignore_eos\":true,"
                           "\"temperature\":0,\"stream\":true,"
                           "\"stream_options\":{\"include_usage\":true}}",
                           rp->res[i].max_tokens, rp->res[i].max_tokens);
    free(m);
    return rc ? -1 : 0;
}

/* Sends request i. A failure to even start it is recorded as its error. */
static void send_one(replay_t *rp, size_t i)
{
    kvb_result_t *r = &rp->res[i];
    flight_t *f = calloc(1, sizeof(*f));
    struct evhttp_connection *c = NULL;
    struct evhttp_request *req = NULL;

    r->start_ms = since(rp);
    rp->in_flight++;
    if (f == NULL || build_body(rp, i)) {
        set_error(r, "out of memory%s", NULL);
        goto fail;
    }
    f->rp = rp;
    f->idx = i;
    c = evhttp_connection_base_new(rp->base, NULL, rp->host, (unsigned short)rp->port);
    req = c ? evhttp_request_new(on_done, f) : NULL;
    if (req == NULL) {
        set_error(r, "cannot create a connection%s", NULL);
        goto fail;
    }
    struct timeval tv = { (time_t)rp->o->timeout_s,
                          (suseconds_t)((rp->o->timeout_s - (double)(time_t)rp->o->timeout_s) * 1e6) };
    evhttp_connection_set_timeout_tv(c, &tv);
    evhttp_request_set_chunked_cb(req, on_chunk);
    evhttp_request_set_error_cb(req, on_error);
    struct evkeyvalq *h = evhttp_request_get_output_headers(req);
    evhttp_add_header(h, "Host", rp->host);
    evhttp_add_header(h, "Content-Type", "application/json");
    evhttp_add_header(h, "Accept", "text/event-stream");
    /* one request per connection, closed when it is done */
    evhttp_add_header(h, "Connection", "close");
    evbuffer_add(evhttp_request_get_output_buffer(req), rp->body.buf, rp->body.len);
    f->conn = c;
    if (evhttp_make_request(c, req, EVHTTP_REQ_POST, rp->path) != 0) {
        /* libevent has freed req and called nothing */
        set_error(r, "cannot send the request%s", NULL);
        req = NULL;
        goto fail;
    }
    return;
fail:
    if (req)
        evhttp_request_free(req);
    if (c)
        evhttp_connection_free(c);
    r->end_ms = since(rp);
    if (f)
        kvb_buf_free(&f->line);
    free(f);
    rp->in_flight--;
    rp->done++;
    if (rp->done == rp->t->n)
        event_base_loopexit(rp->base, NULL);
}

/* Concurrency mode: fill the window. */
static void launch(replay_t *rp)
{
    while (rp->next < rp->t->n && (int)rp->in_flight < rp->o->concurrency) {
        size_t i = rp->next++;
        rp->res[i].due_ms = since(rp);
        send_one(rp, i);
    }
}

/* Arrival mode: send everything that is due, then sleep until the next one. */
static void on_pump(evutil_socket_t fd, short what, void *arg)
{
    replay_t *rp = arg;
    double now = since(rp);

    while (rp->next < rp->t->n && rp->res[rp->next].due_ms <= now)
        send_one(rp, rp->next++);
    if (rp->next < rp->t->n) {
        double wait = rp->res[rp->next].due_ms - now;
        struct timeval tv = { (time_t)(wait / 1e3), (suseconds_t)((long)(wait * 1e3) % 1000000) };
        evtimer_add(rp->pump, &tv);
    }
}

double kvb_replay(const kv_trace_t *t, const kvb_opts_t *o, kvb_result_t *res,
                  char *err, size_t errlen)
{
    replay_t rp = { .t = t, .o = o, .res = res };
    double wall = -1;

    if (parse_url(&rp, o->url, o->chat, err, errlen))
        return -1;
    uint64_t ts0 = t->n ? t->reqs[0].timestamp_ms : 0;
    for (size_t i = 0; i < t->n; i++) {
        kvb_result_t *r = &res[i];
        memset(r, 0, sizeof(*r));
        r->first_ms = r->end_ms = r->start_ms = -1;
        r->prompt_tokens = r->completion_tokens = r->cached_tokens = -1;
        r->input_length = t->reqs[i].input_length;
        r->max_tokens = t->reqs[i].output_length ? t->reqs[i].output_length : 1;
        /* traces are sorted by arrival; a stray earlier stamp is sent at once */
        uint64_t ts = t->reqs[i].timestamp_ms > ts0 ? t->reqs[i].timestamp_ms - ts0 : 0;
        r->due_ms = (double)ts / (o->speedup > 0 ? o->speedup : 1.0);
    }
    rp.base = event_base_new();
    rp.pump = rp.base ? evtimer_new(rp.base, on_pump, &rp) : NULL;
    if (rp.pump == NULL) {
        snprintf(err, errlen, "cannot create the event loop");
        goto out;
    }
    rp.t0 = now_ms();
    if (t->n == 0) {
        wall = 0;
        goto out;
    }
    if (o->concurrency > 0)
        launch(&rp);
    else
        on_pump(-1, 0, &rp);
    if (rp.done < t->n)
        event_base_dispatch(rp.base);
    wall = since(&rp);
    /* run the connection releases finish() scheduled last */
    event_base_loop(rp.base, EVLOOP_NONBLOCK);
out:
    if (rp.pump)
        event_free(rp.pump);
    if (rp.base)
        event_base_free(rp.base);
    kvb_buf_free(&rp.body);
    return wall;
}
