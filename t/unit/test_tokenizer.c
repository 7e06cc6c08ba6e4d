/*
 * The tokenizer against HF tokenizers: every line of the fixtures made by
 * tools/gen-tokenizer-fixtures.py must match exactly (encode with and
 * without special tokens, decode). Plus refusals.
 */
#include <stdlib.h>

#include <jansson.h>

#include "kvtest.h"
#include "kv_tokenizer.h"

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
    /* the verbatim TinyLlama file is refused, as HF tokenizers refuses it */
    CHECK(kv_tokenizer_load("conf/tokenizers/tinyllama-1.1b-chat-v1.0/tokenizer.json",
                            err, sizeof(err)) == NULL);
    CHECK(strstr(err, "merges[18917]") != NULL);
}

int main(void)
{
    RUN(gpt2_matches_hf);
    RUN(phi3_matches_hf);
    RUN(qwen25_matches_hf);
    RUN(smollm3_matches_hf);
    RUN(refuses_what_it_does_not_support);
    return kvt_done();
}
