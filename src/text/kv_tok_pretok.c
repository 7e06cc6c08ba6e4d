/*
 * Pre-tokenizers: hand-written scanners equivalent to the split regexes of
 * the supported tokenizers, run over valid UTF-8 (the caller sanitises).
 * Each scanner tries the regex's alternatives in order at the current
 * position, the way a backtracking engine (Oniguruma, as HF uses) takes the
 * first alternative that matches, and emits the match as one piece.
 *
 * GPT-2:   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 * Qwen2:   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*
 *          |\s*[\r\n]+|\s+(?!\S)|\s+
 * Llama-3: the same with \p{N}{1,3}
 */
#include "kv_tok_int.h"
#include "kv_unicode.h"

typedef struct {
    const uint8_t  *s;
    size_t          n;
} text_t;

static uint32_t cp_at(const text_t *t, size_t i, size_t *len)
{
    uint32_t cp;

    if (i >= t->n) {
        *len = 0;
        return UINT32_MAX;
    }
    *len = kv_utf8_next(t->s + i, t->n - i, &cp);
    return cp;
}

static int cls_at(const text_t *t, size_t i, size_t *len)
{
    uint32_t cp = cp_at(t, i, len);

    return cp == UINT32_MAX ? -1 : kv_uni_class(cp);
}

static int ascii_letter(uint8_t b)
{
    return (uint8_t) ((b | 0x20) - 'a') < 26;
}

/* End of the run of characters of class c starting at i (at most max chars). */
static size_t run(const text_t *t, size_t i, int c, size_t max)
{
    size_t len, k = 0;

    if (c == KV_UNI_LETTER && max == SIZE_MAX) {
        /* ASCII letters, the bulk of most text: no decoding, no lookup; an
         * ASCII byte that is no letter ends the run without either */
        for (;;) {
            while (i < t->n && ascii_letter(t->s[i])) {
                i++;
            }
            if (i >= t->n || t->s[i] < 0x80 || cls_at(t, i, &len) != c) {
                return i;
            }
            i += len;
        }
    }

    while (k < max && cls_at(t, i, &len) == c) {
        i += len;
        k++;
    }
    return i;
}

/* The common case of both splits, decided on ASCII bytes alone: a letter,
 * or a space before a letter, starts a letter run (no contraction starts
 * with either). Its end, or 0 where the general path must decide. */
static size_t ascii_word(const text_t *t, size_t i)
{
    if (ascii_letter(t->s[i])) {
        return run(t, i, KV_UNI_LETTER, SIZE_MAX);
    }
    if (t->s[i] == ' ' && i + 1 < t->n && ascii_letter(t->s[i + 1])) {
        return run(t, i + 1, KV_UNI_LETTER, SIZE_MAX);
    }
    return 0;
}

static int lower(int c)
{
    return c >= 'A' && c <= 'Z' ? c + 32 : c;
}

/* A contraction at i ('s 't 're 've 'm 'll 'd): its length, or 0. */
static size_t contraction(const text_t *t, size_t i, int fold)
{
    size_t left = t->n - i;
    int    a, b;

    if (left < 2 || t->s[i] != '\'') {
        return 0;
    }
    a = fold ? lower(t->s[i + 1]) : t->s[i + 1];
    b = left > 2 ? (fold ? lower(t->s[i + 2]) : t->s[i + 2]) : 0;
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
    return 0;
}

/* \s+(?!\S)|\s+ at i, where i starts a whitespace run. */
static size_t spaces(const text_t *t, size_t i)
{
    size_t end = i, last = i, len;

    while (cls_at(t, end, &len) == KV_UNI_SPACE) {
        last = end;
        end += len;
    }
    if (end >= t->n || last == i) {
        return end;             /* to the end, or one char before non-space */
    }
    return last;                /* leave the last space to the next word */
}

static size_t gpt2_piece(const text_t *t, size_t i)
{
    size_t len, len2, k;
    int    c, c2;

    if ((k = ascii_word(t, i))) {
        return k;                   /* ` ?\p{L}+` */
    }
    c = cls_at(t, i, &len);
    if ((k = contraction(t, i, 0))) {
        return i + k;
    }
    c2 = t->s[i] == ' ' ? cls_at(t, i + 1, &len2) : -1;
    if (c2 == KV_UNI_LETTER || c2 == KV_UNI_NUMBER || c2 == KV_UNI_OTHER) {
        return run(t, i + 1, c2, SIZE_MAX);
    }
    if (c == KV_UNI_LETTER || c == KV_UNI_NUMBER || c == KV_UNI_OTHER) {
        return run(t, i, c, SIZE_MAX);
    }
    return spaces(t, i);
}

static size_t newlines(const text_t *t, size_t i)
{
    while (i < t->n && (t->s[i] == '\r' || t->s[i] == '\n')) {
        i++;
    }
    return i;
}

static size_t qwen_piece(const text_t *t, size_t i, size_t digits)
{
    size_t   len, len2, k, end, last_nl;
    uint32_t cp;
    int      c, c2;

    /* a space (neither \r, \n, letter nor number) is the optional lead
     * of [^\r\n\p{L}\p{N}]?\p{L}+ */
    if ((k = ascii_word(t, i))) {
        return k;
    }
    cp = cp_at(t, i, &len);
    c = kv_uni_class(cp);
    if ((k = contraction(t, i, 1))) {
        return i + k;
    }
    /* [^\r\n\p{L}\p{N}]?\p{L}+ */
    if (c != KV_UNI_LETTER && c != KV_UNI_NUMBER && cp != '\r' && cp != '\n'
        && cls_at(t, i + len, &len2) == KV_UNI_LETTER)
    {
        return run(t, i + len, KV_UNI_LETTER, SIZE_MAX);
    }
    if (c == KV_UNI_LETTER) {
        return run(t, i, KV_UNI_LETTER, SIZE_MAX);
    }
    if (c == KV_UNI_NUMBER) {
        return run(t, i, KV_UNI_NUMBER, digits);
    }
    /*  ?[^\s\p{L}\p{N}]+[\r\n]* */
    c2 = cp == ' ' ? cls_at(t, i + 1, &len2) : -1;
    if (c2 == KV_UNI_OTHER) {
        return newlines(t, run(t, i + 1, KV_UNI_OTHER, SIZE_MAX));
    }
    if (c == KV_UNI_OTHER) {
        return newlines(t, run(t, i, KV_UNI_OTHER, SIZE_MAX));
    }
    /* \s*[\r\n]+ : through the run's last newline, if it has one */
    end = i;
    last_nl = SIZE_MAX;
    while (cls_at(t, end, &len) == KV_UNI_SPACE) {
        if (t->s[end] == '\r' || t->s[end] == '\n') {
            last_nl = end;
        }
        end += len;
    }
    if (last_nl != SIZE_MAX) {
        return last_nl + 1;
    }
    return spaces(t, i);
}

int kv_tok_pretokenize(kv_pre_kind_t kind, const char *text, size_t len,
                       kv_tok_emit_fn emit, void *ctx)
{
    text_t t = { (const uint8_t *) text, len };
    size_t i = 0, j;

    if (kind == PRE_NONE) {
        return len ? emit(ctx, text, len) : 0;
    }
    while (i < len) {
        switch (kind) {
        case PRE_GPT2:   j = gpt2_piece(&t, i); break;
        case PRE_QWEN2:  j = qwen_piece(&t, i, 1); break;
        default:         j = qwen_piece(&t, i, 3); break;
        }
        if (j <= i) {
            size_t l;

            cp_at(&t, i, &l);   /* never stall: one character */
            j = i + (l ? l : 1);
        }
        if (emit(ctx, text + i, j - i) != 0) {
            return -1;
        }
        i = j;
    }
    return 0;
}
