// The C++ interface between the torch glue (torch_bindings.cpp) and the kernels (*.cu).
//
// Plain structs of pointers, sizes and strides, one launcher per op family. Nothing here includes torch, so the
// .cu files compile fast and can be built and checked without it. Strides are in elements. Every launcher
// returns the CUDA error of its launch (cudaSuccess when nothing had to be launched).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace patcher {

enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// RMSNorm and LayerNorm, optionally with the residual add fused in front and a second affine (dual LayerNorm).
//   sum  = x + delta                 (one delta)     or   (delta2 + delta) + x    (GPT-NeoX parallel residual)
//   out  = norm(sum) * weight (+ bias), out2 = norm(sum) * weight2 + bias2 (same mean and variance)
struct NormParams {
  DType dtype;
  int64_t rows, hidden;
  const void* x;  // [rows, hidden], row stride x_stride
  int64_t x_stride;
  const void* delta;  // nullptr: no residual add
  int64_t delta_stride;
  const void* delta2;  // nullptr: at most one delta
  int64_t delta2_stride;
  const void* weight;   // [hidden]
  const void* bias;     // [hidden] or nullptr
  const void* weight2;  // [hidden] or nullptr (no second output)
  const void* bias2;    // [hidden] or nullptr
  void* out;            // [rows, hidden] contiguous
  void* out2;           // [rows, hidden] contiguous, or nullptr
  void* sum;            // [rows, hidden] contiguous; required when delta is set, else nullptr
  float eps;
  bool rms;
};
cudaError_t launch_norm(const NormParams& p, cudaStream_t stream);

// Fused QKV projection output -> q, k, v in head layout with RoPE (NeoX half rotation) on the first rotary_dim
// dims of q and k. Source layout per token: [q heads | k heads | v heads], or with `interleaved`
// [head][q | k | v] (GPT-NeoX query_key_value, which has as many kv heads as q heads).
struct RopeQkvParams {
  DType dtype;
  int64_t batch, tokens;
  const void* qkv;  // [batch, tokens, (Hq + 2 Hkv) * D], last dim contiguous
  int64_t qkv_stride_b, qkv_stride_t;
  const void* cos;  // [batch or 1, tokens, rotary_dim], last dim contiguous; stride_b 0 broadcasts
  int64_t cos_stride_b, cos_stride_t;
  const void* sin;
  int64_t sin_stride_b, sin_stride_t;
  int64_t rotary_dim;
  int64_t num_q_heads, num_kv_heads, head_dim;
  bool interleaved;
  void* q;  // [batch, Hq, tokens, D] contiguous
  void* k;  // [batch, Hkv, tokens, D] contiguous
  void* v;  // [batch, Hkv, tokens, D] contiguous
};
cudaError_t launch_rope_qkv(const RopeQkvParams& p, cudaStream_t stream);

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
