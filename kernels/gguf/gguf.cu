// The GGUF kernels' entry points: checks, then the kernels built for the dtype (gguf_gemv.cuh and gguf_dequant.cuh,
// one gguf_<dtype>.cu each).
#include "common/common.cuh"
#include "gguf/params.h"

namespace patcher {

cudaError_t launch_gguf_gemv_half(const GgufGemvParams& p, cudaStream_t stream);
cudaError_t launch_gguf_gemv_bf16(const GgufGemvParams& p, cudaStream_t stream);
cudaError_t launch_gguf_gemv_float(const GgufGemvParams& p, cudaStream_t stream);
cudaError_t launch_gguf_dequantize_half(const GgufDequantizeParams& p, cudaStream_t stream);
cudaError_t launch_gguf_dequantize_bf16(const GgufDequantizeParams& p, cudaStream_t stream);
cudaError_t launch_gguf_dequantize_float(const GgufDequantizeParams& p, cudaStream_t stream);
cudaError_t launch_round_q8_1_half(const Q8_1RoundParams& p, cudaStream_t stream);
cudaError_t launch_round_q8_1_bf16(const Q8_1RoundParams& p, cudaStream_t stream);
cudaError_t launch_round_q8_1_float(const Q8_1RoundParams& p, cudaStream_t stream);

cudaError_t launch_gguf_gemv(const GgufGemvParams& p, cudaStream_t stream) {
  if (p.segments < 1 || p.segments > kGgufMaxSegments || p.batch < 0 || p.batch > kGgufMaxBatch || p.k <= 0)
    return cudaErrorInvalidValue;
  int64_t rows = 0;
  for (int i = 0; i < p.segments; ++i) {
    const GgufSegment& g = p.seg[i];
    const int bytes = gguf_block_bytes(g.kind), values = gguf_block_values(g.kind);
    // The kernels read block fields as 2-byte words (every block size is even); rows follow each other without
    // padding; K is walked in whole blocks (super-blocks for the K-quants).
    if (bytes == 0 || g.n < 0 || p.k % values || g.row_bytes != p.k / values * bytes ||
        (reinterpret_cast<uintptr_t>(g.blocks) & 1) || g.out_col < 0 || g.out_col + g.n > p.out_stride)
      return cudaErrorInvalidValue;
    rows += g.n;
  }
  if (p.batch == 0 || rows == 0) return cudaSuccess;
  if (p.work == nullptr || (reinterpret_cast<uintptr_t>(p.work) & 15)) return cudaErrorInvalidValue;
  const auto launch = by_dtype(p.dtype, launch_gguf_gemv_half, launch_gguf_gemv_bf16, launch_gguf_gemv_float);
  return launch ? launch(p, stream) : cudaErrorInvalidValue;
}

cudaError_t launch_gguf_dequantize(const GgufDequantizeParams& p, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  const int bytes = gguf_block_bytes(p.kind), values = gguf_block_values(p.kind);
  // As the GEMV: 2-byte block fields, unpadded rows of whole blocks; out rows of whole 16-byte vectors.
  if (p.n < 0 || bytes == 0 || p.k <= 0 || p.k % values || p.row_bytes != p.k / values * bytes ||
      (reinterpret_cast<uintptr_t>(p.blocks) & 1) || (reinterpret_cast<uintptr_t>(p.out) & 15))
    return cudaErrorInvalidValue;
  const auto launch =
      by_dtype(p.dtype, launch_gguf_dequantize_half, launch_gguf_dequantize_bf16, launch_gguf_dequantize_float);
  return launch ? launch(p, stream) : cudaErrorInvalidValue;
}

cudaError_t launch_round_q8_1(const Q8_1RoundParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  if (p.rows < 0 || p.k <= 0 || p.k % 32 || p.x_stride < p.k) return cudaErrorInvalidValue;
  const auto launch = by_dtype(p.dtype, launch_round_q8_1_half, launch_round_q8_1_bf16, launch_round_q8_1_float);
  return launch ? launch(p, stream) : cudaErrorInvalidValue;
}

}  // namespace patcher
