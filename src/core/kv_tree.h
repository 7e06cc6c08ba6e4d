/*
 * A flat parse tree for small, untrusted documents in JSON or MessagePack:
 * one array of nodes in document order, each container knowing where its
 * subtree ends. Integers keep all 64 bits (unsigned, or negative with a
 * flag), which jansson cannot: KV block hashes use the whole u64 range.
 * Strings point into the input, escapes left in place (the event fields
 * compared as strings never contain any).
 */
#ifndef KV_TREE_H
#define KV_TREE_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
    KV_T_NULL = 0, KV_T_TRUE, KV_T_FALSE, KV_T_UINT, KV_T_NEG, KV_T_FLOAT,
    KV_T_STR, KV_T_BIN, KV_T_ARR, KV_T_OBJ
} kv_tnode_type_t;

typedef struct {
    uint8_t         type;
    uint32_t        n;          /* containers: members (objects: key + value pairs) */
    uint32_t        end;        /* index just past this node's subtree */
    uint64_t        u;          /* UINT value, or NEG as two's complement */
    const char     *s;          /* STR / BIN bytes */
    uint32_t        len;
} kv_tnode_t;

typedef struct {
    kv_tnode_t     *nodes;
    uint32_t        n;
    uint32_t        cap;
} kv_tree_t;

/* 0, or -1 with a reason. The tree is reused across calls. */
int kv_tree_json(kv_tree_t *t, const char *buf, size_t len, char *err, size_t errlen);
int kv_tree_msgpack(kv_tree_t *t, const void *buf, size_t len, char *err, size_t errlen);
void kv_tree_free(kv_tree_t *t);

/* The value of key in object node obj, or -1. */
long kv_tree_get(const kv_tree_t *t, uint32_t obj, const char *key);
/* The i-th child of an array, by walking; use kv_tree_next to iterate. */
static inline uint32_t kv_tree_first(uint32_t node) { return node + 1; }
static inline uint32_t kv_tree_next(const kv_tree_t *t, uint32_t node) { return t->nodes[node].end; }
/* Whether node is a string equal to s. */
int kv_tree_streq(const kv_tree_t *t, uint32_t node, const char *s);

#endif
