/*
 * HuggingFace tokenizer.json loader and encoder, exact to HF `tokenizers`
 * for the families in conf/tokenizers/ (byte-level BPE, regex split +
 * byte-level BPE, SentencePiece-style BPE with byte fallback).
 *
 * A loaded tokenizer is immutable: encode/decode may run concurrently from
 * any number of threads (nginx workers tokenize on the event loop and in
 * thread pools). A feature of tokenizer.json this code does not implement
 * is refused by kv_tokenizer_load() with a message naming it.
 */
#ifndef KV_TOKENIZER_H
#define KV_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

typedef struct kv_tokenizer kv_tokenizer_t;

/* A growable id array; zero-initialise, free ids with free(). */
typedef struct {
    uint32_t   *ids;
    size_t      n;
    size_t      cap;
} kv_ids_t;

/* Loads tokenizer.json. NULL on error, with the reason in err. */
kv_tokenizer_t *kv_tokenizer_load(const char *path, char *err, size_t errlen);
/* The same from a buffer holding the file's bytes. */
kv_tokenizer_t *kv_tokenizer_load_buffer(const char *json, size_t len,
                                         char *err, size_t errlen);
void kv_tokenizer_free(kv_tokenizer_t *t);

/*
 * Appends the ids of text[0..len) to out, as HF Tokenizer.encode(text,
 * add_special_tokens=add_special).ids does: added tokens split out first,
 * then normalizer, pre-tokenizer, model, and (if add_special) the
 * post-processor's special tokens. Invalid UTF-8 is handled as HF does
 * for Python strings with surrogate escapes replaced (U+FFFD per bad byte).
 * Returns the number of ids appended, or -1 on allocation failure.
 */
long kv_tokenizer_encode(const kv_tokenizer_t *t, const char *text, size_t len,
                         int add_special, kv_ids_t *out);

/*
 * Decodes ids to UTF-8 as HF Tokenizer.decode(ids, skip_special_tokens)
 * does. Returns a malloc'ed NUL-terminated string (length in *len) or NULL.
 */
char *kv_tokenizer_decode(const kv_tokenizer_t *t, const uint32_t *ids, size_t n,
                          int skip_special, size_t *len);

/*
 * The raw bytes one token stands for (byte-level and byte-fallback tokens
 * decode to bytes that may be a partial UTF-8 sequence): for incremental
 * detokenisation in streaming workers. Returns the byte count written to
 * buf (at most cap), or -1 for an unknown id.
 */
long kv_tokenizer_token_bytes(const kv_tokenizer_t *t, uint32_t id, char *buf, size_t cap);

uint32_t kv_tokenizer_vocab_size(const kv_tokenizer_t *t);
/* Bytes of heap memory held by t. */
size_t kv_tokenizer_memory(const kv_tokenizer_t *t);

/*
 * Work the calling thread's encodes have done, as counts rather than time
 * (deterministic, so tests can check how cost grows with input): symbols
 * BPE-merged, merges applied, and queue operations of long words
 * (candidates pushed, taken and sorted). reset: zero them after reading.
 */
typedef struct {
    uint64_t    symbols;
    uint64_t    merges;
    uint64_t    queue_ops;
} kv_tok_work_t;

void kv_tokenizer_work(kv_tok_work_t *out, int reset);

/*
 * Encodes on the calling thread stop early, returning -1 as on allocation
 * failure, once *flag (read atomically) becomes nonzero: a prompt whose
 * client has gone stops costing CPU (the router's thread pool). Checked
 * between pre-token words, so one huge word is not interrupted. NULL: off.
 */
void kv_tokenizer_cancel_on(const int *flag);

/* Frees ids held by out and zeroes it. */
void kv_ids_free(kv_ids_t *out);

#endif
