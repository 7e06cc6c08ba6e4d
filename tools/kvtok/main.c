/*
 * kvtok: the tokenizer, chat templates and block hashing from the command
 * line, on the same code the nginx module and kvworker use.
 *
 *   kvtok encode --tokenizer FILE [--no-special] [--chat [--template NAME|FILE]
 *                [--chat-engine vllm|sglang]] [--jsonl]
 *                (--chat: a messages array, or a whole chat request with its tools,
 *                rendered by that engine's rules)
 *   kvtok decode --tokenizer FILE [--skip-special]
 *   kvtok hash --block-size N [--salt S]
 *   kvtok bench --tokenizer FILE TEXTFILE
 */
#include <getopt.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include <jansson.h>

#include "kv_chat.h"
#include "kv_hash.h"
#include "kv_request.h"
#include "kv_tokenizer.h"

typedef struct {
    const char         *tokenizer;
    const char         *template;
    const char         *salt;
    int                 no_special, skip_special, chat, jsonl;
    kv_chat_engine_t    engine;             /* --chat-engine */
    long                block_size;
    kv_tokenizer_t     *tok;
    kv_chat_template_t *tpl;
} opts_t;

static void usage(void)
{
    fprintf(stderr,
        "usage: kvtok encode --tokenizer FILE [--no-special] [--chat [--template NAME|FILE]\n"
        "                    [--chat-engine vllm|sglang]] [--jsonl]\n"
        "       kvtok decode --tokenizer FILE [--skip-special]\n"
        "       kvtok hash --block-size N [--salt S]\n"
        "       kvtok bench --tokenizer FILE TEXTFILE\n");
    exit(2);
}

static char *read_all(FILE *f, size_t *len)
{
    size_t cap = 1 << 16, n = 0, k;
    char  *buf = malloc(cap + 1), *g;

    while (buf && (k = fread(buf + n, 1, cap - n, f)) > 0) {
        n += k;
        if (n == cap) {
            g = realloc(buf, 2 * cap + 1);
            if (g == NULL) {
                free(buf);
                return NULL;
            }
            buf = g;
            cap *= 2;
        }
    }
    if (buf) buf[n] = '\0';
    *len = n;
    return buf;
}

static int exists(const char *p)
{
    struct stat st;

    return stat(p, &st) == 0;
}

/* --template: a file, a conf/templates/NAME or conf/tokenizers/NAME directory,
 * or by default the tokenizer's own directory. */
static kv_chat_template_t *load_template(const opts_t *o)
{
    char        path[1400], err[512], dir[1024];
    const char *names[] = { "tokenizer_config.json", "chat_template.jinja" };
    const char *slash;
    size_t      i;
    kv_chat_template_t *t;

    if (o->template && exists(o->template)) {
        snprintf(path, sizeof(path), "%s", o->template);
        goto load;
    }
    if (o->template) {
        for (i = 0; i < 2; i++) {
            snprintf(path, sizeof(path), "conf/templates/%s/%s", o->template, names[1 - i]);
            if (exists(path)) goto load;
            snprintf(path, sizeof(path), "conf/tokenizers/%s/%s", o->template, names[1 - i]);
            if (exists(path)) goto load;
        }
        fprintf(stderr, "kvtok: no chat template named %s\n", o->template);
        exit(1);
    }
    slash = strrchr(o->tokenizer, '/');
    snprintf(dir, sizeof(dir), "%.*s", slash ? (int) (slash - o->tokenizer) : 1,
             slash ? o->tokenizer : ".");
    for (i = 0; i < 2; i++) {
        snprintf(path, sizeof(path), "%s/%s", dir, names[1 - i]);
        if (exists(path)) goto load;
    }
    fprintf(stderr, "kvtok: no chat template next to %s; use --template\n", o->tokenizer);
    exit(1);
load:
    t = kv_chat_load(path, NULL, err, sizeof(err));
    if (t == NULL) {
        fprintf(stderr, "kvtok: %s: %s\n", path, err);
        exit(1);
    }
    return t;
}

static void print_ids(const kv_ids_t *ids)
{
    size_t i;

    putchar('[');
    for (i = 0; i < ids->n; i++) {
        printf(i ? ",%u" : "%u", ids->ids[i]);
    }
    printf("]\n");
}

/* One input (text, or with --chat a messages array or a whole chat request
 * with its tools and kwargs) to ids. */
static int encode_one(const opts_t *o, const char *text, size_t len, json_t *messages)
{
    kv_ids_t             ids = { 0 };
    char                 err[512];
    kv_request_status_t  st;

    if (!o->chat && o->no_special) {
        st = kv_tokenizer_encode(o->tok, text, len, 0, &ids) < 0 ? KV_REQUEST_NO_MEMORY
                                                                  : KV_REQUEST_OK;
    } else {
        /* what the router and kvworker compute (kv_request.h) */
        st = kv_request_ids(o->tok, o->tpl, text, len, o->chat ? messages : NULL, o->engine,
                            &ids, err, sizeof(err));
    }
    if (st != KV_REQUEST_OK) {
        if (st == KV_REQUEST_NO_MEMORY)
            fprintf(stderr, "kvtok: out of memory\n");
        else
            fprintf(stderr, "kvtok: chat template: %s\n", err);
        kv_ids_free(&ids);
        return -1;
    }
    print_ids(&ids);
    kv_ids_free(&ids);
    return 0;
}

static int cmd_encode(const opts_t *o)
{
    size_t       len;
    char        *in = read_all(stdin, &len), *line, *save = NULL;
    json_error_t je;
    json_t      *v;
    int          rc = 0, lineno = 0;

    if (in == NULL) return 1;
    if (!o->jsonl) {
        if (o->chat) {
            v = json_loadb(in, len, 0, &je);
            if (!json_is_array(v) && !json_is_object(v)) {
                fprintf(stderr, "kvtok: --chat wants a messages array or a chat request on "
                        "stdin: %s\n", v ? "neither" : je.text);
                return 1;
            }
            rc = encode_one(o, NULL, 0, v);
            json_decref(v);
        } else {
            rc = encode_one(o, in, len, NULL);
        }
        free(in);
        return rc ? 1 : 0;
    }
    for (line = strtok_r(in, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        lineno++;
        /* a prompt may hold U+0000 (text to HF): encoded by length */
        v = json_loads(line, JSON_DECODE_ANY | (o->chat ? 0 : JSON_ALLOW_NUL), &je);
        if (o->chat ? !json_is_array(v) && !json_is_object(v) : !json_is_string(v)) {
            fprintf(stderr, "kvtok: line %d: expected a JSON %s\n", lineno,
                    o->chat ? "messages array or chat request" : "string");
            json_decref(v);
            rc = 1;
            continue;
        }
        if (encode_one(o, json_string_value(v), json_string_length(v), v) != 0) {
            rc = 1;
        }
        json_decref(v);
    }
    free(in);
    return rc;
}

static int read_ids(uint32_t **out, size_t *n)
{
    size_t       len, i;
    char        *in = read_all(stdin, &len);
    json_error_t je;
    json_t      *v = in ? json_loadb(in, len, 0, &je) : NULL;

    free(in);
    if (!json_is_array(v)) {
        fprintf(stderr, "kvtok: expected a JSON array of token ids on stdin\n");
        json_decref(v);
        return -1;
    }
    *n = json_array_size(v);
    *out = malloc((*n + 1) * sizeof(uint32_t));
    for (i = 0; i < *n; i++) {
        json_t *x = json_array_get(v, i);

        if (!json_is_integer(x) || json_integer_value(x) < 0
            || json_integer_value(x) > UINT32_MAX)
        {
            fprintf(stderr, "kvtok: element %zu is not a token id\n", i);
            json_decref(v);
            free(*out);
            return -1;
        }
        (*out)[i] = (uint32_t) json_integer_value(x);
    }
    json_decref(v);
    return 0;
}

static int cmd_decode(const opts_t *o)
{
    uint32_t *ids;
    size_t    n, len;
    char     *s;

    if (read_ids(&ids, &n) != 0) return 1;
    s = kv_tokenizer_decode(o->tok, ids, n, o->skip_special, &len);
    free(ids);
    if (s == NULL) return 1;
    fwrite(s, 1, len, stdout);
    free(s);
    return 0;
}

static int cmd_hash(const opts_t *o)
{
    uint32_t *ids;
    uint64_t *seq;
    size_t    n, k, i;

    if (o->block_size < 1) {
        fprintf(stderr, "kvtok: hash needs --block-size N (N >= 1)\n");
        return 2;
    }
    if (read_ids(&ids, &n) != 0) return 1;
    seq = malloc((n / (size_t) o->block_size + 1) * sizeof(uint64_t));
    k = kv_hash_blocks(ids, n, (size_t) o->block_size,
                       kv_hash_seed(o->salt, o->salt ? strlen(o->salt) : 0), NULL, seq);
    for (i = 0; i < k; i++) {
        printf("%llu\n", (unsigned long long) seq[i]);
    }
    free(ids);
    free(seq);
    return 0;
}

static double clock_s(clockid_t id)
{
    struct timespec ts;

    clock_gettime(id, &ts);
    return (double) ts.tv_sec + (double) ts.tv_nsec / 1e9;
}

static double now_s(void)
{
    return clock_s(CLOCK_MONOTONIC);
}

/*
 * The first pass over text the word cache has not seen, once other text
 * of the same kind has gone through it: what a router that has served for
 * a while pays for a new prompt. A new thread starts with an empty word
 * cache; the file's first half fills it, the second half is timed.
 */
typedef struct {
    const opts_t *o;
    const char   *text;
    size_t        split, len;
    double        el, cpu;
} held_out_t;

static void *held_out(void *arg)
{
    held_out_t *h = arg;
    kv_ids_t    ids = { 0 };
    double      a, c;

    kv_tokenizer_encode(h->o->tok, h->text, h->split, 0, &ids);
    ids.n = 0;
    a = now_s();
    c = clock_s(CLOCK_THREAD_CPUTIME_ID);
    kv_tokenizer_encode(h->o->tok, h->text + h->split, h->len - h->split, 0, &ids);
    h->el = now_s() - a;
    h->cpu = clock_s(CLOCK_THREAD_CPUTIME_ID) - c;
    kv_ids_free(&ids);
    return NULL;
}

/* The line break nearest the middle (the halves stay whole lines). */
static size_t middle_line(const char *text, size_t len)
{
    const char *nl = memchr(text + len / 2, '\n', len - len / 2);

    return nl ? (size_t) (nl - text) + 1 : len / 2;
}

/* The best of 5 held-out passes, each on a new thread (one pass over half
 * the file is short enough for a shared machine to disturb): -1 if a
 * thread cannot start. */
static int held_out_best(held_out_t *h, double *el, double *cpu)
{
    pthread_t th;
    int       i;

    h->split = middle_line(h->text, h->len);
    for (i = 0; i < 5; i++) {
        if (pthread_create(&th, NULL, held_out, h) != 0 || pthread_join(th, NULL) != 0) {
            return -1;
        }
        *el = i == 0 || h->el < *el ? h->el : *el;
        *cpu = i == 0 || h->cpu < *cpu ? h->cpu : *cpu;
    }
    return 0;
}

static int cmd_bench(const opts_t *o, const char *file)
{
    FILE    *f = fopen(file, "rb");
    size_t   len, tokens = 0, runs = 0;
    char    *text;
    double   t0, el, best = 1e9, cpu, best_cpu = 1e9, cold = 0, cold_cpu = 0;
    kv_ids_t ids = { 0 };
    kv_tok_work_t w;
    held_out_t h = { o, NULL, 0, 0, 0, 0 };
    double     held_el = 0, held_cpu = 0;

    if (f == NULL) {
        fprintf(stderr, "kvtok: cannot open %s\n", file);
        return 1;
    }
    text = read_all(f, &len);
    fclose(f);
    /* best of several passes, at least one second in all; wall-clock and the
     * thread's CPU time (which a busy shared machine inflates less) */
    for (t0 = now_s(); runs < 3 || now_s() - t0 < 1.0; runs++) {
        double a = now_s(), c = clock_s(CLOCK_THREAD_CPUTIME_ID);

        ids.n = 0;
        kv_tokenizer_work(NULL, 1);
        kv_tokenizer_encode(o->tok, text, len, 0, &ids);
        el = now_s() - a;
        cpu = clock_s(CLOCK_THREAD_CPUTIME_ID) - c;
        if (runs == 0) {
            cold = el;              /* the word cache starts empty */
            cold_cpu = cpu;
        }
        if (el < best) best = el;
        if (cpu < best_cpu) best_cpu = cpu;
        tokens = ids.n;
    }
    kv_tokenizer_work(&w, 1);       /* of the last pass: the same every pass */
    h.text = text;
    h.len = len;
    if (held_out_best(&h, &held_el, &held_cpu) != 0) {
        fprintf(stderr, "kvtok: cannot start a held-out pass's thread\n");
        kv_ids_free(&ids);
        free(text);
        return 1;
    }
    printf("{\"bytes\":%zu,\"tokens\":%zu,\"seconds\":%.6f,\"mb_per_s\":%.2f,"
           "\"tokens_per_s\":%.0f,\"cpu_seconds\":%.6f,\"cpu_mb_per_s\":%.2f,"
           "\"cold_mb_per_s\":%.2f,\"cold_cpu_mb_per_s\":%.2f,"
           "\"held_out_mb_per_s\":%.2f,\"held_out_cpu_mb_per_s\":%.2f,"
           "\"runs\":%zu,\"memory_bytes\":%zu,"
           "\"bpe_symbols\":%llu,\"bpe_merges\":%llu,\"bpe_queue_ops\":%llu}\n",
           len, tokens, best, (double) len / best / 1e6, (double) tokens / best,
           best_cpu, (double) len / best_cpu / 1e6, (double) len / cold / 1e6,
           (double) len / cold_cpu / 1e6, (double) (len - h.split) / held_el / 1e6,
           (double) (len - h.split) / held_cpu / 1e6, runs,
           kv_tokenizer_memory(o->tok), (unsigned long long) w.symbols,
           (unsigned long long) w.merges, (unsigned long long) w.queue_ops);
    kv_ids_free(&ids);
    free(text);
    return 0;
}

int main(int argc, char **argv)
{
    static const struct option lo[] = {
        { "tokenizer", 1, 0, 't' }, { "no-special", 0, 0, 'n' }, { "chat", 0, 0, 'c' },
        { "template", 1, 0, 'T' }, { "jsonl", 0, 0, 'j' }, { "skip-special", 0, 0, 's' },
        { "block-size", 1, 0, 'b' }, { "salt", 1, 0, 'S' }, { "help", 0, 0, 'h' },
        { "chat-engine", 1, 0, 'E' }, { 0, 0, 0, 0 }
    };
    opts_t      o = { 0 };
    const char *cmd;
    char        err[512];
    int         c;

    if (argc < 2) usage();
    cmd = argv[1];
    optind = 2;
    while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        switch (c) {
        case 't': o.tokenizer = optarg; break;
        case 'n': o.no_special = 1; break;
        case 'c': o.chat = 1; break;
        case 'E':
            if (strcmp(optarg, "vllm") && strcmp(optarg, "sglang")) usage();
            o.engine = strcmp(optarg, "sglang") ? KV_CHAT_VLLM : KV_CHAT_SGLANG;
            break;
        case 'T': o.template = optarg; break;
        case 'j': o.jsonl = 1; break;
        case 's': o.skip_special = 1; break;
        case 'b': o.block_size = strtol(optarg, NULL, 10); break;
        case 'S': o.salt = optarg; break;
        default: usage();
        }
    }
    if (strcmp(cmd, "hash") == 0) {
        return cmd_hash(&o);
    }
    if (o.tokenizer == NULL) usage();
    o.tok = kv_tokenizer_load(o.tokenizer, err, sizeof(err));
    if (o.tok == NULL) {
        fprintf(stderr, "kvtok: %s: %s\n", o.tokenizer, err);
        return 1;
    }
    if (o.chat) o.tpl = load_template(&o);
    if (strcmp(cmd, "encode") == 0) return cmd_encode(&o);
    if (strcmp(cmd, "decode") == 0) return cmd_decode(&o);
    if (strcmp(cmd, "bench") == 0 && optind < argc) return cmd_bench(&o, argv[optind]);
    usage();
    return 2;
}
