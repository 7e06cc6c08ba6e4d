/*
 * libFuzzer target: the turn-delta cache (src/route/kv_turn.c over
 * src/index/kv_tcache.c) keeps its one promise on any conversation: a text's
 * ids through the cache equal the ids of tokenizing it whole.
 *
 * The input is a conversation: segments split by 0xff, each appended to the
 * text so far (a chat's next turn repeats all before it) and the text sent
 * as a request. A segment starting with 0xfe first edits the history (its
 * next byte says where, its one after what), so cached prefixes go stale;
 * 0xfd moves the clock past the TTL; bytes 1-8 stand for ChatML's pieces.
 * The cache is small (evictions in most inputs) and new for each input.
 * Qwen2.5's tokenizer; run from the repository's top (make fuzz does).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_tok_bound.h"
#include "kv_tokenizer.h"
#include "kv_turn.h"

#define CACHE_BYTES (64 << 10)
#define TTL_MS      1000

static kv_tokenizer_t  *tok;
static kv_tok_bounds_t *bounds;
static void            *mem;

static const char *pieces[8] = { "<|im_start|>", "<|im_end|>", "<|endoftext|>",
                                 "<|im_start|>user\n", "<|im_start|>assistant\n", "\n", " ",
                                 "<|im" };

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    char err[256];

    (void) argc;
    (void) argv;
    tok = kv_tokenizer_load("conf/tokenizers/qwen2.5-instruct/tokenizer.json", err, sizeof(err));
    if (tok == NULL || (bounds = kv_tok_bounds_new(tok)) == NULL
        || (mem = aligned_alloc(64, CACHE_BYTES)) == NULL)
    {
        fprintf(stderr, "fuzz_turn: %s (run from the repository's top)\n", err);
        exit(1);
    }
    return 0;
}

/* appends data[0..n) to text, expanding bytes 1-8 */
static size_t append(char *text, size_t len, const uint8_t *data, size_t n)
{
    size_t i, k;

    for (i = 0; i < n; i++) {
        if (data[i] >= 1 && data[i] <= 8) {
            k = strlen(pieces[data[i] - 1]);
            memcpy(text + len, pieces[data[i] - 1], k);
            len += k;
        } else {
            text[len++] = (char) data[i];
        }
    }
    return len;
}

static void request(const kv_turn_t *turn, const char *text, size_t len, uint64_t now)
{
    kv_ids_t       want = { 0 }, got = { 0 };
    kv_turn_info_t info;
    long           a, b;

    a = kv_request_encode(tok, KV_REQUEST_CHAT, text, len, &want);
    b = kv_turn_encode(turn, tok, KV_REQUEST_CHAT, text, len, now, &got, &info);
    if (a != b || want.n != got.n
        || (want.n && memcmp(want.ids, got.ids, want.n * sizeof(uint32_t)) != 0))
    {
        fprintf(stderr, "ids differ: %ld against %ld, %zu bytes reused, text of %zu bytes\n", a,
                b, info.reused_bytes, len);
        abort();
    }
    kv_ids_free(&want);
    kv_ids_free(&got);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char       err[256], *text = malloc(size * 24 + 1);
    size_t     len = 0, i = 0, j, at;
    uint64_t   now = 1000000;
    kv_turn_t  turn = { NULL, bounds };

    turn.cache = kv_tcache_create(mem, CACHE_BYTES, TTL_MS, err, sizeof(err));
    if (turn.cache == NULL) {
        abort();
    }
    while (i < size) {
        for (j = i; j < size && data[j] != 0xff; j++) {
        }
        if (j - i >= 3 && data[i] == 0xfe && len > 0) {
            at = data[i + 1] * len / 256;
            text[at] = (char) data[i + 2];
            i += 3;
        } else if (j > i && data[i] == 0xfd) {
            now += TTL_MS + 1;
            i++;
        }
        len = append(text, len, data + i, j - i);
        request(&turn, text, len, now);
        now += 10;
        i = j + 1;
    }
    free(text);
    return 0;
}
