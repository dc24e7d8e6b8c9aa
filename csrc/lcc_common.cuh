// Shared scalar helpers of the lightcc kernels: float formats, scale exponents, encode/decode.
//
// The numeric contract is the CPU one in lightcc/common/kernels/floatcast.py, bit for bit:
//   * per scaling block, amax = largest *finite* |x| (0 when none);
//   * scale = 2**e with e the smallest integer such that amax * 2**-e <= format max
//     (e = 0 when amax == 0), clipped to [-126, 126]; scaling is therefore exact;
//   * code = round-to-nearest-even of x * 2**-e, saturated at the largest finite code
//     (never Inf/NaN from finite input); NaN -> NaN code, +-Inf -> Inf code (E4M3 has no
//     Inf: its NaN code); the sign bit is kept (also for -0 and NaN);
//   * decode = value(code) * scale in float32; a product that overflows from a finite code
//     saturates to +-FLT_MAX.
// Everything here is __host__ __device__ so tests/unit/test_csrc_compile.py can compile it
// into a host program and compare it with floatcast.py on a machine without a GPU.
// The loader (lightcc/common/kernels/cuda.py) pastes this file into each .cu before NVRTC.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#define LCC_HD __host__ __device__ __forceinline__

typedef long long lcc_i64;
typedef unsigned long long lcc_u64;

// Format identifiers shared with Python (lightcc/common/compression/gpu.py).
#define LCC_FMT_FP16 0
#define LCC_FMT_BF16 1
#define LCC_FMT_E4M3 2
#define LCC_FMT_E5M2 3

#define LCC_FLT_MAX 3.40282346638528859812e+38f

LCC_HD unsigned int lcc_float_bits(float x) {
    union { float f; unsigned int u; } c;
    c.f = x;
    return c.u;
}

LCC_HD float lcc_bits_float(unsigned int u) {
    union { float f; unsigned int u; } c;
    c.u = u;
    return c.f;
}

// |x| bits when x is finite, else 0: unsigned order of these equals float order.
LCC_HD unsigned int lcc_finite_abs_bits(float x) {
    const unsigned int a = lcc_float_bits(x) & 0x7fffffffu;
    return a < 0x7f800000u ? a : 0u;
}

LCC_HD int lcc_clz32(unsigned int x) {   // x != 0
#ifdef __CUDA_ARCH__
    return __clz((int)x);
#else
    int n = 0;
    while (!(x & 0x80000000u)) {
        x <<= 1;
        ++n;
    }
    return n;
#endif
}

// Smallest e with amax * 2**-e <= fmax, in [-126, 126]; 0 when amax == 0 (amax finite, >= 0).
LCC_HD int lcc_scale_exponent(float amax, float fmax) {
    if (!(amax > 0.0f)) return 0;
    int ex = 0;
    const double mant = frexp((double)amax / (double)fmax, &ex);   // r = mant * 2**ex
    const int e = (mant == 0.5) ? ex - 1 : ex;
    return e < -126 ? -126 : (e > 126 ? 126 : e);
}

// 2**e as float for e in [-126, 127] (always a normal float).
LCC_HD float lcc_pow2f(int e) {
    return lcc_bits_float((unsigned int)(e + 127) << 23);
}

// Exact integer encoder: code of the float with bits u in a format whose exponent bias is b
// (b = format bias - e applies the scale 2**-e). Same algorithm as floatcast._encode_one.
LCC_HD unsigned int lcc_encode_bits(unsigned int u, int b, int mbits, unsigned int maxcode,
                                    unsigned int infcode, unsigned int nancode, int signshift) {
    const unsigned int sign = ((u >> 31) & 1u) << signshift;
    const unsigned int a = u & 0x7fffffffu;
    if (a >= 0x7f800000u) return sign | (a == 0x7f800000u ? infcode : nancode);
    const int ef = (int)(a >> 23);
    const unsigned int mant = a & 0x7fffffu;
    unsigned int m;
    int ee;
    if (ef == 0) {
        if (mant == 0) return sign;
        const int lz = lcc_clz32(mant) - 8;      // shifts that bring the leading 1 to bit 23
        m = mant << lz;
        ee = 1 - lz;
    } else {
        m = mant | 0x800000u;
        ee = ef;
    }
    const int et = ee - 127 + b;
    unsigned int v, rem, half;
    if (et >= 1) {
        const int s = 23 - mbits;
        v = ((unsigned int)et << mbits) | ((m & 0x7fffffu) >> s);
        rem = m & ((1u << s) - 1u);
        half = 1u << (s - 1);
    } else {
        const int sh = 24 - mbits - et;
        if (sh >= 25) return sign;
        v = m >> sh;
        rem = m & ((1u << sh) - 1u);
        half = 1u << (sh - 1);
    }
    if (rem > half || (rem == half && (v & 1u))) v += 1u;
    if (v > maxcode) v = maxcode;
    return sign | v;
}

// One format: constants for the exact encoder, plus the fast intrinsic conversion of a value
// that is already scaled, finite and a normal float (RNE, saturating at the format max).
template <int FMT>
struct LccFormat;

template <>
struct LccFormat<LCC_FMT_FP16> {
    typedef unsigned short T;
    enum { bias = 15, mbits = 10, maxcode = 0x7BFF, infcode = 0x7C00, nancode = 0x7E00, nbits = 16 };
    static LCC_HD float max() { return 65504.0f; }
    static LCC_HD T fast(float y) {
        const float m = 65504.0f;
        return __half_as_ushort(__float2half_rn(y > m ? m : (y < -m ? -m : y)));
    }
    static LCC_HD float value(T b) { return __half2float(__ushort_as_half(b)); }
};

template <>
struct LccFormat<LCC_FMT_BF16> {
    typedef unsigned short T;
    enum { bias = 127, mbits = 7, maxcode = 0x7F7F, infcode = 0x7F80, nancode = 0x7FC0, nbits = 16 };
    static LCC_HD float max() { return 3.38953138925153547590470800371487866880e+38f; }
    static LCC_HD T fast(float y) {
        const float m = 3.38953138925153547590470800371487866880e+38f;
        return __bfloat16_as_ushort(__float2bfloat16_rn(y > m ? m : (y < -m ? -m : y)));
    }
    static LCC_HD float value(T b) { return __bfloat162float(__ushort_as_bfloat16(b)); }
};

template <>
struct LccFormat<LCC_FMT_E4M3> {
    typedef unsigned char T;
    enum { bias = 7, mbits = 3, maxcode = 0x7E, infcode = 0x7F, nancode = 0x7F, nbits = 8 };
    static LCC_HD float max() { return 448.0f; }
    static LCC_HD T fast(float y) {
        return (T)__nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3);
    }
    static LCC_HD float value(T b) {
        return __half2float(__half(__nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)b, __NV_E4M3)));
    }
};

template <>
struct LccFormat<LCC_FMT_E5M2> {
    typedef unsigned char T;
    enum { bias = 15, mbits = 2, maxcode = 0x7B, infcode = 0x7C, nancode = 0x7E, nbits = 8 };
    static LCC_HD float max() { return 57344.0f; }
    static LCC_HD T fast(float y) {
        return (T)__nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E5M2);
    }
    static LCC_HD float value(T b) {
        return __half2float(__half(__nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)b, __NV_E5M2)));
    }
};

// Code of x * 2**-e. Fast path (hardware conversion) when x is a normal float and so is the
// scaled value, which makes the multiplication exact and immune to flush-to-zero; zeros,
// subnormals, Inf/NaN and underflowing values take the exact integer path.
template <int FMT>
LCC_HD typename LccFormat<FMT>::T lcc_encode(float x, int e) {
    typedef LccFormat<FMT> F;
    const unsigned int u = lcc_float_bits(x);
    const int ef = (int)((u >> 23) & 0xffu);
    if (ef != 0 && ef != 255 && ef - e >= 1 && ef - e <= 254) {
        return F::fast(x * lcc_pow2f(-e));
    }
    return (typename F::T)lcc_encode_bits(u, (int)F::bias - e, (int)F::mbits,
                                          (unsigned int)F::maxcode, (unsigned int)F::infcode,
                                          (unsigned int)F::nancode, (int)F::nbits - 1);
}

// value(code) * scale in float32, saturating a finite code's overflow to +-FLT_MAX.
template <int FMT>
LCC_HD float lcc_decode(typename LccFormat<FMT>::T code, float scale) {
    const float q = LccFormat<FMT>::value(code);
#ifdef __CUDA_ARCH__
    const float v = __fmul_rn(q, scale);      // never contracted into an FMA
#else
    const float v = q * scale;
#endif
    const unsigned int qa = lcc_float_bits(q) & 0x7fffffffu;
    const unsigned int va = lcc_float_bits(v) & 0x7fffffffu;
    if (va == 0x7f800000u && qa < 0x7f800000u) return q > 0.0f ? LCC_FLT_MAX : -LCC_FLT_MAX;
    return v;
}
