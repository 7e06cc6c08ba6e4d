#include "kv_hash.h"

#include <string.h>
/* inline: a block's hash (64 bytes at block size 16) and a chain's (16)
 * take XXH3's short-input paths, a few dozen instructions that the
 * library's call and dispatch would double */
#define XXH_INLINE_ALL
#include <xxhash.h>

uint64_t kv_hash_seed(const char *salt, size_t len)
{
    if (salt == NULL || len == 0)
        return KV_HASH_SEED;
    return KV_HASH_SEED + XXH3_64bits(salt, len);   /* wraps, as Rust's wrapping_add */
}

static int host_is_little_endian(void)
{
    const uint16_t one = 1;
    return *(const uint8_t *)&one == 1;
}

uint64_t kv_hash_block(const uint32_t *tokens, size_t n, uint64_t seed)
{
    if (host_is_little_endian())
        return XXH3_64bits_withSeed(tokens, n * sizeof(uint32_t), seed);

    /* Dynamo hashes the little-endian bytes on every host. */
    uint8_t buf[4096];
    XXH3_state_t st;
    XXH3_64bits_reset_withSeed(&st, seed);
    for (size_t i = 0; i < n; ) {
        size_t k = 0;
        for (; i < n && k + 4 <= sizeof(buf); i++, k += 4) {
            uint32_t t = tokens[i];
            buf[k] = t; buf[k + 1] = t >> 8; buf[k + 2] = t >> 16; buf[k + 3] = t >> 24;
        }
        XXH3_64bits_update(&st, buf, k);
    }
    return XXH3_64bits_digest(&st);
}

static void put_le64(uint8_t *p, uint64_t v)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(p, &v, 8);       /* one store; gcc does not merge the loop below */
#else
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
#endif
}

uint64_t kv_hash_chain(uint64_t parent_seq, uint64_t local)
{
    uint8_t buf[16];
    put_le64(buf, parent_seq);
    put_le64(buf + 8, local);
    return XXH3_64bits_withSeed(buf, sizeof(buf), KV_HASH_SEED);
}

size_t kv_hash_blocks(const uint32_t *tokens, size_t n, size_t block_size,
                      uint64_t seed, uint64_t *local, uint64_t *seq)
{
    if (block_size == 0)
        return 0;
    size_t nb = n / block_size;
    uint64_t prev = 0;
    for (size_t i = 0; i < nb; i++) {
        uint64_t h = kv_hash_block(tokens + i * block_size, block_size, seed);
        uint64_t s = i == 0 ? h : kv_hash_chain(prev, h);
        if (local)
            local[i] = h;
        if (seq)
            seq[i] = s;
        prev = s;
    }
    return nb;
}

uint64_t kv_hash_worker_id(const char *address, size_t len)
{
    uint64_t id = XXH3_64bits(address, len) & 0x7fffffffffffffffULL;

    return id ? id : 1;
}
