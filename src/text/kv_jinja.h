/*
 * A small Jinja interpreter for chat templates: the subset that HF chat
 * templates use, with the semantics of jinja2's ImmutableSandboxedEnvironment
 * as transformers configures it (trim_blocks, lstrip_blocks, loopcontrols,
 * Python str/repr/json formatting). Internal to the chat renderer (kv_chat*.c)
 * and kv_anthropic.c, which builds its chat requests from these values.
 *
 *   kv_jinja_lex.c     template text -> tokens (whitespace control here)
 *   kv_jinja_parse.c   tokens -> AST; refuses constructs outside the subset
 *   kv_jinja_value.c   values, per-render arena, str()/repr()/json
 *   kv_jinja_eval.c    AST walker: statements, expressions, scopes
 *   kv_jinja_text.c    Python str semantics (case, strip, split, ...)
 *   kv_jinja_filter.c  filters
 *   kv_jinja_builtin.c tests, methods, global functions
 *
 * Values live in a per-render arena, so a render shares nothing mutable
 * with another render of the same template (thread safety) and frees
 * everything at once.
 */
#ifndef KV_JINJA_H
#define KV_JINJA_H

#include <stddef.h>
#include <stdint.h>
#include <jansson.h>

/* ---- arena ---------------------------------------------------------- */

/* A render that prints more than this is a broken template, not a prompt. */
#define JJ_MAX_OUTPUT ((size_t)256 << 20)
/*
 * The most a render's arena holds (input values included). Nothing is freed before the
 * render ends, so without a bound a template concatenating in a loop held O(N^2) bytes
 * for a request of N (960 KB -> 2.7 GB). Twice the output cap: room for the input and an
 * output's worth of strings under construction; past it the render fails (and the
 * request routes by load).
 */
#define JJ_ARENA_MAX (2 * JJ_MAX_OUTPUT)
/* Strings that grow by concatenation tracked at once (see jv_str_append). */
#define JJ_GROW_SLOTS 4

typedef struct jj_chunk jj_chunk;
typedef struct {
    jj_chunk *head;  /* small allocations bump here */
    jj_chunk *big;   /* chunks of growing strings (never bumped into) */
    jj_chunk *grow[JJ_GROW_SLOTS]; /* the last strings that may grow in place */
    unsigned grow_next;
    size_t total;    /* bytes malloc'ed, at most JJ_ARENA_MAX */
    int failed;      /* JJ_ARENA_OVER or JJ_ARENA_OOM: every later allocation fails too */
} jj_arena;

enum { JJ_ARENA_OVER = 1, JJ_ARENA_OOM = 2 };

/* NULL once the arena would pass JJ_ARENA_MAX, or out of memory (then a->failed). */
void *jj_alloc(jj_arena *a, size_t n);
void jj_arena_free(jj_arena *a);

/* ---- values --------------------------------------------------------- */

typedef enum {
    JV_UNDEF,
    JV_NONE,
    JV_BOOL,
    JV_INT,
    JV_FLOAT,
    JV_STR,
    JV_LIST, /* also tuples (flag in jj_list) */
    JV_DICT,
    JV_NS,     /* namespace(): a dict whose attributes may be set */
    JV_LOOP,   /* the `loop` variable of a for loop */
    JV_FUNC,   /* a global function (builtin id) */
    JV_METHOD, /* a bound method: self + name */
    JV_MACRO,
    JV_BIGINT, /* an integer past 64 bits, as Python's int keeps it: its digits in str */
} jj_value_kind;

typedef struct jj_value jj_value;
typedef struct jj_list jj_list;
typedef struct jj_dict jj_dict;
typedef struct jj_loop jj_loop;
typedef struct jj_method jj_method;
typedef struct jj_closure jj_closure; /* a macro and the scope it was defined in (eval) */
struct jnode;

struct jj_value {
    jj_value_kind kind;
    union {
        int64_t i; /* BOOL, INT, FUNC id */
        double f;
        struct {
            const char *s;
            size_t n;
        } str; /* STR; UNDEF: its name; BIGINT: its decimal digits */
        jj_list *list;
        jj_dict *dict; /* DICT, NS */
        jj_loop *loop;
        jj_method *method;
        const jj_closure *macro;
    } u;
};

struct jj_list {
    size_t n, cap;
    jj_value *items;
    int tuple;
};

/*
 * Keys in insertion order, as Python's dict. Past DICT_INDEX_MIN keys, lookups go
 * through a hash index (in the arena the dict was made in) so that building or
 * comparing an N-key dict is O(N), not O(N^2): requests choose N. Callers may
 * append to keys/vals directly (n++); the index catches up on the next lookup.
 */
struct jj_dict {
    size_t n, cap;
    jj_value *keys, *vals;
    jj_arena *a;   /* the arena of the index; NULL: lookups scan */
    uint32_t *idx; /* open addressing: 1 + the position of a key, 0 empty */
    size_t idx_cap; /* a power of two, over twice nidx */
    size_t nidx;    /* keys[0..nidx) are indexed */
};

struct jj_loop {
    size_t index0, length;
    const jj_value *items; /* the (filtered) sequence, for previtem/nextitem */
};

struct jj_method {
    jj_value self;
    const char *name;
};

jj_value jv_undef(const char *name);
jj_value jv_none(void);
jj_value jv_bool(int b);
jj_value jv_int(int64_t i);
jj_value jv_float(double f);
jj_value jv_strn(const char *s, size_t n);
/* An integer outside int64 by its decimal digits ([-]d+, no leading zero): printed
 * exactly, compared by value; arithmetic on it fails. */
jj_value jv_bigint(const char *digits, size_t n);
/* x + y[0..yn) in the arena: in place when x is the whole of a string that grew this way
 * before, so that s = s + t in a loop costs O(len) overall, not O(len^2). An undefined
 * value when the arena fails. (x's bytes stay, but not its terminating NUL.) */
jj_value jv_str_append(jj_arena *a, jj_value x, const char *y, size_t yn);
jj_value jv_cstr(const char *s);
jj_value jv_new_list(jj_arena *a, size_t cap);
jj_value jv_new_dict(jj_arena *a, size_t cap);
void jv_list_push(jj_arena *a, jj_value list, jj_value item);
void jv_dict_set(jj_arena *a, jj_value dict, jj_value key, jj_value val);
/* jv_dict_set, -1 when out of memory. */
int jv_dict_put(jj_arena *a, jj_value dict, jj_value key, jj_value val);
/* Empties a dict, keeping its storage (a loop's frame, each iteration). */
void jv_dict_clear(jj_dict *d);
const jj_value *jv_dict_get(jj_value dict, const char *key, size_t n);
const jj_value *jv_dict_find(jj_value dict, jj_value key);

jj_value jv_from_json(jj_arena *a, const json_t *j);
int jv_truthy(jj_value v);
int jv_equal(jj_value a, jj_value b);
int jv_is_str(jj_value v, const char *s);
const char *jv_type_name(jj_value v);

/* Growable output buffer (malloc'ed; not in the arena: it is returned). */
typedef struct {
    char *p;
    size_t n, cap;
    int oom;
} jj_buf;

void jj_buf_put(jj_buf *b, const char *s, size_t n);
void jj_buf_putc(jj_buf *b, char c);
void jj_buf_puts(jj_buf *b, const char *s);

/* Python str(v) and repr(v) appended to b; 0, or -1 for an unsupported value. */
int jv_write_str(jj_buf *b, jj_value v);
int jv_write_repr(jj_buf *b, jj_value v);
/* json.dumps(v, ensure_ascii=False, indent, separators); -1 if not serialisable. */
int jv_write_json(jj_buf *b, jj_value v, int indent, const char *item_sep, const char *key_sep,
                  int sort_keys, int level);
void jv_write_float(jj_buf *b, double f);
/* str(v) as an arena string. */
jj_value jv_to_str(jj_arena *a, jj_value v, int *ok);

/* ---- tokens and AST ------------------------------------------------- */

typedef enum {
    /* expressions */
    N_LIT,
    N_NAME,
    N_ATTR,
    N_ITEM,
    N_SLICE,
    N_CALL,
    N_FILTER,
    N_TEST,
    N_BIN,
    N_NOT,
    N_NEG,
    N_POS,
    N_AND,
    N_OR,
    N_CMP,
    N_COND,
    N_LISTLIT,
    N_TUPLELIT,
    N_DICTLIT,
    N_CONCAT,
    /* statements */
    N_TEXT,
    N_EMIT,
    N_BODY,
    N_IF,
    N_FOR,
    N_SET,
    N_SETBLOCK,
    N_MACRO,
    N_BREAK,
    N_CONTINUE,
} jn_type;

typedef struct jnode {
    jn_type type;
    int line;
    int op;        /* N_BIN/N_CMP operator, N_TEST negation */
    const char *s; /* name, attribute, filter/test name, text */
    size_t slen;
    jj_value lit;            /* N_LIT */
    struct jnode *a, *b, *c; /* operands; N_SLICE: a[b:c:d] uses d too */
    struct jnode *d;
    struct jnode **kids; /* args, body, items, list-literal elements */
    int nkids;
    struct jnode **kids2; /* kwarg values, else body, dict values */
    int nkids2;
    const char **names; /* kwarg names, loop/set targets, macro params */
    int nnames;
    int height; /* levels of nodes from here down (the evaluator's recursion); parse time */
} jnode;

/* Binary operators (op field). */
enum {
    OP_ADD = 1,
    OP_SUB,
    OP_MUL,
    OP_DIV,
    OP_FLOORDIV,
    OP_MOD,
    OP_POW,
    OP_EQ,
    OP_NE,
    OP_LT,
    OP_LE,
    OP_GT,
    OP_GE,
    OP_IN,
    OP_NOTIN
};

typedef struct jj_template jj_template;

/* Parses source; NULL with "line N: ..." in err for anything outside the subset. */
jj_template *jj_parse(const char *src, size_t len, char *err, size_t errlen);
void jj_template_free(jj_template *t);
const jnode *jj_template_root(const jj_template *t);
/* Whether some {% for %} iterates over a message's content (vLLM's "openai" format). */
int jj_template_iterates_content(const jj_template *t);

/* Lexer (used by the parser). */
typedef enum {
    T_EOF,
    T_TEXT,
    T_VAR_BEGIN,
    T_VAR_END,
    T_BLOCK_BEGIN,
    T_BLOCK_END,
    T_NAME,
    T_STRING,
    T_INT,
    T_FLOAT,
    T_OP,
} jt_type;

typedef struct {
    jt_type type;
    int line;
    const char *s; /* NAME/OP: points into source; STRING/TEXT: decoded, malloc'ed */
    size_t n;
    int64_t i;
    double f;
} jt;

typedef struct {
    jt *toks;
    size_t n, cap;
    char **owned; /* decoded strings to free */
    size_t nowned, capowned;
} jt_list;

int jj_lex(const char *src, size_t len, jt_list *out, char *err, size_t errlen);
void jj_lex_free(jt_list *l);

/* ---- evaluation ----------------------------------------------------- */

typedef struct {
    const char *name;
    jj_value value;
} jj_var;

/*
 * Renders t with the given globals. now: seconds since the epoch for
 * strftime_now (local time, as datetime.now()). Returns 0 and the text in
 * out, or -1 with the reason in err.
 */
int jj_render(const jj_template *t, jj_arena *a, const jj_var *vars, size_t nvars, long long now,
              jj_buf *out, char *err, size_t errlen);

/*
 * Builtins, each named once: X(ID, "name"). The parser refuses a name not
 * in its table; the evaluator looks the name up and switches on the id.
 */
/* clang-format off */
#define JJ_FILTERS(X) \
    X(TOJSON, "tojson") X(TRIM, "trim") X(LENGTH, "length") X(COUNT, "count") \
    X(UPPER, "upper") X(LOWER, "lower") X(CAPITALIZE, "capitalize") X(TITLE, "title") \
    X(REPLACE, "replace") X(DEFAULT, "default") X(D, "d") X(FIRST, "first") X(LAST, "last") \
    X(JOIN, "join") X(LIST, "list") X(ITEMS, "items") X(SELECTATTR, "selectattr") \
    X(REJECTATTR, "rejectattr") X(MAP, "map") X(SELECT, "select") X(REJECT, "reject") \
    X(STRING, "string") X(INT, "int") X(FLOAT, "float") X(ABS, "abs") X(REVERSE, "reverse") \
    X(SAFE, "safe") X(UNIQUE, "unique") X(DICTSORT, "dictsort") X(SORT, "sort") \
    X(INDENT, "indent") X(ESCAPE, "escape") X(E, "e") X(SUM, "sum") X(MIN, "min") \
    X(MAX, "max")

#define JJ_TESTS(X) \
    X(DEFINED, "defined") X(UNDEFINED, "undefined") X(NONE, "none") X(BOOLEAN, "boolean") \
    X(TRUE, "true") X(FALSE, "false") X(INTEGER, "integer") X(FLOAT, "float") \
    X(NUMBER, "number") X(STRING, "string") X(MAPPING, "mapping") X(ITERABLE, "iterable") \
    X(SEQUENCE, "sequence") X(CALLABLE, "callable") X(SAMEAS, "sameas") X(EQ, "eq") \
    X(EQUALTO, "equalto") X(EQ_OP, "==") X(NE, "ne") X(NE_OP, "!=") X(LT, "lt") X(GT, "gt") \
    X(LE, "le") X(GE, "ge") X(IN, "in") X(ODD, "odd") X(EVEN, "even") \
    X(DIVISIBLEBY, "divisibleby") X(LOWER, "lower") X(UPPER, "upper")

/* Python str/dict/list methods; the mutating ones are named so that they
 * fail as ImmutableSandboxedEnvironment makes them fail. */
#define JJ_METHODS(X) \
    X(STRIP, "strip") X(LSTRIP, "lstrip") X(RSTRIP, "rstrip") X(STARTSWITH, "startswith") \
    X(ENDSWITH, "endswith") X(SPLIT, "split") X(RSPLIT, "rsplit") X(TITLE, "title") \
    X(UPPER, "upper") X(LOWER, "lower") X(REPLACE, "replace") X(CAPITALIZE, "capitalize") \
    X(FIND, "find") X(RFIND, "rfind") X(COUNT, "count") X(JOIN, "join") X(GET, "get") \
    X(ITEMS, "items") X(KEYS, "keys") X(VALUES, "values") X(APPEND, "append") \
    X(EXTEND, "extend") X(INSERT, "insert") X(POP, "pop") X(REMOVE, "remove") \
    X(UPDATE, "update") X(SETDEFAULT, "setdefault") X(CLEAR, "clear") X(INDEX, "index") \
    X(ISDIGIT, "isdigit") X(ISSPACE, "isspace") X(ISALPHA, "isalpha") X(ISALNUM, "isalnum") \
    X(CYCLE, "cycle")

/* The globals transformers provides to chat templates. */
#define JJ_FUNCS(X) \
    X(RANGE, "range") X(NAMESPACE, "namespace") X(DICT, "dict") \
    X(RAISE_EXCEPTION, "raise_exception") X(STRFTIME_NOW, "strftime_now")

#define JJ_FILTER_ENUM(id, name) JJ_FILTER_##id,
#define JJ_TEST_ENUM(id, name)   JJ_TEST_##id,
#define JJ_METHOD_ENUM(id, name) JJ_METHOD_##id,
#define JJ_FUNC_ENUM(id, name)   JJ_FUNC_##id,
#define JJ_NAME(id, name)        name,

typedef enum { JJ_FILTERS(JJ_FILTER_ENUM) JJ_FILTER_N } jj_filter_id;
typedef enum { JJ_TESTS(JJ_TEST_ENUM) JJ_TEST_N } jj_test_id;
typedef enum { JJ_METHODS(JJ_METHOD_ENUM) JJ_METHOD_N } jj_method_id;
typedef enum { JJ_FUNCS(JJ_FUNC_ENUM) JJ_FUNC_N } jj_func_id_t;
/* clang-format on */

/* The id of name in a builtin table, or -1. */
int jj_filter_lookup(const char *name);
int jj_test_lookup(const char *name);
int jj_method_lookup(const char *name);
int jj_func_lookup(const char *name);
extern const char *const jj_filter_names[JJ_FILTER_N];
extern const char *const jj_func_names[JJ_FUNC_N];

/* Builtins (kv_jinja_filter.c, kv_jinja_builtin.c). */
typedef struct jj_ctx jj_ctx;
int jj_call_filter(jj_ctx *c, const char *name, jj_value v, const jj_value *args, int nargs,
                   const char **kwn, const jj_value *kwv, int nkw, jj_value *out);
int jj_call_test(jj_ctx *c, const char *name, jj_value v, const jj_value *args, int nargs,
                 int *out);
int jj_call_method(jj_ctx *c, jj_method *m, const jj_value *args, int nargs, const char **kwn,
                   const jj_value *kwv, int nkw, jj_value *out);
int jj_call_func(jj_ctx *c, int id, const jj_value *args, int nargs, const char **kwn,
                 const jj_value *kwv, int nkw, jj_value *out);

/* Argument pos (positional) or name (keyword) of a call; NULL if absent. */
const jj_value *jj_arg(const jj_value *args, int nargs, const char **kwn, const jj_value *kwv,
                       int nkw, int pos, const char *name);
#define ARG(pos, name) jj_arg(args, nargs, kwn, kwv, nkw, pos, name)

/* Python str operations (kv_jinja_text.c); strings live in the render's arena. */
int jj_need_str(jj_ctx *c, jj_value v, const char *what);
jj_value jj_strdup(jj_ctx *c, const char *s, size_t n);
int jj_str(jj_ctx *c, jj_value v, jj_value *out); /* str(v) */
int jj_py_space(unsigned cp);                     /* str.isspace() */
typedef enum {
    JJ_CASE_UPPER,
    JJ_CASE_LOWER,
    JJ_CASE_CAPITALIZE, /* first character upper, the rest lower */
    JJ_CASE_TITLE,      /* Python's str.title(): after any uncased character */
    JJ_CASE_JINJA_TITLE /* jinja's title filter: after spaces and brackets */
} jj_case;
jj_value jj_map_case(jj_ctx *c, jj_value s, jj_case mode);
/* Whether s has a cased character (one that jj_map_case maps). */
int jj_has_cased(jj_value s);
typedef enum {
    JJ_STRIP_LEFT = 1,
    JJ_STRIP_RIGHT = 2,
    JJ_STRIP_BOTH = 3
} jj_strip_side;
jj_value jj_strip(jj_value s, const jj_value *chars, jj_strip_side side);
size_t jj_cp_len(jj_value s);
jj_value jj_replace(jj_ctx *c, jj_value s, jj_value old, jj_value new, int64_t count);
int jj_split(jj_ctx *c, jj_value s, const jj_value *sep, int64_t maxsplit, int right,
             jj_value *out);
int jj_affix(jj_ctx *c, jj_value s, jj_value x, int end, int *res); /* startswith / endswith */
jj_value jj_items(jj_ctx *c, jj_value dict); /* list of (key, value) tuples */

/* Shared by eval and builtins. */
jj_arena *jj_ctx_arena(jj_ctx *c);
int jj_fail(jj_ctx *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* jj_fail for a failed allocation: the arena's cap, or out of memory. */
int jj_oom(jj_ctx *c);
long long jj_ctx_now(jj_ctx *c);
int jj_failed(jj_ctx *c);
jj_value jj_getattr(jj_ctx *c, jj_value obj, const char *name, size_t n);
jj_value jj_getitem(jj_ctx *c, jj_value obj, jj_value key);
/* Python's ordering (<) of two values: *cmp < 0, 0, > 0; -1 if they do not compare. */
int jj_order(jj_ctx *c, jj_value a, jj_value b, int *cmp);
/* Iterates a value as Python's iter() would: fills items/n (arena); -1 if not iterable. */
int jj_iterate(jj_ctx *c, jj_value v, const jj_value **items, size_t *n);

#endif
