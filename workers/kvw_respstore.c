#include "kvw_respstore.h"
#include "kv_unicode.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <stdlib.h>
#include <string.h>

/* One kept response. */
typedef struct resp {
    char        *id;
    json_t      *items;     /* its conversation as input items */
    json_t      *output;    /* its output text, a JSON string */
    char        *response;  /* the Response JSON, for GET */
    struct resp *next;      /* in its bucket */
} resp_t;

/*
 * A ring of the kept responses in the order they came (the oldest is
 * overwritten first) and a chained hash over their ids, about one bucket
 * per response.
 */
struct kvw_respstore {
    resp_t **ring;
    size_t   capacity, count, head;     /* head: the slot written next */
    resp_t **buckets;
    size_t   mask;
};

kvw_respstore_t *kvw_respstore_new(size_t capacity)
{
    kvw_respstore_t *s;
    size_t           n = 1;

    if (capacity == 0 || (s = calloc(1, sizeof(*s))) == NULL)
        return NULL;
    while (n < capacity)
        n <<= 1;
    s->ring = calloc(capacity, sizeof(*s->ring));
    s->buckets = calloc(n, sizeof(*s->buckets));
    if (s->ring == NULL || s->buckets == NULL) {
        free(s->ring);
        free(s->buckets);
        free(s);
        return NULL;
    }
    s->capacity = capacity;
    s->mask = n - 1;
    return s;
}

static void resp_free(resp_t *r)
{
    if (r == NULL)
        return;
    free(r->id);
    json_decref(r->items);
    json_decref(r->output);
    free(r->response);
    free(r);
}

void kvw_respstore_free(kvw_respstore_t *s)
{
    if (s == NULL)
        return;
    for (size_t i = 0; i < s->capacity; i++)
        resp_free(s->ring[i]);
    free(s->ring);
    free(s->buckets);
    free(s);
}

static resp_t **bucket(const kvw_respstore_t *s, const char *id)
{
    return &s->buckets[XXH3_64bits(id, strlen(id)) & s->mask];
}

static resp_t *find(const kvw_respstore_t *s, const char *id)
{
    if (s == NULL)
        return NULL;
    for (resp_t *r = *bucket(s, id); r; r = r->next)
        if (strcmp(r->id, id) == 0)
            return r;
    return NULL;
}

static void unlink_resp(kvw_respstore_t *s, resp_t *r)
{
    for (resp_t **p = bucket(s, r->id); *p; p = &(*p)->next)
        if (*p == r) {
            *p = r->next;
            return;
        }
}

/* A body's input as a list of items (new reference): a string is one user message. */
static json_t *as_items(json_t *input)
{
    if (json_is_array(input))
        return json_incref(input);
    if (json_is_string(input))
        return json_pack("[{s:s,s:O}]", "role", "user", "content", input);
    return NULL;
}

int kvw_respstore_expand(const kvw_respstore_t *s, json_t *doc, kvw_openai_err_t *e)
{
    json_t     *prev = json_object_get(doc, "previous_response_id");
    json_t     *items, *all;
    const char *id;
    resp_t     *r;

    if (prev == NULL || json_is_null(prev))
        return 0;
    if (!json_is_string(prev))
        return kvw_openai_fail(e, 400, "invalid_request_error", "previous_response_id",
                               "invalid_type", "'previous_response_id' must be a string.");
    id = json_string_value(prev);
    r = find(s, id);
    if (r == NULL)
        return kvw_openai_fail(e, 404, "invalid_request_error", "previous_response_id",
                               "previous_response_not_found",
                               "Previous response with id '%.200s' not found.", id);
    items = as_items(json_object_get(doc, "input"));
    if (items == NULL)      /* no input, or of the wrong type: refused as any such body */
        return 0;
    all = json_array();
    if (all == NULL
        || json_array_extend(all, r->items) != 0
        || json_array_append_new(all, json_pack("{s:s,s:O}", "role", "assistant",
                                                "content", r->output)) != 0
        || json_array_extend(all, items) != 0) {
        json_decref(items);
        json_decref(all);
        return kvw_openai_fail(e, 503, "server_error", NULL, "out_of_memory", "out of memory");
    }
    json_decref(items);
    json_object_set_new(doc, "input", all);
    json_object_del(doc, "previous_response_id");
    return 0;
}

json_t *kvw_respstore_conversation(const kvw_respstore_t *s, const json_t *doc)
{
    if (s == NULL || json_is_false(json_object_get(doc, "store")))
        return NULL;
    return as_items(json_object_get(doc, "input"));
}

int kvw_respstore_put(kvw_respstore_t *s, const char *id, json_t *conversation,
                      const char *text, size_t len, char *response)
{
    resp_t *r = calloc(1, sizeof(*r));
    char   *clean = kv_utf8_clean(text ? text : "", text ? len : 0, &len);
    resp_t *old;

    if (r == NULL || clean == NULL || (r->id = strdup(id)) == NULL
        || (r->output = json_stringn(clean, len)) == NULL) {
        free(clean);
        if (r)
            free(r->id);
        free(r);
        json_decref(conversation);
        free(response);
        return -1;
    }
    free(clean);
    r->items = conversation;
    r->response = response;
    old = find(s, id);          /* an id given twice: the newer wins */
    if (old)
        unlink_resp(s, old);
    if (s->ring[s->head]) {
        unlink_resp(s, s->ring[s->head]);
        resp_free(s->ring[s->head]);
        s->count--;
    }
    s->ring[s->head] = r;
    s->head = (s->head + 1) % s->capacity;
    s->count++;
    r->next = *bucket(s, id);
    *bucket(s, id) = r;
    return 0;
}

const char *kvw_respstore_get(const kvw_respstore_t *s, const char *id)
{
    resp_t *r = find(s, id);

    return r ? r->response : NULL;
}

size_t kvw_respstore_count(const kvw_respstore_t *s)
{
    return s ? s->count : 0;
}
