/*
 * kvemu: the host emulation of the CUDA runtime and cuBLAS declared in this
 * folder's headers (cuda_runtime.h says what is emulated and what is not).
 *
 * One lock serializes every call: the engine drives one stream from one
 * thread at a time, and the emulation runs queued work on the thread that
 * synchronizes. Threads of a block are fibers with their own stacks,
 * switched by a few lines of assembly (x86-64) or by ucontext elsewhere; a
 * fiber runs until it reaches a barrier (__syncthreads, a shuffle,
 * __syncwarp) or ends, then the next one runs.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <vector>

#include "cublas_v2.h"
#include "cuda_runtime.h"
#include "mma.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define KVEMU_ASAN 1
#else
#define KVEMU_ASAN 0
#endif

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

/* --- state -------------------------------------------------------------------- */

typedef std::function<cudaError_t()> op_t;

struct kvemu_graph {
    std::vector<op_t> ops;
    int               exec;         /* instantiated (cudaGraphExec_t) */
};

struct kvemu_stream {
    std::deque<op_t> q;
    kvemu_graph     *capture;       /* recording into this graph, or NULL */
    int              invalidated;   /* the capture met a call it does not allow */
};

struct kvemu_event {
    int recorded;
};

struct kvemu_cublas {
    cudaStream_t st;
};

namespace {

std::recursive_mutex             lock_;
std::map<uintptr_t, size_t>      dev_;          /* device allocations: base -> size */
std::map<uintptr_t, size_t>      pinned_;       /* cudaMallocHost */

/*
 * Where a device allocation lives: a memfd (so cudaIpcGetMemHandle can hand
 * it to another process) mapped between two inaccessible guard pages; the
 * slack after the allocation's end, up to the page, is poisoned for ASan.
 */
struct mapping {
    void     *region;               /* guard page, data, guard page */
    size_t    region_len;
    int       fd;                   /* the memfd (-1: an imported mapping, fd closed) */
    uint64_t  serial;               /* this process's allocation number, in the memfd's name */
    int       device;
};
std::map<uintptr_t, mapping>     maps_;         /* every device allocation: base -> mapping */
std::set<uintptr_t>              imported_;     /* bases opened by cudaIpcOpenMemHandle */
std::map<std::pair<long, uint64_t>, uintptr_t> opened_;  /* (pid, serial) -> base here */
uint64_t                         serial_;
int                              device_;       /* cudaSetDevice */
std::set<kvemu_stream *>         streams_;
std::set<kvemu_cublas *>         handles_;
std::set<kvemu_event *>          events_;
std::set<kvemu_graph *>          graphs_;       /* graphs and instantiated graphs */
int                              capturing_;    /* streams capturing now */
size_t                           dev_used_;
cudaError_t                      sticky_;       /* a fault: every later call returns it */
cudaError_t                      last_;         /* cudaGetLastError (per process here, not per thread) */
long                             launches_;     /* kernels enqueued, for FAIL_LAUNCH */
kvemu_stream                     legacy_;       /* the NULL stream */

long env_long(const char *name, long dflt)
{
    const char *v = getenv(name);

    return v && *v ? strtol(v, NULL, 10) : dflt;
}

int reverse_order(void)
{
    const char *v = getenv("KVW_CUDAEMU_ORDER");

    return v && !strcmp(v, "reverse");
}

size_t total_mem(void)
{
    return (size_t) env_long("KVW_CUDAEMU_MEM_MB", 4096) << 20;
}

cudaError_t set(cudaError_t e)
{
    if (e != cudaSuccess) last_ = e;
    return e;
}

void complain(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void complain(const char *fmt, ...)
{
    va_list ap;

    va_start(ap, fmt);
    fputs("kvemu: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

/* The allocation of table t that holds [p, p + n), or NULL. */
const std::pair<const uintptr_t, size_t> *inside(const std::map<uintptr_t, size_t> &t,
                                                 const void *p, size_t n)
{
    uintptr_t a = (uintptr_t) p;
    auto      it = t.upper_bound(a);

    if (it == t.begin()) return NULL;
    --it;
    if (a < it->first || a - it->first > it->second || n > it->second - (a - it->first))
        return NULL;
    return &*it;
}

int is_device(const void *p) { return inside(dev_, p, 1) != NULL; }

/* Runs a stream's queue; a failure drops the rest (as a faulted context does). */
cudaError_t drain(kvemu_stream *s)
{
    while (!s->q.empty()) {
        op_t        op = std::move(s->q.front());
        cudaError_t e;

        s->q.pop_front();
        if (sticky_ != cudaSuccess) continue;
        e = op();
        if (e != cudaSuccess) {
            sticky_ = e;
            last_ = e;
        }
    }
    return sticky_;
}

/* The legacy default stream waits for every blocking stream: all queues run. */
cudaError_t drain_all(void)
{
    drain(&legacy_);
    for (kvemu_stream *s : streams_) drain(s);
    return sticky_;
}

kvemu_stream *stream_of(cudaStream_t st)
{
    if (st == NULL) return &legacy_;
    return streams_.count(st) ? st : NULL;
}

/* A call that would wait for the device, while streams capture: refused, and the captures end invalid. */
cudaError_t capture_refuses(const char *what)
{
    if (capturing_ == 0) return cudaSuccess;
    complain("%s during a stream capture: not allowed (the capture is invalidated)", what);
    for (kvemu_stream *s : streams_) {
        if (s->capture) s->invalidated = 1;
    }
    return cudaErrorStreamCaptureUnsupported;
}

/* Queues op on st (records it, while st captures), or runs it after everything else on the NULL stream. */
cudaError_t submit(cudaStream_t st, op_t op)
{
    kvemu_stream *s = stream_of(st);

    if (s == NULL) return set(cudaErrorInvalidResourceHandle);
    if (sticky_ != cudaSuccess) return set(sticky_);
    if (s == &legacy_ && capturing_) {
        capture_refuses("work on the legacy default stream");
        return set(cudaErrorStreamCaptureImplicit);
    }
    if (s->capture) {
        s->capture->ops.push_back(std::move(op));
        return cudaSuccess;
    }
    s->q.push_back(std::move(op));
    return cudaSuccess;
}

}  // namespace

/* --- fibers ---------------------------------------------------------------------- */

namespace {

enum { F_RUN, F_BLOCK_BAR, F_WARP_BAR, F_DONE };

struct fiber {
    void     *sp;                   /* saved stack pointer (x86-64) */
#if !defined(__x86_64__)
    ucontext_t uc;
#endif
    char     *stack;
    size_t    size;
    int       state, parity;
    int       returned;             /* its body returned: only the top frames are left */
    unsigned  mask;                 /* of the warp barrier it waits at */
    uint3     tid;
    int       linear;
    void     *fake;                 /* ASan's fake stack while switched out */
};

struct warp_slots {
    uint64_t v[2][32];
    float    m[2][3 * 256];         /* wmma::mma_sync's operands, one round each (mma.h) */
};

const size_t STACK = 256 << 10;

std::vector<fiber>      fibers_;
std::vector<warp_slots> warps_;
fiber                  *cur_;
void                   *sched_sp_;
#if !defined(__x86_64__)
ucontext_t              sched_uc_;
#endif
const void             *sched_bottom_;
size_t                  sched_size_;
uint3                   block_;
dim3                    bdim_, gdim_;
kvemu::body            *body_;
const char             *kname_;
long                    pdl_waits_;     /* kvc_pdl_wait calls in the running block */
char                    kerr_[256];     /* a device-side error of this launch */

#if defined(__x86_64__)
extern "C" void kvemu_switch(void **save_sp, void *to_sp);
__asm__(".text\n"
        ".p2align 4\n"
        ".type kvemu_switch,@function\n"
        ".hidden kvemu_switch\n"
        "kvemu_switch:\n"
        "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
        "  movq %rsp, (%rdi)\n"
        "  movq %rsi, %rsp\n"
        "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
        "  ret\n"
        ".size kvemu_switch, .-kvemu_switch\n");
#endif

void to_scheduler(int finished)
{
    fiber *f = cur_;

#if KVEMU_ASAN
    __sanitizer_start_switch_fiber(finished ? NULL : &f->fake, sched_bottom_, sched_size_);
#endif
#if defined(__x86_64__)
    kvemu_switch(&f->sp, sched_sp_);
#else
    swapcontext(&f->uc, &sched_uc_);
#endif
#if KVEMU_ASAN
    __sanitizer_finish_switch_fiber(f->fake, &sched_bottom_, &sched_size_);
#endif
    (void) finished;
}

extern "C" void kvemu_fiber_main(void)
{
#if KVEMU_ASAN
    __sanitizer_finish_switch_fiber(NULL, &sched_bottom_, &sched_size_);
#endif
    body_->run();
    cur_->returned = 1;
    cur_->state = F_DONE;
    to_scheduler(1);
    abort();                        /* a finished fiber is never resumed */
}

void start_fiber(fiber *f)
{
    if (f->stack == NULL) {
        f->size = STACK;
        f->stack = (char *) mmap(NULL, f->size, PROT_READ | PROT_WRITE,
                                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (f->stack == MAP_FAILED) {
            complain("cannot map a fiber stack: %s", strerror(errno));
            abort();
        }
    }
#if KVEMU_ASAN
    /*
     * The previous fiber on this stack never returned: its frames are still
     * poisoned. One whose body returned left only kvemu_fiber_main's and
     * to_scheduler's, above the stack pointer it switched out at; the frames
     * below returned and cleared their own shadow. Clearing all 256 KiB for
     * every thread of every block was a third of an emulated run's time.
     */
    {
        char *from = f->stack;
#if defined(__x86_64__)
        if (f->returned && (char *) f->sp - 256 > f->stack)
            from = (char *) f->sp - 256;
#endif
        __asan_unpoison_memory_region(from, (size_t) (f->stack + f->size - from));
    }
#endif
#if defined(__x86_64__)
    {
        uintptr_t *top = (uintptr_t *) ((uintptr_t) (f->stack + f->size) & ~(uintptr_t) 15);

        *--top = 0;                             /* kvemu_fiber_main's return address */
        *--top = (uintptr_t) kvemu_fiber_main;  /* where kvemu_switch returns to */
        for (int i = 0; i < 6; i++) *--top = 0; /* rbp rbx r12..r15 */
        f->sp = top;
    }
#else
    getcontext(&f->uc);
    f->uc.uc_stack.ss_sp = f->stack;
    f->uc.uc_stack.ss_size = f->size;
    f->uc.uc_link = NULL;
    makecontext(&f->uc, kvemu_fiber_main, 0);
#endif
    f->state = F_RUN;
    f->returned = 0;
    f->parity = 0;
    f->fake = NULL;
}

void resume(fiber *f)
{
    void *fake = NULL;

    cur_ = f;
#if KVEMU_ASAN
    __sanitizer_start_switch_fiber(&fake, f->stack, f->size);
#endif
#if defined(__x86_64__)
    kvemu_switch(&sched_sp_, f->sp);
#else
    swapcontext(&sched_uc_, &f->uc);
#endif
#if KVEMU_ASAN
    __sanitizer_finish_switch_fiber(fake, NULL, NULL);
#endif
    cur_ = NULL;
}

void device_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void device_error(const char *fmt, ...)
{
    va_list ap;

    if (kerr_[0]) return;           /* the first one is the cause */
    va_start(ap, fmt);
    vsnprintf(kerr_, sizeof(kerr_), fmt, ap);
    va_end(ap);
}

extern "C" char __start_kvemu_shared[] __attribute__((weak, visibility("hidden")));
extern "C" char __stop_kvemu_shared[] __attribute__((weak, visibility("hidden")));

/* Shared memory starts as NaN bytes: a read before a write shows in the results. */
__attribute__((no_sanitize_address)) void poison_shared(void)
{
    volatile char *p = __start_kvemu_shared, *end = __stop_kvemu_shared;

    if (p == NULL) return;
    for (; p < end && ((uintptr_t) p & 7); p++) *p = (char) 0xff;
    for (; p + 8 <= end; p += 8) *(volatile uint64_t *) p = ~(uint64_t) 0;
    for (; p < end; p++) *p = (char) 0xff;
}

/*
 * One block: every fiber runs until it waits or ends; a barrier opens when
 * every thread it concerns has reached it. Nothing runnable and not all
 * done is a deadlock: a barrier in divergent code.
 */
void run_block(int n)
{
    int rev = reverse_order(), done = 0;

    for (int i = 0; i < n; i++) start_fiber(&fibers_[i]);
    poison_shared();
    while (done < n) {
        int ran = 0, at_block = 0;

        for (int j = 0; j < n; j++) {
            fiber *f = &fibers_[rev ? n - 1 - j : j];

            if (f->state != F_RUN) continue;
            resume(f);
            ran++;
            if (kerr_[0]) return;
        }
        done = 0;
        for (int i = 0; i < n; i++) {
            done += fibers_[i].state == F_DONE;
            at_block += fibers_[i].state == F_BLOCK_BAR;
        }
        /* warps: open when every lane of the warp waits at a warp barrier */
        for (int w = 0; w * 32 < n; w++) {
            int lanes = n - w * 32 < 32 ? n - w * 32 : 32, waiting = 0;

            for (int l = 0; l < lanes; l++) waiting += fibers_[w * 32 + l].state == F_WARP_BAR;
            if (waiting == 0) continue;
            if (waiting == lanes) {
                for (int l = 0; l < lanes; l++) fibers_[w * 32 + l].state = F_RUN;
                ran++;
            }
        }
        if (at_block > 0 && at_block + done == n) {
            if (done > 0) {
                device_error("__syncthreads reached by %d threads while %d had returned",
                             at_block, done);
                return;
            }
            for (int i = 0; i < n; i++) fibers_[i].state = F_RUN;
            ran++;
        }
        if (!ran && done < n) {
            device_error("deadlock: %d threads at __syncthreads, %d at a warp barrier, %d "
                         "returned (a barrier in divergent code)", at_block,
                         n - at_block - done, done);
            return;
        }
    }
}

cudaError_t run_grid(const char *name, dim3 g, dim3 b, kvemu::body *bd, int pdl)
{
    int      n = (int) (b.x * b.y * b.z), rev = reverse_order();
    unsigned nb = g.x * g.y * g.z;

    if ((int) fibers_.size() < n) fibers_.resize((size_t) n);
    warps_.resize((size_t) (n + 31) / 32);
    for (int i = 0; i < n; i++) {
        fiber *f = &fibers_[i];

        f->linear = i;
        f->tid.x = (unsigned) i % b.x;
        f->tid.y = (unsigned) i / b.x % b.y;
        f->tid.z = (unsigned) i / (b.x * b.y);
    }
    bdim_ = b;
    gdim_ = g;
    body_ = bd;
    kname_ = name;
    kerr_[0] = '\0';
    for (unsigned j = 0; j < nb; j++) {
        unsigned i = rev ? nb - 1 - j : j;

        block_.x = i % g.x;
        block_.y = i / g.x % g.y;
        block_.z = i / (g.x * g.y);
        pdl_waits_ = 0;
        run_block(n);
        if (!kerr_[0] && pdl && pdl_waits_ == 0) {
            snprintf(kerr_, sizeof(kerr_), "launched as a programmatic dependent launch, but "
                     "no thread called kvc_pdl_wait");
        }
        if (kerr_[0]) {
            complain("kernel %s, block (%u,%u,%u): %s", name, block_.x, block_.y, block_.z,
                     kerr_);
            return cudaErrorLaunchFailure;
        }
    }
    return cudaSuccess;
}

}  // namespace

uint3 kvemu::thread_idx(void) { return cur_->tid; }
void  kvemu::pdl_wait(void) { pdl_waits_++; }
uint3 kvemu::block_idx(void) { return block_; }
dim3  kvemu::block_dim(void) { return bdim_; }
dim3  kvemu::grid_dim(void) { return gdim_; }

void kvemu::sync_threads(void)
{
    cur_->state = F_BLOCK_BAR;
    to_scheduler(0);
}

uint64_t kvemu::warp_exchange(unsigned mask, uint64_t mine, int src)
{
    fiber      *f = cur_;
    int         lane = f->linear & 31, w = f->linear >> 5, p = f->parity;
    int         lanes = (int) (bdim_.x * bdim_.y * bdim_.z) - w * 32;
    warp_slots *s = &warps_[(size_t) w];

    if (lanes > 32) lanes = 32;
    if (mask != 0xffffffffu || lanes != 32) {
        /* partial warps and masks are not emulated: the engine has neither */
        device_error("warp operation with mask %#x in a warp of %d lanes (only full warps "
                     "are emulated)", mask, lanes);
        f->state = F_DONE;
        to_scheduler(1);
        abort();                    /* never resumed */
    }
    f->parity ^= 1;
    s->v[p][lane] = mine;
    f->state = F_WARP_BAR;
    to_scheduler(0);
    return src >= 0 && src < 32 ? s->v[p][src] : mine;
}

int kvemu::lane_id(void) { return cur_->linear & 31; }

float *kvemu::warp_scratch(void) { return warps_[(size_t) (cur_->linear >> 5)].m[cur_->parity]; }

void kvemu::fault(const char *fmt, ...)
{
    char    msg[200];
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    device_error("thread %d: %s", cur_->linear, msg);
    cur_->state = F_DONE;
    to_scheduler(1);
    abort();                        /* never resumed */
}

/*
 * A warp-collective call (mma.h): a warp barrier where every lane passes
 * the same tag (the call and its arguments). A lane that never comes is a
 * deadlock (run_block reports it); lanes at another warp barrier (a shuffle,
 * __syncwarp, another wmma call) or with other arguments are reported here.
 */
void kvemu::warp_collective(const char *what, uint64_t tag)
{
    int         p = cur_->parity;
    warp_slots *s = &warps_[(size_t) (cur_->linear >> 5)];
    int         same = 1;

    warp_exchange(0xffffffffu, tag, 0);
    for (int l = 0; l < 32; l++) same &= s->v[p][l] == tag;  /* round p: kept until all have read */
    if (!same) {
        fault("%s: not every lane of warp %d made this call with these arguments (a warp-"
              "collective call in divergent code, or different pointers, ldm or layout)",
              what, cur_->linear >> 5);
    }
}

cudaError_t kvemu::enqueue(const char *name, dim3 grid, dim3 block, size_t smem,
                           cudaStream_t st, kvemu::body *b, int pdl)
{
    std::lock_guard<std::recursive_mutex> g(lock_);
    unsigned long threads = (unsigned long) block.x * block.y * block.z;
    long          nth;

    if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535
        || grid.z > 65535 || threads == 0 || threads > 1024 || block.z > 64 || smem > 0) {
        complain("launch of %s: grid (%u,%u,%u), block (%u,%u,%u), %zu bytes of dynamic shared "
                 "memory is an invalid configuration", name, grid.x, grid.y, grid.z, block.x,
                 block.y, block.z, smem);
        delete b;
        return set(cudaErrorInvalidConfiguration);
    }
    nth = ++launches_;
    std::shared_ptr<kvemu::body> own(b);    /* freed with the queue entry, run or dropped */
    return submit(st, [name, grid, block, own, nth, pdl]() {
        if (nth == env_long("KVW_CUDAEMU_FAIL_LAUNCH", 0)) {
            complain("kernel %s: injected fault (KVW_CUDAEMU_FAIL_LAUNCH=%ld)", name, nth);
            return cudaErrorIllegalAddress;
        }
        return run_grid(name, grid, block, own.get(), pdl);
    });
}

/* --- runtime API ------------------------------------------------------------------- */

#define LOCK std::lock_guard<std::recursive_mutex> guard_(lock_)
#define STICKY do { if (sticky_ != cudaSuccess) return set(sticky_); } while (0)
/* calls that synchronize (or may) are refused during a capture */
#define NO_CAPTURE(what) do {                                                    \
        cudaError_t ce_ = capture_refuses(what);                                 \
        if (ce_ != cudaSuccess) return set(ce_);                                 \
    } while (0)

cudaError_t cudaGetDeviceCount(int *count)
{
    long e = env_long("KVW_CUDAEMU_DEVICE_ERROR", 0);

    *count = 0;
    if (e != 0) return set((cudaError_t) e);
    *count = (int) env_long("KVW_CUDAEMU_DEVICES", 1);
    return *count > 0 ? cudaSuccess : set(cudaErrorNoDevice);
}

cudaError_t cudaSetDevice(int device)
{
    int n = 0;

    if (cudaGetDeviceCount(&n) != cudaSuccess) return last_;
    if (device < 0 || device >= n) return set(cudaErrorInvalidDevice);
    device_ = device;
    return cudaSuccess;
}

cudaError_t cudaGetDevice(int *device) { *device = device_; return cudaSuccess; }

cudaError_t cudaGetDeviceProperties(cudaDeviceProp *prop, int device)
{
    int n = 0;

    if (cudaGetDeviceCount(&n) != cudaSuccess) return last_;
    if (device < 0 || device >= n) return set(cudaErrorInvalidDevice);
    memset(prop, 0, sizeof(*prop));
    snprintf(prop->name, sizeof(prop->name), "kvemu host emulation");
    prop->totalGlobalMem = total_mem();
    prop->major = 9;
    prop->multiProcessorCount = 1;
    return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int *v) { *v = 13000; return cudaSuccess; }
cudaError_t cudaRuntimeGetVersion(int *v) { *v = 13000; return cudaSuccess; }

cudaError_t cudaDeviceSynchronize(void)
{
    LOCK;
    NO_CAPTURE("cudaDeviceSynchronize");
    return set(drain_all());
}

cudaError_t cudaGetLastError(void)
{
    cudaError_t e = last_;

    if (sticky_ != cudaSuccess) return sticky_;     /* a fault is not cleared by reading it */
    last_ = cudaSuccess;
    return e;
}

cudaError_t cudaPeekAtLastError(void) { return sticky_ != cudaSuccess ? sticky_ : last_; }

const char *cudaGetErrorName(cudaError_t e)
{
    switch (e) {
#define N(x) case x: return #x
    N(cudaSuccess); N(cudaErrorInvalidValue); N(cudaErrorMemoryAllocation);
    N(cudaErrorInitializationError); N(cudaErrorInvalidConfiguration);
    N(cudaErrorInvalidMemcpyDirection); N(cudaErrorInsufficientDriver);
    N(cudaErrorDevicesUnavailable); N(cudaErrorNoDevice); N(cudaErrorInvalidDevice);
    N(cudaErrorNoKernelImageForDevice); N(cudaErrorUnsupportedPtxVersion);
    N(cudaErrorDeviceUninitialized); N(cudaErrorAlreadyMapped);
    N(cudaErrorPeerAccessUnsupported); N(cudaErrorNotSupported);
    N(cudaErrorInvalidResourceHandle); N(cudaErrorNotReady); N(cudaErrorIllegalAddress);
    N(cudaErrorLaunchTimeout); N(cudaErrorAssert); N(cudaErrorHardwareStackError);
    N(cudaErrorIllegalInstruction); N(cudaErrorMisalignedAddress);
    N(cudaErrorInvalidAddressSpace); N(cudaErrorInvalidPc); N(cudaErrorLaunchFailure);
    N(cudaErrorSystemDriverMismatch); N(cudaErrorCompatNotSupportedOnDevice);
    N(cudaErrorIllegalState); N(cudaErrorStreamCaptureUnsupported);
    N(cudaErrorStreamCaptureInvalidated); N(cudaErrorStreamCaptureImplicit);
    N(cudaErrorUnknown);
#undef N
    }
    return "cudaErrorUnknown";
}

const char *cudaGetErrorString(cudaError_t e)
{
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInitializationError: return "initialization error";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInsufficientDriver:
        return "CUDA driver version is insufficient for CUDA runtime version";
    case cudaErrorDevicesUnavailable: return "CUDA-capable device(s) is/are busy or unavailable";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorDeviceUninitialized: return "invalid device context";
    case cudaErrorAlreadyMapped: return "resource already mapped";
    case cudaErrorPeerAccessUnsupported: return "peer access is not supported between these two devices";
    case cudaErrorNotSupported: return "operation not supported";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    case cudaErrorSystemDriverMismatch:
        return "system has unsupported display driver / cuda driver combination";
    case cudaErrorCompatNotSupportedOnDevice:
        return "forward compatibility was attempted on non supported HW";
    default: return cudaGetErrorName(e);
    }
}

namespace {

size_t page_size(void) { return (size_t) sysconf(_SC_PAGESIZE); }

size_t round_page(size_t n) { return (n + page_size() - 1) / page_size() * page_size(); }

/* Maps len bytes of fd between two guard pages; the data's address, or NULL. */
void *map_between_guards(int fd, size_t n, void **region, size_t *region_len)
{
    size_t pg = page_size(), len = round_page(n ? n : 1);
    char  *r = (char *) mmap(NULL, len + 2 * pg, PROT_NONE,
                             MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);

    if (r == MAP_FAILED) return NULL;
    if (mmap(r + pg, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
        munmap(r, len + 2 * pg);
        return NULL;
    }
#if KVEMU_ASAN
    if (len > n) __asan_poison_memory_region(r + pg + n, len - n);
#endif
    *region = r;
    *region_len = len + 2 * pg;
    return r + pg;
}

void unmap(const mapping &m)
{
#if KVEMU_ASAN
    __asan_unpoison_memory_region(m.region, m.region_len);
#endif
    munmap(m.region, m.region_len);
    if (m.fd >= 0) close(m.fd);
}

}  // namespace

cudaError_t cudaMalloc(void **p, size_t n)
{
    LOCK;
    STICKY;
    NO_CAPTURE("cudaMalloc");
    mapping m;
    char    name[64];

    *p = NULL;
    if (n > total_mem() - dev_used_) return set(cudaErrorMemoryAllocation);
    m.serial = ++serial_;
    m.device = device_;
    snprintf(name, sizeof(name), "kvemu-%ld-%llu", (long) getpid(),
             (unsigned long long) m.serial);
    m.fd = memfd_create(name, MFD_CLOEXEC);
    if (m.fd < 0 || ftruncate(m.fd, (off_t) round_page(n ? n : 1)) != 0
        || (*p = map_between_guards(m.fd, n, &m.region, &m.region_len)) == NULL) {
        complain("cudaMalloc(%zu): cannot map a memfd: %s", n, strerror(errno));
        if (m.fd >= 0) close(m.fd);
        *p = NULL;
        return set(cudaErrorMemoryAllocation);
    }
    memset(*p, 0xff, n);            /* NaN: a read of memory never written shows */
    dev_[(uintptr_t) *p] = n;
    maps_[(uintptr_t) *p] = m;
    dev_used_ += n;
    return cudaSuccess;
}

cudaError_t cudaFree(void *p)
{
    LOCK;
    if (p == NULL) return cudaSuccess;
    NO_CAPTURE("cudaFree");
    drain_all();                    /* cudaFree waits for the device */
    auto it = dev_.find((uintptr_t) p);
    if (it == dev_.end()) {
        complain("cudaFree(%p): not a device allocation", p);
        return set(cudaErrorInvalidValue);
    }
    if (imported_.count((uintptr_t) p)) {
        complain("cudaFree(%p): an IPC mapping (cudaIpcCloseMemHandle undoes it)", p);
        return set(cudaErrorInvalidValue);
    }
    dev_used_ -= it->second;
    dev_.erase(it);
    unmap(maps_[(uintptr_t) p]);
    maps_.erase((uintptr_t) p);
    return sticky_ != cudaSuccess ? set(sticky_) : cudaSuccess;
}

/* --- CUDA IPC (cuda_runtime.h) ------------------------------------------------------- */

namespace {

/* The handle's bytes (64, as the toolkit's): what another process needs to find the memfd. */
struct ipc_handle {
    char      magic[4];             /* "KVEM" */
    int32_t   device;
    int32_t   pid;
    int32_t   fd;
    uint64_t  serial;
    uint64_t  size;
    uint64_t  ino;
    char      boot[24];             /* the first 24 characters of the boot id */
};
static_assert(sizeof(ipc_handle) == 64, "an IPC handle is 64 bytes");

void boot_id(char out[24])
{
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    char  line[64] = "";

    memset(out, 0, 24);
    if (f) {
        if (fgets(line, sizeof(line), f) == NULL) line[0] = '\0';
        fclose(f);
    }
    memcpy(out, line, strnlen(line, 24));
}

int ipc_off(void)
{
    const char *v = getenv("KVW_CUDAEMU_IPC");

    return v && !strcmp(v, "0");
}

int peer_ok(int a, int b)
{
    const char *v = getenv("KVW_CUDAEMU_NO_PEER");

    return a == b || !(v && !strcmp(v, "1"));
}

}  // namespace

cudaError_t cudaDeviceCanAccessPeer(int *can, int device, int peer)
{
    int n = 0;

    if (cudaGetDeviceCount(&n) != cudaSuccess) return last_;
    if (device < 0 || device >= n || peer < 0 || peer >= n) return set(cudaErrorInvalidDevice);
    *can = device != peer && peer_ok(device, peer);
    return cudaSuccess;
}

cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t *handle, void *p)
{
    LOCK;
    STICKY;
    ipc_handle h;
    struct stat st;

    if (ipc_off()) return set(cudaErrorNotSupported);
    auto it = maps_.find((uintptr_t) p);
    if (handle == NULL || it == maps_.end() || imported_.count((uintptr_t) p)
        || fstat(it->second.fd, &st) != 0) {
        complain("cudaIpcGetMemHandle(%p): not the base of a device allocation of this process", p);
        return set(cudaErrorInvalidValue);
    }
    memset(&h, 0, sizeof(h));
    memcpy(h.magic, "KVEM", 4);
    h.device = it->second.device;
    h.pid = (int32_t) getpid();
    h.fd = it->second.fd;
    h.serial = it->second.serial;
    h.size = dev_[(uintptr_t) p];
    h.ino = (uint64_t) st.st_ino;
    boot_id(h.boot);
    memcpy(handle->reserved, &h, sizeof(h));
    return cudaSuccess;
}

cudaError_t cudaIpcOpenMemHandle(void **p, cudaIpcMemHandle_t handle, unsigned flags)
{
    LOCK;
    STICKY;
    ipc_handle h;
    char       path[64], link[128], want[64], boot[24];
    struct stat st;
    mapping    m;
    int        fd;

    *p = NULL;
    if (ipc_off()) return set(cudaErrorNotSupported);
    memcpy(&h, handle.reserved, sizeof(h));
    boot_id(boot);
    if (memcmp(h.magic, "KVEM", 4) != 0 || memcmp(h.boot, boot, sizeof(boot)) != 0
        || flags & ~(unsigned) cudaIpcMemLazyEnablePeerAccess) {
        return set(cudaErrorInvalidValue);      /* garbage, or a handle of another machine */
    }
    if (h.pid == (int32_t) getpid()) return set(cudaErrorDeviceUninitialized);
    if (!peer_ok(h.device, device_)) return set(cudaErrorPeerAccessUnsupported);
    /* the exporter's descriptor: gone with its process or its cudaFree (a stale handle) */
    snprintf(path, sizeof(path), "/proc/%d/fd/%d", (int) h.pid, (int) h.fd);
    snprintf(want, sizeof(want), "/memfd:kvemu-%d-%llu (deleted)", (int) h.pid,
             (unsigned long long) h.serial);
    ssize_t ln = readlink(path, link, sizeof(link) - 1);
    if (ln < 0) return set(cudaErrorInvalidValue);
    link[ln] = '\0';
    if (strcmp(link, want) != 0) return set(cudaErrorInvalidValue);
    if ((fd = open(path, O_RDWR | O_CLOEXEC)) < 0) return set(cudaErrorInvalidValue);
    if (fstat(fd, &st) != 0 || (uint64_t) st.st_ino != h.ino
        || (uint64_t) st.st_size != round_page(h.size ? h.size : 1)) {
        close(fd);
        return set(cudaErrorInvalidValue);
    }
    if (opened_.count({(long) h.pid, h.serial})) {     /* a valid handle, open here already */
        close(fd);
        return set(cudaErrorAlreadyMapped);
    }
    *p = map_between_guards(fd, h.size, &m.region, &m.region_len);
    close(fd);                      /* the mapping keeps the pages */
    if (*p == NULL) return set(cudaErrorMemoryAllocation);
    m.fd = -1;
    m.serial = h.serial;
    m.device = h.device;
    dev_[(uintptr_t) *p] = h.size;
    maps_[(uintptr_t) *p] = m;
    imported_.insert((uintptr_t) *p);
    opened_[{(long) h.pid, h.serial}] = (uintptr_t) *p;
    return cudaSuccess;
}

cudaError_t cudaIpcCloseMemHandle(void *p)
{
    LOCK;
    if (!imported_.count((uintptr_t) p)) {
        complain("cudaIpcCloseMemHandle(%p): not a mapping from cudaIpcOpenMemHandle", p);
        return set(cudaErrorInvalidValue);
    }
    drain_all();                    /* copies from it complete first */
    for (auto it = opened_.begin(); it != opened_.end(); ++it) {
        if (it->second == (uintptr_t) p) {
            opened_.erase(it);
            break;
        }
    }
    imported_.erase((uintptr_t) p);
    dev_.erase((uintptr_t) p);
    unmap(maps_[(uintptr_t) p]);
    maps_.erase((uintptr_t) p);
    return cudaSuccess;
}

cudaError_t cudaMallocHost(void **p, size_t n)
{
    LOCK;
    STICKY;
    NO_CAPTURE("cudaMallocHost");
    *p = malloc(n ? n : 1);
    if (*p == NULL) return set(cudaErrorMemoryAllocation);
    pinned_[(uintptr_t) *p] = n;
    return cudaSuccess;
}

cudaError_t cudaFreeHost(void *p)
{
    LOCK;
    if (p == NULL) return cudaSuccess;
    NO_CAPTURE("cudaFreeHost");
    drain_all();
    auto it = pinned_.find((uintptr_t) p);
    if (it == pinned_.end()) {
        complain("cudaFreeHost(%p): not from cudaMallocHost", p);
        return set(cudaErrorInvalidValue);
    }
    pinned_.erase(it);
    free(p);
    return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t *free_b, size_t *total_b)
{
    LOCK;
    STICKY;
    *total_b = total_mem();
    *free_b = *total_b - dev_used_;
    return cudaSuccess;
}

namespace {

/* The direction must match where the pointers are, and device ranges fit their allocations. */
cudaError_t check_copy(const char *what, void *dst, const void *src, size_t n, cudaMemcpyKind k)
{
    int dd = is_device(dst), sd = is_device(src);

    if (n == 0) return cudaSuccess;
    if (k == cudaMemcpyDefault) {
        k = (cudaMemcpyKind) ((sd ? 2 : 0) + (dd ? 1 : 0));
        if (k == cudaMemcpyDeviceToDevice + 0 && !(dd && sd)) k = cudaMemcpyHostToHost;
    }
    if ((k == cudaMemcpyHostToDevice || k == cudaMemcpyDeviceToDevice) && !inside(dev_, dst, n)) {
        complain("%s: destination %p + %zu is not inside one device allocation", what, dst, n);
        return cudaErrorInvalidValue;
    }
    if ((k == cudaMemcpyDeviceToHost || k == cudaMemcpyDeviceToDevice) && !inside(dev_, src, n)) {
        complain("%s: source %p + %zu is not inside one device allocation", what, src, n);
        return cudaErrorInvalidValue;
    }
    if ((k == cudaMemcpyHostToDevice || k == cudaMemcpyHostToHost) && sd) {
        complain("%s: host source %p is device memory", what, src);
        return cudaErrorInvalidValue;
    }
    if ((k == cudaMemcpyDeviceToHost || k == cudaMemcpyHostToHost) && dd) {
        complain("%s: host destination %p is device memory", what, dst);
        return cudaErrorInvalidValue;
    }
    if (k < cudaMemcpyHostToHost || k > cudaMemcpyDefault) return cudaErrorInvalidMemcpyDirection;
    return cudaSuccess;
}

}  // namespace

cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, cudaMemcpyKind kind)
{
    LOCK;
    cudaError_t e;

    STICKY;
    NO_CAPTURE("cudaMemcpy");
    if ((e = check_copy("cudaMemcpy", dst, src, n, kind)) != cudaSuccess) return set(e);
    if (drain_all() != cudaSuccess) return set(sticky_);
    memmove(dst, src, n);
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, cudaMemcpyKind kind,
                            cudaStream_t st)
{
    LOCK;
    cudaError_t e;

    STICKY;
    if ((e = check_copy("cudaMemcpyAsync", dst, src, n, kind)) != cudaSuccess) return set(e);
    return submit(st, [dst, src, n]() { memmove(dst, src, n); return cudaSuccess; });
}

cudaError_t cudaMemset(void *p, int v, size_t n)
{
    LOCK;
    STICKY;
    NO_CAPTURE("cudaMemset");
    if (n && !inside(dev_, p, n)) {
        complain("cudaMemset: %p + %zu is not inside one device allocation", p, n);
        return set(cudaErrorInvalidValue);
    }
    if (drain_all() != cudaSuccess) return set(sticky_);
    memset(p, v, n);
    return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t st)
{
    LOCK;
    STICKY;
    if (n && !inside(dev_, p, n)) {
        complain("cudaMemsetAsync: %p + %zu is not inside one device allocation", p, n);
        return set(cudaErrorInvalidValue);
    }
    return submit(st, [p, v, n]() { memset(p, v, n); return cudaSuccess; });
}

cudaError_t cudaStreamCreate(cudaStream_t *st) { return cudaStreamCreateWithFlags(st, 0); }

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *st, unsigned flags)
{
    LOCK;
    STICKY;
    if (flags > cudaStreamNonBlocking) return set(cudaErrorInvalidValue);
    *st = new kvemu_stream();
    streams_.insert(*st);
    return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t st)
{
    LOCK;
    if (!streams_.count(st)) return set(cudaErrorInvalidResourceHandle);
    if (st->capture) {
        complain("cudaStreamDestroy of a capturing stream");
        return set(cudaErrorIllegalState);
    }
    drain(st);                      /* queued work still completes */
    streams_.erase(st);
    delete st;
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t st)
{
    LOCK;
    kvemu_stream *s = stream_of(st);

    if (s == NULL) return set(cudaErrorInvalidResourceHandle);
    NO_CAPTURE("cudaStreamSynchronize");
    if (s == &legacy_) return set(drain_all());
    drain(&legacy_);
    return set(drain(s));
}

cudaError_t cudaEventCreate(cudaEvent_t *ev) { return cudaEventCreateWithFlags(ev, 0); }

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *ev, unsigned flags)
{
    LOCK;
    STICKY;
    *ev = new kvemu_event();
    events_.insert(*ev);
    return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t ev, cudaStream_t st)
{
    LOCK;
    if (!events_.count(ev)) return set(cudaErrorInvalidResourceHandle);
    ev->recorded = 0;
    return submit(st, [ev]() { ev->recorded = 1; return cudaSuccess; });
}

cudaError_t cudaEventSynchronize(cudaEvent_t ev)
{
    LOCK;
    if (!events_.count(ev)) return set(cudaErrorInvalidResourceHandle);
    NO_CAPTURE("cudaEventSynchronize");
    return set(drain_all());
}

cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b)
{
    LOCK;
    if (!events_.count(a) || !events_.count(b)) return set(cudaErrorInvalidResourceHandle);
    if (!a->recorded || !b->recorded) return set(cudaErrorNotReady);
    *ms = 0;                        /* no time passes on an emulated device */
    return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t ev)
{
    LOCK;
    if (!events_.erase(ev)) return set(cudaErrorInvalidResourceHandle);
    delete ev;
    return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t st, cudaEvent_t ev, unsigned flags)
{
    LOCK;
    if (!events_.count(ev) || stream_of(st) == NULL) return set(cudaErrorInvalidResourceHandle);
    drain_all();                    /* streams run in order here: waiting is finishing */
    return sticky_;
}

/* --- graphs ------------------------------------------------------------------------- */

cudaError_t cudaStreamBeginCapture(cudaStream_t st, cudaStreamCaptureMode mode)
{
    LOCK;
    STICKY;
    if (st == NULL) {
        complain("cudaStreamBeginCapture: the legacy default stream cannot capture");
        return set(cudaErrorStreamCaptureUnsupported);
    }
    if (!streams_.count(st)) return set(cudaErrorInvalidResourceHandle);
    if (st->capture) return set(cudaErrorIllegalState);
    if (env_long("KVW_CUDAEMU_NO_CAPTURE", 0)) return set(cudaErrorStreamCaptureUnsupported);
    if (mode > cudaStreamCaptureModeRelaxed) return set(cudaErrorInvalidValue);
    st->capture = new kvemu_graph();
    st->capture->exec = 0;
    st->invalidated = 0;
    graphs_.insert(st->capture);
    capturing_++;
    return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t st, cudaGraph_t *graph)
{
    LOCK;
    *graph = NULL;
    if (st == NULL || !streams_.count(st)) return set(cudaErrorInvalidResourceHandle);
    if (st->capture == NULL) return set(cudaErrorIllegalState);
    kvemu_graph *g = st->capture;
    st->capture = NULL;
    capturing_--;
    if (st->invalidated) {
        graphs_.erase(g);
        delete g;
        return set(cudaErrorStreamCaptureInvalidated);
    }
    *graph = g;
    return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t st, cudaStreamCaptureStatus *status)
{
    LOCK;
    kvemu_stream *s = stream_of(st);

    if (s == NULL) return set(cudaErrorInvalidResourceHandle);
    *status = s->capture == NULL ? cudaStreamCaptureStatusNone
              : s->invalidated ? cudaStreamCaptureStatusInvalidated : cudaStreamCaptureStatusActive;
    return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t graph, unsigned long long flags)
{
    LOCK;
    STICKY;
    if (!graphs_.count(graph) || graph->exec) return set(cudaErrorInvalidValue);
    *exec = new kvemu_graph(*graph);     /* later changes to the graph do not reach it */
    (*exec)->exec = 1;
    graphs_.insert(*exec);
    return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t st)
{
    LOCK;
    cudaError_t e;

    if (!graphs_.count(exec) || !exec->exec) return set(cudaErrorInvalidValue);
    for (const op_t &op : exec->ops) {
        if ((e = submit(st, op)) != cudaSuccess) return e;
    }
    return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec)
{
    LOCK;
    if (!graphs_.count(exec) || !exec->exec) return set(cudaErrorInvalidValue);
    graphs_.erase(exec);
    delete exec;
    return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph)
{
    LOCK;
    if (!graphs_.count(graph) || graph->exec) return set(cudaErrorInvalidValue);
    graphs_.erase(graph);
    delete graph;
    return cudaSuccess;
}

/* --- cuBLAS ------------------------------------------------------------------------- */

cublasStatus_t cublasCreate(cublasHandle_t *h)
{
    LOCK;
    if (sticky_ != cudaSuccess) return CUBLAS_STATUS_NOT_INITIALIZED;
    *h = new kvemu_cublas();
    (*h)->st = NULL;
    handles_.insert(*h);
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy(cublasHandle_t h)
{
    LOCK;
    if (!handles_.erase(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    delete h;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t st)
{
    LOCK;
    if (!handles_.count(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (stream_of(st) == NULL) return CUBLAS_STATUS_INVALID_VALUE;
    h->st = st;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetWorkspace(cublasHandle_t h, void *ws, size_t bytes)
{
    LOCK;
    if (!handles_.count(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (bytes > 0 && !inside(dev_, ws, bytes)) {
        complain("cublasSetWorkspace: %p + %zu is not inside one device allocation", ws, bytes);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetMathMode(cublasHandle_t h, cublasMath_t mode)
{
    LOCK;
    return handles_.count(h) ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_INITIALIZED;
}

const char *cublasGetStatusString(cublasStatus_t s)
{
    switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    }
    return "CUBLAS_STATUS_UNKNOWN";
}

namespace {

size_t dtype_size(cudaDataType_t t)
{
    return t == CUDA_R_32F ? 4 : t == CUDA_R_16F || t == CUDA_R_16BF ? 2 : t == CUDA_R_64F ? 8 : 0;
}

float load(const void *p, cudaDataType_t t, size_t i)
{
    switch (t) {
    case CUDA_R_16F: return __half2float(((const __half *) p)[i]);
    case CUDA_R_16BF: return __bfloat162float(((const __nv_bfloat16 *) p)[i]);
    case CUDA_R_64F: return (float) ((const double *) p)[i];
    default: return ((const float *) p)[i];
    }
}

void store(void *p, cudaDataType_t t, size_t i, float v)
{
    switch (t) {
    case CUDA_R_16F: ((__half *) p)[i] = __float2half(v); break;
    case CUDA_R_16BF: ((__nv_bfloat16 *) p)[i] = __float2bfloat16(v); break;
    case CUDA_R_64F: ((double *) p)[i] = v; break;
    default: ((float *) p)[i] = v;
    }
}

/* A column-major rows x cols matrix with leading dimension ld must fit in one device allocation. */
int fits(const char *name, const void *p, cudaDataType_t t, int rows, int cols, int ld)
{
    size_t need = ((size_t) (cols - 1) * (size_t) ld + (size_t) rows) * dtype_size(t);

    if (p == NULL || !inside(dev_, p, need)) {
        complain("cublasGemmEx: %s (%d x %d, ld %d, %zu bytes from %p) is not inside one device "
                 "allocation", name, rows, cols, ld, need, p);
        return 0;
    }
    return 1;
}

}  // namespace

/* sum over l of A[a0 + l*as] * B[b0 + l*bs], in order; f32 without load()'s switch per element */
static float dot(const void *A, const void *B, cudaDataType_t t, size_t a0, size_t as,
                 size_t b0, size_t bs, int k)
{
    float s = 0;

    if (t == CUDA_R_32F) {
        const float *a = (const float *) A + a0, *b = (const float *) B + b0;

        for (int l = 0; l < k; l++) s += a[(size_t) l * as] * b[(size_t) l * bs];
        return s;
    }
    for (int l = 0; l < k; l++)
        s += load(A, t, a0 + (size_t) l * as) * load(B, t, b0 + (size_t) l * bs);
    return s;
}

cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb,
                            int m, int n, int k, const void *alpha,
                            const void *A, cudaDataType_t at, int lda,
                            const void *B, cudaDataType_t bt, int ldb, const void *beta,
                            void *C, cudaDataType_t ct, int ldc,
                            cublasComputeType_t compute, cublasGemmAlgo_t algo)
{
    LOCK;
    int   ar = ta == CUBLAS_OP_N ? m : k, ac = ta == CUBLAS_OP_N ? k : m;
    int   br = tb == CUBLAS_OP_N ? k : n, bc = tb == CUBLAS_OP_N ? n : k;
    float al, be;

    if (!handles_.count(h)) {
        complain("cublasGemmEx: not a live handle");
        return CUBLAS_STATUS_NOT_INITIALIZED;
    }
    if (sticky_ != cudaSuccess) return CUBLAS_STATUS_EXECUTION_FAILED;
    if ((ta != CUBLAS_OP_N && ta != CUBLAS_OP_T && ta != CUBLAS_OP_C)
        || (tb != CUBLAS_OP_N && tb != CUBLAS_OP_T && tb != CUBLAS_OP_C)
        || m < 0 || n < 0 || k < 0 || lda < (ar > 1 ? ar : 1) || ldb < (br > 1 ? br : 1)
        || ldc < (m > 1 ? m : 1)) {
        complain("cublasGemmEx: invalid value (op %d/%d, m %d n %d k %d, lda %d ldb %d ldc %d)",
                 ta, tb, m, n, k, lda, ldb, ldc);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    /* the CUBLAS_COMPUTE_32F rows of cublasGemmEx's table of supported types */
    if (compute != CUBLAS_COMPUTE_32F || at != bt
        || !((at == CUDA_R_32F && ct == CUDA_R_32F)
             || ((at == CUDA_R_16F || at == CUDA_R_16BF) && (ct == at || ct == CUDA_R_32F)))) {
        complain("cublasGemmEx: types A %d B %d C %d with compute %d are not supported", at, bt,
                 ct, compute);
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (algo != CUBLAS_GEMM_DEFAULT && algo != CUBLAS_GEMM_DEFAULT_TENSOR_OP) {
        complain("cublasGemmEx: algo %d", algo);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    if (alpha == NULL || beta == NULL || is_device(alpha) || is_device(beta)) {
        complain("cublasGemmEx: alpha and beta must be host pointers (the default pointer mode)");
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
    if ((k > 0 && (!fits("A", A, at, ar, ac, lda) || !fits("B", B, bt, br, bc, ldb)))
        || !fits("C", C, ct, m, n, ldc))
        return CUBLAS_STATUS_INVALID_VALUE;
    {
        uintptr_t c0 = (uintptr_t) C, c1 = c0 + ((size_t) (n - 1) * ldc + m) * dtype_size(ct);
        uintptr_t a0 = (uintptr_t) A, a1 = a0 + ((size_t) (ac - 1) * lda + ar) * dtype_size(at);
        uintptr_t b0 = (uintptr_t) B, b1 = b0 + ((size_t) (bc - 1) * ldb + br) * dtype_size(bt);

        if (k > 0 && ((c0 < a1 && a0 < c1) || (c0 < b1 && b0 < c1))) {
            complain("cublasGemmEx: C overlaps A or B");
            return CUBLAS_STATUS_INVALID_VALUE;
        }
    }
    al = *(const float *) alpha;    /* read at the call, as in host pointer mode */
    be = *(const float *) beta;
    if (submit(h->st, [=]() {
            for (int j = 0; j < n; j++) {
                for (int i = 0; i < m; i++) {
                    size_t ci = (size_t) j * ldc + i;
                    size_t a0 = ta == CUBLAS_OP_N ? (size_t) i : (size_t) i * lda;
                    size_t as = ta == CUBLAS_OP_N ? (size_t) lda : 1;
                    size_t b0 = tb == CUBLAS_OP_N ? (size_t) j * ldb : (size_t) j;
                    size_t bs = tb == CUBLAS_OP_N ? 1 : (size_t) ldb;
                    float  s = dot(A, B, at, a0, as, b0, bs, k);

                    /* beta 0: C is not read (it may hold anything, NaN included) */
                    store(C, ct, ci, al * s + (be != 0.0f ? be * load(C, ct, ci) : 0.0f));
                }
            }
            return cudaSuccess;
        }) != cudaSuccess)
        return CUBLAS_STATUS_EXECUTION_FAILED;
    return CUBLAS_STATUS_SUCCESS;
}
