// The int4 decode-step kernel for __nv_bfloat16 activations (one file per dtype: see step_half.cu).
#include "step.cuh"

namespace patcher {

cudaError_t launch_step_bf16(const StepPlan& plan, cudaStream_t stream) {
  return launch_step_typed<__nv_bfloat16>(plan, stream);
}

}  // namespace patcher
