// The ranks' partial outputs of a row-wise projection summed through peer-mapped inboxes (params.h says how).
//
// A decode step's all-reduce moves a few kilobytes: its cost is latency. Each word of x crosses NVLink once, with
// its flag beside it, and the receiver spins on its own memory; nothing else is exchanged. Words are 4 bytes of x:
// two fp16/bf16 values or one fp32 value, the last word of an odd-length 16-bit x padded with zero.
#include "common/common.cuh"
#include "parallel/params.h"

namespace patcher {
namespace {

__device__ __forceinline__ void store_word(uint64_t* at, uint32_t data, uint32_t flag) {
  asm volatile("st.volatile.global.v2.u32 [%0], {%1, %2};" ::"l"(at), "r"(data), "r"(flag) : "memory");
}

// Spins until the word at `at` carries `flag`, then returns its data.
__device__ __forceinline__ uint32_t await_word(const uint64_t* at, uint32_t flag) {
  uint32_t data, seen;
  do {
    asm volatile("ld.volatile.global.v2.u32 {%0, %1}, [%2];" : "=r"(data), "=r"(seen) : "l"(at) : "memory");
  } while (seen != flag);
  return data;
}

template <typename T>
__device__ __forceinline__ uint32_t load_word(const T* x, int64_t numel, int64_t w) {
  constexpr int per_word = 4 / sizeof(T);
  uint32_t word = 0;
#pragma unroll
  for (int k = 0; k < per_word; ++k) {
    const int64_t i = w * per_word + k;
    if (i < numel) {
      T value = x[i];
      uint32_t bits = 0;
      memcpy(&bits, &value, sizeof(T));
      word |= bits << (8 * sizeof(T) * k);
    }
  }
  return word;
}

template <typename T>
__device__ __forceinline__ void add_word(float (&sum)[4 / sizeof(T)], uint32_t word) {
#pragma unroll
  for (int k = 0; k < static_cast<int>(4 / sizeof(T)); ++k) {
    const uint32_t bits = word >> (8 * sizeof(T) * k);
    T value;
    if constexpr (sizeof(T) == 4) {
      memcpy(&value, &bits, 4);
    } else {
      const uint16_t half_bits = static_cast<uint16_t>(bits & 0xffffu);
      memcpy(&value, &half_bits, 2);
    }
    sum[k] += to_float(value);
  }
}

template <typename T>
__global__ void __launch_bounds__(kRankSumThreads) rank_sum_kernel(const RankSumParams p) {
  griddep_trigger_at_entry();  // the next kernels' weight loads overlap the wait for the peers' words
  griddep_wait();  // x is written by the kernel before
  constexpr int per_word = 4 / sizeof(T);
  const T* x = static_cast<const T*>(p.x);
  const int64_t words = (p.numel + per_word - 1) / per_word;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint32_t epoch = p.epochs[blockIdx.x];
  const uint32_t flag = epoch + 1u;  // (never 0, the inboxes' first contents, before the count wraps at 2^32 calls)
  const int64_t half = epoch & 1u;
  // This rank's row in a receiver's inbox, and the senders' rows in its own.
  const int64_t out_row = (half * p.world + p.rank) * p.capacity;
  for (int64_t w = first; w < words; w += stride) {
    const uint32_t word = load_word(x, p.numel, w);
    for (int r = 0; r < p.world; ++r)
      if (r != p.rank) store_word(p.inboxes[r] + out_row + w, word, flag);
  }
  const uint64_t* inbox = p.inboxes[p.rank];
  for (int64_t w = first; w < words; w += stride) {
    float sum[per_word] = {};
    for (int r = 0; r < p.world; ++r) {
      const uint32_t word =
          r == p.rank ? load_word(x, p.numel, w) : await_word(inbox + (half * p.world + r) * p.capacity + w, flag);
      add_word<T>(sum, word);
    }
#pragma unroll
    for (int k = 0; k < per_word; ++k) {
      const int64_t i = w * per_word + k;
      if (i < p.numel) static_cast<T*>(p.out)[i] = from_float<T>(sum[k]);
    }
  }
  __syncthreads();  // every thread has read this call's epoch
  if (threadIdx.x == 0) p.epochs[blockIdx.x] = flag;
}

}  // namespace

cudaError_t launch_rank_sum(const RankSumParams& p, cudaStream_t stream) {
  // Every call runs the whole grid, also with nothing to sum: each block's count must advance with every call.
  PATCHER_DISPATCH_DTYPE(p.dtype, T, {
    return launch_pdl(rank_sum_kernel<T>, dim3(kRankSumBlocks), dim3(kRankSumThreads), 0, stream, p);
  });
  return cudaSuccess;
}

}  // namespace patcher
