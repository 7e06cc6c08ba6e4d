/*
 * The decode side of a KV transfer. For a request that names a prefill
 * worker it decides first whether to disaggregate at all (conditional
 * disaggregation, as Dynamo does: a prompt whose uncached part is shorter
 * than --disagg-min-tokens is prefilled here), then references the cached
 * prefix and allocates the blocks the transfer will fill, asks the prefill
 * worker for the rest, and checks every frame as it arrives
 * (kvw_xfer_wire.h). The blocks stay private (unregistered, invisible to the
 * prefix cache and the index) until the whole transfer is in and verified;
 * only then are they committed, which publishes their Stored events. Any
 * failure (refusal, overload, timeout, a dead or lying peer) releases them,
 * and the request is prefilled locally: never a client error.
 *
 * The mock engine moves a manifest (hashes only) and charges the link time
 * its modelled KV would take: blocks x block_size x --kv-bytes-per-token
 * bytes at --link-gbps.
 */
#include <errno.h>
#include <inttypes.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <jansson.h>

#include "kv_hash.h"
#include "kvw_sched.h"
#include "kvw_xfer.h"
#include "kvw_xfer_wire.h"

struct kvw_pull {
    kvw_engine_t               *e;
    kvw_xfer_stats_t           *st;
    kvw_blocks_t               *bm;
    kvw_backend_t              *be;
    const kvw_req_t            *r;
    int                         fd;         /* the connection to the prefill worker, or -1 */
    struct event               *io;
    struct evbuffer            *out;        /* the request, not yet written */
    struct evbuffer            *raw;        /* the reply's head, until it is whole */
    int                         phase;      /* 0 connecting, 1 writing, 2 head, 3 body, 4 read */
    int                         status;     /* the reply's HTTP status */
    uint64_t                    body_left;  /* of its Content-Length */
    kvw_seq_blocks_t            pin;
    uint64_t                   *seq, *local;
    uint32_t                    have, n_full;
    kvx_rx_t                    rx;
    struct evbuffer            *in;         /* received, not yet parsed */
    uint8_t                    *stage;      /* the frame being checked */
    struct event               *deadline;
    struct event               *fin;        /* the end, run outside libevent's callbacks */
    struct event               *again;      /* CUDA IPC failed: ask again for bytes */
    char                        host[256], addr[64];
    int                         port;
    int                         over;       /* result decided: ignore further callbacks */
    int                         offer_ipc;  /* this request offers CUDA IPC */
    int                         retrying;   /* IPC failed: this reply is ignored, on_again asks again */
    void                       *peer;       /* the prefill side's pool, mapped (IPC) */
    uint64_t                   *src;        /* IPC: each block's offset in it, by prompt index */
    int                         ok;
    char                        why[320];
    kvw_pull_done_fn            done;
    void                       *arg;
    struct timespec             t0;
};

static double since(const struct timespec *t0)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)(t.tv_sec - t0->tv_sec) + (double)(t.tv_nsec - t0->tv_nsec) / 1e9;
}

static void close_conn(kvw_pull_t *p)
{
    if (p->io) {
        event_free(p->io);
        p->io = NULL;
    }
    if (p->fd >= 0) {
        close(p->fd);
        p->fd = -1;
    }
    if (p->out)
        evbuffer_drain(p->out, evbuffer_get_length(p->out));
    if (p->raw)
        evbuffer_drain(p->raw, evbuffer_get_length(p->raw));
}

static void pull_free(kvw_pull_t *p)
{
    close_conn(p);                      /* after an IPC copy: lets the prefill side unpin */
    if (p->pin.table)
        kvw_blocks_release(p->bm, &p->pin);
    /* the blocks this pull allocated may have evicted cached ones: their
     * Removed events go out now, not at the idle engine's next step */
    kvw_blocks_flush(p->bm);
    if (p->deadline)
        event_free(p->deadline);
    if (p->fin)
        event_free(p->fin);
    if (p->again)
        event_free(p->again);
    if (p->in)
        evbuffer_free(p->in);
    if (p->out)
        evbuffer_free(p->out);
    if (p->raw)
        evbuffer_free(p->raw);
    free(p->seq);
    free(p->local);
    free(p->stage);
    free(p->src);
    free(p);
}

static int send_request(kvw_pull_t *p);
static void conclude(kvw_pull_t *p, int ok, double delay_s, const char *why);

/*
 * CUDA IPC failed on this side (the handle would not open, a copy failed):
 * the blocks allocated for the transfer are untouched, so the same pull asks
 * the prefill worker again without offering IPC, for the byte stream (its
 * prefix cache has the prompt by now). The address is remembered so later
 * pulls from it do not offer IPC again. Run from the event loop, never from
 * inside the connection's callbacks (the connection is freed here).
 */
static void on_again(evutil_socket_t fd, short what, void *arg)
{
    kvw_pull_t *p = arg;

    if (p->over)
        return;                         /* the deadline passed meanwhile */
    close_conn(p);                      /* the IPC reply: lets the prefill side unpin */
    evbuffer_drain(p->in, evbuffer_get_length(p->in));
    p->rx.state = 0;
    p->rx.got = 0;
    p->rx.ipc = 0;
    p->rx.ipc_offered = 0;
    p->offer_ipc = 0;
    p->peer = NULL;
    p->retrying = 0;
    if (send_request(p) != 0)
        conclude(p, 0, 0, "cannot send the transfer request again (after CUDA IPC failed)");
}

static void ipc_failed(kvw_pull_t *p, const char *why)
{
    kvw_xfer_stats_t *st = p->st;

    if (p->over || p->retrying)
        return;
    fprintf(stderr, "kvworker: transfer from %s: CUDA IPC failed, pulling bytes: %s\n", p->addr,
            why);
    st->ipc_fallbacks++;
    snprintf(st->ipc_off[st->n_ipc_off++ % 8], sizeof(st->ipc_off[0]), "%s", p->addr);
    p->retrying = 1;                    /* ignore the rest of this reply */
    struct timeval tv = { 0, 0 };
    evtimer_add(p->again, &tv);
}

static int ipc_refused_before(const kvw_xfer_stats_t *st, const char *addr)
{
    for (unsigned i = 0; i < 8 && i < st->n_ipc_off; i++)
        if (strcmp(st->ipc_off[i], addr) == 0)
            return 1;
    return 0;
}

/* Decides the outcome once; the end runs from the event loop (on_fin). */
static void conclude(kvw_pull_t *p, int ok, double delay_s, const char *why)
{
    if (p->over)
        return;
    p->over = 1;
    p->ok = ok;
    if (p->io)
        event_del(p->io);               /* nothing more is read (the connection closes at the end) */
    if (why)
        snprintf(p->why, sizeof(p->why), "%s", why);
    event_del(p->deadline);
    struct timeval tv = { (time_t)delay_s, (suseconds_t)((delay_s - (double)(time_t)delay_s) * 1e6) };
    evtimer_add(p->fin, &tv);
}

static void on_fin(evutil_socket_t fd, short what, void *arg)
{
    kvw_pull_t *p = arg;
    kvw_pull_done_fn done = p->done;
    void *darg = p->arg;

    close_conn(p);
    if (p->ok) {
        /* complete and verified: now, and only now, the blocks join the cache */
        kvw_blocks_commit(p->bm, &p->pin, p->r->prompt,
                          (size_t)p->n_full * kvw_blocks_block_size(p->bm));
        kvw_blocks_flush(p->bm);
        p->st->pulled++;
        p->st->pull_s += since(&p->t0);
        kvw_seq_blocks_t pin = p->pin;
        kvx_token_t first = p->rx.token;
        int has_first = p->rx.has_token;
        memset(&p->pin, 0, sizeof(p->pin));
        pull_free(p);
        done(darg, &pin, has_first ? &first : NULL, NULL);  /* which submits (or releases) pin */
        return;
    }
    char why[sizeof(p->why)];
    snprintf(why, sizeof(why), "%s", p->why);
    p->st->fallbacks++;
    pull_free(p);       /* releases the half-filled blocks: never used */
    done(darg, NULL, NULL, why);
}

static void fail(kvw_pull_t *p, const char *fmt, const char *detail)
{
    char why[320];

    snprintf(why, sizeof(why), fmt, detail);
    conclude(p, 0, 0, why);
}

/*
 * A pool in host memory (the cpu engine): the payload is copied out of the
 * receive buffer straight into the block allocated for it and checked there
 * (hashes, checksum). The block is private until the whole transfer is in
 * and verified, so bytes that fail a check are never used: the pull fails
 * and the block is released.
 */
static void receive_in_place(kvw_pull_t *p)
{
    size_t bb = (size_t)p->rx.block_bytes;
    uint32_t want = (uint32_t)kvx_rx_next_block(&p->rx);
    uint8_t *dst = want < p->n_full ? p->be->block_ptr(p->be, p->pin.table[want]) : NULL;
    struct evbuffer_ptr at;
    kvx_block_t blk;
    char why[200];

    if (dst == NULL || evbuffer_copyout(p->in, p->stage, KVX_BLK_LEN) != KVX_BLK_LEN
        || evbuffer_ptr_set(p->in, &at, KVX_BLK_LEN, EVBUFFER_PTR_SET) != 0
        || evbuffer_copyout_from(p->in, &at, dst, bb) != (ev_ssize_t)bb) {
        fail(p, "%s", "cannot read the receive buffer");
        return;
    }
    if (kvx_rx_block(&p->rx, p->stage, dst, &blk, why, sizeof(why)) != KVX_BLOCK) {
        fail(p, "refused the transfer: %s", why);
        return;
    }
    p->st->pulled_blocks++;
    p->st->pulled_bytes += bb;
    evbuffer_drain(p->in, KVX_BLK_LEN + bb);
}

/* Everything received so far, frame by frame: verified blocks are written at once. */
static void parse(kvw_pull_t *p)
{
    char why[200];

    while (!p->over && !p->retrying) {
        size_t need = kvx_rx_need(&p->rx), used = 0;
        if (need == 0) {
            if (evbuffer_get_length(p->in) > 0)
                fail(p, "%s", "bytes after the end of the transfer");
            return;
        }
        if (evbuffer_get_length(p->in) < need)
            return;
        if (kvx_rx_next_block(&p->rx) >= 0 && !p->rx.ipc && p->rx.block_bytes
            && p->be->block_ptr) {
            receive_in_place(p);
            continue;
        }
        /* one copy, into a staging buffer reused for every frame */
        if (evbuffer_copyout(p->in, p->stage, need) != (ev_ssize_t)need) {
            fail(p, "%s", "cannot read the receive buffer");
            return;
        }
        const uint8_t *buf = p->stage, *payload = NULL;
        kvx_block_t blk;
        kvx_rx_ev_t ev = kvx_rx_feed(&p->rx, buf, need, &used, &blk, &payload, why, sizeof(why));

        if (ev == KVX_ERROR) {
            fail(p, "refused the transfer: %s", why);
            return;
        }
        if (ev == KVX_IPC) {
            char err[256];
            p->peer = p->be->ipc_open(p->be, p->rx.pool.handle, p->rx.pool.pool_bytes, err,
                                      sizeof(err));
            if (p->peer == NULL) {
                ipc_failed(p, err);
                return;
            }
        }
        if (ev == KVX_BLOCK && p->rx.ipc) {
            p->src[blk.index] = blk.checksum;   /* copied once the whole stream is verified */
        } else if (ev == KVX_BLOCK) {
            if (p->rx.block_bytes
                && p->be->block_write(p->be, p->pin.table[blk.index], payload) != 0) {
                fail(p, "%s", "block_write failed");
                return;
            }
            p->st->pulled_blocks++;
            p->st->pulled_bytes += p->rx.block_bytes;
        }
        evbuffer_drain(p->in, used);
    }
}

/* The reply is complete: a whole, verified stream and nothing after it is a success. */
static void complete(kvw_pull_t *p)
{
    double link_s = 0;

    parse(p);
    if (p->over || p->retrying)
        return;
    if (kvx_rx_need(&p->rx) != 0) {
        fail(p, "%s", "the transfer stream ended early (truncated)");
        return;
    }
    if (p->rx.ipc) {
        /* every frame verified: copy the blocks from the prefill side's pool, then commit */
        char err[256];
        uint32_t n = p->n_full - p->have;
        if (p->be->blocks_copy_peer(p->be, p->peer, p->src + p->have, p->pin.table + p->have, n,
                                    err, sizeof(err)) != 0) {
            ipc_failed(p, err);
            return;
        }
        p->st->pulled_ipc++;
        p->st->pulled_blocks += n;
        p->st->pulled_bytes += (uint64_t)n * p->rx.block_bytes;
    }
    if (p->be->simulated) {
        /* the mock's manifest: charge what its KV would take on the link */
        double bytes = (double)p->rx.count * kvw_xfer_block_bytes(p->e);
        link_s = bytes * 8 / (p->e->cfg->link_gbps * 1e9);
        p->st->link_s += link_s;
        p->st->pulled_bytes += (uint64_t)bytes;
    }
    conclude(p, 1, link_s, NULL);
}

/* A refusal (not 200): its JSON reason, for the fallback message. */
static void refused(kvw_pull_t *p)
{
    char msg[300];
    size_t n = evbuffer_get_length(p->in);
    char *body = (char *)evbuffer_pullup(p->in, -1);
    json_t *j = body ? json_loadb(body, n, 0, NULL) : NULL;
    const char *m = json_string_value(json_object_get(json_object_get(j, "error"), "message"));
    const char *c = json_string_value(json_object_get(json_object_get(j, "error"), "code"));

    snprintf(msg, sizeof(msg), "prefill worker answered %d %s: %s", p->status, c ? c : "",
             m ? m : "(no reason)");
    json_decref(j);
    conclude(p, 0, 0, msg);
}

/*
 * The reply's head: status line and headers, up to the blank line. The
 * stream comes with a Content-Length (the prefill side knows it up front),
 * as does a refusal; anything else is not a reply this protocol knows.
 */
static int read_head(kvw_pull_t *p)
{
    struct evbuffer_ptr end = evbuffer_search(p->raw, "\r\n\r\n", 4, NULL);
    long long clen = -1;

    if (end.pos < 0) {
        if (evbuffer_get_length(p->raw) > 16384) {
            fail(p, "%s", "prefill worker: invalid HTTP from the prefill worker");
            return -1;
        }
        return 0;
    }
    size_t hlen = (size_t)end.pos + 4;
    char *h = malloc(hlen + 1);
    if (h == NULL) {
        fail(p, "%s", "out of memory");
        return -1;
    }
    evbuffer_remove(p->raw, h, hlen);
    h[hlen] = '\0';
    if (sscanf(h, "HTTP/1.%*[01] %d", &p->status) != 1 || p->status < 100 || p->status > 599) {
        free(h);
        fail(p, "%s", "prefill worker: invalid HTTP from the prefill worker");
        return -1;
    }
    for (char *line = strstr(h, "\r\n"); line && line[2] != '\r'; line = strstr(line + 2, "\r\n")) {
        if (strncasecmp(line + 2, "Content-Length:", 15) == 0)
            clen = strtoll(line + 17, NULL, 10);
        else if (strncasecmp(line + 2, "Transfer-Encoding:", 18) == 0)
            clen = -2;
    }
    free(h);
    if (clen < 0) {
        fail(p, "%s", clen == -2 ? "prefill worker: a chunked reply (this protocol sends a "
             "Content-Length)" : "prefill worker: a reply without Content-Length");
        return -1;
    }
    p->body_left = (uint64_t)clen;
    p->phase = 3;
    /* what came with the head is the body's start */
    size_t have = evbuffer_get_length(p->raw);
    if (have > p->body_left) {
        fail(p, "%s", "prefill worker: bytes after the reply");
        return -1;
    }
    p->body_left -= have;
    evbuffer_add_buffer(p->in, p->raw);
    return 1;
}

/* The body so far: frames checked as they arrive; at its end, the outcome. */
static void read_body(kvw_pull_t *p)
{
    if (p->status != 200) {
        if (evbuffer_get_length(p->in) > 1024)      /* keep the reason's first bytes */
            evbuffer_drain(p->in, evbuffer_get_length(p->in) - 1024);
    } else {
        parse(p);
    }
    if (p->over || p->retrying || p->body_left > 0)
        return;
    p->phase = 4;
    event_del(p->io);                   /* the connection stays open until the end (IPC) */
    if (p->status != 200)
        refused(p);
    else
        complete(p);
}

/*
 * The connection to the prefill worker, by hand rather than through
 * evhttp's client: libevent 2.1 reads at most 4 KB per wakeup, which made
 * the receiving side the transfer's bottleneck (a syscall round per 4 KB).
 * Here each wakeup reads everything there is, up to 4 MB, into the
 * receive buffer's own chains (no copy).
 */
static void on_io(evutil_socket_t fd, short what, void *arg)
{
    kvw_pull_t *p = arg;

    if (p->over || p->retrying)
        return;
    if (p->phase <= 1) {
        if (p->phase == 0) {
            int err = 0;
            socklen_t len = sizeof(err);
            if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) {
                fail(p, "%s", "prefill worker unreachable or the connection failed");
                return;
            }
            p->phase = 1;
        }
        if (evbuffer_write(p->out, fd) < 0 && errno != EAGAIN && errno != EINTR) {
            fail(p, "%s", "prefill worker unreachable or the connection failed");
            return;
        }
        if (evbuffer_get_length(p->out) > 0)
            return;
        p->phase = 2;
        event_del(p->io);
        event_assign(p->io, p->e->base, fd, EV_READ | EV_PERSIST, on_io, p);
        event_add(p->io, NULL);
        return;
    }
    for (size_t got = 0; got < (4u << 20) && !p->over && !p->retrying && p->phase >= 2
                         && p->phase < 4;) {
        struct evbuffer *dst = p->phase == 2 ? p->raw : p->in;
        struct evbuffer_iovec v[2];
        size_t want = p->phase == 3 && p->body_left < (1u << 20) ? (size_t)p->body_left + 1
                                                                 : (size_t)1 << 20;
        int n = evbuffer_reserve_space(dst, (ev_ssize_t)want, v, 2);
        if (n <= 0) {
            fail(p, "%s", "out of memory");
            return;
        }
        if (v[0].iov_len > want) {
            v[0].iov_len = want;
            n = 1;
        } else if (n == 2 && v[0].iov_len + v[1].iov_len > want) {
            v[1].iov_len = want - v[0].iov_len;
        }
        ssize_t r = readv(fd, (struct iovec *)v, n);
        if (r < 0) {
            evbuffer_commit_space(dst, v, 0);
            if (errno == EAGAIN || errno == EINTR)
                return;
            fail(p, "%s", "prefill worker: connection error");
            return;
        }
        if (r == 0) {
            evbuffer_commit_space(dst, v, 0);
            if (p->phase == 3 && p->status == 200)
                parse(p);               /* a broken frame says more than the EOF */
            fail(p, "%s", p->phase == 2 && evbuffer_get_length(p->raw) == 0
                 ? "prefill worker unreachable or the connection failed"
                 : "prefill worker: connection closed mid-transfer");
            return;
        }
        size_t left = (size_t)r;
        for (int i = 0; i < n; i++) {
            if (v[i].iov_len > left)
                v[i].iov_len = left;
            left -= v[i].iov_len;
        }
        evbuffer_commit_space(dst, v, n);
        got += (size_t)r;
        if (p->phase == 2 && read_head(p) <= 0)
            continue;                   /* more head to come, or failed */
        if (p->phase == 3 && dst == p->in) {
            if ((uint64_t)r > p->body_left) {
                fail(p, "%s", "prefill worker: bytes after the reply");
                return;
            }
            p->body_left -= (uint64_t)r;
        }
        read_body(p);
    }
}

static void on_deadline(evutil_socket_t fd, short what, void *arg)
{
    kvw_pull_t *p = arg;
    char why[64];

    snprintf(why, sizeof(why), "transfer timed out after %d ms", p->e->cfg->xfer_timeout_ms);
    conclude(p, 0, 0, why);
}

/* host:port or [v6]:port */
static int split_addr(const char *addr, char *host, size_t hn, int *port)
{
    const char *colon = strrchr(addr, ':');
    char *end;

    if (colon == NULL || colon == addr || (size_t)(colon - addr) >= hn)
        return -1;
    long v = strtol(colon + 1, &end, 10);
    if (*end != '\0' || v < 1 || v > 65535)
        return -1;
    if (addr[0] == '[' && colon[-1] == ']') {
        memcpy(host, addr + 1, (size_t)(colon - addr) - 2);
        host[colon - addr - 2] = '\0';
    } else {
        memcpy(host, addr, (size_t)(colon - addr));
        host[colon - addr] = '\0';
    }
    *port = (int)v;
    return host[0] ? 0 : -1;
}

static char *request_body(kvw_pull_t *p)
{
    json_t *toks = json_array(), *have = json_array();
    char hex[17];

    for (size_t i = 0; i < p->r->n_prompt; i++)
        json_array_append_new(toks, json_integer(p->r->prompt[i]));
    for (uint32_t i = 0; i < p->have; i++) {
        snprintf(hex, sizeof(hex), "%016" PRIx64, p->seq[i]);
        json_array_append_new(have, json_string(hex));
    }
    json_t *j = json_pack("{s:i,s:s,s:s%,s:s%,s:i,s:s?,s:o,s:o}", "v", KVX_VERSION,
                          "model", p->e->cfg->model, "model_fp", "", 0, "layout_fp", "", 0,
                          "block_size", (int)kvw_blocks_block_size(p->bm),
                          "cache_salt", p->r->cache_salt, "tokens", toks, "have", have);
    snprintf(hex, sizeof(hex), "%016" PRIx64, kvw_xfer_model_fp(p->e));
    json_object_set_new(j, "model_fp", json_string(hex));
    snprintf(hex, sizeof(hex), "%016" PRIx64, kvw_xfer_layout_fp(p->e));
    json_object_set_new(j, "layout_fp", json_string(hex));
    if (p->r->lora)         /* the adapter's blocks, hashed with its name */
        json_object_set_new(j, "lora", json_string(p->r->model));
    if (p->offer_ipc)
        json_object_set_new(j, "ipc", json_pack("{s:s}", "node", kvw_xfer_node_id()));
    /* ask for the first output token, sampled as this side would sample it */
    json_object_set_new(j, "sample", json_pack("{s:f,s:f,s:i,s:I}", "temperature",
                                               p->r->temperature, "top_p", p->r->top_p,
                                               "top_k", p->r->top_k, "seed",
                                               (json_int_t)p->r->seed));
    char *s = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    return s;
}

static int send_request(kvw_pull_t *p)
{
    kvw_engine_t *e = p->e;
    struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM }, *ai = NULL;
    char port[8], *body = request_body(p);

    p->phase = 0;
    p->status = 0;
    p->body_left = 0;
    snprintf(port, sizeof(port), "%d", p->port);
    if (body == NULL || getaddrinfo(p->host, port, &hints, &ai) != 0 || ai == NULL) {
        free(body);
        if (ai)
            freeaddrinfo(ai);
        return -1;
    }
    p->fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    int rc = p->fd < 0 ? -1 : connect(p->fd, ai->ai_addr, ai->ai_addrlen);
    freeaddrinfo(ai);
    if (p->fd < 0 || (rc != 0 && errno != EINPROGRESS)) {
        free(body);
        close_conn(p);
        return -1;
    }
    evbuffer_add_printf(p->out, "POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                        "Accept: %s\r\nContent-Length: %zu\r\n\r\n", KVX_PATH, p->addr,
                        KVX_CTYPE, strlen(body));
    evbuffer_add(p->out, body, strlen(body));
    free(body);
    p->io = event_new(e->base, p->fd, EV_WRITE | EV_PERSIST, on_io, p);
    if (p->io == NULL || event_add(p->io, NULL) != 0) {
        close_conn(p);
        return -1;
    }
    return 0;
}

kvw_pull_t *kvw_pull_start(kvw_engine_t *e, kvw_xfer_stats_t *st, const kvw_req_t *r,
                           const char *addr, kvw_pull_done_fn done, void *arg,
                           const char **why)
{
    kvw_blocks_t *bm = kvw_sched_blocks(e);
    uint32_t bs = kvw_blocks_block_size(bm);
    uint64_t seed = kvw_blocks_seed(r->cache_salt, r->lora ? r->model : NULL);
    char host[256];
    int port;

    if (split_addr(addr, host, sizeof(host), &port) != 0) {
        *why = "bad prefill address (host:port)";
        return NULL;
    }
    if (r->n_prompt < 2 || !e->cfg->enable_prefix_caching) {
        *why = r->n_prompt < 2 ? "prompt too short" : "prefix caching is off";
        return NULL;
    }
    kvw_pull_t *p = calloc(1, sizeof(*p));
    if (p == NULL) {
        *why = "out of memory";
        return NULL;
    }
    p->fd = -1;
    p->e = e;
    p->st = st;
    p->bm = bm;
    p->be = kvw_sched_backend(e);
    p->r = r;
    p->done = done;
    p->arg = arg;
    clock_gettime(CLOCK_MONOTONIC, &p->t0);
    p->n_full = (uint32_t)((r->n_prompt - 1) / bs);
    p->seq = malloc((p->n_full + 1) * sizeof(uint64_t));
    p->local = malloc((p->n_full + 1) * sizeof(uint64_t));
    p->in = evbuffer_new();
    p->out = evbuffer_new();
    p->raw = evbuffer_new();
    p->fd = -1;
    p->deadline = evtimer_new(e->base, on_deadline, p);
    p->fin = evtimer_new(e->base, on_fin, p);
    p->again = evtimer_new(e->base, on_again, p);
    p->src = calloc(p->n_full + 1, sizeof(uint64_t));
    if (p->seq == NULL || p->local == NULL || p->in == NULL || p->out == NULL || p->raw == NULL
        || p->deadline == NULL
        || p->fin == NULL || p->again == NULL || p->src == NULL) {
        *why = "out of memory";
        pull_free(p);
        return NULL;
    }
    kv_hash_blocks(r->prompt, (size_t)p->n_full * bs, bs, seed, p->local, p->seq);
    p->have = (uint32_t)(kvw_blocks_pin_prefix(bm, &p->pin, seed, r->prompt, r->n_prompt) / bs);
    if (r->n_prompt - (size_t)p->have * bs < (size_t)e->cfg->disagg_min_tokens
        || p->have >= p->n_full) {
        *why = "uncached part of the prompt is short: prefilled locally";
        pull_free(p);
        return NULL;
    }
    /* the transfer's target: allocated now, filled by it, registered when verified */
    if (kvw_blocks_reserve(bm, &p->pin, (size_t)p->n_full * bs) != 0) {
        *why = "no free KV blocks to receive the transfer";
        pull_free(p);
        return NULL;
    }
    p->stage = malloc(KVX_HDR_LEN + KVX_BLK_LEN + p->be->block_bytes);
    if (p->stage == NULL) {
        *why = "out of memory";
        pull_free(p);
        return NULL;
    }
    p->rx.model_fp = kvw_xfer_model_fp(e);
    p->rx.layout_fp = kvw_xfer_layout_fp(e);
    p->rx.block_bytes = p->be->block_bytes;
    p->rx.block_size = bs;
    p->rx.first = p->have;
    p->rx.count = p->n_full - p->have;
    p->rx.seq = p->seq;
    p->rx.local = p->local;

    p->offer_ipc = p->be->ipc_open && p->be->blocks_copy_peer && p->be->block_bytes
                   && kvw_xfer_node_id()[0] && !ipc_refused_before(st, addr);
    p->rx.ipc_offered = p->offer_ipc;
    p->rx.token_asked = 1;
    snprintf(p->host, sizeof(p->host), "%s", host);
    snprintf(p->addr, sizeof(p->addr), "%s", addr);
    p->port = port;
    if (send_request(p) != 0) {
        *why = "cannot send the transfer request";
        pull_free(p);
        return NULL;
    }
    struct timeval tv = { e->cfg->xfer_timeout_ms / 1000, (e->cfg->xfer_timeout_ms % 1000) * 1000 };
    evtimer_add(p->deadline, &tv);
    return p;
}

void kvw_pull_cancel(kvw_pull_t *p)
{
    p->over = 1;
    pull_free(p);
}
