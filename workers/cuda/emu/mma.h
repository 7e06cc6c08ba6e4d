/*
 * kvemu (see cuda_runtime.h here): the warp matrix functions of the CUDA
 * toolkit's <mma.h> (nvcuda::wmma), the 16x16x16 shape with __half or
 * __nv_bfloat16 inputs and float accumulators: what the tensor-core
 * prefill attention uses.
 *
 * A fragment's element layout is opaque in CUDA, so the emulation picks its
 * own, deliberately scrambled: element e of lane L holds matrix element
 * ((e * 32 + L) * 37) mod 256 (row-major index). Code that assumes the
 * hardware's layout (x[i] is row i / 2, ...) gets wrong results here, code
 * that uses only the documented functions and element-wise operations on
 * all of x[] gets right ones.
 *
 * load_matrix_sync, store_matrix_sync and mma_sync are warp-collective, as
 * the CUDA documentation says: every lane of the warp must call them, with
 * the same pointer, ldm and layout. Each is a warp barrier here (a lane that
 * does not reach it is a deadlock, reported; lanes at different calls or
 * with different arguments are reported). The documented preconditions are
 * checked: the pointer 256-bit (32-byte) aligned, ldm a multiple of 16 bytes
 * (8 16-bit elements, 4 floats). A load reads the lane's elements when the
 * lane arrives, a store writes them when it leaves: a missing __syncwarp
 * between scalar writes and a load (or a store and scalar reads) shows as
 * stale values, in one thread order or the other. mma_sync computes, per
 * output element, c + sum over k of a * b in float, k ascending; real tensor
 * cores accumulate in an order and with roundings of their own.
 * fill_fragment is not collective (it touches the lane's own elements).
 */
#ifndef KVEMU_MMA_H
#define KVEMU_MMA_H

#include <stdint.h>

#include <type_traits>

#include "cuda_runtime.h"

namespace kvemu {

/* Barrier of the calling lane's warp; every lane must pass the same tag. */
void warp_collective(const char *what, uint64_t tag);
/* The calling thread's lane in its warp. */
int lane_id(void);
/* This round's per-warp scratch (3 x 256 floats), valid from the call until the next collective returns. */
float *warp_scratch(void);
/* A device-side error: reported with the launch, the calling thread ends. */
[[noreturn]] void fault(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static inline int mma_index(int e, int lane) { return ((e * 32 + lane) * 37) & 255; }

}  // namespace kvemu

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};

enum layout_t { mem_row_major, mem_col_major };

template <class Use, int M, int N, int K, class T, class Layout = void> struct fragment {
    static_assert(M == 16 && N == 16 && K == 16, "kvemu emulates the 16x16x16 shape only");
    enum { num_elements = 8 };
    T x[num_elements];
};

static inline float kvemu_to_f(float v) { return v; }
static inline float kvemu_to_f(__half v) { return __half2float(v); }
static inline float kvemu_to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <class T> static inline T kvemu_from_f(float v);
template <> inline float kvemu_from_f<float>(float v) { return v; }
template <> inline __half kvemu_from_f<__half>(float v) { return __float2half(v); }
template <> inline __nv_bfloat16 kvemu_from_f<__nv_bfloat16>(float v) { return __float2bfloat16(v); }

template <class Use, class T, class Layout, class V>
static inline void fill_fragment(fragment<Use, 16, 16, 16, T, Layout> &f, const V &v)
{
    for (int e = 0; e < 8; e++) f.x[e] = kvemu_from_f<T>(kvemu_to_f(v));
}

/* The documented preconditions of a load or store, and the rendezvous. */
template <class T>
static inline void kvemu_check(const char *what, int id, const T *p, unsigned ldm, int col)
{
    if (((uintptr_t) p & 31) != 0)
        kvemu::fault("%s: pointer %p is not 256-bit aligned", what, (const void *) p);
    if ((ldm * sizeof(T)) % 16 != 0 || ldm < 16)
        kvemu::fault("%s: ldm %u is not a multiple of 16 bytes of at least 16 elements", what, ldm);
    kvemu::warp_collective(what, ((uint64_t) (uintptr_t) p * 31 + ldm) * 4 + (uint64_t) col * 2
                                     + (uint64_t) id * 0x9e3779b97f4a7c15ull);
}

/* element (r, c) of a matrix at p: row-major p[r * ldm + c], column-major p[c * ldm + r] */
template <class Use, class T, class Layout, class S>
static inline void kvemu_load(fragment<Use, 16, 16, 16, T, Layout> &f, const S *p, unsigned ldm,
                              int col, int id)
{
    int lane = kvemu::lane_id();

    for (int e = 0; e < 8; e++) {       /* read on arrival, as the lane's own loads would be */
        int i = kvemu::mma_index(e, lane), r = i / 16, c = i % 16;

        f.x[e] = (T) p[col ? (size_t) c * ldm + r : (size_t) r * ldm + c];
    }
    kvemu_check("load_matrix_sync", id, p, ldm, col);
}

/* matrix_a and matrix_b, either layout; an accumulator needs the layout argument (below) */
template <class Use, class T, class Layout>
static inline void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout> &f, const T *p,
                                    unsigned ldm)
{
    static_assert(std::is_same<Use, matrix_a>::value || std::is_same<Use, matrix_b>::value,
                  "an accumulator is loaded with a layout_t");
    kvemu_load(f, p, ldm, std::is_same<Layout, col_major>::value,
               std::is_same<Use, matrix_a>::value ? 1 : 2);
}
template <class T>
static inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, T> &f, const T *p,
                                    unsigned ldm, layout_t layout)
{
    kvemu_load(f, p, ldm, layout == mem_col_major, 3);
}

template <class T>
static inline void store_matrix_sync(T *p, const fragment<accumulator, 16, 16, 16, T> &f,
                                     unsigned ldm, layout_t layout)
{
    int lane = kvemu::lane_id();
    int col = layout == mem_col_major;

    kvemu_check("store_matrix_sync", 4, p, ldm, col);
    for (int e = 0; e < 8; e++) {       /* written on leaving the barrier */
        int i = kvemu::mma_index(e, lane), r = i / 16, c = i % 16;

        p[col ? (size_t) c * ldm + r : (size_t) r * ldm + c] = f.x[e];
    }
}

/* d = a * b + c: the lanes' elements gathered in the warp's scratch, each lane computes its own. */
template <class T, class LA, class LB, class TC>
static inline void mma_sync(fragment<accumulator, 16, 16, 16, TC> &d,
                            const fragment<matrix_a, 16, 16, 16, T, LA> &a,
                            const fragment<matrix_b, 16, 16, 16, T, LB> &b,
                            const fragment<accumulator, 16, 16, 16, TC> &c)
{
    int    lane = kvemu::lane_id();
    float *s = kvemu::warp_scratch(), out[8];

    for (int e = 0; e < 8; e++) {
        int i = kvemu::mma_index(e, lane);

        s[i] = kvemu_to_f(a.x[e]);
        s[256 + i] = kvemu_to_f(b.x[e]);
        s[512 + i] = kvemu_to_f(c.x[e]);
    }
    kvemu::warp_collective("mma_sync", 5 * 0x9e3779b97f4a7c15ull);
    for (int e = 0; e < 8; e++) {
        int   i = kvemu::mma_index(e, lane), r = i / 16, col = i % 16;
        float acc = s[512 + i];

        for (int k = 0; k < 16; k++) acc += s[r * 16 + k] * s[256 + k * 16 + col];
        out[e] = acc;
    }
    for (int e = 0; e < 8; e++) d.x[e] = kvemu_from_f<TC>(out[e]);   /* d may be c */
}

}  // namespace wmma
}  // namespace nvcuda

#endif
