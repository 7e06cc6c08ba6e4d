/*
 * kvemu: a host emulation of the part of the CUDA runtime that the CUDA
 * engine (workers/cuda) uses, so that the engine's unmodified .cu sources
 * build with g++ and run, under ASan, on a machine without a GPU. This
 * folder shadows the toolkit's headers (cuda_runtime.h, cuda_fp16.h,
 * cuda_bf16.h, cublas_v2.h); kvemu.cpp implements them.
 *
 * What is emulated:
 *  - device memory is host memory (a memfd mapped between guard pages, the
 *    slack after the end poisoned: ASan sees every out-of-bounds
 *    access), filled with NaN bytes when allocated; every copy and cuBLAS
 *    operand is checked to lie inside one allocation of the right kind;
 *  - streams: kernel launches, async copies and cuBLAS calls are queued and
 *    run at the next sync point (stream/device synchronize, a synchronous
 *    cudaMemcpy/cudaMemset/cudaFree), so host code that reads results
 *    before synchronizing sees stale data, as on a GPU;
 *  - a launch (KVW_LAUNCH in the sources) runs each block's threads as
 *    cooperative fibers: __syncthreads is a block barrier, warp shuffles
 *    and __syncwarp are warp barriers that exchange values; a barrier not
 *    reached by every thread is reported (divergence, deadlock). Shared
 *    memory is filled with NaN bytes before each block;
 *  - KVW_CUDAEMU_ORDER=reverse runs the threads of a block (and the blocks
 *    of a grid) in reverse order: code that relies on an order the
 *    hardware does not promise gives different results in the two orders;
 *  - a programmatic dependent launch (KVW_LAUNCH_PDL) runs after the grid
 *    before it, as every launch here; each of its blocks must call
 *    kvc_pdl_wait, else the launch fails;
 *  - cublasGemmEx is a reference matmul that checks every argument;
 *  - KVW_CUDAEMU_NO_CAPTURE=1 makes cudaStreamBeginCapture fail (a driver
 *    that cannot capture);
 *  - errors: KVW_CUDAEMU_DEVICE_ERROR=<code> makes cudaGetDeviceCount fail
 *    with that cudaError_t; KVW_CUDAEMU_FAIL_LAUNCH=N makes the Nth kernel
 *    launch fault (cudaErrorIllegalAddress, sticky, as on a GPU).
 *
 * What it cannot catch: races between blocks (blocks run one after
 * another), a kernel reading before its kvc_pdl_wait what the kernel
 * before it writes (grids never overlap here), memory ordering and fences (everything is sequentially
 * consistent here), races inside a warp between shuffles (lanes run one at
 * a time), anything about speed (occupancy, coalescing, bank conflicts,
 * register spills, launch overhead), resource limits of a real device
 * (registers, shared memory size, max grid beyond what is checked), and
 * driver or toolkit behaviour (JIT, versions, ECC, sticky errors of causes
 * other than the injected one). The real nvcc build is the only check of
 * device code generation.
 */
#ifndef KVEMU_CUDA_RUNTIME_H
#define KVEMU_CUDA_RUNTIME_H

#ifndef __cplusplus
#error "kvemu needs C++ (g++ -x c++)"
#endif

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <tuple>
#include <type_traits>
#include <utility>

#include "cuda_bf16.h"
#include "cuda_fp16.h"

#define KVEMU 1
#define CUDART_VERSION 13000  /* the toolkit the real build uses */

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __align__(n) __attribute__((aligned(n)))
#define __restrict__ __restrict
/* every __shared__ variable lives in one section, poisoned before each block */
#define __shared__ static __attribute__((section("kvemu_shared")))

struct uint3 {
    unsigned x, y, z;
};

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};

/* the values are the toolkit's, so messages and codes read the same */
typedef enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInitializationError = 3,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorInvalidMemcpyDirection = 21,
    cudaErrorInsufficientDriver = 35,
    cudaErrorDevicesUnavailable = 46,
    cudaErrorNoDevice = 100,
    cudaErrorInvalidDevice = 101,
    cudaErrorNoKernelImageForDevice = 209,
    cudaErrorDeviceUninitialized = 201,
    cudaErrorAlreadyMapped = 208,
    cudaErrorPeerAccessUnsupported = 217,
    cudaErrorUnsupportedPtxVersion = 222,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorIllegalState = 401,
    cudaErrorNotReady = 600,
    cudaErrorIllegalAddress = 700,
    cudaErrorLaunchTimeout = 702,
    cudaErrorAssert = 710,
    cudaErrorHardwareStackError = 714,
    cudaErrorIllegalInstruction = 715,
    cudaErrorMisalignedAddress = 716,
    cudaErrorInvalidAddressSpace = 717,
    cudaErrorInvalidPc = 718,
    cudaErrorLaunchFailure = 719,
    cudaErrorNotSupported = 801,
    cudaErrorSystemDriverMismatch = 803,
    cudaErrorCompatNotSupportedOnDevice = 804,
    cudaErrorStreamCaptureUnsupported = 900,
    cudaErrorStreamCaptureInvalidated = 901,
    cudaErrorStreamCaptureImplicit = 906,
    cudaErrorUnknown = 999
} cudaError_t;

typedef enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4
} cudaMemcpyKind;

typedef enum cudaDataType_t {
    CUDA_R_32F = 0,
    CUDA_R_64F = 1,
    CUDA_R_16F = 2,
    CUDA_R_16BF = 14
} cudaDataType_t;

typedef struct kvemu_stream *cudaStream_t;
typedef struct kvemu_event  *cudaEvent_t;
typedef struct kvemu_graph  *cudaGraph_t;
typedef struct kvemu_graph  *cudaGraphExec_t;    /* an instantiated graph: its own copy */

typedef enum cudaStreamCaptureMode {
    cudaStreamCaptureModeGlobal = 0,
    cudaStreamCaptureModeThreadLocal = 1,
    cudaStreamCaptureModeRelaxed = 2
} cudaStreamCaptureMode;

typedef enum cudaStreamCaptureStatus {
    cudaStreamCaptureStatusNone = 0,
    cudaStreamCaptureStatusActive = 1,
    cudaStreamCaptureStatusInvalidated = 2
} cudaStreamCaptureStatus;

#define cudaStreamDefault     0x00
#define cudaStreamNonBlocking 0x01
#define cudaEventDefault      0x00

struct cudaDeviceProp {
    char   name[256];
    size_t totalGlobalMem;
    int    major, minor, multiProcessorCount;
};

cudaError_t cudaGetDeviceCount(int *count);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDevice(int *device);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *prop, int device);
cudaError_t cudaDriverGetVersion(int *v);
cudaError_t cudaRuntimeGetVersion(int *v);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaGetLastError(void);
cudaError_t cudaPeekAtLastError(void);
const char *cudaGetErrorString(cudaError_t e);
const char *cudaGetErrorName(cudaError_t e);

cudaError_t cudaMalloc(void **p, size_t n);
cudaError_t cudaFree(void *p);
cudaError_t cudaMallocHost(void **p, size_t n);
cudaError_t cudaFreeHost(void *p);
cudaError_t cudaMemGetInfo(size_t *free_b, size_t *total_b);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, cudaMemcpyKind kind,
                            cudaStream_t st = 0);
cudaError_t cudaMemset(void *p, int v, size_t n);
cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t st = 0);

/*
 * CUDA IPC: a device allocation exported by one process and mapped by
 * another on the same machine. Every cudaMalloc here is a memfd mapping, so
 * the handle (the exporter's pid, the memfd's descriptor, inode, size and
 * serial, and the boot id) lets another process map the same pages. As the
 * driver: only the base of an allocation can be exported; the exporting
 * process cannot open its own handle (cudaErrorDeviceUninitialized, "invalid
 * device context"); a handle already open in this process is
 * cudaErrorAlreadyMapped; a handle whose allocation was freed or whose
 * process is gone, one from another machine or garbage is
 * cudaErrorInvalidValue; a mapping is undone with cudaIpcCloseMemHandle
 * (cudaFree refuses it). KVW_CUDAEMU_NO_PEER=1: devices that differ cannot
 * reach each other (cudaErrorPeerAccessUnsupported, cudaDeviceCanAccessPeer
 * 0); KVW_CUDAEMU_IPC=0: the platform has no IPC (cudaErrorNotSupported).
 */
typedef struct cudaIpcMemHandle_st {
    char reserved[64];
} cudaIpcMemHandle_t;

#define cudaIpcMemLazyEnablePeerAccess 0x01

cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t *handle, void *dev_ptr);
cudaError_t cudaIpcOpenMemHandle(void **dev_ptr, cudaIpcMemHandle_t handle, unsigned flags);
cudaError_t cudaIpcCloseMemHandle(void *dev_ptr);
cudaError_t cudaDeviceCanAccessPeer(int *can, int device, int peer_device);

cudaError_t cudaStreamCreate(cudaStream_t *st);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *st, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t st);
cudaError_t cudaStreamSynchronize(cudaStream_t st);

cudaError_t cudaEventCreate(cudaEvent_t *ev);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *ev, unsigned flags);
cudaError_t cudaEventRecord(cudaEvent_t ev, cudaStream_t st = 0);
cudaError_t cudaEventSynchronize(cudaEvent_t ev);
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b);
cudaError_t cudaEventDestroy(cudaEvent_t ev);
cudaError_t cudaStreamWaitEvent(cudaStream_t st, cudaEvent_t ev, unsigned flags = 0);

/*
 * CUDA graphs by stream capture: while a stream captures, what is queued on
 * it (launches, async copies and memsets, cuBLAS calls) is recorded instead
 * of queued, with its arguments as they were at the call; a launched graph
 * queues the recorded work again, in order. A synchronizing call (or work
 * on the legacy stream) during a capture fails and invalidates it, as the
 * driver does in the global and thread-local modes.
 */
cudaError_t cudaStreamBeginCapture(cudaStream_t st, cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t st, cudaGraph_t *graph);
cudaError_t cudaStreamIsCapturing(cudaStream_t st, cudaStreamCaptureStatus *status);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t graph,
                                 unsigned long long flags = 0);
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t st);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec);
cudaError_t cudaGraphDestroy(cudaGraph_t graph);

/* --- device side ------------------------------------------------------------ */

namespace kvemu {

uint3 thread_idx(void);
uint3 block_idx(void);
dim3  block_dim(void);
dim3  grid_dim(void);
void  sync_threads(void);
/* the warp exchange behind every shuffle: my value out, lane src's value back */
uint64_t warp_exchange(unsigned mask, uint64_t mine, int src);

template <class V> static inline V shfl(unsigned mask, V v, int src)
{
    static_assert(sizeof(V) <= 8 && std::is_trivially_copyable<V>::value, "shuffle of a word");
    uint64_t bits = 0, got;
    V        out;

    memcpy(&bits, &v, sizeof(V));
    got = warp_exchange(mask, bits, src);
    memcpy(&out, &got, sizeof(V));
    return out;
}

}  // namespace kvemu

#define threadIdx (kvemu::thread_idx())
#define blockIdx  (kvemu::block_idx())
#define blockDim  (kvemu::block_dim())
#define gridDim   (kvemu::grid_dim())
#define warpSize  32

static inline void __syncthreads(void) { kvemu::sync_threads(); }
static inline void __syncwarp(unsigned mask = 0xffffffffu) { kvemu::warp_exchange(mask, 0, 0); }

static inline int kvemu_lane(void) { return (int) (kvemu::thread_idx().x & 31); }

template <class V> static inline V __shfl_xor_sync(unsigned mask, V v, int lane_mask, int w = 32)
{
    int lane = kvemu_lane(), src = lane ^ lane_mask;

    return kvemu::shfl(mask, v, src / w == lane / w ? src : lane);
}

template <class V> static inline V __shfl_sync(unsigned mask, V v, int src, int w = 32)
{
    return kvemu::shfl(mask, v, (kvemu_lane() / w) * w + (src % w));
}

template <class V> static inline V __shfl_down_sync(unsigned mask, V v, unsigned d, int w = 32)
{
    int lane = kvemu_lane(), src = lane + (int) d;

    return kvemu::shfl(mask, v, src / w == lane / w ? src : lane);
}

template <class V> static inline V __shfl_up_sync(unsigned mask, V v, unsigned d, int w = 32)
{
    int lane = kvemu_lane(), src = lane - (int) d;

    return kvemu::shfl(mask, v, src >= 0 && src / w == lane / w ? src : lane);
}

/* fibers switch only at barriers, so a read-modify-write is atomic here */
template <class V> static inline V atomicAdd(V *p, V v) { V o = *p; *p = o + v; return o; }
template <class V> static inline V atomicSub(V *p, V v) { V o = *p; *p = o - v; return o; }
template <class V> static inline V atomicExch(V *p, V v) { V o = *p; *p = v; return o; }
template <class V> static inline V atomicMax(V *p, V v) { V o = *p; if (v > o) *p = v; return o; }
template <class V> static inline V atomicMin(V *p, V v) { V o = *p; if (v < o) *p = v; return o; }
template <class V> static inline V atomicCAS(V *p, V cmp, V v)
{
    V o = *p;

    if (o == cmp) *p = v;
    return o;
}
static inline void __threadfence(void) {}
static inline void __threadfence_block(void) {}

static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline float __fdividef(float a, float b) { return a / b; }
template <class V> static inline V __ldg(const V *p) { return *p; }

/* --- launches ------------------------------------------------------------------ */

namespace kvemu {

struct body {
    virtual ~body() {}
    virtual void run() = 0;
};

template <class F> struct body_of : body {
    F f;
    explicit body_of(F g) : f(std::move(g)) {}
    void run() override { f(); }
};

/*
 * Checks the configuration now (cudaGetLastError reports it) and queues the
 * grid. pdl: launched as a programmatic dependent launch (KVW_LAUNCH_PDL);
 * grids run one after another here as always, but every block of such a
 * grid must call kvc_pdl_wait (pdl_wait), else the launch fails: on a GPU
 * it would read the kernel before's results while that kernel still runs.
 */
cudaError_t enqueue(const char *name, dim3 grid, dim3 block, size_t smem, cudaStream_t st,
                    body *b, int pdl = 0);

/* kvc_pdl_wait in a kernel (see enqueue) */
void pdl_wait(void);

/* The arguments are converted to the kernel's parameter types and copied at the launch, as <<<>>> does. */
template <class... P, class... A>
cudaError_t launch_as(int pdl, const char *name, dim3 grid, dim3 block, size_t smem,
                      cudaStream_t st, void (*k)(P...), A &&...a)
{
    static_assert(sizeof...(P) == sizeof...(A), "kernel called with the wrong number of arguments");
    std::tuple<typename std::decay<P>::type...> args(std::forward<A>(a)...);
    auto f = [k, args]() { std::apply(k, args); };

    return enqueue(name, grid, block, smem, st, new body_of<decltype(f)>(std::move(f)), pdl);
}

}  // namespace kvemu

#define KVW_LAUNCH(K, grid, block, smem, stream, ...) \
    ((void) kvemu::launch_as(0, #K, grid, block, smem, stream, K, __VA_ARGS__))
#define KVW_LAUNCH_PDL(pdl, K, grid, block, smem, stream, ...) \
    ((void) kvemu::launch_as(pdl, #K, grid, block, smem, stream, K, __VA_ARGS__))

#endif
