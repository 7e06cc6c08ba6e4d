/* The routing decision (see kv_route.h for the policy). */
#include <math.h>
#include <stdlib.h>

#include "kv_hash.h"
#include "kv_route.h"
#include "kv_score.h"

void kv_route_config_init(kv_route_config_t *cfg)
{
    cfg->policy = KV_ROUTE_TTFT;
    cfg->block_size = 16;
    cfg->busy_prefill_tokens = 0;
    cfg->busy_decode_blocks = 0;
    cfg->worker_load = KV_ROUTE_LOAD_LOCAL;
    cfg->slack = 0.25;
    cfg->prefill_rate = 8;
    cfg->decode_pace = 20;
    cfg->max_tokens = 256;
    cfg->overlap_weight = 1.0;
    cfg->temperature = 0;
}

uint32_t kv_route_overlap(const kv_route_server_t *s)
{
    uint32_t ix = s->trusted ? s->overlap_index : 0;

    return ix > s->overlap_pending ? ix : s->overlap_pending;
}

const char *kv_route_why_name(kv_route_why_t why)
{
    static const char *names[] = { "", "sticky", "spill", "cold", "cost", "session", "shared",
                                   "seed", "response" };

    return (unsigned) why < sizeof(names) / sizeof(names[0]) ? names[why] : "";
}

int kv_route_why_reads_blocks(kv_route_why_t why)
{
    return why == KV_ROUTE_WHY_SPILL || why == KV_ROUTE_WHY_SEED
           || why == KV_ROUTE_WHY_SHARED;
}

static uint32_t block_size_of(const kv_route_config_t *cfg)
{
    return cfg->block_size ? cfg->block_size : 16;
}

static uint64_t prefill_load(const kv_route_server_t *s, const kv_route_config_t *cfg)
{
    if (cfg->worker_load == KV_ROUTE_LOAD_MAX && s->reported
        && s->reported_prefill_tokens > s->prefill_tokens)
    {
        return s->reported_prefill_tokens;
    }
    return s->prefill_tokens;
}

uint64_t kv_route_prefill_load(const kv_route_server_t *s, const kv_route_config_t *cfg)
{
    return prefill_load(s, cfg);
}

static uint64_t decode_load(const kv_route_server_t *s, const kv_route_config_t *cfg)
{
    if (cfg->worker_load == KV_ROUTE_LOAD_MAX && s->reported
        && s->reported_decode_blocks > s->decode_blocks)
    {
        return s->reported_decode_blocks;
    }
    return s->decode_blocks;
}

uint64_t kv_route_tree_blocks(uint64_t indexed, int index_lags, const kv_route_server_t *s,
                              const kv_route_config_t *cfg)
{
    uint32_t bs = block_size_of(cfg);

    return index_lags ? indexed + (prefill_load(s, cfg) + bs - 1) / bs : indexed;
}

static uint32_t weight_of(const kv_route_server_t *s)
{
    return s->weight ? s->weight : 1;
}

static uint64_t cached(const kv_route_server_t *s, const kv_route_request_t *rq, uint32_t bs)
{
    uint64_t c = (uint64_t) kv_route_overlap(s) * bs;

    return c < rq->prompt_tokens ? c : rq->prompt_tokens;
}

/* What the server prefills for the request: a batch's other prompts too
 * (their prefix shared with the first is counted once, in it). */
static uint64_t uncached(const kv_route_server_t *s, const kv_route_request_t *rq, uint32_t bs)
{
    return rq->prompt_tokens - cached(s, rq, bs) + rq->batch_tokens;
}

/* Weighted rendezvous: the server with the lowest -ln(u)/weight for
 * u = hash(key, id) in (0, 1) ranks first for key. */
static double rendezvous(uint64_t key, const kv_route_server_t *s)
{
    double u = ((double) (kv_mix64(key ^ kv_mix64(s->id)) >> 11) + 0.5) / 9007199254740992.0;

    return -log(u) / weight_of(s);
}

static int busy(const kv_route_server_t *s, const kv_route_config_t *cfg)
{
    return (cfg->busy_prefill_tokens && prefill_load(s, cfg) >= cfg->busy_prefill_tokens)
           || (cfg->busy_decode_blocks && decode_load(s, cfg) >= cfg->busy_decode_blocks);
}

static int candidate(const kv_route_server_t *s)
{
    return s->usable && !s->busy;
}

/* --- ttft ---------------------------------------------------------------- */

static double load_of(const kv_route_server_t *s)
{
    return (double) s->requests / weight_of(s);
}

/*
 * a before b in the sticky order; home: the session's home or -1. Between
 * equal prefixes the sooner first token wins, not the sooner end (ttft +
 * output tokens x decode pace): the learned paces of identical engines
 * differ by a third, and times a few hundred output tokens that noise
 * outweighed every queue (t/unit/test_route.c,
 * ttft_equal_prefix_goes_to_the_sooner_first_token). L bounds the requests
 * each server decodes.
 */
static int stickier(const kv_route_server_t *a, const kv_route_server_t *b, uint64_t key,
                    const kv_route_server_t *home)
{
    uint32_t oa = kv_route_overlap(a), ob = kv_route_overlap(b);

    if (oa != ob) {
        return oa > ob;
    }
    if (home && (a == home || b == home)) {
        return a == home;
    }
    if (a->ttft != b->ttft) {
        return a->ttft < b->ttft;
    }
    if (a->tree_blocks != b->tree_blocks) {
        return a->tree_blocks < b->tree_blocks;
    }
    return rendezvous(key, a) < rendezvous(key, b);
}

#define IN_L  1                         /* load bound */
#define IN_E  2                         /* ... and the estimate within the slack */
#define IN_C  4                         /* ... and the queue within the slack */
#define IN_Q  8                         /* ... and the queue within one step of the least */
#define IN_K  16                        /* in E or Q, and under the bounded-load capacity */

/*
 * The most prompt tokens one engine step is taken to prefill: vLLM's
 * chunked-prefill budget (max_num_batched_tokens) for its API server is
 * 2,048 by default, 8,192 on GPUs of 70 GB and more; SGLang's
 * chunked_prefill_size likewise grows with GPU memory from 2,048. The
 * smallest is taken: too small means a long prompt shares a step less
 * often, never that it waits behind a longer queue.
 * A cold request joins a queue up to one step longer than the least (the
 * step's fixed part and this many tokens, pick_cold): what a request
 * batched into a step shares with the queued prompts is that step, not its
 * whole prefill.
 */
#define KV_ROUTE_STEP_TOKENS  2048

/* The first server with a flag in mask in key's rendezvous order; -1 if
 * none. */
static int first_in_order(const kv_route_server_t *s, size_t n, uint64_t key, int mask)
{
    size_t i;
    int    first = -1;

    for (i = 0; i < n; i++) {
        if ((s[i].eligible & mask)
            && (first < 0 || rendezvous(key, &s[i]) < rendezvous(key, &s[first])))
        {
            first = (int) i;
        }
    }
    return first;
}

/*
 * Among cold candidates of equal cost, a server whose index holds nothing
 * comes before the rendezvous order: on an idle fleet the rendezvous hash
 * alone puts distinct prefixes on the same server about as often as chance
 * (8 system prompts over 8 idle engines: two on one engine nearly always),
 * and a second prefix there leaves another engine nothing to be sticky
 * with (busy-time spread 1.4 at one instance, docs/BENCHMARKS.md
 * "Scale-out round 3"). Every instance sees the same events (or shared
 * decisions), so they still agree once those have reached them (within
 * the event lag they may differ, where rendezvous alone would not);
 * between empty servers, and between servers that hold something, the
 * rendezvous order decides as before.
 */
static int colder(const kv_route_server_t *a, const kv_route_server_t *b, uint64_t key)
{
    if ((a->tree_blocks == 0) != (b->tree_blocks == 0)) {
        return a->tree_blocks == 0;
    }
    return rendezvous(key, a) < rendezvous(key, b);
}

/*
 * pick_cold's order among servers with the fewest requests in flight:
 * colder()'s, with a server whose queued prefill the request can still
 * join (joinable: a prefill queued, sent there within the server's step
 * time) before one where it cannot, after the empty-index rule and before
 * rendezvous (pick_cold says why).
 */
static int sharer(const kv_route_server_t *a, const kv_route_server_t *b, uint64_t key)
{
    if ((a->tree_blocks == 0) == (b->tree_blocks == 0) && a->joinable != b->joinable) {
        return a->joinable;
    }
    return colder(a, b, key);
}

/*
 * Cold: no server's cached overlap saves the request a meaningful part of
 * its prefill, so its prefill is the same work anywhere and the estimate
 * has nothing to tell the servers apart that counting requests does not:
 * choose the way least_conn does, the fewest requests in flight per unit
 * of weight, among the servers of Q (load-bounded, and not a queue more
 * than one engine step above the least queue). Ties (sharer()): a server
 * the index holds nothing of, then a server with a prefill queued, then
 * the first in the prefix's rendezvous order (so independent routers agree
 * on an idle fleet).
 *
 * Why a queued prefill first among ties (round 10): what a cold prompt
 * costs everyone else is the stall its prefill step puts on every stream
 * decoding where it runs. Among servers with as many requests in flight,
 * one whose queued prompts have not had their first token yet has fewer
 * streams decoding, and a prefill step the new prompt may share (engines
 * batch queued prefills into one step); one with nothing queued gives it a
 * step of its own that stalls all of its streams. The opposite order (the
 * estimate as the tie-break: nothing queued first) made short-prompt ITL
 * +27% over least_conn's (docs/BENCHMARKS.md, round 4); rendezvous alone,
 * blind to the queues, -1..+15% over rounds 5-10; this order -4..+2% in
 * round 10's five runs (seeds 16-18), where rendezvous alone was +5..+15%
 * in the same runs, and the streams decoding where each request arrived
 * (from the decision logs) were fewer than with rendezvous alone in every
 * run. A queued prefill may already be running, and the request then
 * waits for its step to end: time to first token +3..+6% against
 * rendezvous alone's, +1..+4% against least_conn's; Q bounds that wait to
 * a step.
 *
 * Why only a prefill sent within the server's step time (joinable, 2026-11-30):
 * engines admit waiting prompts at the start of a step, so a prompt sent
 * longer ago than a step has most likely started, and a request joining
 * it shares nothing: it waits for that step, then runs one of its own.
 * Joining every queue cost short prompts 9-12% of time to first token
 * against least_conn's on 16 engines (about two requests a server, where
 * the queued prefill has usually started); joining only one sent within a
 * step (the learned decode pace, ms per output token) gave 1.01-1.03x, and
 * on 8 engines kept ITL within 5% as before (docs/BENCHMARKS.md, "Joining
 * only a prefill not started"). The send time is this zone's own: another
 * nginx instance's queued prefill is never joined, only counted.
 *
 * Why Q's bound stays, though least_conn has none: without it (round 5,
 * alternated A/B, 4 runs) short-prompt ITL was +2..+6% over least_conn's
 * against +3..+8% with it, but mooncake's time to first token went from
 * -34..-36% against least_conn's to -18%, and sysprompt's hit rate from
 * 99% of the oracle to 91%: a cold long prompt behind a long queue costs
 * more than a decoding stream more does; a bound at the slack of its
 * decode time instead lost mooncake alike (-19%).
 *
 * Why Q's bound is one engine step, not the request's whole prefill
 * (round 5b) nor its own first step (round 10): what a cold request gains
 * by joining a queue is a share of the step those queued prompts will run
 * in (no prefill step of its own, no extra stall for the streams decoding
 * there); that is worth a wait of at most one step, the step's fixed part
 * (the learned base) plus KV_ROUTE_STEP_TOKENS tokens, whatever the
 * request's own size. Round 5b's bound counted the request's own tokens up
 * to a step's: for a 256-token prompt a queue of three such prompts above
 * the least shut a server out, and 26-68 of 720 short requests went to a
 * server with more requests in flight than the least (ITL +5..+15% over
 * least_conn's, against +3..+7% with the whole step, the same runs; for a
 * prompt of a step or more the two bounds are the same). Round 4-5's
 * bound was the request's whole own prefill: for a short prompt that is
 * less than a step and nothing changes, but a 20k-token prompt could join
 * a queue ~1.7 s longer than the least while another stood empty, and on
 * bench-disagg's mix of 8-32k and 0.5-2k-token prompts with no reuse the
 * aggregated fleet's mean time to first token was +29-31% against round
 * 3's placement, long and short prompts alike (docs/BENCHMARKS.md,
 * "Disaggregation round 4" and "Round 5b").
 *
 * Why rendezvous and not a rotation among the last ties (least_conn's
 * weighted rotation is even over time, rendezvous random over unrelated
 * prompts): a rotation measured no better on short prompts (+4/+4/+7% ITL
 * against +8/+3/+8%, the same runs; two runs of least_conn alone differ by
 * 4%, round 5), and
 * independent nginx instances would then place the same new prefix
 * differently among equals (on an idle fleet, or under worker_load=max,
 * where they count the same requests), where rendezvous makes them agree
 * (t/integration/test_multi_instance.py, test_cold_spread.py).
 *
 * Why not a cost: round 2's cold cost (its own time to first token plus
 * the stall its prefill imposes on each request in flight there) weighs
 * every request in flight by the server's learned line, and those lines
 * differ between identical servers by 2x and more in their fixed part
 * (docs/BENCHMARKS.md, round 3), so for short prompts the noise times the
 * requests in flight outweighed a request more or less: a server that
 * learned a low base took cold requests up to the load bound, and decode
 * batches spread worse than counting connections (short-prompt ITL
 * +13..17% over least_conn's on a quiet machine, "Round 3b"). A queue
 * bound at the slack of the request's own prefill (C) shut out a server
 * with one short prompt queued, which the engine batches into the same
 * step, while any had none: each cold request then started a prefill step
 * of its own, stalling every decoding stream there ("Round 3b"). Q's bound
 * is one step there (the base included), so a long queue is still avoided.
 */
static int pick_cold(kv_route_server_t *s, size_t n, uint64_t key)
{
    double  least = INFINITY;
    size_t  i;
    int     pick = -1;

    for (i = 0; i < n; i++) {
        if (s[i].eligible & IN_Q) {
            s[i].cold = load_of(&s[i]);
            least = fmin(least, s[i].cold);
        }
    }
    for (i = 0; i < n; i++) {
        if ((s[i].eligible & IN_Q) && s[i].cold <= least
            && (pick < 0 || sharer(&s[i], &s[pick], key)))
        {
            pick = (int) i;
        }
    }
    return pick;
}

/*
 * Cold, for servers that decode nothing (a prefill pool, kv_prefill.h:
 * every decode pace 0): nobody holds the prompt, so its prefill is the same
 * work anywhere; what differs is what it costs everyone. On server s, with r requests in
 * flight, it waits for the prefill queued there and then stalls each of
 * those r decoding streams while it prefills: for its tokens, and for the
 * fixed part of a prefill step (the learned base) unless a prefill is
 * already queued there, which it joins (engines batch queued prefills into
 * one step). So, in ms of everyone's latency:
 *
 *   cost(s) = ttft(s) + r(s) x (tokens / rate(s) + (queued(s) ? 0 : base(s)))
 *
 * The lowest cost among the servers of C (load-bounded, and the queue it
 * would wait behind within the slack of its own prefill, which bounds what
 * its time to first token pays for the others' gain) wins; costs within one
 * output token's time are equal, and among those colder() decides.
 */
static int pick_cold_cost(kv_route_server_t *s, size_t n, uint64_t key, uint64_t out)
{
    double  cost, best = INFINITY, own;
    size_t  i;
    int     pick = -1;

    for (i = 0; i < n; i++) {
        if (!(s[i].eligible & IN_C)) {
            continue;
        }
        own = s[i].ttft - s[i].wait - s[i].base;
        cost = s[i].ttft + (double) s[i].requests * (own + (s[i].wait > 0 ? 0 : s[i].base));
        s[i].cold = cost;
        best = fmin(best, cost);
    }
    for (i = 0; i < n; i++) {
        if ((s[i].eligible & IN_C) && s[i].cold <= best + s[i].decode_ms / (double) out
            && (pick < 0 || colder(&s[i], &s[pick], key)))
        {
            pick = (int) i;
        }
    }
    return pick;
}

/*
 * Spill: the servers holding the prefix are all outside E (saturated), so
 * the request goes to a server of E that holds none of it, and that server
 * joins the prefix's set: the set grows by one server each time all of its
 * members are saturated, and no faster (the next request finds the new
 * member in E and sticks to it), so it stays as small as the prefix's load
 * allows, and warm. Which server joins: among those of E with the fewest
 * requests in flight per unit of weight (as the cold rule), those holding
 * the fewest indexed blocks per unit of weight, give or take one prompt's
 * blocks (band), and among them the first in the prefix's rendezvous order.
 *
 * The blocks come first because the rendezvous order alone gave each hot
 * prefix the same few servers: 8 hot prefixes over 64 engines left 13-27
 * engines without a single request and a busy-time spread of 2.0-2.6
 * (docs/BENCHMARKS.md, "Scale-out round 3"); a server holding little draws
 * little sticky traffic, so it is where the spread has room. The band and
 * the rendezvous order after it keep distinct prefixes spilling at once
 * apart: nginx instances that learn of each other's requests only from the
 * workers' reports and events (tens of ms late) would otherwise all send
 * their spills to the one emptiest server ("Scale-out round 4"). Every input
 * is the same on instances that see the same load and events, so they
 * agree.
 */
static int pick_spill(const kv_route_server_t *s, size_t n, uint64_t key, double band, int mask)
{
    double least = INFINITY, fewest = INFINITY;
    size_t i;
    int    pick = -1;

    for (i = 0; i < n; i++) {
        if (s[i].eligible & mask) {
            least = fmin(least, load_of(&s[i]));
        }
    }
    for (i = 0; i < n; i++) {
        if ((s[i].eligible & mask) && load_of(&s[i]) <= least) {
            fewest = fmin(fewest, (double) s[i].tree_blocks / weight_of(&s[i]));
        }
    }
    for (i = 0; i < n; i++) {
        if ((s[i].eligible & mask) && load_of(&s[i]) <= least
            && (double) s[i].tree_blocks / weight_of(&s[i]) < fewest + band
            && (pick < 0 || rendezvous(key, &s[i]) < rendezvous(key, &s[pick])))
        {
            pick = (int) i;
        }
    }
    return pick;
}

/*
 * Shared head: the longest prefix any server of E holds is held by two
 * servers or more (every candidate counted, saturated or not), so it is a
 * head that several conversations share (a system prompt) and the request
 * starts a branch of its own there, not the continuation of one server's
 * conversation. Where the branch goes, its conversation's later turns go
 * (they stick to it), so the choice places future load, and the sticky
 * rule alone would put every new branch on the head's holders until their
 * queue passes a whole prefill (E's saved credit) or their requests the
 * mean's slack + 1 (L): on 64 engines, where the mean is below one request,
 * that left 11-24 engines without a single request and a busy-time spread
 * of 1.9-2.3 (docs/BENCHMARKS.md, "Routing round 7").
 *
 * So a branch is placed with bounded loads (Mirrokni, Thorup, Zadimoghaddam,
 * consistent hashing with bounded loads): a server may take it only while
 * its requests in flight, this one included, stay within the capacity
 * ceil((1 + slack) x (requests in flight + 1) x weight / total weight),
 * and only if it is in E or in Q (the cold rule's queue bound: a server
 * seeded with the head prefills it as a cold request would, so the same
 * bound on the queue it waits behind; E alone would hold only the head's
 * holders, whose cached estimate no idle server's full prefill is within
 * the slack of): K. Among K, a server holding part of the prompt sticks as
 * before (stickier()); if none does, the spill order (pick_spill: fewest
 * requests, fewest blocks within a band, rendezvous) seeds a new server,
 * which then holds the head too. The capacity is the mean's, rounded up:
 * where servers run many requests each (8 engines under load) it is L's
 * bound give or take one, where they run less than one (a large fleet) it
 * keeps a new branch off a holder busy with another while some server is
 * idle. A continuation (its longest prefix held by one server) keeps the
 * sticky rule: moving it would redo its whole conversation. If K is empty
 * (never at a capacity of at least one), the sticky rule decides.
 *
 * The resident bound: where a branch goes, its conversation's later turns
 * go, so what a server takes now adds to its work for the conversation's
 * life, which its requests in flight at this instant do not show. On 64
 * engines, holders with room at the moment took branch after branch: the
 * busiest engines ran 13-17 conversations against a mean of 9, a busy-time
 * spread of 1.5-1.7 (docs/BENCHMARKS.md, "Scale-out round 6"). So K also
 * leaves out a server whose indexed blocks per unit of weight (tree_blocks,
 * what its conversations stored; every instance sees the same through the
 * events) are above (1 + slack) x the candidates' mean plus the branch's
 * own blocks (the prompt past the head): the branch goes to a holder
 * nearer the fleet's share, or seeds one. When every cache is full (a
 * real cluster) the blocks are equal everywhere, every server is within
 * the bound and the rule is the one before it.
 *
 * The rule acts only while the fleet runs at most about a request a
 * server: requests in flight, this one included, at most (1 + slack) x the
 * total weight, where the capacity is one or two requests and a holder's
 * next branch would leave a server idle for want of it. Beyond that the
 * sticky rule decides, and its own load bound (L: the mean's slack + 1)
 * spreads the load: the capacity, the mean rounded up, is stricter than L
 * by about one request, and on 8 engines at about two requests a server it
 * seeded branches off holders running three with nothing queued (a
 * 256-word question behind nothing), each redoing a 2,048-word head
 * elsewhere: text's hit rate 0.608-0.622 against 0.626 before the rule
 * (88-90% of the load-bounded oracle), chat's 0.633-0.637 against 0.646.
 * With the gate, in the same runs, text 0.631-0.640 (91-92%) and chat
 * 0.639-0.647 (four runs each), hotprefix, sysprompt and mooncake within
 * main's run-to-run range, and 64 engines keep the rule's figures
 * (docs/BENCHMARKS.md, "Routing round 8"). Tried and dropped there:
 * a gate at one request a server (no slack) won chat (0.647) and text
 * (0.626) but, 64 engines running about one request a server, it turned
 * the rule off half the time there (8 instances: busy spread 1.85 against
 * 1.70, hit -0.006); a gate on "some server is idle" changes nothing on 8
 * engines, whose seeds went to servers idle at that moment; comparing the
 * seed's estimated time to first token with the holder's (seed only where
 * lower) won text (0.636) but not chat (0.634) and lost the 64-engine gain
 * (spread 2.0-2.2 against 1.6-1.8, hit 0.78-0.80 against 0.81): an idle
 * server's full prefill rarely beats a holder's estimate.
 */
static int pick_shared(kv_route_server_t *s, size_t n, uint64_t key, uint32_t longest,
                       const kv_route_server_t *home, double slack, double band,
                       kv_route_why_t *why)
{
    double  reqs = 0, weights = 0, blocks = 0, cap, most;
    size_t  i, holders = 0, k = 0;
    int     pick = -1, held = 0;

    for (i = 0; i < n; i++) {
        if (candidate(&s[i])) {
            reqs += (double) s[i].requests;
            weights += weight_of(&s[i]);
            blocks += (double) s[i].tree_blocks;
            holders += kv_route_overlap(&s[i]) >= longest;
        }
    }
    if (holders < 2 || reqs + 1 > (1 + slack) * weights) {
        return -1;
    }
    /* the resident bound (above): band is the prompt's blocks */
    most = (1 + slack) * blocks / weights + fmax(0, band - (double) longest);
    for (i = 0; i < n; i++) {
        cap = ceil((1 + slack) * (reqs + 1) * weight_of(&s[i]) / weights);
        if ((s[i].eligible & (IN_E | IN_Q)) && (double) s[i].requests + 1 <= cap
            && (double) s[i].tree_blocks / weight_of(&s[i]) <= most)
        {
            s[i].eligible |= IN_K;
            held |= kv_route_overlap(&s[i]) > 0;
            k++;
        }
    }
    if (k == 0) {
        return -1;
    }
    if (!held) {
        *why = KV_ROUTE_WHY_SEED;
        return pick_spill(s, n, key, band, IN_K);
    }
    *why = KV_ROUTE_WHY_SHARED;
    for (i = 0; i < n; i++) {
        if ((s[i].eligible & IN_K) && (pick < 0 || stickier(&s[i], &s[pick], key, home))) {
            pick = (int) i;
        }
    }
    return pick;
}

/* prompt tokens per ms: the learned rate, or lrate (the measured servers'
 * mean per unit of weight) scaled by the weight before a sample */
static double rate_of(const kv_route_server_t *s, double lrate)
{
    return s->prefill_rate > 0 ? s->prefill_rate : lrate * weight_of(s);
}

static int pick_ttft(kv_route_server_t *s, size_t n, const kv_route_request_t *rq,
                     const kv_route_config_t *cfg, uint64_t rnd, kv_route_why_t *why)
{
    uint32_t bs = block_size_of(cfg);
    uint64_t out = rq->max_tokens ? rq->max_tokens : cfg->max_tokens ? cfg->max_tokens : 1;
    uint64_t key = rq->nseq ? rq->seq[0] : rnd;
    double   best = INFINITY, loads = 0, mean, rate, base, pace;
    double   lrate = 0, lbase = 0, lpace = 0, minwait = INFINITY, grain, step;
    size_t   i, m = 0, nrate = 0, npace = 0;
    int      pick = -1, held_outside = 0, home = -1, decodes = 0;
    uint32_t longest = 0;

    /* a server the traffic has not measured yet is taken to be like those
     * it has (per unit of weight); the configured defaults stand in only
     * before any sample, so a new server neither looks faster than its
     * measured peers (and draws every request) nor slower */
    for (i = 0; i < n; i++) {
        if (candidate(&s[i]) && s[i].prefill_rate > 0) {
            lrate += s[i].prefill_rate / weight_of(&s[i]);
            lbase += s[i].prefill_base;
            nrate++;
        }
        if (candidate(&s[i]) && s[i].decode_pace > 0) {
            lpace += s[i].decode_pace;
            npace++;
        }
    }
    lrate = nrate ? lrate / nrate : cfg->prefill_rate;
    lbase = nrate ? lbase / nrate : 0;
    lpace = npace ? lpace / npace : cfg->decode_pace;

    for (i = 0; i < n; i++) {
        if (!candidate(&s[i])) {
            continue;
        }
        rate = rate_of(&s[i], lrate);
        base = s[i].prefill_rate > 0 ? s[i].prefill_base : lbase;
        pace = s[i].decode_pace > 0 ? s[i].decode_pace : lpace;
        s[i].wait = (double) prefill_load(&s[i], cfg) / rate;
        s[i].base = base;
        s[i].ttft = base + s[i].wait + (double) uncached(&s[i], rq, bs) / rate;
        s[i].saved = (double) cached(&s[i], rq, bs) / rate;
        s[i].decode_ms = (double) out * pace;
        s[i].joinable = s[i].wait > 0 && s[i].since_sent >= 0 && s[i].since_sent <= pace;
        decodes |= pace > 0;
        loads += load_of(&s[i]);
        m++;
    }
    if (m == 0) {
        return -1;
    }
    mean = loads / (double) m;

    /* L: not far above the mean load (the least loaded never is) */
    for (i = 0; i < n; i++) {
        if (candidate(&s[i]) && load_of(&s[i]) <= mean * (1 + cfg->slack) + 1) {
            s[i].eligible = 1;
            best = fmin(best, s[i].ttft);
            minwait = fmin(minwait, s[i].wait);
        }
    }

    /*
     * E (in L): within the slack of the best estimate, plus the prefill
     * the server's cached prefix spares the request (saved; 0 for a server
     * holding none of it); estimates closer than one output token's time
     * apart are equal. The credit keeps a holder until its queue costs
     * more than the work a spill would redo: the spill prefills the whole
     * prompt again, which delays every request queued behind it there and
     * puts the prefix on one more server's cache. Without it, mooncake's
     * lost hits were 95% spills of holders 20-90k tokens behind an idle
     * peer (73-87% of the load-bounded oracle; with it 92-93%, and
     * sysprompt 99% against 78%, docs/BENCHMARKS.md, round 5). L still
     * bounds the holder's requests, so a hot prefix spreads as before.
     * C (in L), where a
     * session's home may be: the prefill queued ahead waits no longer than
     * the least queue's by the slack of the request's own service time (on
     * an idle fleet every server, whatever the noise in each one's learned
     * rate). Q (in L), for cold requests: the queue waits no longer than the
     * least queue's by one engine step there, its fixed part (the base) and
     * KV_ROUTE_STEP_TOKENS tokens, whatever the request's own size
     * (pick_cold).
     */
    for (i = 0; i < n; i++) {
        grain = s[i].decode_ms / (double) out;
        step = KV_ROUTE_STEP_TOKENS / rate_of(&s[i], lrate);
        if (s[i].eligible
            && s[i].wait <= minwait + cfg->slack * (s[i].ttft - s[i].wait) + grain)
        {
            s[i].eligible |= IN_C;
        }
        if (s[i].eligible && s[i].wait <= minwait + s[i].base + step + grain) {
            s[i].eligible |= IN_Q;
        }
        if (s[i].eligible && s[i].ttft <= best * (1 + cfg->slack) + grain + s[i].saved) {
            s[i].eligible |= IN_E;
        }
    }

    for (i = 0; i < n; i++) {
        if (s[i].eligible & IN_E) {
            longest = kv_route_overlap(&s[i]) > longest ? kv_route_overlap(&s[i]) : longest;
        } else if (s[i].usable && kv_route_overlap(&s[i]) > 0) {
            held_outside = 1;
        }
    }
    home = rq->session ? first_in_order(s, n, rq->session, longest > 0 ? IN_E : IN_C) : -1;

    if (longest == 0 && !held_outside && home >= 0) {
        *why = KV_ROUTE_WHY_SESSION;
        pick = home;
    } else if (longest > 0
               && (pick = pick_shared(s, n, key, longest, home >= 0 ? &s[home] : NULL,
                                      cfg->slack, rq->nseq > 0 ? (double) rq->nseq : 1,
                                      why)) >= 0)
    {
        /* a branch off a shared head, placed with bounded loads */
    } else if (longest > 0) {
        *why = KV_ROUTE_WHY_STICKY;
        for (i = 0; i < n; i++) {
            if ((s[i].eligible & IN_E)
                && (pick < 0 || stickier(&s[i], &s[pick], key, home >= 0 ? &s[home] : NULL)))
            {
                pick = (int) i;
            }
        }
    } else if (held_outside) {
        *why = KV_ROUTE_WHY_SPILL;
        pick = pick_spill(s, n, key, rq->nseq > 0 ? (double) rq->nseq : 1, IN_E);
    } else {
        *why = KV_ROUTE_WHY_COLD;
        pick = decodes ? pick_cold(s, n, key) : pick_cold_cost(s, n, key, out);
    }

    /* report E membership */
    for (i = 0; i < n; i++) {
        s[i].eligible = (s[i].eligible & IN_E) != 0;
    }
    return pick;
}

/* --- dynamo -------------------------------------------------------------- */

static int pick_dynamo(kv_route_server_t *s, size_t n, const kv_route_request_t *rq,
                       const kv_route_config_t *cfg, uint64_t rnd)
{
    kv_candidate_t     small[64], *c = n <= 64 ? small : malloc(n * sizeof(*c));
    kv_score_config_t  sc;
    size_t             i;
    int                pick;

    if (c == NULL) {
        return -1;
    }
    sc.overlap_weight = cfg->overlap_weight;
    sc.temperature = cfg->temperature;
    sc.block_size = block_size_of(cfg);
    sc.busy_prefill_tokens = 0;             /* kv_route_pick judged busy */
    sc.busy_decode_blocks = 0;
    for (i = 0; i < n; i++) {
        c[i].usable = candidate(&s[i]);
        c[i].weight = weight_of(&s[i]);
        c[i].overlap = kv_route_overlap(&s[i]);
        c[i].tree_blocks = s[i].tree_blocks;
        c[i].active_prefill_tokens = prefill_load(&s[i], cfg);
        c[i].active_decode_blocks = decode_load(&s[i], cfg);
    }
    pick = kv_score_pick(c, n, rq->prompt_tokens, &sc, rnd);
    for (i = 0; i < n; i++) {
        s[i].ttft = c[i].cost;
        s[i].decode_ms = 0;
        s[i].eligible = c[i].usable;
    }
    if (c != small) {
        free(c);
    }
    return pick;
}

/* --- the decision -------------------------------------------------------- */

/* The usable server with id home, or -1. */
static int home_of(const kv_route_server_t *s, size_t n, uint64_t home)
{
    size_t i;

    for (i = 0; home && i < n; i++) {
        if (s[i].usable && s[i].id == home) {
            return (int) i;
        }
    }
    return -1;
}

int kv_route_pick(kv_route_server_t *s, size_t n, const kv_route_request_t *rq,
                  const kv_route_config_t *cfg, uint64_t rnd, kv_route_result_t *out)
{
    uint32_t bs = block_size_of(cfg);
    size_t   i, usable = 0, busy_n = 0;
    int      pick, home;

    out->pick = KV_ROUTE_NONE;
    out->why = KV_ROUTE_WHY_NONE;
    out->overlap = 0;
    out->estimate = 0;
    out->prefill_tokens = 0;
    out->decode_blocks = 0;
    out->decode_tokens = 0;
    out->queued_tokens = 0;

    for (i = 0; i < n; i++) {
        s[i].busy = busy(&s[i], cfg);
        s[i].eligible = 0;
        s[i].ttft = 0;
        s[i].wait = 0;
        s[i].joinable = 0;
        s[i].saved = 0;
        s[i].base = 0;
        s[i].cold = 0;
        s[i].decode_ms = 0;
        if (s[i].usable) {
            usable++;
            busy_n += s[i].busy != 0;
        }
    }
    if (usable == 0) {
        return out->pick;
    }
    home = home_of(s, n, rq->home);
    if (busy_n == usable && home < 0) {
        out->pick = KV_ROUTE_BUSY;
        return out->pick;
    }

    if (cfg->policy == KV_ROUTE_DYNAMO) {
        pick = pick_dynamo(s, n, rq, cfg, rnd);
        out->why = KV_ROUTE_WHY_COST;
    } else {
        pick = pick_ttft(s, n, rq, cfg, rnd, &out->why);
    }
    if (home >= 0) {
        /* the estimates above are still what the decision saw */
        pick = home;
        out->why = KV_ROUTE_WHY_RESPONSE;
    }
    if (pick < 0) {
        out->why = KV_ROUTE_WHY_NONE;
        return out->pick;
    }

    out->pick = pick;
    out->overlap = kv_route_overlap(&s[pick]);
    out->estimate = s[pick].ttft;
    out->prefill_tokens = uncached(&s[pick], rq, bs);
    /* the request holds all its blocks while it runs, cached or not */
    out->decode_blocks = (rq->prompt_tokens + bs - 1) / bs + (rq->batch_tokens + bs - 1) / bs;
    /* n sequences (of each prompt of a batch) share their prompt's blocks and
     * decode apart */
    out->decode_tokens = rq->prefill_only ? 0
                         : (rq->max_tokens ? rq->max_tokens : cfg->max_tokens)
                           * (rq->sequences > 1 ? rq->sequences : 1);
    out->queued_tokens = prefill_load(&s[pick], cfg);
    return pick;
}
