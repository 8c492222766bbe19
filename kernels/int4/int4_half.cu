// The GPTQ int4 decode kernel for __half activations (one file per dtype: see int4_gemv.cuh).
#include "int4/int4_gemv.cuh"

namespace patcher {

cudaError_t launch_int4_gemv_half(const Int4Params& p, cudaStream_t stream) {
  return launch_int4_gemv_typed<__half>(p, stream);
}

}  // namespace patcher
