// Batched pack/unpack of fusion buckets: many tensors <-> one contiguous buffer in one launch.
//
// The host builds three small device tables for a bucket of `ntensors` tensors:
//   ptrs[t]         device address of tensor t (source for pack, destination for unpack)
//   offsets[t]      element offset of tensor t in the bucket; offsets[ntensors] = total
//   block_start[t]  first CUDA block that works on tensor t (each block copies `chunk`
//                   elements of one tensor); block_start[ntensors] = grid size
// A block finds its tensor by binary search over block_start (uniform across the block, so
// the loads are broadcasts), then copies its chunk with coalesced accesses.
// Entry points: lcc_pack_b{1,2,4,8}, lcc_unpack_b{1,2,4,8} (by element size in bytes) and
// lcc_pack_scale_f32 / lcc_unpack_scale_f32, which multiply by `scale` on the way
// (prescale before the reduction, postscale, e.g. 1/size for averaging, after it).
#include "lcc_common.cuh"

__device__ __forceinline__ lcc_i64 lcc_find_tensor(const lcc_i64* __restrict__ block_start,
                                                   lcc_i64 ntensors, lcc_i64 b) {
    // Largest t with block_start[t] <= b (tensors with zero blocks are skipped naturally).
    lcc_i64 lo = 0, hi = ntensors - 1;
    while (lo < hi) {
        const lcc_i64 mid = (lo + hi + 1) >> 1;
        if (block_start[mid] <= b) lo = mid; else hi = mid - 1;
    }
    return lo;
}

template <typename T, bool SCALE>
__device__ __forceinline__ void lcc_copy_range(const T* __restrict__ src, T* __restrict__ dst,
                                               lcc_i64 lo, lcc_i64 hi, float scale) {
    lcc_i64 i = lo + threadIdx.x;
    // 16-byte loads and stores when both sides are aligned there (the same answer for the
    // whole block): element-wise copies of 4-byte values reached 0.42x torch.cat on an H200.
    if ((((lcc_u64)(src + lo)) & 15u) == 0 && (((lcc_u64)(dst + lo)) & 15u) == 0) {
        constexpr int PER = 16 / sizeof(T);
        const lcc_i64 nvec = (hi - lo) / PER;
        const uint4* s4 = reinterpret_cast<const uint4*>(src + lo);
        uint4* d4 = reinterpret_cast<uint4*>(dst + lo);
        for (lcc_i64 j = threadIdx.x; j < nvec; j += blockDim.x) {
            if constexpr (SCALE) {
                float4 v = reinterpret_cast<const float4*>(s4)[j];
                v.x = v.x * scale; v.y = v.y * scale; v.z = v.z * scale; v.w = v.w * scale;
                reinterpret_cast<float4*>(d4)[j] = v;
            } else {
                d4[j] = s4[j];
            }
        }
        i = lo + nvec * PER + threadIdx.x;
    }
    for (; i < hi; i += blockDim.x) {
        T v = src[i];
        if constexpr (SCALE) v = (T)(v * scale);
        dst[i] = v;
    }
}

template <typename T, bool PACK, bool SCALE>
__device__ __forceinline__ void lcc_copy_bucket(const lcc_u64* __restrict__ ptrs,
                                                const lcc_i64* __restrict__ offsets,
                                                const lcc_i64* __restrict__ block_start,
                                                lcc_i64 ntensors, lcc_i64 chunk, T* bucket,
                                                float scale) {
    const lcc_i64 b = blockIdx.x;
    const lcc_i64 t = lcc_find_tensor(block_start, ntensors, b);
    const lcc_i64 size = offsets[t + 1] - offsets[t];
    const lcc_i64 lo = (b - block_start[t]) * chunk;
    lcc_i64 hi = lo + chunk;
    if (hi > size) hi = size;
    T* tensor = reinterpret_cast<T*>(ptrs[t]);
    T* slot = bucket + offsets[t];
    if constexpr (PACK) {
        lcc_copy_range<T, SCALE>(tensor, slot, lo, hi, scale);
    } else {
        lcc_copy_range<T, SCALE>(slot, tensor, lo, hi, scale);
    }
}

#define LCC_PACK_ENTRY(NAME, T, PACK, SCALE)                                                  \
    extern "C" __global__ void NAME(const lcc_u64* ptrs, const lcc_i64* offsets,              \
                                    const lcc_i64* block_start, lcc_i64 ntensors,             \
                                    lcc_i64 chunk, T* bucket, float scale) {                  \
        lcc_copy_bucket<T, PACK, SCALE>(ptrs, offsets, block_start, ntensors, chunk, bucket,  \
                                        scale);                                               \
    }

LCC_PACK_ENTRY(lcc_pack_b1, unsigned char, true, false)
LCC_PACK_ENTRY(lcc_pack_b2, unsigned short, true, false)
LCC_PACK_ENTRY(lcc_pack_b4, unsigned int, true, false)
LCC_PACK_ENTRY(lcc_pack_b8, lcc_u64, true, false)
LCC_PACK_ENTRY(lcc_unpack_b1, unsigned char, false, false)
LCC_PACK_ENTRY(lcc_unpack_b2, unsigned short, false, false)
LCC_PACK_ENTRY(lcc_unpack_b4, unsigned int, false, false)
LCC_PACK_ENTRY(lcc_unpack_b8, lcc_u64, false, false)
LCC_PACK_ENTRY(lcc_pack_scale_f32, float, true, true)
LCC_PACK_ENTRY(lcc_unpack_scale_f32, float, false, true)
