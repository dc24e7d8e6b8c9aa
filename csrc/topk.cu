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
//   3. the exact k among the candidates, in ascending index order, with no sort (below:
//      lcc_topk_hist/pick/mark/block_counts/emit; lightcc/common/compression/gpu.py drives it).
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

// |x[p_j]| as bits (NaN as Inf), p_j uniform in stratum [j*n/nsample, (j+1)*n/nsample).
__device__ __forceinline__ unsigned int lcc_sample_bits(const float* __restrict__ x, lcc_i64 n,
                                                        lcc_i64 nsample, lcc_u64 seed,
                                                        lcc_i64 j) {
    // 128-bit-free stratum bounds: n and nsample are < 2^40 in practice, j*n may not fit,
    // so use floating point for the bounds (strata need not be exact).
    const double w = (double)n / (double)nsample;
    lcc_i64 lo = (lcc_i64)(w * (double)j);
    lcc_i64 width = (lcc_i64)(w * (double)(j + 1)) - lo;
    if (width < 1) width = 1;
    lcc_i64 p = lo + (lcc_i64)(lcc_mix64(seed ^ (lcc_u64)j) % (lcc_u64)width);
    if (p >= n) p = n - 1;
    const unsigned int a = lcc_float_bits(x[p]) & 0x7fffffffu;
    return a > 0x7f800000u ? 0x7f800000u : a;
}

// out[j] = |x[p_j]| (NaN as Inf) for j < nsample.
extern "C" __global__ void lcc_topk_sample(const float* __restrict__ x, lcc_i64 n,
                                           lcc_i64 nsample, lcc_u64 seed,
                                           float* __restrict__ out) {
    const lcc_i64 stride = (lcc_i64)gridDim.x * blockDim.x;
    for (lcc_i64 j = (lcc_i64)blockIdx.x * blockDim.x + threadIdx.x; j < nsample; j += stride) {
        out[j] = lcc_bits_float(lcc_sample_bits(x, n, nsample, seed, j));
    }
}

// Tiles of 8 elements per thread (blockDim.x * 8 a tile): each thread counts its candidates,
// a block-wide scan gives each its slots, and one global atomic per tile reserves them (one
// atomic per warp on a single counter serialised the kernel at a third of memory speed).
#define LCC_SELECT_PER 8

// Exclusive scan of x over the block (blockDim.x a multiple of 32, at most 1024); sh holds 32
// values, and sh[blockDim.x / 32 - 1] holds the block's total until the next call.
template <typename T>
__device__ __forceinline__ T lcc_block_excl_scan(T x, T* sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    T incl = x;
    for (int o = 1; o < 32; o <<= 1) {
        const T v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += v;
    }
    __syncthreads();                                 // sh may still be read by a prior call
    if (lane == 31) sh[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        const int nw = (int)(blockDim.x >> 5);
        T w = lane < nw ? sh[lane] : (T)0;
        for (int o = 1; o < 32; o <<= 1) {
            const T v = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += v;
        }
        if (lane < nw) sh[lane] = w;                 // inclusive over warps
    }
    __syncthreads();
    return incl - x + (warp > 0 ? sh[warp - 1] : (T)0);
}

// The threshold is `thr`, or *thr_dev when thr_dev is not null (lcc_topk_threshold's result).
extern "C" __global__ void lcc_topk_select(const float* __restrict__ x, lcc_i64 n, float thr,
                                           const float* __restrict__ thr_dev, lcc_i64 capacity,
                                           unsigned long long* __restrict__ count,
                                           lcc_u64* __restrict__ keys) {
    __shared__ unsigned int sh[32];
    __shared__ unsigned long long tile_base;
    if (thr_dev != nullptr) thr = *thr_dev;
    const lcc_i64 tile = (lcc_i64)blockDim.x * LCC_SELECT_PER;
    const bool aligned = (((lcc_u64)x) & 15u) == 0;
    for (lcc_i64 t0 = (lcc_i64)blockIdx.x * tile; t0 < n; t0 += (lcc_i64)gridDim.x * tile) {
        const lcc_i64 i0 = t0 + (lcc_i64)threadIdx.x * LCC_SELECT_PER;
        float v[LCC_SELECT_PER];
        if (aligned && i0 + LCC_SELECT_PER <= n) {
            const float4 a = reinterpret_cast<const float4*>(x + i0)[0];
            const float4 b = reinterpret_cast<const float4*>(x + i0)[1];
            v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
            v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
        } else {
            for (int j = 0; j < LCC_SELECT_PER; ++j) v[j] = i0 + j < n ? x[i0 + j] : 0.0f;
        }
        unsigned int take = 0u;
        for (int j = 0; j < LCC_SELECT_PER; ++j) {
            // NaN is always a candidate (!(NaN < thr)); elements past n never are.
            if (i0 + j < n && !(fabsf(v[j]) < thr)) take |= 1u << j;
        }
        const unsigned int mine = lcc_block_excl_scan<unsigned int>(__popc(take), sh);
        const unsigned int total = sh[(blockDim.x >> 5) - 1];
        if (total == 0u) continue;                   // uniform: every thread saw the same total
        if (threadIdx.x == 0) tile_base = atomicAdd(count, (unsigned long long)total);
        __syncthreads();
        lcc_i64 pos = (lcc_i64)tile_base + mine;
        for (int j = 0; j < LCC_SELECT_PER; ++j) {
            if (take & (1u << j)) {
                if (pos < capacity) {
                    unsigned int bits = lcc_float_bits(v[j]) & 0x7fffffffu;
                    if (bits > 0x7f800000u) bits = 0x7f800000u;   // NaN ranks as Inf
                    keys[pos] = ((lcc_u64)(~bits) << 32) | (lcc_u64)(unsigned int)(i0 + j);
                }
                ++pos;
            }
        }
        __syncthreads();                             // tile_base is read before the next tile
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

// ---- exact top-k among the candidates, in index order ---------------------------------------
// Replaces sorting the candidate keys and then the chosen indices (two radix sorts) by a radix
// *select* over the 32 bits of |x| and an emit that keeps index order by construction:
//   lcc_topk_hist / lcc_topk_pick, three times (bits 31-21, 20-10, 9-0 of u = |x| bits, NaN as
//     Inf): histogram the candidates whose higher bits equal the prefix chosen so far, then one
//     block walks the bins from the top and extends the prefix with the bin that holds the
//     `need`-th largest. state = {prefix, mask, need, greater}: after the last pass prefix is
//     v, the k-th largest u, `greater` candidates have u > v, and the `need` = k - greater
//     lowest-index candidates with u == v complete the top k (ties go to the lower index, as
//     in the CPU kernel).
//   lcc_topk_mark: sets bit i of `gt` for candidates with u > v and of `tie` for u == v.
//   lcc_topk_block_counts, lcc_topk_scan_blocks, lcc_topk_emit: each chosen index's output
//     position is (#gt before it) + min(#ties before it, need), so the output is ascending.
// lcc_topk_threshold does the same select in one block on a sample of x (in shared memory),
// so the candidate threshold never travels through the host.
#define LCC_TOPK_MAX_BINS 2048
#define LCC_THREADS_MAX 1024
#define LCC_TOPK_SAMPLE 8192          // lcc_topk_threshold's sample (32 KB of shared memory)

__device__ __forceinline__ unsigned int lcc_key_u(lcc_u64 key) {
    return ~(unsigned int)(key >> 32);
}

// One radix-select step over a histogram `hist` of 2**bits bins (shared or global memory):
// every thread of the block calls it; the bin holding the need-th largest key extends the
// prefix in state[0..3] (written by one thread; the caller syncs before reading it). Zeroes
// the histogram for the next pass.
__device__ __forceinline__ void lcc_pick_bin(unsigned int* hist, lcc_u64* state, int shift,
                                             int bits, unsigned long long* sh) {
    const unsigned int nbins = 1u << bits;
    const unsigned int per = (nbins + blockDim.x - 1) / blockDim.x;
    const unsigned int first = threadIdx.x * per;
    unsigned long long mine = 0;
    for (unsigned int p = first; p < first + per && p < nbins; ++p) mine += hist[nbins - 1 - p];
    unsigned long long before = lcc_block_excl_scan<unsigned long long>(mine, sh);
    const lcc_u64 need = state[2];
    __syncthreads();                                 // every thread has read state[2]
    for (unsigned int p = first; p < first + per && p < nbins; ++p) {
        const unsigned int bin = nbins - 1 - p;
        const unsigned long long h = hist[bin];
        if (before < need && need <= before + h) {   // exactly one bin (1 <= need <= total)
            state[0] |= (lcc_u64)bin << shift;
            state[1] |= (lcc_u64)(nbins - 1u) << shift;
            state[2] = need - before;
            state[3] += before;
        }
        before += h;
        hist[bin] = 0u;
    }
    __syncthreads();
}

__device__ __forceinline__ void lcc_state_init(lcc_u64* state, lcc_i64 need) {
    if (threadIdx.x == 0) {
        state[0] = 0; state[1] = 0; state[2] = (lcc_u64)need; state[3] = 0;
    }
    __syncthreads();
}

// state[0..3] need not be initialised before the first pass (first != 0, need = k): the
// first pick writes it.
extern "C" __global__ void lcc_topk_hist(const lcc_u64* __restrict__ keys, lcc_i64 m,
                                         const lcc_u64* __restrict__ state, int shift, int bits,
                                         int first, unsigned int* __restrict__ hist) {
    __shared__ unsigned int sh[LCC_TOPK_MAX_BINS];
    const unsigned int nbins = 1u << bits;
    for (unsigned int b = threadIdx.x; b < nbins; b += blockDim.x) sh[b] = 0u;
    __syncthreads();
    const unsigned int prefix = first ? 0u : (unsigned int)state[0];
    const unsigned int mask = first ? 0u : (unsigned int)state[1];
    const lcc_i64 stride = (lcc_i64)gridDim.x * blockDim.x;
    for (lcc_i64 j = (lcc_i64)blockIdx.x * blockDim.x + threadIdx.x; j < m; j += stride) {
        const unsigned int u = lcc_key_u(keys[j]);
        if ((u & mask) == prefix) atomicAdd(&sh[(u >> shift) & (nbins - 1u)], 1u);
    }
    __syncthreads();
    for (unsigned int b = threadIdx.x; b < nbins; b += blockDim.x) {
        if (sh[b]) atomicAdd(&hist[b], sh[b]);
    }
}

// One block. k_init > 0 on the first pass: the state starts as {0, 0, k_init, 0}.
extern "C" __global__ void lcc_topk_pick(unsigned int* __restrict__ hist,
                                         lcc_u64* __restrict__ state, int shift, int bits,
                                         lcc_i64 k_init) {
    __shared__ unsigned long long sh[32];
    if (k_init > 0) lcc_state_init(state, k_init);
    lcc_pick_bin(hist, state, shift, bits, sh);
}

// One block: |x| (NaN as Inf) at LCC_TOPK_SAMPLE stratified, jittered positions, then the
// `rank`-th largest of them (1-based) into *thr (0 when rank > the sample).
extern "C" __global__ void lcc_topk_threshold(const float* __restrict__ x, lcc_i64 n,
                                              lcc_u64 seed, lcc_i64 rank,
                                              float* __restrict__ thr) {
    __shared__ unsigned int sample[LCC_TOPK_SAMPLE];
    __shared__ unsigned int hist[LCC_TOPK_MAX_BINS];
    __shared__ unsigned long long sh[32];
    __shared__ lcc_u64 state[4];
    const lcc_i64 ns = LCC_TOPK_SAMPLE;
    for (lcc_i64 j = threadIdx.x; j < ns; j += blockDim.x) {
        sample[j] = lcc_sample_bits(x, n, ns, seed, j);
    }
    for (unsigned int b = threadIdx.x; b < LCC_TOPK_MAX_BINS; b += blockDim.x) hist[b] = 0u;
    if (rank > ns) {
        if (threadIdx.x == 0) *thr = 0.0f;
        return;
    }
    lcc_state_init(state, rank);                     // also syncs the sample and the zeroing
    const int shifts[3] = {21, 10, 0}, widths[3] = {11, 11, 10};
    for (int pass = 0; pass < 3; ++pass) {
        const unsigned int prefix = (unsigned int)state[0], mask = (unsigned int)state[1];
        const unsigned int nb = 1u << widths[pass];
        for (lcc_i64 j = threadIdx.x; j < ns; j += blockDim.x) {
            const unsigned int u = sample[j];
            if ((u & mask) == prefix) atomicAdd(&hist[(u >> shifts[pass]) & (nb - 1u)], 1u);
        }
        __syncthreads();
        lcc_pick_bin(hist, state, shifts[pass], widths[pass], sh);
    }
    if (threadIdx.x == 0) *thr = lcc_bits_float((unsigned int)state[0]);
}

extern "C" __global__ void lcc_topk_mark(const lcc_u64* __restrict__ keys, lcc_i64 m,
                                         const lcc_u64* __restrict__ state,
                                         unsigned int* __restrict__ gt,
                                         unsigned int* __restrict__ tie) {
    const unsigned int v = (unsigned int)state[0];
    const lcc_i64 stride = (lcc_i64)gridDim.x * blockDim.x;
    for (lcc_i64 j = (lcc_i64)blockIdx.x * blockDim.x + threadIdx.x; j < m; j += stride) {
        const lcc_u64 key = keys[j];
        const unsigned int u = lcc_key_u(key);
        const unsigned int i = (unsigned int)key;
        if (u > v) atomicOr(&gt[i >> 5], 1u << (i & 31u));
        else if (u == v) atomicOr(&tie[i >> 5], 1u << (i & 31u));
    }
}

// counts[2 b] / counts[2 b + 1]: set bits of gt / tie in the words of block b (one word a
// thread, blockDim.x words a block).
extern "C" __global__ void lcc_topk_block_counts(const unsigned int* __restrict__ gt,
                                                 const unsigned int* __restrict__ tie,
                                                 lcc_i64 nwords, lcc_i64* __restrict__ counts) {
    __shared__ unsigned int sg[LCC_THREADS_MAX / 32], st[LCC_THREADS_MAX / 32];
    const lcc_i64 w = (lcc_i64)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned int g = w < nwords ? (unsigned int)__popc(gt[w]) : 0u;
    unsigned int t = w < nwords ? (unsigned int)__popc(tie[w]) : 0u;
    for (int o = 16; o > 0; o >>= 1) {
        g += __shfl_xor_sync(0xffffffffu, g, o);
        t += __shfl_xor_sync(0xffffffffu, t, o);
    }
    if ((threadIdx.x & 31) == 0) { sg[threadIdx.x >> 5] = g; st[threadIdx.x >> 5] = t; }
    __syncthreads();
    if (threadIdx.x == 0) {
        lcc_i64 a = 0, b = 0;
        for (unsigned int i = 0; i < (blockDim.x >> 5); ++i) { a += sg[i]; b += st[i]; }
        counts[2 * blockIdx.x] = a;
        counts[2 * blockIdx.x + 1] = b;
    }
}

// One block: exclusive prefix sums of the (gt, tie) pairs in place, over `nb` pairs.
extern "C" __global__ void lcc_topk_scan_blocks(lcc_i64* __restrict__ counts, lcc_i64 nb) {
    __shared__ unsigned long long sh[32];
    __shared__ unsigned long long carry[2];
    if (threadIdx.x == 0) { carry[0] = 0; carry[1] = 0; }
    __syncthreads();
    for (lcc_i64 base = 0; base < nb; base += blockDim.x) {
        const lcc_i64 b = base + threadIdx.x;
        const unsigned long long g = b < nb ? (unsigned long long)counts[2 * b] : 0ull;
        const unsigned long long t = b < nb ? (unsigned long long)counts[2 * b + 1] : 0ull;
        const unsigned long long eg = lcc_block_excl_scan<unsigned long long>(g, sh) + carry[0];
        const unsigned long long tg = sh[(blockDim.x >> 5) - 1];      // this chunk's total
        const unsigned long long et = lcc_block_excl_scan<unsigned long long>(t, sh) + carry[1];
        const unsigned long long tt = sh[(blockDim.x >> 5) - 1];
        if (b < nb) { counts[2 * b] = (lcc_i64)eg; counts[2 * b + 1] = (lcc_i64)et; }
        __syncthreads();                             // every thread has read carry
        if (threadIdx.x == 0) { carry[0] += tg; carry[1] += tt; }
        __syncthreads();
    }
}

// `excl` is lcc_topk_scan_blocks' output; writes the k chosen indices in ascending order.
extern "C" __global__ void lcc_topk_emit(const unsigned int* __restrict__ gt,
                                         const unsigned int* __restrict__ tie, lcc_i64 nwords,
                                         const lcc_i64* __restrict__ excl,
                                         const lcc_u64* __restrict__ state,
                                         lcc_i64* __restrict__ out) {
    __shared__ unsigned long long sh[32];
    const lcc_i64 w = (lcc_i64)blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned int gw = w < nwords ? gt[w] : 0u;
    const unsigned int tw = w < nwords ? tie[w] : 0u;
    typedef unsigned long long u64;
    const u64 lg = lcc_block_excl_scan<u64>((u64)__popc(gw), sh);    // gt bits before w here
    const u64 lt = lcc_block_excl_scan<u64>((u64)__popc(tw), sh);
    const lcc_i64 b = blockIdx.x;
    lcc_i64 ng = excl[2 * b] + (lcc_i64)lg;          // gt bits before word w
    lcc_i64 nt = excl[2 * b + 1] + (lcc_i64)lt;      // tie bits before word w
    const lcc_i64 need = (lcc_i64)state[2];
    unsigned int bits = gw | tw;
    while (bits) {
        const int j = __ffs(bits) - 1;
        bits &= bits - 1u;
        const unsigned int bit = 1u << j;
        const lcc_i64 pos = ng + (nt < need ? nt : need);
        if (gw & bit) {
            out[pos] = 32 * w + j;
            ++ng;
        } else {
            if (nt < need) out[pos] = 32 * w + j;
            ++nt;
        }
    }
}
