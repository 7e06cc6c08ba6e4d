/*
 * The little Unicode the tokenizer needs: UTF-8 decoding with the
 * replacement Python applies to invalid bytes, and the classes the
 * tokenizers' pre-tokenizer regexes use: \p{L}, \p{N} and \s (White_Space).
 * Tables are generated from the Unicode Character Database
 * (tools/gen-unicode-tables.py -> kv_unicode_tables.c).
 */
#ifndef KV_UNICODE_H
#define KV_UNICODE_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint32_t lo, hi;
} kv_uni_range_t;

extern const kv_uni_range_t kv_uni_letters[], kv_uni_numbers[], kv_uni_spaces[];
extern const unsigned kv_uni_letters_n, kv_uni_numbers_n, kv_uni_spaces_n;

enum { KV_UNI_OTHER = 0, KV_UNI_LETTER = 1, KV_UNI_NUMBER = 2, KV_UNI_SPACE = 3 };

/* KV_UNI_LETTER, _NUMBER, _SPACE or _OTHER. */
int kv_uni_class(uint32_t cp);

/*
 * Decodes one code point at s[0..n). Returns its length in bytes; for an
 * invalid sequence returns the length of its maximal subpart (at least 1)
 * with *cp = U+FFFD, as Python's bytes.decode("utf-8", "replace") does.
 */
size_t kv_utf8_next(const uint8_t *s, size_t n, uint32_t *cp);
size_t kv_utf8_put(char *dst, uint32_t cp);

/* The value of one hex digit (JSON and Python escapes), or -1. */
static inline int kv_hex_digit(int c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* s[0..n) with each invalid maximal subpart replaced by U+FFFD, as
 * Python's and Rust's lossy decoders do; malloc'ed, NUL-terminated. */
char *kv_utf8_clean(const char *s, size_t n, size_t *out_len);

/* 1 if s[0..n) is valid UTF-8. */
int kv_utf8_valid(const uint8_t *s, size_t n);

#endif
