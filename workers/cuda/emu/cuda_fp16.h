/*
 * kvemu (see cuda_runtime.h here): __half on the host, bit-exact IEEE
 * binary16 with round-to-nearest-even conversions, as the device does them.
 */
#ifndef KVEMU_CUDA_FP16_H
#define KVEMU_CUDA_FP16_H

#include <stdint.h>
#include <string.h>

struct __half {
    uint16_t x;
};

static inline __half __float2half(float f)
{
    uint32_t u, sign, mant;
    int      exp;
    __half   h;

    memcpy(&u, &f, 4);
    sign = (u >> 16) & 0x8000u;
    exp = (int) ((u >> 23) & 0xff) - 127 + 15;
    mant = u & 0x7fffffu;
    if (((u >> 23) & 0xff) == 0xff) {                       /* inf, nan */
        h.x = (uint16_t) (sign | 0x7c00u | (mant ? 0x200u : 0));
        return h;
    }
    if (exp >= 31) {                                        /* overflow: inf */
        h.x = (uint16_t) (sign | 0x7c00u);
        return h;
    }
    if (exp <= 0) {                                         /* subnormal or zero */
        uint32_t m, shift, r, half_bit;

        if (exp < -10) {
            h.x = (uint16_t) sign;
            return h;
        }
        m = mant | 0x800000u;
        shift = (uint32_t) (14 - exp);
        r = m >> shift;
        half_bit = 1u << (shift - 1);
        if ((m & (2 * half_bit - 1)) > half_bit || ((m & (2 * half_bit - 1)) == half_bit && (r & 1)))
            r++;
        h.x = (uint16_t) (sign | r);
        return h;
    }
    {
        uint32_t r = ((uint32_t) exp << 10) | (mant >> 13), rest = mant & 0x1fffu;

        if (rest > 0x1000u || (rest == 0x1000u && (r & 1))) r++;   /* may carry into inf: right */
        h.x = (uint16_t) (sign | r);
    }
    return h;
}

static inline float __half2float(__half h)
{
    uint32_t sign = (uint32_t) (h.x >> 15) << 31, e = (h.x >> 10) & 0x1f, m = h.x & 0x3ff, bits;
    float    out;

    if (e == 0) {
        out = (float) m * (1.0f / 16777216.0f);             /* m * 2^-24 */
        return sign ? -out : out;
    }
    bits = e == 31 ? sign | 0x7f800000u | (m << 13) : sign | ((e - 15 + 127) << 23) | (m << 13);
    memcpy(&out, &bits, 4);
    return out;
}

#endif
