// Norm ops: parameters and launcher (norm.cu), and the norm prologue of the decode matrix-vector kernels.
//
// Plain structs of pointers, sizes and strides for the torch glue (kernels/bindings.cpp) and the kernels: nothing
// here includes torch. Strides are in elements. Every launcher returns the CUDA error of its launch (cudaSuccess when
// nothing had to be launched).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/types.h"

namespace patcher {

// RMSNorm and LayerNorm, optionally with the residual add fused in front and a second affine (dual LayerNorm).
//   sum  = x + delta                 (one delta)     or   (delta2 + delta) + x    (GPT-NeoX parallel residual)
//   out  = norm(sum) * weight (+ bias), out2 = norm(sum) * weight2 + bias2 (same mean and variance)
struct NormParams {
  DType dtype;
  int64_t rows, hidden;
  const void* x;  // [rows, hidden], row stride x_stride
  int64_t x_stride;
  const void* delta;  // nullptr: no residual add
  int64_t delta_stride;
  const void* delta2;  // nullptr: at most one delta
  int64_t delta2_stride;
  const void* weight;   // [hidden]
  const void* bias;     // [hidden] or nullptr
  const void* weight2;  // [hidden] or nullptr (no second output)
  const void* bias2;    // [hidden] or nullptr
  void* out;            // [rows, hidden] contiguous
  void* out2;           // [rows, hidden] contiguous, or nullptr
  void* sum;            // [rows, hidden] contiguous; required when delta is set, else nullptr
  float eps;
  bool rms;
  // The GGUF decode GEMV's workspace (gguf/params.h, GgufGemvParams::work), or nullptr. Set: the norm's output goes
  // there instead of to `out`, in the form the GEMV reads (gguf_a8: Q8_1 blocks, else fp32), and the GEMV runs
  // without its input kernel (GgufGemvParams::work_ready). RMSNorm, one output, 16-bit dtypes in 16-byte vectors (8
  // values a thread, four threads a 32-value block), hidden a multiple of 256 (so a warp's threads all hold values);
  // launch_norm returns cudaErrorInvalidValue otherwise.
  void* gguf_work;
  bool gguf_a8;
  // `out` holds the normalized values rounded through Q8_1 blocks of 32 (as round_q8_1 rounds them: a GGUF W4A8
  // projection's prefill input). The same conditions as gguf_work.
  bool round_q8_1;
};
cudaError_t launch_norm(const NormParams& p, cudaStream_t stream);

// The norm prologue of the decode matrix-vector kernels (dense and int4): x is then the residual stream, and the
// kernel makes its own input from it with the rounding of launch_norm:
//   sum = x + delta (or (delta2 + delta) + x),  h = norm(sum) * weight (+ bias)
// One block writes `sum` (when delta is set) and h2 = the second LayerNorm of sum (when weight2 is set), so the
// separate add + norm kernel of the decode step is not needed. weight == nullptr: no prologue, x is the input.
struct NormPrologue {
  const void* delta;  // [batch, k] rows, or nullptr
  int64_t delta_stride;
  // delta is an int4 op's fixed-point accumulator (int64, Int4Params::acc) instead of rows in the dtype: the int4
  // kernels' prologue rounds each value to the dtype first, as that op's own epilogue would have.
  bool delta_fixed;
  const void* delta2;  // nullptr: at most one delta
  int64_t delta2_stride;
  const void* weight;   // [k]
  const void* bias;     // [k] or nullptr
  const void* weight2;  // [k] or nullptr (no h2)
  const void* bias2;    // [k] or nullptr
  float eps;
  bool rms;
  void* sum;  // [batch, k] contiguous, when delta is set
  void* h2;   // [batch, k] contiguous, when weight2 is set
};

}  // namespace patcher
