// The GGUF kernels for float activations (one file per dtype): the decode GEMV (gguf_launch.cuh) and
// the prefill path's dequantization and Q8_1 rounding (gguf_dequant.cuh).
#include "gguf/gguf_dequant.cuh"
#include "gguf/gguf_launch.cuh"

namespace patcher {

cudaError_t launch_gguf_gemv_float(const GgufGemvParams& p, cudaStream_t stream) {
  return launch_gguf_gemv_typed<float>(p, stream);
}

cudaError_t launch_gguf_dequantize_float(const GgufDequantizeParams& p, cudaStream_t stream) {
  return launch_gguf_dequantize_typed<float>(p, stream);
}

cudaError_t launch_round_q8_1_float(const Q8_1RoundParams& p, cudaStream_t stream) {
  return launch_round_q8_1_typed<float>(p, stream);
}

}  // namespace patcher
