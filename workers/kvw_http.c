/*
 * evhttp transport for the OpenAI routes. A request's life: parse the body,
 * hand a kvw_req_t to the engine, then either stream each token as an SSE
 * event or collect the text and answer once. If the client disconnects
 * first, the connection's close callback cancels the request in the engine,
 * which frees its KV blocks.
 */
#include "kvw_http.h"

#include <event2/buffer.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>

#define KVW_MAX_BODY (64 << 20)

struct kvw_http {
    struct evhttp          *http;
    kvw_engine_t           *engine;
    kvw_tokenize_fn         tok;
    void                   *tok_ctx;
    uint64_t                next_id;
};

/* Per in-flight request state owned by the front. */
typedef struct {
    kvw_req_t                    req;
    kvw_http_t                  *h;
    struct evhttp_request       *http;
    struct evhttp_connection    *conn;
    char                         id[48];
    long                         created;
    char                        *text;      /* non-streamed output */
    size_t                       len, cap;
    int                          started;   /* SSE headers sent */
} kvw_front_t;

static uint64_t now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static void reply_json(struct evhttp_request *req, int code, const char *reason,
                       char *json)
{
    struct evbuffer *b = evbuffer_new();
    evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type",
                      "application/json");
    if (json) {
        evbuffer_add(b, json, strlen(json));
        evbuffer_add(b, "\n", 1);
    }
    evhttp_send_reply(req, code, reason, b);
    evbuffer_free(b);
    free(json);
}

static void reply_error(struct evhttp_request *req, int code, const char *reason,
                        const char *msg, const char *type)
{
    reply_json(req, code, reason, kvw_openai_error(msg, type, NULL));
}

static void front_free(kvw_front_t *f)
{
    if (f->conn)
        evhttp_connection_set_closecb(f->conn, NULL, NULL);
    kvw_req_clear(&f->req);
    free(f->text);
    free(f);
}

static void on_close(struct evhttp_connection *conn, void *arg)
{
    kvw_front_t *f = arg;

    f->conn = NULL;     /* libevent frees the connection and its request */
    if (f->req.engine)
        f->req.engine->ops->cancel(f->req.engine, &f->req);
    front_free(f);
}

static void send_sse(kvw_front_t *f, char *payload)
{
    struct evbuffer *b = evbuffer_new();
    evbuffer_add_printf(b, "data: %s\n\n", payload);
    evhttp_send_reply_chunk(f->http, b);
    evbuffer_free(b);
    free(payload);
}

static void start_stream(kvw_front_t *f)
{
    struct evkeyvalq *hd = evhttp_request_get_output_headers(f->http);
    evhttp_add_header(hd, "Content-Type", "text/event-stream");
    evhttp_add_header(hd, "Cache-Control", "no-cache");
    evhttp_send_reply_start(f->http, 200, "OK");
    f->started = 1;
}

void kvw_req_emit(kvw_req_t *r, uint32_t token, const char *text, size_t len)
{
    kvw_front_t *f = r->front;

    if (r->n_output++ == 0)
        r->first_token_us = now_us();
    if (r->stream) {
        if (!f->started)
            start_stream(f);
        send_sse(f, kvw_openai_chunk(r, f->id, f->created, text, len, NULL));
        return;
    }
    if (f->len + len + 1 > f->cap) {
        size_t c = f->cap ? f->cap * 2 : 256;
        while (c < f->len + len + 1)
            c *= 2;
        char *p = realloc(f->text, c);
        if (p == NULL)
            return;
        f->text = p;
        f->cap = c;
    }
    memcpy(f->text + f->len, text, len);
    f->len += len;
    f->text[f->len] = '\0';
}

void kvw_req_finish(kvw_req_t *r, kvw_finish_t why)
{
    kvw_front_t *f = r->front;
    const char *finish = kvw_finish_name(why);

    r->engine = NULL;
    if (r->stream) {
        if (!f->started)
            start_stream(f);
        send_sse(f, kvw_openai_chunk(r, f->id, f->created, NULL, 0, finish));
        if (r->include_usage)
            send_sse(f, kvw_openai_usage_chunk(r, f->id, f->created));
        struct evbuffer *b = evbuffer_new();
        evbuffer_add_printf(b, "data: [DONE]\n\n");
        evhttp_send_reply_chunk(f->http, b);
        evbuffer_free(b);
        evhttp_send_reply_end(f->http);
    } else if (why == KVW_FINISH_ABORT) {
        reply_error(f->http, 500, "Internal Server Error", "the engine aborted the request",
                    "server_error");
    } else {
        reply_json(f->http, 200, "OK",
                   kvw_openai_response(r, f->id, f->created, f->text, f->len, finish));
    }
    front_free(f);
}

static void handle_generate(kvw_http_t *h, struct evhttp_request *req, int chat)
{
    struct evbuffer *in = evhttp_request_get_input_buffer(req);
    size_t len = evbuffer_get_length(in);
    char err[256];
    kvw_front_t *f;

    if (evhttp_request_get_command(req) != EVHTTP_REQ_POST) {
        reply_error(req, 405, "Method Not Allowed", "use POST", "invalid_request_error");
        return;
    }
    f = calloc(1, sizeof(*f));
    if (f == NULL) {
        reply_error(req, 503, "Service Unavailable", "out of memory", "server_error");
        return;
    }
    const char *body = (const char *)evbuffer_pullup(in, -1);
    if (kvw_openai_parse(&f->req, chat, body ? body : "", len, h->tok, h->tok_ctx,
                         err, sizeof(err))) {
        reply_error(req, 400, "Bad Request", err, "invalid_request_error");
        kvw_req_clear(&f->req);
        free(f);
        return;
    }
    f->h = h;
    f->http = req;
    f->created = (long)time(NULL);
    snprintf(f->id, sizeof(f->id), "%s-%d-%llu", chat ? "chatcmpl" : "cmpl",
             h->engine->port, (unsigned long long)++h->next_id);
    f->req.front = f;
    f->req.engine = h->engine;
    f->req.arrival_us = now_us();
    f->conn = evhttp_request_get_connection(req);
    evhttp_connection_set_closecb(f->conn, on_close, f);

    if (h->engine->ops->submit(h->engine, &f->req) != 0) {
        f->req.engine = NULL;
        reply_error(req, 503, "Service Unavailable", "engine cannot take the request",
                    "server_error");
        front_free(f);
    }
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
        handle_generate(h, req, 1);
    } else if (strcmp(path, "/v1/completions") == 0) {
        handle_generate(h, req, 0);
    } else if (strcmp(path, "/v1/models") == 0) {
        json_t *j = json_pack("{s:s,s:[{s:s,s:s,s:I,s:s}]}", "object", "list", "data",
                              "id", h->engine->cfg->model, "object", "model",
                              "created", (json_int_t)0, "owned_by", "kvroute");
        char *s = json_dumps(j, JSON_COMPACT);
        json_decref(j);
        reply_json(req, 200, "OK", s);
    } else if (strcmp(path, "/health") == 0) {
        reply_json(req, 200, "OK", strdup("{\"status\":\"ok\"}"));
    } else {
        reply_error(req, 404, "Not Found", "no such route", "invalid_request_error");
    }
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
    h->tok = tok;
    h->tok_ctx = tok_ctx;
    evhttp_set_max_body_size(h->http, e->cfg->max_body ? e->cfg->max_body : KVW_MAX_BODY);
    evhttp_set_allowed_methods(h->http, EVHTTP_REQ_GET | EVHTTP_REQ_POST | EVHTTP_REQ_HEAD);
    evhttp_set_gencb(h->http, handle_request, h);
    if (evhttp_bind_socket(h->http, host, (ev_uint16_t)port) != 0) {
        snprintf(err, errlen, "cannot listen on %s:%d (port in use?)", host, port);
        evhttp_free(h->http);
        free(h);
        return NULL;
    }
    return h;
}

void kvw_http_stop(kvw_http_t *h)
{
    if (h) {
        evhttp_free(h->http);
        free(h);
    }
}
