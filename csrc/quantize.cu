// Low-precision quantization for compressed allreduce (FP16, BF16, FP8 e4m3/e5m2).
//
// Numerics follow lcc_common.cuh (bit-identical to lightcc/common/kernels/floatcast.py):
// scaling blocks of `block` elements (per-bucket scaling = one block over the buffer), a
// power-of-two scale 2**e per block from the block's largest finite |x|, RNE + saturation.
// A launch sequence for one buffer:
//   lcc_amax_warp (block <= 8192: one warp per scaling block) or
//   lcc_amax_big (bigger blocks: `per` thread blocks each, atomicMax into zeroed amax),
//   lcc_scale_exponents (amax -> int32 e and float32 2**e per block),
//   lcc_quantize_<fmt> (codes; exps == nullptr means unscaled, the plain cast).
// Dequantization is fused with the accumulation of the two-phase allreduce:
//   lcc_dequant_sum_<fmt>: out[i] = (accumulate ? out[i] : 0) + sum over `nsrc` sources,
//   in source order, of decode(q[r * q_stride + i], scales[r * scale_stride + blk(i)]),
//   so the float32 sum is deterministic and equals sequential decode(accumulate=True) calls
//   on the host. blk(i) = (i + phase) / block, `phase` being where the segment starts inside
//   its first scaling block (0 for block-aligned segments).
//   lcc_decode_payload_<fmt>: the same sum read straight from the wire format of
//   lightcc/common/compression/fp.py, one payload per source `src_bytes` apart, each
//   `nscales` float32 scales (any byte alignment) followed by the codes.
#include "lcc_common.cuh"

#define LCC_QTHREADS 256

__device__ __forceinline__ unsigned int lcc_warp_max_u32(unsigned int v) {
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned int other = __shfl_xor_sync(0xffffffffu, v, o);
        v = other > v ? other : v;
    }
    return v;
}

// ---- amax -----------------------------------------------------------------------------------
// One warp per scaling block, grid-stride over blocks; writes amax[s] (no init needed).
extern "C" __global__ void lcc_amax_warp(const float* __restrict__ x, lcc_i64 n, lcc_i64 block,
                                         lcc_i64 nblocks, float* __restrict__ amax) {
    const int lane = threadIdx.x & 31;
    const lcc_i64 warp = ((lcc_i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const lcc_i64 nwarps = ((lcc_i64)gridDim.x * blockDim.x) >> 5;
    for (lcc_i64 s = warp; s < nblocks; s += nwarps) {
        const lcc_i64 lo = s * block;
        lcc_i64 hi = lo + block;
        if (hi > n) hi = n;
        unsigned int m = 0;
        for (lcc_i64 i = lo + lane; i < hi; i += 32) {
            const unsigned int b = lcc_finite_abs_bits(x[i]);
            m = b > m ? b : m;
        }
        m = lcc_warp_max_u32(m);
        if (lane == 0) amax[s] = lcc_bits_float(m);
    }
}

// `per` thread blocks share each scaling block: blockIdx.x = s * per + part. amax must be
// zeroed first; the result is exact because max does not depend on the order.
extern "C" __global__ void lcc_amax_big(const float* __restrict__ x, lcc_i64 n, lcc_i64 block,
                                        lcc_i64 per, float* __restrict__ amax) {
    __shared__ unsigned int warp_max[LCC_QTHREADS / 32];
    const lcc_i64 s = blockIdx.x / per;
    const lcc_i64 part = blockIdx.x % per;
    const lcc_i64 lo = s * block;
    lcc_i64 hi = lo + block;
    if (hi > n) hi = n;
    unsigned int m = 0;
    const lcc_i64 stride = per * (lcc_i64)blockDim.x;
    const lcc_i64 first = part * blockDim.x + threadIdx.x;
    lcc_i64 tail = lo;
    if ((((lcc_u64)(x + lo)) & 15u) == 0) {
        // float4 loads over the 16-byte aligned body, scalar loads for the rest.
        const lcc_i64 nvec = (hi - lo) / 4;
        const float4* xv = reinterpret_cast<const float4*>(x + lo);
        for (lcc_i64 j = first; j < nvec; j += stride) {
            const float4 v = xv[j];
            unsigned int a = lcc_finite_abs_bits(v.x), b = lcc_finite_abs_bits(v.y);
            unsigned int c = lcc_finite_abs_bits(v.z), d = lcc_finite_abs_bits(v.w);
            a = a > b ? a : b;
            c = c > d ? c : d;
            a = a > c ? a : c;
            m = a > m ? a : m;
        }
        tail = lo + nvec * 4;
    }
    for (lcc_i64 i = tail + first; i < hi; i += stride) {
        const unsigned int b = lcc_finite_abs_bits(x[i]);
        m = b > m ? b : m;
    }
    m = lcc_warp_max_u32(m);
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x < 32) {
        const int nw = (int)(blockDim.x >> 5);
        m = (int)threadIdx.x < nw ? warp_max[threadIdx.x] : 0u;
        m = lcc_warp_max_u32(m);
        if (threadIdx.x == 0 && m != 0u) {
            atomicMax(reinterpret_cast<unsigned int*>(amax) + s, m);
        }
    }
}

// e[s] = lcc_scale_exponent(amax[s], fmax); scales[s] = 2**e[s] (either output may be null).
extern "C" __global__ void lcc_scale_exponents(const float* __restrict__ amax, lcc_i64 nblocks,
                                               float fmax, int* __restrict__ exps,
                                               float* __restrict__ scales) {
    const lcc_i64 stride = (lcc_i64)gridDim.x * blockDim.x;
    for (lcc_i64 s = (lcc_i64)blockIdx.x * blockDim.x + threadIdx.x; s < nblocks; s += stride) {
        const int e = lcc_scale_exponent(amax[s], fmax);
        if (exps != nullptr) exps[s] = e;
        if (scales != nullptr) scales[s] = lcc_pow2f(e);
    }
}

// ---- quantize -------------------------------------------------------------------------------
// Vector path: each thread encodes groups of 8 consecutive elements with two 16-byte loads and
// one 16-byte (16-bit codes) or 8-byte (8-bit codes) store, which is what lets a cast run at
// memory speed (4 scalar 2-byte stores per thread ran at half of it on an H200). It needs `x`
// 16-byte aligned, `q` aligned to 8 codes and, when scaled, blocks of a multiple of 8 elements
// (one exponent per group); the pointers are the same for every thread, so the whole grid takes
// the same path. The n % 8 tail and any other case take the scalar loop.
template <typename T>
__device__ __forceinline__ void lcc_store8(T* q, const unsigned int (&c)[8]);

template <>
__device__ __forceinline__ void lcc_store8<unsigned short>(unsigned short* q,
                                                           const unsigned int (&c)[8]) {
    uint4 v;
    v.x = c[0] | (c[1] << 16);
    v.y = c[2] | (c[3] << 16);
    v.z = c[4] | (c[5] << 16);
    v.w = c[6] | (c[7] << 16);
    *reinterpret_cast<uint4*>(q) = v;
}

template <>
__device__ __forceinline__ void lcc_store8<unsigned char>(unsigned char* q,
                                                          const unsigned int (&c)[8]) {
    uint2 v;
    v.x = c[0] | (c[1] << 8) | (c[2] << 16) | (c[3] << 24);
    v.y = c[4] | (c[5] << 8) | (c[6] << 16) | (c[7] << 24);
    *reinterpret_cast<uint2*>(q) = v;
}

template <int FMT>
__device__ __forceinline__ void lcc_quantize(const float* __restrict__ x, lcc_i64 n,
                                             lcc_i64 block, const int* __restrict__ exps,
                                             typename LccFormat<FMT>::T* __restrict__ q) {
    typedef typename LccFormat<FMT>::T T;
    const lcc_i64 tid = (lcc_i64)blockIdx.x * blockDim.x + threadIdx.x;
    const lcc_i64 nthreads = (lcc_i64)gridDim.x * blockDim.x;
    lcc_i64 done = 0;
    if ((((lcc_u64)x) & 15u) == 0 && (((lcc_u64)q) & (8 * sizeof(T) - 1)) == 0 &&
        (exps == nullptr || block % 8 == 0)) {
        const lcc_i64 ngroups = n / 8;
        const float4* xv = reinterpret_cast<const float4*>(x);
        for (lcc_i64 g = tid; g < ngroups; g += nthreads) {
            const float4 a = xv[2 * g];
            const float4 b = xv[2 * g + 1];
            const int e = exps != nullptr ? exps[(8 * g) / block] : 0;
            const unsigned int c[8] = {
                lcc_encode<FMT>(a.x, e), lcc_encode<FMT>(a.y, e), lcc_encode<FMT>(a.z, e),
                lcc_encode<FMT>(a.w, e), lcc_encode<FMT>(b.x, e), lcc_encode<FMT>(b.y, e),
                lcc_encode<FMT>(b.z, e), lcc_encode<FMT>(b.w, e)};
            lcc_store8<T>(q + 8 * g, c);
        }
        done = ngroups * 8;
    }
    for (lcc_i64 i = done + tid; i < n; i += nthreads) {
        const int e = exps != nullptr ? exps[i / block] : 0;
        q[i] = lcc_encode<FMT>(x[i], e);
    }
}

#define LCC_QUANT_ENTRY(NAME, FMT, T)                                                         \
    extern "C" __global__ void NAME(const float* x, lcc_i64 n, lcc_i64 block, const int* exps, \
                                    T* q) {                                                    \
        lcc_quantize<FMT>(x, n, block, exps, q);                                               \
    }

LCC_QUANT_ENTRY(lcc_quantize_fp16, LCC_FMT_FP16, unsigned short)
LCC_QUANT_ENTRY(lcc_quantize_bf16, LCC_FMT_BF16, unsigned short)
LCC_QUANT_ENTRY(lcc_quantize_e4m3, LCC_FMT_E4M3, unsigned char)
LCC_QUANT_ENTRY(lcc_quantize_e5m2, LCC_FMT_E5M2, unsigned char)

// ---- fused dequantize + accumulate ----------------------------------------------------------
// Loads 8 consecutive codes of a source at once (16 or 8 bytes): one code per load ran at 0.87x
// torch's add_ of a half tensor on an H200.
template <typename T>
__device__ __forceinline__ void lcc_load8(const T* q, unsigned int (&c)[8]);

template <>
__device__ __forceinline__ void lcc_load8<unsigned short>(const unsigned short* q,
                                                          unsigned int (&c)[8]) {
    const uint4 v = *reinterpret_cast<const uint4*>(q);
    c[0] = v.x & 0xffffu; c[1] = v.x >> 16; c[2] = v.y & 0xffffu; c[3] = v.y >> 16;
    c[4] = v.z & 0xffffu; c[5] = v.z >> 16; c[6] = v.w & 0xffffu; c[7] = v.w >> 16;
}

template <>
__device__ __forceinline__ void lcc_load8<unsigned char>(const unsigned char* q,
                                                         unsigned int (&c)[8]) {
    const uint2 v = *reinterpret_cast<const uint2*>(q);
    for (int j = 0; j < 4; ++j) {
        c[j] = (v.x >> (8 * j)) & 0xffu;
        c[4 + j] = (v.y >> (8 * j)) & 0xffu;
    }
}

__device__ __forceinline__ void lcc_load_acc8(const float* out, int accumulate, float (&acc)[8]) {
    if (accumulate) {
        const float4 a = reinterpret_cast<const float4*>(out)[0];
        const float4 b = reinterpret_cast<const float4*>(out)[1];
        acc[0] = a.x; acc[1] = a.y; acc[2] = a.z; acc[3] = a.w;
        acc[4] = b.x; acc[5] = b.y; acc[6] = b.z; acc[7] = b.w;
    } else {
        for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
    }
}

__device__ __forceinline__ void lcc_store_acc8(float* out, const float (&acc)[8]) {
    reinterpret_cast<float4*>(out)[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    reinterpret_cast<float4*>(out)[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
}

template <int FMT>
__device__ __forceinline__ void lcc_dequant_sum(const typename LccFormat<FMT>::T* __restrict__ q,
                                                const float* __restrict__ scales, lcc_i64 n,
                                                lcc_i64 nsrc, lcc_i64 q_stride,
                                                lcc_i64 scale_stride, lcc_i64 block,
                                                lcc_i64 phase, int accumulate,
                                                float* __restrict__ out) {
    typedef typename LccFormat<FMT>::T T;
    const lcc_i64 tid = (lcc_i64)blockIdx.x * blockDim.x + threadIdx.x;
    const lcc_i64 stride = (lcc_i64)gridDim.x * blockDim.x;
    lcc_i64 done = 0;
    if ((((lcc_u64)out) & 15u) == 0 && (((lcc_u64)q) & (8 * sizeof(T) - 1)) == 0 &&
        q_stride % 8 == 0 && (scales == nullptr || (block % 8 == 0 && phase % 8 == 0))) {
        const lcc_i64 ngroups = n / 8;
        for (lcc_i64 g = tid; g < ngroups; g += stride) {
            const lcc_i64 i0 = 8 * g;
            float acc[8];
            lcc_load_acc8(out + i0, accumulate, acc);
            const lcc_i64 s = (i0 + phase) / block;
            for (lcc_i64 r = 0; r < nsrc; ++r) {
                const float scale = scales != nullptr ? scales[r * scale_stride + s] : 1.0f;
                unsigned int c[8];
                lcc_load8<T>(q + r * q_stride + i0, c);
                for (int j = 0; j < 8; ++j) {
                    acc[j] = __fadd_rn(acc[j], lcc_decode<FMT>((T)c[j], scale));
                }
            }
            lcc_store_acc8(out + i0, acc);
        }
        done = ngroups * 8;
    }
    for (lcc_i64 i = done + tid; i < n; i += stride) {
        float acc = accumulate ? out[i] : 0.0f;
        const lcc_i64 s = (i + phase) / block;
        for (lcc_i64 r = 0; r < nsrc; ++r) {
            const float scale = scales != nullptr ? scales[r * scale_stride + s] : 1.0f;
            acc = __fadd_rn(acc, lcc_decode<FMT>(q[r * q_stride + i], scale));
        }
        out[i] = acc;
    }
}

#define LCC_DEQUANT_ENTRY(NAME, FMT, T)                                                       \
    extern "C" __global__ void NAME(const T* q, const float* scales, lcc_i64 n, lcc_i64 nsrc,  \
                                    lcc_i64 q_stride, lcc_i64 scale_stride, lcc_i64 block,     \
                                    lcc_i64 phase, int accumulate, float* out) {               \
        lcc_dequant_sum<FMT>(q, scales, n, nsrc, q_stride, scale_stride, block, phase,        \
                             accumulate, out);                                                 \
    }

LCC_DEQUANT_ENTRY(lcc_dequant_sum_fp16, LCC_FMT_FP16, unsigned short)
LCC_DEQUANT_ENTRY(lcc_dequant_sum_bf16, LCC_FMT_BF16, unsigned short)
LCC_DEQUANT_ENTRY(lcc_dequant_sum_e4m3, LCC_FMT_E4M3, unsigned char)
LCC_DEQUANT_ENTRY(lcc_dequant_sum_e5m2, LCC_FMT_E5M2, unsigned char)

// ---- the same, straight from fp.py's wire payloads --------------------------------------------
__device__ __forceinline__ float lcc_load_f32_unaligned(const unsigned char* p) {
    const unsigned int u = (unsigned int)p[0] | ((unsigned int)p[1] << 8) |
                           ((unsigned int)p[2] << 16) | ((unsigned int)p[3] << 24);
    return lcc_bits_float(u);
}

template <int FMT>
__device__ __forceinline__ void lcc_decode_payload(const unsigned char* __restrict__ payload,
                                                   lcc_i64 n, lcc_i64 nsrc, lcc_i64 src_bytes,
                                                   lcc_i64 nscales, lcc_i64 block,
                                                   int accumulate, float* __restrict__ out) {
    typedef typename LccFormat<FMT>::T T;
    const lcc_i64 tid = (lcc_i64)blockIdx.x * blockDim.x + threadIdx.x;
    const lcc_i64 stride = (lcc_i64)gridDim.x * blockDim.x;
    lcc_i64 done = 0;
    // Vector path when every source's codes start aligned to 8 codes (as the scalar loop, the
    // scales are read bytewise: they sit at any 4-byte-multiple offset in the payload).
    if ((((lcc_u64)out) & 15u) == 0 &&
        (((lcc_u64)(payload + 4 * nscales)) & (8 * sizeof(T) - 1)) == 0 &&
        src_bytes % (8 * sizeof(T)) == 0 && (nscales == 0 || block % 8 == 0)) {
        const lcc_i64 ngroups = n / 8;
        for (lcc_i64 g = tid; g < ngroups; g += stride) {
            const lcc_i64 i0 = 8 * g;
            float acc[8];
            lcc_load_acc8(out + i0, accumulate, acc);
            const lcc_i64 s = i0 / block;
            for (lcc_i64 r = 0; r < nsrc; ++r) {
                const unsigned char* src = payload + r * src_bytes;
                const T* codes = reinterpret_cast<const T*>(src + 4 * nscales);
                const float scale = nscales > 0 ? lcc_load_f32_unaligned(src + 4 * s) : 1.0f;
                unsigned int c[8];
                lcc_load8<T>(codes + i0, c);
                for (int j = 0; j < 8; ++j) {
                    acc[j] = __fadd_rn(acc[j], lcc_decode<FMT>((T)c[j], scale));
                }
            }
            lcc_store_acc8(out + i0, acc);
        }
        done = ngroups * 8;
    }
    for (lcc_i64 i = done + tid; i < n; i += stride) {
        float acc = accumulate ? out[i] : 0.0f;
        const lcc_i64 s = i / block;
        for (lcc_i64 r = 0; r < nsrc; ++r) {
            const unsigned char* src = payload + r * src_bytes;
            const T* codes = reinterpret_cast<const T*>(src + 4 * nscales);
            const float scale = nscales > 0 ? lcc_load_f32_unaligned(src + 4 * s) : 1.0f;
            acc = __fadd_rn(acc, lcc_decode<FMT>(codes[i], scale));
        }
        out[i] = acc;
    }
}

#define LCC_PAYLOAD_ENTRY(NAME, FMT)                                                          \
    extern "C" __global__ void NAME(const unsigned char* payload, lcc_i64 n, lcc_i64 nsrc,     \
                                    lcc_i64 src_bytes, lcc_i64 nscales, lcc_i64 block,         \
                                    int accumulate, float* out) {                              \
        lcc_decode_payload<FMT>(payload, n, nsrc, src_bytes, nscales, block, accumulate, out); \
    }

LCC_PAYLOAD_ENTRY(lcc_decode_payload_fp16, LCC_FMT_FP16)
LCC_PAYLOAD_ENTRY(lcc_decode_payload_bf16, LCC_FMT_BF16)
LCC_PAYLOAD_ENTRY(lcc_decode_payload_e4m3, LCC_FMT_E4M3)
LCC_PAYLOAD_ENTRY(lcc_decode_payload_e5m2, LCC_FMT_E5M2)
