// transformers' repetition_penalty on a decode step's logits, into the float32 scores the warpers read
// (sampling/params.h says what it computes).
//
// Why a kernel: HF gathers every token of the sequence so far each step; as torch ops in the decode graph that is
// about a dozen launches (the positions, the mask of the sequence, its scatter into a [B, V] mask, the float cast,
// the compares and the where's), where a mask kept across steps and one elementwise pass do. The mask gains the
// current token here: the block that writes it is one of many reading the row, so every thread also compares its ids
// with the current token, whichever value of that byte it reads.
#include "common/common.cuh"
#include "sampling/params.h"

namespace patcher {
namespace {

constexpr int kPenaltyThreads = 256;
constexpr int kPenaltyPerThread = 4;  // elements a thread, kPenaltyThreads apart (coalesced)
constexpr int kPenaltyBlockElems = kPenaltyThreads * kPenaltyPerThread;

template <typename T>
__global__ void __launch_bounds__(kPenaltyThreads) repetition_penalty_kernel(const RepetitionPenaltyParams p) {
  griddep_trigger_at_entry();
  griddep_wait();  // the logits, the mask and the current token are written by earlier kernels
  const int64_t b = blockIdx.y;
  const int64_t slot = *p.slot;
  const int64_t current = slot < p.columns ? p.tokens[b * p.tokens_stride + slot] : -1;
  uint8_t* seen = p.seen + b * p.vocab;
  if (blockIdx.x == 0 && threadIdx.x == 0 && current >= 0 && current < p.vocab) seen[current] = 1;
  const T* logits = static_cast<const T*>(p.logits) + b * p.logits_stride;
  float* out = p.out + b * p.vocab;
  const int64_t first = int64_t{blockIdx.x} * kPenaltyBlockElems + threadIdx.x;
#pragma unroll
  for (int j = 0; j < kPenaltyPerThread; ++j) {
    const int64_t v = first + j * kPenaltyThreads;
    if (v < p.vocab) {
      const float s = to_float(logits[v]);
      const bool hit = v == current || seen[v] != 0;
      const float divided = p.reciprocal ? s * p.inv_penalty : __fdiv_rn(s, p.penalty);
      out[v] = hit ? (s < 0.f ? s * p.penalty : divided) : s;
    }
  }
}

}  // namespace

cudaError_t launch_repetition_penalty(const RepetitionPenaltyParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.vocab == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((p.vocab + kPenaltyBlockElems - 1) / kPenaltyBlockElems),
                  static_cast<unsigned>(p.batch));
  PATCHER_DISPATCH_DTYPE(p.dtype, T, {
    return launch_pdl(repetition_penalty_kernel<T>, grid, dim3(kPenaltyThreads), 0, stream, p);
  });
  return cudaSuccess;
}

}  // namespace patcher
