/*
 * Shared decisions: what one nginx instance tells the others sharing its
 * NATS about its routing (docs/PROTOCOL.md, "Shared decisions").
 *
 * Each instance publishes, on P.kvroute.decisions (kv_proto.h):
 *   - its recent decisions: worker id and the prompt's sequence hashes (up
 *     to a bound), which the others record in their approximate index (or
 *     their pending index, in events mode), as if they had made them;
 *   - which server made each Responses API response that passed through it
 *     (a response record, below), so that any instance sends a request
 *     continuing that response to that server (kv_respmap.h);
 *   - its own in-flight load per server, as absolute values (not deltas:
 *     a lost message is repaired by the next one), for the servers whose
 *     load changed since the last message, and every refresh period for
 *     those still nonzero.
 * Each instance adds the others' load to its load table (through a row of
 * its own, so that routing sees one total) and forgets an entry that no
 * message refreshed within the lease: an instance that dies or loses NATS
 * leaves no phantom load past the lease.
 *
 * The nginx worker processes never talk to NATS: they append decisions to
 * the zone's ring (kv_dring.h); the helper process drains it here, at most
 * max_records per message and one message per interval (the rest waits in
 * the ring, which drops and counts what does not fit).
 *
 * Threading: cnats calls the receive handler on its own thread; it and
 * kv_share_tick take one mutex. on_blocks is called with it held.
 *
 * Pure C, no nginx. Without servers (NULL) nothing connects and publish
 * (if set) receives the messages: unit tests drive it that way.
 */
#ifndef KV_SHARE_H
#define KV_SHARE_H

#include <stddef.h>
#include <stdint.h>

#include "kv_dring.h"
#include "kv_load.h"

#define KV_SHARE_MAGIC        "KVD1"
#define KV_SHARE_VERSION      1
#define KV_SHARE_HEADER       32
#define KV_SHARE_MAX_HASHES   KV_DRING_HASHES
#define KV_SHARE_MAX_RECORDS  1024      /* per message, what a receiver accepts */
#define KV_SHARE_MAX_LOAD     1024
#define KV_SHARE_MAX_VALUE    ((int64_t) 1 << 40)
#define KV_SHARE_INSTANCES    64        /* other instances tracked at once */
/*
 * A response record: a decision record with first = KV_SHARE_RESPONSE and
 * one hash, the key of a response id (kv_respid.h), worker_id the server
 * that made it. Receivers from before it take it for a decision whose one
 * hash is the parent of no new block, and record nothing: no version
 * change was needed.
 */
#define KV_SHARE_RESPONSE     (1u << 24)

typedef struct kv_share kv_share_t;

typedef struct {
    const char *servers;            /* "nats://h:p[,...]"; NULL: no NATS (tests) */
    const char *subject;            /* default prefix + ".kvroute.decisions" */
    const char *prefix;             /* default "namespace.dynamo.component.backend" */
    const char *user, *password, *token;
    uint32_t    lease_ms;           /* remote load kept this long unrefreshed; default 3000 */
    uint32_t    interval_ms;        /* at most one message per interval; default 20 */
    uint32_t    max_records;        /* decision records per message; default 64 */
    uint64_t    instance_id;        /* this instance (nonzero) */
    /* a remote decision: worker_id holds seq[0..n), seq[0] being request block
     * `first` (when first > 0, seq[0] is the parent of the new blocks) */
    void      (*on_blocks)(void *arg, uint64_t worker_id, const uint64_t *seq,
                           uint32_t first, uint32_t n);
    /* a remote response record: worker_id made the response whose id has key */
    void      (*on_response)(void *arg, uint64_t worker_id, uint64_t key);
    void       *arg;
    /* tests: receives each message instead of NATS */
    int       (*publish)(void *arg, const void *buf, size_t len);
    void       *publish_arg;
} kv_share_config_t;

/* ring: the zone's decision ring (its consumer must be this process);
 * ld, row: the load table and the row remote load is added through. */
kv_share_t *kv_share_create(const kv_share_config_t *cfg, kv_dring_t *ring,
                            kv_load_t *ld, int row, char *err, size_t errlen);
/* Connects in the background (retrying forever); never blocks on NATS. */
int  kv_share_start(kv_share_t *s, char *err, size_t errlen);
/* Drains the ring and publishes (rate limited), expires leases. Call often
 * (every interval_ms or so). */
void kv_share_tick(kv_share_t *s, uint64_t now_ms);
/* Disconnects, takes the remote load back out of the table. */
void kv_share_destroy(kv_share_t *s);

/* One message from NATS: 0 applied (or our own: ignored), -1 refused
 * (malformed; counted in kv_dring_share()->rejected). */
int  kv_share_receive(kv_share_t *s, const void *msg, size_t len, uint64_t now_ms);

/* The key a load entry names its server by (the load table's name,
 * "upstream/host:port": instances that share must name them alike). */
uint64_t kv_share_server_key(const char *name, size_t len);

#endif
