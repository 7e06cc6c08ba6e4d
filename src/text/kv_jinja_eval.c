/*
 * Jinja evaluator: walks the AST with jinja2's semantics.
 *
 * Scopes: a chain of frames (globals <- template <- for-iteration/macro).
 * As in jinja2, every loop iteration gets a fresh frame (a {% set %} in a
 * loop body does not survive the iteration; namespace() is the way out),
 * {% if %} is not a scope, and a macro closes over the frame it is defined
 * in (a loop's, a macro's or the template's), reading it when called.
 * Frames a macro can be defined in live in the render's arena, so a macro
 * kept past its loop or macro call still has its scope to read.
 *
 * Undefined follows jinja2's default Undefined: prints as "", is falsy,
 * iterates as empty, compares unequal to defined values; attribute or item
 * access on it, arithmetic with it and calling it are errors.
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_jinja.h"

/* A render that loops this often is a broken template, not a prompt. */
#define MAX_STEPS (10u * 1000 * 1000)
#define MAX_OUTPUT JJ_MAX_OUTPUT
/* Levels of evaluator recursion (expressions and statements, through macro calls): the
 * parser bounds one template's height, but nested macro calls stack it. At a few hundred
 * bytes of C stack a level (a few KB under ASan) this stays within a thread's stack. */
#define MAX_NEST 1024

typedef struct frame frame;
struct frame {
    frame *parent;
    jj_dict vars; /* a dict, hashed once large: the globals hold every chat_template_kwargs key */
};

/* A new frame under parent, its dict in the render's arena. */
#define FRAME(c, up) {.parent = (up), .vars = {.a = (c)->a}}

struct jj_closure {
    const jnode *node; /* the N_MACRO */
    frame *scope;      /* where it was defined */
};

struct jj_ctx {
    jj_arena *a;
    jj_buf *out;
    char *err;
    size_t errlen;
    int failed;
    int brk, cont;  /* pending {% break %} / {% continue %} */
    int depth;      /* macro call depth */
    int nest;       /* eval_expr/exec_node recursion depth */
    uint64_t steps; /* loop iterations and macro calls so far: bounds a render */
    long long now;
};

jj_arena *jj_ctx_arena(jj_ctx *c)
{
    return c->a;
}
long long jj_ctx_now(jj_ctx *c)
{
    return c->now;
}
int jj_failed(jj_ctx *c)
{
    return c->failed;
}

int jj_fail(jj_ctx *c, const char *fmt, ...)
{
    if (c->failed)
        return -1;
    c->failed = 1;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, c->errlen, fmt, ap);
    va_end(ap);
    return -1;
}

int jj_oom(jj_ctx *c)
{
    if (c->a->failed == JJ_ARENA_OVER)
        return jj_fail(c, "template needs too much memory (more than %zu MiB)",
                       (size_t)JJ_ARENA_MAX >> 20);
    return jj_fail(c, "out of memory");
}

static int undefined_error(jj_ctx *c, jj_value u)
{
    if (u.u.str.s)
        return jj_fail(c, "'%.*s' is undefined", (int)u.u.str.n, u.u.str.s);
    return jj_fail(c, "a value is undefined");
}

/* ---- frames ---- */

static jj_value frame_dict(frame *f)
{
    jj_value d = {.kind = JV_DICT};
    d.u.dict = &f->vars;
    return d;
}

static const jj_value *lookup(frame *f, const char *name)
{
    size_t n = strlen(name);
    for (; f; f = f->parent) {
        const jj_value *v = jv_dict_get(frame_dict(f), name, n);
        if (v)
            return v;
    }
    return NULL;
}

static int frame_set(jj_ctx *c, frame *f, const char *name, jj_value v)
{
    if (jv_dict_put(c->a, frame_dict(f), jv_cstr(name), v))
        return jj_oom(c);
    return 0;
}

/* A frame in the arena (one a macro may close over); NULL after jj_oom. */
static frame *new_frame(jj_ctx *c, frame *up)
{
    frame *f = jj_alloc(c->a, sizeof *f);
    if (!f) {
        jj_oom(c);
        return NULL;
    }
    *f = (frame)FRAME(c, up);
    return f;
}

static int eval_expr_at(jj_ctx *c, frame *f, const jnode *n, jj_value *out);
static int exec_node_at(jj_ctx *c, frame *f, const jnode *n);

static int too_deep(jj_ctx *c)
{
    return jj_fail(c, "template nested too deeply (more than %d levels of evaluation)", MAX_NEST);
}

/* Every recursion of the evaluator goes through these two, which bound it. */
static int eval_expr(jj_ctx *c, frame *f, const jnode *n, jj_value *out)
{
    if (c->nest >= MAX_NEST)
        return too_deep(c);
    c->nest++;
    int rc = eval_expr_at(c, f, n, out);
    c->nest--;
    /* an allocation that failed on the way (a list push, say) fails the render here */
    return rc || !c->a->failed ? rc : jj_oom(c);
}

static int exec_node(jj_ctx *c, frame *f, const jnode *n)
{
    if (c->nest >= MAX_NEST)
        return too_deep(c);
    c->nest++;
    int rc = exec_node_at(c, f, n);
    c->nest--;
    return rc || !c->a->failed ? rc : jj_oom(c);
}

/* ---- attribute and item access ---- */

static jj_value make_method(jj_ctx *c, jj_value self, const char *name)
{
    jj_method *m = jj_alloc(c->a, sizeof *m);
    if (!m)
        return jv_undef(NULL);
    m->self = self;
    m->name = name;
    jj_value v = {.kind = JV_METHOD};
    v.u.method = m;
    return v;
}

static int is_method_of(jj_value obj, const char *name)
{
    static const char *const str_m[] = {
        "strip",   "lstrip",  "rstrip",  "startswith", "endswith", "split", "rsplit", "title",
        "upper",   "lower",   "replace", "capitalize", "find",     "count", "join",   "splitlines",
        "isdigit", "isspace", "isalpha", "isalnum",    "format",   "index", "rfind",  NULL};
    static const char *const dict_m[] = {"get",        "items", "keys", "values",  "pop", "update",
                                         "setdefault", "clear", "copy", "popitem", NULL};
    static const char *const list_m[] = {"append", "extend", "insert", "pop",   "remove", "reverse",
                                         "sort",   "clear",  "index",  "count", "copy",   NULL};
    const char *const *m = obj.kind == JV_STR                          ? str_m
                           : obj.kind == JV_DICT                       ? dict_m
                           : obj.kind == JV_LIST && !obj.u.list->tuple ? list_m
                                                                       : NULL;
    for (int i = 0; m && m[i]; i++)
        if (!strcmp(m[i], name))
            return 1;
    return 0;
}

static jj_value make_method(jj_ctx *c, jj_value self, const char *name);

static jj_value loop_attr(jj_ctx *c, jj_value lv, const char *name)
{
    jj_loop *l = lv.u.loop;
    if (!strcmp(name, "cycle"))
        return make_method(c, lv, "cycle");
    if (!strcmp(name, "index"))
        return jv_int((int64_t)l->index0 + 1);
    if (!strcmp(name, "index0"))
        return jv_int((int64_t)l->index0);
    if (!strcmp(name, "first"))
        return jv_bool(l->index0 == 0);
    if (!strcmp(name, "last"))
        return jv_bool(l->index0 + 1 == l->length);
    if (!strcmp(name, "length"))
        return jv_int((int64_t)l->length);
    if (!strcmp(name, "revindex"))
        return jv_int((int64_t)(l->length - l->index0));
    if (!strcmp(name, "revindex0"))
        return jv_int((int64_t)(l->length - l->index0 - 1));
    if (!strcmp(name, "depth"))
        return jv_int(1);
    if (!strcmp(name, "depth0"))
        return jv_int(0);
    if (!strcmp(name, "previtem"))
        return l->index0 ? l->items[l->index0 - 1] : jv_undef("previtem");
    if (!strcmp(name, "nextitem"))
        return l->index0 + 1 < l->length ? l->items[l->index0 + 1] : jv_undef("nextitem");
    return jv_undef(name);
}

jj_value jj_getattr(jj_ctx *c, jj_value obj, const char *name, size_t n)
{
    if (obj.kind == JV_UNDEF) {
        undefined_error(c, obj);
        return obj;
    }
    if (obj.kind == JV_LOOP)
        return loop_attr(c, obj, name);
    /* Python getattr first (methods win over keys), then the item. */
    if (is_method_of(obj, name))
        return make_method(c, obj, name);
    if (obj.kind == JV_DICT || obj.kind == JV_NS) {
        const jj_value *v = jv_dict_get(obj, name, n);
        if (v)
            return *v;
    }
    return jv_undef(name);
}

/* Byte offsets of each code point of s (plus the end), in the arena. */
static size_t *cp_offsets(jj_ctx *c, const char *s, size_t n, size_t *count)
{
    size_t *off = jj_alloc(c->a, (n + 1) * sizeof *off);
    size_t k = 0;
    if (!off)
        return NULL;
    for (size_t i = 0; i < n; i++)
        if (((unsigned char)s[i] & 0xC0) != 0x80)
            off[k++] = i;
    off[k] = n;
    *count = k;
    return off;
}

/* Byte offset of code point k of s[0..n), n past the end: s[i] or s[a:b] need no table of
 * every offset (which cost 8 bytes a byte of the string, each time, in the arena). */
static size_t cp_at(const char *s, size_t n, uint64_t k)
{
    for (size_t i = 0; i < n; i++)
        if (((unsigned char)s[i] & 0xC0) != 0x80 && k-- == 0)
            return i;
    return n;
}

jj_value jj_getitem(jj_ctx *c, jj_value obj, jj_value key)
{
    if (obj.kind == JV_UNDEF) {
        undefined_error(c, obj);
        return obj;
    }
    int int_key = key.kind == JV_INT || key.kind == JV_BOOL;
    if (obj.kind == JV_LIST && int_key) {
        int64_t i = key.u.i, len = (int64_t)obj.u.list->n;
        if (i < 0)
            i += len;
        return i >= 0 && i < len ? obj.u.list->items[i] : jv_undef(NULL);
    }
    if (obj.kind == JV_STR && int_key) {
        const char *p = obj.u.str.s;
        size_t n = obj.u.str.n;
        int64_t i = key.u.i;
        if (i < 0)
            i += (int64_t)jj_cp_len(obj);
        if (i < 0)
            return jv_undef(NULL);
        size_t b = cp_at(p, n, (uint64_t)i), e = b + 1;
        if (b >= n)
            return jv_undef(NULL);
        while (e < n && ((unsigned char)p[e] & 0xC0) == 0x80)
            e++;
        return jv_strn(p + b, e - b);
    }
    if (obj.kind == JV_DICT || obj.kind == JV_NS) {
        const jj_value *v = jv_dict_find(obj, key);
        if (v)
            return *v;
    }
    if (key.kind == JV_STR) {
        /* jinja2 falls back to getattr for string keys; names are NUL-free here. */
        char *nm = jj_alloc(c->a, key.u.str.n + 1);
        if (!nm)
            return jv_undef(NULL);
        memcpy(nm, key.u.str.s, key.u.str.n);
        nm[key.u.str.n] = 0;
        if (obj.kind == JV_DICT || obj.kind == JV_NS)
            return is_method_of(obj, nm) ? make_method(c, obj, nm) : jv_undef(nm);
        return jj_getattr(c, obj, nm, key.u.str.n);
    }
    return jv_undef(NULL);
}

/* Python's slice.indices(): clamps start/stop for a sequence of length len. */
static int slice_indices(jj_ctx *c, jj_value vs, jj_value ve, jj_value vp, int64_t len,
                         int64_t *start, int64_t *stop, int64_t *step)
{
    *step = 1;
    if (vp.kind != JV_NONE && vp.kind != JV_UNDEF) {
        if (vp.kind != JV_INT && vp.kind != JV_BOOL)
            return jj_fail(c, "slice indices must be integers");
        *step = vp.u.i;
        if (*step == 0)
            return jj_fail(c, "slice step cannot be zero");
    }
    int64_t lo = *step < 0 ? -1 : 0, hi = *step < 0 ? len - 1 : len;
    const jj_value *ends[2] = {&vs, &ve};
    int64_t *dst[2] = {start, stop};
    for (int k = 0; k < 2; k++) {
        jj_value e = *ends[k];
        if (e.kind == JV_NONE || e.kind == JV_UNDEF) {
            *dst[k] = (k == 0) == (*step > 0) ? lo : hi;
            continue;
        }
        if (e.kind != JV_INT && e.kind != JV_BOOL)
            return jj_fail(c, "slice indices must be integers");
        int64_t i = e.u.i;
        if (i < 0) {
            i += len;
            if (i < lo)
                i = lo;
        } else if (i > hi)
            i = hi;
        *dst[k] = i;
    }
    return 0;
}

/* How many indices start, start+step, ... lie before stop (start and stop already clamped). */
static int64_t slice_count(int64_t start, int64_t stop, int64_t step)
{
    __int128 span = step > 0 ? (__int128)stop - start : (__int128)start - stop;
    __int128 st = step > 0 ? (__int128)step : -(__int128)step;
    return span <= 0 ? 0 : (int64_t)((span + st - 1) / st);
}

static int do_slice(jj_ctx *c, jj_value obj, jj_value vs, jj_value ve, jj_value vp, jj_value *out)
{
    if (obj.kind == JV_UNDEF)
        return undefined_error(c, obj);
    int64_t start, stop, step;
    if (obj.kind == JV_LIST) {
        jj_list *l = obj.u.list;
        if (slice_indices(c, vs, ve, vp, (int64_t)l->n, &start, &stop, &step))
            return -1;
        jj_value r = jv_new_list(c->a, l->n);
        if (r.kind != JV_LIST)
            return jj_oom(c);
        r.u.list->tuple = l->tuple;
        int64_t cnt = slice_count(start, stop, step);
        for (int64_t k = 0; k < cnt; k++)
            jv_list_push(c->a, r, l->items[start + k * step]);
        *out = r;
        return 0;
    }
    if (obj.kind == JV_STR) {
        size_t cnt = jj_cp_len(obj), *off;
        if (slice_indices(c, vs, ve, vp, (int64_t)cnt, &start, &stop, &step))
            return -1;
        if (step == 1) {
            const char *p = obj.u.str.s;
            size_t b = start < stop ? cp_at(p, obj.u.str.n, (uint64_t)start) : 0;
            size_t e = start < stop ? b + cp_at(p + b, obj.u.str.n - b, (uint64_t)(stop - start)) : 0;
            *out = jv_strn(p + b, e - b);
            return 0;
        }
        if (!(off = cp_offsets(c, obj.u.str.s, obj.u.str.n, &cnt)))
            return jj_oom(c);
        char *s = jj_alloc(c->a, obj.u.str.n + 1);
        size_t len = 0;
        if (!s)
            return jj_oom(c);
        int64_t picks = slice_count(start, stop, step);
        for (int64_t k = 0; k < picks; k++) {
            int64_t i = start + k * step;
            memcpy(s + len, obj.u.str.s + off[i], off[i + 1] - off[i]);
            len += off[i + 1] - off[i];
        }
        *out = jv_strn(s, len);
        return 0;
    }
    *out = jv_undef(NULL);
    return 0;
}

int jj_iterate(jj_ctx *c, jj_value v, const jj_value **items, size_t *n)
{
    switch (v.kind) {
    case JV_UNDEF:
        *items = NULL;
        *n = 0;
        return 0;
    case JV_LIST:
        *items = v.u.list->items;
        *n = v.u.list->n;
        return 0;
    case JV_DICT:
    case JV_NS:
        *items = v.u.dict->keys;
        *n = v.u.dict->n;
        return 0;
    case JV_STR: {
        size_t cnt, *off = cp_offsets(c, v.u.str.s, v.u.str.n, &cnt);
        jj_value *arr = jj_alloc(c->a, (cnt + 1) * sizeof *arr);
        if (!off || !arr)
            return jj_oom(c);
        for (size_t i = 0; i < cnt; i++)
            arr[i] = jv_strn(v.u.str.s + off[i], off[i + 1] - off[i]);
        *items = arr;
        *n = cnt;
        return 0;
    }
    default:
        return jj_fail(c, "'%s' object is not iterable", jv_type_name(v));
    }
}

/* ---- operators ---- */

static int is_num(jj_value v)
{
    return v.kind == JV_INT || v.kind == JV_BOOL || v.kind == JV_FLOAT;
}
static double num(jj_value v)
{
    return v.kind == JV_FLOAT ? v.u.f : (double)v.u.i;
}

static int type_error(jj_ctx *c, const char *op, jj_value a, jj_value b)
{
    if (a.kind == JV_UNDEF)
        return undefined_error(c, a);
    if (b.kind == JV_UNDEF)
        return undefined_error(c, b);
    return jj_fail(c, "unsupported operand type(s) for %s: '%s' and '%s'", op, jv_type_name(a),
                   jv_type_name(b));
}

static jj_value repeat(jj_ctx *c, jj_value seq, int64_t times)
{
    if (times < 0)
        times = 0;
    if (seq.kind == JV_STR) {
        size_t n = seq.u.str.n * (size_t)times;
        char *s = jj_alloc(c->a, n + 1);
        if (!s)
            return jv_undef(NULL);
        for (int64_t i = 0; i < times; i++)
            memcpy(s + (size_t)i * seq.u.str.n, seq.u.str.s, seq.u.str.n);
        s[n] = 0;
        return jv_strn(s, n);
    }
    /* (the arena refuses a list beyond its cap: [0] * 268435456 is 6 GB of values) */
    jj_value r = jv_new_list(c->a, seq.u.list->n * (size_t)times);
    if (r.kind != JV_LIST)
        return r;
    r.u.list->tuple = seq.u.list->tuple;
    for (int64_t i = 0; i < times; i++)
        for (size_t k = 0; k < seq.u.list->n; k++)
            r.u.list->items[r.u.list->n++] = seq.u.list->items[k];
    return r;
}

/* Python ints are unbounded; ours are 64-bit, so a result that would wrap is an error. */
static int overflow(jj_ctx *c)
{
    return jj_fail(c, "integer overflow (integers beyond 64 bits are not supported)");
}

static int arith(jj_ctx *c, int op, jj_value a, jj_value b, jj_value *out)
{
    static const char *const names[] = {"", "+", "-", "*", "/", "//", "%", "**"};
    if (op == OP_ADD && a.kind == JV_STR && b.kind == JV_STR) {
        *out = jv_str_append(c->a, a, b.u.str.s, b.u.str.n);
        return out->kind == JV_UNDEF ? jj_oom(c) : 0;
    }
    if (op == OP_ADD && a.kind == JV_LIST && b.kind == JV_LIST
        && a.u.list->tuple == b.u.list->tuple) {
        jj_value r = jv_new_list(c->a, a.u.list->n + b.u.list->n);
        if (r.kind != JV_LIST)
            return jj_oom(c);
        r.u.list->tuple = a.u.list->tuple;
        for (size_t i = 0; i < a.u.list->n; i++)
            jv_list_push(c->a, r, a.u.list->items[i]);
        for (size_t i = 0; i < b.u.list->n; i++)
            jv_list_push(c->a, r, b.u.list->items[i]);
        *out = r;
        return 0;
    }
    if (op == OP_MUL && (b.kind == JV_STR || b.kind == JV_LIST)
        && (a.kind == JV_INT || a.kind == JV_BOOL)) {
        jj_value t = a;
        a = b;
        b = t;
    }
    if (op == OP_MUL && (a.kind == JV_STR || a.kind == JV_LIST)
        && (b.kind == JV_INT || b.kind == JV_BOOL)) {
        size_t unit = a.kind == JV_STR ? a.u.str.n : a.u.list->n;
        if (b.u.i > 0 && unit > 0 && (uint64_t)b.u.i > MAX_OUTPUT / unit)
            return jj_fail(c, "repeated sequence too large");
        *out = repeat(c, a, b.u.i);
        return out->kind == JV_UNDEF ? jj_oom(c) : 0;
    }
    if (!is_num(a) || !is_num(b))
        return type_error(c, names[op], a, b);
    int ints = a.kind != JV_FLOAT && b.kind != JV_FLOAT;
    int64_t x = a.u.i, y = b.u.i;
    double fx = num(a), fy = num(b);
    int64_t r64;
    switch (op) {
    case OP_ADD:
        if (ints && __builtin_add_overflow(x, y, &r64))
            return overflow(c);
        *out = ints ? jv_int(r64) : jv_float(fx + fy);
        return 0;
    case OP_SUB:
        if (ints && __builtin_sub_overflow(x, y, &r64))
            return overflow(c);
        *out = ints ? jv_int(r64) : jv_float(fx - fy);
        return 0;
    case OP_MUL:
        if (ints && __builtin_mul_overflow(x, y, &r64))
            return overflow(c);
        *out = ints ? jv_int(r64) : jv_float(fx * fy);
        return 0;
    case OP_DIV:
        if (fy == 0)
            return jj_fail(c, "division by zero");
        *out = jv_float(fx / fy);
        return 0;
    case OP_FLOORDIV:
    case OP_MOD:
        if (fy == 0)
            return jj_fail(c, "integer division or modulo by zero");
        if (ints) {
            if (x == INT64_MIN && y == -1)
                return overflow(c);
            int64_t q = x / y, r = x % y;
            if (r != 0 && ((r < 0) != (y < 0))) {
                q--;
                r += y;
            }
            *out = jv_int(op == OP_MOD ? r : q);
        } else {
            double r = fmod(fx, fy);
            if (r != 0 && ((r < 0) != (fy < 0)))
                r += fy;
            *out = op == OP_MOD ? jv_float(r) : jv_float(floor(fx / fy));
        }
        return 0;
    case OP_POW:
        if (ints && y >= 0) { /* square and multiply, refusing to wrap */
            int64_t r = 1, base = x;
            for (int64_t e = y; e > 0; e >>= 1) {
                if ((e & 1) && __builtin_mul_overflow(r, base, &r))
                    return overflow(c);
                if (e > 1 && __builtin_mul_overflow(base, base, &base))
                    return overflow(c);
            }
            *out = jv_int(r);
        } else {
            *out = jv_float(pow(fx, fy));
        }
        return 0;
    }
    return jj_fail(c, "bad operator");
}

static int order(jj_ctx *c, jj_value a, jj_value b, int *cmp, int depth);

int jj_order(jj_ctx *c, jj_value a, jj_value b, int *cmp)
{
    return order(c, a, b, cmp, 0);
}

static int order(jj_ctx *c, jj_value a, jj_value b, int *cmp, int depth)
{
    if (depth > 1000) /* lists nested in lists: Python's recursion limit */
        return jj_fail(c, "maximum recursion depth exceeded in comparison");
    if (is_num(a) && is_num(b)) {
        double x = num(a), y = num(b);
        if (a.kind != JV_FLOAT && b.kind != JV_FLOAT)
            *cmp = (a.u.i > b.u.i) - (a.u.i < b.u.i);
        else
            *cmp = (x > y) - (x < y);
        return 0;
    }
    if (a.kind == JV_STR && b.kind == JV_STR) {
        size_t n = a.u.str.n < b.u.str.n ? a.u.str.n : b.u.str.n;
        int r = memcmp(a.u.str.s, b.u.str.s, n);
        *cmp = r ? (r > 0) - (r < 0) : (a.u.str.n > b.u.str.n) - (a.u.str.n < b.u.str.n);
        return 0;
    }
    if (a.kind == JV_LIST && b.kind == JV_LIST) {
        for (size_t i = 0; i < a.u.list->n && i < b.u.list->n; i++) {
            if (jv_equal(a.u.list->items[i], b.u.list->items[i]))
                continue;
            return order(c, a.u.list->items[i], b.u.list->items[i], cmp, depth + 1);
        }
        *cmp = (a.u.list->n > b.u.list->n) - (a.u.list->n < b.u.list->n);
        return 0;
    }
    if (a.kind == JV_UNDEF)
        return undefined_error(c, a);
    if (b.kind == JV_UNDEF)
        return undefined_error(c, b);
    return jj_fail(c, "'<' not supported between instances of '%s' and '%s'", jv_type_name(a),
                   jv_type_name(b));
}

static int contains(jj_ctx *c, jj_value hay, jj_value needle, int *res)
{
    if (hay.kind == JV_STR) {
        if (needle.kind != JV_STR)
            return jj_fail(c, "'in <string>' requires string as left operand, not %s",
                           jv_type_name(needle));
        *res = needle.u.str.n == 0
               || memmem(hay.u.str.s, hay.u.str.n, needle.u.str.s, needle.u.str.n) != NULL;
        return 0;
    }
    if (hay.kind == JV_LIST) {
        *res = 0;
        for (size_t i = 0; i < hay.u.list->n && !*res; i++)
            *res = jv_equal(hay.u.list->items[i], needle);
        return 0;
    }
    if (hay.kind == JV_DICT || hay.kind == JV_NS) {
        *res = jv_dict_find(hay, needle) != NULL;
        return 0;
    }
    if (hay.kind == JV_UNDEF) {
        *res = 0;
        return 0;
    }
    return jj_fail(c, "argument of type '%s' is not iterable", jv_type_name(hay));
}

static int compare(jj_ctx *c, int op, jj_value a, jj_value b, jj_value *out)
{
    int r = 0, cmp;
    switch (op) {
    case OP_EQ:
        r = jv_equal(a, b);
        break;
    case OP_NE:
        r = !jv_equal(a, b);
        break;
    case OP_IN:
        if (contains(c, b, a, &r))
            return -1;
        break;
    case OP_NOTIN:
        if (contains(c, b, a, &r))
            return -1;
        r = !r;
        break;
    default:
        if (jj_order(c, a, b, &cmp))
            return -1;
        r = op == OP_LT ? cmp < 0 : op == OP_LE ? cmp <= 0 : op == OP_GT ? cmp > 0 : cmp >= 0;
    }
    *out = jv_bool(r);
    return 0;
}

/* ---- calls ---- */

typedef struct {
    jj_value *args;
    int nargs;
    const char **kwn;
    jj_value *kwv;
    int nkw;
} callargs;

static int eval_args(jj_ctx *c, frame *f, const jnode *n, callargs *ca)
{
    ca->nargs = n->nkids;
    ca->nkw = n->nkids2;
    ca->kwn = n->names;
    ca->args = jj_alloc(c->a, (size_t)(n->nkids + 1) * sizeof(jj_value));
    ca->kwv = jj_alloc(c->a, (size_t)(n->nkids2 + 1) * sizeof(jj_value));
    if (!ca->args || !ca->kwv)
        return jj_oom(c);
    for (int i = 0; i < n->nkids; i++)
        if (eval_expr(c, f, n->kids[i], &ca->args[i]))
            return -1;
    for (int i = 0; i < n->nkids2; i++)
        if (eval_expr(c, f, n->kids2[i], &ca->kwv[i]))
            return -1;
    return 0;
}

static int call_macro(jj_ctx *c, const jj_closure *cl, callargs *ca, jj_value *out)
{
    const jnode *m = cl->node;

    if (c->depth > 64)
        return jj_fail(c, "macro recursion too deep");
    if (++c->steps > MAX_STEPS)
        return jj_fail(c, "template runs too long (more than %u steps)", MAX_STEPS);
    if (ca->nargs > m->nnames)
        return jj_fail(c, "macro '%s' takes not more than %d argument(s)", m->s, m->nnames);
    frame *mf = new_frame(c, cl->scope);
    if (!mf)
        return -1;
    for (int i = 0; i < m->nnames; i++) {
        jj_value v = jv_undef(m->names[i]);
        int set = 0;
        if (i < ca->nargs) {
            v = ca->args[i];
            set = 1;
        }
        for (int k = 0; k < ca->nkw; k++)
            if (!strcmp(ca->kwn[k], m->names[i])) {
                v = ca->kwv[k];
                set = 1;
            }
        if (!set && m->kids2[i] && eval_expr(c, mf, m->kids2[i], &v))
            return -1;
        if (frame_set(c, mf, m->names[i], v))
            return -1;
    }
    for (int k = 0; k < ca->nkw; k++) {
        int found = 0;
        for (int i = 0; i < m->nnames; i++)
            found |= !strcmp(ca->kwn[k], m->names[i]);
        if (!found)
            return jj_fail(c, "macro '%s' has no argument '%s'", m->s, ca->kwn[k]);
    }
    jj_buf buf = {0}, *saved = c->out;
    c->out = &buf;
    c->depth++;
    int rc = exec_node(c, mf, m->b);
    c->depth--;
    c->out = saved;
    c->brk = c->cont = 0;
    if (!rc && buf.oom)
        rc = jj_oom(c);
    if (!rc) {
        char *s = jj_alloc(c->a, buf.n + 1);
        if (!s)
            rc = jj_oom(c);
        else {
            if (buf.n)
                memcpy(s, buf.p, buf.n);
            s[buf.n] = 0;
            *out = jv_strn(s, buf.n);
        }
    }
    free(buf.p);
    return rc;
}

static int call_value(jj_ctx *c, jj_value fn, callargs *ca, jj_value *out)
{
    switch (fn.kind) {
    case JV_FUNC:
        return jj_call_func(c, (int)fn.u.i, ca->args, ca->nargs, ca->kwn, ca->kwv, ca->nkw, out);
    case JV_METHOD:
        return jj_call_method(c, fn.u.method, ca->args, ca->nargs, ca->kwn, ca->kwv, ca->nkw, out);
    case JV_MACRO:
        return call_macro(c, fn.u.macro, ca, out);
    case JV_UNDEF:
        return undefined_error(c, fn);
    default:
        return jj_fail(c, "'%s' object is not callable", jv_type_name(fn));
    }
}

/* ---- expressions ---- */

/* a ~ b ~ ...: str() of each appended to the first, in place when that one is a string
 * that grew so before ({% set ns.s = ns.s ~ x %} in a loop) */
static int eval_concat(jj_ctx *c, frame *f, const jnode *n, jj_value *out)
{
    jj_buf b = {0};
    jj_value first = jv_strn("", 0);
    for (int i = 0; i < n->nkids; i++) {
        jj_value v;
        if (eval_expr(c, f, n->kids[i], &v)) {
            free(b.p);
            return -1;
        }
        if (i == 0 && v.kind == JV_STR) {
            first = v;
            continue;
        }
        if (jv_write_str(&b, v)) {
            free(b.p);
            return jj_fail(c, "cannot convert %s to a string", jv_type_name(v));
        }
        if (b.n > MAX_OUTPUT) {
            free(b.p);
            return jj_fail(c, "template output too large");
        }
    }
    *out = b.oom ? jv_undef(NULL) : jv_str_append(c->a, first, b.p, b.n);
    free(b.p);
    if (out->kind != JV_STR)
        return jj_oom(c);
    return 0;
}

static int eval_collection(jj_ctx *c, frame *f, const jnode *n, jj_value *out)
{
    if (n->type == N_DICTLIT) {
        jj_value d = jv_new_dict(c->a, (size_t)n->nkids);
        if (d.kind != JV_DICT)
            return jj_oom(c);
        for (int i = 0; i < n->nkids; i++) {
            jj_value k, v;
            if (eval_expr(c, f, n->kids[i], &k) || eval_expr(c, f, n->kids2[i], &v))
                return -1;
            if (jv_dict_put(c->a, d, k, v))
                return jj_oom(c);
        }
        *out = d;
        return 0;
    }
    jj_value l = jv_new_list(c->a, (size_t)n->nkids);
    if (l.kind != JV_LIST)
        return jj_oom(c);
    l.u.list->tuple = n->type == N_TUPLELIT;
    for (int i = 0; i < n->nkids; i++) {
        jj_value v;
        if (eval_expr(c, f, n->kids[i], &v))
            return -1;
        jv_list_push(c->a, l, v);
    }
    *out = l;
    return 0;
}

static int eval_expr_at(jj_ctx *c, frame *f, const jnode *n, jj_value *out)
{
    jj_value a, b;
    callargs ca;
    switch (n->type) {
    case N_LIT:
        *out = n->lit;
        return 0;
    case N_NAME: {
        const jj_value *v = lookup(f, n->s);
        *out = v ? *v : jv_undef(n->s);
        return 0;
    }
    case N_ATTR:
        if (eval_expr(c, f, n->a, &a))
            return -1;
        *out = jj_getattr(c, a, n->s, strlen(n->s));
        return c->failed ? -1 : 0;
    case N_ITEM:
        if (eval_expr(c, f, n->a, &a) || eval_expr(c, f, n->b, &b))
            return -1;
        *out = jj_getitem(c, a, b);
        return c->failed ? -1 : 0;
    case N_SLICE: {
        jj_value s = jv_none(), e = jv_none(), p = jv_none();
        if (eval_expr(c, f, n->a, &a))
            return -1;
        if ((n->b && eval_expr(c, f, n->b, &s)) || (n->c && eval_expr(c, f, n->c, &e))
            || (n->d && eval_expr(c, f, n->d, &p)))
            return -1;
        return do_slice(c, a, s, e, p, out);
    }
    case N_CALL:
        if (eval_expr(c, f, n->a, &a) || eval_args(c, f, n, &ca))
            return -1;
        return call_value(c, a, &ca, out);
    case N_FILTER:
        if (eval_expr(c, f, n->a, &a) || eval_args(c, f, n, &ca))
            return -1;
        return jj_call_filter(c, n->s, a, ca.args, ca.nargs, ca.kwn, ca.kwv, ca.nkw, out);
    case N_TEST: {
        int r;
        if (eval_expr(c, f, n->a, &a) || eval_args(c, f, n, &ca))
            return -1;
        if (jj_call_test(c, n->s, a, ca.args, ca.nargs, &r))
            return -1;
        *out = jv_bool(n->op ? !r : r);
        return 0;
    }
    case N_BIN:
        if (eval_expr(c, f, n->a, &a) || eval_expr(c, f, n->b, &b))
            return -1;
        return arith(c, n->op, a, b, out);
    case N_CMP:
        if (eval_expr(c, f, n->a, &a) || eval_expr(c, f, n->b, &b))
            return -1;
        return compare(c, n->op, a, b, out);
    case N_NOT:
        if (eval_expr(c, f, n->a, &a))
            return -1;
        *out = jv_bool(!jv_truthy(a));
        return 0;
    case N_NEG:
    case N_POS:
        if (eval_expr(c, f, n->a, &a))
            return -1;
        if (!is_num(a))
            return a.kind == JV_UNDEF
                       ? undefined_error(c, a)
                       : jj_fail(c, "bad operand type for unary -: '%s'", jv_type_name(a));
        if (n->type == N_NEG && a.kind != JV_FLOAT && a.u.i == INT64_MIN)
            return overflow(c);
        *out = n->type == N_POS     ? (a.kind == JV_BOOL ? jv_int(a.u.i) : a)
               : a.kind == JV_FLOAT ? jv_float(-a.u.f)
                                    : jv_int(-a.u.i);
        return 0;
    case N_AND:
    case N_OR:
        if (eval_expr(c, f, n->a, &a))
            return -1;
        if (jv_truthy(a) == (n->type == N_OR)) {
            *out = a;
            return 0;
        }
        return eval_expr(c, f, n->b, out);
    case N_COND:
        if (eval_expr(c, f, n->a, &a))
            return -1;
        if (jv_truthy(a))
            return eval_expr(c, f, n->b, out);
        if (n->c)
            return eval_expr(c, f, n->c, out);
        *out = jv_undef(NULL);
        return 0;
    case N_LISTLIT:
    case N_TUPLELIT:
    case N_DICTLIT:
        return eval_collection(c, f, n, out);
    case N_CONCAT:
        return eval_concat(c, f, n, out);
    default:
        return jj_fail(c, "line %d: not an expression", n->line);
    }
}

/* ---- statements ---- */

static int assign(jj_ctx *c, frame *f, const jnode *n, jj_value v)
{
    if (n->nnames == 1)
        return frame_set(c, f, n->names[0], v);
    const jj_value *items;
    size_t cnt;
    if (jj_iterate(c, v, &items, &cnt))
        return -1;
    if (cnt != (size_t)n->nnames)
        return jj_fail(c, "cannot unpack %zu values into %d names", cnt, n->nnames);
    for (int i = 0; i < n->nnames; i++)
        if (frame_set(c, f, n->names[i], items[i]))
            return -1;
    return 0;
}

static int exec_set(jj_ctx *c, frame *f, const jnode *n)
{
    jj_value v;
    if (n->type == N_SETBLOCK) {
        jj_buf buf = {0}, *saved = c->out;
        c->out = &buf;
        int rc = exec_node(c, f, n->b);
        c->out = saved;
        char *s = rc || buf.oom ? NULL : jj_alloc(c->a, buf.n + 1);
        if (s) {
            if (buf.n)
                memcpy(s, buf.p, buf.n);
            s[buf.n] = 0;
        }
        free(buf.p);
        if (rc)
            return -1;
        if (!s)
            return jj_oom(c);
        return assign(c, f, n, jv_strn(s, buf.n));
    }
    if (eval_expr(c, f, n->b, &v))
        return -1;
    if (n->a) { /* ns.attr = v */
        const jj_value *ns = lookup(f, n->a->c->s);
        if (!ns || ns->kind != JV_NS)
            return jj_fail(c, "line %d: can't assign attribute '%s' on non-namespace object",
                           n->line, n->a->s);
        return jv_dict_put(c->a, *ns, jv_cstr(n->a->s), v) ? jj_oom(c) : 0;
    }
    return assign(c, f, n, v);
}

static int exec_for(jj_ctx *c, frame *f, const jnode *n)
{
    jj_value seq;
    const jj_value *items;
    size_t cnt;
    if (eval_expr(c, f, n->a, &seq) || jj_iterate(c, seq, &items, &cnt))
        return -1;
    frame *it = new_frame(c, f);
    if (!it)
        return -1;
    if (n->b) { /* {% for x in xs if cond %}: filter first, so loop.length counts what is kept */
        jj_value *kept = jj_alloc(c->a, (cnt + 1) * sizeof *kept);
        size_t k = 0;
        if (!kept)
            return jj_oom(c);
        for (size_t i = 0; i < cnt; i++) {
            jj_value ok;
            /* the condition is evaluated once an item: it counts as a step */
            if (++c->steps > MAX_STEPS)
                return jj_fail(c, "template runs too long (more than %u steps)", MAX_STEPS);
            jv_dict_clear(&it->vars);
            if (assign(c, it, n, items[i]) || eval_expr(c, it, n->b, &ok))
                return -1;
            if (jv_truthy(ok))
                kept[k++] = items[i];
        }
        items = kept;
        cnt = k;
    }
    jj_loop *loop = jj_alloc(c->a, sizeof *loop);
    if (!loop)
        return jj_oom(c);
    loop->length = cnt;
    loop->items = items;
    jj_value lv = {.kind = JV_LOOP};
    lv.u.loop = loop;
    for (size_t i = 0; i < cnt; i++) {
        jv_dict_clear(&it->vars);
        loop->index0 = i;
        if (++c->steps > MAX_STEPS)
            return jj_fail(c, "template runs too long (more than %u steps)", MAX_STEPS);
        if (c->out->n > MAX_OUTPUT)
            return jj_fail(c, "template output too large");
        if (assign(c, it, n, items[i]) || frame_set(c, it, "loop", lv))
            return -1;
        if (exec_node(c, it, n->c))
            return -1;
        c->cont = 0;
        if (c->brk) {
            c->brk = 0;
            break;
        }
    }
    if (cnt == 0 && n->d) {
        frame *eb = new_frame(c, f);
        return eb ? exec_node(c, eb, n->d) : -1;
    }
    return 0;
}

static int exec_node_at(jj_ctx *c, frame *f, const jnode *n)
{
    jj_value v;
    switch (n->type) {
    case N_TEXT:
        jj_buf_put(c->out, n->s, n->slen);
        return 0;
    case N_EMIT:
        if (eval_expr(c, f, n->a, &v))
            return -1;
        if (jv_write_str(c->out, v))
            return jj_fail(c, "line %d: cannot print a %s", n->line, jv_type_name(v));
        return 0;
    case N_BODY:
        for (int i = 0; i < n->nkids && !c->brk && !c->cont; i++)
            if (exec_node(c, f, n->kids[i]))
                return -1;
        return 0;
    case N_IF:
        if (eval_expr(c, f, n->a, &v))
            return -1;
        if (jv_truthy(v))
            return exec_node(c, f, n->b);
        return n->c ? exec_node(c, f, n->c) : 0;
    case N_FOR:
        return exec_for(c, f, n);
    case N_SET:
    case N_SETBLOCK:
        return exec_set(c, f, n);
    case N_MACRO: {
        jj_closure *cl = jj_alloc(c->a, sizeof *cl);
        if (!cl)
            return jj_oom(c);
        cl->node = n;
        cl->scope = f;
        jj_value m = {.kind = JV_MACRO};
        m.u.macro = cl;
        return frame_set(c, f, n->s, m);
    }
    case N_BREAK:
        c->brk = 1;
        return 0;
    case N_CONTINUE:
        c->cont = 1;
        return 0;
    default:
        return jj_fail(c, "line %d: not a statement", n->line);
    }
}

int jj_render(const jj_template *t, jj_arena *a, const jj_var *vars, size_t nvars, long long now,
              jj_buf *out, char *err, size_t errlen)
{
    jj_ctx c = {.a = a, .out = out, .err = err, .errlen = errlen, .now = now};
    frame globals = FRAME(&c, NULL), top = FRAME(&c, &globals);
    for (int i = 0; i < JJ_FUNC_N; i++) {
        jj_value fn = {.kind = JV_FUNC};
        fn.u.i = i;
        if (frame_set(&c, &globals, jj_func_names[i], fn))
            return -1;
    }
    for (size_t i = 0; i < nvars; i++)
        if (frame_set(&c, &globals, vars[i].name, vars[i].value))
            return -1;
    if (exec_node(&c, &top, jj_template_root(t)))
        return -1;
    if (out->oom)
        return jj_oom(&c);
    return 0;
}
