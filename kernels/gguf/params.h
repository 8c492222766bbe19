// GGUF block-quantized linears for decode: parameters and launcher (gguf.cu).
//
// Plain structs of pointers, sizes and strides for the torch glue (kernels/bindings_gguf.h) and the kernels: nothing
// here includes torch. Strides are in elements. The launcher returns the CUDA error of its launch (cudaSuccess when
// nothing had to be launched).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/types.h"

namespace patcher {

// The GGUF block types the kernels take (ggml's type numbers), each 32 values a block (patcher/gguf/format.py):
//   Q4_0  18 bytes: d fp16 | qs[16]           w = d * (nibble - 8)
//   Q4_1  20 bytes: d fp16 | m fp16 | qs[16]   w = d * nibble + m
//   Q8_0  34 bytes: d fp16 | qs int8[32]       w = d * q
// Nibbles: element i < 16 is the low nibble of qs[i], element i >= 16 the high nibble of qs[i - 16].
enum GgufKind : int32_t { kGgufQ4_0 = 2, kGgufQ4_1 = 3, kGgufQ8_0 = 8 };

// y [batch, n] = x [batch, k] . W^T + bias, W [n, k] the GGUF rows `blocks` (n rows of k / 32 blocks, row after row,
// each row `row_bytes` = k / 32 * block bytes long). Two modes (patcher/gguf/reference.py):
//   quantize_activations (W4A8): each row of x quantized to Q8_1 blocks of 32 (d = max|x| / 127 stored as fp16,
//     q = roundf(x / d), s = d * sum(q)); per block the integer dot product isum of the weight's and the activation's
//     integers, then  y = sum_blocks (d_w * d_a) * isum  +  sum_blocks m_w * s_a  (Q4_1 only)  +  bias  in fp32,
//     each product and sum rounded once (no fused multiply-add), rounded to the dtype once at the end.
//   otherwise (W4A16): the weights dequantized in fp32 as gguf.quants forms them, rounded to the dtype (the
//     reference's weight.to(x.dtype)), multiplied with x in fp32, plus the bias rounded to the dtype, rounded once.
struct GgufGemvParams {
  DType dtype;  // of x and out
  int32_t kind;  // GgufKind
  bool quantize_activations;
  int64_t batch;  // rows of x, 1..8
  int64_t n;      // output features (rows of W)
  int64_t k;      // input features, a positive multiple of 32
  const void* x;  // [batch, k], row stride x_stride, last dimension contiguous
  int64_t x_stride;
  const uint8_t* blocks;  // [n, row_bytes] contiguous
  int64_t row_bytes;
  const void* bias;  // [n] or nullptr, in bias_dtype
  DType bias_dtype;
  void* out;  // [batch, n] contiguous
};
// Bytes per 32-value block of a GgufKind, 0 for any other value.
PATCHER_HOST_DEVICE inline int gguf_block_bytes(int32_t kind) {
  return kind == kGgufQ4_0 ? 18 : kind == kGgufQ4_1 ? 20 : kind == kGgufQ8_0 ? 34 : 0;
}
constexpr int64_t kGgufMaxBatch = 8;
cudaError_t launch_gguf_gemv(const GgufGemvParams& p, cudaStream_t stream);

}  // namespace patcher
