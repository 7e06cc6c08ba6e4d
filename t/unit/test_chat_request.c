/*
 * Whole chat requests render as vLLM (or SGLang) renders them (t/data/chat/requests.jsonl,
 * made by tools/gen-chat-request-fixtures.py): tools, tool calls with JSON
 * text arguments, dropped and renamed message members, template kwargs,
 * documents, add_generation_prompt and continue_final_message, on every
 * shipped template. Checked on both sides that must agree: the router's
 * (kv_body's spans of the raw body, then kv_chat_render_request) and
 * kvworker's (the parsed body, kv_chat_render_request_json).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_body.h"
#include "kv_chat_request.h"
#include "kvtest.h"

static long long fixture_now(void)
{
    json_t *idx = json_load_file("t/data/chat/index.json", 0, NULL);
    long long now = idx ? json_integer_value(json_object_get(idx, "now")) : 0;
    json_decref(idx);
    return now;
}

/* The router's path: the body scanned in one pass, spans handed over. */
static kv_chat_engine_t engine;     /* whose rules the renders below follow */

static char *render_router(const kv_chat_template_t *t, const char *body, long long now,
                           size_t *len, char *err, size_t errlen)
{
    kv_body_t b;
    char *text;

    if (kv_body_parse(&b, body, strlen(body), err, errlen) != 0)
        return NULL;
    b.chat.engine = engine;
    text = kv_chat_render_request(t, &b.chat, now, len, err, errlen);
    kv_body_free(&b);
    return text;
}

static char *render_worker(const kv_chat_template_t *t, const char *body, long long now,
                           size_t *len, char *err, size_t errlen)
{
    json_t *req = json_loads(body, JSON_ALLOW_NUL, NULL);     /* as kvworker loads a body */
    char *text = kv_chat_render_request_json(t, req, engine, now, len, err, errlen);
    json_decref(req);
    return text;
}

typedef char *(*render_fn)(const kv_chat_template_t *, const char *, long long, size_t *,
                           char *, size_t);

static int check(render_fn fn, const char *side, const kv_chat_template_t *t, json_t *rec,
                 long long now)
{
    const char *body = json_string_value(json_object_get(rec, "body"));
    const char *want = json_string_value(json_object_get(rec, "output"));
    const char *name = json_string_value(json_object_get(rec, "template"));
    const char *c = json_string_value(json_object_get(rec, "case"));
    const char *e = json_string_value(json_object_get(rec, "engine"));
    char err[512] = "";
    size_t len = 0;
    char *got = fn(t, body, now, &len, err, sizeof err);
    int ok = want ? got && len == strlen(want) && !memcmp(got, want, len) : got == NULL;

    if (!ok)
        fprintf(stderr, "  %s %s %s/%s:\n    want: %s\n    got:  %s\n", side, e, name, c,
                want ? want : "an error", got ? got : err);
    free(got);
    return ok;
}

static kv_chat_template_t *load(const char *name)
{
    json_t *idx = json_load_file("t/data/chat/index.json", 0, NULL), *e;
    kv_chat_template_t *t = NULL;
    size_t i;
    char err[256];

    json_array_foreach(json_object_get(idx, "templates"), i, e)
        if (!strcmp(json_string_value(json_object_get(e, "name")), name))
            t = kv_chat_load(json_string_value(json_object_get(e, "config")), NULL, err,
                             sizeof err);
    json_decref(idx);
    return t;
}

TEST(requests_as_vllm_renders_them)
{
    FILE *f = fopen("t/data/chat/requests.jsonl", "r");
    char *line = NULL, name[128] = "";
    size_t cap = 0, total = 0, passed = 0;
    kv_chat_template_t *t = NULL;
    long long now = fixture_now();

    CHECK(f != NULL);
    while (f && getline(&line, &cap, f) > 0) {
        json_t *rec = json_loads(line, 0, NULL);
        const char *tn = json_string_value(json_object_get(rec, "template"));
        CHECK(tn != NULL);
        if (tn == NULL) {
            json_decref(rec);
            continue;
        }
        if (strcmp(tn, name) != 0) {
            kv_chat_free(t);
            t = load(tn);
            snprintf(name, sizeof name, "%s", tn);
            CHECK(t != NULL);
        }
        total++;
        engine = strcmp(json_string_value(json_object_get(rec, "engine")), "sglang") == 0
                 ? KV_CHAT_SGLANG : KV_CHAT_VLLM;
        if (t && check(render_router, "router", t, rec, now)
            && check(render_worker, "worker", t, rec, now))
            passed++;
        json_decref(rec);
    }
    kv_chat_free(t);
    free(line);
    if (f)
        fclose(f);
    engine = KV_CHAT_VLLM;
    fprintf(stderr, "  %zu of %zu requests as vLLM and SGLang render them\n", passed, total);
    CHECK(total > 400);
    CHECK(passed == total);
}

/* One request on both paths; 1 if they agree (text and error alike). */
static int paths_agree(const kv_chat_template_t *t, const char *body)
{
    char err1[256], err2[256], *a, *b;
    size_t la = 0, lb = 0;
    int ok;

    a = render_router(t, body, 1721995200, &la, err1, sizeof err1);
    b = render_worker(t, body, 1721995200, &lb, err2, sizeof err2);
    ok = (a == NULL) == (b == NULL) && (a == NULL || (la == lb && memcmp(a, b, la) == 0));
    if (!ok)
        fprintf(stderr, "  paths differ on %s:\n    router: %s\n    worker: %s\n", body,
                a ? a : err1, b ? b : err2);
    free(a);
    free(b);
    return ok;
}

/*
 * Every fixture conversation of t/data/chat/ (tools, kwargs and all) as a
 * request, escaped plainly and as ASCII: the router's fast JSON path and
 * its jansson fallback give the worker's render.
 */
TEST(router_and_worker_paths_agree)
{
    json_t *index = json_load_file("t/data/chat/index.json", 0, NULL), *e;
    char err[256], path[256], line[1 << 16];
    size_t k, n = 0;

    json_array_foreach(json_object_get(index, "templates"), k, e) {
        kv_chat_template_t *t = kv_chat_load(json_string_value(json_object_get(e, "config")),
                                             NULL, err, sizeof err);
        FILE *fp;

        snprintf(path, sizeof path, "t/data/chat/%s.jsonl",
                 json_string_value(json_object_get(e, "name")));
        fp = fopen(path, "r");
        while (t && fp && fgets(line, sizeof line, fp)) {
            json_t *d = json_loads(line, 0, NULL), *req = json_object();
            json_object_set(req, "messages", json_object_get(d, "messages"));
            json_object_set(req, "tools", json_object_get(d, "tools"));
            json_object_set(req, "add_generation_prompt",
                            json_object_get(d, "add_generation_prompt"));
            if (json_object_get(d, "kwargs"))
                json_object_set(req, "chat_template_kwargs", json_object_get(d, "kwargs"));
            for (int ascii = 0; ascii < 4; ascii++) {
                char *body = json_dumps(req, JSON_COMPACT | (ascii & 1 ? JSON_ENSURE_ASCII : 0));
                engine = ascii & 2 ? KV_CHAT_SGLANG : KV_CHAT_VLLM;
                CHECK(paths_agree(t, body));
                free(body);
                n++;
            }
            engine = KV_CHAT_VLLM;
            json_decref(req);
            json_decref(d);
        }
        if (fp)
            fclose(fp);
        kv_chat_free(t);
    }
    json_decref(index);
    CHECK(n > 2000);
}

/* JSON the fast path leaves to jansson renders as the worker renders it. */
TEST(jansson_fallback)
{
    static const char *const bodies[] = {
        "{\"messages\":[{\"role\":\"user\",\"content\":\"a\",\"content\":\"b\"}]}",
        "{\"messages\":[{\"role\":\"user\",\"content\":\"\\ud800x\"}]}",
        "{\"messages\":[{\"role\":\"user\",\"content\":\"a\\u0000b\"}]}",
        "{\"messages\":[{\"role\":\"user\",\"content\":\"x\",\"n\":1.5}]}",
        "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
        "\"tools\":[{\"function\":{\"name\":\"f\",\"parameters\":{\"m\":0.25}}}]}",
        "{\"messages\":[{\"role\":\"user\",\"content\":\"\\ud83d\\ude00 \\u00e9\\n\\\"\"}]}",
    };
    kv_chat_template_t *t = load("qwen2.5-instruct");
    size_t len;
    char err[256], *text;

    CHECK(t != NULL);
    for (size_t i = 0; t && i < sizeof bodies / sizeof bodies[0]; i++)
        CHECK(paths_agree(t, bodies[i]));
    /* an integer past 64 bits: the router prints it as Python does
     * (kvworker's jansson refuses it; numbers_as_python_prints_them) */
    text = t ? render_router(t, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
                             "\"tools\":[{\"function\":{\"name\":\"f\",\"parameters\":"
                             "{\"m\":9223372036854775808}}}]}", 0, &len, err, sizeof err) : NULL;
    CHECK(text != NULL && strstr(text, "\"parameters\": {\"m\": 9223372036854775808}") != NULL);
    free(text);
    /* a float in a tool's schema: printed as Python prints it */
    text = t ? render_router(t, bodies[4], 0, &len, err, sizeof err) : NULL;
    CHECK(text != NULL && strstr(text, "\"parameters\": {\"m\": 0.25}") != NULL);
    free(text);
    kv_chat_free(t);
}

/*
 * Numbers as Python holds them: an integer past 64 bits stays exact (json
 * keeps Python's int) and prints its digits; floats print as repr() and
 * json.dumps do (1e400 is inf, "Infinity" in JSON). Outputs are Python's
 * str() and json.dumps() of the same JSON.
 */
TEST(numbers_as_python_prints_them)
{
    static const char *tpl = "{{ tools[0] }}|{{ tools[0] | tojson }}|{{ tools[0][5] is integer }}";
    static const char *body =
        "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[[1e400, -0.0, 1.0, "
        "1e16, 0.1, 12345678901234567890123, -99999999999999999999, 1.5e-7, 1e22, "
        "123456789012345678, 18446744073709551616, 18446744073709551615, "
        "9223372036854775808, -9223372036854775809, 2.5e-300, 1E5, 0.000001]]}";
    static const char *want =
        "[inf, -0.0, 1.0, 1e+16, 0.1, 12345678901234567890123, -99999999999999999999, "
        "1.5e-07, 1e+22, 123456789012345678, 18446744073709551616, 18446744073709551615, "
        "9223372036854775808, -9223372036854775809, 2.5e-300, 100000.0, 1e-06]|"
        "[Infinity, -0.0, 1.0, 1e+16, 0.1, 12345678901234567890123, -99999999999999999999, "
        "1.5e-07, 1e+22, 123456789012345678, 18446744073709551616, 18446744073709551615, "
        "9223372036854775808, -9223372036854775809, 2.5e-300, 100000.0, 1e-06]|True";
    char err[256] = "", body2[512];
    size_t len = 0;
    kv_chat_template_t *t = kv_chat_load_string(tpl, NULL, NULL, err, sizeof err);
    char *text = t ? render_router(t, body, 0, &len, err, sizeof err) : NULL;

    if (text == NULL || strcmp(text, want) != 0)
        fprintf(stderr, "  want: %s\n  got:  %s\n", want, text ? text : err);
    CHECK(text != NULL && strcmp(text, want) == 0);
    free(text);
    /* a repeated key among them: still the last value, at the first place */
    snprintf(body2, sizeof body2, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
             "\"tools\":[{\"a\":1,\"b\":99999999999999999999,\"a\":2.5}]}");
    kv_chat_free(t);
    t = kv_chat_load_string("{{ tools[0] }}", NULL, NULL, err, sizeof err);
    text = t ? render_router(t, body2, 0, &len, err, sizeof err) : NULL;
    /* (vLLM gives a tool its "type" first) */
    if (text == NULL || strstr(text, "'a': 2.5, 'b': 99999999999999999999}") == NULL)
        fprintf(stderr, "  got: %s\n", text ? text : err);
    CHECK(text != NULL && strstr(text, "'a': 2.5, 'b': 99999999999999999999}") != NULL);
    free(text);
    /* arithmetic on one fails the render cleanly */
    kv_chat_free(t);
    t = kv_chat_load_string("{{ tools[0].b + 1 }}", NULL, NULL, err, sizeof err);
    text = t ? render_router(t, body2, 0, &len, err, sizeof err) : NULL;
    CHECK(text == NULL);
    free(text);
    kv_chat_free(t);
}

/* What made the router and the engine disagree before: tools, and a call's
 * arguments as the client's JSON text rather than the parsed object. */
TEST(tools_and_arguments_shape_the_prompt)
{
    kv_chat_template_t *t = load("qwen2.5-instruct");
    const char *with = "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"},"
                       "{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"c\","
                       "\"type\":\"function\",\"function\":{\"name\":\"f\","
                       "\"arguments\":\"{\\\"a\\\":1}\"}}]}],"
                       "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}]}";
    char err[256];
    size_t len;
    char *text;

    CHECK(t != NULL);
    if (t == NULL)
        return;
    text = render_router(t, with, 0, &len, err, sizeof err);
    CHECK(text != NULL);
    if (text) {
        CHECK(strstr(text, "{\"type\": \"function\", \"function\": {\"name\": \"f\", "
                           "\"description\": null, \"parameters\": null}}") != NULL);
        CHECK(strstr(text, "\"arguments\": {\"a\": 1}") != NULL);
        CHECK(strstr(text, "{\\\"a\\\":1}") == NULL && strstr(text, "{\"a\":1}") == NULL);
    }
    free(text);
    kv_chat_free(t);
}

/* A long agent history whose every call has a float argument (each left
 * to jansson by the fast path) still renders, as the worker renders it. */
TEST(many_slow_arguments)
{
    kv_chat_template_t *t = load("qwen2.5-instruct");
    char *body = malloc(1 << 16);
    size_t n = 0;

    n += (size_t) sprintf(body + n, "{\"messages\":[{\"role\":\"user\",\"content\":\"go\"}");
    for (int i = 0; i < 40; i++)
        n += (size_t) sprintf(body + n, ",{\"role\":\"assistant\",\"content\":null,\"tool_calls\":"
                              "[{\"id\":\"c%d\",\"type\":\"function\",\"function\":{\"name\":\"f\","
                              "\"arguments\":\"{\\\"x\\\":%d.5}\"}}]},"
                              "{\"role\":\"tool\",\"tool_call_id\":\"c%d\",\"content\":\"ok\"}",
                              i, i, i);
    sprintf(body + n, "]}");
    CHECK(t != NULL);
    if (t) {
        char err[256], *text;
        size_t len;

        CHECK(paths_agree(t, body));
        text = render_router(t, body, 0, &len, err, sizeof err);
        CHECK(text != NULL && strstr(text, "{\"x\": 39.5}") != NULL);
        free(text);
    }
    free(body);
    kv_chat_free(t);
}

/*
 * Bodies a client shapes against the router (found by a code review):
 * - a member with many keys, one repeated: the duplicate is still seen
 *   (jansson keeps the last) now that keys are hashed, not compared pairwise;
 * - a call's arguments text nested deeper than the body may be: taken as
 *   unparsable ({}, as a bad one), not handed to jansson's 2048 levels and
 *   a recursion through them;
 * - empty text parts: vLLM's parser drops them (a falsy part), so they add
 *   no separator.
 */
TEST(wide_deep_and_empty_members)
{
    kv_chat_template_t *t = load("qwen2.5-instruct");
    char *body = malloc(1 << 16), err[256], *text;
    size_t n = 0, len;

    CHECK(t != NULL);
    if (t == NULL) {
        free(body);
        return;
    }
    n += (size_t) sprintf(body + n, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"");
    for (int i = 0; i < 40; i++)
        n += (size_t) sprintf(body + n, ",\"k%02d\":%d", i, i);
    sprintf(body + n, ",\"k17\":99}]}");
    CHECK(paths_agree(t, body));
    text = render_router(t, body, 0, &len, err, sizeof err);
    CHECK(text != NULL);
    free(text);

    n = (size_t) sprintf(body, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"},"
                         "{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"c\","
                         "\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"");
    for (int i = 0; i < 100; i++)
        n += (size_t) sprintf(body + n, "{\\\"a\\\":");
    n += (size_t) sprintf(body + n, "1.5");
    for (int i = 0; i < 100; i++)
        body[n++] = '}';
    sprintf(body + n, "\"}}]}]}");
    text = render_router(t, body, 0, &len, err, sizeof err);
    CHECK(text != NULL && strstr(text, "\"arguments\": {}") != NULL);
    free(text);
    CHECK(paths_agree(t, body));

    sprintf(body, "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\","
            "\"text\":\"a\"},{\"type\":\"text\",\"text\":\"\"},\"\",\"b\"]}]}");
    CHECK(paths_agree(t, body));
    text = render_router(t, body, 0, &len, err, sizeof err);
    CHECK(text != NULL && strstr(text, "user\na\nb<|im_end|>") != NULL);
    free(text);
    free(body);
    kv_chat_free(t);
}

/* The operator's default kwargs (vLLM's --default-chat-template-kwargs),
 * the request's own over them: SmolLM3 writes enable_thinking into its
 * system header, so without them every block would differ. */
TEST(default_kwargs)
{
    kv_chat_template_t *t = load("smollm3-3b");
    const char *plain = "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}";
    const char *off = "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],"
                      "\"chat_template_kwargs\":{\"enable_thinking\":false}}";
    const char *on = "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],"
                     "\"chat_template_kwargs\":{\"enable_thinking\":true}}";
    const char *defaults = "{\"enable_thinking\": false, \"unused\": [1]}";
    char *want_off, *want_on, *got, err[256];
    size_t len;
    kv_body_t b;

    CHECK(t != NULL);
    if (t == NULL)
        return;
    want_off = render_router(t, off, 0, &len, err, sizeof err);
    want_on = render_router(t, on, 0, &len, err, sizeof err);
    CHECK(want_off && want_on && strcmp(want_off, want_on) != 0);
    for (int i = 0; i < 2; i++) {
        const char *body = i ? on : plain;
        CHECK(kv_body_parse(&b, body, strlen(body), err, sizeof err) == 0);
        b.chat.default_kwargs = defaults;
        b.chat.default_kwargs_len = strlen(defaults);
        got = kv_chat_render_request(t, &b.chat, 0, &len, err, sizeof err);
        CHECK(got != NULL && strcmp(got, i ? want_on : want_off) == 0);
        free(got);
        kv_body_free(&b);
    }
    free(want_off);
    free(want_on);
    kv_chat_free(t);
}

/* Bad members never crash: the router gets an error and routes by load. */
TEST(bad_members)
{
    kv_chat_template_t *t = load("qwen2.5-instruct");
    static const char *const bodies[] = {
        "{\"messages\":{}}",
        "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":7}",
        "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[1,\"a\",null,{}]}",
        "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"chat_template_kwargs\":[1]}",
        "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"documents\":\"d\"}",
        "{\"messages\":[{\"role\":\"assistant\",\"tool_calls\":[1,{\"function\":3},"
        "{\"function\":{\"arguments\":\"\\u0000\"}}]}]}",
        "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"continue_final_message\":true}",
        "{\"messages\":[],\"continue_final_message\":true}",
        "{\"messages\":[7,null,\"s\"]}",
    };
    char err[256];
    size_t len;

    CHECK(t != NULL);
    for (int e = 0; e < 2; e++) {
        engine = e ? KV_CHAT_SGLANG : KV_CHAT_VLLM;
        for (size_t i = 0; t && i < sizeof bodies / sizeof bodies[0]; i++) {
            free(render_router(t, bodies[i], 0, &len, err, sizeof err));
            free(render_worker(t, bodies[i], 0, &len, err, sizeof err));
        }
    }
    engine = KV_CHAT_VLLM;
    kv_chat_free(t);
}

int main(void)
{
    RUN(requests_as_vllm_renders_them);
    RUN(router_and_worker_paths_agree);
    RUN(jansson_fallback);
    RUN(numbers_as_python_prints_them);
    RUN(tools_and_arguments_shape_the_prompt);
    RUN(many_slow_arguments);
    RUN(wide_deep_and_empty_members);
    RUN(default_kwargs);
    RUN(bad_members);
    return kvt_done();
}
