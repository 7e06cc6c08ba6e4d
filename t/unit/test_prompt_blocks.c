/* kv_prompt: request body -> token count and block sequence hashes, at
 * several block sizes; salt; the fallbacks (test_prompt.c: max_tokenize). */
#include <stdlib.h>
#include "kvtest.h"
#include "kv_body.h"
#include "kv_hash.h"
#include "kv_prompt.h"

static const char *ids_body(size_t n, const char *extra)
{
    static char buf[65536];
    size_t      len = 0;

    len += snprintf(buf + len, sizeof(buf) - len, "{\"model\":\"m\",\"prompt\":[");
    for (size_t i = 0; i < n; i++) {
        len += snprintf(buf + len, sizeof(buf) - len, "%s%zu", i ? "," : "", 1000 + i);
    }
    snprintf(buf + len, sizeof(buf) - len, "]%s}", extra);
    return buf;
}

TEST(token_ids_at_several_block_sizes)
{
    static const uint32_t sizes[] = { 16, 32, 64 };
    uint32_t ids[200];
    uint64_t want[200];

    for (size_t i = 0; i < 200; i++) {
        ids[i] = (uint32_t) (1000 + i);
    }
    for (size_t k = 0; k < 3; k++) {
        kv_prompt_config_t cfg = { NULL, NULL, NULL, sizes[k], 0, NULL, 0, KV_CHAT_VLLM, NULL, NULL, KV_API_ANY };
        kv_prompt_t p;
        const char *b = ids_body(200, ",\"max_tokens\":7,\"stream\":true");

        CHECK(kv_prompt_compute(&cfg, b, strlen(b), NULL, 0, &p) == KV_PROMPT_OK);
        CHECK_EQ_U64(p.prompt_tokens, 200);
        CHECK_EQ_U64(p.nseq, 200 / sizes[k]);
        CHECK(p.max_tokens == 7 && p.stream == 1);
        kv_hash_blocks(ids, 200, sizes[k], kv_hash_seed(NULL, 0), NULL, want);
        CHECK(p.nseq && memcmp(p.seq, want, p.nseq * sizeof(uint64_t)) == 0);
        kv_prompt_free(&p);
    }
}

TEST(salt_changes_every_hash)
{
    kv_prompt_config_t cfg = { NULL, NULL, NULL, 16, 0, NULL, 0, KV_CHAT_VLLM, NULL, NULL, KV_API_ANY };
    kv_prompt_t a, b, c;
    const char *body = ids_body(64, "");
    char        copy[65536];

    snprintf(copy, sizeof(copy), "%s", body);
    CHECK(kv_prompt_compute(&cfg, copy, strlen(copy), NULL, 0, &a) == KV_PROMPT_OK);
    CHECK(kv_prompt_compute(&cfg, copy, strlen(copy), "tenant", 6, &b) == KV_PROMPT_OK);
    body = ids_body(64, ",\"cache_salt\":\"tenant\"");
    CHECK(kv_prompt_compute(&cfg, body, strlen(body), "other", 5, &c) == KV_PROMPT_OK);
    CHECK(a.nseq == 4 && b.nseq == 4 && c.nseq == 4);
    for (size_t i = 0; i < 4; i++) {
        CHECK(a.seq[i] != b.seq[i]);
        CHECK(b.seq[i] == c.seq[i]);     /* the body's cache_salt wins */
    }
    kv_prompt_free(&a);
    kv_prompt_free(&b);
    kv_prompt_free(&c);
}

TEST(short_prompt_has_no_blocks)
{
    kv_prompt_config_t cfg = { NULL, NULL, NULL, 64, 0, NULL, 0, KV_CHAT_VLLM, NULL, NULL, KV_API_ANY };
    kv_prompt_t p;
    const char *b = ids_body(63, "");

    CHECK(kv_prompt_compute(&cfg, b, strlen(b), NULL, 0, &p) == KV_PROMPT_OK);
    CHECK_EQ_U64(p.prompt_tokens, 63);
    CHECK(p.nseq == 0 && p.seq == NULL);
    kv_prompt_free(&p);
}

TEST(fallbacks_say_why)
{
    kv_prompt_config_t cfg = { NULL, NULL, "m", 16, 0, NULL, 0, KV_CHAT_VLLM, NULL, NULL, KV_API_ANY };
    kv_prompt_t p;
    const char *b;

    b = "{\"prompt\": [1, 2";
    CHECK(kv_prompt_compute(&cfg, b, strlen(b), NULL, 0, &p) == KV_PROMPT_PARSE);
    CHECK(p.err[0] != '\0');
    kv_prompt_free(&p);
    b = "{\"model\":\"m\",\"max_tokens\":3}";
    CHECK(kv_prompt_compute(&cfg, b, strlen(b), NULL, 0, &p) == KV_PROMPT_NO_PROMPT);
    kv_prompt_free(&p);
    b = "{\"model\":\"m\",\"prompt\":\"hello\"}";
    CHECK(kv_prompt_compute(&cfg, b, strlen(b), NULL, 0, &p) == KV_PROMPT_NO_TOKENIZER);
    kv_prompt_free(&p);
    b = "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}";
    CHECK(kv_prompt_compute(&cfg, b, strlen(b), NULL, 0, &p) == KV_PROMPT_NO_TOKENIZER);
    kv_prompt_free(&p);
    b = "{\"model\":\"other\",\"prompt\":[1,2,3]}";
    CHECK(kv_prompt_compute(&cfg, b, strlen(b), NULL, 0, &p) == KV_PROMPT_MODEL);
    kv_prompt_free(&p);
    b = "[1, 2, 3]";
    CHECK(kv_prompt_compute(&cfg, b, strlen(b), NULL, 0, &p) == KV_PROMPT_PARSE);
    kv_prompt_free(&p);
}

/* The session: prompt_cache_key before user; neither: 0. The blocks do
 * not depend on it. */
TEST(session_precedence)
{
    kv_prompt_config_t cfg = { NULL, NULL, NULL, 16, 0, NULL, 0, KV_CHAT_VLLM, NULL, NULL, KV_API_ANY };
    kv_prompt_t p;
    char        copy[65536];

    snprintf(copy, sizeof(copy), "%s", ids_body(32, ",\"user\":\"u1\",\"prompt_cache_key\":\"k1\""));
    CHECK(kv_prompt_compute(&cfg, copy, strlen(copy), NULL, 0, &p) == KV_PROMPT_OK);
    CHECK(p.session == kv_body_session_key("k1", 2));
    kv_prompt_free(&p);
    snprintf(copy, sizeof(copy), "%s", ids_body(32, ",\"user\":\"u1\""));
    CHECK(kv_prompt_compute(&cfg, copy, strlen(copy), NULL, 0, &p) == KV_PROMPT_OK);
    CHECK(p.session == kv_body_session_key("u1", 2));
    kv_prompt_free(&p);
    snprintf(copy, sizeof(copy), "%s", ids_body(32, ""));
    CHECK(kv_prompt_compute(&cfg, copy, strlen(copy), NULL, 0, &p) == KV_PROMPT_OK);
    CHECK(p.session == 0);
    kv_prompt_free(&p);
}

/* salt_combine: the operator's salt is combined with the client's, the
 * same (operator, client) always gives the same blocks, and no client salt
 * reproduces another operator salt's blocks; every top-level cache_salt
 * value (escaped keys and duplicates too) is recorded for the rewrite. */
TEST(operator_salt_combined_not_overridden)
{
    kv_prompt_config_t cfg = { NULL, NULL, NULL, 16, 0, NULL, 1, KV_CHAT_VLLM, NULL, NULL, KV_API_ANY };
    kv_prompt_t a, b, c, d;
    char        body[65536], evil[65536];

    snprintf(body, sizeof(body), "%s", ids_body(64, ""));
    CHECK(kv_prompt_compute(&cfg, body, strlen(body), "tenantA", 7, &a) == KV_PROMPT_OK);
    CHECK(a.salt_len == 9 && memcmp(a.salt, "7:tenantA", 9) == 0);
    CHECK(a.n_salts == 0 && a.parsed && body[a.obj_open - 1] == '{');
    /* tenant B's client tries to become tenant A: "tenantA" as its salt */
    snprintf(evil, sizeof(evil), "%s",
             ids_body(64, ",\"c\\u0061che_salt\":\"x\",\"cache_salt\":\"7:tenantA\""));
    CHECK(kv_prompt_compute(&cfg, evil, strlen(evil), "tenantB", 7, &b) == KV_PROMPT_OK);
    CHECK(b.n_salts == 2);
    CHECK(memcmp(evil + b.salt_off[0], "\"x\"", 3) == 0 && b.salt_len_raw[0] == 3);
    CHECK(memcmp(evil + b.salt_off[1], "\"7:tenantA\"", 11) == 0);
    /* the client's salt is the last one, as the engine's json reads it */
    CHECK(b.salt_len == 18 && memcmp(b.salt, "7:tenantB7:tenantA", 18) == 0);
    /* with no operator salt at all (an empty $var), still not tenant A's */
    CHECK(kv_prompt_compute(&cfg, evil, strlen(evil), "", 0, &c) == KV_PROMPT_OK);
    CHECK(c.salt_len == 11 && memcmp(c.salt, "0:7:tenantA", 11) == 0);
    CHECK(kv_prompt_compute(&cfg, body, strlen(body), "tenantA", 7, &d) == KV_PROMPT_OK);
    for (size_t i = 0; i < 4; i++) {
        CHECK(a.seq[i] == d.seq[i]);
        CHECK(a.seq[i] != b.seq[i] && a.seq[i] != c.seq[i]);
    }
    kv_prompt_free(&a);
    kv_prompt_free(&b);
    kv_prompt_free(&c);
    kv_prompt_free(&d);

    /* no operator salt and no client salt: no salt, the unsalted blocks */
    kv_prompt_config_t plain = { NULL, NULL, NULL, 16, 0, NULL, 0, KV_CHAT_VLLM, NULL, NULL, KV_API_ANY };
    CHECK(kv_prompt_compute(&cfg, body, strlen(body), "", 0, &a) == KV_PROMPT_OK);
    CHECK(kv_prompt_compute(&plain, body, strlen(body), NULL, 0, &b) == KV_PROMPT_OK);
    CHECK(a.salt == NULL && a.nseq == 4 && memcmp(a.seq, b.seq, 4 * sizeof(uint64_t)) == 0);
    kv_prompt_free(&a);
    kv_prompt_free(&b);

    char q[64];
    size_t n = kv_prompt_json_string("a\"b\\c\n", 6, q);
    CHECK(n == 15 && memcmp(q, "\"a\\\"b\\\\c\\u000a\"", 15) == 0);
}

/* Which names an upstream serves: its model (and aliases), its LoRA
 * adapters (a list, or "*" for any), no name at all; without model= every
 * name. */
TEST(model_roles)
{
    CHECK(kv_model_role(NULL, NULL, "x") == KV_MODEL_BASE);
    CHECK(kv_model_role("", NULL, "x") == KV_MODEL_BASE);
    CHECK(kv_model_role("m", NULL, "") == KV_MODEL_BASE);
    CHECK(kv_model_role("m", NULL, "m") == KV_MODEL_BASE);
    CHECK(kv_model_role("m", NULL, "x") == KV_MODEL_OTHER);
    CHECK(kv_model_role("m", "*", "x") == KV_MODEL_LORA);
    CHECK(kv_model_role("m", "*", "m") == KV_MODEL_BASE);
    CHECK(kv_model_role("m", "sql,chat", "sql") == KV_MODEL_LORA);
    CHECK(kv_model_role("m", "sql,chat", "chat") == KV_MODEL_LORA);
    CHECK(kv_model_role("m", "sql,chat", "sq") == KV_MODEL_OTHER);
    CHECK(kv_model_role("m", "sql,chat", "chat2") == KV_MODEL_OTHER);
    CHECK(kv_model_role("m", "sql,chat", "sql,chat") == KV_MODEL_OTHER);
    CHECK(kv_model_role("m,alias", "*", "alias") == KV_MODEL_BASE);    /* not an adapter */
    CHECK(kv_model_role("m,alias", NULL, "m") == KV_MODEL_BASE);
    CHECK(kv_model_role("m,alias", NULL, "m,alias") == KV_MODEL_OTHER);
    CHECK(kv_model_role("m,alias", "*", "x") == KV_MODEL_LORA);
}

/* A request naming a LoRA adapter is hashed with the adapter's seed, as
 * the engine tags the adapter's blocks (vLLM's lora_name: the same seed
 * kv_vllm_lora_seed gives); a salt replaces it; base requests are not
 * seeded; a name served by no one is not routed on its prompt. */
TEST(lora_requests_take_the_adapters_seed)
{
    kv_prompt_config_t cfg = { NULL, NULL, "m", 16, 0, NULL, 0, KV_CHAT_VLLM, NULL, "sql,chat", KV_API_ANY };
    kv_prompt_t base, sql, chat, salted, other;
    uint32_t    ids[32];
    uint64_t    want[2];
    char        b[65536];

    for (size_t i = 0; i < 32; i++) {
        ids[i] = (uint32_t) (1000 + i);
    }
    snprintf(b, sizeof(b), "%s", ids_body(32, ""));
    CHECK(kv_prompt_compute(&cfg, b, strlen(b), NULL, 0, &base) == KV_PROMPT_OK);
    kv_hash_blocks(ids, 32, 16, KV_HASH_SEED, NULL, want);
    CHECK(base.nseq == 2 && memcmp(base.seq, want, sizeof(want)) == 0);

    snprintf(b, sizeof(b), "%s", ids_body(32, ",\"model\":\"sql\""));
    CHECK(kv_prompt_compute(&cfg, b, strlen(b), NULL, 0, &sql) == KV_PROMPT_OK);
    kv_hash_blocks(ids, 32, 16, kv_hash_seed("sql", 3), NULL, want);
    CHECK(sql.nseq == 2 && memcmp(sql.seq, want, sizeof(want)) == 0);

    snprintf(b, sizeof(b), "%s", ids_body(32, ",\"model\":\"chat\""));
    CHECK(kv_prompt_compute(&cfg, b, strlen(b), NULL, 0, &chat) == KV_PROMPT_OK);
    CHECK(chat.nseq == 2 && chat.seq[0] != sql.seq[0] && chat.seq[0] != base.seq[0]);

    snprintf(b, sizeof(b), "%s", ids_body(32, ",\"model\":\"sql\",\"cache_salt\":\"t\""));
    CHECK(kv_prompt_compute(&cfg, b, strlen(b), NULL, 0, &salted) == KV_PROMPT_OK);
    kv_hash_blocks(ids, 32, 16, kv_hash_seed("t", 1), NULL, want);
    CHECK(salted.nseq == 2 && memcmp(salted.seq, want, sizeof(want)) == 0);

    snprintf(b, sizeof(b), "%s", ids_body(32, ",\"model\":\"nope\""));
    CHECK(kv_prompt_compute(&cfg, b, strlen(b), NULL, 0, &other) == KV_PROMPT_MODEL);

    kv_prompt_free(&base);
    kv_prompt_free(&sql);
    kv_prompt_free(&chat);
    kv_prompt_free(&salted);
    kv_prompt_free(&other);
}

/* A tenant's salt reaches the engine whatever the router makes of the
 * prompt: a body it cannot tokenize (no tokenizer here) still gets the
 * combined salt to write, or the engine would cache the tenant's prompt
 * unsalted, where another tenant's fallback could hit it. */
TEST(operator_salt_kept_when_the_prompt_is_not_read)
{
    kv_prompt_config_t cfg = { NULL, NULL, NULL, 16, 0, NULL, 1, KV_CHAT_VLLM, NULL, NULL,
                               KV_API_ANY };
    const char        *text = "{\"prompt\":\"secret\",\"cache_salt\":\"u\"}";
    kv_prompt_t        p;

    CHECK(kv_prompt_compute(&cfg, text, strlen(text), "acme", 4, &p) == KV_PROMPT_NO_TOKENIZER);
    CHECK(p.parsed && p.n_salts == 1);
    CHECK(p.salt_len == 7 && memcmp(p.salt, "4:acmeu", 7) == 0);
    kv_prompt_free(&p);
    cfg.api = KV_API_SCORE;
    text = "{\"query\":\"q\",\"documents\":[\"a\",\"b\"]}";
    CHECK(kv_prompt_compute(&cfg, text, strlen(text), "acme", 4, &p) == KV_PROMPT_OK);
    CHECK(p.salt_len == 6 && memcmp(p.salt, "4:acme", 6) == 0);
    kv_prompt_free(&p);
}

/*
 * Requests that decode nothing: an embedding's `input` hashes as the same
 * completion's `prompt` does; a score (query-document pairs the engine
 * builds) and a tokenize are not read, a score counting its bytes at 4 a
 * token, a tokenize nothing.
 */
TEST(prefill_only_requests)
{
    kv_prompt_config_t cfg = { NULL, NULL, NULL, 16, 0, NULL, 0, KV_CHAT_VLLM, NULL, NULL,
                               KV_API_GENERATE };
    kv_prompt_t        gen, emb;
    char               body[65536], *in;
    const char        *score = "{\"query\":\"what\",\"documents\":[\"a doc\",\"another\"]}";

    snprintf(body, sizeof(body), "%s", ids_body(64, ",\"max_tokens\":9"));
    CHECK(kv_prompt_compute(&cfg, body, strlen(body), NULL, 0, &gen) == KV_PROMPT_OK);
    CHECK(gen.prefill_only == 0 && gen.nseq == 4 && gen.max_tokens == 9);
    in = strstr(body, "\"prompt\"");
    memcpy(in, "\"input\" ", 8);                         /* the same ids as `input` */
    cfg.api = KV_API_POOLING;
    CHECK(kv_prompt_compute(&cfg, body, strlen(body), NULL, 0, &emb) == KV_PROMPT_OK);
    CHECK(emb.prefill_only == 1 && emb.nseq == 4 && emb.prompt_tokens == 64);
    CHECK(memcmp(gen.seq, emb.seq, 4 * sizeof(uint64_t)) == 0);
    kv_prompt_free(&gen);
    kv_prompt_free(&emb);

    cfg.api = KV_API_SCORE;
    CHECK(kv_prompt_compute(&cfg, score, strlen(score), NULL, 0, &emb) == KV_PROMPT_OK);
    CHECK(emb.prefill_only && emb.nseq == 0 && emb.prompt_tokens == 0);
    CHECK_EQ_U64(emb.batch_tokens, (strlen(score) + 3) / 4);
    kv_prompt_free(&emb);
    cfg.api = KV_API_TOKENIZE;
    snprintf(body, sizeof(body), "%s", ids_body(64, ""));
    CHECK(kv_prompt_compute(&cfg, body, strlen(body), NULL, 0, &emb) == KV_PROMPT_OK);
    CHECK(emb.prefill_only && emb.nseq == 0 && emb.prompt_tokens == 0 && emb.batch_tokens == 0);
    kv_prompt_free(&emb);
    /* a body that cannot be read is still one for its path */
    cfg.api = KV_API_POOLING;
    CHECK(kv_prompt_compute(&cfg, "{\"input\":", 9, NULL, 0, &emb) == KV_PROMPT_PARSE);
    CHECK(emb.prefill_only);
    kv_prompt_free(&emb);
}

int main(void)
{
    RUN(session_precedence);
    RUN(operator_salt_combined_not_overridden);
    RUN(operator_salt_kept_when_the_prompt_is_not_read);
    RUN(prefill_only_requests);
    RUN(token_ids_at_several_block_sizes);
    RUN(salt_changes_every_hash);
    RUN(short_prompt_has_no_blocks);
    RUN(fallbacks_say_why);
    RUN(model_roles);
    RUN(lora_requests_take_the_adapters_seed);
    return kvt_done();
}
