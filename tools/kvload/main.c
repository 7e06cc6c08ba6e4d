/*
 * kvload: an open-loop HTTP load generator for kvworker fleets, small
 * enough to leave the CPU to the workers it measures. Requests arrive at a
 * fixed rate spread over ports PORT..PORT+N-1 (each engine of a
 * `kvworker --engines N`), on a few keep-alive connections per port, and
 * the summary is one JSON line: achieved rate, errors, latency percentiles,
 * the generator's own CPU time.
 *
 *   kvload --port 9000 --engines 64 --rate 1000 --duration 10
 *          [--prompt-len 256] [--max-tokens 16] [--conns 4] [--groups 32]
 *
 * Prompts share one of --groups prefixes (half the prompt) so the prefix
 * cache sees realistic reuse; the rest is unique per request.
 */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>

typedef struct {
    const char *host;
    int         port, engines, conns, prompt_len, max_tokens, groups;
    double      rate, duration;
} opts_t;

typedef struct {
    opts_t                      o;
    struct event_base          *base;
    struct evhttp_connection  **conns;      /* engines * conns */
    int                        *busy;       /* in flight per connection */
    struct event               *tick;
    double                      t0, next_due;
    uint64_t                    sent, done, errors, dropped, seq;
    double                     *lat;        /* ms, one per completed request */
    size_t                      n_lat, cap_lat;
    int                         stopping;
} load_t;

typedef struct {
    load_t     *l;
    int         conn;
    double      t;
} inflight_t;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void record(load_t *l, double ms)
{
    if (l->n_lat == l->cap_lat) {
        size_t c = l->cap_lat ? l->cap_lat * 2 : 4096;
        double *p = realloc(l->lat, c * sizeof(double));
        if (p == NULL)
            return;
        l->lat = p;
        l->cap_lat = c;
    }
    l->lat[l->n_lat++] = ms;
}

static void on_done(struct evhttp_request *req, void *arg)
{
    inflight_t *f = arg;
    load_t *l = f->l;

    l->busy[f->conn]--;
    if (req && evhttp_request_get_response_code(req) == 200) {
        l->done++;
        record(l, (now_s() - f->t) * 1000);
    } else {
        l->errors++;
    }
    free(f);
    if (l->stopping && l->done + l->errors == l->sent)
        event_base_loopbreak(l->base);
}

static void send_one(load_t *l)
{
    uint64_t k = l->seq++;
    int engine = (int)(k % (uint64_t)l->o.engines);
    int best = -1;

    /* the least busy connection of that engine */
    for (int c = 0; c < l->o.conns; c++) {
        int i = engine * l->o.conns + c;
        if (best < 0 || l->busy[i] < l->busy[best])
            best = i;
    }
    inflight_t *f = calloc(1, sizeof(*f));
    struct evhttp_request *req = f ? evhttp_request_new(on_done, f) : NULL;
    if (req == NULL) {
        free(f);
        l->dropped++;
        return;
    }
    f->l = l;
    f->conn = best;
    f->t = now_s();

    struct evbuffer *b = evhttp_request_get_output_buffer(req);
    int shared = l->o.prompt_len / 2;
    evbuffer_add_printf(b, "{\"prompt\":\"g%04d ", (int)(k % (uint64_t)l->o.groups));
    for (int i = 6; i < shared; i++)
        evbuffer_add(b, "abcdefghijklmnopqrstuvwxyz" + (i % 26), 1);
    evbuffer_add_printf(b, " r%012llu ", (unsigned long long)k);
    for (int i = shared + 15; i < l->o.prompt_len; i++)
        evbuffer_add(b, "zyxwvutsrqponmlkjihgfedcba" + ((i + k) % 26), 1);
    evbuffer_add_printf(b, "\",\"max_tokens\":%d,\"ignore_eos\":true}", l->o.max_tokens);

    struct evkeyvalq *h = evhttp_request_get_output_headers(req);
    evhttp_add_header(h, "Host", l->o.host);
    evhttp_add_header(h, "Content-Type", "application/json");
    if (evhttp_make_request(l->conns[best], req, EVHTTP_REQ_POST, "/v1/completions") != 0) {
        free(f);
        l->dropped++;
        return;
    }
    l->busy[best]++;
    l->sent++;
}

/* Open loop: every tick, send what the schedule says is due. */
static void on_tick(evutil_socket_t fd, short what, void *arg)
{
    load_t *l = arg;
    double t = now_s();

    if (t - l->t0 >= l->o.duration) {
        l->stopping = 1;
        event_del(l->tick);
        if (l->done + l->errors == l->sent)
            event_base_loopbreak(l->base);
        return;
    }
    while (l->next_due <= t) {
        send_one(l);
        l->next_due += 1.0 / l->o.rate;
    }
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double pct(const load_t *l, double p)
{
    if (l->n_lat == 0)
        return 0;
    size_t i = (size_t)ceil(p / 100.0 * (double)l->n_lat) - 1;
    return l->lat[i < l->n_lat ? i : l->n_lat - 1];
}

static int parse(int argc, char **argv, opts_t *o)
{
    static const struct option lo[] = {
        {"host", 1, 0, 'h'}, {"port", 1, 0, 'p'}, {"engines", 1, 0, 'n'},
        {"rate", 1, 0, 'r'}, {"duration", 1, 0, 'd'}, {"prompt-len", 1, 0, 'l'},
        {"max-tokens", 1, 0, 'm'}, {"conns", 1, 0, 'c'}, {"groups", 1, 0, 'g'},
        {0, 0, 0, 0}
    };
    int c;
    while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        switch (c) {
        case 'h': o->host = optarg; break;
        case 'p': o->port = atoi(optarg); break;
        case 'n': o->engines = atoi(optarg); break;
        case 'r': o->rate = atof(optarg); break;
        case 'd': o->duration = atof(optarg); break;
        case 'l': o->prompt_len = atoi(optarg); break;
        case 'm': o->max_tokens = atoi(optarg); break;
        case 'c': o->conns = atoi(optarg); break;
        case 'g': o->groups = atoi(optarg); break;
        default: return -1;
        }
    }
    if (o->port <= 0 || o->engines < 1 || o->rate <= 0 || o->duration <= 0
        || o->prompt_len < 32 || o->max_tokens < 1 || o->conns < 1 || o->groups < 1)
        return -1;
    return 0;
}

int main(int argc, char **argv)
{
    load_t l;
    memset(&l, 0, sizeof(l));
    l.o = (opts_t){ .host = "127.0.0.1", .engines = 1, .conns = 4, .prompt_len = 256,
                    .max_tokens = 16, .groups = 32, .rate = 100, .duration = 5 };
    if (parse(argc, argv, &l.o)) {
        fprintf(stderr, "usage: kvload --port P [--engines N] [--rate R] [--duration S]\n"
                        "              [--prompt-len L] [--max-tokens M] [--conns C]"
                        " [--groups G]\n");
        return 2;
    }
    struct event_config *ec = event_config_new();
    event_config_set_flag(ec, EVENT_BASE_FLAG_PRECISE_TIMER);
    l.base = event_base_new_with_config(ec);
    event_config_free(ec);
    int n = l.o.engines * l.o.conns;
    l.conns = calloc((size_t)n, sizeof(*l.conns));
    l.busy = calloc((size_t)n, sizeof(int));
    if (l.base == NULL || l.conns == NULL || l.busy == NULL)
        return 1;
    for (int i = 0; i < n; i++) {
        l.conns[i] = evhttp_connection_base_new(l.base, NULL, l.o.host,
                                                (ev_uint16_t)(l.o.port + i / l.o.conns));
        evhttp_connection_set_timeout(l.conns[i], 60);
    }
    l.tick = event_new(l.base, -1, EV_PERSIST, on_tick, &l);
    struct timeval tv = { 0, 1000 };
    l.t0 = l.next_due = now_s();
    event_add(l.tick, &tv);
    event_base_dispatch(l.base);
    double elapsed = now_s() - l.t0;

    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    double cpu = ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6
               + ru.ru_stime.tv_sec + ru.ru_stime.tv_usec / 1e6;
    qsort(l.lat, l.n_lat, sizeof(double), cmp_double);
    printf("{\"target_rate\":%.1f,\"achieved_rate\":%.1f,\"sent\":%llu,\"ok\":%llu,"
           "\"errors\":%llu,\"dropped\":%llu,\"elapsed_s\":%.2f,\"lat_ms_p50\":%.2f,"
           "\"lat_ms_p90\":%.2f,\"lat_ms_p99\":%.2f,\"kvload_cpu_s\":%.2f}\n",
           l.o.rate, l.done / elapsed, (unsigned long long)l.sent,
           (unsigned long long)l.done, (unsigned long long)l.errors,
           (unsigned long long)l.dropped, elapsed, pct(&l, 50), pct(&l, 90), pct(&l, 99), cpu);
    for (int i = 0; i < n; i++)
        evhttp_connection_free(l.conns[i]);
    event_free(l.tick);
    event_base_free(l.base);
    free(l.conns);
    free(l.busy);
    free(l.lat);
    return l.errors || l.dropped ? 1 : 0;
}
