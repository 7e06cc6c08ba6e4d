/*
 * The one JSON reader: a pull scanner over a buffer, used by the event
 * decoders (kv_tree), the heartbeat and dump reader (src/events) and the
 * request body scanner (src/route/kv_body.c).
 *
 * Why not jansson: ids and hashes are full unsigned 64-bit integers, which
 * jansson rejects above INT64_MAX. The scanner reads integers exactly (and
 * bit-casts negative ones, as docs/PROTOCOL.md asks), never allocates,
 * validates what it skips and bounds its nesting at KV_JSON_MAX_DEPTH, so
 * bad input fails cleanly with a reason and a byte offset.
 *
 * Errors are sticky: the first failure sets err (and the reason, when the
 * scanner was given a buffer for it); every later call fails too.
 */
#ifndef KV_JSCAN_H
#define KV_JSCAN_H

#include <stddef.h>
#include <stdint.h>

/* The deepest nesting of arrays and objects any reader accepts (JSON and
 * MessagePack alike); deeper input is refused, never recursed into. */
#define KV_JSON_MAX_DEPTH  64

typedef struct {
    const char *p, *end;
    const char *base;       /* start of the document, for byte offsets */
    char       *why;        /* the first failure's reason, or NULL */
    size_t      whylen;
    int         err;        /* sticky: set by the first failure */
} kv_jscan_t;

typedef enum {
    KV_JNUM_UINT = 0,       /* a non-negative integer in u */
    KV_JNUM_NEG,            /* a negative integer, two's complement in u */
    KV_JNUM_FLOAT,          /* a fraction or exponent: u is not set */
    KV_JNUM_BIG             /* an integer outside [-2^63, 2^64) */
} kv_jnum_kind_t;

typedef struct {
    kv_jnum_kind_t  kind;
    uint64_t        u;
    const char     *text;   /* the number's bytes */
    size_t          len;
} kv_jnum_t;

void kv_jscan_init(kv_jscan_t *s, const char *buf, size_t len);
/* The same, with room for a failure's reason. */
void kv_jscan_init_err(kv_jscan_t *s, const char *buf, size_t len, char *why, size_t whylen);
/* Fails with a reason (printf format; " at byte N" is appended): -1. */
int  kv_jscan_fail(kv_jscan_t *s, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Next non-space byte without consuming it; 0 at the end. */
int  kv_jscan_peek(kv_jscan_t *s);
/* Consumes c (after spaces) or fails. */
int  kv_jscan_expect(kv_jscan_t *s, char c);
/* Consumes c if it is next; 1 if it was. */
int  kv_jscan_accept(kv_jscan_t *s, char c);

/* A string's raw bytes (between the quotes, escapes validated but left in
 * place) in *raw and *len; *escaped says whether any escape is in there. */
int  kv_jscan_string_raw(kv_jscan_t *s, const char **raw, size_t *len, int *escaped);
/* A string unescaped into out (NUL-terminated, truncated to cap). */
int  kv_jscan_string(kv_jscan_t *s, char *out, size_t cap);
/* Unescapes len validated raw bytes into dst (room for len bytes: the
 * result is never longer); returns the length. A lone surrogate becomes
 * U+FFFD: engines reject such text anyway and routing needs a stable answer. */
size_t kv_json_unescape(const char *raw, size_t len, char *dst);

/* Any number, classified (see kv_jnum_kind_t). */
int  kv_jscan_number(kv_jscan_t *s, kv_jnum_t *num);
/* An integer as u64 (negative: two's complement); fractions fail. */
int  kv_jscan_u64(kv_jscan_t *s, uint64_t *v);
/* Consumes the literal (true, false, null) or fails. */
int  kv_jscan_literal(kv_jscan_t *s, const char *lit);
/* null: 1 (consumed), else 0 and nothing consumed. */
int  kv_jscan_null(kv_jscan_t *s);

/* Skips any value; depth is the nesting the value sits at. */
int  kv_jscan_skip_at(kv_jscan_t *s, int depth);
static inline int kv_jscan_skip(kv_jscan_t *s) { return kv_jscan_skip_at(s, 0); }
/* Iterates an object's keys: after consuming '{', set first = 1 and call
 * until it returns 0 (the closing '}' consumed); 1: "key": read, now read
 * or skip the value; -1 on error. */
int  kv_jscan_key(kv_jscan_t *s, int *first, char *key, size_t cap);
/* Iterates a container's members after its '[' or '{': 1 when a member
 * follows (the ',' before it consumed), 0 after close, -1 on error. */
int  kv_jscan_more(kv_jscan_t *s, int *first, char close);
/* kv_jscan_more for an array. */
static inline int kv_jscan_item(kv_jscan_t *s, int *first) { return kv_jscan_more(s, first, ']'); }

/*
 * An object read by a table: each known key's value is stored at its offset
 * in base, unknown keys are skipped. Bit i of *seen is set when fields[i]
 * was present (at most 32 fields; KV_JF_SKIP records presence only).
 * 0 once the object is closed, or -1.
 */
typedef enum {
    KV_JF_U64,              /* uint64_t at off */
    KV_JF_STRING,           /* char[cap] at off, truncated and terminated */
    KV_JF_OBJECT,           /* a nested object read with sub, at off */
    KV_JF_SKIP              /* the value is skipped */
} kv_jfield_type_t;

typedef struct kv_jfield_s  kv_jfield_t;

struct kv_jfield_s {
    const char          *name;
    kv_jfield_type_t     type;
    size_t               off;
    size_t               cap;
    const kv_jfield_t   *sub;   /* KV_JF_OBJECT: its table, NULL-name ended */
};

/* fields ends with an entry whose name is NULL. */
int  kv_jscan_fields(kv_jscan_t *s, const kv_jfield_t *fields, void *base, uint32_t *seen);

#endif
