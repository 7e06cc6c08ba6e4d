/* The cold rule's tie-break (kv_route.c, colder): on an idle fleet a new
 * prefix goes first to a server whose index holds nothing, then by the
 * prefix's rendezvous order (issue 18, docs/BENCHMARKS.md "Scale-out
 * round 3"). */
#include "kvtest.h"
#include "route_fleet.h"
#include "kv_route.h"

#define N 8

static void idle(kv_route_server_t *s, size_t n)
{
    route_fleet_idle(s, n, 9100, 17);
}

static kv_route_config_t config(void)
{
    return route_fleet_config(16);
}

/* Eight new prefixes, one after the other, each recorded where it went:
 * eight servers, one each, whatever the hashes; a router that lists the
 * servers in another order picks the same ones. */
TEST(new_prefixes_fill_empty_servers_first)
{
    kv_route_config_t  cfg = config();
    kv_route_server_t  s[N], t[N];
    kv_route_result_t  r;
    uint64_t           held[N] = { 0 };

    for (uint64_t round = 0; round < 20; round++) {
        int used[N] = { 0 };

        memset(held, 0, sizeof(held));
        for (uint64_t k = 0; k < N; k++) {
            uint64_t            q[4] = { (round * 131 + k) * 2654435761u + 1, 2, 3, 4 };
            kv_route_request_t  rq = { 64, q, 4, 0, 0, 1, 0, 0, 0 };
            int                 a, b;

            idle(s, N);
            for (int i = 0; i < N; i++) {
                s[i].tree_blocks = held[i];
                t[N - 1 - i] = s[i];
            }
            a = kv_route_pick(s, N, &rq, &cfg, k, &r);
            CHECK(r.why == KV_ROUTE_WHY_COLD);
            b = kv_route_pick(t, N, &rq, &cfg, k * 5 + 1, &r);
            CHECK(a >= 0 && b >= 0 && s[a].id == t[b].id);
            CHECK(used[a] == 0);
            used[a] = 1;
            held[a] += 4;
        }
    }
}

/* Once every server holds something, the rendezvous order decides again:
 * prefixes spread over all of them, not onto the one holding least. */
TEST(held_everywhere_rendezvous_decides)
{
    kv_route_config_t  cfg = config();
    kv_route_server_t  s[N];
    kv_route_result_t  r;
    int                seen[N] = { 0 };

    for (uint64_t k = 0; k < 160; k++) {
        uint64_t            q[4] = { k * 7919 + 3, 2, 3, 4 };
        kv_route_request_t  rq = { 64, q, 4, 0, 0, 1, 0, 0, 0 };
        int                 a;

        idle(s, N);
        for (int i = 0; i < N; i++) {
            s[i].tree_blocks = 1 + 1000 * (uint64_t) i;
        }
        a = kv_route_pick(s, N, &rq, &cfg, k, &r);
        CHECK(a >= 0 && r.why == KV_ROUTE_WHY_COLD);
        seen[a]++;
    }
    for (int i = 0; i < N; i++) {
        CHECK(seen[i] > 5);
    }
}

int main(void)
{
    RUN(new_prefixes_fill_empty_servers_first);
    RUN(held_everywhere_rendezvous_decides);
    return kvt_done();
}
