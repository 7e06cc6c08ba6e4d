/*
 * The compute backend contract: what the shared scheduler and block manager
 * ask of an engine's forward pass. The mock backend only predicts how long
 * a step takes (Dynamo's perf model); cpu and cuda run a Llama-family model
 * over the paged KV cache whose block ids the block manager hands out.
 *
 * KV layout (cpu and cuda): one pool of num_blocks blocks, each block
 * contiguous across layers: [block][layer][K|V][block_size][n_kv_heads]
 * [head_dim], so one block of all layers is one (offset, block_bytes) range
 * that can be copied to another process in one transfer.
 */
#ifndef KVW_BACKEND_H
#define KVW_BACKEND_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    float       temperature;    /* 0: greedy */
    float       top_p;          /* 1: off */
    int         top_k;          /* 0: off */
    uint64_t   *rng;            /* per-request state, seeded from the request's seed */
} kvw_sampling_t;

/* One sequence's part of a step. */
typedef struct {
    const uint32_t *tokens;     /* tokens to run: a prefill chunk, or the last token when decoding */
    uint32_t        n_tokens;
    uint32_t        pos;        /* position of tokens[0]; KV of [0, pos) is in the cache */
    const uint32_t *block_table;/* physical block ids covering [0, pos + n_tokens) */
    uint32_t        n_blocks;
    uint32_t        cached;     /* prompt tokens served from the prefix cache (timing models) */
    int             sample;     /* sample a next token after tokens[n_tokens - 1] */
    int             decode;     /* a generation step, not a prompt chunk (timing models) */
    kvw_sampling_t  sampling;
    uint32_t        next_token; /* out, when sample */
    float          *logits;     /* out, optional (tests): vocab_size floats for the last token */
} kvw_step_seq_t;

typedef struct kvw_backend kvw_backend_t;

struct kvw_backend {
    const char *name;
    uint32_t    vocab_size;
    uint32_t    eos_token_id;
    uint32_t    eos_ids[8];     /* every id that ends a sequence (n_eos of them; 0: eos_token_id) */
    uint32_t    n_eos;
    uint32_t    max_model_len;
    uint32_t    block_size;
    uint32_t    num_blocks;
    size_t      block_bytes;    /* one block, all layers, K and V */
    int         simulated;      /* step() only predicts: the scheduler waits step_ms */
    /*
     * NULL while the engine works; why not, once it never will again (a
     * sticky CUDA error: every later step fails). kvworker then fails its
     * health check and stops announcing itself, so routers drop it.
     */
    const char *unhealthy;
    /*
     * What block_read/block_write move, as a string two engines must agree on
     * before blocks go from one to the other (element type, order, sizes);
     * NULL: not stated (the cpu engine: f32 in the layout above).
     */
    const char *kv_layout;

    /*
     * Runs one step over n sequences. *step_ms is the step's duration:
     * predicted by the mock (the scheduler then waits that long before
     * delivering tokens), measured by real backends (which have already
     * spent it). 0, or -1 on failure.
     */
    int  (*step)(kvw_backend_t *b, kvw_step_seq_t *seqs, uint32_t n, double *step_ms);

    /* One block of all layers to/from host memory (block_bytes); NULL in the mock. */
    int  (*block_read)(kvw_backend_t *b, uint32_t block, void *dst);
    int  (*block_write)(kvw_backend_t *b, uint32_t block, const void *src);
    /*
     * Where a block lives when the pool is host memory (the cpu engine), so
     * the transfer can send from it and receive into it without a copy;
     * NULL where it is not (cuda: device memory, mock: none).
     */
    void *(*block_ptr)(kvw_backend_t *b, uint32_t block);

    /*
     * CUDA IPC between two processes on one node (docs/PROTOCOL.md, "CUDA
     * IPC"); NULL where the engine has none (mock, cpu). On failure -1 (NULL)
     * with the reason in err, and the caller falls back to the byte stream.
     *
     * ipc_export: the pool's IPC handle (64 bytes), its size and device, once
     * every write to the pool queued so far has completed (another process
     * reads it next). ipc_open: maps another process's pool by its handle, or
     * returns the mapping made before (kept until destroy); a token for
     * blocks_copy_peer. blocks_copy_peer: n blocks, device to device, from
     * the mapped pool at byte offsets src[i] into this pool's blocks dst[i];
     * returns once the copies are complete.
     */
    int   (*ipc_export)(kvw_backend_t *b, uint8_t handle[64], uint64_t *pool_bytes,
                        uint32_t *device, char *err, size_t errlen);
    void *(*ipc_open)(kvw_backend_t *b, const uint8_t handle[64], uint64_t pool_bytes,
                      char *err, size_t errlen);
    int   (*blocks_copy_peer)(kvw_backend_t *b, void *peer, const uint64_t *src,
                              const uint32_t *dst, uint32_t n, char *err, size_t errlen);

    void (*destroy)(kvw_backend_t *b);
};

/*
 * Constructors. mock: Dynamo's perf model, no weights (kvw_mock_model.c).
 * cpu: the C reference forward pass over model_dir (kvw_cpu.c). cuda:
 * dlopen()s libkvcuda.so next to the binary or on the library path
 * (kvw_cuda_loader.c). NULL with a reason in err.
 */
/* Whether tok ends a sequence: eos_token_id or any of eos_ids (Llama-3 instruct has several). */
static inline int kvw_backend_is_eos(const kvw_backend_t *b, uint32_t tok)
{
    uint32_t i;

    if (tok == b->eos_token_id) return 1;
    for (i = 0; i < b->n_eos && i < 8; i++) {
        if (tok == b->eos_ids[i]) return 1;
    }
    return 0;
}

typedef struct {
    const char *model_dir;      /* cpu, cuda: HF-layout directory */
    const char *profile;        /* mock: interpolated perf profile (JSON), NULL: polynomial */
    uint32_t    block_size;
    uint32_t    num_blocks;     /* 0: backend picks (cpu/cuda: from memory) */
    double      speedup;        /* mock: divides predicted times */
    double      decode_speedup; /* mock: further divides decode times (0: 1) */
    int         device;         /* cuda: the GPU's ordinal (--device) */
    uint32_t    max_batched_tokens; /* cuda: scratch for this many tokens a step (0: grow) */
    uint32_t    max_seqs;       /* cuda: and this many sequences a step */
} kvw_backend_config_t;

/* The mock's polynomial model (ms, before --speedup), for tests and tools:
 * prefill(T) = SQUARE T^2 + PER_TOKEN T + FIXED for T > 0 tokens in a step. */
#define KVW_MOCK_PREFILL_SQUARE     4.209989e-07
#define KVW_MOCK_PREFILL_PER_TOKEN  1.518344e-02
#define KVW_MOCK_PREFILL_FIXED      1.650142e+01
double kvw_mock_poly_prefill_ms(double new_tokens);
double kvw_mock_poly_decode_ms(double kv_usage);

kvw_backend_t *kvw_mock_backend_create(const kvw_backend_config_t *cfg, char *err, size_t errlen);
kvw_backend_t *kvw_cpu_backend_create(const kvw_backend_config_t *cfg, char *err, size_t errlen);
kvw_backend_t *kvw_cuda_backend_create(const kvw_backend_config_t *cfg, char *err, size_t errlen);

#endif
