/*
 * The fuzz targets as unit tests: `make test` builds each t/fuzz/fuzz_X.c
 * with this main instead of libFuzzer's, as build/t/test_fuzz_X, and runs it
 * over the target's seed corpus (t/fuzz/corpus/fuzz_X/) and a fixed set of
 * mutants of those seeds. Every target checks its own property (abort on a
 * wrong answer), so this keeps two promises on every CI run, with no clang
 * and no time limit to tune: each seed still passes, and a broken harness
 * (one that aborts on every input, as fuzz_event_* once did) fails the suite
 * instead of waiting for someone to run `make fuzz`.
 *
 * The mutants come from a fixed xorshift seed, so a failure reproduces: its
 * name is printed (seed file and mutant number) before the input runs.
 * Run from the repository's top (t/run.py does).
 */
#include <dirent.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifndef FUZZ_TARGET
#error "build with -DFUZZ_TARGET='\"fuzz_X\"'"
#endif

#define MAX_SEEDS    256
#define INPUT_MAX    (1 << 20)
#define MUTANTS      1000        /* per seed: a few seconds for the slowest target */

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv) __attribute__((weak));

typedef struct {
    char    name[256];
    uint8_t *data;
    size_t   size;
} seed_t;

static char     current[320];    /* the input running now, for the crash message */
static uint64_t rng = 0x9e3779b97f4a7c15ULL;

static uint64_t next(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

static void on_crash(int sig)
{
    static const char msg[] = "not ok replay: crashed on ";

    if (write(2, msg, sizeof(msg) - 1) < 0 || write(2, current, strlen(current)) < 0
        || write(2, "\n", 1) < 0)
    {
        /* nothing more to say */
    }
    signal(sig, SIG_DFL);
    raise(sig);
}

static int by_name(const void *a, const void *b)
{
    return strcmp(((const seed_t *) a)->name, ((const seed_t *) b)->name);
}

/* the seed files, sorted by name so the mutants do not depend on readdir's order */
static size_t load_seeds(const char *dir, seed_t *seeds)
{
    DIR           *d = opendir(dir);
    struct dirent *e;
    size_t         n = 0;
    char           path[512];
    FILE          *f;

    if (d == NULL)
        return 0;
    while ((e = readdir(d)) != NULL && n < MAX_SEEDS) {
        if (e->d_name[0] == '.')
            continue;
        snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
        if ((f = fopen(path, "rb")) == NULL)
            continue;
        if ((seeds[n].data = malloc(INPUT_MAX)) == NULL) {
            fclose(f);
            break;
        }
        seeds[n].size = fread(seeds[n].data, 1, INPUT_MAX, f);
        fclose(f);
        snprintf(seeds[n].name, sizeof(seeds[n].name), "%s", e->d_name);
        n++;
    }
    closedir(d);
    qsort(seeds, n, sizeof(*seeds), by_name);
    return n;
}

/* one mutant of a (into out, returns its size): libFuzzer's simplest moves,
 * a few at a time; b is another seed to splice from */
static size_t mutate(const seed_t *a, const seed_t *b, uint8_t *out)
{
    size_t n = a->size, i, k, at, moves = 1 + next() % 4;

    memcpy(out, a->data, n);
    for (k = 0; k < moves; k++) {
        at = n ? next() % n : 0;
        switch (next() % 5) {
        case 0:                                  /* flip a bit */
            if (n)
                out[at] ^= (uint8_t) (1u << (next() % 8));
            break;
        case 1:                                  /* a random byte */
            if (n)
                out[at] = (uint8_t) next();
            break;
        case 2:                                  /* cut the tail */
            n = at;
            break;
        case 3:                                  /* insert a byte */
            if (n < INPUT_MAX) {
                memmove(out + at + 1, out + at, n - at);
                out[at] = (uint8_t) next();
                n++;
            }
            break;
        default:                                 /* splice b's tail at at */
            i = b->size ? next() % b->size : 0;
            if (at + (b->size - i) <= INPUT_MAX) {
                memcpy(out + at, b->data + i, b->size - i);
                n = at + (b->size - i);
            }
            break;
        }
    }
    return n;
}

int main(int argc, char **argv)
{
    static seed_t seeds[MAX_SEEDS];
    const char   *dir = "t/fuzz/corpus/" FUZZ_TARGET;
    uint8_t      *buf = malloc(INPUT_MAX);
    size_t        n, i, m, size;

    if (buf == NULL) {
        printf("not ok %s: out of memory\n", FUZZ_TARGET);
        return 1;
    }
    signal(SIGABRT, on_crash);
    signal(SIGSEGV, on_crash);
    signal(SIGBUS, on_crash);
    signal(SIGFPE, on_crash);
    if (LLVMFuzzerInitialize)
        LLVMFuzzerInitialize(&argc, &argv);

    n = load_seeds(dir, seeds);
    snprintf(current, sizeof(current), "the empty input");
    LLVMFuzzerTestOneInput(buf, 0);
    for (i = 0; i < n; i++) {
        snprintf(current, sizeof(current), "%.64s/%.200s", dir, seeds[i].name);
        memcpy(buf, seeds[i].data, seeds[i].size);   /* a copy: targets may not keep it */
        LLVMFuzzerTestOneInput(buf, seeds[i].size);
    }
    printf("ok %s_seeds (%zu)\n", FUZZ_TARGET, n);

    for (i = 0; i < n; i++) {
        for (m = 0; m < MUTANTS; m++) {
            snprintf(current, sizeof(current), "mutant %zu of %.64s/%.200s", m, dir, seeds[i].name);
            size = mutate(&seeds[i], &seeds[next() % n], buf);
            LLVMFuzzerTestOneInput(buf, size);
        }
    }
    printf("ok %s_mutants (%zu)\n", FUZZ_TARGET, n * MUTANTS);

    for (i = 0; i < n; i++)
        free(seeds[i].data);
    free(buf);
    return 0;
}
