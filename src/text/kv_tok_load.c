/*
 * Loading tokenizer.json: vocab and merges into hash tables, added tokens,
 * and the pipeline (normalizer, pre-tokenizer, model options,
 * post-processor, decoder) checked against what kv_tokenizer implements.
 * Anything else is refused here, naming the feature, so that no text is
 * ever tokenized differently from HF tokenizers without notice.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>
#include <xxhash.h>

#include "kv_tok_int.h"
#include "kv_unicode.h"

static const char QWEN2_RE[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char LLAMA3_RE[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

typedef struct {
    char   *err;
    size_t  errlen;
} load_t;

static int refuse(load_t *l, const char *fmt, ...)
{
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(l->err, l->errlen, fmt, ap);
    va_end(ap);
    return -1;
}

static const char *str_of(json_t *o, const char *key)
{
    json_t *v = json_object_get(o, key);

    return json_is_string(v) ? json_string_value(v) : NULL;
}

/* o has this "type" (a missing or non-string type is none) */
static int type_is(json_t *o, const char *type)
{
    const char *v = str_of(o, "type");

    return v != NULL && strcmp(v, type) == 0;
}

static int bool_of(json_t *o, const char *key, int dflt)
{
    json_t *v = json_object_get(o, key);

    return json_is_boolean(v) ? json_is_true(v) : dflt;
}

/* --- string -> id map --------------------------------------------------- */

static uint64_t hash_str(const char *s, size_t len)
{
    return XXH3_64bits(s, len);
}

static int64_t map_lookup(const kv_tok_map_t *m, const char *arena, const char *s, size_t len)
{
    uint64_t       h = hash_str(s, len);
    uint32_t       i = (uint32_t) h & m->mask;
    kv_tok_slot_t *e;

    if (m->slots == NULL) {
        return -1;
    }
    for (;; i = (i + 1) & m->mask) {
        e = &m->slots[i];
        if (e->id == UINT32_MAX) {
            return -1;
        }
        if (e->hash == h && e->len == len && memcmp(arena + e->off, s, len) == 0) {
            return e->id;
        }
    }
}

int64_t kv_tok_map_get(const kv_tokenizer_t *t, const char *s, size_t len)
{
    return map_lookup(&t->vocab, t->arena, s, len);
}

void kv_tok_word_prefetch(const kv_tokenizer_t *t, const char *s, size_t len)
{
    if (t->words.slots) {
        __builtin_prefetch(&t->words.slots[(uint32_t) hash_str(s, len) & t->words.mask]);
    }
}

int64_t kv_tok_word_get(const kv_tokenizer_t *t, const char *s, size_t len)
{
    return map_lookup(&t->words, t->words_arena, s, len);
}

static void map_put(kv_tokenizer_t *t, uint32_t off, uint32_t len, uint32_t id)
{
    uint64_t       h = hash_str(t->arena + off, len);
    uint32_t       i = (uint32_t) h & t->vocab.mask;
    kv_tok_slot_t *e;

    for (;; i = (i + 1) & t->vocab.mask) {
        e = &t->vocab.slots[i];
        if (e->id == UINT32_MAX) {
            e->hash = h;
            e->off = off;
            e->len = len;
            e->id = id;
            return;
        }
        if (e->hash == h && e->len == len && memcmp(t->arena + e->off, t->arena + off, len) == 0) {
            return;             /* first id wins */
        }
    }
}

/* --- vocab, added tokens ------------------------------------------------- */

/* added_sorted's order: bytes, a prefix first; equal contents in file
 * (array) order, which is the one the longest-match search keeps */
static int added_cmp(const void *x, const void *y)
{
    const kv_added_t *a = *(const kv_added_t *const *) x, *b = *(const kv_added_t *const *) y;
    int               c = memcmp(a->content, b->content, a->len < b->len ? a->len : b->len);

    if (c != 0) {
        return c;
    }
    if (a->len != b->len) {
        return a->len < b->len ? -1 : 1;
    }
    return a < b ? -1 : a > b;
}

static int sort_added(kv_tokenizer_t *t)
{
    uint32_t i, b;

    t->added_sorted = malloc((t->n_added + 1) * sizeof(*t->added_sorted));
    if (t->added_sorted == NULL) {
        return -1;
    }
    for (i = 0; i < t->n_added; i++) {
        t->added_sorted[i] = &t->added[i];
    }
    qsort(t->added_sorted, t->n_added, sizeof(*t->added_sorted), added_cmp);
    for (i = 0, b = 0; b < 257; b++) {
        while (i < t->n_added && (uint8_t) t->added_sorted[i]->content[0] < b) {
            i++;
        }
        t->added_start[b] = i;
    }
    t->memory += (t->n_added + 1) * sizeof(*t->added_sorted);
    return 0;
}

/* Ids the loader takes at all (vocab and added tokens): an id sizes the
 * id-indexed tables, so an untrusted file must not pick it freely. The
 * merge table's packing lowers this further (kv_tok_int.h). */
#define MAX_ID  (1 << 24)

static int id_ok(json_t *v)
{
    return json_is_integer(v) && json_integer_value(v) >= 0 && json_integer_value(v) < MAX_ID;
}

static int load_vocab(kv_tokenizer_t *t, json_t *vocab, json_t *added, load_t *l)
{
    const char *k;
    json_t     *v;
    size_t      arena = 0, i, cap;
    uint32_t    max_id = 0, id;

    if (!json_is_object(vocab)) {
        return refuse(l, "model.vocab is not an object");
    }
    json_object_foreach(vocab, k, v) {
        if (!id_ok(v)) {
            return refuse(l, "model.vocab: bad id for \"%s\"", k);
        }
        arena += strlen(k);
        if ((uint32_t) json_integer_value(v) > max_id) max_id = (uint32_t) json_integer_value(v);
    }
    for (i = 0; i < json_array_size(added); i++) {
        json_t *a = json_array_get(added, i);
        const char *c = str_of(a, "content");

        if (c == NULL || !json_is_integer(json_object_get(a, "id"))) {
            return refuse(l, "added_tokens[%zu] without content or id", i);
        }
        if (!id_ok(json_object_get(a, "id"))) {
            /* -1 would wrap vocab_size to 0, 2^32 + 5 overwrite token 5 */
            return refuse(l, "added_tokens[%zu]: id %" JSON_INTEGER_FORMAT " is out of range",
                          i, json_integer_value(json_object_get(a, "id")));
        }
        arena += strlen(c);
        if ((uint32_t) json_integer_value(json_object_get(a, "id")) > max_id) {
            max_id = (uint32_t) json_integer_value(json_object_get(a, "id"));
        }
    }
    if (max_id >= (1u << KV_TOK_ID_BITS) - 2) {
        /* before the id-indexed tables are allocated: load_merges would
         * refuse it anyway */
        return refuse(l, "a vocab of %u ids: at most %u ids are supported", max_id + 1,
                      (1u << KV_TOK_ID_BITS) - 2);
    }
    t->vocab_size = max_id + 1;
    t->arena = malloc(arena + 1);
    t->tok_off = calloc(t->vocab_size, sizeof(uint32_t));
    t->tok_len = calloc(t->vocab_size, sizeof(uint32_t));
    t->is_special = calloc(t->vocab_size, 1);
    for (cap = 1024; cap < 2 * (json_object_size(vocab) + json_array_size(added)); cap *= 2) {
        /* void */
    }
    t->vocab.slots = malloc(cap * sizeof(kv_tok_slot_t));
    t->vocab.mask = (uint32_t) cap - 1;
    if (!t->arena || !t->tok_off || !t->tok_len || !t->is_special || !t->vocab.slots) {
        return refuse(l, "out of memory");
    }
    for (i = 0; i < cap; i++) {
        t->vocab.slots[i].id = UINT32_MAX;
    }
    t->memory += arena + t->vocab_size * 9 + cap * sizeof(kv_tok_slot_t);
    json_object_foreach(vocab, k, v) {
        size_t len = strlen(k);

        id = (uint32_t) json_integer_value(v);
        t->tok_off[id] = (uint32_t) t->arena_len;
        t->tok_len[id] = (uint32_t) len;
        memcpy(t->arena + t->arena_len, k, len);
        t->arena_len += len;
    }
    json_object_foreach(vocab, k, v) {
        id = (uint32_t) json_integer_value(v);
        map_put(t, t->tok_off[id], t->tok_len[id], id);
    }
    t->n_added = (uint32_t) json_array_size(added);
    t->added = calloc(t->n_added + 1, sizeof(kv_added_t));
    if (t->added == NULL) {
        return refuse(l, "out of memory");
    }
    for (i = 0; i < t->n_added; i++) {
        json_t     *a = json_array_get(added, i);
        const char *c = str_of(a, "content");
        size_t      len = strlen(c);
        kv_added_t *ad = &t->added[i];

        if (len == 0) {
            return refuse(l, "added_tokens[%zu] is empty", i);
        }
        if (bool_of(a, "single_word", 0)) {
            return refuse(l, "added token \"%s\": single_word is not supported", c);
        }
        if (!kv_utf8_valid((const uint8_t *) c, len)) {
            return refuse(l, "added token %zu is not valid UTF-8", i);
        }
        id = (uint32_t) json_integer_value(json_object_get(a, "id"));
        ad->id = id;
        ad->len = (uint32_t) len;
        ad->special = bool_of(a, "special", 0);
        ad->lstrip = bool_of(a, "lstrip", 0);
        ad->rstrip = bool_of(a, "rstrip", 0);
        ad->normalized = bool_of(a, "normalized", !ad->special);
        t->tok_off[id] = (uint32_t) t->arena_len;
        t->tok_len[id] = (uint32_t) len;
        memcpy(t->arena + t->arena_len, c, len);
        ad->content = t->arena + t->arena_len;
        t->arena_len += len;
        t->is_special[id] = (uint8_t) ad->special;
        t->added_first[(uint8_t) c[0]] = 1;
        map_put(t, t->tok_off[id], (uint32_t) len, id);
    }
    if (sort_added(t) != 0) {
        return refuse(l, "out of memory");
    }
    return 0;
}

/* --- merges -------------------------------------------------------------- */

static int add_merge(kv_tokenizer_t *t, const char *a, size_t al, const char *b, size_t bl,
                     uint32_t rank, load_t *l)
{
    char     buf[1024];
    int64_t  ia = kv_tok_map_get(t, a, al), ib = kv_tok_map_get(t, b, bl), im;
    uint64_t key;
    uint32_t i;

    if (al + bl > sizeof(buf)) {
        return refuse(l, "merge %u is too long", rank);
    }
    memcpy(buf, a, al);
    memcpy(buf + al, b, bl);
    im = kv_tok_map_get(t, buf, al + bl);
    if (ia < 0 || ib < 0 || im < 0) {
        return refuse(l, "merge %u (\"%.*s\" \"%.*s\") names a token not in the vocab",
                      rank, (int) al, a, (int) bl, b);
    }
    key = kv_tok_merge_key((uint32_t) ia, (uint32_t) ib);
    for (i = kv_tok_merge_home(key, t->merges_mask);; i = (i + 1) & t->merges_mask) {
        if ((t->merges[i] & ~KV_TOK_RANK_MASK) == key) {
            /* a pair listed twice takes its last rank: HF collects the
             * merges into a map, where a later entry replaces an earlier */
            t->merges[i] = key | rank;
            t->merge_id[rank] = (uint32_t) im;
            return 0;
        }
        if (t->merges[i] == UINT64_MAX) {
            t->merges[i] = key | rank;
            t->merge_id[rank] = (uint32_t) im;
            return 0;
        }
    }
}

/* merge_base (kv_tok_int.h): in vocabularies built with their merges
 * (GPT-2, Qwen2.5) merge r makes id r + 256; checked for every merge in
 * the table, else -1 and merge_id is read. */
static void dense_merge_ids(kv_tokenizer_t *t)
{
    uint64_t i, base = 0;
    int      first = 1;

    t->merge_base = -1;
    for (i = 0; i <= t->merges_mask; i++) {
        uint32_t r;

        if (t->merges[i] == UINT64_MAX) {
            continue;
        }
        r = (uint32_t) (t->merges[i] & KV_TOK_RANK_MASK);
        if (first) {
            if (t->merge_id[r] < r) {
                return;
            }
            base = t->merge_id[r] - r;
            first = 0;
        } else if ((uint64_t) t->merge_id[r] != r + base) {
            return;
        }
    }
    t->merge_base = first ? -1 : (int64_t) base;
}

static int load_merges(kv_tokenizer_t *t, json_t *merges, load_t *l)
{
    size_t n = json_array_size(merges), cap, i;

    if (n >= (1u << KV_TOK_RANK_BITS) || t->vocab_size >= (1u << KV_TOK_ID_BITS) - 1) {
        return refuse(l, "%zu merges over a vocab of %u ids: at most %u merges and %u ids "
                      "are supported", n, t->vocab_size, (1u << KV_TOK_RANK_BITS) - 1,
                      (1u << KV_TOK_ID_BITS) - 2);
    }
    /* load at most 0.8 (0.58 for Qwen2.5): probes stay within a line or two */
    for (cap = 1024; cap * 4 < 5 * n; cap *= 2) {
        /* void */
    }
    t->merges = malloc(cap * sizeof(kv_tok_merge_t));
    t->merge_id = malloc((n ? n : 1) * sizeof(uint32_t));
    if (t->merges == NULL || t->merge_id == NULL) {
        return refuse(l, "out of memory");
    }
    t->memory += cap * sizeof(kv_tok_merge_t) + n * sizeof(uint32_t);
    t->merges_mask = (uint32_t) cap - 1;
    t->n_merges = (uint32_t) n;
    for (i = 0; i < cap; i++) {
        t->merges[i] = UINT64_MAX;
    }
    for (i = 0; i < n; i++) {
        json_t *m = json_array_get(merges, i);

        if (json_is_string(m)) {
            /* "a b": exactly one space, as HF requires */
            const char *s = json_string_value(m), *sp = strchr(s, ' ');

            if (sp == NULL || strchr(sp + 1, ' ') != NULL) {
                return refuse(l, "merges[%zu] \"%s\" is not two tokens separated by one space "
                              "(HF tokenizers rejects this file too)", i, s);
            }
            if (add_merge(t, s, (size_t) (sp - s), sp + 1, strlen(sp + 1), (uint32_t) i, l) != 0) {
                return -1;
            }
        } else if (json_is_array(m) && json_array_size(m) == 2
                   && json_is_string(json_array_get(m, 0))
                   && json_is_string(json_array_get(m, 1)))
        {
            const char *a = json_string_value(json_array_get(m, 0));
            const char *b = json_string_value(json_array_get(m, 1));

            if (add_merge(t, a, strlen(a), b, strlen(b), (uint32_t) i, l) != 0) {
                return -1;
            }
        } else {
            return refuse(l, "merges[%zu] is neither \"a b\" nor [a, b]", i);
        }
    }
    dense_merge_ids(t);
    return 0;
}

/* --- pipeline ------------------------------------------------------------ */

static int is_sp_normalizer(json_t *n)
{
    json_t *list = json_object_get(n, "normalizers"), *a, *b, *pat;
    const char *sp = "\xe2\x96\x81";

    if (!json_is_array(list) || json_array_size(list) != 2) {
        return 0;
    }
    a = json_array_get(list, 0);
    b = json_array_get(list, 1);
    pat = json_object_get(b, "pattern");
    return str_of(a, "type") && strcmp(str_of(a, "type"), "Prepend") == 0
           && str_of(a, "prepend") && strcmp(str_of(a, "prepend"), sp) == 0
           && str_of(b, "type") && strcmp(str_of(b, "type"), "Replace") == 0
           && str_of(pat, "String") && strcmp(str_of(pat, "String"), " ") == 0
           && str_of(b, "content") && strcmp(str_of(b, "content"), sp) == 0;
}

static int load_normalizer(kv_tokenizer_t *t, json_t *n, load_t *l)
{
    const char *type;

    if (n == NULL || json_is_null(n)) {
        t->norm = NORM_NONE;
        return 0;
    }
    type = str_of(n, "type");
    if (type && strcmp(type, "NFC") == 0) {
        t->norm = NORM_NFC;
        return 0;
    }
    if (type && strcmp(type, "Sequence") == 0 && is_sp_normalizer(n)) {
        t->norm = NORM_SENTENCEPIECE;
        return 0;
    }
    return refuse(l, "normalizer %s is not supported", type ? type : "(untyped)");
}

static int bytelevel_ok(json_t *p, int need_regex, load_t *l)
{
    json_t *ur = json_object_get(p, "use_regex");
    int     use_regex = ur ? json_is_true(ur) : 1;

    if (bool_of(p, "add_prefix_space", 0)) {
        return refuse(l, "pre_tokenizer ByteLevel with add_prefix_space is not supported");
    }
    if (use_regex != need_regex) {
        return refuse(l, "pre_tokenizer ByteLevel use_regex=%s is not supported here",
                      use_regex ? "true" : "false");
    }
    return 0;
}

static int load_pre(kv_tokenizer_t *t, json_t *p, load_t *l)
{
    const char *type, *re, *beh;
    json_t     *list, *split, *bl;

    if (p == NULL || json_is_null(p)) {
        t->pre = PRE_NONE;
        return 0;
    }
    type = str_of(p, "type");
    if (type && strcmp(type, "ByteLevel") == 0) {
        t->pre = PRE_GPT2;
        t->byte_level = 1;
        return bytelevel_ok(p, 1, l);
    }
    if (!type || strcmp(type, "Sequence") != 0) {
        return refuse(l, "pre_tokenizer %s is not supported", type ? type : "(untyped)");
    }
    list = json_object_get(p, "pretokenizers");
    split = json_array_get(list, 0);
    bl = json_array_get(list, 1);
    if (json_array_size(list) != 2 || !type_is(split, "Split") || !type_is(bl, "ByteLevel"))
    {
        return refuse(l, "pre_tokenizer Sequence other than [Split, ByteLevel] is not supported");
    }
    re = str_of(json_object_get(split, "pattern"), "Regex");
    beh = str_of(split, "behavior");
    if (re == NULL || beh == NULL || strcmp(beh, "Isolated") != 0 || bool_of(split, "invert", 0)) {
        return refuse(l, "pre_tokenizer Split: only an Isolated, non-inverted Regex is supported");
    }
    if (strcmp(re, QWEN2_RE) == 0) {
        t->pre = PRE_QWEN2;
    } else if (strcmp(re, LLAMA3_RE) == 0) {
        t->pre = PRE_LLAMA3;
    } else {
        return refuse(l, "pre_tokenizer Split regex is not one kvroute has a scanner for: %.80s", re);
    }
    t->byte_level = 1;
    return bytelevel_ok(bl, 0, l);
}

static int load_model(kv_tokenizer_t *t, json_t *m, load_t *l)
{
    const char *type = str_of(m, "type"), *csp, *eows, *unk;

    if (type && strcmp(type, "BPE") != 0) {
        return refuse(l, "model type %s is not supported (BPE only)", type);
    }
    if (!json_is_array(json_object_get(m, "merges"))) {
        return refuse(l, "model has no merges: only BPE is supported");
    }
    if (json_object_get(m, "dropout") && !json_is_null(json_object_get(m, "dropout"))) {
        return refuse(l, "BPE dropout is not supported");
    }
    csp = str_of(m, "continuing_subword_prefix");
    eows = str_of(m, "end_of_word_suffix");
    if ((csp && *csp) || (eows && *eows)) {
        return refuse(l, "BPE continuing_subword_prefix / end_of_word_suffix are not supported");
    }
    t->byte_fallback = bool_of(m, "byte_fallback", 0);
    t->ignore_merges = bool_of(m, "ignore_merges", 0);
    t->fuse_unk = bool_of(m, "fuse_unk", 0);
    unk = str_of(m, "unk_token");
    t->unk_id = unk ? kv_tok_map_get(t, unk, strlen(unk)) : -1;
    return 0;
}

static int load_post(kv_tokenizer_t *t, json_t *p, load_t *l)
{
    const char *type;
    json_t     *single, *item, *st;
    size_t      i;
    int         seen_a = 0;

    if (p == NULL || json_is_null(p)) {
        return 0;
    }
    type = str_of(p, "type");
    if (type && strcmp(type, "ByteLevel") == 0) {
        return 0;       /* offsets only */
    }
    if (!type || strcmp(type, "TemplateProcessing") != 0) {
        return refuse(l, "post_processor %s is not supported", type ? type : "(untyped)");
    }
    single = json_object_get(p, "single");
    t->prefix_ids = calloc(json_array_size(single) + 1, sizeof(uint32_t));
    t->suffix_ids = calloc(json_array_size(single) + 1, sizeof(uint32_t));
    if (!t->prefix_ids || !t->suffix_ids) {
        return refuse(l, "out of memory");
    }
    for (i = 0; i < json_array_size(single); i++) {
        item = json_array_get(single, i);
        if (json_object_get(item, "Sequence")) {
            seen_a = 1;
            continue;
        }
        st = json_object_get(item, "SpecialToken");
        if (st == NULL || str_of(st, "id") == NULL) {
            return refuse(l, "post_processor TemplateProcessing item %zu is not supported", i);
        }
        {
            json_t *ids = json_object_get(json_object_get(json_object_get(p, "special_tokens"),
                                                          str_of(st, "id")), "ids");
            json_t *id0 = json_array_get(ids, 0);
            int64_t id = id0 && json_is_integer(id0) ? json_integer_value(id0)
                                                     : kv_tok_map_get(t, str_of(st, "id"),
                                                                      strlen(str_of(st, "id")));

            /* an id past the vocab would index the id tables when decoded */
            if (id < 0 || id >= (int64_t) t->vocab_size || json_array_size(ids) > 1) {
                return refuse(l, "post_processor special token %s is not in the vocab",
                              str_of(st, "id"));
            }
            if (seen_a) {
                t->suffix_ids[t->n_suffix++] = (uint32_t) id;
            } else {
                t->prefix_ids[t->n_prefix++] = (uint32_t) id;
            }
        }
    }
    return 0;
}

/*
 * The SentencePiece decoder kvroute implements: Replace "\u2581" by " ",
 * ByteFallback, Fuse, Strip of leading " " (decode_sp). Any other
 * parameters would decode differently from HF, so they are refused.
 */
static int sp_decoder(kv_tokenizer_t *t, json_t *list, load_t *l)
{
    json_t     *rep = json_array_get(list, 0), *strip = json_array_get(list, 3), *start;
    const char *pat = str_of(json_object_get(rep, "pattern"), "String");
    const char *content = str_of(rep, "content"), *sc = str_of(strip, "content");

    if (pat == NULL || strcmp(pat, "\xe2\x96\x81") != 0 || content == NULL
        || strcmp(content, " ") != 0)
    {
        return refuse(l, "decoder Replace other than \"\u2581\" -> \" \" is not supported");
    }
    start = json_object_get(strip, "start");
    if (sc == NULL || strcmp(sc, " ") != 0 || !json_is_integer(start)
        || json_integer_value(start) < 0 || json_integer_value(start) > 1024
        || json_integer_value(json_object_get(strip, "stop")) != 0)
    {
        return refuse(l, "decoder Strip other than of \" \" at the start (0..1024) "
                      "is not supported");
    }
    t->dec = DEC_SENTENCEPIECE;
    t->dec_strip_left = (int) json_integer_value(start);
    return 0;
}

static int load_decoder(kv_tokenizer_t *t, json_t *d, load_t *l)
{
    const char *type;
    json_t     *list;

    if (d == NULL || json_is_null(d)) {
        t->dec = DEC_NONE;
        return 0;
    }
    type = str_of(d, "type");
    if (type && strcmp(type, "ByteLevel") == 0) {
        t->dec = DEC_BYTELEVEL;
        return 0;
    }
    list = json_object_get(d, "decoders");
    if (type && strcmp(type, "Sequence") == 0 && json_array_size(list) == 4
        && type_is(json_array_get(list, 0), "Replace")
        && type_is(json_array_get(list, 1), "ByteFallback")
        && type_is(json_array_get(list, 2), "Fuse")
        && type_is(json_array_get(list, 3), "Strip"))
    {
        return sp_decoder(t, list, l);
    }
    return refuse(l, "decoder %s is not supported", type ? type : "(untyped)");
}

/* GPT-2's byte <-> printable code point table. */
static void byte_table(kv_tokenizer_t *t)
{
    uint32_t b, n = 0;
    char     buf[8];

    memset(t->char_byte, -1, sizeof(t->char_byte));
    for (b = 0; b < 256; b++) {
        int printable = (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || b >= 0xae;

        t->byte_char[b] = printable ? b : 256 + n++;
        t->char_byte[t->byte_char[b]] = (int16_t) b;
    }
    for (b = 0; b < 256; b++) {
        size_t  k = kv_utf8_put(buf, t->byte_char[b]);
        int64_t id = kv_tok_map_get(t, buf, k);

        t->byte_id[b] = id < 0 ? UINT32_MAX : (uint32_t) id;
    }
}

/* The words map (see kv_tok_int.h): every token's raw bytes, kept when
 * merging those bytes gives back the token itself. */
static int words_table(kv_tokenizer_t *t)
{
    size_t    cap, i, k, total = 0;
    uint32_t  id, *syms = NULL, nsyms = 0;
    kv_ids_t  out = { 0 };
    int       rc = -1;

    for (cap = 1024; cap < 2 * (size_t) t->vocab_size; cap *= 2) {
        /* void */
    }
    t->words.slots = malloc(cap * sizeof(kv_tok_slot_t));
    t->words_arena = malloc(t->arena_len + 1);
    syms = malloc(1024 * sizeof(uint32_t));
    if (!t->words.slots || !t->words_arena || !syms) {
        goto done;
    }
    t->words.mask = (uint32_t) cap - 1;
    for (i = 0; i < cap; i++) {
        t->words.slots[i].id = UINT32_MAX;
    }
    for (id = 0; id < t->vocab_size; id++) {
        const char *s = t->arena + t->tok_off[id];
        size_t      n = t->tok_len[id], len;
        uint32_t    cp;
        char       *raw = t->words_arena + total;

        if (n == 0 || n > 1024 || t->is_special[id]) {
            continue;
        }
        for (i = 0, k = 0; i < n; i += len) {
            len = kv_utf8_next((const uint8_t *) s + i, n - i, &cp);
            if (cp >= 512 || t->char_byte[cp] < 0) {
                break;
            }
            raw[k++] = (char) t->char_byte[cp];
        }
        if (i < n) {
            continue;           /* not a byte-level token (an added one) */
        }
        if (!t->ignore_merges) {
            for (i = 0; i < k; i++) {
                syms[i] = t->byte_id[(uint8_t) raw[i]];
            }
            nsyms = (uint32_t) k;
            out.n = 0;
            if (kv_tok_bpe_word(t, syms, nsyms, &out) != 0) {
                goto done;
            }
            if (out.n != 1 || out.ids[0] != id) {
                continue;
            }
        }
        {
            uint64_t       h = hash_str(raw, k);
            uint32_t       j = (uint32_t) h & t->words.mask;
            kv_tok_slot_t *e;

            for (;; j = (j + 1) & t->words.mask) {
                e = &t->words.slots[j];
                if (e->id == UINT32_MAX) {
                    e->hash = h;
                    e->off = (uint32_t) total;
                    e->len = (uint32_t) k;
                    e->id = id;
                    total += k;
                    break;
                }
                if (e->hash == h && e->len == k && memcmp(t->words_arena + e->off, raw, k) == 0) {
                    break;
                }
            }
        }
    }
    t->memory += cap * sizeof(kv_tok_slot_t) + total;
    rc = 0;
done:
    free(syms);
    kv_ids_free(&out);
    return rc;
}

/*
 * SentencePiece vocabularies normally keep "▁" only at the start of a token
 * (or in runs of "▁"). Then no token spans a non-"▁" character followed by
 * "▁", so no merge crosses a word start and each word can be merged alone
 * with the same result: the difference between one BPE over a whole prompt
 * and many small ones.
 */
static int spm_words_independent(const kv_tokenizer_t *t)
{
    uint32_t id;

    for (id = 0; id < t->vocab_size; id++) {
        const char *s = t->arena + t->tok_off[id], *p = s;
        size_t      n = t->tok_len[id];

        while ((p = memmem(p, n - (size_t) (p - s), "\xe2\x96\x81", 3)) != NULL) {
            if (p > s && (p - s < 3 || memcmp(p - 3, "\xe2\x96\x81", 3) != 0)) {
                return 0;
            }
            p += 3;
        }
    }
    return 1;
}

/* pair_rank (kv_tok_int.h): every pair of bytes' merge, looked up once. */
static int pair_table(kv_tokenizer_t *t)
{
    uint32_t a, b;

    t->pair_rank = malloc(65536 * sizeof(uint32_t));
    if (t->pair_rank == NULL) {
        return -1;
    }
    for (a = 0; a < 256; a++) {
        for (b = 0; b < 256; b++) {
            t->pair_rank[a << 8 | b] = kv_tok_merge_rank(t, t->byte_id[a], t->byte_id[b]);
        }
    }
    t->memory += 65536 * sizeof(uint32_t);
    return 0;
}

static void fallback_table(kv_tokenizer_t *t)
{
    char     buf[8];
    uint32_t b;

    for (b = 0; b < 256; b++) {
        int64_t id;

        snprintf(buf, sizeof(buf), "<0x%02X>", b);
        id = kv_tok_map_get(t, buf, 6);
        t->byte_id[b] = id < 0 ? UINT32_MAX : (uint32_t) id;
    }
}

kv_tokenizer_t *kv_tokenizer_load_buffer(const char *buf, size_t len, char *err, size_t errlen)
{
    json_error_t    jerr;
    json_t         *root, *model;
    kv_tokenizer_t *t;
    load_t          l = { err, errlen };
    uint32_t        b;

    root = json_loadb(buf, len, 0, &jerr);
    if (root == NULL) {
        snprintf(err, errlen, "tokenizer.json: %s (line %d)", jerr.text, jerr.line);
        return NULL;
    }
    t = calloc(1, sizeof(*t));
    if (t == NULL) {
        json_decref(root);
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    t->merge_base = -1;
    do {
        static uint32_t tags;

        t->cache_tag = __atomic_add_fetch(&tags, 1, __ATOMIC_RELAXED) & KV_TOK_TAG_MASK;
    } while (t->cache_tag == 0);
    model = json_object_get(root, "model");
    if (!json_is_object(model)) {
        refuse(&l, "tokenizer.json has no model object");
        goto fail;
    }
    if (json_object_get(root, "truncation") && !json_is_null(json_object_get(root, "truncation"))) {
        refuse(&l, "truncation is not supported");
        goto fail;
    }
    if (json_object_get(root, "padding") && !json_is_null(json_object_get(root, "padding"))) {
        refuse(&l, "padding is not supported");
        goto fail;
    }
    if (str_of(model, "type") && strcmp(str_of(model, "type"), "BPE") != 0) {
        refuse(&l, "model type %s is not supported (BPE only)", str_of(model, "type"));
        goto fail;
    }
    if (load_vocab(t, json_object_get(model, "vocab"), json_object_get(root, "added_tokens"), &l)
        || load_model(t, model, &l)
        || load_merges(t, json_object_get(model, "merges"), &l)
        || load_normalizer(t, json_object_get(root, "normalizer"), &l)
        || load_pre(t, json_object_get(root, "pre_tokenizer"), &l)
        || load_post(t, json_object_get(root, "post_processor"), &l)
        || load_decoder(t, json_object_get(root, "decoder"), &l))
    {
        goto fail;
    }
    if (t->byte_level) {
        byte_table(t);
        for (b = 0; b < 256; b++) {
            if (t->byte_id[b] == UINT32_MAX) {
                refuse(&l, "byte-level vocab lacks the token for byte 0x%02x", b);
                goto fail;
            }
        }
        if (words_table(t) != 0 || pair_table(t) != 0) {
            refuse(&l, "out of memory");
            goto fail;
        }
    } else if (t->norm != NORM_SENTENCEPIECE || t->pre != PRE_NONE) {
        refuse(&l, "a BPE model without ByteLevel must be SentencePiece-style "
               "(Prepend/Replace normalizer, no pre-tokenizer)");
        goto fail;
    } else {
        fallback_table(t);
        t->spm_split = spm_words_independent(t);
    }
    json_decref(root);
    t->memory += sizeof(*t) + t->n_added * sizeof(kv_added_t);
    return t;
fail:
    json_decref(root);
    kv_tokenizer_free(t);
    return NULL;
}

kv_tokenizer_t *kv_tokenizer_load(const char *path, char *err, size_t errlen)
{
    FILE           *f = fopen(path, "rb");
    char           *buf;
    long            n;
    kv_tokenizer_t *t;

    if (f == NULL) {
        snprintf(err, errlen, "cannot open %s", path);
        return NULL;
    }
    fseek(f, 0, SEEK_END);
    n = ftell(f);
    fseek(f, 0, SEEK_SET);
    buf = n > 0 ? malloc((size_t) n) : NULL;
    if (buf == NULL || fread(buf, 1, (size_t) n, f) != (size_t) n) {
        fclose(f);
        free(buf);
        snprintf(err, errlen, "cannot read %s", path);
        return NULL;
    }
    fclose(f);
    t = kv_tokenizer_load_buffer(buf, (size_t) n, err, errlen);
    free(buf);
    return t;
}

void kv_tokenizer_free(kv_tokenizer_t *t)
{
    if (t == NULL) {
        return;
    }
    free(t->arena);
    free(t->tok_off);
    free(t->tok_len);
    free(t->vocab.slots);
    free(t->words.slots);
    free(t->words_arena);
    free(t->merges);
    free(t->merge_id);
    free(t->pair_rank);
    free(t->added);
    free(t->added_sorted);
    free(t->is_special);
    free(t->prefix_ids);
    free(t->suffix_ids);
    free(t);
}
