// The decode GEMV for __nv_bfloat16 inputs (one file per dtype: see gemv.cuh).
#include "gemv/gemv.cuh"

namespace patcher {

cudaError_t launch_gemv_bf16(const GemvParams& p, cudaStream_t stream) {
  return launch_gemv_typed<__nv_bfloat16>(p, stream);
}

}  // namespace patcher
