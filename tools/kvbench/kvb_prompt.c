#include "kvb_prompt.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int kvb_buf_add(kvb_buf_t *b, const char *s, size_t n)
{
    if (b->len + n + 1 > b->cap) {
        size_t c = b->cap ? b->cap : 4096;
        while (c < b->len + n + 1)
            c *= 2;
        char *p = realloc(b->buf, c);
        if (p == NULL)
            return -1;
        b->buf = p;
        b->cap = c;
    }
    memcpy(b->buf + b->len, s, n);
    b->len += n;
    b->buf[b->len] = '\0';
    return 0;
}

int kvb_buf_printf(kvb_buf_t *b, const char *fmt, ...)
{
    char small[512];
    va_list ap;

    va_start(ap, fmt);
    int n = vsnprintf(small, sizeof(small), fmt, ap);
    va_end(ap);
    if (n < 0)
        return -1;
    if ((size_t)n < sizeof(small))
        return kvb_buf_add(b, small, (size_t)n);
    char *big = malloc((size_t)n + 1);
    if (big == NULL)
        return -1;
    va_start(ap, fmt);
    vsnprintf(big, (size_t)n + 1, fmt, ap);
    va_end(ap);
    int rc = kvb_buf_add(b, big, (size_t)n);
    free(big);
    return rc;
}

void kvb_buf_free(kvb_buf_t *b)
{
    free(b->buf);
    memset(b, 0, sizeof(*b));
}

/* splitmix64: a cheap, well-mixed function of (hash id, position). */
static uint64_t mix(uint64_t h, uint64_t pos)
{
    uint64_t z = h * 0x9E3779B97F4A7C15ull + pos + 0x632BE59BD9B4E019ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

uint32_t kvb_block_token(uint64_t h, uint32_t pos, uint32_t vocab)
{
    /* ids below 100 are where tokenizers keep special tokens */
    return 100 + (uint32_t)(mix(h, pos) % (vocab ? vocab : 1));
}

/*
 * Short, common English words: each is one token (with its leading space)
 * in the usual BPE vocabularies (GPT-2, Llama, Qwen), so a 512-word block is
 * about 512 tokens there. A byte-level tokenizer sees about 4 bytes a word.
 */
static const char *const words[] = {
    " the", " of", " and", " to", " in", " is", " that", " for", " it", " as",
    " was", " with", " be", " by", " on", " not", " he", " this", " are", " or",
    " his", " from", " at", " which", " but", " have", " an", " had", " they", " you",
    " were", " their", " one", " all", " we", " can", " her", " has", " there", " been",
    " if", " more", " when", " will", " would", " who", " so", " no", " she", " other",
    " its", " time", " may", " what", " about", " out", " up", " into", " them", " some",
    " than", " only", " could", " new", " these", " two", " first", " then", " do", " any",
    " like", " my", " now", " over", " such", " our", " man", " me", " even", " most",
    " made", " after", " also", " did", " many", " off", " before", " must", " well", " back",
    " through", " years", " much", " where", " your", " way", " down", " should", " because", " long",
    " each", " just", " state", " people", " those", " too", " how", " little", " good", " world",
    " make", " very", " year", " still", " see", " own", " work", " men", " day", " get",
    " here", " between", " both", " life", " being", " under", " never", " same", " another", " know",
    " while", " last", " might", " us", " great", " old", " open", " come", " since", " against",
    " go", " came", " right", " used", " take", " three", " himself", " few", " house", " use",
    " during", " without", " again", " place", " around", " however", " home", " small", " found", " thought",
    " went", " say", " part", " once", " general", " high", " upon", " school", " every", " don",
    " does", " got", " united", " left", " number", " course", " war", " until", " always", " away",
    " something", " fact", " though", " water", " less", " public", " put", " think", " almost", " hand",
    " enough", " far", " took", " head", " yet", " government", " system", " better", " set", " told",
    " nothing", " night", " end", " why", " called", " didn", " eyes", " find", " going", " look",
    " asked", " later", " knew", " point", " next", " program", " city", " business", " give", " group",
    " toward", " young", " days", " let", " room", " president", " side", " social", " given", " present",
    " several", " order", " national", " second", " possible", " rather", " per", " face", " among", " form",
    " often", " important", " things", " looked", " early", " white", " case", " john", " become", " large",
    " big", " need", " four", " within", " felt", " along", " children", " saw", " best", " church",
};

const char *kvb_block_word(uint64_t h, uint32_t pos)
{
    return words[mix(h, pos) % (sizeof(words) / sizeof(words[0]))];
}

/* The hash id of position i of request idx's prompt, or a unique id past the ids. */
static uint64_t block_id(const kv_trace_t *t, const kv_trace_req_t *r, size_t idx, uint32_t blk)
{
    if (blk < r->n_hash)
        return kv_trace_ids(t, r)[blk];
    /* the top bit keeps these apart from any id a trace uses */
    return (1ull << 63) | ((uint64_t)idx << 20) | blk;
}

int kvb_prompt_json(kvb_buf_t *b, const kv_trace_t *t, const kv_trace_req_t *r, size_t idx,
                    uint32_t block_size, uint32_t vocab, int text)
{
    uint32_t n = r->input_length ? r->input_length : 1;
    char num[16];

    if (kvb_buf_add(b, text ? "\"" : "[", 1))
        return -1;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t h = block_id(t, r, idx, i / block_size);
        if (text) {
            const char *w = kvb_block_word(h, i % block_size);
            if (kvb_buf_add(b, w, strlen(w)))
                return -1;
        } else {
            int k = snprintf(num, sizeof(num), i ? ",%u" : "%u",
                             kvb_block_token(h, i % block_size, vocab));
            if (kvb_buf_add(b, num, (size_t)k))
                return -1;
        }
    }
    return kvb_buf_add(b, text ? "\"" : "]", 1);
}
