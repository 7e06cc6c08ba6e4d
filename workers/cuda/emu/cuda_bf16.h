/*
 * kvemu (see cuda_runtime.h here): __nv_bfloat16 on the host, the top 16
 * bits of an f32 with round-to-nearest-even, as the device converts.
 */
#ifndef KVEMU_CUDA_BF16_H
#define KVEMU_CUDA_BF16_H

#include <stdint.h>
#include <string.h>

struct __nv_bfloat16 {
    uint16_t x;
};

static inline __nv_bfloat16 __float2bfloat16(float f)
{
    uint32_t      u;
    __nv_bfloat16 b;

    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {                  /* nan stays a (quiet) nan */
        b.x = (uint16_t) ((u >> 16) | 0x40);
        return b;
    }
    u += 0x7fffu + ((u >> 16) & 1);
    b.x = (uint16_t) (u >> 16);
    return b;
}

static inline float __bfloat162float(__nv_bfloat16 b)
{
    uint32_t u = (uint32_t) b.x << 16;
    float    f;

    memcpy(&f, &u, 4);
    return f;
}

#endif
