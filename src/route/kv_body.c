/*
 * One-pass scanner for OpenAI request bodies (see kv_body.h). It validates
 * the whole document as JSON (a malformed body must fall back to load-only
 * routing, not be half-understood) but only materialises the fields the
 * router uses. Nesting is limited so a hostile body cannot exhaust the stack.
 */
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "kv_body.h"
#include "kv_responses.h"
#include "kv_hash.h"
#include "kv_jscan.h"

typedef kv_jscan_t scan_t;

/*
 * A member may come more than once. Python's json.loads keeps the last
 * value, at the first one's place, and the engine reads that: so does the
 * router, for every member. Each value is read as it comes (a repeat
 * replaces what the earlier one gave; nothing is scanned twice), and what
 * combines several members is combined once the body is read.
 */

/* The members a prompt is read from; the first present, at its first
 * place, with a usable last value, routes the body. */
enum { PK_PROMPT, PK_MESSAGES, PK_TEXT, PK_INPUT_IDS, PK_N };

typedef struct {
    int         rank[PK_N];     /* order of first occurrence, 1-based; 0: absent */
    const char *span[PK_N];     /* the last value, NULL when it is no prompt */
    size_t      len[PK_N];
    int         ranks;
    int         held;           /* the member b's prompt came from, or -1 */
    long        max_tokens, max_completion_tokens, max_output_tokens, max_new_tokens;
    long        n, best_of, sampling_n;
    uint64_t    user, metadata_user;
} members_t;

/*
 * A string at s->p (the opening quote). With out != NULL, the unescaped
 * bytes are malloc'ed into *out (NUL-terminated). Unescaped output is never
 * longer than the escaped input, so one allocation of the span suffices.
 */
static int scan_string(scan_t *s, char **out, size_t *out_len)
{
    const char *raw;
    char       *dst;
    size_t      len;
    int         escaped;

    if (kv_jscan_string_raw(s, &raw, &len, &escaped) != 0) {
        return -1;
    }
    if (out == NULL) {
        return 0;
    }
    dst = malloc(len + 1);
    if (dst == NULL) {
        return kv_jscan_fail(s, "out of memory");
    }
    if (escaped) {
        len = kv_json_unescape(raw, len, dst);
    } else {
        memcpy(dst, raw, len);
    }
    dst[len] = '\0';
    *out = dst;
    *out_len = len;
    return 0;
}

static int skip_value(scan_t *s, int depth)
{
    return kv_jscan_skip_at(s, depth);
}

/* A token id: a non-negative integer below 2^32. */
static int scan_id(scan_t *s, uint32_t *id)
{
    kv_jnum_t num;
    int       c = kv_jscan_peek(s);

    if (c < '0' || c > '9' || kv_jscan_number(s, &num) != 0
        || num.kind != KV_JNUM_UINT || num.u > UINT32_MAX)
    {
        return s->err ? -1 : kv_jscan_fail(s, "prompt token ids must be integers in [0, 2^32)");
    }
    *id = (uint32_t) num.u;
    return 0;
}

static int push_id(scan_t *s, kv_body_t *b, size_t *cap, uint32_t id)
{
    uint32_t *grown;

    if (b->n_ids == *cap) {
        *cap = *cap ? *cap * 2 : 1024;
        grown = realloc(b->ids, *cap * sizeof(uint32_t));
        if (grown == NULL) {
            return kv_jscan_fail(s, "out of memory");
        }
        b->ids = grown;
    }
    b->ids[b->n_ids++] = id;
    return 0;
}

/*
 * The ids of an array as clients write them, "1,2,3]" or "1, 2, 3]": one
 * tight loop instead of the general scanner's calls per id (most of a 1k-id
 * decision). It stops, with s->p where the general scanner goes on (just
 * after '[', or at the ',' before an item), at anything else: other
 * spacing, a sign, a fraction, an id of 2^32 or more, an error; the general
 * scanner then takes that one item, so what is accepted and every error
 * message stay the general scanner's. 0: the array ended (']' consumed);
 * 1: stopped; -1: out of memory.
 */
/*
 * The leading decimal digits of the 8 bytes at p, all at once (SWAR): their
 * count, and when it is 1-7 their value in *v. A byte is a digit when its
 * high nibble is 3 both as it is and with 6 added ('0'-'9', not ':'-'?');
 * a carry out of a byte that is no digit only reaches bytes after it. The
 * digits, moved to the top of the word, are combined in pairs, fours and
 * eights by three multiplies. Ids are 1-6 digits: one step per id instead
 * of one per byte. Big-endian machines return 8 (the byte loop's case).
 */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
/* The value of the n (1-7) digits at the head of the 8 bytes in x. */
static uint32_t swar_value(uint64_t x, unsigned n)
{
    x = (x - 0x3030303030303030ULL) << (8 * (8 - n));  /* digits last: leading zeros first */
    x = (x * 10 + (x >> 8)) & 0x00ff00ff00ff00ffULL;
    x = (x * 100 + (x >> 16)) & 0x0000ffff0000ffffULL;
    x = (x * 10000 + (x >> 32)) & 0xffffffffULL;
    return (uint32_t) x;
}
#endif

static unsigned swar_digits(const char *p, uint32_t *v)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    const uint64_t hi = 0xf0f0f0f0f0f0f0f0ULL, three = 0x3030303030303030ULL;
    uint64_t       x, non;
    unsigned       n;

    memcpy(&x, p, 8);
    non = ((x & hi) ^ three) | (((x + 0x0606060606060606ULL) & hi) ^ three);
    n = non ? (unsigned) __builtin_ctzll(non) / 8 : 8;
    if (n == 0 || n == 8) {
        return n;
    }
    *v = swar_value(x, n);
    return n;
#else
    (void) p;
    (void) v;
    return 8;
#endif
}

#if defined(__SSE2__) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define IDS_BLOCK 1

/* One bit per byte of the 64 at p (bit i: byte i): digits, commas, spaces. */
static void classify64(const char *p, uint64_t *dig, uint64_t *com, uint64_t *spc)
{
    const __m128i zero = _mm_set1_epi8('0'), nine = _mm_set1_epi8(9);
    const __m128i comma = _mm_set1_epi8(','), space = _mm_set1_epi8(' ');
    __m128i       v, t;
    int           i;

    *dig = *com = *spc = 0;
    for (i = 0; i < 4; i++) {
        v = _mm_loadu_si128((const __m128i *) (const void *) (p + 16 * i));
        t = _mm_sub_epi8(v, zero);
        *dig |= (uint64_t) (uint16_t) _mm_movemask_epi8(
                    _mm_cmpeq_epi8(_mm_min_epu8(t, nine), t)) << (16 * i);
        *com |= (uint64_t) (uint16_t) _mm_movemask_epi8(_mm_cmpeq_epi8(v, comma)) << (16 * i);
        *spc |= (uint64_t) (uint16_t) _mm_movemask_epi8(_mm_cmpeq_epi8(v, space)) << (16 * i);
    }
}

/*
 * Many ids at once, without the one-after-another dependency of finding
 * where each ends: p is at an id's first digit, with 72 bytes readable.
 * Of the 64 bytes at p, the leading run of digits, commas and spaces is
 * taken when it reads d+(, ?d+)* (each comma after a digit, no two commas
 * together, each space just after a comma): then the k-th digit run ends
 * just before the k-th comma, and each such id of 1-7 digits is stored in
 * order (an id of 8 or more stops it there). Returns how many, 0 when the
 * run is anything else (the caller goes on one id at a time), and sets
 * *last to the comma after the last id taken.
 */
static size_t ids_block(const char *p, uint32_t *ids, const char **last)
{
    uint64_t dig, com, spc, ok, starts, x;
    unsigned a, c;
    size_t   k = 0;

    classify64(p, &dig, &com, &spc);
    ok = dig | com | spc;
    if (~ok) {
        ok = (1ULL << __builtin_ctzll(~ok)) - 1;
        dig &= ok;
        com &= ok;
        spc &= ok;
    }
    if ((com & com << 1) || (spc & ~(com << 1)) || (com & ~(dig << 1))) {
        return 0;
    }
    for (starts = dig & ~(dig << 1); com; com &= com - 1, starts &= starts - 1) {
        a = (unsigned) __builtin_ctzll(starts);
        c = (unsigned) __builtin_ctzll(com);
        if (c - a > 7) {
            break;
        }
        memcpy(&x, p + a, 8);
        ids[k++] = swar_value(x, c - a);
        *last = p + c;
    }
    return k;
}
#endif

static int scan_ids_fast(scan_t *s, kv_body_t *b, int keep, size_t *cap, int *first)
{
    const char *p = s->p, *end = s->end, *q, *at;
    uint64_t    v;
    uint32_t    v32;
    unsigned    n;
#ifdef IDS_BLOCK
    uint32_t    scratch[32];
    size_t      k;
#endif
    size_t      most = (size_t) (end - p) / 2 + 1;
    uint32_t   *grown;

    /* an id takes 2 bytes at least ("7,"): room for all the rest at once
     * (at most 64k more at a time), so the loop stores without growing */
    most = b->n_ids + (most < 65536 ? most : 65536);
    if (keep && *cap < most) {
        most = most > 2 * *cap ? most : 2 * *cap;
        grown = realloc(b->ids, most * sizeof(uint32_t));
        if (grown == NULL) {
            return kv_jscan_fail(s, "out of memory");
        }
        b->ids = grown;
        *cap = most;
    }
    for (;;) {
        at = p;
        if (!*first) {
            if (p >= end || *p != ',') {
                break;
            }
            p++;
            if (p < end && *p == ' ') {
                p++;
            }
        }
#ifdef IDS_BLOCK
        /* at most 32 ids in 64 bytes: room for them all */
        if (end - p >= 72 && (unsigned char) (*p - '0') < 10
            && (!keep || *cap - b->n_ids >= 32))
        {
            k = ids_block(p, keep ? b->ids + b->n_ids : scratch, &q);
            if (k > 0) {
                b->n_ids += keep ? k : 0;
                *first = 0;
                p = q;
                continue;
            }
        }
#endif
        if (end - p >= 8 && (n = swar_digits(p, &v32)) - 1 < 7) {
            q = p + n;
            v = v32;
        } else {
            for (q = p, v = 0; q < end && q - p < 10 && (unsigned char) (*q - '0') < 10; q++) {
                v = v * 10 + (uint64_t) (*q - '0');
            }
        }
        if (q == p || q >= end || (*q != ',' && *q != ']') || v > UINT32_MAX
            || (keep && b->n_ids == *cap))
        {
            break;
        }
        if (keep) {
            b->ids[b->n_ids++] = (uint32_t) v;
        }
        *first = 0;
        if (*q == ']') {
            s->p = q + 1;
            return 0;
        }
        p = q;
    }
    s->p = at;
    return 1;
}

/* An id array at s->p ('['); with keep, the ids go to b. */
static int scan_ids(scan_t *s, kv_body_t *b, int keep)
{
    size_t    cap = 0;
    uint32_t  id = 0;
    int       first = 1, more;

    s->p++;
    for (;;) {
        more = scan_ids_fast(s, b, keep, &cap, &first);
        if (more <= 0) {
            return more;
        }
        /* one item the fast loop left, by the general scanner */
        if ((more = kv_jscan_item(s, &first)) != 1) {
            return more;
        }
        if (scan_id(s, &id) != 0) {
            return -1;
        }
        if (keep && push_id(s, b, &cap, id) != 0) {
            return -1;
        }
    }
}

static int digit(char c)
{
    return c >= '0' && c <= '9';
}

/* Prompts of a batch after the first one: what each adds beyond its common
 * prefix with the first (a batch often repeats one few-shot or system
 * prefix), read on the raw JSON. A string adds its raw bytes; an id array
 * the ids that end past the common part, and the one it ends with when the
 * first's goes on ([1] after [12]). */
static void count_rest(kv_body_t *b, const char *first, size_t first_len, const char *p,
                       size_t len)
{
    size_t i = 0, n = 0;

    while (i < len && i < first_len && p[i] == first[i]) {
        i++;
    }
    if (p[0] == '"') {
        b->batch_bytes += len - i;
        return;
    }
    n = i > 0 && i < len && i < first_len && digit(p[i - 1]) && !digit(p[i])
        && digit(first[i]);
    for (; i < len; i++) {
        n += digit(p[i]) && (i + 1 == len || !digit(p[i + 1]));
    }
    b->batch_ids += n;
}

/* `prompt`: string, [string...], [id...] or [[id...]...]. */
static int scan_prompt(scan_t *s, kv_body_t *b)
{
    const char *save, *at, *first_at = NULL;
    size_t      i, first_len = 0;
    int         c, first = 1, more;

    b->prompts = 1;
    b->batch_bytes = 0;
    b->batch_ids = 0;
    c = kv_jscan_peek(s);
    if (c == '"') {
        b->kind = KV_BODY_TEXT;
        return scan_string(s, &b->text, &b->text_len);
    }
    if (c != '[') {
        return kv_jscan_fail(s, "prompt must be a string or an array");
    }
    save = s->p++;
    c = kv_jscan_peek(s);
    if (c == ']' || (c >= '0' && c <= '9')) {
        s->p = save;
        b->kind = KV_BODY_IDS;
        return scan_ids(s, b, 1);
    }
    /* a batch: the first prompt routes the request; the rest are checked
     * and counted, since the engine prefills and decodes each of them */
    b->prompts = 0;
    for (i = 0; (more = kv_jscan_item(s, &first)) == 1; i++) {
        c = kv_jscan_peek(s);
        at = s->p;
        if (c == '"') {
            if (scan_string(s, i == 0 ? &b->text : NULL, &b->text_len) != 0) {
                return -1;
            }
            if (i == 0) {
                b->kind = KV_BODY_TEXT;
            }
        } else if (c == '[') {
            if (scan_ids(s, b, i == 0) != 0) {
                return -1;
            }
            if (i == 0) {
                b->kind = KV_BODY_IDS;
            }
        } else {
            return s->err ? -1
                          : kv_jscan_fail(s, "prompt array elements must be strings or id arrays");
        }
        if (i == 0) {
            first_at = at;
            first_len = (size_t) (s->p - at);
        } else {
            count_rest(b, first_at, first_len, at, (size_t) (s->p - at));
        }
        b->prompts++;
    }
    if (b->prompts == 0) {
        b->prompts = 1;
    }
    return more;
}

/* An integer field; -1 when it is not one or does not fit a long. */
static int scan_long(scan_t *s, long *out)
{
    kv_jnum_t num;

    if (kv_jscan_number(s, &num) != 0) {
        return -1;
    }
    if (num.kind == KV_JNUM_UINT && num.u <= (uint64_t) LONG_MAX) {
        *out = (long) num.u;
    } else if (num.kind == KV_JNUM_NEG) {
        *out = (long) (int64_t) num.u;
    } else {
        *out = -1;
    }
    return 0;
}

/* A member's raw JSON (the last one wins, as in Python); null: absent. */
static int scan_span(scan_t *s, const char **span, size_t *len)
{
    const char *start = s->p;

    if (skip_value(s, 1) != 0) {
        return -1;
    }
    *span = *start == 'n' ? NULL : start;
    *len = *start == 'n' ? 0 : (size_t) (s->p - start);
    return 0;
}

/* A boolean member; any other type gives the default (the engine refuses it). */
static int scan_flag(scan_t *s, int *flag, int dflt)
{
    *flag = s->p < s->end && (*s->p == 't' || *s->p == 'f') ? *s->p == 't' : dflt;
    return skip_value(s, 1);
}

/*
 * A member's key and its ':', unescaped into key[cap] ("c\u0061che_salt"
 * must be seen: engines unescape keys too). The keys the router reads are
 * short; escaped, each of their characters takes at most 12 bytes (a
 * surrogate pair), so a longer key cannot be one of them: *klen 0.
 */
static int scan_key(scan_t *s, char *key, size_t cap, size_t *klen)
{
    const char *raw;
    int         escaped;

    if (kv_jscan_string_raw(s, &raw, klen, &escaped) != 0 || kv_jscan_expect(s, ':') != 0) {
        return -1;
    }
    if (*klen >= cap) {
        *klen = 0;
    } else if (escaped) {
        *klen = kv_json_unescape(raw, *klen, key);
    } else {
        memcpy(key, raw, *klen);
    }
    return 0;
}

/* A string member's value unescaped into out[cap] (NUL-terminated); -1
 * when it does not fit: a model name is refused, not cut. */
static int scan_name(scan_t *s, char *out, size_t cap)
{
    char   *str;
    size_t  n;

    if (scan_string(s, &str, &n) != 0) {
        return -1;
    }
    if (n >= cap) {
        free(str);
        return kv_jscan_fail(s, "model name longer than %zu bytes", cap - 1);
    }
    memcpy(out, str, n + 1);
    free(str);
    return 0;
}

static long larger(long a, long b)
{
    return a > b ? a : b;
}

/* A count member (`n`, `best_of`): an integer, or 1 (absent, or not one). */
static int scan_count(scan_t *s, long *v, int depth)
{
    *v = 1;
    return digit(kv_jscan_peek(s)) ? scan_long(s, v) : skip_value(s, depth);
}

/* A token limit: an integer, or -1 (absent, or not one that fits). */
static int scan_limit(scan_t *s, long *v, int depth)
{
    int c = kv_jscan_peek(s);

    *v = -1;
    return c == '-' || digit(c) ? scan_long(s, v) : skip_value(s, depth);
}

/* A session hint: the key of a string, 0 for anything else. */
static int scan_hint(scan_t *s, uint64_t *hint, int depth)
{
    char   *str;
    size_t  n;

    *hint = 0;
    if (kv_jscan_peek(s) != '"') {
        return skip_value(s, depth);
    }
    if (scan_string(s, &str, &n) != 0) {
        return -1;
    }
    *hint = kv_body_session_key(str, n);
    free(str);
    return 0;
}

/* One sampling_params object of SGLang's /generate: max_new_tokens and n,
 * the larger of the objects' kept (a batch may give one per prompt). */
static int scan_sampling_one(scan_t *s, members_t *m, int depth)
{
    char   key[16];
    size_t klen;
    long   max_new = -1, n = 1;
    int    first = 1, more;

    s->p++;
    while ((more = kv_jscan_more(s, &first, '}')) == 1) {
        if (scan_key(s, key, sizeof(key), &klen) != 0) {
            return -1;
        }
        if (klen == 14 && memcmp(key, "max_new_tokens", 14) == 0) {
            more = scan_limit(s, &max_new, depth + 1);
        } else if (klen == 1 && key[0] == 'n') {
            more = scan_count(s, &n, depth + 1);
        } else {
            more = skip_value(s, depth + 1);
        }
        if (more != 0) {
            return -1;
        }
    }
    m->max_new_tokens = larger(m->max_new_tokens, max_new);
    m->sampling_n = larger(m->sampling_n, n);
    return more;
}

/* `sampling_params`: an object, or a list of them (one per prompt). */
static int scan_sampling(scan_t *s, members_t *m)
{
    int first = 1, more;

    m->max_new_tokens = -1;
    m->sampling_n = 1;
    if (*s->p == '{') {
        return scan_sampling_one(s, m, 1);
    }
    if (*s->p != '[') {
        return skip_value(s, 1);
    }
    s->p++;
    while ((more = kv_jscan_item(s, &first)) == 1) {
        if (kv_jscan_peek(s) == '{' ? scan_sampling_one(s, m, 2) : skip_value(s, 2)) {
            return -1;
        }
    }
    return more;
}

/* `metadata` (the Anthropic API's): its `user_id` is the user hint, as
 * OpenAI's `user` (Claude Code puts its session there). */
static int scan_metadata(scan_t *s, members_t *m)
{
    char    key[8];
    size_t  klen;
    int     first = 1, more;

    m->metadata_user = 0;
    if (*s->p != '{') {
        return skip_value(s, 1);
    }
    s->p++;
    while ((more = kv_jscan_more(s, &first, '}')) == 1) {
        if (scan_key(s, key, sizeof(key), &klen) != 0) {
            return -1;
        }
        if (klen == 7 && memcmp(key, "user_id", 7) == 0
            ? scan_hint(s, &m->metadata_user, 2) != 0 : skip_value(s, 2) != 0)
        {
            return -1;
        }
    }
    return more;
}

/* Forgets the prompt read so far: a later value replaces it. */
static void drop_prompt(kv_body_t *b)
{
    free(b->text);
    free(b->ids);
    b->text = NULL;
    b->ids = NULL;
    b->text_len = 0;
    b->n_ids = 0;
    b->kind = KV_BODY_NONE;
    b->chat.messages = NULL;
    b->chat.messages_len = 0;
    b->prompts = 1;
    b->batch_bytes = 0;
    b->batch_ids = 0;
}

/* Whether a value starting with c can be member k's prompt. A `prompt` of
 * another type is an error when read (as the engine refuses it); the
 * others are then no prompt (the Responses API's `text` is an object). */
static int prompt_value(int k, int c)
{
    return k == PK_MESSAGES ? c == '[' : k == PK_PROMPT || c == '"' || c == '[';
}

/* Member k's value at s->p into b: 0, or -1. */
static int read_prompt(scan_t *s, kv_body_t *b, int k)
{
    const char *start = s->p;

    if (k != PK_MESSAGES) {
        return scan_prompt(s, b);
    }
    if (skip_value(s, 1) != 0) {
        return -1;
    }
    b->kind = KV_BODY_MESSAGES;
    b->chat.messages = start;
    b->chat.messages_len = (size_t) (s->p - start);
    return 0;
}

/* A prompt member: read when it is the one held, or when none is; else
 * only its span kept, in case the one held is replaced by no prompt. */
static int prompt_member(scan_t *s, kv_body_t *b, members_t *m, int k)
{
    const char *start = s->p;
    int         usable = prompt_value(k, *start);

    if (m->rank[k] == 0) {
        m->rank[k] = ++m->ranks;
    }
    if (m->held == k) {
        drop_prompt(b);
        m->held = -1;
    }
    if (m->held == -1 && usable) {
        if (read_prompt(s, b, k) != 0) {
            return -1;
        }
        m->held = k;
    } else if (skip_value(s, 1) != 0) {
        return -1;
    }
    m->span[k] = usable ? start : NULL;
    m->len[k] = (size_t) (s->p - start);
    return 0;
}

/* Once the body is read: the prompt member first in place whose last
 * value is a prompt. It differs from the one held only when a repeat
 * changed which members have one; that one is read again from its span. */
static int settle_prompt(scan_t *s, kv_body_t *b, members_t *m)
{
    scan_t in;
    int    k, best = -1;

    for (k = 0; k < PK_N; k++) {
        if (m->span[k] && (best < 0 || m->rank[k] < m->rank[best])) {
            best = k;
        }
    }
    if (best < 0 || best == m->held) {
        return 0;
    }
    drop_prompt(b);
    kv_jscan_init_err(&in, m->span[best], m->len[best], s->why, s->whylen);
    in.base = s->base;
    return read_prompt(&in, b, best);
}

/* What several members give together: vLLM's token limit (a chat's
 * max_completion_tokens over its max_tokens), the sequences decoded. */
static void settle_members(kv_body_t *b, const members_t *m)
{
    long seq = larger(larger(m->n, m->best_of), m->sampling_n);

    b->max_tokens = m->max_completion_tokens >= 0 ? m->max_completion_tokens
                    : m->max_tokens >= 0 ? m->max_tokens
                    : m->max_output_tokens >= 0 ? m->max_output_tokens
                    : m->max_new_tokens;
    b->sequences = seq < 1 ? 1 : seq > KV_BODY_SEQUENCES_MAX ? KV_BODY_SEQUENCES_MAX : seq;
    b->user = m->user ? m->user : m->metadata_user;
}

/* A member read as a raw span when its value starts with one of ok (the
 * last one wins; any other value: absent). */
static int scan_span_if(scan_t *s, const char *ok, const char **span, size_t *len)
{
    const char *start = s->p;

    *span = NULL;
    *len = 0;
    if (skip_value(s, 1) != 0) {
        return -1;
    }
    if (strchr(ok, *start) != NULL) {
        *span = start;
        *len = (size_t) (s->p - start);
    }
    return 0;
}

static int scan_field(scan_t *s, kv_body_t *b, members_t *m, const char *key, size_t klen)
{
#define KEY(lit) (klen == sizeof(lit) - 1 && memcmp(key, lit, klen) == 0)

    if (kv_jscan_peek(s) == 0) {
        return skip_value(s, 1);        /* fails as any missing value does */
    }
    if (KEY("prompt") || KEY("messages")) {
        return prompt_member(s, b, m, KEY("prompt") ? PK_PROMPT : PK_MESSAGES);
    }
    if (KEY("tools") || KEY("documents") || KEY("chat_template_kwargs") || KEY("tool_choice")
        || KEY("reasoning_effort"))
    {
        kv_chat_request_t *c = &b->chat;

        return KEY("tools") ? scan_span(s, &c->tools, &c->tools_len)
               : KEY("documents") ? scan_span(s, &c->documents, &c->documents_len)
               : KEY("tool_choice") ? scan_span(s, &c->tool_choice, &c->tool_choice_len)
               : KEY("reasoning_effort")
                 ? scan_span(s, &c->reasoning_effort, &c->reasoning_effort_len)
               : scan_span(s, &c->kwargs, &c->kwargs_len);
    }
    if (KEY("add_generation_prompt") || KEY("continue_final_message")) {
        return KEY("add_generation_prompt") ? scan_flag(s, &b->chat.add_generation_prompt, -1)
                                            : scan_flag(s, &b->chat.continue_final_message, 0);
    }
    if (KEY("add_special_tokens")) {
        return scan_flag(s, &b->add_special_tokens, -1);
    }
    if (KEY("model")) {
        b->model[0] = '\0';
        return *s->p == '"' ? scan_name(s, b->model, sizeof(b->model)) : skip_value(s, 1);
    }
    if (KEY("cache_salt")) {
        free(b->salt);
        b->salt = NULL;
        b->salt_len = 0;
        return *s->p == '"' ? scan_string(s, &b->salt, &b->salt_len) : skip_value(s, 1);
    }
    if (KEY("prompt_cache_key") || KEY("user")) {
        return scan_hint(s, KEY("user") ? &m->user : &b->cache_key, 1);
    }
    if (KEY("previous_response_id")) {
        return scan_hint(s, &b->prev_response, 1);
    }
    if (KEY("stream")) {
        b->stream = *s->p == 't';
        return skip_value(s, 1);
    }
    /* max_output_tokens: the Responses API's */
    if (KEY("max_tokens") || KEY("max_completion_tokens") || KEY("max_output_tokens")) {
        return scan_limit(s, KEY("max_tokens") ? &m->max_tokens
                             : KEY("max_output_tokens") ? &m->max_output_tokens
                                                        : &m->max_completion_tokens, 1);
    }
    if (KEY("n") || KEY("best_of")) {
        return scan_count(s, KEY("n") ? &m->n : &m->best_of, 1);
    }
    /* SGLang's native /generate (RL rollout frameworks send it token ids):
     * the prompt in `text` or `input_ids`, one or a batch, as `prompt`;
     * only a string or a list (the Responses API's `text` is an object) */
    if (KEY("text") || KEY("input_ids")) {
        return prompt_member(s, b, m, KEY("text") ? PK_TEXT : PK_INPUT_IDS);
    }
    if (KEY("sampling_params")) {
        return scan_sampling(s, m);
    }
    if (KEY("metadata")) {
        return scan_metadata(s, m);
    }
    if (KEY("system")) {
        return scan_span_if(s, "\"[", &b->system, &b->system_len);
    }
    /* members only embeddings have: a pooling request on an unknown path */
    if (KEY("encoding_format") || KEY("dimensions")) {
        b->embed_members = 1;
        return skip_value(s, 1);
    }
    /* the Responses API (or an embedding's input): read once the whole
     * body is */
    if (KEY("input")) {
        return scan_span_if(s, "\"[", &b->input, &b->input_len);
    }
    if (KEY("instructions")) {
        return scan_span_if(s, "\"", &b->instructions, &b->instructions_len);
    }
#undef KEY
    return skip_value(s, 1);
}

/* `input` of a pooling request: a prompt, as a completion's (its span
 * was checked with the whole body). */
static int pooling_input(kv_body_t *b, scan_t *s)
{
    scan_t in;

    kv_jscan_init_err(&in, b->input, b->input_len, s->why, s->whylen);
    in.base = s->base;
    return scan_prompt(&in, b);
}

/* An `input` list of prompts (strings or token ids), not of the Responses
 * API's items (objects). */
static int input_is_prompts(const kv_body_t *b)
{
    size_t i;

    if (b->input == NULL || b->input[0] != '[') {
        return 0;
    }
    for (i = 1; i < b->input_len && (b->input[i] == ' ' || b->input[i] == '\t'
                                      || b->input[i] == '\r' || b->input[i] == '\n'); i++)
    {
        /* void */
    }
    return i < b->input_len && b->input[i] != '{' && b->input[i] != ']';
}

/* What the path does not say, the members do: an `input` list of prompts
 * or `encoding_format` / `dimensions` (the official openai client always
 * sends encoding_format) make an embeddings request. */
static kv_api_t body_api(const kv_body_t *b, kv_api_t api)
{
    if (api == KV_API_ANY && (b->embed_members || input_is_prompts(b))) {
        return KV_API_POOLING;
    }
    return api;
}

/* An Anthropic Messages API request as the chat vLLM makes of it. One it
 * cannot convert (past the renderer's memory bound) is routed by load. */
static int anthropic(kv_body_t *b, scan_t *s)
{
    char why[96];

    if (kv_anthropic_chat(b->system, b->system_len, b->chat.messages, b->chat.messages_len,
                          b->chat.tools, b->chat.tools_len, &b->anthropic, why,
                          sizeof(why)) != 0)
    {
        b->kind = KV_BODY_NONE;
        return strcmp(why, "out of memory") == 0 ? kv_jscan_fail(s, "out of memory") : 0;
    }
    b->chat.messages = b->anthropic.messages;
    b->chat.messages_len = b->anthropic.messages_len;
    b->chat.tools = b->anthropic.tools;
    b->chat.tools_len = b->anthropic.tools_len;
    b->chat.tool_choice = NULL;
    b->chat.tool_choice_len = 0;
    return 0;
}

/* A Responses API request as a chat: its messages, without `tools` (the
 * vLLM this follows refuses them there; kv_responses.h). */
static int responses(kv_body_t *b, scan_t *s)
{
    b->responses = kv_responses_messages(b->instructions, b->instructions_len, b->input,
                                         b->input_len, &b->chat.messages_len);
    if (b->responses == NULL) {
        return kv_jscan_fail(s, "out of memory");
    }
    b->kind = KV_BODY_MESSAGES;
    b->chat.messages = b->responses;
    b->chat.tools = NULL;
    b->chat.tools_len = 0;
    return 0;
}

int kv_body_parse(kv_body_t *b, const char *buf, size_t len, char *err, size_t errlen)
{
    return kv_body_parse_api(b, KV_API_ANY, buf, len, err, errlen);
}

int kv_body_parse_api(kv_body_t *b, kv_api_t api, const char *buf, size_t len, char *err,
                      size_t errlen)
{
    scan_t      s;
    members_t   m = { .held = -1, .max_tokens = -1, .max_completion_tokens = -1,
                      .max_output_tokens = -1, .max_new_tokens = -1, .n = 1, .best_of = 1,
                      .sampling_n = 1 };
    char        key[256];
    const char *val;
    size_t      klen;
    int         first = 1, more;

    memset(b, 0, sizeof(*b));
    b->max_tokens = -1;
    b->sequences = 1;
    b->prompts = 1;
    b->chat.add_generation_prompt = -1;
    b->add_special_tokens = -1;
    kv_jscan_init_err(&s, buf, len, err, errlen);

    if (kv_jscan_peek(&s) != '{') {
        kv_jscan_fail(&s, "body is not a JSON object");
        goto bad;
    }
    s.p++;
    b->obj_open = (size_t) (s.p - buf);
    while ((more = kv_jscan_more(&s, &first, '}')) == 1) {
        if (scan_key(&s, key, sizeof(key), &klen) != 0) {
            goto bad;
        }
        kv_jscan_peek(&s);
        val = s.p;
        if (scan_field(&s, b, &m, key, klen) != 0) {
            goto bad;
        }
        if (klen == sizeof("cache_salt") - 1 && memcmp(key, "cache_salt", klen) == 0) {
            if (b->n_salts == KV_BODY_SALTS_MAX) {
                kv_jscan_fail(&s, "more than %d cache_salt members", KV_BODY_SALTS_MAX);
                goto bad;
            }
            b->salt_off[b->n_salts] = (size_t) (val - buf);
            b->salt_len_raw[b->n_salts++] = (size_t) (s.p - val);
        }
    }
    if (more < 0) {
        goto bad;
    }
    kv_jscan_peek(&s);
    if (s.p != s.end) {
        kv_jscan_fail(&s, "trailing data after the JSON object");
        goto bad;
    }
    if (settle_prompt(&s, b, &m) != 0) {
        goto bad;
    }
    settle_members(b, &m);
    api = body_api(b, api);
    b->prefill_only = api >= KV_API_POOLING;
    if (b->chat.add_generation_prompt < 0) {
        b->chat.add_generation_prompt = api != KV_API_POOLING;
    }
    if (b->kind == KV_BODY_NONE && b->input && api == KV_API_POOLING
        && pooling_input(b, &s) != 0)
    {
        goto bad;
    }
    if (b->kind == KV_BODY_MESSAGES
        && (api == KV_API_ANTHROPIC || (api == KV_API_ANY && b->system))
        && anthropic(b, &s) != 0)
    {
        goto bad;
    }
    if (b->kind == KV_BODY_NONE && b->input && (api == KV_API_ANY || api == KV_API_GENERATE)
        && responses(b, &s) != 0)
    {
        goto bad;
    }
    return 0;

bad:
    kv_body_free(b);
    b->max_tokens = -1;
    b->sequences = 1;
    b->prompts = 1;
    return -1;
}

/*
 * Only `model`, to choose among upstreams before the prompt is read with
 * one of them: every other value is skipped (and validated); the last
 * `model` wins, as in kv_body_parse and Python's json (not a string: none).
 */
int kv_body_model(const char *buf, size_t len, char *model, size_t cap, char *err, size_t errlen)
{
    scan_t      s;
    char        key[64];
    size_t      klen;
    int         first = 1, more;

    model[0] = '\0';
    kv_jscan_init_err(&s, buf, len, err, errlen);
    if (kv_jscan_peek(&s) != '{') {
        return kv_jscan_fail(&s, "body is not a JSON object");
    }
    s.p++;
    while ((more = kv_jscan_more(&s, &first, '}')) == 1) {
        if (scan_key(&s, key, sizeof(key), &klen) != 0) {
            return -1;
        }
        if (klen == 5 && memcmp(key, "model", 5) == 0) {
            model[0] = '\0';       /* a later model that is no string: none */
        }
        if (klen == 5 && memcmp(key, "model", 5) == 0 && kv_jscan_peek(&s) == '"') {
            if (scan_name(&s, model, cap) != 0) {
                return -1;
            }
        } else if (skip_value(&s, 1) != 0) {
            return -1;
        }
    }
    if (more < 0) {
        return -1;
    }
    kv_jscan_peek(&s);
    return s.p == s.end ? 0 : kv_jscan_fail(&s, "trailing data after the JSON object");
}

void kv_body_free(kv_body_t *b)
{
    free(b->text);
    free(b->ids);
    free(b->salt);
    free(b->responses);
    kv_anthropic_free(&b->anthropic);
    b->text = NULL;
    b->ids = NULL;
    b->salt = NULL;
    b->responses = NULL;
    b->n_ids = 0;
    b->text_len = 0;
    b->kind = KV_BODY_NONE;
}

uint64_t kv_body_session_key(const char *s, size_t len)
{
    uint64_t h;

    if (s == NULL || len == 0) {
        return 0;
    }
    h = kv_hash_seed(s, len);
    return h ? h : 1;
}
