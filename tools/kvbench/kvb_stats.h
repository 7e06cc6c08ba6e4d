/* Summary statistics over a sample of latencies. */
#ifndef KVB_STATS_H
#define KVB_STATS_H

#include <stddef.h>

typedef struct {
    size_t  n;
    double  mean, p50, p90, p99, max;
} kvb_dist_t;

/* Sorts v in place and fills d; all zero when n == 0. */
void kvb_dist(double *v, size_t n, kvb_dist_t *d);

#endif
