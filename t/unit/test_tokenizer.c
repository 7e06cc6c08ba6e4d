/*
 * The tokenizer against HF tokenizers: every line of the fixtures made by
 * tools/gen-tokenizer-fixtures.py must match exactly (encode with and
 * without special tokens, decode); long words, against HF too, and the
 * work they cost as counts. Plus refusals.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <jansson.h>

#include "kvtest.h"
#include "kv_tokenizer.h"
#include "kv_tok_bound.h"
#include "kv_tok_int.h"
#include "kv_unicode.h"

static const char *models[] = {
    "gpt2", "phi-3-mini-4k-instruct", "qwen2.5-instruct", "smollm3-3b",
};

static int from_hex(const char *h, char *out)
{
    int n = 0;
    unsigned v;

    while (h[0] && h[1] && sscanf(h, "%2x", &v) == 1) {
        out[n++] = (char) v;
        h += 2;
    }
    return n;
}

static int ids_equal(const kv_ids_t *got, json_t *want)
{
    size_t i;

    if (got->n != json_array_size(want)) {
        return 0;
    }
    for (i = 0; i < got->n; i++) {
        if ((json_int_t) got->ids[i] != json_integer_value(json_array_get(want, i))) {
            return 0;
        }
    }
    return 1;
}

static void check_model(const char *name)
{
    char            path[256], err[512], line_buf[1 << 16];
    kv_tokenizer_t *t;
    FILE           *f;
    char           *line = NULL;
    size_t          cap = 0, lines = 0, bad_enc = 0, bad_plain = 0, bad_dec = 0;
    ssize_t         n;

    snprintf(path, sizeof(path), "conf/tokenizers/%s/tokenizer.json", name);
    t = kv_tokenizer_load(path, err, sizeof(err));
    if (t == NULL) {
        fprintf(stderr, "  %s: %s\n", name, err);
        CHECK(t != NULL);
        return;
    }
    snprintf(path, sizeof(path), "t/data/tokenizer/%s.jsonl", name);
    f = fopen(path, "r");
    CHECK(f != NULL);
    if (f == NULL) {
        kv_tokenizer_free(t);
        return;
    }
    while ((n = getline(&line, &cap, f)) > 0) {
        json_error_t je;
        json_t      *rec = json_loads(line, 0, &je);
        const char  *text;
        char        *raw = line_buf, *dec;
        size_t       len, dlen;
        kv_ids_t     ids = { 0 }, plain = { 0 };

        lines++;
        if (json_object_get(rec, "hex")) {
            len = (size_t) from_hex(json_string_value(json_object_get(rec, "hex")), raw);
        } else {
            text = json_string_value(json_object_get(rec, "text"));
            len = json_string_length(json_object_get(rec, "text"));
            raw = (char *) text;
        }
        kv_tokenizer_encode(t, raw, len, 1, &ids);
        kv_tokenizer_encode(t, raw, len, 0, &plain);
        if (!ids_equal(&ids, json_object_get(rec, "ids"))) {
            if (bad_enc++ < 5) {
                fprintf(stderr, "  %s line %zu: encode differs (%zu ids, want %zu): %.80s\n",
                        name, lines, ids.n, json_array_size(json_object_get(rec, "ids")), line);
            }
        }
        if (!ids_equal(&plain, json_object_get(rec, "ids_nospecial"))) {
            bad_plain++;
        }
        {
            json_t  *want = json_object_get(rec, "ids");
            uint32_t *w = malloc((json_array_size(want) + 1) * sizeof(uint32_t));

            for (size_t i = 0; i < json_array_size(want); i++) {
                w[i] = (uint32_t) json_integer_value(json_array_get(want, i));
            }
            dec = kv_tokenizer_decode(t, w, json_array_size(want), 0, &dlen);
            if (dec == NULL || strcmp(dec, json_string_value(json_object_get(rec, "decoded"))) != 0) {
                if (bad_dec++ < 3) {
                    fprintf(stderr, "  %s line %zu: decode differs: got \"%.60s\" want \"%.60s\"\n",
                            name, lines, dec ? dec : "(null)",
                            json_string_value(json_object_get(rec, "decoded")));
                }
            }
            free(dec);
            free(w);
        }
        kv_ids_free(&ids);
        kv_ids_free(&plain);
        json_decref(rec);
    }
    fclose(f);
    free(line);
    fprintf(stderr, "  %s: %zu strings, %zu encode / %zu no-special / %zu decode mismatches\n",
            name, lines, bad_enc, bad_plain, bad_dec);
    CHECK(lines >= 2000);
    CHECK(bad_enc == 0 && bad_plain == 0 && bad_dec == 0);
    kv_tokenizer_free(t);
}

TEST(gpt2_matches_hf) { check_model(models[0]); }
TEST(phi3_matches_hf) { check_model(models[1]); }
TEST(qwen25_matches_hf) { check_model(models[2]); }
TEST(smollm3_matches_hf) { check_model(models[3]); }

/* A SentencePiece-style model kvroute loads, to add one bad part to. */
#define SP_MODEL_OF(vocab, merges) \
    "\"normalizer\":{\"type\":\"Sequence\",\"normalizers\":[{\"type\":\"Prepend\"," \
    "\"prepend\":\"\\u2581\"},{\"type\":\"Replace\",\"pattern\":{\"String\":\" \"}," \
    "\"content\":\"\\u2581\"}]},\"model\":{\"type\":\"BPE\",\"vocab\":" vocab "," \
    "\"merges\":" merges "}"
#define SP_MODEL    SP_MODEL_OF("{\"a\":0,\"\\u2581\":1}", "[]")
#define SP_DECODER(start, stop) \
    "{\"type\":\"Sequence\",\"decoders\":[{\"type\":\"Replace\",\"pattern\":{\"String\":" \
    "\"\\u2581\"},\"content\":\" \"},{\"type\":\"ByteFallback\"},{\"type\":\"Fuse\"}," \
    "{\"type\":\"Strip\",\"content\":\" \",\"start\":" start ",\"stop\":" stop "}]}"

TEST(refuses_what_it_does_not_support)
{
    static const struct { const char *json; const char *needle; } cases[] = {
        { "{\"model\":{\"type\":\"Unigram\",\"vocab\":[]}}", "Unigram" },
        { "{\"normalizer\":{\"type\":\"NFKC\"},\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},"
          "\"merges\":[]}}", "NFKC" },
        { "{\"pre_tokenizer\":{\"type\":\"Whitespace\"},\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},"
          "\"merges\":[]}}", "Whitespace" },
        { "{\"model\":{\"type\":\"BPE\",\"dropout\":0.1,\"vocab\":{\"a\":0},\"merges\":[]}}",
          "dropout" },
        { "{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[\"a b\"]}}", "not in the vocab" },
        { "{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]},\"added_tokens\":"
          "[{\"id\":1,\"content\":\"x\",\"single_word\":true}]}", "single_word" },
        { "not json", "tokenizer.json" },
        /* merges are packed with 21-bit ids (kv_tok_int.h) */
        { "{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":2097151},\"merges\":[]}}",
          "ids are supported" },
        /* malformed files, refused before any id indexes a table */
        { "{" SP_MODEL ",\"added_tokens\":[{\"id\":-1,\"content\":\"<x>\"}]}", "out of range" },
        { "{" SP_MODEL ",\"added_tokens\":[{\"id\":4294967301,\"content\":\"<x>\"}]}",
          "out of range" },
        { "{" SP_MODEL ",\"added_tokens\":[{\"id\":16777216,\"content\":\"<x>\"}]}",
          "out of range" },
        { "{" SP_MODEL ",\"added_tokens\":[{\"id\":16777215,\"content\":\"<x>\"}]}",
          "ids are supported" },
        { "{" SP_MODEL ",\"decoder\":{\"type\":\"Sequence\",\"decoders\":[{},{},{},{}]}}",
          "decoder Sequence" },
        { "{" SP_MODEL ",\"decoder\":{\"type\":\"Sequence\",\"decoders\":[{\"type\":\"Replace\"},"
          "{\"type\":\"ByteFallback\"},{\"type\":\"Fuse\"},{\"type\":\"Strip\",\"content\":\" \","
          "\"start\":1,\"stop\":0}]}}", "Replace" },
        { "{" SP_MODEL ",\"decoder\":" SP_DECODER("1", "3") "}", "Strip" },
        { "{" SP_MODEL ",\"decoder\":" SP_DECODER("-5", "0") "}", "Strip" },
        { "{" SP_MODEL ",\"decoder\":" SP_DECODER("\"x\"", "0") "}", "Strip" },
        { "{" SP_MODEL ",\"post_processor\":{\"type\":\"TemplateProcessing\",\"single\":"
          "[{\"SpecialToken\":{\"id\":\"X\"}},{\"Sequence\":{\"id\":\"A\"}}],"
          "\"special_tokens\":{\"X\":{\"ids\":[99999999]}}}}", "not in the vocab" },
    };
    char   err[512];
    size_t i;

    for (i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        kv_tokenizer_t *t = kv_tokenizer_load_buffer(cases[i].json, strlen(cases[i].json),
                                                     err, sizeof(err));
        CHECK(t == NULL);
        if (t == NULL && strstr(err, cases[i].needle) == NULL) {
            fprintf(stderr, "  case %zu: \"%s\" lacks \"%s\"\n", i, err, cases[i].needle);
            CHECK(0);
        }
        kv_tokenizer_free(t);
    }
    /* the base of the malformed cases loads, with its decoder too */
    {
        static const char ok[] = "{" SP_MODEL ",\"decoder\":" SP_DECODER("1", "0") "}";
        kv_tokenizer_t   *t = kv_tokenizer_load_buffer(ok, strlen(ok), err, sizeof(err));

        CHECK(t != NULL);
        if (t == NULL) {
            fprintf(stderr, "  %s\n", err);
        }
        kv_tokenizer_free(t);
    }
    /* the verbatim TinyLlama file is refused, as HF tokenizers refuses it */
    CHECK(kv_tokenizer_load("conf/tokenizers/tinyllama-1.1b-chat-v1.0/tokenizer.json",
                            err, sizeof(err)) == NULL);
    CHECK(strstr(err, "merges[18917]") != NULL);
}

/* --- long words ------------------------------------------------------------
 * The generator of tools/gen-tokenizer-long-fixtures.py: a 64-bit LCG
 * picking from an alphabet ("": the pattern of an older scaling test). */
static char *gen_text(size_t len, const char *alphabet, uint64_t seed)
{
    char   *s = malloc(len + 1);
    size_t  i, k = strlen(alphabet);
    uint64_t x = seed;

    for (i = 0; i < len; i++) {
        if (k == 0) {
            s[i] = "abcdefghij"[(i * 7 + i / 13) % 10];
        } else {
            x = x * 6364136223846793005ULL + 1442695040888963407ULL;
            s[i] = alphabet[(x >> 33) % k];
        }
    }
    s[len] = '\0';
    return s;
}

static uint64_t fnv_ids(const kv_ids_t *ids)
{
    uint64_t h = 0xcbf29ce484222325ULL;
    size_t   i;
    int      b;

    for (i = 0; i < ids->n; i++) {
        for (b = 0; b < 4; b++) {
            h = (h ^ ((ids->ids[i] >> (8 * b)) & 0xff)) * 0x100000001b3ULL;
        }
    }
    return h;
}

/* Words of 60-300 KB with no space, against HF (t/data/tokenizer/long_words.json). */
TEST(long_words_match_hf)
{
    json_error_t je;
    json_t      *fx = json_load_file("t/data/tokenizer/long_words.json", 0, &je), *c;
    size_t       i, m, cases = 0;
    char         path[256], err[512];

    CHECK(fx != NULL);
    if (fx == NULL) return;
    for (m = 0; m < sizeof(models) / sizeof(models[0]); m++) {
        kv_tokenizer_t *t;

        snprintf(path, sizeof(path), "conf/tokenizers/%s/tokenizer.json", models[m]);
        t = kv_tokenizer_load(path, err, sizeof(err));
        CHECK(t != NULL);
        if (t == NULL) continue;
        json_array_foreach(json_object_get(fx, "cases"), i, c) {
            size_t      len = (size_t) json_integer_value(json_object_get(c, "length"));
            char       *s = gen_text(len, json_string_value(json_object_get(c, "alphabet")),
                                     (uint64_t) json_integer_value(json_object_get(c, "seed")));
            json_t     *want = json_object_get(json_object_get(c, "want"), models[m]);
            kv_ids_t    ids = { 0 };
            char        got[17];

            CHECK(kv_tokenizer_encode(t, s, len, 0, &ids) >= 0);
            snprintf(got, sizeof(got), "%016" PRIx64, fnv_ids(&ids));
            if (ids.n != (size_t) json_integer_value(json_object_get(want, "n"))
                || strcmp(got, json_string_value(json_object_get(want, "fnv"))) != 0)
            {
                fprintf(stderr, "  %s %s: %zu ids %s, want %lld %s\n", models[m],
                        json_string_value(json_object_get(c, "name")), ids.n, got,
                        (long long) json_integer_value(json_object_get(want, "n")),
                        json_string_value(json_object_get(want, "fnv")));
                CHECK(0);
            }
            cases++;
            kv_ids_free(&ids);
            free(s);
        }
        kv_tokenizer_free(t);
    }
    CHECK(cases >= 20);
    json_decref(fx);
}

/*
 * Merges listed out of training order: merging "a b" makes "c ab", of a
 * lower rank than the merge being worked, which must be applied first
 * (HF's order is rank, then position). Short words and long ones (the
 * bucket queue) against HF's ids for the same tokenizer.
 */
TEST(merges_out_of_rank_order_match_hf)
{
    static const char *json =
        "{\"normalizer\":{\"type\":\"Sequence\",\"normalizers\":[{\"type\":\"Prepend\","
        "\"prepend\":\"\\u2581\"},{\"type\":\"Replace\",\"pattern\":{\"String\":\" \"},"
        "\"content\":\"\\u2581\"}]},"
        "\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1,\"c\":2,\"ab\":3,\"cab\":4,"
        "\"bc\":5,\"abc\":6,\"aa\":7,\"aab\":8,\"cabab\":9,\"abab\":10,\"\\u2581\":11},"
        "\"merges\":[\"c ab\",\"a b\",\"ab ab\",\"cab ab\",\"b c\",\"a bc\",\"a a\",\"aa b\"]}}";
    static const struct { size_t len; size_t n; const char *fnv; } want[] = {
        { 40, 30, "56ac97c599635cc9" },
        { 200, 154, "701e07159c3dafd0" },
        { 5000, 3635, "20c1869647870609" },
    };
    char            err[512], got[17];
    kv_tokenizer_t *t = kv_tokenizer_load_buffer(json, strlen(json), err, sizeof(err));
    size_t          i;

    CHECK(t != NULL);
    if (t == NULL) {
        fprintf(stderr, "  %s\n", err);
        return;
    }
    for (i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
        char     *s = gen_text(want[i].len, "abc", 7);
        kv_ids_t  ids = { 0 };

        kv_tokenizer_encode(t, s, want[i].len, 0, &ids);
        snprintf(got, sizeof(got), "%016" PRIx64, fnv_ids(&ids));
        CHECK_EQ_U64(ids.n, want[i].n);
        CHECK_STR(got, want[i].fnv);
        kv_ids_free(&ids);
        free(s);
    }
    /* repeated "cab": every "a b" merge is followed by its "c ab" */
    {
        char     *s = malloc(121);
        kv_ids_t  ids = { 0 };

        for (i = 0; i < 120; i++) s[i] = "cab"[i % 3];
        kv_tokenizer_encode(t, s, 120, 0, &ids);
        CHECK_EQ_U64(ids.n, 41);            /* the prepended "\u2581", then 40 "cab" */
        for (i = 1; i < ids.n; i++) CHECK_EQ_U64(ids.ids[i], 4);
        kv_ids_free(&ids);
        free(s);
    }
    kv_tokenizer_free(t);
}

/* Merges are packed into 8 bytes with 21-bit ids and a 22-bit rank: ids
 * and ranks at the top of the range come back whole. */
TEST(merge_ids_near_the_packing_limit)
{
    static const char *json =
        "{\"normalizer\":{\"type\":\"Sequence\",\"normalizers\":[{\"type\":\"Prepend\","
        "\"prepend\":\"\\u2581\"},{\"type\":\"Replace\",\"pattern\":{\"String\":\" \"},"
        "\"content\":\"\\u2581\"}]},"
        "\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":2097148,\"c\":7,"
        "\"ab\":2097149,\"abc\":5,\"ca\":2097147,\"\\u2581\":9},"
        "\"merges\":[\"c a\",\"a b\",\"ab c\"]}}";
    char            err[512];
    kv_tokenizer_t *t = kv_tokenizer_load_buffer(json, strlen(json), err, sizeof(err));
    kv_ids_t        ids = { 0 };

    CHECK(t != NULL);
    if (t == NULL) {
        fprintf(stderr, "  %s\n", err);
        return;
    }
    /* as HF tokenizers 0.23 gives: "c a" (rank 0) first, then "a b" */
    kv_tokenizer_encode(t, "abcab", 5, 0, &ids);
    CHECK_EQ_U64(ids.n, 4);
    CHECK_EQ_U64(ids.ids[0], 9);
    CHECK_EQ_U64(ids.ids[1], 2097149);
    CHECK_EQ_U64(ids.ids[2], 2097147);
    CHECK_EQ_U64(ids.ids[3], 2097148);
    ids.n = 0;
    kv_tokenizer_encode(t, "abc", 3, 0, &ids);
    CHECK_EQ_U64(ids.n, 2);
    CHECK_EQ_U64(ids.ids[1], 5);
    ids.n = 0;
    kv_tokenizer_encode(t, "cab", 3, 0, &ids);      /* "c a" ranks before "a b" */
    CHECK_EQ_U64(ids.n, 3);
    CHECK_EQ_U64(ids.ids[1], 2097147);
    CHECK_EQ_U64(ids.ids[2], 2097148);
    kv_ids_free(&ids);
    kv_tokenizer_free(t);
}

/*
 * The cost of one huge word grows linearly: the work the tokenizer reports
 * (symbols, merges and queue operations: counts, not time, so the same on
 * every machine) for 1 MB is at most 12x that for 100 KB. The old heap was
 * n log n in operations and worse in time; a quadratic merge would be 100x.
 */
static uint64_t encode_work(const kv_tokenizer_t *t, const char *s, size_t n)
{
    kv_ids_t      ids = { 0 };
    kv_tok_work_t w;

    kv_tokenizer_work(NULL, 1);
    kv_tokenizer_encode(t, s, n, 0, &ids);
    kv_tokenizer_work(&w, 1);
    kv_ids_free(&ids);
    return w.symbols + w.merges + w.queue_ops;
}

TEST(one_megabyte_word_costs_linear_work)
{
    static const char *files[] = {
        "conf/tokenizers/phi-3-mini-4k-instruct/tokenizer.json",
        "conf/tokenizers/qwen2.5-instruct/tokenizer.json",
    };
    static const char *alphabets[] = { "", "abcdefghijklmnopqrstuvwxyz" };
    size_t  big = 1 << 20, small = big / 10, f, a;
    char    err[512];

    for (a = 0; a < 2; a++) {
        char *s = gen_text(big, alphabets[a], 11);

        for (f = 0; f < 2; f++) {
            kv_tokenizer_t *t = kv_tokenizer_load(files[f], err, sizeof(err));
            uint64_t        ws, wb;

            CHECK(t != NULL);
            if (t == NULL) continue;
            ws = encode_work(t, s, small);
            wb = encode_work(t, s, big);
            fprintf(stderr, "  %s, %s: work 100 KB %" PRIu64 ", 1 MB %" PRIu64 " (x%.1f)\n",
                    files[f], a ? "random letters" : "pattern", ws, wb, (double) wb / ws);
            CHECK(ws >= small);         /* every symbol counted */
            CHECK(wb <= 12 * ws);
            kv_tokenizer_free(t);
        }
        free(s);
    }
}

/* --- the per-thread word cache ------------------------------------------ */

typedef struct {
    kv_tokenizer_t *t;
    const char     *text;
    size_t          len;
    kv_ids_t        ids;
} cold_t;

static void *encode_cold(void *arg)
{
    cold_t *c = arg;

    kv_tokenizer_encode(c->t, c->text, c->len, 0, &c->ids);
    return NULL;
}

/*
 * The word cache is per thread and shared by every tokenizer the thread
 * uses: two byte-level tokenizers (gpt2 and Qwen2.5 split and merge the
 * same words differently), each encoding 256 KB of prose in a thread of its
 * own (an empty cache), must give the same ids as when one thread encodes
 * with both in turn, three times over (a cache full of the other's words;
 * the second tokenizer loaded twice: a new tag each time).
 */
TEST(word_cache_keeps_tokenizers_apart)
{
    static const char *files[2] = {
        "conf/tokenizers/gpt2/tokenizer.json", "conf/tokenizers/qwen2.5-instruct/tokenizer.json",
    };
    FILE      *f = fopen("t/data/prose_en.txt", "rb");
    char      *text = malloc(1 << 18), err[512];
    size_t     len = f ? fread(text, 1, 1 << 18, f) : 0, k, round;
    cold_t     cold[2];
    pthread_t  th;
    int        i;

    if (f) fclose(f);
    CHECK(len == 1 << 18);
    while (len > 0 && ((uint8_t) text[len - 1] & 0xc0) == 0x80) {
        len--;                  /* whole characters */
    }
    for (i = 0; i < 2; i++) {
        memset(&cold[i], 0, sizeof(cold[i]));
        cold[i].t = kv_tokenizer_load(files[i], err, sizeof(err));
        CHECK(cold[i].t != NULL);
        if (cold[i].t == NULL) return;
        cold[i].text = text;
        cold[i].len = len;
        pthread_create(&th, NULL, encode_cold, &cold[i]);
        pthread_join(th, NULL);
        CHECK(cold[i].ids.n > 10000);
    }
    for (round = 0; round < 3; round++) {
        for (i = 0; i < 2; i++) {
            kv_ids_t ids = { 0 };

            if (round == 2 && i == 1) {
                kv_tokenizer_free(cold[1].t);
                cold[1].t = kv_tokenizer_load(files[1], err, sizeof(err));
            }
            kv_tokenizer_encode(cold[i].t, text, len, 0, &ids);
            CHECK_EQ_U64(ids.n, cold[i].ids.n);
            for (k = 0; k < ids.n && k < cold[i].ids.n; k++) {
                if (ids.ids[k] != cold[i].ids.ids[k]) {
                    fprintf(stderr, "  %s round %zu: id %zu differs\n", files[i], round, k);
                    CHECK(0);
                    break;
                }
            }
            kv_ids_free(&ids);
        }
    }
    for (i = 0; i < 2; i++) {
        kv_ids_free(&cold[i].ids);
        kv_tokenizer_free(cold[i].t);
    }
    free(text);
}

/* kv_tok_bpe_bytes starts a word's merging from the 256 KB byte-pair rank
 * table instead of the merge table: the same ids as kv_tok_bpe_word from
 * the byte ids, for every pair of bytes and 20,000 random words of 3-60
 * bytes (past the short-word limit too), in each byte-level tokenizer. */
TEST(byte_pair_table_equals_merge_table)
{
    static const char *byte_level[] = { "gpt2", "qwen2.5-instruct", "smollm3-3b" };
    char            path[256], err[512];
    uint8_t         w[64];
    uint32_t        syms[64], x = 12345;
    size_t          m, k, n, bad = 0, words = 0;

    for (m = 0; m < 3; m++) {
        kv_tokenizer_t *t;

        snprintf(path, sizeof(path), "conf/tokenizers/%s/tokenizer.json", byte_level[m]);
        t = kv_tokenizer_load(path, err, sizeof(err));
        CHECK(t != NULL && t->pair_rank != NULL);
        if (t == NULL) {
            return;
        }
        for (k = 0; k < 65536 + 20000; k++) {
            kv_ids_t a = { 0 }, b = { 0 };
            size_t   i;

            if (k < 65536) {
                n = 2;
                w[0] = (uint8_t) (k >> 8);
                w[1] = (uint8_t) k;
            } else {
                /* mostly letters, so merges run deep; any byte sometimes */
                x = x * 1103515245u + 12345u;
                n = 3 + (x >> 8) % 58;
                for (i = 0; i < n; i++) {
                    x = x * 1103515245u + 12345u;
                    w[i] = (x >> 24) % 8 ? (uint8_t) ("etaoinshrdlu "[(x >> 12) % 13])
                                         : (uint8_t) (x >> 16);
                }
            }
            for (i = 0; i < n; i++) {
                syms[i] = t->byte_id[w[i]];
            }
            CHECK(kv_tok_bpe_bytes(t, w, n, &a) == 0);
            CHECK(kv_tok_bpe_word(t, syms, n, &b) == 0);
            if (a.n != b.n || memcmp(a.ids, b.ids, a.n * sizeof(uint32_t)) != 0) {
                bad++;
            }
            words++;
            kv_ids_free(&a);
            kv_ids_free(&b);
        }
        kv_tokenizer_free(t);
    }
    printf("  %zu words compared\n", words);
    CHECK_EQ_U64(bad, 0);
}

/* encode(s[0..len), no specials) is want[0..nwant), else the first difference */
static void check_ids(const kv_tokenizer_t *t, const char *s, size_t len,
                      const uint32_t *want, size_t nwant)
{
    kv_ids_t ids = { 0 };
    size_t   i;

    CHECK(kv_tokenizer_encode(t, s, len, 0, &ids) >= 0);
    CHECK_EQ_U64(ids.n, nwant);
    for (i = 0; i < ids.n && i < nwant; i++) {
        if (ids.ids[i] != want[i]) {
            fprintf(stderr, "  id %zu: %u, want %u\n", i, ids.ids[i], want[i]);
            CHECK(0);
            break;
        }
    }
    kv_ids_free(&ids);
}

/* A NUL byte is text (U+0000) to HF; NFC (Qwen2.5) of a segment with a
 * character that can compose must keep what follows it. Ids from HF
 * tokenizers 0.23.3. */
TEST(nfc_keeps_text_after_nul)
{
    static const char s1[] = "\xd0\x9f\xd1\x80\xd0\xb8\xd0\xb2\xd0\xb5\xd1\x82\0 "
                             "\xd0\xbc\xd0\xb8\xd1\x80, how are you";
    static const uint32_t w1[] = { 53645, 26991, 8178, 188, 137144, 11, 1246, 525, 498 };
    static const char s2[] = "e\xcc\x81\0e\xcc\x81 x\0\0 caf\xc3\xa9\0";     /* e + U+0301 composes */
    static const uint32_t w2[] = { 963, 188, 963, 856, 188, 188, 51950, 188 };
    char            err[512];
    kv_tokenizer_t *t = kv_tokenizer_load("conf/tokenizers/qwen2.5-instruct/tokenizer.json",
                                          err, sizeof(err));

    CHECK(t != NULL);
    if (t == NULL) return;
    check_ids(t, s1, sizeof(s1) - 1, w1, sizeof(w1) / sizeof(w1[0]));
    check_ids(t, s2, sizeof(s2) - 1, w2, sizeof(w2) / sizeof(w2[0]));
    kv_tokenizer_free(t);
}

/* A merge listed twice ranks by its last entry, as in HF (its merges are
 * collected into a map, a later entry replacing an earlier): "a b" comes
 * after "b c", so "abc" is "a" "bc". Ids from HF tokenizers 0.23.3. */
TEST(duplicate_merge_takes_its_last_rank)
{
    static const char json[] = "{" SP_MODEL_OF("{\"a\":0,\"b\":1,\"c\":2,\"ab\":3,\"bc\":4,"
                                               "\"\\u2581\":5}", "[\"a b\",\"b c\",\"a b\"]") "}";
    static const uint32_t abc[] = { 5, 0, 4 }, ab[] = { 5, 3 }, cab[] = { 5, 2, 3 };
    char            err[512];
    kv_tokenizer_t *t = kv_tokenizer_load_buffer(json, strlen(json), err, sizeof(err));

    CHECK(t != NULL);
    if (t == NULL) {
        fprintf(stderr, "  %s\n", err);
        return;
    }
    check_ids(t, "abc", 3, abc, 3);
    check_ids(t, "ab", 2, ab, 2);
    check_ids(t, "cab", 3, cab, 3);
    kv_tokenizer_free(t);
}

/*
 * Added tokens are matched leftmost, then longest (ties: the first in the
 * file), through the sorted search: against a plain scan of every token
 * at every position, on random text over their alphabet. SentencePiece
 * style with no merges, so a segment's ids are "\u2581" then one per
 * character.
 */
static const char *const ov_added[] = {
    "<", "<|", "<|a", "<|ab|>", "a<", "|>", "ab", "b|>", "<|a", "ab|>", "<<|", ">a",
};

static size_t ov_expected(const char *s, size_t n, uint32_t *out)
{
    static const char alpha[] = "ab<|>";
    size_t            i = 0, seg = 0, k = 0, j, m, best;

    while (i <= n) {
        best = SIZE_MAX;
        for (m = 0; i < n && m < sizeof(ov_added) / sizeof(ov_added[0]); m++) {
            size_t len = strlen(ov_added[m]);

            if (len <= n - i && memcmp(s + i, ov_added[m], len) == 0
                && (best == SIZE_MAX || len > strlen(ov_added[best])))
            {
                best = m;
            }
        }
        if (best == SIZE_MAX && i < n) {
            i++;
            continue;
        }
        if (i > seg) {
            out[k++] = 5;                           /* "\u2581" */
            for (j = seg; j < i; j++) {
                out[k++] = (uint32_t) (strchr(alpha, s[j]) - alpha);
            }
        }
        if (i == n) {
            break;
        }
        out[k++] = 100 + (uint32_t) best;
        i = seg = i + strlen(ov_added[best]);
    }
    return k;
}

TEST(added_tokens_leftmost_longest)
{
    char            json[4096], err[512], s[48];
    size_t          m, k, trial, n, bad = 0;
    uint32_t        want[200], x = 99;
    kv_tokenizer_t *t;

    k = (size_t) snprintf(json, sizeof(json), "{" SP_MODEL_OF("{\"a\":0,\"b\":1,\"<\":2,"
                          "\"|\":3,\">\":4,\"\\u2581\":5}", "[]") ",\"added_tokens\":[");
    for (m = 0; m < sizeof(ov_added) / sizeof(ov_added[0]); m++) {
        k += (size_t) snprintf(json + k, sizeof(json) - k, "%s{\"id\":%zu,\"content\":\"%s\"}",
                               m ? "," : "", 100 + m, ov_added[m]);
    }
    snprintf(json + k, sizeof(json) - k, "]}");
    t = kv_tokenizer_load_buffer(json, strlen(json), err, sizeof(err));
    CHECK(t != NULL);
    if (t == NULL) {
        fprintf(stderr, "  %s\n", err);
        return;
    }
    for (trial = 0; trial < 20000; trial++) {
        kv_ids_t ids = { 0 };

        x = x * 1103515245u + 12345u;
        n = (x >> 16) % 40;
        for (m = 0; m < n; m++) {
            x = x * 1103515245u + 12345u;
            s[m] = "ab<|>"[(x >> 16) % 5];
        }
        k = ov_expected(s, n, want);
        kv_tokenizer_encode(t, s, n, 0, &ids);
        if (ids.n != k || (k && memcmp(ids.ids, want, k * sizeof(uint32_t)) != 0)) {
            if (bad++ < 3) {
                fprintf(stderr, "  \"%.*s\": %zu ids, want %zu\n", (int) n, s, ids.n, k);
            }
        }
        kv_ids_free(&ids);
    }
    CHECK_EQ_U64(bad, 0);
    kv_tokenizer_free(t);
}

/* 4096 added tokens sharing their first two bytes, searched by the sorted
 * search (a position compared every token before: 256 KB of "<|" took
 * 1.5 s; that figure is a benchmark's, docs/BENCHMARKS.md, not asserted
 * here): text that starts each of them everywhere matches none, and one
 * written out is found, by the encoder and by the turn cache's cuts. */
TEST(many_added_tokens_searched)
{
    size_t          cap = 64 * 4096 + 1024, k, i, n = 256 * 1024;
    char           *json = malloc(cap), *s = malloc(n), err[512];
    kv_tokenizer_t *t;
    kv_ids_t        ids = { 0 };

    k = (size_t) snprintf(json, cap, "{" SP_MODEL_OF("{\"a\":0,\"b\":1,\"<\":2,"
                          "\"|\":3,\">\":4,\"\\u2581\":5}", "[]") ",\"added_tokens\":[");
    for (i = 0; i < 4096; i++) {
        k += (size_t) snprintf(json + k, cap - k, "%s{\"id\":%zu,\"content\":\"<|tok%zu|>\"}",
                               i ? "," : "", 100 + i, i);
    }
    snprintf(json + k, cap - k, "]}");
    t = kv_tokenizer_load_buffer(json, strlen(json), err, sizeof(err));
    CHECK(t != NULL);
    if (t == NULL) {
        fprintf(stderr, "  %s\n", err);
        free(json);
        free(s);
        return;
    }
    for (i = 0; i < n; i++) {
        s[i] = "<|"[i % 2];
    }
    CHECK_EQ_U64(kv_tokenizer_encode(t, s, n, 0, &ids), n + 1);
    /* the turn cache's cut search (kv_tok_bound.c) likewise: all 4096 are
     * cut tokens, in one list by their first two bytes before */
    {
        kv_tok_bounds_t *bd = kv_tok_bounds_new(t);
        size_t          *cuts = NULL;

        CHECK(bd != NULL && kv_tok_bounds_count(bd) == 4096);
        CHECK(bd != NULL && kv_tok_bounds_find(bd, s, n, &cuts) == 0);
        memcpy(s + 1000, "<|tok4095|>", 11);
        CHECK(bd != NULL && kv_tok_bounds_find(bd, s, n, &cuts) == 1 && cuts[0] == 1011);
        free(cuts);
        kv_tok_bounds_free(bd);
    }
    {
        size_t found = 0;

        ids.n = 0;
        kv_tokenizer_encode(t, s, n, 0, &ids);
        for (i = 0; i < ids.n; i++) {
            found += ids.ids[i] == 100 + 4095;
        }
        CHECK_EQ_U64(found, 1);
    }
    kv_ids_free(&ids);
    kv_tokenizer_free(t);
    free(json);
    free(s);
}

/* The ASCII classes (a constant table): \p{L}, \p{N}, \s as the regexes
 * see them, the rest other. */
TEST(ascii_classes)
{
    uint32_t c;

    for (c = 0; c < 128; c++) {
        int want = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ? KV_UNI_LETTER
                 : (c >= '0' && c <= '9') ? KV_UNI_NUMBER
                 : (c == ' ' || (c >= 9 && c <= 13)) ? KV_UNI_SPACE
                 : KV_UNI_OTHER;

        if (kv_uni_class(c) != want) {
            fprintf(stderr, "  U+%04X: class %d, want %d\n", c, kv_uni_class(c), want);
            CHECK(0);
        }
    }
}

/*
 * The code points whose class moved between Debian's Unicode 15.0 and the
 * 16.0 of HF's regexes, and those HF's NFC (Unicode 9.0) leaves alone that
 * utf8proc would reorder or compose: t/data/tokenizer/unicode.jsonl, HF's
 * ids for each in a few contexts, every shipped tokenizer (made by
 * tools/gen-unicode-tables.py fixtures).
 */
TEST(unicode_versions_match_hf)
{
    kv_tokenizer_t *toks[sizeof(models) / sizeof(models[0])] = { 0 };
    char            path[256], err[512], *line = NULL;
    size_t          cap = 0, lines = 0, bad = 0, k;
    FILE           *f = fopen("t/data/tokenizer/unicode.jsonl", "r");

    CHECK(f != NULL);
    if (f == NULL) return;
    for (k = 0; k < sizeof(models) / sizeof(models[0]); k++) {
        snprintf(path, sizeof(path), "conf/tokenizers/%s/tokenizer.json", models[k]);
        toks[k] = kv_tokenizer_load(path, err, sizeof(err));
        CHECK(toks[k] != NULL);
    }
    while (getline(&line, &cap, f) > 0) {
        json_t     *rec = json_loads(line, 0, NULL);
        const char *model = json_string_value(json_object_get(rec, "model"));
        json_t     *text = json_object_get(rec, "text");
        kv_ids_t    ids = { 0 };

        for (k = 0; model && k < sizeof(models) / sizeof(models[0]); k++) {
            if (strcmp(models[k], model) == 0 && toks[k] != NULL) {
                break;
            }
        }
        lines++;
        if (model == NULL || k == sizeof(models) / sizeof(models[0])
            || kv_tokenizer_encode(toks[k], json_string_value(text), json_string_length(text),
                                   1, &ids) < 0
            || !ids_equal(&ids, json_object_get(rec, "ids")))
        {
            if (bad++ < 5) {
                fprintf(stderr, "  line %zu differs: %.100s", lines, line);
            }
        }
        kv_ids_free(&ids);
        json_decref(rec);
    }
    fprintf(stderr, "  %zu strings, %zu differ from HF\n", lines, bad);
    CHECK(lines >= 2000);
    CHECK(bad == 0);
    for (k = 0; k < sizeof(models) / sizeof(models[0]); k++) {
        kv_tokenizer_free(toks[k]);
    }
    free(line);
    fclose(f);
}

int main(void)
{
    RUN(gpt2_matches_hf);
    RUN(phi3_matches_hf);
    RUN(qwen25_matches_hf);
    RUN(smollm3_matches_hf);
    RUN(refuses_what_it_does_not_support);
    RUN(long_words_match_hf);
    RUN(merges_out_of_rank_order_match_hf);
    RUN(merge_ids_near_the_packing_limit);
    RUN(one_megabyte_word_costs_linear_work);
    RUN(word_cache_keeps_tokenizers_apart);
    RUN(byte_pair_table_equals_merge_table);
    RUN(nfc_keeps_text_after_nul);
    RUN(duplicate_merge_takes_its_last_rank);
    RUN(added_tokens_leftmost_longest);
    RUN(many_added_tokens_searched);
    RUN(ascii_classes);
    RUN(unicode_versions_match_hf);
    return kvt_done();
}
