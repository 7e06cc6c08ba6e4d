/*
 * Block hashing, wire compatible with NVIDIA Dynamo's KV router
 * (lib/kv-router/src/protocols.rs):
 *
 *   local[i] = XXH3_64(u32le tokens of full block i, seed)
 *   seq[0]   = local[0]
 *   seq[i]   = XXH3_64(le64(seq[i-1]) || le64(local[i]), 1337)
 *
 * The local hash's seed is 1337, or 1337 + XXH3_64(name) for a LoRA adapter
 * or cache salt; the chain always uses 1337, as Dynamo's router does, so an
 * index fed only local hashes (KV events) derives the same sequence hashes.
 * A trailing partial block is not hashed.
 */
#ifndef KV_HASH_H
#define KV_HASH_H

#include <stddef.h>
#include <stdint.h>

#define KV_HASH_SEED 1337ULL

/* The seed for a LoRA name or cache salt; NULL or "" gives KV_HASH_SEED. */
uint64_t kv_hash_seed(const char *salt, size_t len);

/* Local hash of one block of n token ids. */
uint64_t kv_hash_block(const uint32_t *tokens, size_t n, uint64_t seed);

/* Sequence hash of a block given its parent's sequence hash. */
uint64_t kv_hash_chain(uint64_t parent_seq, uint64_t local);

/*
 * Hashes the full blocks of tokens[0..n): fills local[] and seq[] (either may
 * be NULL) and returns the number of full blocks, n / block_size.
 */
size_t kv_hash_blocks(const uint32_t *tokens, size_t n, size_t block_size,
                      uint64_t seed, uint64_t *local, uint64_t *seq);

/*
 * The worker id a worker at address "host:port" uses when it is given none
 * (kvworker) and the router assumes for a server with no announce and no
 * kvroute_worker_id line: XXH3-64 of the address, top bit clear so that it
 * also fits Dynamo's older signed worker_id, never 0.
 */
uint64_t kv_hash_worker_id(const char *address, size_t len);

/* splitmix64's finaliser: a cheap bijective mix of 64 bits, for orders
 * derived from ids (rendezvous ranks, ring points), never for block hashes. */
static inline uint64_t kv_mix64(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

#endif
