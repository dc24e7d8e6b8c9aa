// TopK sparsification by sampled threshold + compaction, and the scatter-add that densifies.
//
// Exact top-k of |x| over n elements in three cheap steps instead of a full sort:
//   1. lcc_topk_sample  gathers |x| at `nsample` stratified, jittered positions; the host
//      sorts that small sample and picks a threshold a little below the k/n quantile.
//   2. lcc_topk_select  one read of x; every element with |x| >= thr (NaN included) is
//      appended, warp-aggregated, as a 64-bit key = (~bits(|x|) << 32) | index, so an
//      ascending sort orders candidates by |x| descending, ties by index ascending; NaN
//      ranks as Inf (as in lightcc/common/kernels/sparse.py: both count as largest).
//      `count` receives the number of candidates even past `capacity`, so the host can
//      retry with more room (count > capacity) or a lower threshold (count < k).
//   3. the host sorts the candidate keys (about k of them), keeps the first k and takes the
//      index from the low 32 bits (lightcc/common/compression/gpu.py: topk_indices).
// lcc_scatter_add_{i32,i64}: dst[idx[j]] += val[j] with fp32 atomics; indices outside
// [0, n) are skipped and counted in `bad` so the host can raise instead of corrupting memory.
#include "lcc_common.cuh"

__device__ __forceinline__ lcc_u64 lcc_mix64(lcc_u64 z) {
    // splitmix64 finalizer: a cheap, well-mixed hash for the sample jitter.
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// out[j] = |x[p_j]|, p_j uniform in stratum [j*n/nsample, (j+1)*n/nsample).
extern "C" __global__ void lcc_topk_sample(const float* __restrict__ x, lcc_i64 n,
                                           lcc_i64 nsample, lcc_u64 seed,
                                           float* __restrict__ out) {
    const lcc_i64 stride = (lcc_i64)gridDim.x * blockDim.x;
    for (lcc_i64 j = (lcc_i64)blockIdx.x * blockDim.x + threadIdx.x; j < nsample; j += stride) {
        // 128-bit-free stratum bounds: n and nsample are < 2^40 in practice, j*n may not fit,
        // so use floating point for the bounds (strata need not be exact).
        const double w = (double)n / (double)nsample;
        lcc_i64 lo = (lcc_i64)(w * (double)j);
        lcc_i64 width = (lcc_i64)(w * (double)(j + 1)) - lo;
        if (width < 1) width = 1;
        lcc_i64 p = lo + (lcc_i64)(lcc_mix64(seed ^ (lcc_u64)j) % (lcc_u64)width);
        if (p >= n) p = n - 1;
        out[j] = lcc_bits_float(lcc_float_bits(x[p]) & 0x7fffffffu);
    }
}

// Grid-stride in whole warps so the ballot below always sees 32 active lanes.
extern "C" __global__ void lcc_topk_select(const float* __restrict__ x, lcc_i64 n, float thr,
                                           lcc_i64 capacity,
                                           unsigned long long* __restrict__ count,
                                           lcc_u64* __restrict__ keys) {
    const int lane = threadIdx.x & 31;
    const lcc_i64 warp = ((lcc_i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const lcc_i64 nwarps = ((lcc_i64)gridDim.x * blockDim.x) >> 5;
    for (lcc_i64 base = warp * 32; base < n; base += nwarps * 32) {
        const lcc_i64 i = base + lane;
        unsigned int bits = 0;
        bool take = false;
        if (i < n) {
            bits = lcc_float_bits(x[i]) & 0x7fffffffu;
            take = !(lcc_bits_float(bits) < thr);   // NaN is always a candidate
            if (bits > 0x7f800000u) bits = 0x7f800000u;   // NaN ranks as Inf (ties by index)
        }
        const unsigned int mask = __ballot_sync(0xffffffffu, take);
        if (mask == 0u) continue;
        unsigned long long first = 0;
        if (lane == 0) first = atomicAdd(count, (unsigned long long)__popc(mask));
        first = __shfl_sync(0xffffffffu, first, 0);
        if (take) {
            const lcc_i64 pos = (lcc_i64)first + __popc(mask & ((1u << lane) - 1u));
            if (pos < capacity) {
                keys[pos] = ((lcc_u64)(~bits) << 32) | (lcc_u64)(unsigned int)i;
            }
        }
    }
}

template <typename I>
__device__ __forceinline__ void lcc_scatter_add(float* __restrict__ dst, lcc_i64 n,
                                                const I* __restrict__ idx,
                                                const float* __restrict__ val, lcc_i64 m,
                                                unsigned long long* __restrict__ bad) {
    const lcc_i64 stride = (lcc_i64)gridDim.x * blockDim.x;
    for (lcc_i64 j = (lcc_i64)blockIdx.x * blockDim.x + threadIdx.x; j < m; j += stride) {
        const lcc_i64 i = (lcc_i64)idx[j];
        if (i < 0 || i >= n) {
            atomicAdd(bad, 1ull);
            continue;
        }
        atomicAdd(dst + i, val[j]);
    }
}

extern "C" __global__ void lcc_scatter_add_i32(float* dst, lcc_i64 n, const int* idx,
                                               const float* val, lcc_i64 m,
                                               unsigned long long* bad) {
    lcc_scatter_add<int>(dst, n, idx, val, m, bad);
}

extern "C" __global__ void lcc_scatter_add_i64(float* dst, lcc_i64 n, const lcc_i64* idx,
                                               const float* val, lcc_i64 m,
                                               unsigned long long* bad) {
    lcc_scatter_add<lcc_i64>(dst, n, idx, val, m, bad);
}
