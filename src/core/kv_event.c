/*
 * KV event decoders (kv_event.h): Dynamo RouterEvent as JSON (both shapes,
 * single or batch) or as the MessagePack envelope. Both formats parse into
 * one flat tree (kv_tree.c) and one extractor reads the fields, so the two
 * cannot drift apart. Any malformed part fails the whole message.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_buf.h"
#include "kv_event.h"
#include "kv_proto.h"
#include "kv_tree.h"

typedef struct {
    kv_tree_t           tree;
    kv_tree_t           inner;      /* an envelope's payload */
    kv_event_t         *events;
    size_t              events_cap;
    kv_stored_block_t  *blocks;
    size_t              n_blocks, blocks_cap;
    uint64_t           *hashes;
    size_t              n_hashes, hashes_cap;
} priv_t;

typedef struct {
    kv_event_batch_t   *b;
    priv_t             *pv;
    const kv_tree_t    *t;
    char               *err;
    size_t              errlen;
} ex_t;

static int bad(ex_t *x, const char *fmt, ...)
{
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(x->err, x->errlen, fmt, ap);
    va_end(ap);
    return -1;
}

/* A u64 field: unsigned, or negative (older Dynamo's i64) bit-cast. */
static int u64_at(ex_t *x, long node, const char *what, uint64_t *out)
{
    if (node < 0) {
        return bad(x, "missing %s", what);
    }
    if (x->t->nodes[node].type != KV_T_UINT && x->t->nodes[node].type != KV_T_NEG) {
        return bad(x, "%s is not an integer", what);
    }
    *out = x->t->nodes[node].u;
    return 0;
}

static int opt_u64(ex_t *x, uint32_t obj, const char *key, int *has, uint64_t *out)
{
    long v = kv_tree_get(x->t, obj, key);

    *has = 0;
    if (v < 0 || x->t->nodes[v].type == KV_T_NULL) {
        return 0;
    }
    *has = 1;
    return u64_at(x, v, key, out);
}

static int stored(ex_t *x, uint32_t data, kv_event_t *ev)
{
    long     blocks = kv_tree_get(x->t, data, "blocks");
    uint32_t i, k;
    uint64_t sp;
    priv_t  *pv = x->pv;

    if (opt_u64(x, data, "parent_hash", &ev->has_parent, &ev->parent_hash) != 0
        || opt_u64(x, data, "start_position", &ev->has_start_position, &sp) != 0)
    {
        return -1;
    }
    ev->start_position = (uint32_t) sp;
    if (blocks < 0 || x->t->nodes[blocks].type != KV_T_ARR) {
        return bad(x, "stored event without a blocks array");
    }
    /* an empty blocks array is valid serde (Vec) and applies as nothing */
    if (kv_grow((void **) &pv->blocks, &pv->blocks_cap, pv->n_blocks + x->t->nodes[blocks].n,
             sizeof(kv_stored_block_t)) != 0)
    {
        return bad(x, "out of memory");
    }
    /* pointers are fixed up after the whole message, as the array may move */
    ev->blocks = (const kv_stored_block_t *) (uintptr_t) pv->n_blocks;
    ev->n_blocks = x->t->nodes[blocks].n;
    for (i = 0, k = kv_tree_first((uint32_t) blocks); i < ev->n_blocks;
         i++, k = kv_tree_next(x->t, k))
    {
        kv_stored_block_t *b = &pv->blocks[pv->n_blocks++];

        if (x->t->nodes[k].type != KV_T_OBJ) {
            return bad(x, "block %u is not an object", i);
        }
        if (u64_at(x, kv_tree_get(x->t, k, "block_hash"), "block_hash", &b->block_hash) != 0
            || u64_at(x, kv_tree_get(x->t, k, "tokens_hash"), "tokens_hash",
                      &b->tokens_hash) != 0)
        {
            return -1;
        }
    }
    return 0;
}

static int removed(ex_t *x, uint32_t data, kv_event_t *ev)
{
    long     hs = kv_tree_get(x->t, data, "block_hashes");
    uint32_t i, k;
    priv_t  *pv = x->pv;

    if (hs < 0 || x->t->nodes[hs].type != KV_T_ARR) {
        return bad(x, "removed event without a block_hashes array");
    }
    if (kv_grow((void **) &pv->hashes, &pv->hashes_cap, pv->n_hashes + x->t->nodes[hs].n,
             sizeof(uint64_t)) != 0)
    {
        return bad(x, "out of memory");
    }
    ev->hashes = (const uint64_t *) (uintptr_t) pv->n_hashes;
    ev->n_hashes = x->t->nodes[hs].n;
    for (i = 0, k = kv_tree_first((uint32_t) hs); i < ev->n_hashes;
         i++, k = kv_tree_next(x->t, k))
    {
        if (u64_at(x, k, "block_hashes[]", &pv->hashes[pv->n_hashes++]) != 0) {
            return -1;
        }
    }
    return 0;
}

/* Whether node is the variant name (kv_proto.h), or it with a capital. */
static int variant_is(const kv_tree_t *t, uint32_t node, const char *name)
{
    char capital[16];

    snprintf(capital, sizeof(capital), "%c%s", name[0] - 'a' + 'A', name + 1);
    return kv_tree_streq(t, node, name) || kv_tree_streq(t, node, capital);
}

/* "data": {"stored": {...}} | {"removed": {...}} | "cleared" (any case). */
static int data(ex_t *x, long d, kv_event_t *ev)
{
    const kv_tnode_t *n;
    uint32_t          key;

    if (d < 0) {
        return bad(x, "event without data");
    }
    n = &x->t->nodes[d];
    if (n->type == KV_T_STR) {
        if (variant_is(x->t, (uint32_t) d, KV_PROTO_CLEARED)) {
            ev->kind = KV_EVENT_CLEARED;
            return 0;
        }
        return bad(x, "unknown event data \"%.*s\"", (int) (n->len > 32 ? 32 : n->len), n->s);
    }
    if (n->type != KV_T_OBJ || n->n != 1) {
        return bad(x, "event data is not one tagged variant");
    }
    key = (uint32_t) d + 1;
    if (variant_is(x->t, key, KV_PROTO_STORED)) {
        ev->kind = KV_EVENT_STORED;
        if (x->t->nodes[key + 1].type != KV_T_OBJ) {
            return bad(x, "stored data is not an object");
        }
        return stored(x, key + 1, ev);
    }
    if (variant_is(x->t, key, KV_PROTO_REMOVED)) {
        ev->kind = KV_EVENT_REMOVED;
        if (x->t->nodes[key + 1].type != KV_T_OBJ) {
            return bad(x, "removed data is not an object");
        }
        return removed(x, key + 1, ev);
    }
    if (variant_is(x->t, key, KV_PROTO_CLEARED)) {
        ev->kind = KV_EVENT_CLEARED;
        return 0;
    }
    return bad(x, "unknown event variant");
}

/* One RouterEvent object; appended unless its tier is not the device. */
static int router_event(ex_t *x, uint32_t obj)
{
    kv_event_t  ev;
    long        inner, tier;
    int         has;
    uint64_t    v;
    priv_t     *pv = x->pv;
    size_t      nb = pv->n_blocks, nh = pv->n_hashes;

    memset(&ev, 0, sizeof(ev));
    if (x->t->nodes[obj].type != KV_T_OBJ) {
        return bad(x, "event is not an object");
    }
    if (u64_at(x, kv_tree_get(x->t, obj, "worker_id"), "worker_id", &ev.worker_id) != 0) {
        return -1;
    }
    inner = kv_tree_get(x->t, obj, "event");
    if (inner < 0 || x->t->nodes[inner].type != KV_T_OBJ) {
        return bad(x, "missing event object");
    }
    if (u64_at(x, kv_tree_get(x->t, (uint32_t) inner, "event_id"), "event_id",
               &ev.event_id) != 0)
    {
        return -1;
    }
    /* dp_rank sits in the inner event (newer) or, in some relays, outside */
    if (opt_u64(x, (uint32_t) inner, "dp_rank", &has, &v) != 0) {
        return -1;
    }
    if (!has && opt_u64(x, obj, "dp_rank", &has, &v) != 0) {
        return -1;
    }
    if (has && v > UINT32_MAX) {
        /* as a heartbeat's: never truncated into another rank's slot */
        return bad(x, "dp_rank %llu is above 2^32-1", (unsigned long long) v);
    }
    ev.dp_rank = has ? (uint32_t) v : 0;
    if (data(x, kv_tree_get(x->t, (uint32_t) inner, "data"), &ev) != 0) {
        return -1;
    }
    tier = kv_tree_get(x->t, obj, "storage_tier");
    if (tier >= 0 && x->t->nodes[tier].type != KV_T_NULL) {
        if (x->t->nodes[tier].type != KV_T_STR) {
            return bad(x, "storage_tier is not a string");
        }
        if (!kv_tree_streq(x->t, (uint32_t) tier, "device")
            && !kv_tree_streq(x->t, (uint32_t) tier, "Device"))
        {
            x->b->skipped_tier++;
            pv->n_blocks = nb;
            pv->n_hashes = nh;
            return 0;
        }
    }
    if (kv_grow((void **) &pv->events, &pv->events_cap, x->b->n_events + 1,
             sizeof(kv_event_t)) != 0)
    {
        return bad(x, "out of memory");
    }
    pv->events[x->b->n_events++] = ev;
    return 0;
}

static int events(ex_t *x, uint32_t root)
{
    uint32_t i, k;

    if (x->t->nodes[root].type == KV_T_ARR) {
        for (i = 0, k = kv_tree_first(root); i < x->t->nodes[root].n;
             i++, k = kv_tree_next(x->t, k))
        {
            if (router_event(x, k) != 0) {
                return -1;
            }
        }
        return 0;
    }
    return router_event(x, root);
}

static priv_t *priv(kv_event_batch_t *b)
{
    if (b->priv == NULL) {
        b->priv = calloc(1, sizeof(priv_t));
    }
    return b->priv;
}

static void reset(kv_event_batch_t *b)
{
    priv_t *pv = b->priv;

    b->events = NULL;
    b->n_events = 0;
    b->skipped_tier = 0;
    b->has_envelope = 0;
    b->publisher_id = b->sequence = b->published_at = 0;
    if (pv) {
        pv->n_blocks = pv->n_hashes = 0;
    }
}

/* Turns the stored indices into pointers once the arrays stopped moving. */
static void finish(kv_event_batch_t *b)
{
    priv_t *pv = b->priv;
    size_t  i;

    b->events = pv->events;
    for (i = 0; i < b->n_events; i++) {
        kv_event_t *ev = &pv->events[i];

        /* offsets into arrays that may not exist (no event had a block or
         * hash): NULL + 0 is undefined behaviour (found by fuzz_event_json) */
        if (ev->kind == KV_EVENT_STORED) {
            ev->blocks = pv->blocks ? pv->blocks + (uintptr_t) ev->blocks : NULL;
        } else if (ev->kind == KV_EVENT_REMOVED) {
            ev->hashes = pv->hashes ? pv->hashes + (uintptr_t) ev->hashes : NULL;
        }
    }
}

static int done(kv_event_batch_t *b, int rc)
{
    if (rc != 0) {
        reset(b);
        return -1;
    }
    finish(b);
    return 0;
}

void kv_event_batch_init(kv_event_batch_t *b)
{
    memset(b, 0, sizeof(*b));
}

void kv_event_batch_free(kv_event_batch_t *b)
{
    priv_t *pv = b->priv;

    if (pv) {
        kv_tree_free(&pv->tree);
        kv_tree_free(&pv->inner);
        free(pv->events);
        free(pv->blocks);
        free(pv->hashes);
        free(pv);
    }
    memset(b, 0, sizeof(*b));
}

int kv_event_decode_json(kv_event_batch_t *b, const char *buf, size_t len,
                         char *err, size_t errlen)
{
    priv_t *pv = priv(b);
    ex_t    x = { b, pv, NULL, err, errlen };

    reset(b);
    if (pv == NULL) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    if (kv_tree_json(&pv->tree, buf, len, err, errlen) != 0) {
        return done(b, -1);
    }
    x.t = &pv->tree;
    return done(b, events(&x, 0));
}

int kv_event_decode_msgpack(kv_event_batch_t *b, const void *buf, size_t len,
                            char *err, size_t errlen)
{
    priv_t *pv = priv(b);
    ex_t    x = { b, pv, NULL, err, errlen };
    long    payload, v;
    int     has;

    reset(b);
    if (pv == NULL) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    if (kv_tree_msgpack(&pv->tree, buf, len, err, errlen) != 0) {
        return done(b, -1);
    }
    x.t = &pv->tree;
    payload = kv_tree_get(&pv->tree, 0, "payload");
    if (payload < 0) {
        /* a bare RouterEvent map (or array of them) */
        return done(b, events(&x, 0));
    }
    if (pv->tree.nodes[payload].type != KV_T_BIN && pv->tree.nodes[payload].type != KV_T_STR) {
        return done(b, bad(&x, "envelope payload is not bytes"));
    }
    b->has_envelope = 1;
    if (opt_u64(&x, 0, "publisher_id", &has, &b->publisher_id) != 0
        || opt_u64(&x, 0, "sequence", &has, &b->sequence) != 0
        || opt_u64(&x, 0, "published_at", &has, &b->published_at) != 0)
    {
        return done(b, -1);
    }
    v = payload;
    if (kv_tree_msgpack(&pv->inner, pv->tree.nodes[v].s, pv->tree.nodes[v].len,
                        err, errlen) != 0)
    {
        return done(b, -1);
    }
    x.t = &pv->inner;
    return done(b, events(&x, 0));
}

int kv_event_decode(kv_event_batch_t *b, const void *buf, size_t len,
                    char *err, size_t errlen)
{
    const unsigned char *p = buf, *end = p + len;

    while (p < end && (*p == ' ' || *p == '\n' || *p == '\r' || *p == '\t')) {
        p++;
    }
    if (p < end && (*p == '{' || *p == '[')) {
        return kv_event_decode_json(b, buf, len, err, errlen);
    }
    return kv_event_decode_msgpack(b, buf, len, err, errlen);
}
