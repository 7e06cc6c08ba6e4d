/*
 * libFuzzer target: the request body scanner (kv_body), what every client
 * sends. Odd first byte: the rest is a whole body, which gives a result or
 * a clean error, never a crash, leak or over-read (the buffer is exactly
 * the body's size, so ASan sees any read past it); kv_body_model reads the
 * model the whole parse reads.
 *
 * Even first byte: the rest, mapped onto the bytes a token-id list is made
 * of, is the inside of an id array, and kv_body's fast id loops (SWAR and
 * 64-byte blocks) must agree with a plain reading of the same array by the
 * general scanner (kv_jscan): the same verdict, the same error, the same
 * ids; in each place an id array can be (the prompt, a batch's first
 * prompt that routes, a later one that is only checked and counted for
 * load: within what it holds).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_body.h"
#include "kv_jscan.h"

/* what id arrays are made of, and a few bytes that break them */
static const char alphabet[] = "0123456789012345678901234567890123456789,,,,,,,,    "
                               "-.eE+\t\n9999999999x";

/* The ids of "[" list "]" read item by item by kv_jscan; -1 with why. */
static int reference(const char *list, size_t n, uint32_t **ids, size_t *n_ids, char *why,
                     size_t whylen)
{
    size_t     len = n + 2;
    char      *buf = malloc(len);
    kv_jscan_t s;
    kv_jnum_t  num;
    int        first = 1, more, c;

    buf[0] = '[';
    memcpy(buf + 1, list, n);
    buf[n + 1] = ']';
    *ids = malloc((n / 2 + 1) * sizeof(uint32_t));
    *n_ids = 0;
    kv_jscan_init_err(&s, buf, len, why, whylen);
    s.p++;
    while ((more = kv_jscan_item(&s, &first)) == 1) {
        c = kv_jscan_peek(&s);
        if (c < '0' || c > '9' || kv_jscan_number(&s, &num) != 0
            || num.kind != KV_JNUM_UINT || num.u > UINT32_MAX)
        {
            if (!s.err) {
                kv_jscan_fail(&s, "prompt token ids must be integers in [0, 2^32)");
            }
            more = -1;
            break;
        }
        (*ids)[(*n_ids)++] = (uint32_t) num.u;
    }
    free(buf);
    return more;
}

/* kv_body_parse of head list tail, in a buffer of exactly its size */
static int body(const char *head, const char *list, size_t n, const char *tail, kv_body_t *b,
                char *err, size_t errlen)
{
    size_t hl = strlen(head), tl = strlen(tail);
    char  *buf = malloc(hl + n + tl);
    int    rc;

    memcpy(buf, head, hl);
    memcpy(buf + hl, list, n);
    memcpy(buf + hl + n, tail, tl);
    rc = kv_body_parse(b, buf, hl + n + tl, err, errlen);
    free(buf);
    return rc;
}

/*
 * want/why: the reference's verdict and reason ("... at byte N" in "[list]");
 * the list starts at byte at of the body, so kv_body must stop at N - 1 + at.
 */
static void check(int rc, const kv_body_t *b, const char *err, int want, const uint32_t *ids,
                  size_t n_ids, const char *why, size_t at, int kept)
{
    char        expect[300];
    const char *pos = strstr(why, " at byte ");

    if ((rc == 0) != (want == 0)) {
        fprintf(stderr, "verdict differs: kv_body %d (%s), reference %d (%s)\n", rc, err, want,
                why);
        abort();
    }
    if (rc != 0) {
        if (pos == NULL) {
            abort();
        }
        snprintf(expect, sizeof(expect), "%.*s at byte %zu", (int) (pos - why), why,
                 strtoul(pos + 9, NULL, 10) - 1 + at);
        if (strcmp(err, expect) != 0) {
            fprintf(stderr, "errors differ: kv_body \"%s\", expected \"%s\"\n", err, expect);
            abort();
        }
        return;
    }
    if (kept && (b->kind != KV_BODY_IDS || b->n_ids != n_ids
                 || (n_ids && memcmp(b->ids, ids, n_ids * sizeof(uint32_t)) != 0)))
    {
        fprintf(stderr, "ids differ: kv_body %zu, reference %zu\n", b->n_ids, n_ids);
        abort();
    }
}

static void differential(const uint8_t *data, size_t size)
{
    static const char one[] = "{\"prompt\":[", first[] = "{\"model\":\"m\",\"prompt\":[[",
                      later[] = "{\"prompt\":[[1,2],[";
    char     *list = malloc(size + 1), err[256], why[256];
    uint32_t *ids;
    size_t    n_ids, i;
    int       want, rc;
    kv_body_t b;

    for (i = 0; i < size; i++) {
        list[i] = alphabet[data[i] % (sizeof(alphabet) - 1)];
    }
    why[0] = 0;
    want = reference(list, size, &ids, &n_ids, why, sizeof(why));

    for (i = 0; i < size && (list[i] == ' ' || list[i] == '\t' || list[i] == '\n'); i++) {
        /* the first item decides between an id array and a batch */
    }
    rc = body(one, list, size, "]}", &b, err, sizeof(err));
    if (i == size || (list[i] >= '0' && list[i] <= '9')) {
        check(rc, &b, err, want, ids, n_ids, why, strlen(one), 1);
    } else if (rc == 0 || strstr(err, "prompt array elements must be") != err) {
        fprintf(stderr, "not read as a batch: %s\n", err);
        abort();
    }
    kv_body_free(&b);
    rc = body(first, list, size, "],[7,8]],\"max_tokens\":4}", &b, err, sizeof(err));
    check(rc, &b, err, want, ids, n_ids, why, strlen(first), 1);
    if (rc == 0 && (b.prompts != 2 || b.batch_ids > 2 || b.batch_bytes != 0)) {
        abort();                    /* [7,8] after it: at most its 2 ids */
    }
    kv_body_free(&b);
    rc = body(later, list, size, "]]}", &b, err, sizeof(err));
    check(rc, &b, err, want, ids, n_ids, why, strlen(later), 0);
    /* after [1,2]: its ids but those two, at most, are counted for load */
    if (rc == 0 && (b.prompts != 2 || b.batch_ids > n_ids
                    || b.batch_ids + (n_ids < 2 ? n_ids : 2) < n_ids))
    {
        fprintf(stderr, "batch counted %zu of %zu ids\n", b.batch_ids, n_ids);
        abort();
    }
    kv_body_free(&b);
    free(ids);
    free(list);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char      err[256], model[128], *buf;
    kv_body_t b;

    if (size < 1) {
        return 0;
    }
    if (data[0] & 1) {
        buf = malloc(size - 1 ? size - 1 : 1);
        memcpy(buf, data + 1, size - 1);
        /* kv_body_model (choosing an upstream) reads the same model as
         * the whole parse wherever the whole parse succeeds, for every
         * API a path names (bits 1-3 of the first byte) */
        if (kv_body_parse_api(&b, (kv_api_t) ((data[0] >> 1) % (KV_API_TOKENIZE + 1)), buf,
                              size - 1, err, sizeof(err)) == 0
            && (kv_body_model(buf, size - 1, model, sizeof(model), err, sizeof(err)) != 0
                || strcmp(model, b.model) != 0))
        {
            abort();
        }
        kv_body_free(&b);
        kv_body_model(buf, size - 1, model, sizeof(model), err, sizeof(err));
        free(buf);
        return 0;
    }
    differential(data + 1, size - 1);
    return 0;
}
