// MLP activations as single elementwise kernels.
//
//   silu_and_mul: out = round(round(silu(gate)) * up)      LLaMA/Qwen2 `act_fn(gate_proj(x)) * up_proj(x)` on the
//                                                          output of one fused gate/up GEMM ([gate | up] per row)
//   bias_gelu:    out = round(gelu(round(x + bias)))       GPT-NeoX `act(dense_h_to_4h(x))` with the GEMM run
//                                                          without its bias; erf GELU or the tanh approximation
// silu and GELU are computed in fp32 with the formulas of torch's CUDA kernels.
#include "common.cuh"

namespace patcher {
namespace {

__device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }

__device__ __forceinline__ float gelu(float x, bool tanh_approx) {
  if (tanh_approx) {
    const float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
    const float x_cube = x * x * x;
    const float inner = kBeta * (x + 0.044715f * x_cube);
    return 0.5f * x * (1.0f + tanhf(inner));
  }
  return x * 0.5f * (1.0f + erff(x * 0.70710678118654752f));
}

// One thread per VEC consecutive outputs of a row; a grid-stride loop over rows * cols / VEC.
template <typename T, int VEC>
__global__ void __launch_bounds__(256) silu_and_mul_kernel(const ActivationParams p) {
  const int64_t per_row = p.cols / VEC;
  const int64_t total = p.rows * per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / per_row, c = (i % per_row) * VEC;
    const T* row = static_cast<const T*>(p.x) + r * p.x_stride;
    float g[VEC], u[VEC], y[VEC];
    load_vec<T, VEC>(g, row + c);
    load_vec<T, VEC>(u, row + p.cols + c);
#pragma unroll
    for (int k = 0; k < VEC; ++k) y[k] = round_to<T>(silu(g[k])) * u[k];
    store_vec<T, VEC>(static_cast<T*>(p.out) + r * p.cols + c, y);
  }
}

template <typename T, int VEC>
__global__ void __launch_bounds__(256) bias_gelu_kernel(const ActivationParams p, bool tanh_approx) {
  const int64_t per_row = p.cols / VEC;
  const int64_t total = p.rows * per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / per_row, c = (i % per_row) * VEC;
    float x[VEC], b[VEC] = {}, y[VEC];
    load_vec<T, VEC>(x, static_cast<const T*>(p.x) + r * p.x_stride + c);
    if (p.bias) load_vec<T, VEC>(b, static_cast<const T*>(p.bias) + c);
#pragma unroll
    for (int k = 0; k < VEC; ++k) y[k] = gelu(p.bias ? round_to<T>(x[k] + b[k]) : x[k], tanh_approx);
    store_vec<T, VEC>(static_cast<T*>(p.out) + r * p.cols + c, y);
  }
}

int grid_for(int64_t items) {
  const int64_t blocks = (items + 255) / 256;
  return static_cast<int>(blocks < 65536 ? blocks : 65536);
}

template <typename T>
bool can_vectorize(const ActivationParams& p) {
  constexpr int vec = 16 / sizeof(T);
  return p.cols % vec == 0 && p.x_stride % vec == 0 && aligned16(p.x) && aligned16(p.out) &&
         (!p.bias || aligned16(p.bias));
}

}  // namespace

cudaError_t launch_silu_and_mul(const ActivationParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return cudaSuccess;
  PATCHER_DISPATCH_DTYPE(p.dtype, T, {
    constexpr int vec = 16 / sizeof(T);
    if (can_vectorize<T>(p)) {
      silu_and_mul_kernel<T, vec><<<grid_for(p.rows * p.cols / vec), 256, 0, stream>>>(p);
    } else {
      silu_and_mul_kernel<T, 1><<<grid_for(p.rows * p.cols), 256, 0, stream>>>(p);
    }
  });
  return cudaGetLastError();
}

cudaError_t launch_bias_gelu(const ActivationParams& p, bool tanh, cudaStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return cudaSuccess;
  PATCHER_DISPATCH_DTYPE(p.dtype, T, {
    constexpr int vec = 16 / sizeof(T);
    if (can_vectorize<T>(p)) {
      bias_gelu_kernel<T, vec><<<grid_for(p.rows * p.cols / vec), 256, 0, stream>>>(p, tanh);
    } else {
      bias_gelu_kernel<T, 1><<<grid_for(p.rows * p.cols), 256, 0, stream>>>(p, tanh);
    }
  });
  return cudaGetLastError();
}

}  // namespace patcher
