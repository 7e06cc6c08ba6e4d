/*
 * Jinja lexer: template text -> tokens. Mirrors jinja2's Lexer.tokeniter
 * with trim_blocks=True and lstrip_blocks=True:
 *   - newlines normalised to \n, one trailing newline dropped;
 *   - "{%-", "{{-", "{#-" strip all whitespace before the tag;
 *   - otherwise "{%" and "{#" (not "{{") strip spaces/tabs back to the start
 *     of their line when only such whitespace precedes them on it
 *     ("{%+" disables this);
 *   - "%}" and "#}" eat one following newline; "-%}", "-}}", "-#}" eat all
 *     following whitespace; "+%}" keeps it.
 * Comments produce no tokens. Text tokens point into a normalised copy of
 * the source that the token list owns.
 */
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_jinja.h"
#include "kv_unicode.h"

typedef struct {
    const char *s;
    size_t len, pos;
    int line;
    jt_list *out;
    char *err;
    size_t errlen;
} lexer;

static int lex_err(lexer *L, const char *msg)
{
    snprintf(L->err, L->errlen, "line %d: %s", L->line, msg);
    return -1;
}

static char *own(jt_list *l, size_t n)
{
    if (l->nowned == l->capowned) {
        size_t cap = l->capowned ? l->capowned * 2 : 16;
        char **p = realloc(l->owned, cap * sizeof *p);
        if (!p)
            return NULL;
        l->owned = p;
        l->capowned = cap;
    }
    char *s = malloc(n + 1);
    if (s)
        l->owned[l->nowned++] = s;
    return s;
}

static jt *push(lexer *L, jt_type type, const char *s, size_t n)
{
    jt_list *l = L->out;
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 64;
        jt *p = realloc(l->toks, cap * sizeof *p);
        if (!p)
            return NULL;
        l->toks = p;
        l->cap = cap;
    }
    jt *t = &l->toks[l->n++];
    memset(t, 0, sizeof *t);
    t->type = type;
    t->line = L->line;
    t->s = s;
    t->n = n;
    return t;
}

static int is_ws(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'
           || (c >= 0x1c && c <= 0x1f);
}

static void count_lines(lexer *L, size_t from, size_t to)
{
    for (size_t i = from; i < to; i++)
        if (L->s[i] == '\n')
            L->line++;
}

/* Emits template data s[from, to) after whitespace control for the tag that follows. */
static int emit_text(lexer *L, size_t from, size_t to, char sign, int is_var, int line_starting)
{
    size_t end = to;
    if (sign == '-') {
        while (end > from && is_ws(L->s[end - 1]))
            end--;
    } else if (sign != '+' && !is_var) {
        size_t lpos = from;
        for (size_t i = to; i > from; i--)
            if (L->s[i - 1] == '\n') {
                lpos = i;
                break;
            }
        int after_nl = lpos > from;
        if ((after_nl || line_starting) && lpos < to) {
            size_t i = lpos;
            while (i < to && is_ws(L->s[i]))
                i++;
            if (i == to)
                end = lpos;
        }
    }
    if (end > from && !push(L, T_TEXT, L->s + from, end - from))
        return lex_err(L, "out of memory");
    count_lines(L, from, to);
    return 0;
}

/* Finds the next "{{", "{%" or "{#" at or after pos; returns its offset or len. */
static size_t find_open(lexer *L, size_t pos)
{
    for (size_t i = pos; i + 1 < L->len; i++)
        if (L->s[i] == '{' && (L->s[i + 1] == '{' || L->s[i + 1] == '%' || L->s[i + 1] == '#'))
            return i;
    return L->len;
}

/* Skips a comment body; sets *nl_end when the consumed text ends with \n. */
static int skip_comment(lexer *L, int *nl_end)
{
    for (size_t k = L->pos; k + 1 < L->len; k++) {
        size_t end = 0;
        if (L->s[k] == '+' && k + 2 < L->len && L->s[k + 1] == '#' && L->s[k + 2] == '}') {
            end = k + 3;
        } else if (L->s[k] == '-' && k + 2 < L->len && L->s[k + 1] == '#' && L->s[k + 2] == '}') {
            end = k + 3;
            while (end < L->len && is_ws(L->s[end]))
                end++;
        } else if (L->s[k] == '#' && L->s[k + 1] == '}') {
            end = k + 2;
            if (end < L->len && L->s[end] == '\n')
                end++;
        }
        if (end) {
            count_lines(L, L->pos, end);
            *nl_end = L->s[end - 1] == '\n';
            L->pos = end;
            return 0;
        }
    }
    return lex_err(L, "missing end of comment tag");
}

/* Decodes a Python string literal body (unicode-escape rules) into o; returns length or -1. */
static long decode_escapes(const char *s, size_t n, char *o)
{
    size_t j = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] != '\\' || i + 1 == n) {
            o[j++] = s[i];
            continue;
        }
        char c = s[++i];
        unsigned cp;
        int digits = 0;
        switch (c) {
        case '\n':
            continue;
        case '\\':
            o[j++] = '\\';
            continue;
        case '\'':
            o[j++] = '\'';
            continue;
        case '"':
            o[j++] = '"';
            continue;
        case 'a':
            o[j++] = '\a';
            continue;
        case 'b':
            o[j++] = '\b';
            continue;
        case 'f':
            o[j++] = '\f';
            continue;
        case 'n':
            o[j++] = '\n';
            continue;
        case 'r':
            o[j++] = '\r';
            continue;
        case 't':
            o[j++] = '\t';
            continue;
        case 'v':
            o[j++] = '\v';
            continue;
        case 'x':
            digits = 2;
            break;
        case 'u':
            digits = 4;
            break;
        case 'U':
            digits = 8;
            break;
        case 'N':
            return -1;
        default:
            if (c >= '0' && c <= '7') {
                cp = 0;
                int k = 0;
                while (k < 3 && i < n && s[i] >= '0' && s[i] <= '7')
                    cp = cp * 8 + (unsigned)(s[i++] - '0'), k++;
                i--;
                j += kv_utf8_put(o + j, cp);
                continue;
            }
            o[j++] = '\\';
            o[j++] = c;
            continue;
        }
        cp = 0;
        for (int k = 0; k < digits; k++) {
            int h = i + 1 < n ? kv_hex_digit((unsigned char)s[i + 1]) : -1;
            if (h < 0)
                return -1;
            cp = cp * 16 + (unsigned)h;
            i++;
        }
        if (cp > 0x10FFFF)
            return -1;
        j += kv_utf8_put(o + j, cp);
    }
    return (long)j;
}

static int lex_string(lexer *L)
{
    char q = L->s[L->pos];
    size_t i = L->pos + 1;
    while (i < L->len && L->s[i] != q) {
        if (L->s[i] == '\\')
            i++;
        i++;
    }
    if (i >= L->len)
        return lex_err(L, "unterminated string");
    size_t n = i - L->pos - 1;
    char *o = own(L->out, n);
    if (!o)
        return lex_err(L, "out of memory");
    long m = decode_escapes(L->s + L->pos + 1, n, o);
    if (m < 0)
        return lex_err(L, "unsupported escape in string literal");
    o[m] = 0;
    if (!push(L, T_STRING, o, (size_t)m))
        return lex_err(L, "out of memory");
    count_lines(L, L->pos, i + 1);
    L->pos = i + 1;
    return 0;
}

static int lex_number(lexer *L)
{
    size_t i = L->pos;
    int is_float = 0;
    while (i < L->len && (isdigit((unsigned char)L->s[i]) || L->s[i] == '_'))
        i++;
    if (i + 1 < L->len && L->s[i] == '.' && isdigit((unsigned char)L->s[i + 1])) {
        is_float = 1;
        i++;
        while (i < L->len && (isdigit((unsigned char)L->s[i]) || L->s[i] == '_'))
            i++;
    }
    if (i < L->len && (L->s[i] == 'e' || L->s[i] == 'E')) {
        size_t k = i + 1;
        if (k < L->len && (L->s[k] == '+' || L->s[k] == '-'))
            k++;
        if (k < L->len && isdigit((unsigned char)L->s[k])) {
            is_float = 1;
            i = k;
            while (i < L->len && isdigit((unsigned char)L->s[i]))
                i++;
        }
    }
    char buf[64];
    size_t n = 0;
    for (size_t k = L->pos; k < i && n < sizeof buf - 1; k++)
        if (L->s[k] != '_')
            buf[n++] = L->s[k];
    buf[n] = 0;
    jt *t = push(L, is_float ? T_FLOAT : T_INT, L->s + L->pos, i - L->pos);
    if (!t)
        return lex_err(L, "out of memory");
    errno = 0;
    if (is_float)
        t->f = strtod(buf, NULL);
    else
        t->i = strtoll(buf, NULL, 10);
    if (!is_float && errno == ERANGE)
        return lex_err(L, "integer literal beyond 64 bits");
    L->pos = i;
    return 0;
}

static const char *const ops2[] = {"//", "**", "==", "!=", ">=", "<=", NULL};
static const char ops1[] = "+-/*%~[](){}><=.:|,;";

/* Lexes the inside of a {{ }} or {% %} tag up to and including its end. */
static int lex_tag(lexer *L, int is_var, int *nl_end)
{
    char endc = is_var ? '}' : '%';
    int depth = 0;
    for (;;) {
        while (L->pos < L->len && is_ws(L->s[L->pos])) {
            if (L->s[L->pos] == '\n')
                L->line++;
            L->pos++;
        }
        if (L->pos >= L->len)
            return lex_err(L, is_var ? "unexpected end of template in {{ }}"
                                     : "unexpected end of template in {% %}");
        const char *p = L->s + L->pos;
        size_t left = L->len - L->pos;
        if (depth == 0) {
            size_t end = 0;
            if (!is_var && left >= 3 && p[0] == '+' && p[1] == '%' && p[2] == '}') {
                end = L->pos + 3;
            } else if (left >= 3 && p[0] == '-' && p[1] == endc && p[2] == '}') {
                end = L->pos + 3;
                while (end < L->len && is_ws(L->s[end]))
                    end++;
            } else if (left >= 2 && p[0] == endc && p[1] == '}') {
                end = L->pos + 2;
                if (!is_var && end < L->len && L->s[end] == '\n')
                    end++;
            }
            if (end) {
                if (!push(L, is_var ? T_VAR_END : T_BLOCK_END, NULL, 0))
                    return lex_err(L, "out of memory");
                count_lines(L, L->pos, end);
                *nl_end = L->s[end - 1] == '\n';
                L->pos = end;
                return 0;
            }
        }
        int rc;
        if (isdigit((unsigned char)*p)) {
            rc = lex_number(L);
        } else if (isalpha((unsigned char)*p) || *p == '_') {
            size_t i = L->pos;
            while (i < L->len && (isalnum((unsigned char)L->s[i]) || L->s[i] == '_'))
                i++;
            rc = push(L, T_NAME, p, i - L->pos) ? 0 : lex_err(L, "out of memory");
            L->pos = i;
        } else if (*p == '\'' || *p == '"') {
            rc = lex_string(L);
        } else {
            size_t n = 0;
            for (int k = 0; ops2[k]; k++)
                if (left >= 2 && p[0] == ops2[k][0] && p[1] == ops2[k][1])
                    n = 2;
            if (!n && strchr(ops1, *p))
                n = 1;
            if (!n) {
                char msg[64];
                snprintf(msg, sizeof msg, "unexpected character '%c'", *p);
                return lex_err(L, msg);
            }
            if (n == 1 && (*p == '(' || *p == '[' || *p == '{'))
                depth++;
            if (n == 1 && (*p == ')' || *p == ']' || *p == '}')) {
                if (depth == 0)
                    return lex_err(L, "unbalanced bracket");
                depth--;
            }
            rc = push(L, T_OP, p, n) ? 0 : lex_err(L, "out of memory");
            L->pos += n;
        }
        if (rc)
            return rc;
    }
}

/* Normalises newlines and drops one trailing newline, as jinja2 does. */
static char *normalise(jt_list *out, const char *src, size_t len, size_t *nlen)
{
    char *o = own(out, len);
    if (!o)
        return NULL;
    size_t j = 0;
    for (size_t i = 0; i < len; i++) {
        if (src[i] == '\r') {
            o[j++] = '\n';
            if (i + 1 < len && src[i + 1] == '\n')
                i++;
        } else {
            o[j++] = src[i];
        }
    }
    if (j > 0 && o[j - 1] == '\n')
        j--;
    o[j] = 0;
    *nlen = j;
    return o;
}

int jj_lex(const char *src, size_t len, jt_list *out, char *err, size_t errlen)
{
    memset(out, 0, sizeof *out);
    lexer L = {.out = out, .err = err, .errlen = errlen, .line = 1};
    L.s = normalise(out, src, len, &L.len);
    if (!L.s)
        return lex_err(&L, "out of memory");
    int line_starting = 1;
    while (L.pos < L.len) {
        size_t at = find_open(&L, L.pos);
        if (at == L.len) {
            if (emit_text(&L, L.pos, L.len, 0, 1, 0))
                return -1;
            break;
        }
        char kind = L.s[at + 1];
        char sign = at + 2 < L.len && (L.s[at + 2] == '-' || L.s[at + 2] == '+') ? L.s[at + 2] : 0;
        if (emit_text(&L, L.pos, at, sign, kind == '{', line_starting))
            return -1;
        L.pos = at + 2 + (sign ? 1 : 0);
        int nl_end = 0;
        if (kind == '#') {
            if (skip_comment(&L, &nl_end))
                return -1;
        } else {
            if (!push(&L, kind == '{' ? T_VAR_BEGIN : T_BLOCK_BEGIN, NULL, 0))
                return lex_err(&L, "out of memory");
            if (lex_tag(&L, kind == '{', &nl_end))
                return -1;
        }
        line_starting = nl_end;
    }
    if (!push(&L, T_EOF, NULL, 0))
        return lex_err(&L, "out of memory");
    return 0;
}

void jj_lex_free(jt_list *l)
{
    for (size_t i = 0; i < l->nowned; i++)
        free(l->owned[i]);
    free(l->owned);
    free(l->toks);
    memset(l, 0, sizeof *l);
}
