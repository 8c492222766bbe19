// Dense decode matrix-vector products: parameters and launcher (gemv.cu).
//
// Plain structs of pointers, sizes and strides for the torch glue (kernels/bindings.cpp) and the kernels: nothing
// here includes torch. Strides are in elements. Every launcher returns the CUDA error of its launch (cudaSuccess when
// nothing had to be launched).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/types.h"
#include "norm/params.h"
#include "rope/params.h"

namespace patcher {

// Matrix-vector products for decode (1 to 8 rows of x), with an optional norm prologue and fused epilogues.
//   out[b, n] = act(h[b] . w[n] + bias[n])                                       act: none, gelu, gelu_tanh
//   kSiluMul:  out[b, n] = silu(h[b] . w[n] + bias[n]) * (h[b] . w[N + n] + bias[N + n])   w is [gate; up]
// h is x, or the prologue's normalized residual sum. Each intermediate is rounded to the dtype where HF's
// separate ops would round it.
//   kRopeCache: w is one token's fused q|k|v projection; RoPE and the cache writes of rope_qkv_cache follow:
//              q [batch, Hq, D] goes to `out`, K and V into rope.k_cache/v_cache at *rope.slot (bias as for none)
enum GemvAct : int32_t { kActNone = 0, kActGelu = 1, kActGeluTanh = 2, kActSiluMul = 3, kActRopeCache = 4 };
struct GemvParams {
  DType dtype;
  int64_t batch;  // rows of x, 1..8
  int64_t n;      // output columns (w has n rows, or 2n for kActSiluMul)
  int64_t k;
  const void* x;  // [batch, k], row stride x_stride
  int64_t x_stride;
  NormPrologue norm;
  const void* w;  // [rows, k], row stride w_stride
  int64_t w_stride;
  const void* bias;  // [rows] or nullptr
  void* out;         // [batch, n] contiguous
  int32_t act;
  RopeCacheParams rope;  // kActRopeCache: the tables, heads and caches (its qkv and q fields are not used)
  bool stage_inputs;     // set by launch_gemv: the prologue copies its inputs into shared memory first
};
// Shared memory of the norm prologue: the [batch, k] stage of h, and with `staged` also copies of its inputs.
// The most a block may have.
size_t gemv_prologue_smem(const GemvParams& p, bool staged);
size_t gemv_max_smem();
cudaError_t launch_gemv(const GemvParams& p, cudaStream_t stream);

}  // namespace patcher
