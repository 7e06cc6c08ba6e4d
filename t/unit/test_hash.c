/* Block hashing against Dynamo's published test vectors (docs/DESIGN.md). */
#include "kvtest.h"
#include "kv_hash.h"

TEST(local_hash_vector)
{
    uint32_t t[] = {1, 2, 3, 4};
    CHECK_EQ_U64(kv_hash_block(t, 4, KV_HASH_SEED), 14643705804678351452ULL);
}

TEST(sequence_hash_vector)
{
    uint32_t t[] = {11, 22, 33, 44, 55, 66, 77, 88};
    uint64_t local[2], seq[2];
    CHECK_EQ_U64(kv_hash_blocks(t, 8, 4, KV_HASH_SEED, local, seq), 2);
    CHECK_EQ_U64(local[0], 4117275816416024698ULL);
    CHECK_EQ_U64(local[1], 6081346995852963768ULL);
    CHECK_EQ_U64(seq[0], local[0]);
    CHECK_EQ_U64(seq[1], 5947898228081096063ULL);
}

TEST(partial_block_not_hashed)
{
    uint32_t t[33] = {0};
    CHECK_EQ_U64(kv_hash_blocks(t, 11, 16, KV_HASH_SEED, NULL, NULL), 0);
    CHECK_EQ_U64(kv_hash_blocks(t, 16, 16, KV_HASH_SEED, NULL, NULL), 1);
    CHECK_EQ_U64(kv_hash_blocks(t, 33, 16, KV_HASH_SEED, NULL, NULL), 2);
    CHECK_EQ_U64(kv_hash_blocks(t, 33, 0, KV_HASH_SEED, NULL, NULL), 0);
}

TEST(block_size_16_vector)
{
    uint32_t t[16];
    for (int i = 0; i < 16; i++)
        t[i] = i;
    CHECK_EQ_U64(kv_hash_block(t, 16, KV_HASH_SEED), 15310707395893867146ULL);
}

TEST(salt_changes_seed)
{
    uint32_t t[] = {1, 2, 3, 4};
    uint64_t seed = kv_hash_seed("my-adapter", 10);
    CHECK_EQ_U64(seed, 2360313164392603308ULL);
    CHECK_EQ_U64(kv_hash_block(t, 4, seed), 15633847640104431966ULL);
    CHECK_EQ_U64(kv_hash_seed("", 0), KV_HASH_SEED);
    CHECK_EQ_U64(kv_hash_seed(NULL, 0), KV_HASH_SEED);
}

TEST(salt_does_not_change_chain)
{
    /* the chain is seeded with 1337 whatever the salt */
    uint32_t t[] = {11, 22, 33, 44, 55, 66, 77, 88};
    uint64_t seed = kv_hash_seed("tenant-a", 8), local[2], seq[2];
    kv_hash_blocks(t, 8, 4, seed, local, seq);
    CHECK(local[0] != 4117275816416024698ULL);
    CHECK_EQ_U64(seq[1], kv_hash_chain(local[0], local[1]));
    CHECK_EQ_U64(kv_hash_chain(4117275816416024698ULL, 6081346995852963768ULL),
                 5947898228081096063ULL);
}

int main(void)
{
    RUN(local_hash_vector);
    RUN(sequence_hash_vector);
    RUN(partial_block_not_hashed);
    RUN(block_size_16_vector);
    RUN(salt_changes_seed);
    RUN(salt_does_not_change_chain);
    return kvt_done();
}
