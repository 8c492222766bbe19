// The decode GEMV for float inputs (one file per dtype: see gemv.cuh).
#include "gemv/gemv.cuh"

namespace patcher {

cudaError_t launch_gemv_float(const GemvParams& p, cudaStream_t stream) { return launch_gemv_typed<float>(p, stream); }

}  // namespace patcher
