// The GGUF decode GEMV's entry point: checks, then the kernels built for the dtype (gguf_gemv.cuh and
// gguf_kquant.cuh, one gguf_<dtype>.cu each).
#include "common/common.cuh"
#include "gguf/params.h"

namespace patcher {

cudaError_t launch_gguf_gemv_half(const GgufGemvParams& p, cudaStream_t stream);
cudaError_t launch_gguf_gemv_bf16(const GgufGemvParams& p, cudaStream_t stream);
cudaError_t launch_gguf_gemv_float(const GgufGemvParams& p, cudaStream_t stream);

cudaError_t launch_gguf_gemv(const GgufGemvParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.n == 0) return cudaSuccess;
  const int bytes = gguf_block_bytes(p.kind), values = gguf_block_values(p.kind);
  // The kernels read block fields as 2-byte words (every block size is even); rows follow each other without
  // padding; K is walked in whole blocks (super-blocks for the K-quants).
  if (p.batch < 0 || p.batch > kGgufMaxBatch || bytes == 0 || p.k <= 0 || p.k % values ||
      p.row_bytes != p.k / values * bytes || (reinterpret_cast<uintptr_t>(p.blocks) & 1))
    return cudaErrorInvalidValue;
  switch (p.dtype) {
    case DType::kFloat16:
      return launch_gguf_gemv_half(p, stream);
    case DType::kBFloat16:
      return launch_gguf_gemv_bf16(p, stream);
    case DType::kFloat32:
      return launch_gguf_gemv_float(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace patcher
