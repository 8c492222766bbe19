// The GGUF decode GEMV for __nv_bfloat16 activations (one file per dtype: see gguf_gemv.cuh and gguf_kquant.cuh).
#include "gguf/gguf_kquant.cuh"

namespace patcher {

cudaError_t launch_gguf_gemv_bf16(const GgufGemvParams& p, cudaStream_t stream) {
  return launch_gguf_gemv_typed<__nv_bfloat16>(p, stream);
}

}  // namespace patcher
