/*
 * Active load per upstream server, shared by every nginx worker process
 * through one region of shared memory (offsets only, no pointers).
 *
 * Each process adds and releases its requests' load in two places: the
 * server's totals, which routing reads, and its own row, which remembers
 * what that process still holds. A process that dies without releasing
 * (a crash, or a reload's old worker killed at worker_shutdown_timeout)
 * leaves a row owned by a dead pid; kv_load_reap subtracts that row from
 * the totals and frees it, so leaked load disappears within a reap period.
 *
 * Servers are found by name ("upstream/host:port", through a hash), so an
 * nginx reload that reuses the region keeps the counts of servers that still
 * exist, and old workers finishing their requests release into the same
 * counters.
 *
 * The least-loaded order: each placed server sits in one group (an upstream's
 * primaries, say) and, within it, in a bucket by requests in flight per unit
 * of weight (exact up to 47, then one bucket per power of two). Every change
 * of a server's requests moves it between buckets in O(1), so the few least
 * loaded servers of a group are found without looking at the others. The
 * bucket lists are guarded by a spinlock that names its holder's pid; a
 * holder that died is detected by the next waiter, which rebuilds the lists
 * from the counters.
 */
#ifndef KV_LOAD_H
#define KV_LOAD_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define KV_LOAD_NAME_MAX  96
#define KV_LOAD_BUCKETS   64

typedef struct kv_load kv_load_t;

typedef enum {
    KV_LOAD_PREFILL_TOKENS = 0,     /* prompt tokens not yet past their first byte */
    KV_LOAD_DECODE_BLOCKS,          /* KV blocks held by requests in flight */
    KV_LOAD_REQUESTS,               /* requests in flight */
    KV_LOAD_DECODE_TOKENS,          /* output tokens requested by requests in flight */
    KV_LOAD_ACTIVE                  /* number of released-on-end counters */
} kv_load_counter_t;

typedef struct {
    int64_t     active[KV_LOAD_ACTIVE];
    uint64_t    requests_total;
    uint64_t    overlap_hits;       /* requests routed with overlap > 0 */
    uint64_t    overlap_blocks;     /* sum of overlaps */
    uint64_t    prompt_blocks;      /* sum of prompt blocks */
    double      prefill_rate;       /* learned prompt tokens per ms; 0: no sample yet */
    double      prefill_base;       /* learned ms of time to first byte that no token adds */
    double      decode_pace;        /* learned ms per output token; 0: no sample yet */
    uint64_t    sent_us;            /* kv_clock_us() of the last request sent; 0: none */
} kv_load_server_t;

size_t     kv_load_size(uint32_t max_servers, uint32_t max_rows, uint32_t max_groups);
/* Lays out a fresh table, or re-opens one (same sizes) when reuse is set. */
kv_load_t *kv_load_init(void *region, size_t size, uint32_t max_servers,
                        uint32_t max_rows, uint32_t max_groups, int reuse);
uint32_t   kv_load_capacity(const kv_load_t *ld);     /* max_servers */
uint32_t   kv_load_servers(const kv_load_t *ld);      /* names added so far */
uint32_t   kv_load_groups(const kv_load_t *ld);       /* max_groups */

/* The index of server name, adding it; -1 when the table is full. Writers
 * of names must be serialised by the caller (the nginx master at config). */
int  kv_load_server(kv_load_t *ld, const char *name, size_t len);
int  kv_load_find(const kv_load_t *ld, const char *name, size_t len);
const char *kv_load_server_name(const kv_load_t *ld, uint32_t server);

/*
 * Puts server in group (< max_groups) with weight (>= 1) in the
 * least-loaded order, or moves it there; group UINT32_MAX takes it out.
 */
void   kv_load_place(kv_load_t *ld, uint32_t server, uint32_t group, uint32_t weight);
/* Up to k servers of group, least requests per weight first (by bucket;
 * within a bucket, the longest there first). */
size_t kv_load_least(kv_load_t *ld, uint32_t group, uint32_t *out, size_t k);
/* Tests: 0 when every placed server is in the bucket its counters say and
 * every list is well linked, else a negative code. */
int    kv_load_order_check(kv_load_t *ld);

/* A row for process pid (re-using its own row if it has one); -1 if none left. */
int  kv_load_claim_row(kv_load_t *ld, pid_t pid);
void kv_load_release_row(kv_load_t *ld, int row);

/* Adds delta to one active counter of server, in row (may be -1) and totals. */
void kv_load_add(kv_load_t *ld, int row, uint32_t server, kv_load_counter_t c,
                 int64_t delta);
/* Records that a request was sent to server at now_us (kv_clock_us()): how
 * long ago tells the router whether the prefill it queued there has likely
 * started (kv_route.c, joinable). */
void kv_load_sent(kv_load_t *ld, uint32_t server, uint64_t now_us);
/* Counts a routing decision (cumulative, never reclaimed). */
void kv_load_count(kv_load_t *ld, uint32_t server, uint32_t overlap, uint32_t prompt_blocks);
void kv_load_get(const kv_load_t *ld, uint32_t server, kv_load_server_t *out);

/*
 * What the traffic teaches about a server, as exponentially weighted means
 * (weight 1/16 per sample) of the sample's numerator and denominator, so a
 * rate is a ratio of sums rather than a mean of noisy ratios:
 *   prefill: tokens = prompt tokens it had to prefill, queued ahead of the
 *            request and its own uncached ones; ms = time to first byte;
 *            read back as the least-squares line ms = base + tokens / rate
 *            (weighted means of tokens^2 and tokens x ms kept beside);
 *   decode:  tokens = output tokens; ms = first byte to the end.
 * Concurrent updates from several processes may lose a sample, never
 * corrupt one (each mean is one atomic word).
 */
void kv_load_learn_prefill(kv_load_t *ld, uint32_t server, double tokens, double ms);
void kv_load_learn_decode(kv_load_t *ld, uint32_t server, double tokens, double ms);

/* Frees the rows of dead processes, returning their load; the count reaped. */
int  kv_load_reap(kv_load_t *ld, int (*alive)(pid_t pid));
/* Rows reaped since creation. */
uint64_t kv_load_reaped(const kv_load_t *ld);

#endif
