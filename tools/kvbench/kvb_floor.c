#include "kvb_floor.h"

#include "kvw_backend.h"

double kvb_floor_ttft_ms(uint32_t prompt, uint64_t cached, uint32_t block_size,
                         uint32_t budget, double speedup)
{
    if (prompt == 0 || block_size == 0 || budget == 0 || !(speedup > 0))
        return 0;
    uint64_t most = (uint64_t)((prompt - 1) / block_size) * block_size;
    double u = (double)prompt - (double)(cached < most ? cached : most);
    uint64_t m = ((uint64_t)u + budget - 1) / budget;
    double best = m * kvw_mock_poly_prefill_ms(u / m);

    /* m * prefill(u / m) is convex in m: walk up while it still falls */
    for (;;) {
        double next = (m + 1) * kvw_mock_poly_prefill_ms(u / (m + 1));
        if (!(next < best))
            break;
        best = next;
        m++;
    }
    return best / speedup;
}

double kvb_floor_any_order_ms(uint64_t computed, uint64_t n, double speedup)
{
    if (n == 0 || !(speedup > 0))
        return 0;
    return (KVW_MOCK_PREFILL_PER_TOKEN * (double)computed + KVW_MOCK_PREFILL_FIXED * (double)n)
           / (double)n / speedup;
}
