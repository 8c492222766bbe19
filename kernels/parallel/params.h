// Tensor parallelism: the sum of the ranks' partial outputs (rank_sum.cu) through buffers that every rank maps.
//
// Plain structs for the torch glue (kernels/bindings.cpp) and the kernel: nothing here includes torch.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/types.h"

namespace patcher {

// rank_sum: out[i] = sum over ranks r = 0 .. world - 1 of x_r[i], accumulated in fp32 in rank order and rounded once,
// so every rank gets the same values.
//
// Each rank pushes its x to every other rank as 8-byte words, 4 bytes of x and a 4-byte flag that says which call
// wrote them, into the receiver's inbox (torch's symmetric memory: `inboxes` is the device array of every rank's inbox,
// mapped here). An 8-byte store lands whole, so a receiver that reads the call's flag in a word holds its data too:
// one one-way trip over NVLink, no barrier. The inbox has two halves, used by alternate calls: a rank can only be a
// call ahead of any other (it needs their words to finish a call), so it never writes the half another still reads.
// `epochs` ([kRankSumBlocks], this rank's own memory, zeros at first) counts each block's calls; every call runs the
// same grid and gives a word of x to the same block, so each word's half and flag follow that block's count.
constexpr int kRankSumMaxWorld = 8;
constexpr int kRankSumBlocks = 16;
constexpr int kRankSumThreads = 256;

struct RankSumParams {
  DType dtype;
  int64_t numel;
  const void* x;             // [numel] contiguous: this rank's partial output
  void* out;                 // [numel] contiguous
  uint64_t* const* inboxes;  // [world] device pointers: inbox [2 halves][world senders][capacity words]
  int64_t capacity;          // words a sender's row of an inbox holds (>= numel * element size / 4, rounded up)
  uint32_t* epochs;          // [kRankSumBlocks]
  int rank, world;
};
cudaError_t launch_rank_sum(const RankSumParams& p, cudaStream_t stream);

}  // namespace patcher
