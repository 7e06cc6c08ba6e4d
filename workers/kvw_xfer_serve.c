/*
 * The prefill side of a KV transfer: POST /kvroute/v1/prefill.
 *
 * The request (JSON) carries the prompt's token ids, its cache salt, the
 * decode side's fingerprints and block size, and the sequence hashes of
 * the leading blocks the decode side already holds. Mismatches are refused
 * (409) and an overloaded worker says so (503 prefill_overloaded), both
 * before any byte of KV moves. Otherwise the prompt runs through this
 * engine's own scheduler as a one-token request (its prefix cache counts),
 * the prompt's full blocks are pinned, and streamed in the engine's layout
 * (kvw_xfer_wire.h), a few MB at a time as the socket drains. The pin is let
 * go when the last frame has been written out, when the decode side goes
 * away, or when --xfer-timeout-ms passes.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <jansson.h>

#include "kv_hash.h"
#include "kv_model.h"
#include "kvw_openai.h"
#include "kvw_sched.h"
#include "kvw_xfer.h"
#include "kvw_xfer_wire.h"

#define SEND_WINDOW (4u << 20)      /* bytes queued on the socket at once */

/*
 * The window: shared by this transfer and the socket's output buffer, which
 * may still hold it when the transfer ends early (a timeout); the last one
 * to let go frees it.
 */
typedef struct {
    int         refs;
    size_t      len;
    uint8_t     data[];
} win_t;

static void win_unref(const void *data, size_t len, void *arg)
{
    win_t *w = arg;

    if (--w->refs == 0)
        free(w);
}

typedef struct {
    kvw_engine_t               *e;
    kvw_xfer_stats_t           *st;
    struct evhttp_request      *http;
    struct evhttp_connection   *conn;
    kvw_req_t                   req;        /* the prefill, as a one-token request */
    uint32_t                    first, n_full, next;
    kvw_seq_blocks_t            pin;
    struct event               *timer;
    int                         computing, streaming;
    int                         want_token;     /* the decode side asked for the first token */
    int                         has_token;      /* ... and the prefill sampled it */
    kvx_token_t                 token;
    int                         ipc_offered;    /* the decode side is on this node and can map */
    int                         ipc;            /* streaming offsets into the exported pool */
    int                         ending;         /* inside end_reply: on_close frees nothing */
    win_t                      *win;        /* frames being sent, read from the pool */
    uint64_t                   *seq, *local; /* the prompt's block hashes */
} serve_t;

uint64_t kvw_xfer_model_fp(kvw_engine_t *e)
{
    return kvx_model_fp(e->cfg->model, kvw_sched_backend(e)->vocab_size);
}

uint64_t kvw_xfer_layout_fp(kvw_engine_t *e)
{
    kvw_backend_t *b = kvw_sched_backend(e);
    uint64_t kvpt = b->block_bytes ? 0 : (uint64_t)e->cfg->kv_bytes_per_token;
    return kvx_layout_fp(kvw_blocks_block_size(kvw_sched_blocks(e)), b->block_bytes, kvpt);
}

double kvw_xfer_block_bytes(kvw_engine_t *e)
{
    kvw_backend_t *b = kvw_sched_backend(e);
    if (b->block_bytes)
        return (double)b->block_bytes;
    return e->cfg->kv_bytes_per_token * kvw_blocks_block_size(kvw_sched_blocks(e));
}

const char *kvw_role_name(int role)
{
    return role == KVW_ROLE_PREFILL ? "prefill" : role == KVW_ROLE_DECODE ? "decode"
                                                                          : "aggregated";
}

/*
 * This machine, for CUDA IPC: the kernel's boot id (the same for every
 * process and container on one host, another after a reboot). Empty where it
 * cannot be read: then IPC is never offered or accepted.
 */
const char *kvw_xfer_node_id(void)
{
    static char id[64];
    static int done;

    if (!done) {
        FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
        done = 1;
        if (f) {
            if (fgets(id, sizeof(id), f) == NULL)
                id[0] = '\0';
            id[strcspn(id, "\n")] = '\0';
            fclose(f);
        }
    }
    return id;
}

static void refuse(struct evhttp_request *req, int code, const char *reason, const char *ecode,
                   const char *msg)
{
    struct evbuffer *b = evbuffer_new();
    char *body = kvw_openai_error(msg, code == 503 ? "server_error" : "invalid_request_error",
                                  NULL, ecode);

    evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type",
                      "application/json");
    evbuffer_add_printf(b, "%s\n", body ? body : "{}");
    evhttp_send_reply(req, code, reason, b);
    evbuffer_free(b);
    free(body);
}

static void serve_free(serve_t *s)
{
    if (s->conn) {
        evhttp_connection_set_closecb(s->conn, NULL, NULL);
        /* a stream cut short left send_from_pool's watermark: the connection's next replies need 0 */
        bufferevent_setwatermark(evhttp_connection_get_bufferevent(s->conn), EV_WRITE, 0, 0);
    }
    if (s->computing) {
        s->st->computing--;
        if (s->req.engine)
            s->e->ops->cancel(s->e, &s->req);
    }
    if (s->pin.table)
        kvw_blocks_release(kvw_sched_blocks(s->e), &s->pin);
    if (s->timer)
        event_free(s->timer);
    kvw_req_clear(&s->req);
    if (s->win)
        win_unref(NULL, 0, s->win);
    free(s->seq);
    free(s->local);
    free(s);
}

/*
 * Ends the reply; the request is libevent's from here. When the decode side
 * asked to close (Connection: close, HTTP/1.0) and the output is already
 * written, libevent frees the request and the connection inside this call,
 * running on_close: which then only notes the connection gone (s->conn
 * NULL), for the caller to free s once (it freed s itself, twice, before).
 */
static void end_reply(serve_t *s)
{
    struct evhttp_request *req = s->http;

    s->http = NULL;
    s->ending = 1;
    evhttp_send_reply_end(req);
    s->ending = 0;
}

/*
 * A stream that cannot be finished. It has a Content-Length, so ending the
 * reply early would leave the decode side waiting for the missing bytes
 * until its deadline: shut the socket instead, so it reads the cut at once
 * and prefills locally (libevent then fails and frees the connection).
 */
static void cut_short(serve_t *s)
{
    if (s->conn)
        shutdown(bufferevent_getfd(evhttp_connection_get_bufferevent(s->conn)), SHUT_RDWR);
    end_reply(s);
    serve_free(s);
}

/* The decode side went away (or the connection failed): let everything go. */
static void on_close(struct evhttp_connection *conn, void *arg)
{
    serve_t *s = arg;

    s->conn = NULL;
    if (s->ending)
        return;
    if (s->http && evhttp_request_get_connection(s->http) == NULL)
        evhttp_request_free(s->http);
    serve_free(s);
}

static void on_last_written(struct evhttp_connection *conn, void *arg)
{
    serve_t *s = arg;

    end_reply(s);
    if (s->ipc && s->conn) {
        /*
         * The decode side reads the blocks from our pool after the last frame:
         * they stay pinned until it closes the connection (it copies first),
         * or until --xfer-timeout-ms.
         */
        return;
    }
    serve_free(s);
}

/* CUDA IPC: the header, the exported pool, block offsets instead of payloads, the end. */
static int send_ipc(serve_t *s, const kvx_ipc_t *pool)
{
    kvw_backend_t *be = kvw_sched_backend(s->e);
    size_t len = KVX_IPC_LEN + (size_t)(s->n_full - s->first) * KVX_BLK_LEN + KVX_END_LEN;
    uint8_t *buf = malloc(len), *p = buf;
    struct evbuffer *b = evbuffer_new();

    if (buf == NULL || b == NULL) {
        free(buf);
        if (b)
            evbuffer_free(b);
        return -1;
    }
    kvx_ipc_encode(pool, p);
    p += KVX_IPC_LEN;
    for (uint32_t i = s->first; i < s->n_full; i++) {
        kvx_block_t blk = { .index = i, .seq_hash = s->seq[i], .local_hash = s->local[i],
                            .checksum = (uint64_t)s->pin.table[i] * be->block_bytes };
        kvx_block_encode(&blk, p);
        p += KVX_BLK_LEN;
        s->st->served_blocks++;
        s->st->served_bytes += be->block_bytes;     /* moved, by the decode side's copy */
    }
    kvx_end_encode(s->n_full - s->first, p);
    evbuffer_add(b, buf, len);
    free(buf);
    s->st->served++;
    s->st->served_ipc++;
    evhttp_send_reply_chunk_with_cb(s->http, b, on_last_written, s);
    evbuffer_free(b);
    return 0;
}

static void send_more(struct evhttp_connection *conn, void *arg);

/*
 * --xfer-fault (testing only, off by default): the fault of this kind hits
 * at stream block i (counted from the first block sent). Logged, so that a
 * test can tell the injected failure from a real one.
 */
static int fault_at(const serve_t *s, int kind, uint32_t i)
{
    if (s->e->cfg->xfer_fault != kind || i - s->first < s->e->cfg->xfer_fault_at)
        return 0;
    fprintf(stderr, "kvworker: transfer: --xfer-fault %s injected at block %u\n",
            kind == KVW_FAULT_READ ? "read" : kind == KVW_FAULT_ALLOC ? "alloc" : "stall",
            i - s->first);
    return 1;
}

/* Where this window's frames stop: the stream's end, or an injected window fault. */
static uint32_t window_end(const serve_t *s)
{
    int k = s->e->cfg->xfer_fault;
    uint64_t at = (uint64_t)s->first + s->e->cfg->xfer_fault_at;

    if ((k == KVW_FAULT_ALLOC || k == KVW_FAULT_STALL) && s->next < at && at < s->n_full)
        return (uint32_t)at;
    return s->n_full;
}

/*
 * A pool in host memory (the cpu engine): each block's payload goes to the
 * socket by reference, straight from the pinned block (no copy before the
 * kernel's), its checksum computed there; only the 32-byte frame headers
 * are written into the window. The blocks stay pinned until the stream has
 * been written (or the connection is gone).
 */
static void send_from_pool(serve_t *s, struct evbuffer *b)
{
    kvw_backend_t *be = kvw_sched_backend(s->e);
    size_t bytes = be->block_bytes, used = 0, queued = 0;
    uint32_t stop = window_end(s);

    while (s->next < stop && queued < SEND_WINDOW
           && used + KVX_BLK_LEN + KVX_END_LEN <= s->win->len) {
        uint32_t i = s->next++;
        kvx_block_t blk = { .index = i, .seq_hash = s->seq[i], .local_hash = s->local[i] };
        const uint8_t *payload = fault_at(s, KVW_FAULT_READ, i) ? NULL
                                 : be->block_ptr(be, s->pin.table[i]);

        if (payload == NULL) {
            fprintf(stderr, "kvworker: transfer: block %u outside the pool\n", s->pin.table[i]);
            evbuffer_free(b);
            cut_short(s);
            return;
        }
        blk.checksum = kvx_checksum(payload, bytes);
        kvx_block_encode(&blk, s->win->data + used);
        if (evbuffer_add(b, s->win->data + used, KVX_BLK_LEN) != 0
            || evbuffer_add_reference(b, payload, bytes, NULL, NULL) != 0) {
            evbuffer_free(b);
            cut_short(s);
            return;
        }
        used += KVX_BLK_LEN;
        queued += KVX_BLK_LEN + bytes;
        s->st->served_blocks++;
        s->st->served_bytes += bytes;
    }
    struct bufferevent *bev = evhttp_connection_get_bufferevent(s->conn);
    if (s->next == s->n_full) {
        uint8_t end[KVX_END_LEN];
        kvx_end_encode(s->n_full - s->first, end);
        evbuffer_add(b, end, KVX_END_LEN);
        s->st->served++;
        /* the last callback only once every referenced byte is written: the pin holds till then */
        bufferevent_setwatermark(bev, EV_WRITE, 0, 0);
    } else {
        /* the next window is queued while this one is still being written */
        bufferevent_setwatermark(bev, EV_WRITE, SEND_WINDOW / 2, 0);
    }
    evhttp_send_reply_chunk_with_cb(s->http, b, s->next < s->n_full ? send_more : on_last_written,
                                    s);
    evbuffer_free(b);
}

/*
 * Fills the window with block frames, read from the pool straight into it,
 * and hands it to the socket by reference; the callback comes when it has
 * all been written, so the same window serves the next round (no
 * allocation, one copy out of the pool).
 */
static void send_more(struct evhttp_connection *conn, void *arg)
{
    serve_t *s = arg;
    kvw_backend_t *be = kvw_sched_backend(s->e);
    struct evbuffer *b = evbuffer_new();
    size_t bytes = be->block_bytes, used = 0;
    uint32_t stop = window_end(s);

    if (b != NULL && fault_at(s, KVW_FAULT_ALLOC, s->next)) {
        evbuffer_free(b);
        b = NULL;
    }
    if (b == NULL) {
        cut_short(s);
        return;
    }
    if (fault_at(s, KVW_FAULT_STALL, s->next)) {
        evbuffer_free(b);               /* on_timeout cuts the stream */
        return;
    }
    if (bytes && be->block_ptr) {
        send_from_pool(s, b);
        return;
    }
    while (s->next < stop && used + KVX_BLK_LEN + bytes + KVX_END_LEN <= s->win->len) {
        uint32_t i = s->next++;
        kvx_block_t blk = { .index = i, .seq_hash = s->seq[i], .local_hash = s->local[i] };
        uint8_t *payload = s->win->data + used + KVX_BLK_LEN;

        if (fault_at(s, KVW_FAULT_READ, i)
            || (bytes && be->block_read(be, s->pin.table[i], payload) != 0)) {
            fprintf(stderr, "kvworker: transfer: block_read %u failed\n", s->pin.table[i]);
            evbuffer_free(b);
            cut_short(s);
            return;
        }
        blk.checksum = kvx_checksum(payload, bytes);
        kvx_block_encode(&blk, s->win->data + used);
        used += KVX_BLK_LEN + bytes;
        s->st->served_blocks++;
        s->st->served_bytes += bytes;
    }
    if (s->next == s->n_full) {
        kvx_end_encode(s->n_full - s->first, s->win->data + used);
        used += KVX_END_LEN;
        s->st->served++;
    }
    s->win->refs++;
    if (evbuffer_add_reference(b, s->win->data, used, win_unref, s->win) != 0)
        s->win->refs--;
    evhttp_send_reply_chunk_with_cb(s->http, b, s->next < s->n_full ? send_more : on_last_written,
                                    s);
    evbuffer_free(b);
}

static void start_stream(serve_t *s)
{
    kvw_engine_t *e = s->e;
    kvw_backend_t *be = kvw_sched_backend(e);
    kvx_header_t h = {
        .version = KVX_VERSION,
        .model_fp = kvw_xfer_model_fp(e),
        .layout_fp = kvw_xfer_layout_fp(e),
        .block_size = be->block_size ? be->block_size : kvw_blocks_block_size(kvw_sched_blocks(e)),
        .first = s->first,
        .count = s->n_full - s->first,
        .block_bytes = be->block_bytes,
        .kv_bytes_per_token = be->block_bytes ? 0 : (uint64_t)e->cfg->kv_bytes_per_token,
    };
    uint8_t hdr[KVX_HDR_LEN];
    struct evbuffer *b = evbuffer_new();
    kvx_ipc_t pool;
    char err[256];

    s->next = s->first;
    s->streaming = 1;
    if (s->has_token)
        h.flags |= KVX_F_TOKEN;
    if (s->ipc_offered && s->n_full > s->first) {
        if (be->ipc_export(be, pool.handle, &pool.pool_bytes, &pool.device, err,
                           sizeof(err)) == 0) {
            s->ipc = 1;
            h.flags |= KVX_F_IPC;
        } else {
            fprintf(stderr, "kvworker: transfer: CUDA IPC refused, sending bytes: %s\n", err);
        }
    }
    /* a window of whole frames: SEND_WINDOW, or one block if blocks are larger */
    size_t frame = KVX_BLK_LEN + be->block_bytes;
    size_t len = (frame < SEND_WINDOW ? SEND_WINDOW - SEND_WINDOW % frame : frame) + KVX_END_LEN;
    if ((s->win = malloc(sizeof(win_t) + len)) != NULL) {
        s->win->refs = 1;
        s->win->len = len;
    } else {
        refuse(s->http, 503, "Service Unavailable", "out_of_memory", "out of memory");
        evbuffer_free(b);
        serve_free(s);
        return;
    }
    /* the length is known up front: a Content-Length, no chunked framing for the decode side to undo */
    uint64_t count = s->n_full - s->first, total = KVX_HDR_LEN + KVX_END_LEN
                     + (s->has_token ? KVX_TOK_LEN : 0)
                     + (s->ipc ? KVX_IPC_LEN + count * KVX_BLK_LEN
                               : count * (KVX_BLK_LEN + be->block_bytes));
    char clen[24];
    snprintf(clen, sizeof(clen), "%" PRIu64, total);
    evhttp_add_header(evhttp_request_get_output_headers(s->http), "Content-Type", KVX_CTYPE);
    evhttp_add_header(evhttp_request_get_output_headers(s->http), "Content-Length", clen);
    evhttp_send_reply_start(s->http, 200, "OK");
    kvx_header_encode(&h, hdr);
    evbuffer_add(b, hdr, sizeof(hdr));
    if (s->has_token) {
        uint8_t tok[KVX_TOK_LEN];
        kvx_token_encode(&s->token, tok);
        evbuffer_add(b, tok, sizeof(tok));
    }
    evhttp_send_reply_chunk(s->http, b);
    evbuffer_free(b);
    if (s->ipc) {
        if (send_ipc(s, &pool) != 0) {
            cut_short(s);
        }
        return;
    }
    send_more(s->conn, s);
}

/* The prompt's full blocks are in the cache: pin them and stream. */
static void pin_and_stream(serve_t *s)
{
    kvw_blocks_t *bm = kvw_sched_blocks(s->e);
    size_t got = kvw_blocks_pin_prefix(bm, &s->pin, s->pin.seed, s->req.prompt,
                                       s->req.n_prompt) / kvw_blocks_block_size(bm);

    if (got < s->n_full) {
        /* evicted between the prefill and now: only under heavy memory pressure */
        refuse(s->http, 503, "Service Unavailable", "prefill_evicted",
               "the prompt's blocks were evicted before they could be sent");
        serve_free(s);
        return;
    }
    start_stream(s);
}

/* The one token the prefill samples: sent to the decode side with the KV, when asked. */
static void hook_emit(kvw_req_t *r, uint32_t token, const char *text, size_t len)
{
    serve_t *s = r->front;

    if (s->want_token && !s->has_token) {
        s->token.token = token;
        s->token.rng = r->rng;
        s->has_token = 1;
    }
}

static void hook_emit_text(kvw_req_t *r, const char *text, size_t len) {}

static void hook_finish(kvw_req_t *r, kvw_finish_t why)
{
    serve_t *s = r->front;

    r->engine = NULL;
    s->computing = 0;
    s->st->computing--;
    if (why == KVW_FINISH_ABORT) {
        refuse(s->http, 503, "Service Unavailable", "engine_abort",
               "the engine aborted the prefill");
        serve_free(s);
        return;
    }
    pin_and_stream(s);
}

static const kvw_req_hooks_t hooks = { hook_emit, hook_emit_text, hook_finish };

static void on_timeout(evutil_socket_t fd, short what, void *arg)
{
    serve_t *s = arg;

    fprintf(stderr, "kvworker: transfer: timed out after %d ms (%s)\n",
            s->e->cfg->xfer_timeout_ms, s->streaming ? "streaming" : "computing");
    if (s->streaming && s->http == NULL)
        ;                                   /* CUDA IPC: the decode side held the pin too long */
    else if (s->streaming) {
        cut_short(s);                       /* no end frame: refused downstream */
        return;
    } else
        refuse(s->http, 503, "Service Unavailable", "prefill_timeout",
               "the prefill did not finish in time");
    serve_free(s);
}

static int parse_hex(json_t *v, uint64_t *out)
{
    const char *str = json_string_value(v);
    char *end;

    if (str == NULL || *str == '\0')
        return -1;
    *out = strtoull(str, &end, 16);
    return *end == '\0' ? 0 : -1;
}

/*
 * "sample" (optional): the decode side's sampling parameters, asking for the
 * first output token to come back with the KV (docs/PROTOCOL.md). The token
 * is sampled as the decode side would have: the same parameters and seed,
 * and the same default seed (a hash of the prompt) when none was given.
 */
static int parse_sample(serve_t *s, json_t *o)
{
    json_t *t = json_object_get(o, "temperature"), *p = json_object_get(o, "top_p");
    json_t *k = json_object_get(o, "top_k"), *seed = json_object_get(o, "seed");

    if (o == NULL)
        return 0;
    if (!json_is_object(o) || !json_is_number(t) || !json_is_number(p) || !json_is_integer(k)
        || !json_is_integer(seed) || !(json_number_value(t) >= 0)
        || !(json_number_value(p) > 0 && json_number_value(p) <= 1) || json_integer_value(k) < 0
        || json_integer_value(k) > INT32_MAX)
        return -1;
    s->want_token = 1;
    s->req.temperature = json_number_value(t);
    s->req.top_p = json_number_value(p);
    s->req.top_k = (int)json_integer_value(k);
    s->req.seed = (uint64_t)json_integer_value(seed);
    return 0;
}

/* Reads the request into s; on a refusal fills code/ecode/msg. */
static int parse(serve_t *s, const char *body, size_t len, int *code, const char **ecode,
                 char *msg, size_t msglen)
{
    kvw_engine_t *e = s->e;
    kvw_blocks_t *bm = kvw_sched_blocks(e);
    uint32_t bs = kvw_blocks_block_size(bm);
    json_error_t je;
    json_t *root = json_loadb(body, len, 0, &je), *v;
    uint64_t mfp = 0, lfp = 0;
    size_t i, n;
    int rc = -1;

    *code = 400;
    *ecode = "bad_transfer_request";
    if (root == NULL || !json_is_object(root)) {
        snprintf(msg, msglen, "transfer request is not a JSON object");
        goto out;
    }
    if (json_integer_value(json_object_get(root, "v")) != KVX_VERSION) {
        snprintf(msg, msglen, "transfer version must be %d", KVX_VERSION);
        goto out;
    }
    json_t *toks = json_object_get(root, "tokens"), *have = json_object_get(root, "have");
    json_t *salt = json_object_get(root, "cache_salt"), *lora = json_object_get(root, "lora");
    if (parse_hex(json_object_get(root, "model_fp"), &mfp)
        || parse_hex(json_object_get(root, "layout_fp"), &lfp)
        || !json_is_integer(json_object_get(root, "block_size"))
        || !json_is_array(toks) || json_array_size(toks) < 2 || !json_is_array(have)
        || !(salt == NULL || json_is_null(salt) || json_is_string(salt))
        || !(lora == NULL || json_is_null(lora) || json_is_string(lora))) {
        snprintf(msg, msglen, "transfer request needs model_fp, layout_fp (hex), block_size, "
                 "tokens (2 or more), have (a list), cache_salt and lora (string or null)");
        goto out;
    }
    *code = 409;
    if (json_integer_value(json_object_get(root, "block_size")) != (json_int_t)bs) {
        *ecode = "block_size_mismatch";
        snprintf(msg, msglen, "block size %" JSON_INTEGER_FORMAT ", this worker's is %u",
                 json_integer_value(json_object_get(root, "block_size")), bs);
        goto out;
    }
    if (mfp != kvw_xfer_model_fp(e)) {
        *ecode = "model_mismatch";
        snprintf(msg, msglen, "model fingerprint %016" PRIx64 ", this worker serves '%.64s' "
                 "(%016" PRIx64 ")", mfp, e->cfg->model, kvw_xfer_model_fp(e));
        goto out;
    }
    if (lfp != kvw_xfer_layout_fp(e)) {
        *ecode = "layout_mismatch";
        snprintf(msg, msglen, "KV layout fingerprint %016" PRIx64 ", this worker's is %016"
                 PRIx64, lfp, kvw_xfer_layout_fp(e));
        goto out;
    }
    if (json_is_string(lora)
        && kv_model_role(e->cfg->model, e->cfg->lora_modules, json_string_value(lora))
           != KV_MODEL_LORA) {
        *ecode = "model_mismatch";
        snprintf(msg, msglen, "LoRA adapter '%.64s' is not served here",
                 json_string_value(lora));
        goto out;
    }
    /* the adapter's blocks are prefilled under its name: submit() seeds them with it */
    s->req.lora = json_is_string(lora);
    s->req.model = strdup(s->req.lora ? json_string_value(lora) : e->cfg->model);
    n = json_array_size(toks);
    s->req.prompt = malloc(n * sizeof(uint32_t));
    s->n_full = (uint32_t)((n - 1) / bs);
    s->seq = malloc((s->n_full + 1) * sizeof(uint64_t));
    s->local = malloc((s->n_full + 1) * sizeof(uint64_t));
    if (s->req.model == NULL || s->req.prompt == NULL || s->seq == NULL || s->local == NULL) {
        *code = 503;
        *ecode = "out_of_memory";
        snprintf(msg, msglen, "out of memory");
        goto out;
    }
    json_array_foreach(toks, i, v) {
        json_int_t t = json_integer_value(v);
        if (!json_is_integer(v) || t < 0 || t > 0xffffffffLL) {
            *code = 400;
            snprintf(msg, msglen, "tokens must be integers in [0, 2^32)");
            goto out;
        }
        s->req.prompt[i] = (uint32_t)t;
    }
    s->req.n_prompt = n;
    if (json_is_string(salt) && (s->req.cache_salt = strdup(json_string_value(salt))) == NULL) {
        *code = 503;
        *ecode = "out_of_memory";
        snprintf(msg, msglen, "out of memory");
        goto out;
    }
    s->pin.seed = kvw_blocks_seed(s->req.cache_salt, s->req.lora ? s->req.model : NULL);
    kv_hash_blocks(s->req.prompt, (size_t)s->n_full * bs, bs, s->pin.seed, s->local, s->seq);
    if (json_array_size(have) > s->n_full) {
        *ecode = "hash_mismatch";
        snprintf(msg, msglen, "have lists %zu blocks, the prompt has %u full ones to send",
                 json_array_size(have), s->n_full);
        goto out;
    }
    json_array_foreach(have, i, v) {
        uint64_t h;
        if (parse_hex(v, &h) || h != s->seq[i]) {
            *ecode = "hash_mismatch";
            snprintf(msg, msglen, "have[%zu] is not the sequence hash of the prompt's block %zu "
                     "(cache salt or tokenizer differ?)", i, i);
            goto out;
        }
    }
    s->first = (uint32_t)json_array_size(have);
    /* CUDA IPC, offered by a decode side on this machine, where this engine can export */
    json_t *ipc = json_object_get(root, "ipc");
    const char *node = json_string_value(json_object_get(ipc, "node"));
    kvw_backend_t *be = kvw_sched_backend(e);
    s->ipc_offered = node && *node && strcmp(node, kvw_xfer_node_id()) == 0 && be->ipc_export
                     && be->block_bytes;
    if (parse_sample(s, json_object_get(root, "sample")) != 0) {
        *code = 400;
        snprintf(msg, msglen, "sample must be an object of temperature >= 0, top_p in (0, 1], "
                 "top_k >= 0 and an integer seed");
        goto out;
    }
    rc = 0;
out:
    json_decref(root);
    return rc;
}

void kvw_xfer_serve(kvw_engine_t *e, kvw_xfer_stats_t *st, struct evhttp_request *req)
{
    struct evbuffer *in = evhttp_request_get_input_buffer(req);
    size_t len = evbuffer_get_length(in);
    const char *body = (const char *)evbuffer_pullup(in, -1);
    const char *ecode;
    char msg[256];
    int code;
    serve_t *s;

    if (evhttp_request_get_command(req) != EVHTTP_REQ_POST) {
        evhttp_add_header(evhttp_request_get_output_headers(req), "Allow", "POST");
        refuse(req, 405, "Method Not Allowed", "method_not_allowed", "use POST");
        return;
    }
    if (e->unhealthy) {
        refuse(req, 503, "Service Unavailable", "engine_unhealthy", e->unhealthy);
        return;
    }
    if ((s = calloc(1, sizeof(*s))) == NULL) {
        refuse(req, 503, "Service Unavailable", "out_of_memory", "out of memory");
        return;
    }
    s->e = e;
    s->st = st;
    s->http = req;
    if (parse(s, body ? body : "", len, &code, &ecode, msg, sizeof(msg)) != 0) {
        st->refused++;
        fprintf(stderr, "kvworker: transfer refused: %s\n", msg);
        refuse(req, code, code == 409 ? "Conflict" : code == 503 ? "Service Unavailable"
                                                                 : "Bad Request", ecode, msg);
        serve_free(s);
        return;
    }
    /* conditional disaggregation: a busy prefill worker tells the decode side to do it itself */
    kvw_sched_load_t load;
    kvw_sched_load(e, &load);
    if (st->computing + load.waiting >= (uint32_t)e->cfg->prefill_queue_limit) {
        st->overloaded++;
        snprintf(msg, sizeof(msg), "prefill queue full (%u queued, limit %d)",
                 st->computing + load.waiting, e->cfg->prefill_queue_limit);
        refuse(req, 503, "Service Unavailable", "prefill_overloaded", msg);
        serve_free(s);
        return;
    }
    s->conn = evhttp_request_get_connection(req);
    evhttp_connection_set_closecb(s->conn, on_close, s);
    /* libevent writes 16 KB per callback by default: a transfer is MBs */
    bufferevent_set_max_single_write(evhttp_connection_get_bufferevent(s->conn), 1 << 20);
    s->timer = evtimer_new(e->base, on_timeout, s);
    if (s->timer) {
        struct timeval tv = { e->cfg->xfer_timeout_ms / 1000, (e->cfg->xfer_timeout_ms % 1000) * 1000 };
        evtimer_add(s->timer, &tv);
    }
    if (s->n_full == s->first) {        /* nothing to compute or send beyond the header */
        start_stream(s);
        return;
    }
    if (kvw_blocks_lookup(kvw_sched_blocks(e), s->pin.seed, s->req.prompt, s->req.n_prompt,
                          NULL) >= s->n_full) {
        pin_and_stream(s);              /* all cached here already */
        return;
    }
    s->req.max_tokens = 1;
    s->req.ignore_eos = 1;
    if (!s->want_token) {
        s->req.temperature = 0;
        s->req.top_p = 1;
    }
    s->req.hooks = &hooks;
    s->req.front = s;
    s->req.engine = e;
    int rc = e->ops->submit(e, &s->req);
    if (rc != 0) {
        s->req.engine = NULL;
        if (rc == KVW_SUBMIT_TOO_LONG)
            refuse(req, 400, "Bad Request", "context_length_exceeded",
                   "the prompt is longer than this engine's context");
        else
            refuse(req, 503, "Service Unavailable", "server_overloaded",
                   "engine cannot take the prefill");
        serve_free(s);
        return;
    }
    s->computing = 1;
    st->computing++;
}
