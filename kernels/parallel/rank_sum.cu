// The ranks' partial outputs of a row-wise projection summed over peer-mapped buffers (one-shot all-reduce).
//
// A decode step's all-reduce moves a few kilobytes: its cost is latency, not bandwidth. NCCL's ring (LL protocol)
// took 6-11 us a call inside the captured step on two H200s; here each block copies its slice of x into this rank's
// buffer, meets the same block of every other rank at a flag, reads the slice from every buffer, sums and writes it,
// and meets them again before it exits, so that no rank's next call overwrites a buffer another rank still reads.
//
// The flags: slot [block][peer] of a rank's signal pad goes 0 -> 1 when that peer's block arrives (the peer waits
// while it is still 1 from the last meeting) and back to 0 when this rank's block sees it. No counter grows, so a
// captured graph replays the same kernels forever, and both meetings of a call use the same slots.
#include "common/common.cuh"
#include "parallel/params.h"

namespace patcher {
namespace {

// Release this block's writes (made visible to the whole system by the fence) and tell every peer; then wait until
// every peer has told this rank. One thread a peer; the caller syncs the block before and after.
__device__ __forceinline__ void meet(const RankSumParams& p) {
  const int peer = threadIdx.x;
  if (peer < p.world) {
    __threadfence_system();
    uint32_t* theirs = p.pads[peer] + blockIdx.x * kRankSumMaxWorld + p.rank;
    while (atomicCAS_system(theirs, 0u, 1u) != 0u) {
    }
    uint32_t* mine = p.pads[p.rank] + blockIdx.x * kRankSumMaxWorld + peer;
    while (atomicCAS_system(mine, 1u, 0u) != 1u) {
    }
    __threadfence_system();
  }
}

// Raw words of one vector, for loads that bypass L1 (ld.global.cg): another GPU rewrites the buffers between calls.
template <int BYTES>
struct Raw;
template <>
struct Raw<2> {
  using type = unsigned short;
};
template <>
struct Raw<4> {
  using type = unsigned int;
};
template <>
struct Raw<16> {
  using type = uint4;
};

template <typename T, int VEC>
__device__ __forceinline__ void load_shared(float (&dst)[VEC], const T* src) {
  using Word = typename Raw<sizeof(T) * VEC>::type;
  const Word word = __ldcg(reinterpret_cast<const Word*>(src));
  Vec<T, VEC> v;
  memcpy(&v, &word, sizeof(word));
#pragma unroll
  for (int k = 0; k < VEC; ++k) dst[k] = to_float(v.data[k]);
}

template <typename T, int VEC>
__global__ void __launch_bounds__(256) rank_sum_kernel(const RankSumParams p) {
  griddep_wait();  // x is written by the kernel before
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x * VEC;
  T* const mine = static_cast<T*>(p.buffers[p.rank]);
  for (int64_t i = first; i < p.numel; i += stride)
    *reinterpret_cast<Vec<T, VEC>*>(mine + i) = *reinterpret_cast<const Vec<T, VEC>*>(static_cast<const T*>(p.x) + i);
  __syncthreads();
  meet(p);
  __syncthreads();
  for (int64_t i = first; i < p.numel; i += stride) {
    float sum[VEC] = {};
    for (int r = 0; r < p.world; ++r) {
      float part[VEC];
      load_shared<T, VEC>(part, static_cast<const T*>(p.buffers[r]) + i);
#pragma unroll
      for (int k = 0; k < VEC; ++k) sum[k] += part[k];
    }
    store_vec<T, VEC>(static_cast<T*>(p.out) + i, sum);
  }
  __syncthreads();
  meet(p);
}

template <typename T, int VEC>
cudaError_t launch_as(const RankSumParams& p, cudaStream_t stream) {
  const int64_t vectors = (p.numel + VEC - 1) / VEC;
  const int64_t blocks = (vectors + 255) / 256;
  const unsigned grid = static_cast<unsigned>(blocks < kRankSumMaxBlocks ? blocks : kRankSumMaxBlocks);
  return launch_pdl(rank_sum_kernel<T, VEC>, dim3(grid), dim3(256), 0, stream, p);
}

}  // namespace

cudaError_t launch_rank_sum(const RankSumParams& p, cudaStream_t stream) {
  if (p.numel == 0) return cudaSuccess;
  PATCHER_DISPATCH_DTYPE(p.dtype, T, {
    constexpr int vec = 16 / sizeof(T);
    // (the buffers are 16-byte aligned; x and out decide)
    if (p.numel % vec == 0 && aligned16(p.x) && aligned16(p.out)) return launch_as<T, vec>(p, stream);
    return launch_as<T, 1>(p, stream);
  });
  return cudaSuccess;
}

}  // namespace patcher
