#include "kv_trace.h"

#include <errno.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "kv_hash.h"

static int grow(void **p, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap)
        return 0;
    size_t c = *cap ? *cap : 1024;
    while (c < need)
        c *= 2;
    void *q = realloc(*p, c * elem);
    if (q == NULL)
        return -1;
    *p = q;
    *cap = c;
    return 0;
}

int kv_trace_add(kv_trace_t *t, uint64_t timestamp_ms, uint32_t input_length,
                 uint32_t output_length, const uint64_t *ids, uint32_t n_ids)
{
    if (grow((void **)&t->reqs, &t->cap_reqs, t->n + 1, sizeof(*t->reqs))
        || grow((void **)&t->hash_ids, &t->cap_hash, t->n_hash_ids + n_ids, sizeof(uint64_t)))
        return -1;
    kv_trace_req_t *r = &t->reqs[t->n++];
    r->timestamp_ms = timestamp_ms;
    r->input_length = input_length;
    r->output_length = output_length;
    r->first_hash = t->n_hash_ids;
    r->n_hash = n_ids;
    if (n_ids)
        memcpy(t->hash_ids + t->n_hash_ids, ids, n_ids * sizeof(uint64_t));
    t->n_hash_ids += n_ids;
    return 0;
}

static int get_uint(json_t *o, const char *key, uint64_t max, uint64_t *v,
                    char *err, size_t errlen)
{
    json_t *j = json_object_get(o, key);
    if (!json_is_integer(j) || json_integer_value(j) < 0
        || (uint64_t)json_integer_value(j) > max) {
        snprintf(err, errlen, "\"%s\" must be an integer in [0, %llu]", key,
                 (unsigned long long)max);
        return -1;
    }
    *v = (uint64_t)json_integer_value(j);
    return 0;
}

int kv_trace_add_line(kv_trace_t *t, const char *line, size_t len, char *err, size_t errlen)
{
    json_error_t jerr;
    json_t *o = json_loadb(line, len, 0, &jerr);
    uint64_t ts, in, out, stack_ids[256], *ids = stack_ids;
    int rc = -1;

    if (o == NULL) {
        snprintf(err, errlen, "not JSON: %s", jerr.text);
        return -1;
    }
    if (!json_is_object(o)) {
        snprintf(err, errlen, "not a JSON object");
        goto done;
    }
    json_t *h = json_object_get(o, "hash_ids");
    if (get_uint(o, "timestamp", UINT64_MAX >> 1, &ts, err, errlen)
        || get_uint(o, "input_length", UINT32_MAX, &in, err, errlen)
        || get_uint(o, "output_length", UINT32_MAX, &out, err, errlen))
        goto done;
    if (!json_is_array(h)) {
        snprintf(err, errlen, "\"hash_ids\" must be an array of integers");
        goto done;
    }
    size_t n = json_array_size(h), i;
    json_t *v;
    if (n > UINT32_MAX || (n > 256 && (ids = malloc(n * sizeof(uint64_t))) == NULL)) {
        snprintf(err, errlen, "out of memory");
        goto done;
    }
    json_array_foreach(h, i, v) {
        if (!json_is_integer(v) || json_integer_value(v) < 0) {
            snprintf(err, errlen, "\"hash_ids\"[%zu] must be a non-negative integer", i);
            goto done;
        }
        ids[i] = (uint64_t)json_integer_value(v);
    }
    if (kv_trace_add(t, ts, (uint32_t)in, (uint32_t)out, ids, (uint32_t)n)) {
        snprintf(err, errlen, "out of memory");
        goto done;
    }
    rc = 0;
done:
    if (ids != stack_ids)
        free(ids);
    json_decref(o);
    return rc;
}

int kv_trace_load_file(FILE *f, kv_trace_t *t, char *err, size_t errlen)
{
    char *line = NULL, why[200];
    size_t cap = 0, lineno = 0;
    ssize_t n;
    int rc = 0;

    while ((n = getline(&line, &cap, f)) >= 0) {
        lineno++;
        size_t k = (size_t)n;
        while (k && (line[k - 1] == '\n' || line[k - 1] == '\r' || line[k - 1] == ' '))
            k--;
        if (k == 0)
            continue;           /* blank lines are allowed */
        if (kv_trace_add_line(t, line, k, why, sizeof(why))) {
            snprintf(err, errlen, "line %zu: %s", lineno, why);
            rc = -1;
            break;
        }
    }
    if (rc == 0 && ferror(f)) {
        snprintf(err, errlen, "read error: %s", strerror(errno));
        rc = -1;
    }
    free(line);
    return rc;
}

int kv_trace_load(const char *path, kv_trace_t *t, char *err, size_t errlen)
{
    FILE *f = strcmp(path, "-") == 0 ? stdin : fopen(path, "r");
    if (f == NULL) {
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        return -1;
    }
    int rc = kv_trace_load_file(f, t, err, errlen);
    if (f != stdin)
        fclose(f);
    return rc;
}

void kv_trace_free(kv_trace_t *t)
{
    free(t->reqs);
    free(t->hash_ids);
    memset(t, 0, sizeof(*t));
}

int kv_trace_write(FILE *f, const kv_trace_t *t, const kv_trace_req_t *r)
{
    const uint64_t *ids = kv_trace_ids(t, r);
    fprintf(f, "{\"timestamp\": %llu, \"input_length\": %u, \"output_length\": %u, "
            "\"hash_ids\": [", (unsigned long long)r->timestamp_ms, r->input_length,
            r->output_length);
    for (uint32_t i = 0; i < r->n_hash; i++)
        fprintf(f, i ? ", %llu" : "%llu", (unsigned long long)ids[i]);
    return fputs("]}\n", f) < 0 ? -1 : 0;
}

/* An open-addressing set of 64-bit prefix keys (0 is the empty marker). */
typedef struct {
    uint64_t   *slot;
    size_t      mask, used;
} keyset_t;

static int keyset_insert(keyset_t *s, uint64_t k)   /* 1 if new, 0 if present, -1 nomem */
{
    if (k == 0)
        k = 1;
    if ((s->used + 1) * 2 > s->mask + 1) {
        keyset_t bigger = { calloc((s->mask + 1) * 2, sizeof(uint64_t)), s->mask * 2 + 1, 0 };
        if (bigger.slot == NULL)
            return -1;
        for (size_t i = 0; i <= s->mask; i++)
            if (s->slot[i])
                keyset_insert(&bigger, s->slot[i]);
        free(s->slot);
        *s = bigger;
    }
    for (size_t i = k & s->mask; ; i = (i + 1) & s->mask) {
        if (s->slot[i] == k)
            return 0;
        if (s->slot[i] == 0) {
            s->slot[i] = k;
            s->used++;
            return 1;
        }
    }
}

double kv_trace_ideal_reuse(const kv_trace_t *t)
{
    keyset_t seen = { calloc(1024, sizeof(uint64_t)), 1023, 0 };
    uint64_t hits = 0, total = 0;

    if (seen.slot == NULL)
        return -1;
    for (size_t i = 0; i < t->n; i++) {
        const kv_trace_req_t *r = &t->reqs[i];
        const uint64_t *ids = kv_trace_ids(t, r);
        uint64_t key = 0;
        int prefix_hit = 1;
        for (uint32_t j = 0; j < r->n_hash; j++) {
            /* the key names the whole prefix ids[0..j], not the id alone */
            key = kv_hash_chain(key, ids[j]);
            int isnew = keyset_insert(&seen, key);
            if (isnew < 0) {
                free(seen.slot);
                return -1;
            }
            prefix_hit = prefix_hit && !isnew;
            hits += prefix_hit;
        }
        total += r->n_hash;
    }
    free(seen.slot);
    return total ? (double)hits / (double)total : 0.0;
}
