// The GPTQ int4 decode kernel for __nv_bfloat16 activations (one file per dtype: see int4_gemv.cuh).
#include "int4/int4_gemv.cuh"

namespace patcher {

cudaError_t launch_int4_gemv_bf16(const Int4Params& p, cudaStream_t stream) {
  return launch_int4_gemv_typed<__nv_bfloat16>(p, stream);
}

}  // namespace patcher
