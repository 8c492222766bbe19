// Tensor parallelism: the sum of the ranks' partial outputs (rank_sum.cu) over buffers that every rank maps.
//
// Plain structs for the torch glue (kernels/bindings.cpp) and the kernel: nothing here includes torch.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/types.h"

namespace patcher {

// rank_sum: out[i] = sum over ranks r = 0 .. world - 1 of x_r[i], accumulated in fp32 in rank order and rounded once,
// so every rank gets the same values. Each rank first writes its x into its own symmetric buffer, then waits until
// every rank has written (a flag in each rank's signal pad), reads all ranks' buffers over NVLink and, once every
// rank has read, returns (the next call may overwrite the buffers). `buffers` and `pads` are device arrays of `world`
// pointers, as torch's symmetric memory hands them out (rendezvous: buffer_ptrs_dev, signal_pad_ptrs_dev); the
// buffers are contiguous, of at least numel elements, 16-byte aligned.
constexpr int kRankSumMaxWorld = 8;
constexpr int kRankSumMaxBlocks = 16;  // each block keeps a flag per peer in the signal pads: 16 x 8 x 4 bytes

struct RankSumParams {
  DType dtype;
  int64_t numel;
  const void* x;      // [numel] contiguous: this rank's partial output
  void* out;          // [numel] contiguous
  void* const* buffers;  // [world] device pointers to each rank's buffer
  uint32_t* const* pads;  // [world] device pointers to each rank's signal pad
  int rank, world;
};
cudaError_t launch_rank_sum(const RankSumParams& p, cudaStream_t stream);

}  // namespace patcher
