// Elementwise MLP activations: parameters and launchers (activation.cu).
//
// Plain structs of pointers, sizes and strides for the torch glue (kernels/bindings.cpp) and the kernels: nothing
// here includes torch. Strides are in elements. Every launcher returns the CUDA error of its launch (cudaSuccess when
// nothing had to be launched).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/types.h"

namespace patcher {

// Elementwise MLP activations.
//   silu_and_mul: out[r, c] = silu(x[r, c]) * x[r, cols + c]     x [rows, 2 cols]
//   bias_gelu:    out[r, c] = gelu(x[r, c] + bias[c])            x [rows, cols]
struct ActivationParams {
  DType dtype;
  int64_t rows, cols;  // of the output
  const void* x;
  int64_t x_stride;  // row stride of x
  const void* bias;  // bias_gelu: [cols] or nullptr
  void* out;         // [rows, cols] contiguous
};
cudaError_t launch_silu_and_mul(const ActivationParams& p, cudaStream_t stream);
cudaError_t launch_bias_gelu(const ActivationParams& p, bool tanh, cudaStream_t stream);

}  // namespace patcher
