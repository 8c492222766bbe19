// The GGUF decode GEMV for __half activations (one file per dtype: see gguf_gemv.cuh and gguf_kquant.cuh).
#include "gguf/gguf_kquant.cuh"

namespace patcher {

cudaError_t launch_gguf_gemv_half(const GgufGemvParams& p, cudaStream_t stream) {
  return launch_gguf_gemv_typed<__half>(p, stream);
}

}  // namespace patcher
