/*
 * kvbench: replays a Mooncake-format trace against any OpenAI-compatible
 * server and reports what users feel (TTFT, ITL, end-to-end latency,
 * throughput) and what the cache did (prefix hit rate from usage).
 *
 *   kvbench replay --trace FILE --url URL [options]   one JSON summary line
 *   kvbench ideal  --trace FILE [--max-requests N]    the trace's ideal reuse
 *   kvbench oracle --trace FILE [--engines N] [--cache-tokens C] [--block-size B]
 *                  [--balance F] [--trace-block-size TB] [--floor-speedup S]
 *                  [--slow-engines K [--slow-factor F]]
 *       the hit rate of a load-bounded longest-prefix oracle on a fleet of N
 *       engines with C-token LRU caches, and the infinite single-cache bound
 *       (kvb_oracle.h has the exact rule); with --floor-speedup, the mean TTFT
 *       floor of both on mock engines of that --speedup (kvb_floor.h)
 *   kvbench floor --records FILE --floor-speedup S [--block-size B] [--floor-budget N]
 *       the mean TTFT floor of the requests a replay recorded (their prompt and
 *       cached tokens) beside their measured mean TTFT: how much of it was
 *       compute and how much waiting
 *
 * Prompts: every trace hash id expands on its own into one block of
 * --block-size token ids (or, with --text, words that are one token each in
 * common BPE vocabularies), so shared leading ids mean shared leading
 * tokens; see kvb_prompt.h and docs/BENCHMARKS.md "End-to-end (bench-e2e)".
 */
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "kv_trace.h"
#include "kvb_floor.h"
#include "kvb_oracle.h"
#include "kvb_replay.h"
#include "kvb_stats.h"

static void usage(FILE *f)
{
    fputs("usage: kvbench replay --trace FILE --url URL [options]\n"
          "       kvbench ideal --trace FILE [--max-requests N]\n"
          "       kvbench oracle --trace FILE [--engines N] [--cache-tokens C] [--block-size B]\n"
          "                      [--balance F] [--trace-block-size TB] [--max-requests N]\n"
          "                      [--slow-engines K [--slow-factor F]]\n"
          "                      [--floor-speedup S] [--floor-budget N]\n"
          "       kvbench floor --records FILE --floor-speedup S [--block-size B] [--floor-budget N]\n"
          "  oracle: --engines 8, --cache-tokens 2097152 (per engine), --block-size 64 (the\n"
          "  engines' KV block), --balance 1.1 (load bound), --trace-block-size 512;\n"
          "  --slow-engines K: the last K engines run at --slow-factor F (default 0.5) x\n"
          "  the others' speed, and the load bound counts work in time\n"
          "  --floor-speedup S: also the mean TTFT floor on mock engines of --speedup S\n"
          "  with a step budget of --floor-budget tokens (default 8192)\n"
          "  --url URL          http://host:port[/path] (path default /v1/completions)\n"
          "  --text             text prompts (words) instead of token-id prompts\n"
          "  --chat             chat requests (default path /v1/chat/completions): the text\n"
          "                     prompt is one user message, so the chat template applies\n"
          "  --speedup X        divide trace arrival times by X (default 1)\n"
          "  --concurrency N    ignore arrival times, keep N requests in flight\n"
          "  --max-requests N   replay only the first N requests\n"
          "  --model NAME       model field of each request (default kvroute-mock)\n"
          "  --block-size N     tokens per trace hash id (default 512)\n"
          "  --vocab N          token ids are drawn from [100, 100+N) (default 30000)\n"
          "  --records FILE     per-request records, one JSON object a line\n"
          "  --timeout S        a request that receives nothing for S seconds fails (default 300)\n",
          f);
}

typedef struct {
    const char *trace, *records;
    size_t      max_requests;
    kvb_opts_t  o;
    kvb_oracle_opts_t oracle;
} args_t;

static int parse_num(const char *name, const char *s, double lo, double hi, double *v)
{
    char *end;
    errno = 0;
    *v = strtod(s, &end);
    if (errno || end == s || *end || !(*v >= lo && *v <= hi)) {
        fprintf(stderr, "kvbench: %s must be a number in [%g, %g], got '%s'\n", name, lo, hi, s);
        return -1;
    }
    return 0;
}

static int parse_args(int argc, char **argv, args_t *a)
{
    static const struct option opts[] = {
        {"trace", 1, 0, 't'}, {"url", 1, 0, 'u'}, {"text", 0, 0, 'x'}, {"chat", 0, 0, 'X'},
        {"speedup", 1, 0, 's'}, {"concurrency", 1, 0, 'c'}, {"max-requests", 1, 0, 'n'},
        {"model", 1, 0, 'm'}, {"block-size", 1, 0, 'b'}, {"vocab", 1, 0, 'v'},
        {"records", 1, 0, 'r'}, {"timeout", 1, 0, 'T'}, {"help", 0, 0, 'h'},
        {"engines", 1, 0, 'E'}, {"cache-tokens", 1, 0, 'C'}, {"balance", 1, 0, 'L'},
        {"trace-block-size", 1, 0, 'B'}, {"floor-speedup", 1, 0, 'F'},
        {"floor-budget", 1, 0, 'G'}, {"slow-engines", 1, 0, 'S'}, {"slow-factor", 1, 0, 'f'},
        {0, 0, 0, 0},
    };
    double v;
    int c;

    a->o.model = "kvroute-mock";
    a->o.speedup = 1;
    a->o.block_size = 512;
    a->o.vocab = 30000;
    a->o.timeout_s = 300;
    a->oracle.engines = 8;
    a->oracle.cache_tokens = 2097152;
    a->oracle.block_size = 64;
    a->oracle.trace_block_size = 512;
    a->oracle.balance = 1.1;
    a->oracle.floor_budget = 8192;
    a->oracle.slow_factor = 0.5;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 't': a->trace = optarg; break;
        case 'u': a->o.url = optarg; break;
        case 'x': a->o.text = 1; break;
        case 'X': a->o.text = a->o.chat = 1; break;
        case 'm': a->o.model = optarg; break;
        case 'r': a->records = optarg; break;
        case 's':
            if (parse_num("--speedup", optarg, 1e-6, 1e9, &a->o.speedup)) return -1;
            break;
        case 'c':
            if (parse_num("--concurrency", optarg, 1, 1e6, &v)) return -1;
            a->o.concurrency = (int)v;
            break;
        case 'n':
            if (parse_num("--max-requests", optarg, 1, 1e12, &v)) return -1;
            a->max_requests = (size_t)v;
            break;
        case 'b':
            if (parse_num("--block-size", optarg, 1, 1 << 20, &v)) return -1;
            a->o.block_size = a->oracle.block_size = (uint32_t)v;
            break;
        case 'E':
            if (parse_num("--engines", optarg, 1, 4096, &v)) return -1;
            a->oracle.engines = (uint32_t)v;
            break;
        case 'C':
            if (parse_num("--cache-tokens", optarg, 1, 1e15, &v)) return -1;
            a->oracle.cache_tokens = (uint64_t)v;
            break;
        case 'L':
            if (parse_num("--balance", optarg, 1, 1e6, &a->oracle.balance)) return -1;
            break;
        case 'F':
            if (parse_num("--floor-speedup", optarg, 1e-6, 1e9, &a->oracle.floor_speedup))
                return -1;
            break;
        case 'S':
            if (parse_num("--slow-engines", optarg, 0, 4096, &v)) return -1;
            a->oracle.slow_engines = (uint32_t)v;
            break;
        case 'f':
            if (parse_num("--slow-factor", optarg, 1e-6, 1, &a->oracle.slow_factor)) return -1;
            break;
        case 'G':
            if (parse_num("--floor-budget", optarg, 1, 1 << 24, &v)) return -1;
            a->oracle.floor_budget = (uint32_t)v;
            break;
        case 'B':
            if (parse_num("--trace-block-size", optarg, 1, 1 << 20, &v)) return -1;
            a->oracle.trace_block_size = (uint32_t)v;
            break;
        case 'v':
            if (parse_num("--vocab", optarg, 1, 1e9, &v)) return -1;
            a->o.vocab = (uint32_t)v;
            break;
        case 'T':
            if (parse_num("--timeout", optarg, 0.001, 1e6, &a->o.timeout_s)) return -1;
            break;
        case 'h': usage(stdout); exit(0);
        default: usage(stderr); return -1;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "kvbench: unexpected argument '%s'\n", argv[optind]);
        return -1;
    }
    if (a->trace == NULL && (a->records == NULL || !(a->oracle.floor_speedup > 0))) {
        fprintf(stderr, "kvbench: --trace FILE is required (floor: --records FILE "
                "--floor-speedup S)\n");
        return -1;
    }
    return 0;
}

static int load(const args_t *a, kv_trace_t *t)
{
    char err[300];
    if (kv_trace_load(a->trace, t, err, sizeof(err))) {
        /* err already names the line: "line N: reason" */
        fprintf(stderr, "kvbench: %s: %s\n", a->trace, err);
        return -1;
    }
    if (a->max_requests && a->max_requests < t->n)
        t->n = a->max_requests;
    if (t->n == 0) {
        fprintf(stderr, "kvbench: %s: no requests\n", a->trace);
        return -1;
    }
    return 0;
}

static json_t *dist_json(double *v, size_t n)
{
    kvb_dist_t d;
    kvb_dist(v, n, &d);
    if (d.n == 0)
        return json_null();
    return json_pack("{s:f,s:f,s:f,s:f,s:f}", "mean", d.mean, "p50", d.p50, "p90", d.p90,
                     "p99", d.p99, "max", d.max);
}

static double itl_of(const kvb_result_t *r)
{
    long out = r->completion_tokens > 0 ? r->completion_tokens : (long)r->chunks;
    if (out < 2 || r->first_ms < 0)
        return -1;
    return (r->end_ms - r->first_ms) / (double)(out - 1);
}

/* Counts of each distinct error message, most common first is not needed: few kinds. */
static json_t *error_kinds(const kvb_result_t *res, size_t n)
{
    json_t *o = json_object();
    for (size_t i = 0; i < n; i++) {
        if (res[i].error == NULL)
            continue;
        json_t *c = json_object_get(o, res[i].error);
        if (c == NULL && json_object_size(o) >= 20)
            continue;           /* keep the summary short */
        json_object_set_new(o, res[i].error, json_integer(c ? json_integer_value(c) + 1 : 1));
    }
    return o;
}

static json_t *summarize(const kv_trace_t *t, const args_t *a, const kvb_result_t *res,
                         double wall_ms)
{
    size_t n = t->n, ok = 0, errors = 0, with_usage = 0;
    double *ttft = calloc(n, sizeof(double)), *itl = calloc(n, sizeof(double));
    double *e2e = calloc(n, sizeof(double)), *lag = calloc(n, sizeof(double));
    size_t nt = 0, ni = 0, ne = 0;
    long long out_tokens = 0, prompt = 0, cached = 0, input = 0;

    if (!ttft || !itl || !e2e || !lag) {
        fprintf(stderr, "kvbench: out of memory\n");
        exit(1);
    }
    for (size_t i = 0; i < n; i++) {
        const kvb_result_t *r = &res[i];
        lag[i] = r->start_ms - r->due_ms;
        input += r->input_length;
        if (r->error) {
            errors++;
            continue;
        }
        ok++;
        ttft[nt++] = r->first_ms - r->start_ms;
        e2e[ne++] = r->end_ms - r->start_ms;
        double x = itl_of(r);
        if (x >= 0)
            itl[ni++] = x;
        out_tokens += r->completion_tokens >= 0 ? r->completion_tokens : r->chunks;
        if (r->prompt_tokens >= 0) {
            with_usage++;
            prompt += r->prompt_tokens;
            cached += r->cached_tokens > 0 ? r->cached_tokens : 0;
        }
    }
    double secs = wall_ms / 1e3;
    json_t *s = json_pack("{s:s,s:s,s:I,s:I,s:I,s:f,s:f,s:f}",
                          "trace", a->trace, "url", a->o.url, "requests", (json_int_t)n,
                          "completed", (json_int_t)ok, "errors", (json_int_t)errors,
                          "duration_s", secs,
                          "request_throughput_rps", secs > 0 ? (double)ok / secs : 0.0,
                          "output_throughput_tok_s", secs > 0 ? (double)out_tokens / secs : 0.0);
    json_object_set_new(s, "ttft_ms", dist_json(ttft, nt));
    json_object_set_new(s, "itl_ms", dist_json(itl, ni));
    /* every gap between consecutive output chunks of completed requests */
    size_t ng = 0, k = 0;
    for (size_t i = 0; i < n; i++)
        ng += res[i].error ? 0 : res[i].ngaps;
    double *gaps = malloc((ng ? ng : 1) * sizeof(double));
    if (gaps == NULL) {
        fprintf(stderr, "kvbench: out of memory\n");
        exit(1);
    }
    for (size_t i = 0; i < n; i++)
        for (uint32_t j = 0; !res[i].error && j < res[i].ngaps; j++)
            gaps[k++] = res[i].gaps[j];
    json_object_set_new(s, "itl_token_ms", dist_json(gaps, k));
    free(gaps);
    json_object_set_new(s, "e2e_ms", dist_json(e2e, ne));
    json_object_set_new(s, "input_tokens", json_integer(input));
    json_object_set_new(s, "output_tokens", json_integer(out_tokens));
    json_object_set_new(s, "prompt_tokens", json_integer(prompt));
    json_object_set_new(s, "cached_tokens", json_integer(cached));
    /* only requests whose usage said how many prompt tokens there were count */
    json_object_set_new(s, "hit_rate", with_usage && prompt > 0
                        ? json_real((double)cached / (double)prompt) : json_null());
    json_object_set_new(s, "ideal_reuse", json_real(kv_trace_ideal_reuse(t)));
    json_object_set_new(s, "mode", json_string(a->o.concurrency > 0 ? "concurrency" : "arrival"));
    if (a->o.concurrency > 0)
        json_object_set_new(s, "concurrency", json_integer(a->o.concurrency));
    else
        json_object_set_new(s, "speedup", json_real(a->o.speedup));
    json_object_set_new(s, "prompts", json_string(a->o.chat ? "chat" : a->o.text ? "text"
                                                                             : "tokens"));
    json_object_set_new(s, "send_lag_ms", dist_json(lag, n));
    json_object_set_new(s, "error_kinds", error_kinds(res, n));
    free(ttft);
    free(itl);
    free(e2e);
    free(lag);
    return s;
}


static int write_records(const char *path, const kvb_result_t *res, size_t n)
{
    FILE *f = fopen(path, "w");
    if (f == NULL) {
        fprintf(stderr, "kvbench: %s: %s\n", path, strerror(errno));
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        const kvb_result_t *r = &res[i];
        int ok = r->error == NULL;
        json_t *o = json_pack("{s:I,s:f,s:f,s:I,s:I,s:I}", "index", (json_int_t)i,
                              "due_ms", r->due_ms, "start_ms", r->start_ms,
                              "input_length", (json_int_t)r->input_length,
                              "max_tokens", (json_int_t)r->max_tokens,
                              "status", (json_int_t)r->status);
        json_object_set_new(o, "ttft_ms", ok ? json_real(r->first_ms - r->start_ms)
                                             : json_null());
        json_object_set_new(o, "e2e_ms", r->end_ms >= 0 ? json_real(r->end_ms - r->start_ms)
                                                        : json_null());
        double itl = ok ? itl_of(r) : -1;
        json_object_set_new(o, "itl_ms", itl >= 0 ? json_real(itl) : json_null());
        json_object_set_new(o, "chunks", json_integer(r->chunks));
        json_object_set_new(o, "prompt_tokens", r->prompt_tokens >= 0
                            ? json_integer(r->prompt_tokens) : json_null());
        json_object_set_new(o, "completion_tokens", r->completion_tokens >= 0
                            ? json_integer(r->completion_tokens) : json_null());
        json_object_set_new(o, "cached_tokens", r->cached_tokens >= 0
                            ? json_integer(r->cached_tokens) : json_null());
        json_object_set_new(o, "error", r->error ? json_string(r->error) : json_null());
        if (json_dumpf(o, f, JSON_COMPACT) || fputc('\n', f) == EOF) {
            json_decref(o);
            fclose(f);
            fprintf(stderr, "kvbench: %s: write failed\n", path);
            return -1;
        }
        json_decref(o);
    }
    return fclose(f) ? -1 : 0;
}

/* Every stream is a socket: lift the descriptor limit as far as allowed. */
static void raise_nofile(void)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
}

static int cmd_replay(const args_t *a)
{
    kv_trace_t t = {0};
    char err[300];
    int rc = 1;

    if (a->o.url == NULL) {
        fprintf(stderr, "kvbench: --url URL is required\n");
        return 2;
    }
    if (load(a, &t))
        return 2;
    kvb_result_t *res = calloc(t.n, sizeof(*res));
    if (res == NULL) {
        fprintf(stderr, "kvbench: out of memory\n");
        goto out;
    }
    raise_nofile();
    double wall = kvb_replay(&t, &a->o, res, err, sizeof(err));
    if (wall < 0) {
        fprintf(stderr, "kvbench: %s\n", err);
        rc = 2;
        goto out;
    }
    json_t *s = summarize(&t, a, res, wall);
    json_dumpf(s, stdout, JSON_COMPACT);
    putchar('\n');
    fflush(stdout);
    json_decref(s);
    rc = 0;
    if (a->records && write_records(a->records, res, t.n))
        rc = 1;
out:
    if (res) {
        for (size_t i = 0; i < t.n; i++) {
            free(res[i].error);
            free(res[i].gaps);
        }
    }
    free(res);
    kv_trace_free(&t);
    return rc;
}

static int cmd_ideal(const args_t *a)
{
    kv_trace_t t = {0};
    if (load(a, &t))
        return 2;
    printf("{\"requests\":%zu,\"ideal_reuse\":%.6f}\n", t.n, kv_trace_ideal_reuse(&t));
    kv_trace_free(&t);
    return 0;
}

static int cmd_oracle(const args_t *a)
{
    kv_trace_t t = {0};
    kvb_oracle_result_t r;
    char err[300];
    const kvb_oracle_opts_t *o = &a->oracle;

    if (load(a, &t))
        return 2;
    if (kvb_oracle_run(&t, o, &r, err, sizeof(err))) {
        fprintf(stderr, "kvbench: oracle: %s\n", err);
        kv_trace_free(&t);
        return 2;
    }
    printf("{\"requests\":%zu,\"engines\":%u,\"cache_tokens\":%llu,\"block_size\":%u,"
           "\"trace_block_size\":%u,\"balance\":%g,\"prompt_tokens\":%llu,"
           "\"oracle_cached_tokens\":%llu,\"ideal_cached_tokens\":%llu,"
           "\"oracle_hit_rate\":%.6f,\"ideal_hit_rate\":%.6f,\"oracle_share_of_ideal\":%.6f,"
           "\"oracle_work_spread\":%.6f,\"fallbacks\":%llu,\"evictions\":%llu,"
           "\"ideal_reuse_trace_blocks\":%.6f",
           t.n, o->engines, (unsigned long long)o->cache_tokens, o->block_size,
           o->trace_block_size, o->balance, (unsigned long long)r.prompt_tokens,
           (unsigned long long)r.oracle_cached, (unsigned long long)r.ideal_cached,
           r.oracle_hit_rate, r.ideal_hit_rate,
           r.ideal_hit_rate > 0 ? r.oracle_hit_rate / r.ideal_hit_rate : 0.0,
           r.work_spread, (unsigned long long)r.fallbacks, (unsigned long long)r.evictions,
           kv_trace_ideal_reuse(&t));
    if (o->slow_engines > 0)
        printf(",\"slow_engines\":%u,\"slow_factor\":%g", o->slow_engines, o->slow_factor);
    if (o->floor_speedup > 0)
        printf(",\"floor_speedup\":%g,\"floor_budget\":%u,\"oracle_floor_ttft_ms\":%.3f,"
               "\"ideal_floor_ttft_ms\":%.3f,\"any_order_floor_ttft_ms\":%.3f",
               o->floor_speedup, o->floor_budget, r.oracle_floor_ms, r.ideal_floor_ms,
               r.any_order_floor_ms);
    printf("}\n");
    fprintf(stderr, "oracle: %zu requests, %u engines x %llu tokens (block %u), balance %g: "
            "hit rate %.3f (%.0f%% of ideal %.3f), prefill work max/mean %.2f, %llu fallbacks\n",
            t.n, o->engines, (unsigned long long)o->cache_tokens, o->block_size, o->balance,
            r.oracle_hit_rate, r.ideal_hit_rate > 0 ? 100 * r.oracle_hit_rate / r.ideal_hit_rate
                                                    : 0.0,
            r.ideal_hit_rate, r.work_spread, (unsigned long long)r.fallbacks);
    kv_trace_free(&t);
    return 0;
}

/* One record's TTFT and floor; 0 when the line is not a completed request. */
static int record_floor(const char *line, const args_t *a, double *ttft, double *low)
{
    json_t *r = json_loads(line, JSON_ALLOW_NUL, NULL);
    json_t *p = json_object_get(r, "prompt_tokens"), *c = json_object_get(r, "cached_tokens");
    json_t *t = json_object_get(r, "ttft_ms"), *st = json_object_get(r, "status");
    int ok = json_is_integer(p) && json_is_integer(c) && json_is_number(t)
             && json_integer_value(st) == 200 && json_integer_value(p) > 0
             && json_integer_value(p) <= UINT32_MAX && json_integer_value(c) >= 0;

    if (ok) {
        *ttft = json_number_value(t);
        *low = kvb_floor_ttft_ms((uint32_t)json_integer_value(p),
                                 (uint64_t)json_integer_value(c), a->oracle.block_size,
                                 a->oracle.floor_budget, a->oracle.floor_speedup);
    }
    json_decref(r);
    return ok;
}

static int cmd_floor(const args_t *a)
{
    FILE *f = fopen(a->records, "r");
    char *line = NULL;
    size_t cap = 0, n = 0, skipped = 0;
    double ttft_sum = 0, floor_sum = 0, ttft, low;

    if (f == NULL) {
        fprintf(stderr, "kvbench: %s: %s\n", a->records, strerror(errno));
        return 2;
    }
    while (getline(&line, &cap, f) > 0) {
        if (record_floor(line, a, &ttft, &low)) {
            ttft_sum += ttft;
            floor_sum += low;
            n++;
        } else {
            skipped++;
        }
    }
    free(line);
    fclose(f);
    if (n == 0) {
        fprintf(stderr, "kvbench: %s: no completed requests\n", a->records);
        return 2;
    }
    printf("{\"requests\":%zu,\"skipped\":%zu,\"ttft_ms\":%.3f,\"floor_ttft_ms\":%.3f,"
           "\"over_floor\":%.4f}\n", n, skipped, ttft_sum / n, floor_sum / n,
           floor_sum > 0 ? ttft_sum / floor_sum : 0.0);
    return 0;
}

int main(int argc, char **argv)
{
    args_t a = {0};

    if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    const char *cmd = argv[1];
    if (strcmp(cmd, "replay") != 0 && strcmp(cmd, "ideal") != 0 && strcmp(cmd, "oracle") != 0
        && strcmp(cmd, "floor") != 0) {
        fprintf(stderr, "kvbench: unknown command '%s'\n", cmd);
        usage(stderr);
        return 2;
    }
    if (parse_args(argc - 1, argv + 1, &a))
        return 2;
    if (strcmp(cmd, "oracle") == 0)
        return cmd_oracle(&a);
    if (strcmp(cmd, "floor") == 0)
        return cmd_floor(&a);
    return strcmp(cmd, "replay") == 0 ? cmd_replay(&a) : cmd_ideal(&a);
}
