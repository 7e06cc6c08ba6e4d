/*
 * Jinja parser: tokens -> AST, following jinja2's Parser (same operator
 * precedence: condexpr < or < and < not < compare < +,- < ~ < *,/,//,% <
 * ** < unary < postfix/filters/tests). Anything outside the supported
 * subset (unknown tag, filter, test or method; *args; recursive loops)
 * fails here, at load time, with the construct and line named.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_jinja.h"
#include "kv_unicode.h"

struct jj_template {
    jt_list toks;  /* owns the normalised source and decoded strings */
    jnode **nodes; /* every node, for freeing */
    size_t nnodes, capnodes;
    void **blocks; /* kid arrays and name arrays, for freeing */
    size_t nblocks, capblocks;
    jnode *root;
    int iterates_content;
};

typedef struct {
    jj_template *t;
    size_t pos;
    char *err;
    size_t errlen;
    int failed;
    int depth; /* nesting of expressions and blocks: bounded so the C stack is */
} parser;

#define MAX_DEPTH 200
/* The evaluator recurses once per level of the tree, and the loops of the parser build
 * left-deep chains (1+1+...+1, a|f|f..., a.b.c..., a long elif chain) as deep as they are
 * long: the height of the whole tree is bounded too, so that such a template fails at load.
 * The shipped templates need under 30. (Macro calls multiply it: the evaluator also counts
 * its recursion.) */
#define MAX_HEIGHT 256

static jt *cur(parser *P)
{
    return &P->t->toks.toks[P->pos];
}
static jt *peek(parser *P, size_t k)
{
    size_t i = P->pos + k;
    return i < P->t->toks.n ? &P->t->toks.toks[i] : &P->t->toks.toks[P->t->toks.n - 1];
}

static void *fail(parser *P, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void *fail(parser *P, const char *fmt, ...)
{
    if (P->failed)
        return NULL;
    P->failed = 1;
    int n = snprintf(P->err, P->errlen, "line %d: ", cur(P)->line);
    if (n < 0 || (size_t)n >= P->errlen)
        return NULL;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(P->err + n, P->errlen - (size_t)n, fmt, ap);
    va_end(ap);
    return NULL;
}

static int track(parser *P, void *p)
{
    jj_template *t = P->t;
    if (t->nblocks == t->capblocks) {
        size_t cap = t->capblocks ? t->capblocks * 2 : 64;
        void **q = realloc(t->blocks, cap * sizeof *q);
        if (!q)
            return -1;
        t->blocks = q;
        t->capblocks = cap;
    }
    t->blocks[t->nblocks++] = p;
    return 0;
}

static jnode *node(parser *P, jn_type type)
{
    jj_template *t = P->t;
    if (t->nnodes == t->capnodes) {
        size_t cap = t->capnodes ? t->capnodes * 2 : 128;
        jnode **q = realloc(t->nodes, cap * sizeof *q);
        if (!q)
            return fail(P, "out of memory");
        t->nodes = q;
        t->capnodes = cap;
    }
    jnode *n = calloc(1, sizeof *n);
    if (!n)
        return fail(P, "out of memory");
    t->nodes[t->nnodes++] = n;
    n->type = type;
    n->line = cur(P)->line;
    return n;
}

/* Appends to a growable pointer array tracked by the template (cap doubles at powers of 2). */
static int append(parser *P, void ***arr, int *n, void *item)
{
    if ((*n & (*n - 1)) == 0) { /* n is 0 or a power of two: grow */
        size_t cap = *n ? (size_t)*n * 2 : 4;
        void **q = malloc(cap * sizeof *q);
        if (!q) {
            fail(P, "out of memory");
            return -1;
        }
        if (*n)
            memcpy(q, *arr, (size_t)*n * sizeof *q);
        if (track(P, q)) {
            free(q);
            fail(P, "out of memory");
            return -1;
        }
        *arr = q; /* the old array stays tracked and is freed with the template */
    }
    (*arr)[(*n)++] = item;
    return 0;
}

static int add_kid(parser *P, jnode *n, jnode *k)
{
    return append(P, (void ***)&n->kids, &n->nkids, k);
}
static int add_kid2(parser *P, jnode *n, jnode *k)
{
    return append(P, (void ***)&n->kids2, &n->nkids2, k);
}
static int add_name(parser *P, jnode *n, const char *s)
{
    return append(P, (void ***)&n->names, &n->nnames, (void *)s);
}

/* NUL-terminated copy of a NAME/OP token's text, owned by the template. */
static const char *tok_str(parser *P, jt *t)
{
    char *s = malloc(t->n + 1);
    if (!s || track(P, s)) {
        free(s);
        return fail(P, "out of memory");
    }
    memcpy(s, t->s, t->n);
    s[t->n] = 0;
    return s;
}

static int is_op(jt *t, const char *op)
{
    return t->type == T_OP && t->n == strlen(op) && !memcmp(t->s, op, t->n);
}
static int is_name(jt *t, const char *nm)
{
    return t->type == T_NAME && t->n == strlen(nm) && !memcmp(t->s, nm, t->n);
}

static int expect_op(parser *P, const char *op)
{
    if (!is_op(cur(P), op)) {
        fail(P, "expected '%s'", op);
        return -1;
    }
    P->pos++;
    return 0;
}

static int expect_block_end(parser *P)
{
    if (cur(P)->type != T_BLOCK_END) {
        fail(P, "expected end of statement block");
        return -1;
    }
    P->pos++;
    return 0;
}

static jnode *parse_expr(parser *P);
static jnode *parse_tuple(parser *P, int with_condexpr, int explicit_parens);
static jnode *parse_unary(parser *P, int with_filter);
static jnode *parse_or(parser *P);

/* ---- expressions ---- */

static int parse_call_args(parser *P, jnode *call)
{
    if (expect_op(P, "("))
        return -1;
    while (!is_op(cur(P), ")")) {
        if (call->nkids + call->nkids2 > 0 && expect_op(P, ","))
            return -1;
        if (is_op(cur(P), ")"))
            break;
        if (is_op(cur(P), "*") || is_op(cur(P), "**")) {
            fail(P, "unsupported: *args/**kwargs in a call");
            return -1;
        }
        if (cur(P)->type == T_NAME && is_op(peek(P, 1), "=")) {
            const char *k = tok_str(P, cur(P));
            P->pos += 2;
            jnode *v = parse_expr(P);
            if (!k || !v || add_name(P, call, k) || add_kid2(P, call, v))
                return -1;
        } else {
            if (call->nkids2) {
                fail(P, "positional argument after keyword argument");
                return -1;
            }
            jnode *v = parse_expr(P);
            if (!v || add_kid(P, call, v))
                return -1;
        }
    }
    P->pos++;
    return 0;
}

static jnode *parse_primary(parser *P)
{
    jt *t = cur(P);
    jnode *n;
    if (t->type == T_NAME) {
        static const struct {
            const char *nm;
            int kind;
        } consts[] = {
            {"true", 1}, {"True", 1}, {"false", 0}, {"False", 0}, {"none", 2}, {"None", 2},
        };
        for (size_t i = 0; i < sizeof consts / sizeof consts[0]; i++) {
            if (is_name(t, consts[i].nm)) {
                if (!(n = node(P, N_LIT)))
                    return NULL;
                n->lit = consts[i].kind == 2 ? jv_none() : jv_bool(consts[i].kind);
                P->pos++;
                return n;
            }
        }
        if (!(n = node(P, N_NAME)) || !(n->s = tok_str(P, t)))
            return NULL;
        P->pos++;
        return n;
    }
    if (t->type == T_STRING) {
        /* Adjacent literals concatenate, as in Python. */
        size_t total = 0, k = 0;
        while (peek(P, k)->type == T_STRING)
            total += peek(P, k++)->n;
        if (!(n = node(P, N_LIT)))
            return NULL;
        if (k == 1) {
            n->lit = jv_strn(t->s, t->n);
        } else {
            char *s = malloc(total + 1);
            if (!s || track(P, s)) {
                free(s);
                return fail(P, "out of memory");
            }
            size_t off = 0;
            for (size_t i = 0; i < k; i++) {
                memcpy(s + off, peek(P, i)->s, peek(P, i)->n);
                off += peek(P, i)->n;
            }
            s[off] = 0;
            n->lit = jv_strn(s, off);
        }
        P->pos += k;
        return n;
    }
    if (t->type == T_INT || t->type == T_FLOAT) {
        if (!(n = node(P, N_LIT)))
            return NULL;
        n->lit = t->type == T_INT ? jv_int(t->i) : jv_float(t->f);
        P->pos++;
        return n;
    }
    if (is_op(t, "(")) {
        P->pos++;
        n = parse_tuple(P, 1, 1);
        if (!n || expect_op(P, ")"))
            return NULL;
        return n;
    }
    if (is_op(t, "[")) {
        P->pos++;
        if (!(n = node(P, N_LISTLIT)))
            return NULL;
        while (!is_op(cur(P), "]")) {
            if (n->nkids && expect_op(P, ","))
                return NULL;
            if (is_op(cur(P), "]"))
                break;
            jnode *item = parse_expr(P);
            if (!item || add_kid(P, n, item))
                return NULL;
        }
        P->pos++;
        return n;
    }
    if (is_op(t, "{")) {
        P->pos++;
        if (!(n = node(P, N_DICTLIT)))
            return NULL;
        while (!is_op(cur(P), "}")) {
            if (n->nkids && expect_op(P, ","))
                return NULL;
            if (is_op(cur(P), "}"))
                break;
            jnode *k = parse_expr(P);
            if (!k || expect_op(P, ":"))
                return NULL;
            jnode *v = parse_expr(P);
            if (!v || add_kid(P, n, k) || add_kid2(P, n, v))
                return NULL;
        }
        P->pos++;
        return n;
    }
    if (t->type == T_VAR_END || t->type == T_BLOCK_END || t->type == T_EOF)
        return fail(P, "unexpected end of expression");
    return fail(P, "unexpected '%.*s'", (int)(t->n ? t->n : 1), t->n ? t->s : "?");
}

static jnode *parse_subscript(parser *P, jnode *obj)
{
    jnode *n;
    if (is_op(cur(P), ".")) {
        P->pos++;
        jt *t = cur(P);
        if (t->type == T_NAME) {
            if (!(n = node(P, N_ATTR)) || !(n->s = tok_str(P, t)))
                return NULL;
            n->a = obj;
            P->pos++;
            return n;
        }
        if (t->type == T_INT) {
            if (!(n = node(P, N_ITEM)) || !(n->b = node(P, N_LIT)))
                return NULL;
            n->a = obj;
            n->b->lit = jv_int(t->i);
            P->pos++;
            return n;
        }
        return fail(P, "expected name or number after '.'");
    }
    P->pos++; /* '[' */
    jnode *start = NULL, *stop = NULL, *step = NULL;
    int is_slice = 0;
    if (!is_op(cur(P), ":")) {
        if (!(start = parse_expr(P)))
            return NULL;
    }
    if (is_op(cur(P), ":")) {
        is_slice = 1;
        P->pos++;
        if (!is_op(cur(P), "]") && !is_op(cur(P), ":") && !(stop = parse_expr(P)))
            return NULL;
        if (is_op(cur(P), ":")) {
            P->pos++;
            if (!is_op(cur(P), "]") && !(step = parse_expr(P)))
                return NULL;
        }
    }
    if (is_op(cur(P), ","))
        return fail(P, "unsupported: tuple subscript");
    if (expect_op(P, "]"))
        return NULL;
    if (!(n = node(P, is_slice ? N_SLICE : N_ITEM)))
        return NULL;
    n->a = obj;
    n->b = start;
    n->c = stop;
    n->d = step;
    return n;
}

static jnode *parse_postfix(parser *P, jnode *n)
{
    while (n) {
        if (is_op(cur(P), ".") || is_op(cur(P), "[")) {
            n = parse_subscript(P, n);
        } else if (is_op(cur(P), "(")) {
            jnode *call = node(P, N_CALL);
            if (!call)
                return NULL;
            call->a = n;
            if (n->type == N_ATTR && jj_method_lookup(n->s) < 0)
                return fail(P, "unsupported method '%s()'", n->s);
            if (parse_call_args(P, call))
                return NULL;
            n = call;
        } else {
            break;
        }
    }
    return n;
}

/* A filter or test name: NAME, possibly dotted. */
static const char *parse_dotted_name(parser *P)
{
    if (cur(P)->type != T_NAME)
        return fail(P, "expected a name");
    if (is_op(peek(P, 1), "."))
        return fail(P, "unsupported: dotted filter or test name");
    const char *s = tok_str(P, cur(P));
    P->pos++;
    return s;
}

static jnode *parse_filter(parser *P, jnode *operand)
{
    P->pos++; /* '|' */
    jnode *f = node(P, N_FILTER);
    if (!f || !(f->s = parse_dotted_name(P)))
        return NULL;
    if (jj_filter_lookup(f->s) < 0)
        return fail(P, "unsupported filter '%s'", f->s);
    f->a = operand;
    if (is_op(cur(P), "(") && parse_call_args(P, f))
        return NULL;
    return f;
}

static jnode *parse_test(parser *P, jnode *operand)
{
    P->pos++; /* 'is' */
    jnode *t = node(P, N_TEST);
    if (!t)
        return NULL;
    if (is_name(cur(P), "not")) {
        t->op = 1;
        P->pos++;
    }
    if (!(t->s = parse_dotted_name(P)))
        return NULL;
    if (jj_test_lookup(t->s) < 0)
        return fail(P, "unsupported test '%s'", t->s);
    t->a = operand;
    jt *c = cur(P);
    if (is_op(c, "(")) {
        if (parse_call_args(P, t))
            return NULL;
    } else if ((c->type == T_NAME || c->type == T_STRING || c->type == T_INT || c->type == T_FLOAT
                || is_op(c, "(") || is_op(c, "[") || is_op(c, "{"))
               && !is_name(c, "else") && !is_name(c, "or") && !is_name(c, "and")) {
        if (is_name(c, "is"))
            return fail(P, "you cannot chain multiple tests with is");
        jnode *arg = parse_postfix(P, parse_primary(P));
        if (!arg || add_kid(P, t, arg))
            return NULL;
    }
    return t;
}

static jnode *parse_filter_expr(parser *P, jnode *n)
{
    while (n) {
        if (is_op(cur(P), "|"))
            n = parse_filter(P, n);
        else if (is_name(cur(P), "is"))
            n = parse_test(P, n);
        else if (is_op(cur(P), "("))
            n = parse_postfix(P, n);
        else
            break;
    }
    return n;
}

static jnode *parse_unary_inner(parser *P, int with_filter);

static jnode *parse_unary(parser *P, int with_filter)
{
    if (++P->depth > MAX_DEPTH)
        return fail(P, "expression nested too deeply");
    jnode *n = parse_unary_inner(P, with_filter);
    P->depth--;
    return n;
}

static jnode *parse_unary_inner(parser *P, int with_filter)
{
    jnode *n;
    if (is_op(cur(P), "-") || is_op(cur(P), "+")) {
        int neg = is_op(cur(P), "-");
        P->pos++;
        if (!(n = node(P, neg ? N_NEG : N_POS)) || !(n->a = parse_unary(P, 0)))
            return NULL;
    } else {
        n = parse_primary(P);
    }
    n = parse_postfix(P, n);
    if (with_filter)
        n = parse_filter_expr(P, n);
    return n;
}

static jnode *binop(parser *P, jn_type type, int op, jnode *a, jnode *b)
{
    if (!a || !b)
        return NULL;
    jnode *n = node(P, type);
    if (!n)
        return NULL;
    n->op = op;
    n->a = a;
    n->b = b;
    return n;
}

static jnode *parse_pow(parser *P)
{
    jnode *n = parse_unary(P, 1);
    while (n && is_op(cur(P), "**")) {
        P->pos++;
        n = binop(P, N_BIN, OP_POW, n, parse_unary(P, 1));
    }
    return n;
}

static jnode *parse_math2(parser *P)
{
    jnode *n = parse_pow(P);
    for (;;) {
        int op = is_op(cur(P), "*")    ? OP_MUL
                 : is_op(cur(P), "/")  ? OP_DIV
                 : is_op(cur(P), "//") ? OP_FLOORDIV
                 : is_op(cur(P), "%")  ? OP_MOD
                                       : 0;
        if (!n || !op)
            return n;
        P->pos++;
        n = binop(P, N_BIN, op, n, parse_pow(P));
    }
}

static jnode *parse_concat(parser *P)
{
    jnode *first = parse_math2(P);
    if (!first || !is_op(cur(P), "~"))
        return first;
    jnode *n = node(P, N_CONCAT);
    if (!n || add_kid(P, n, first))
        return NULL;
    while (is_op(cur(P), "~")) {
        P->pos++;
        jnode *k = parse_math2(P);
        if (!k || add_kid(P, n, k))
            return NULL;
    }
    return n;
}

static jnode *parse_math1(parser *P)
{
    jnode *n = parse_concat(P);
    for (;;) {
        int op = is_op(cur(P), "+") ? OP_ADD : is_op(cur(P), "-") ? OP_SUB : 0;
        if (!n || !op)
            return n;
        P->pos++;
        n = binop(P, N_BIN, op, n, parse_concat(P));
    }
}

/* Chained comparisons a < b < c become (a < b) and (b < c). */
static jnode *parse_compare(parser *P)
{
    jnode *left = parse_math1(P), *result = NULL;
    for (;;) {
        jt *t = cur(P);
        int op = is_op(t, "==")     ? OP_EQ
                 : is_op(t, "!=")   ? OP_NE
                 : is_op(t, "<")    ? OP_LT
                 : is_op(t, "<=")   ? OP_LE
                 : is_op(t, ">")    ? OP_GT
                 : is_op(t, ">=")   ? OP_GE
                 : is_name(t, "in") ? OP_IN
                                    : 0;
        if (!op && is_name(t, "not") && is_name(peek(P, 1), "in")) {
            op = OP_NOTIN;
            P->pos++;
        }
        if (!left || !op)
            return result ? result : left;
        P->pos++;
        jnode *right = parse_math1(P);
        jnode *cmp = binop(P, N_CMP, op, left, right);
        result = result ? binop(P, N_AND, 0, result, cmp) : cmp;
        if (!result)
            return NULL;
        left = right;
    }
}

static jnode *parse_not(parser *P)
{
    if (is_name(cur(P), "not")) {
        P->pos++;
        jnode *n = node(P, N_NOT);
        if (++P->depth > MAX_DEPTH)
            return fail(P, "expression nested too deeply");
        if (!n || !(n->a = parse_not(P)))
            return NULL;
        P->depth--;
        return n;
    }
    return parse_compare(P);
}

static jnode *parse_and(parser *P)
{
    jnode *n = parse_not(P);
    while (n && is_name(cur(P), "and")) {
        P->pos++;
        n = binop(P, N_AND, 0, n, parse_not(P));
    }
    return n;
}

static jnode *parse_or(parser *P)
{
    jnode *n = parse_and(P);
    while (n && is_name(cur(P), "or")) {
        P->pos++;
        n = binop(P, N_OR, 0, n, parse_and(P));
    }
    return n;
}

static jnode *parse_condexpr(parser *P)
{
    jnode *n = parse_or(P);
    while (n && is_name(cur(P), "if")) {
        P->pos++;
        jnode *c = node(P, N_COND);
        if (!c)
            return NULL;
        c->b = n;
        if (!(c->a = parse_or(P)))
            return NULL;
        if (is_name(cur(P), "else")) {
            P->pos++;
            if (++P->depth > MAX_DEPTH)
                return fail(P, "expression nested too deeply");
            if (!(c->c = parse_condexpr(P)))
                return NULL;
            P->depth--;
        }
        n = c;
    }
    return n;
}

static jnode *parse_expr(parser *P)
{
    return parse_condexpr(P);
}

static jnode *parse_tuple(parser *P, int with_condexpr, int explicit_parens)
{
    jnode *first = NULL;
    if (explicit_parens && is_op(cur(P), ")"))
        return node(P, N_TUPLELIT);
    first = with_condexpr ? parse_expr(P) : parse_or(P);
    if (!first || !is_op(cur(P), ","))
        return first;
    jnode *t = node(P, N_TUPLELIT);
    if (!t || add_kid(P, t, first))
        return NULL;
    while (is_op(cur(P), ",")) {
        P->pos++;
        jt *c = cur(P);
        if (c->type == T_VAR_END || c->type == T_BLOCK_END || is_op(c, ")") || is_name(c, "in")
            || is_op(c, "="))
            break;
        jnode *k = with_condexpr ? parse_expr(P) : parse_or(P);
        if (!k || add_kid(P, t, k))
            return NULL;
    }
    return t;
}

/* ---- statements ---- */

static int parse_body(parser *P, jnode *body, const char *const *ends);

/* Parses "name" or "a, b" targets into n->names; ns_attr allows "ns.attr" (sets n->a). */
static int parse_targets(parser *P, jnode *n, int ns_attr)
{
    for (;;) {
        if (cur(P)->type != T_NAME) {
            fail(P, "expected a name to assign to");
            return -1;
        }
        if (ns_attr && is_op(peek(P, 1), ".")) {
            jnode *ref = node(P, N_ATTR);
            if (!ref || !(ref->c = node(P, N_NAME)) || !(ref->c->s = tok_str(P, cur(P))))
                return -1;
            P->pos += 2;
            if (cur(P)->type != T_NAME) {
                fail(P, "expected an attribute name");
                return -1;
            }
            if (!(ref->s = tok_str(P, cur(P))))
                return -1;
            P->pos++;
            n->a = ref;
            return 0;
        }
        const char *s = tok_str(P, cur(P));
        if (!s || add_name(P, n, s))
            return -1;
        P->pos++;
        if (!is_op(cur(P), ","))
            return 0;
        P->pos++;
    }
}

static jnode *parse_if(parser *P)
{
    static const char *const ends[] = {"elif", "else", "endif", NULL};
    jnode *n = node(P, N_IF);
    if (!n || !(n->a = parse_tuple(P, 0, 0)) || expect_block_end(P))
        return NULL;
    jnode *body = node(P, N_BODY);
    if (!body || parse_body(P, body, ends))
        return NULL;
    n->b = body;
    if (is_name(cur(P), "elif")) {
        P->pos++;
        /* each elif nests an if in the previous one: count it as a block */
        if (++P->depth > MAX_DEPTH)
            return fail(P, "too many elif branches (nested too deeply)");
        jnode *elif = parse_if(P);
        P->depth--;
        if (!elif)
            return NULL;
        n->c = elif;
        return n;
    }
    if (is_name(cur(P), "else")) {
        P->pos++;
        static const char *const end[] = {"endif", NULL};
        jnode *eb = node(P, N_BODY);
        if (!eb || expect_block_end(P) || parse_body(P, eb, end))
            return NULL;
        n->c = eb;
    }
    P->pos++; /* endif */
    if (expect_block_end(P))
        return NULL;
    return n;
}

static jnode *parse_for(parser *P)
{
    static const char *const ends[] = {"else", "endfor", NULL};
    static const char *const end[] = {"endfor", NULL};
    jnode *n = node(P, N_FOR);
    if (!n || parse_targets(P, n, 0))
        return NULL;
    if (!is_name(cur(P), "in"))
        return fail(P, "expected 'in' in for loop");
    P->pos++;
    if (!(n->a = parse_tuple(P, 0, 0)))
        return NULL;
    if (is_name(cur(P), "if")) {
        P->pos++;
        if (!(n->b = parse_expr(P)))
            return NULL;
    }
    if (is_name(cur(P), "recursive"))
        return fail(P, "unsupported: recursive for loop");
    jnode *body = node(P, N_BODY);
    if (!body || expect_block_end(P) || parse_body(P, body, ends))
        return NULL;
    n->c = body;
    if (is_name(cur(P), "else")) {
        P->pos++;
        jnode *eb = node(P, N_BODY);
        if (!eb || expect_block_end(P) || parse_body(P, eb, end))
            return NULL;
        n->d = eb;
    }
    P->pos++;
    if (expect_block_end(P))
        return NULL;
    return n;
}

static jnode *parse_set(parser *P)
{
    jnode *n = node(P, N_SET);
    if (!n || parse_targets(P, n, 1))
        return NULL;
    if (is_op(cur(P), "=")) {
        P->pos++;
        if (!(n->b = parse_tuple(P, 1, 0)) || expect_block_end(P))
            return NULL;
        return n;
    }
    if (is_op(cur(P), "|"))
        return fail(P, "unsupported: filtered block set");
    static const char *const end[] = {"endset", NULL};
    n->type = N_SETBLOCK;
    jnode *body = node(P, N_BODY);
    if (!body || expect_block_end(P) || parse_body(P, body, end))
        return NULL;
    n->b = body;
    P->pos++;
    if (expect_block_end(P))
        return NULL;
    return n;
}

static jnode *parse_macro(parser *P)
{
    static const char *const end[] = {"endmacro", NULL};
    jnode *n = node(P, N_MACRO);
    if (!n)
        return NULL;
    if (cur(P)->type != T_NAME)
        return fail(P, "expected macro name");
    if (!(n->s = tok_str(P, cur(P))))
        return NULL;
    P->pos++;
    if (expect_op(P, "("))
        return NULL;
    while (!is_op(cur(P), ")")) {
        if (n->nnames && expect_op(P, ","))
            return NULL;
        if (cur(P)->type != T_NAME)
            return fail(P, "expected a parameter name");
        const char *pn = tok_str(P, cur(P));
        if (!pn || add_name(P, n, pn))
            return NULL;
        P->pos++;
        jnode *def = NULL;
        if (is_op(cur(P), "=")) {
            P->pos++;
            if (!(def = parse_expr(P)))
                return NULL;
        } else if (n->nkids2 && n->kids2[n->nkids2 - 1]) {
            return fail(P, "non-default parameter after a default one");
        }
        if (add_kid2(P, n, def))
            return NULL;
    }
    P->pos++;
    jnode *body = node(P, N_BODY);
    if (!body || expect_block_end(P) || parse_body(P, body, end))
        return NULL;
    n->b = body;
    P->pos++;
    if (cur(P)->type == T_NAME)
        P->pos++; /* {% endmacro name %} */
    if (expect_block_end(P))
        return NULL;
    return n;
}

/* After "{%": one statement. */
static jnode *parse_statement(parser *P)
{
    jt *t = cur(P);
    if (t->type != T_NAME)
        return fail(P, "expected a tag name after '{%%'");
    P->pos++;
    if (is_name(t, "if"))
        return parse_if(P);
    if (is_name(t, "for"))
        return parse_for(P);
    if (is_name(t, "set"))
        return parse_set(P);
    if (is_name(t, "macro"))
        return parse_macro(P);
    if (is_name(t, "break") || is_name(t, "continue")) {
        jnode *n = node(P, is_name(t, "break") ? N_BREAK : N_CONTINUE);
        if (!n || expect_block_end(P))
            return NULL;
        return n;
    }
    if (is_name(t, "generation")) {
        /* transformers' AssistantTracker: renders its body unchanged. */
        static const char *const end[] = {"endgeneration", NULL};
        jnode *body = node(P, N_BODY);
        if (!body || expect_block_end(P) || parse_body(P, body, end))
            return NULL;
        P->pos++;
        if (expect_block_end(P))
            return NULL;
        return body;
    }
    P->pos--;
    return fail(P, "unsupported tag '%.*s'", (int)t->n, t->s);
}

static int is_end(jt *t, const char *const *ends)
{
    for (int i = 0; ends && ends[i]; i++)
        if (is_name(t, ends[i]))
            return 1;
    return 0;
}

/* Parses statements into body until EOF (ends NULL) or a block starting with one of ends;
 * leaves the position on that end name. */
static int parse_body(parser *P, jnode *body, const char *const *ends)
{
    if (P->depth + 1 > MAX_DEPTH) {
        fail(P, "blocks nested too deeply");
        return -1;
    }
    for (;;) {
        jt *t = cur(P);
        jnode *n = NULL;
        if (t->type == T_EOF) {
            if (ends) {
                fail(P, "unexpected end of template, expected '%s'", ends[0]);
                return -1;
            }
            return 0;
        }
        if (t->type == T_TEXT) {
            if (!(n = node(P, N_TEXT)))
                return -1;
            n->s = t->s;
            n->slen = t->n;
            P->pos++;
        } else if (t->type == T_VAR_BEGIN) {
            P->pos++;
            if (!(n = node(P, N_EMIT)) || !(n->a = parse_tuple(P, 1, 0)))
                return -1;
            if (cur(P)->type != T_VAR_END) {
                fail(P, "expected end of print statement");
                return -1;
            }
            P->pos++;
        } else if (t->type == T_BLOCK_BEGIN) {
            P->pos++;
            if (is_end(cur(P), ends))
                return 0;
            P->depth++;
            n = parse_statement(P);
            P->depth--;
            if (!n)
                return -1;
        } else {
            fail(P, "unexpected token");
            return -1;
        }
        if (add_kid(P, body, n))
            return -1;
    }
}

/* ---- tree height ---- */

/* Child i of n (a, b, c, d, kids, kids2); NULL for an absent one, end past the last. */
static jnode *child(const jnode *n, int i, jnode *end)
{
    if (i < 4)
        return i == 0 ? n->a : i == 1 ? n->b : i == 2 ? n->c : n->d;
    i -= 4;
    if (i < n->nkids)
        return n->kids[i];
    i -= n->nkids;
    return i < n->nkids2 ? n->kids2[i] : end;
}

/* Sets every node's height, bottom up with an explicit stack (a recursive walk would
 * overflow on the very trees this refuses); -1 past MAX_HEIGHT. Each node is done once,
 * though a chained comparison shares its middle operands. */
static int check_height(parser *P, jnode *root)
{
    typedef struct {
        jnode *n;
        int next, max;
    } item;
    jnode end;
    size_t cap = 64, top = 0;
    item *st = malloc(cap * sizeof *st);
    if (!st) {
        fail(P, "out of memory");
        return -1;
    }
    st[top++] = (item){root, 0, 0};
    while (top) {
        item *it = &st[top - 1];
        jnode *k = child(it->n, it->next++, &end);
        if (k == &end) {
            it->n->height = it->max + 1;
            if (it->n->height > MAX_HEIGHT) {
                snprintf(P->err, P->errlen, "line %d: expression or blocks nested too deeply",
                         it->n->line);
                P->failed = 1;
                break;
            }
            top--;
            continue;
        }
        if (!k)
            continue;
        if (k->height) {
            if (k->height > it->max)
                it->max = k->height;
            continue;
        }
        it->next--; /* come back to k once it is done */
        if (top == cap) {
            item *q = realloc(st, 2 * cap * sizeof *st);
            if (!q) {
                fail(P, "out of memory");
                break;
            }
            st = q;
            cap *= 2;
        }
        st[top++] = (item){k, 0, 0};
    }
    free(st);
    return P->failed ? -1 : 0;
}

/* ---- content-format detection (vLLM's "openai" vs "string") ---- */

static int is_content_access(const jnode *e)
{
    while (e && e->type == N_FILTER)
        e = e->a;
    if (!e)
        return 0;
    if (e->type == N_ATTR)
        return !strcmp(e->s, "content");
    if (e->type == N_ITEM && e->b && e->b->type == N_LIT && e->b->lit.kind == JV_STR)
        return jv_is_str(e->b->lit, "content");
    return 0;
}

/* Names assigned from a content access, e.g. {% set content = message['content'] %}. */
static void walk_content(const jnode *n, const char **vars, int *nvars, int *hit)
{
    if (!n)
        return;
    if (n->type == N_SET && n->nnames == 1 && is_content_access(n->b) && *nvars < 16)
        vars[(*nvars)++] = n->names[0];
    if (n->type == N_FOR) {
        const jnode *it = n->a;
        while (it && it->type == N_FILTER)
            it = it->a;
        if (is_content_access(it))
            *hit = 1;
        if (it && it->type == N_NAME)
            for (int i = 0; i < *nvars; i++)
                if (!strcmp(vars[i], it->s))
                    *hit = 1;
    }
    const jnode *subs[] = {n->b, n->c, n->d};
    for (int i = 0; i < 3; i++)
        if (subs[i] && subs[i]->type >= N_TEXT)
            walk_content(subs[i], vars, nvars, hit);
    for (int i = 0; i < n->nkids; i++)
        if (n->kids[i]->type >= N_TEXT)
            walk_content(n->kids[i], vars, nvars, hit);
}

jj_template *jj_parse(const char *src, size_t len, char *err, size_t errlen)
{
    jj_template *t = calloc(1, sizeof *t);
    if (!t) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    /* jinja2 reads templates as str: bytes that are not UTF-8 never reach it, and the
     * string code here (case mapping, slicing by code point) assumes they do not. */
    if (!kv_utf8_valid((const uint8_t *)src, len)) {
        int line = 1;
        size_t i = 0;
        while (i < len) {
            uint32_t cp;
            size_t k = kv_utf8_next((const uint8_t *)src + i, len - i, &cp);
            if (cp == 0xFFFD && (k != 3 || memcmp(src + i, "\xEF\xBF\xBD", 3)))
                break;
            line += src[i] == '\n';
            i += k;
        }
        snprintf(err, errlen, "line %d: template is not valid UTF-8", line);
        jj_template_free(t);
        return NULL;
    }
    if (jj_lex(src, len, &t->toks, err, errlen)) {
        jj_template_free(t);
        return NULL;
    }
    parser P = {.t = t, .err = err, .errlen = errlen};
    t->root = node(&P, N_BODY);
    if (!t->root || parse_body(&P, t->root, NULL) || check_height(&P, t->root)) {
        jj_template_free(t);
        return NULL;
    }
    const char *vars[16];
    int nvars = 0;
    walk_content(t->root, vars, &nvars, &t->iterates_content);
    return t;
}

void jj_template_free(jj_template *t)
{
    if (!t)
        return;
    for (size_t i = 0; i < t->nnodes; i++)
        free(t->nodes[i]);
    for (size_t i = 0; i < t->nblocks; i++)
        free(t->blocks[i]);
    free(t->nodes);
    free(t->blocks);
    jj_lex_free(&t->toks);
    free(t);
}

const jnode *jj_template_root(const jj_template *t)
{
    return t->root;
}
int jj_template_iterates_content(const jj_template *t)
{
    return t->iterates_content;
}
