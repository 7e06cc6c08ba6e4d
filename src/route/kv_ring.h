/*
 * The cold-placement ring: a consistent-hash ring over a fleet's server ids,
 * so that the servers a new prefix may go to are found in O(log n) and
 * depend only on the prefix's first block and the servers' ids, never on
 * local state. Every nginx instance with the same upstream therefore offers
 * the same few servers for a prefix nobody holds yet, and the decision among
 * them (least loaded, then rendezvous) places it alike everywhere while load
 * is alike.
 *
 * Each server has 16 points per unit of weight (weights above 16 count as
 * 16), so a weight-2 server is the first successor of about twice as many
 * keys.
 */
#ifndef KV_RING_H
#define KV_RING_H

#include <stddef.h>
#include <stdint.h>

#define KV_RING_POINTS     16       /* per unit of weight */
#define KV_RING_MAX_WEIGHT 16

typedef struct {
    uint64_t    hash;
    uint32_t    server;             /* the caller's index */
} kv_ring_point_t;

/* Points a ring over these weights needs (weight 0 counts as 1). */
size_t kv_ring_points(const uint32_t *weight, size_t n);

/* Fills pt (kv_ring_points() of them) for servers 0..n) and sorts it. */
void kv_ring_build(kv_ring_point_t *pt, const uint64_t *id, const uint32_t *weight,
                   size_t n);

/* Up to k distinct servers, the first k clockwise from key; the count. */
size_t kv_ring_walk(const kv_ring_point_t *pt, size_t npt, uint64_t key, uint32_t *out,
                    size_t k);

#endif
