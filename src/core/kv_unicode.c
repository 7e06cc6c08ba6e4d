/* UTF-8 and character classes for the tokenizer (see kv_unicode.h). */
#include <stdlib.h>
#include <string.h>

#include "kv_unicode.h"

static int in_ranges(const kv_uni_range_t *r, unsigned n, uint32_t cp)
{
    unsigned lo = 0, hi = n;

    while (lo < hi) {
        unsigned mid = (lo + hi) / 2;

        if (cp < r[mid].lo) {
            hi = mid;
        } else if (cp > r[mid].hi) {
            lo = mid + 1;
        } else {
            return 1;
        }
    }
    return 0;
}

/* Constant data, not filled on first use: a lazy fill raced between the
 * threads that tokenize (plain stores, so on a weakly ordered CPU another
 * thread could see it ready before the table). Unlisted: KV_UNI_OTHER. */
static const unsigned char ascii_class[128] = {
    [9 ... 13] = KV_UNI_SPACE, [' '] = KV_UNI_SPACE,
    ['0' ... '9'] = KV_UNI_NUMBER,
    ['A' ... 'Z'] = KV_UNI_LETTER, ['a' ... 'z'] = KV_UNI_LETTER,
};

int kv_uni_class(uint32_t cp)
{
    if (cp < 128) {
        return ascii_class[cp];
    }
    if (in_ranges(kv_uni_letters, kv_uni_letters_n, cp)) return KV_UNI_LETTER;
    if (in_ranges(kv_uni_numbers, kv_uni_numbers_n, cp)) return KV_UNI_NUMBER;
    if (in_ranges(kv_uni_spaces, kv_uni_spaces_n, cp)) return KV_UNI_SPACE;
    return KV_UNI_OTHER;
}

int kv_uni_is_nfc_new(uint32_t cp)
{
    return in_ranges(kv_uni_nfc_new, kv_uni_nfc_new_n, cp);
}

size_t kv_utf8_next(const uint8_t *s, size_t n, uint32_t *cp)
{
    uint8_t  c = s[0];
    uint32_t v, min;
    size_t   len, i;
    uint8_t  lo = 0x80, hi = 0xbf;

    if (c < 0x80) {
        *cp = c;
        return 1;
    }
    if (c >= 0xc2 && c <= 0xdf) {
        len = 2; v = c & 0x1f; min = 0x80;
    } else if (c >= 0xe0 && c <= 0xef) {
        len = 3; v = c & 0x0f; min = 0x800;
        if (c == 0xe0) lo = 0xa0;
        if (c == 0xed) hi = 0x9f;       /* no surrogates */
    } else if (c >= 0xf0 && c <= 0xf4) {
        len = 4; v = c & 0x07; min = 0x10000;
        if (c == 0xf0) lo = 0x90;
        if (c == 0xf4) hi = 0x8f;
    } else {
        *cp = 0xfffd;
        return 1;
    }
    /* the maximal subpart: as many bytes as could still start this char */
    for (i = 1; i < len; i++) {
        uint8_t b = i < n ? s[i] : 0;
        uint8_t l = i == 1 ? lo : 0x80, h = i == 1 ? hi : 0xbf;

        if (i >= n || b < l || b > h) {
            *cp = 0xfffd;
            return i;
        }
        v = v << 6 | (b & 0x3f);
    }
    (void) min;
    *cp = v;
    return len;
}

size_t kv_utf8_put(char *dst, uint32_t cp)
{
    if (cp < 0x80) {
        dst[0] = (char) cp;
        return 1;
    }
    if (cp < 0x800) {
        dst[0] = (char) (0xc0 | cp >> 6);
        dst[1] = (char) (0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        dst[0] = (char) (0xe0 | cp >> 12);
        dst[1] = (char) (0x80 | (cp >> 6 & 0x3f));
        dst[2] = (char) (0x80 | (cp & 0x3f));
        return 3;
    }
    dst[0] = (char) (0xf0 | cp >> 18);
    dst[1] = (char) (0x80 | (cp >> 12 & 0x3f));
    dst[2] = (char) (0x80 | (cp >> 6 & 0x3f));
    dst[3] = (char) (0x80 | (cp & 0x3f));
    return 4;
}

int kv_utf8_valid(const uint8_t *s, size_t n)
{
    size_t   i = 0, k;
    uint32_t cp;

    while (i < n) {
        if (s[i] < 0x80) {
            uint64_t w;

            /* ASCII, the bulk of prompts: eight bytes at a time */
            i++;
            while (i + 8 <= n) {
                memcpy(&w, s + i, 8);
                if (w & 0x8080808080808080ULL) {
                    break;
                }
                i += 8;
            }
            continue;
        }
        k = kv_utf8_next(s + i, n - i, &cp);
        if (cp == 0xfffd && !(k == 3 && s[i] == 0xef && s[i + 1] == 0xbf && s[i + 2] == 0xbd)) {
            return 0;
        }
        i += k;
    }
    return 1;
}

char *kv_utf8_clean(const char *s, size_t n, size_t *out_len)
{
    char    *d = malloc(3 * n + 1);
    size_t   i = 0, k = 0, len;
    uint32_t cp;

    if (d == NULL) {
        return NULL;
    }
    while (i < n) {
        if ((uint8_t) s[i] < 0x80) {
            d[k++] = s[i++];
            continue;
        }
        len = kv_utf8_next((const uint8_t *) s + i, n - i, &cp);
        if (cp == 0xfffd) {
            k += kv_utf8_put(d + k, 0xfffd);
        } else {
            memcpy(d + k, s + i, len);
            k += len;
        }
        i += len;
    }
    d[k] = '\0';
    *out_len = k;
    return d;
}
