/* What the white-box index tests (test_index_writer.c, test_index_reuse.c,
 * which compile kv_index.c in with their own hooks) share: a chain of
 * blocks and one Stored event of it. Included after kv_index.c. */
#ifndef INDEX_CHAIN_H
#define INDEX_CHAIN_H

static char err[256];

/* n blocks: tokens hashes base, base + 1, ...; seq chained from them */
static void chain(uint64_t base, size_t n, uint64_t *tok, uint64_t *seq)
{
    size_t i;

    for (i = 0; i < n; i++) {
        tok[i] = base + i;
        seq[i] = i == 0 ? tok[0] : kv_hash_chain(seq[i - 1], tok[i]);
    }
}

/* One Stored event of n (at most 128) blocks by worker, at time 1000 */
static int store(kv_index_t *ix, uint64_t worker, const uint64_t *tok, const uint64_t *seq,
                 size_t n)
{
    kv_stored_block_t b[128];
    kv_event_t        ev = { .worker_id = worker, .kind = KV_EVENT_STORED, .blocks = b,
                             .n_blocks = n };
    size_t            i;

    for (i = 0; i < n; i++) {
        b[i].block_hash = seq[i];
        b[i].tokens_hash = tok[i];
    }
    return kv_index_apply(ix, &ev, 1000, err, sizeof(err));
}

#endif
