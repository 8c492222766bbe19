// The GGUF decode GEMV for float activations (one file per dtype: see gguf_gemv.cuh and gguf_kquant.cuh).
#include "gguf/gguf_kquant.cuh"

namespace patcher {

cudaError_t launch_gguf_gemv_float(const GgufGemvParams& p, cudaStream_t stream) {
  return launch_gguf_gemv_typed<float>(p, stream);
}

}  // namespace patcher
