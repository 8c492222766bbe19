// The decode GEMV for __half inputs (one file per dtype: see gemv.cuh).
#include "gemv/gemv.cuh"

namespace patcher {

cudaError_t launch_gemv_half(const GemvParams& p, cudaStream_t stream) { return launch_gemv_typed<__half>(p, stream); }

}  // namespace patcher
