// The int4 decode-step kernel for __half activations (one file per dtype: the kernel is large, so the two build
// in parallel; see step.cuh).
#include "step.cuh"

namespace patcher {

cudaError_t launch_step_half(const StepPlan& plan, cudaStream_t stream) {
  return launch_step_typed<__half>(plan, stream);
}

}  // namespace patcher
