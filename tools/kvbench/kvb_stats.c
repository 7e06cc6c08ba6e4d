#include "kvb_stats.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Linear interpolation between closest ranks (numpy's default). */
static double quantile(const double *sorted, size_t n, double q)
{
    double pos = q * (double)(n - 1);
    size_t lo = (size_t)floor(pos);
    size_t hi = lo + 1 < n ? lo + 1 : lo;
    return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - (double)lo);
}

void kvb_dist(double *v, size_t n, kvb_dist_t *d)
{
    memset(d, 0, sizeof(*d));
    if (n == 0)
        return;
    qsort(v, n, sizeof(*v), cmp_double);
    double sum = 0;
    for (size_t i = 0; i < n; i++)
        sum += v[i];
    d->n = n;
    d->mean = sum / (double)n;
    d->p50 = quantile(v, n, 0.50);
    d->p90 = quantile(v, n, 0.90);
    d->p99 = quantile(v, n, 0.99);
    d->max = v[n - 1];
}
