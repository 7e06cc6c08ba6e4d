/*
 * Turn-delta tokenization (src/route/kv_turn.c, src/text/kv_tok_bound.c,
 * src/index/kv_tcache.c): with the cache, a text's ids equal the ids of
 * tokenizing it whole, always. Differential over every shipped tokenizer
 * (conf/tokenizers) crossed with every shipped chat template (the fixtures
 * of t/data/chat, each conversation grown a message at a time as a chat
 * grows turn by turn), completion texts built from the tokenizer fixtures
 * (t/data/tokenizer) joined by every kind of added token, edited history,
 * eviction, TTL, and two processes sharing one cache.
 */
#include <signal.h>
#include <stdlib.h>
#include <time.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <jansson.h>

#include "kv_chat.h"
#include "kv_request.h"
#include "kv_turn.h"
#include "kvtest.h"

static const char *tok_names[] = {
    "gpt2", "phi-3-mini-4k-instruct", "qwen2.5-instruct", "smollm3-3b",
};      /* (the shipped TinyLlama file is refused by the loader, as by HF) */
#define NTOK (sizeof(tok_names) / sizeof(tok_names[0]))

typedef struct {
    kv_tokenizer_t  *tok;
    kv_tok_bounds_t *bounds;
    void            *mem;
    size_t           size;
    kv_turn_t        turn;
    uint64_t         checked, reused;
} fixture_t;

static kv_tokenizer_t *load_tok(const char *name)
{
    char path[256], err[256];

    snprintf(path, sizeof(path), "conf/tokenizers/%s/tokenizer.json", name);
    return kv_tokenizer_load(path, err, sizeof(err));
}

static int setup(fixture_t *f, kv_tokenizer_t *tok, size_t size, uint64_t ttl, int shared)
{
    char err[256];

    memset(f, 0, sizeof(*f));
    f->tok = tok;
    f->bounds = kv_tok_bounds_new(tok);
    f->size = size;
    f->mem = shared ? mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0)
                    : aligned_alloc(64, size);
    if (f->mem == MAP_FAILED || f->mem == NULL || f->bounds == NULL) {
        return -1;
    }
    f->turn.cache = kv_tcache_create(f->mem, size, ttl, err, sizeof(err));
    f->turn.bounds = f->bounds;
    return f->turn.cache ? 0 : -1;
}

static void teardown(fixture_t *f, int shared)
{
    if (shared) {
        munmap(f->mem, f->size);
    } else {
        free(f->mem);
    }
    kv_tok_bounds_free(f->bounds);
}

/* 1 when the cached path gives exactly the whole text's ids. */
static int same(fixture_t *f, kv_request_kind_t kind, const char *text, size_t len,
                uint64_t now, kv_turn_info_t *info)
{
    kv_ids_t       want = { 0 }, got = { 0 };
    kv_turn_info_t dummy;
    long           a, b;
    int            ok;

    if (info == NULL) {
        info = &dummy;
    }
    a = kv_request_encode(f->tok, kind, text, len, &want);
    b = kv_turn_encode(&f->turn, f->tok, kind, text, len, now, &got, info);
    ok = a == b && want.n == got.n
         && (want.n == 0 || memcmp(want.ids, got.ids, want.n * sizeof(uint32_t)) == 0);
    if (!ok) {
        fprintf(stderr, "  mismatch: %ld vs %ld ids, reused %zu bytes, text \"%.*s\"\n", a, b,
                info->reused_bytes, (int) (len < 200 ? len : 200), text);
    }
    f->checked++;
    f->reused += info->reused_bytes > 0;
    kv_ids_free(&want);
    kv_ids_free(&got);
    return ok;
}

TEST(cut_tokens_exclude_overlapping_added_tokens)
{
    /* t/data/tokenizer/overlapping_added_tokens.json: "<a>" is inside "<a>b",
     * "x[" ends with the start of "[b]", " <c>" starts with a space: the cuts
     * are "<a>b", "x[", "<d>" (rstrip), "{e}" */
    static const char *parts[] = { "<a>", "<a>b", "x[", "[b]", " <c>", "<d>", " ", "  ", "a",
                                   "{e}", "x", "<", ">", "[", "d", "\n" };
    char            err[256], text[256];
    json_error_t    jerr;
    json_t         *tj = json_load_file("conf/tokenizers/gpt2/tokenizer.json", 0, &jerr);
    char           *json;
    kv_tokenizer_t *tok;
    fixture_t       f;
    size_t          n = 0, k, i;
    unsigned        seed = 7;

    /* GPT-2 with these added tokens instead of its own */
    CHECK(tj != NULL);
    json_object_set_new(tj, "added_tokens",
                        json_load_file("t/data/tokenizer/overlapping_added_tokens.json", 0, &jerr));
    json = json_dumps(tj, JSON_COMPACT);
    tok = kv_tokenizer_load_buffer(json, strlen(json), err, sizeof(err));
    free(json);
    json_decref(tj);
    CHECK(tok != NULL);
    if (tok == NULL) {
        fprintf(stderr, "  %s\n", err);
        return;
    }
    CHECK(setup(&f, tok, 1 << 20, 0, 0) == 0);
    CHECK_EQ_U64(kv_tok_bounds_count(f.bounds), 4);
    /* random texts over the troublesome pieces, each grown from the last */
    for (i = 0; i < 4000; i++) {
        if (i % 20 == 0) {
            n = 0;
        }
        for (k = 0; k < 3 && n + 8 < sizeof(text); k++) {
            const char *p = parts[(seed = seed * 1103515245 + 12345) >> 16 & 15];

            memcpy(text + n, p, strlen(p));
            n += strlen(p);
        }
        CHECK(same(&f, KV_REQUEST_CHAT, text, n, 0, NULL));
        CHECK(same(&f, KV_REQUEST_COMPLETION, text, n, 0, NULL));
    }
    CHECK(f.reused > 0);
    teardown(&f, 0);
    kv_tokenizer_free(tok);
}

/* Every template's fixture conversations, grown a message at a time. */
static void chat_cases(fixture_t *f, const kv_chat_template_t *tpl, const char *fixtures)
{
    json_error_t jerr;
    char         line[1 << 16], err[256];
    FILE        *fp = fopen(fixtures, "r");

    CHECK(fp != NULL);
    while (fp && fgets(line, sizeof(line), fp)) {
        json_t *d = json_loads(line, 0, &jerr), *msgs, *sub;
        const char *out;
        size_t  j, len;
        char   *text;

        if (d == NULL) {
            continue;
        }
        msgs = json_object_get(d, "messages");
        for (j = 1; j <= json_array_size(msgs); j++) {
            sub = json_array();
            for (size_t k = 0; k < j; k++) {
                json_array_append(sub, json_array_get(msgs, k));
            }
            text = kv_chat_render_ex(tpl, sub, json_object_get(d, "tools"), 1,
                                     json_object_get(d, "kwargs"), 1721995200, &len, err,
                                     sizeof(err));
            if (text) {
                CHECK(same(f, KV_REQUEST_CHAT, text, len, 0, NULL));
                free(text);
            }
            json_decref(sub);
        }
        out = json_string_value(json_object_get(d, "output"));
        if (out) {
            CHECK(same(f, KV_REQUEST_CHAT, out, strlen(out), 0, NULL));
        }
        json_decref(d);
    }
    if (fp) {
        fclose(fp);
    }
}

TEST(every_template_and_tokenizer_equals_full_tokenization)
{
    json_error_t jerr;
    json_t      *index = json_load_file("t/data/chat/index.json", 0, &jerr), *e;
    size_t       i, k;
    char         err[256], path[256];

    CHECK(index != NULL);
    for (i = 0; index && i < NTOK; i++) {
        kv_tokenizer_t *tok = load_tok(tok_names[i]);
        fixture_t       f;

        CHECK(tok != NULL);
        if (tok == NULL || setup(&f, tok, 4 << 20, 0, 0) != 0) {
            CHECK(0);
            continue;
        }
        json_array_foreach(json_object_get(index, "templates"), k, e) {
            const char         *name = json_string_value(json_object_get(e, "name"));
            kv_chat_template_t *tpl = kv_chat_load(
                json_string_value(json_object_get(e, "config")), NULL, err, sizeof(err));

            CHECK(tpl != NULL);
            if (tpl) {
                snprintf(path, sizeof(path), "t/data/chat/%s.jsonl", name);
                chat_cases(&f, tpl, path);
                kv_chat_free(tpl);
            }
        }
        if (strcmp(tok_names[i], "gpt2") != 0) {
            CHECK(f.reused > 0);    /* the grown conversations hit */
        }
        fprintf(stderr, "  %s: %zu cut tokens, %llu texts, %llu reused a prefix\n",
                tok_names[i], kv_tok_bounds_count(f.bounds), (unsigned long long) f.checked,
                (unsigned long long) f.reused);
        teardown(&f, 0);
        kv_tokenizer_free(tok);
    }
    json_decref(index);
}

/* The tokenizer fixture strings, one a line. */
static char **fixture_texts(const char *name, size_t *n)
{
    char         path[256], line[1 << 16];
    char       **v = NULL;
    size_t       cap = 0;
    json_error_t jerr;
    FILE        *fp;

    snprintf(path, sizeof(path), "t/data/tokenizer/%s.jsonl", name);
    *n = 0;
    fp = fopen(path, "r");
    while (fp && fgets(line, sizeof(line), fp)) {
        json_t     *d = json_loads(line, 0, &jerr);
        const char *s = json_string_value(json_object_get(d, "text"));

        if (s) {
            if (*n == cap) {
                v = realloc(v, (cap = cap ? cap * 2 : 1024) * sizeof(char *));
            }
            v[(*n)++] = strdup(s);
        }
        json_decref(d);
    }
    if (fp) {
        fclose(fp);
    }
    return v;
}

TEST(completion_texts_joined_by_added_tokens_equal_full_tokenization)
{
    static const char *around[][2] = { { "", "" }, { " ", " " }, { "", "\n\n" }, { "\n", " " },
                                       { "  ", "\t" } };
    json_error_t jerr;
    size_t       i;

    for (i = 0; i < NTOK; i++) {
        char            path[256];
        kv_tokenizer_t *tok = load_tok(tok_names[i]);
        json_t         *tj, *a;
        fixture_t       f;
        size_t          nstr = 0, k, s, step;
        char          **strs, *text;

        snprintf(path, sizeof(path), "conf/tokenizers/%s/tokenizer.json", tok_names[i]);
        tj = json_load_file(path, 0, &jerr);
        strs = fixture_texts(tok_names[i], &nstr);
        if (tok == NULL || tj == NULL || nstr == 0 || setup(&f, tok, 4 << 20, 0, 0) != 0) {
            CHECK(0);
            continue;
        }
        text = malloc(1 << 20);
        /* each added token (every 16th of a long list), 300 strings a token */
        step = json_array_size(json_object_get(tj, "added_tokens")) / 16 + 1;
        for (k = 0; k < json_array_size(json_object_get(tj, "added_tokens")); k += step) {
            const char *x;
            size_t      n = 0;

            a = json_array_get(json_object_get(tj, "added_tokens"), k);
            x = json_string_value(json_object_get(a, "content"));
            for (s = 0; s < 300; s++) {
                const char *str = strs[(k * 131 + s) % nstr];
                const char *l = around[s % 5][0], *r = around[s % 5][1];

                if (s % 12 == 0 || n + strlen(str) + 64 > (1 << 20)) {
                    n = 0;
                }
                n += (size_t) sprintf(text + n, "%s%s%s%s", str, l, x, r);
                CHECK(same(&f, s % 2 ? KV_REQUEST_CHAT : KV_REQUEST_COMPLETION, text, n, 0,
                           NULL));
                /* and one more string after the cut, not yet followed by a token */
                n += (size_t) sprintf(text + n, "%s", strs[(k * 131 + s + 7) % nstr]);
                CHECK(same(&f, KV_REQUEST_COMPLETION, text, n, 0, NULL));
            }
        }
        if (kv_tok_bounds_count(f.bounds)) {
            CHECK(f.reused > 0);
        }
        free(text);
        for (s = 0; s < nstr; s++) {
            free(strs[s]);
        }
        free(strs);
        json_decref(tj);
        teardown(&f, 0);
        kv_tokenizer_free(tok);
    }
}

/* A 10-turn chat of prose messages in the Qwen2.5 template. */
static char *qwen_turn(const kv_chat_template_t *tpl, const char *prose, int turns, int edit,
                       size_t *len)
{
    json_t *msgs = json_array();
    char    err[256], *text, buf[2100];
    int     i;

    json_array_append_new(msgs, json_pack("{s:s,s:s}", "role", "system", "content",
                                          "You are a helpful assistant."));
    for (i = 0; i < 2 * turns - 1; i++) {
        memcpy(buf, prose + 2048 * i, 2048);
        buf[2048] = '\0';
        if (i == edit) {
            buf[100] = buf[100] == 'x' ? 'y' : 'x';
        }
        json_array_append_new(msgs, json_pack("{s:s,s:s}", "role", i % 2 ? "assistant" : "user",
                                              "content", buf));
    }
    text = kv_chat_render_at(tpl, msgs, NULL, 1, 0, len, err, sizeof(err));
    json_decref(msgs);
    return text;
}

static char *read_prose(void)
{
    FILE  *fp = fopen("t/data/prose_en.txt", "r");
    char  *p = calloc(1, 1 << 16);
    size_t n = fp ? fread(p, 1, (1 << 16) - 1, fp) : 0;

    for (size_t i = 0; i < n; i++) {
        if ((unsigned char) p[i] >= 0x80) {
            p[i] = '?';         /* keep fixed 2 KB slices whole characters */
        }
    }
    if (fp) {
        fclose(fp);
    }
    return p;
}

TEST(follow_up_turns_reuse_and_edited_history_misses)
{
    char                err[256], *prose = read_prose(), *t, *prev = NULL;
    kv_tokenizer_t     *tok = load_tok("qwen2.5-instruct");
    kv_chat_template_t *tpl = kv_chat_load("conf/tokenizers/qwen2.5-instruct/tokenizer_config.json",
                                           NULL, err, sizeof(err));
    fixture_t           f;
    kv_turn_info_t      info;
    kv_tcache_stats_t   st;
    size_t              len, plen = 0, d;
    int                 turn;

    CHECK(tok && tpl && setup(&f, tok, 8 << 20, 60000, 0) == 0);
    for (turn = 1; turn <= 10; turn++) {
        t = qwen_turn(tpl, prose, turn, -1, &len);
        CHECK(same(&f, KV_REQUEST_CHAT, t, len, 1000, &info));
        if (turn > 1) {
            /* all of the last turn's text up to its generation prompt */
            CHECK(info.reused_bytes > 0 && info.reused_bytes <= plen);
            CHECK(plen - info.reused_bytes < 32);
        } else {
            CHECK(info.reused_bytes == 0);
        }
        free(prev);
        prev = t;
        plen = len;
    }
    /* turn 10 again with message 3 edited: reuse stops before the edit */
    t = qwen_turn(tpl, prose, 10, 3, &len);
    for (d = 0; d < len && t[d] == prev[d]; d++) {
        /* void */
    }
    CHECK(same(&f, KV_REQUEST_CHAT, t, len, 1000, &info));
    CHECK(info.reused_bytes <= d);
    CHECK(info.reused_bytes > 0);        /* turn 4's entry is still there */
    /* past the TTL, nothing is reused */
    CHECK(same(&f, KV_REQUEST_CHAT, prev, plen, 1000 + 60001, &info));
    CHECK(info.reused_bytes == 0);
    kv_tcache_stats(f.turn.cache, &st);
    CHECK(st.hits >= 9 && st.expired > 0 && st.misses > 0);
    free(t);
    free(prev);
    free(prose);
    teardown(&f, 0);
    kv_chat_free(tpl);
    kv_tokenizer_free(tok);
}

TEST(tcache_evicts_oldest_and_expires)
{
    size_t             size = kv_tcache_min_size() + 4096, i, n;
    void              *mem = aligned_alloc(64, 1 << 16);
    char               err[128], text[3000];
    uint32_t           ids[64], *got;
    kv_tcache_t       *c = kv_tcache_create(mem, size, 1000, err, sizeof(err));
    kv_tcache_probe_t  p;
    kv_tcache_stats_t  st;

    CHECK(c != NULL && kv_tcache_create(mem, 100, 0, err, sizeof(err)) == NULL);
    for (i = 0; i < 64; i++) {
        ids[i] = (uint32_t) i;
    }
    for (i = 0; i < 200; i++) {
        memset(text, 'a' + (int) (i % 26), sizeof(text));
        snprintf(text, 16, "%zu", i);
        CHECK(kv_tcache_put(c, 1000 + i, text, 1000, ids, 64, 5) == 0);
    }
    kv_tcache_stats(c, &st);
    CHECK(st.stored == 200 && st.evicted > 150);
    /* the newest is there, the oldest is gone */
    p.key = 1000 + 199;
    p.len = 1000;
    CHECK(kv_tcache_get(c, &p, 1, text, 5, &got, &n) == 0 && n == 64 && got[63] == 63);
    free(got);
    p.len = 999;
    CHECK(kv_tcache_get(c, &p, 1, text, 5, &got, &n) == -1);      /* other length */
    p.len = 1000;
    text[500] ^= 1;
    CHECK(kv_tcache_get(c, &p, 1, text, 5, &got, &n) == -1);      /* other text, same key */
    text[500] ^= 1;
    memset(text, 'a', sizeof(text));
    snprintf(text, 16, "%d", 0);
    p.key = 1000;
    CHECK(kv_tcache_get(c, &p, 1, text, 5, &got, &n) == -1);      /* evicted */
    /* TTL: at 1005 still there, at 1006 expired */
    memset(text, 'a' + 199 % 26, sizeof(text));
    snprintf(text, 16, "%d", 199);
    p.key = 1199;
    CHECK(kv_tcache_get(c, &p, 1, text, 1005, &got, &n) == 0);
    free(got);
    CHECK(kv_tcache_get(c, &p, 1, text, 1006, &got, &n) == -1);
    kv_tcache_stats(c, &st);
    CHECK(st.expired == 1 && st.hits == 2);
    /* too large for the ring: skipped */
    {
        char *big = calloc(1, 16384);

        CHECK(kv_tcache_put(c, 1, big, 16384, ids, 64, 5) == 1);
        free(big);
    }
    /* a lock left by a dead process is taken over, and so is one held
     * too long (a reused pid); a live holder taking it now is not (the
     * lock is the header's sixth word: pid << 32 | seconds, kv_tcache.c) */
    {
        pid_t           pid = fork();
        struct timespec ts;
        uint64_t        now, *lock = &((uint64_t *) mem)[5];

        if (pid == 0) {
            _exit(0);
        }
        waitpid(pid, NULL, 0);
        clock_gettime(CLOCK_MONOTONIC, &ts);
        now = (uint32_t) ts.tv_sec;
        *lock = (uint64_t) pid << 32 | now;
        CHECK(kv_tcache_put(c, 7, text, 100, ids, 4, 5) == 0);
        *lock = (uint64_t) getppid() << 32 | now;           /* a live holder: skipped */
        CHECK(kv_tcache_put(c, 8, text, 100, ids, 4, 5) == 1);
        *lock = (uint64_t) getpid() << 32 | now;            /* this process, another thread */
        CHECK(kv_tcache_put(c, 8, text, 100, ids, 4, 5) == 1);
        *lock = (uint64_t) getpid() << 32 | (uint32_t) (now - 60);     /* a reused pid */
        CHECK(kv_tcache_put(c, 8, text, 100, ids, 4, 5) == 0);
        *lock = (uint64_t) getppid() << 32 | (uint32_t) (now - 60);    /* held a minute */
        CHECK(kv_tcache_put(c, 9, text, 100, ids, 4, 5) == 0);
        *lock = 0;
    }
    CHECK(kv_tcache_attach(mem, size) == c && kv_tcache_attach(mem, size + 8) == NULL);
    free(mem);
}

/* Two processes grow chats against one small shared cache (constant
 * eviction under their reads): every result must be exact. */
TEST(two_processes_share_the_cache_exactly)
{
    char                err[256], *prose = read_prose();
    kv_tokenizer_t     *tok = load_tok("qwen2.5-instruct");
    kv_chat_template_t *tpl = kv_chat_load("conf/tokenizers/qwen2.5-instruct/tokenizer_config.json",
                                           NULL, err, sizeof(err));
    fixture_t           f;
    kv_turn_info_t      info;
    kv_tcache_stats_t   st;
    pid_t               pids[2];
    int                 i, status, turn, round;
    size_t              len;
    char               *t;

    CHECK(tok && tpl && setup(&f, tok, 256 << 10, 0, 1) == 0);
    /* one process stores a turn, another reuses it */
    if ((pids[0] = fork()) == 0) {
        t = qwen_turn(tpl, prose, 3, -1, &len);
        _exit(same(&f, KV_REQUEST_CHAT, t, len, 0, NULL) ? 0 : 1);
    }
    CHECK(waitpid(pids[0], &status, 0) == pids[0] && WIFEXITED(status)
          && WEXITSTATUS(status) == 0);
    t = qwen_turn(tpl, prose, 4, -1, &len);
    CHECK(same(&f, KV_REQUEST_CHAT, t, len, 0, &info));
    CHECK(info.reused_bytes > 0);
    free(t);
    for (i = 0; i < 2; i++) {
        if ((pids[i] = fork()) == 0) {
            int bad = 0;

            for (round = 0; round < 6; round++) {
                for (turn = 1; turn <= 6; turn++) {
                    /* each process edits a different message: distinct chats */
                    t = qwen_turn(tpl, prose + 64 * i + round, turn, (i + round) % 5, &len);
                    bad += !same(&f, KV_REQUEST_CHAT, t, len, 0, NULL);
                    free(t);
                }
            }
            _exit(bad ? 1 : 0);
        }
    }
    for (i = 0; i < 2; i++) {
        CHECK(waitpid(pids[i], &status, 0) == pids[i] && WIFEXITED(status)
              && WEXITSTATUS(status) == 0);
    }
    kv_tcache_stats(f.turn.cache, &st);
    CHECK(st.hits > 10 && st.evicted > 0);
    fprintf(stderr, "  shared: %llu lookups, %llu hits, %llu evicted, %llu skipped\n",
            (unsigned long long) st.lookups, (unsigned long long) st.hits,
            (unsigned long long) st.evicted, (unsigned long long) st.skipped);
    free(prose);
    teardown(&f, 1);
    kv_chat_free(tpl);
    kv_tokenizer_free(tok);
}

int main(void)
{
    RUN(cut_tokens_exclude_overlapping_added_tokens);
    RUN(every_template_and_tokenizer_equals_full_tokenization);
    RUN(completion_texts_joined_by_added_tokens_equal_full_tokenization);
    RUN(follow_up_turns_reuse_and_edited_history_misses);
    RUN(tcache_evicts_oldest_and_expires);
    RUN(two_processes_share_the_cache_exactly);
    return kvt_done();
}
