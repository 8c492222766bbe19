// MLP activations as single elementwise kernels.
//
//   silu_and_mul: out = round(round(silu(gate)) * up)      LLaMA/Qwen2 `act_fn(gate_proj(x)) * up_proj(x)` on the
//                                                          output of one fused gate/up GEMM ([gate | up] per row)
//   bias_gelu:    out = round(gelu(round(x + bias)))       GPT-NeoX `act(dense_h_to_4h(x))` with the GEMM run
//                                                          without its bias; erf GELU or the tanh approximation
// Grid: y over rows, x over 16-byte column vectors, so no thread divides 64-bit indices.
#include "activation/params.h"
#include "common/common.cuh"

namespace patcher {
namespace {

template <typename T, int VEC>
__global__ void __launch_bounds__(256) silu_and_mul_kernel(const ActivationParams p) {
  griddep_trigger_at_entry();  // the next kernel reads only constants before its wait
  griddep_wait();
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
  if (c >= p.cols) return;
  for (int64_t r = blockIdx.y; r < p.rows; r += gridDim.y) {
    const T* row = static_cast<const T*>(p.x) + r * p.x_stride;
    float g[VEC], u[VEC], y[VEC];
    load_vec<T, VEC>(g, row + c);
    load_vec<T, VEC>(u, row + p.cols + c);
#pragma unroll
    for (int k = 0; k < VEC; ++k) y[k] = round_to<T>(silu(g[k])) * u[k];
    store_vec<T, VEC>(static_cast<T*>(p.out) + r * p.cols + c, y);
  }
}

// The GELU form is a template parameter: with a runtime flag the compiler keeps both erf and tanh code in the loop,
// and this kernel is bound by instruction issue, not memory. Without a bias, b stays 0 and round(x + 0) == x.
template <typename T, int VEC, bool TANH>
__global__ void __launch_bounds__(256) bias_gelu_kernel(const ActivationParams p) {
  griddep_trigger_at_entry();  // the next kernel reads only constants before its wait
  griddep_wait();
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
  if (c >= p.cols) return;
  float b[VEC] = {};
  if (p.bias) load_vec<T, VEC>(b, static_cast<const T*>(p.bias) + c);
  for (int64_t r = blockIdx.y; r < p.rows; r += gridDim.y) {
    float x[VEC], y[VEC];
    load_vec<T, VEC>(x, static_cast<const T*>(p.x) + r * p.x_stride + c);
#pragma unroll
    for (int k = 0; k < VEC; ++k) y[k] = gelu(round_to<T>(x[k] + b[k]), TANH);
    store_vec<T, VEC>(static_cast<T*>(p.out) + r * p.cols + c, y);
  }
}

dim3 grid_for(const ActivationParams& p, int vec) {
  const int64_t col_blocks = (p.cols / vec + 255) / 256;
  return dim3(static_cast<unsigned>(col_blocks), static_cast<unsigned>(p.rows < 65535 ? p.rows : 65535));
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
    if (can_vectorize<T>(p)) return launch_pdl(silu_and_mul_kernel<T, vec>, grid_for(p, vec), dim3(256), 0, stream, p);
    return launch_pdl(silu_and_mul_kernel<T, 1>, grid_for(p, 1), dim3(256), 0, stream, p);
  });
  return cudaSuccess;
}

template <typename T, bool TANH>
cudaError_t launch_bias_gelu_as(const ActivationParams& p, cudaStream_t stream) {
  constexpr int vec = 16 / sizeof(T);
  if (can_vectorize<T>(p)) return launch_pdl(bias_gelu_kernel<T, vec, TANH>, grid_for(p, vec), dim3(256), 0, stream, p);
  return launch_pdl(bias_gelu_kernel<T, 1, TANH>, grid_for(p, 1), dim3(256), 0, stream, p);
}

cudaError_t launch_bias_gelu(const ActivationParams& p, bool tanh, cudaStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return cudaSuccess;
  PATCHER_DISPATCH_DTYPE(p.dtype, T, {
    return tanh ? launch_bias_gelu_as<T, true>(p, stream) : launch_bias_gelu_as<T, false>(p, stream);
  });
  return cudaSuccess;
}

}  // namespace patcher
