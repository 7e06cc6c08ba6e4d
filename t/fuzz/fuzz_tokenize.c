/*
 * libFuzzer target: the tokenizer and the cuts the turn-delta cache relies
 * on (kv_tok_bound.h): for every cut b that kv_tok_bounds_find gives in a
 * valid UTF-8 text s,
 *
 *   encode(s) == encode(s[0..b)) ++ encode(s[b..))
 *
 * and ASCII text decodes back to itself. Bytes 1-8 of the input stand for
 * pieces the property is most likely to break on (added tokens, pieces of
 * them, spaces and newlines next to them); the rest is the text itself,
 * valid UTF-8 or not (invalid: encode must still return, and no cut is
 * asked for). First byte odd: Qwen2.5's tokenizer (ChatML's added tokens,
 * an NFC normalizer); even: GPT-2's with added tokens that overlap each
 * other (t/data/tokenizer/overlapping_added_tokens.json, as in
 * t/unit/test_turn.c). Run from the repository's top (make fuzz does).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "kv_tok_bound.h"
#include "kv_tokenizer.h"
#include "kv_unicode.h"

typedef struct {
    kv_tokenizer_t   *tok;
    kv_tok_bounds_t  *bounds;
    const char       *pieces[8];
} side_t;

static side_t qwen = { NULL, NULL, { "<|im_start|>", "<|im_end|>", "<|endoftext|>",
                                     "<|im_start|>assistant\n", "\n\n", " <|im_end|> ", "<|im", "|>" } };
static side_t gpt2 = { NULL, NULL, { "<a>", "<a>b", "x[", "[b]", " <c>", "<d>", "{e}", "  " } };

static void load(side_t *side, const char *path, const char *added)
{
    char          err[256], *json;
    json_error_t  jerr;
    json_t       *tj = json_load_file(path, 0, &jerr);

    if (tj == NULL) {
        fprintf(stderr, "fuzz_tokenize: %s: %s (run from the repository's top)\n", path,
                jerr.text);
        exit(1);
    }
    if (added && json_object_set_new(tj, "added_tokens", json_load_file(added, 0, &jerr))) {
        fprintf(stderr, "fuzz_tokenize: %s: %s\n", added, jerr.text);
        exit(1);
    }
    json = json_dumps(tj, JSON_COMPACT);
    json_decref(tj);
    side->tok = kv_tokenizer_load_buffer(json, strlen(json), err, sizeof(err));
    free(json);
    if (side->tok == NULL || (side->bounds = kv_tok_bounds_new(side->tok)) == NULL) {
        fprintf(stderr, "fuzz_tokenize: %s: %s\n", path, err);
        exit(1);
    }
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void) argc;
    (void) argv;
    load(&qwen, "conf/tokenizers/qwen2.5-instruct/tokenizer.json", NULL);
    load(&gpt2, "conf/tokenizers/gpt2/tokenizer.json",
         "t/data/tokenizer/overlapping_added_tokens.json");
    return 0;
}

/* the text the input stands for (malloc'ed, length in *len) */
static char *expand(const side_t *side, const uint8_t *data, size_t size, size_t *len)
{
    size_t i, n = 0;
    char  *s = malloc(size * 24 + 1);

    for (i = 0; i < size; i++) {
        if (data[i] >= 1 && data[i] <= 8) {
            memcpy(s + n, side->pieces[data[i] - 1], strlen(side->pieces[data[i] - 1]));
            n += strlen(side->pieces[data[i] - 1]);
        } else {
            s[n++] = (char) data[i];
        }
    }
    s[n] = 0;
    *len = n;
    return s;
}

static void same_ids(const kv_ids_t *a, const kv_ids_t *b, const char *what, size_t cut)
{
    if (a->n != b->n || (a->n && memcmp(a->ids, b->ids, a->n * sizeof(uint32_t)) != 0)) {
        fprintf(stderr, "%s differ (cut at %zu): %zu ids against %zu\n", what, cut, a->n, b->n);
        abort();
    }
}

static void check_cuts(const side_t *side, const char *s, size_t n, const kv_ids_t *whole)
{
    size_t  *cuts = NULL;
    long     k = kv_tok_bounds_find(side->bounds, s, n, &cuts), i;
    int      j;
    kv_ids_t parts;

    if (k < 0) {
        abort();
    }
    /* the first, one in the middle and the last: the text split in two at each */
    for (j = 0; j < 3 && k > 0; j++) {
        i = j == 0 ? 0 : (j == 1 ? k / 2 : k - 1);
        if ((j == 1 && i == 0) || (j == 2 && i == k / 2)) {
            continue;
        }
        memset(&parts, 0, sizeof(parts));
        if (cuts[i] > n || kv_tokenizer_encode(side->tok, s, cuts[i], 0, &parts) < 0
            || kv_tokenizer_encode(side->tok, s + cuts[i], n - cuts[i], 0, &parts) < 0)
        {
            abort();
        }
        same_ids(whole, &parts, "ids of the halves and of the whole", cuts[i]);
        kv_ids_free(&parts);
    }
    free(cuts);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const side_t *side;
    kv_ids_t      whole = { 0 };
    size_t        n, i, dlen;
    char         *s, *back;
    int           ascii = 1;

    if (size < 1) {
        return 0;
    }
    side = (data[0] & 1) ? &qwen : &gpt2;
    s = expand(side, data + 1, size - 1, &n);
    if (kv_tokenizer_encode(side->tok, s, n, 0, &whole) < 0) {
        abort();
    }
    if (kv_utf8_valid((const uint8_t *) s, n)) {
        check_cuts(side, s, n, &whole);
    }
    for (i = 0; i < n; i++) {
        ascii &= (unsigned char) s[i] < 0x80 && s[i] != 0;
    }
    if (ascii && side == &qwen) {
        back = kv_tokenizer_decode(side->tok, whole.ids, whole.n, 0, &dlen);
        if (back == NULL || dlen != n || memcmp(back, s, n) != 0) {
            fprintf(stderr, "decode(encode(s)) != s: \"%.*s\"\n", (int) (n < 200 ? n : 200), s);
            abort();
        }
        free(back);
    }
    kv_ids_free(&whole);
    free(s);
    return 0;
}
