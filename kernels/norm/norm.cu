// Fused residual add + RMSNorm / LayerNorm (one or two affine outputs), one row per block.
//
// Semantics (matching HF, see patcher/ops/norm.py):
//   sum = round(x + delta)                         LLaMA/Qwen2 `residual + hidden_states` in the working dtype
//   sum = round(round(delta2 + delta) + x)         GPT-NeoX parallel residual `mlp + attn + x`
//   RMSNorm:   out = round(weight * round(sum * rsqrt(mean(sum^2) + eps)))      fp32 normalize, cast, scale
//   LayerNorm: out = round((sum - mean) * rstd * weight + bias)                 nn.LayerNorm, fp32 inside
// A dual LayerNorm (GPT-NeoX parallel residual: the input and post-attention norms read the same x) writes two
// outputs from one pass; they share mean and variance, only the affine parameters differ.
//
// Memory traffic is one read of each input row and one write of each output. Where the row is at most one vector a
// thread (hidden <= 8192 in 16-bit dtypes: every decoder's; RESIDENT), each thread keeps its vector of the sum in
// registers from the first pass to the output and loads its norm weights before the grid-dependency wait (constants),
// so that after the wait one round trip to memory (x and the deltas) precedes the output; wider rows are re-read from
// L1/L2 in the statistics and output passes (at most a few tens of KB per block). LayerNorm uses two passes for the
// variance (mean first), as exact as torch's Welford.
#include "common/common.cuh"
#include "gguf/gguf_q8_1.cuh"
#include "norm/params.h"

namespace patcher {
namespace {

// Where the output goes: `out` (and `out2`), or the GGUF GEMV's workspace as Q8_1 blocks or fp32 (gguf_work), or
// `out` rounded through Q8_1 (round_q8_1).
enum NormOutput { kToOut, kToGgufQ8_1, kToGgufF32, kToOutRoundedQ8_1 };

template <typename T, int VEC, bool RMS, int OUTPUT = kToOut, bool RESIDENT = false>
__global__ void __launch_bounds__(1024) norm_kernel(const NormParams p) {
  __shared__ float scratch[32];
  // Only the norm weights (constants) are read before the wait; the next kernel reads only constants before its own.
  griddep_trigger_at_entry();
  const int64_t row = blockIdx.x;
  const int64_t nvec = p.hidden / VEC;
  const T* weight = static_cast<const T*>(p.weight);
  const T* bias = static_cast<const T*>(p.bias);
  const T* weight2 = static_cast<const T*>(p.weight2);
  const T* bias2 = static_cast<const T*>(p.bias2);
  // RESIDENT: the thread's one vector (index threadIdx.x, where it is < nvec): its weights now, its sum in pass 1.
  const bool live = threadIdx.x < nvec;
  Vec<T, VEC> w_res{}, b_res{}, w2_res{}, b2_res{};
  float s_res[VEC];
  if constexpr (RESIDENT) {
    if (live) {
      w_res = vec_or_zero<T, VEC>(weight, threadIdx.x * VEC);
      b_res = vec_or_zero<T, VEC>(bias, threadIdx.x * VEC);
      if (p.out2) {
        w2_res = vec_or_zero<T, VEC>(weight2, threadIdx.x * VEC);
        b2_res = vec_or_zero<T, VEC>(bias2, threadIdx.x * VEC);
      }
    }
  }
  griddep_wait();
  const T* x = static_cast<const T*>(p.x) + row * p.x_stride;
  const T* delta = p.delta ? static_cast<const T*>(p.delta) + row * p.delta_stride : nullptr;
  const T* delta2 = p.delta2 ? static_cast<const T*>(p.delta2) + row * p.delta2_stride : nullptr;
  T* sum = p.sum ? static_cast<T*>(p.sum) + row * p.hidden : nullptr;
  // Later passes re-read the (rounded) sum from where pass 1 put it; each thread reads back only its own writes.
  const T* s_row = delta ? sum : x;

  // Pass 1: the residual sum, written out, and the first statistic.
  float acc = 0.f;
  for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
    float s[VEC];
    load_vec<T, VEC>(s, x + i * VEC);
    if (delta) {
      add_residual<T, VEC>(s, delta + i * VEC, delta2 ? delta2 + i * VEC : nullptr);
      store_vec<T, VEC>(sum + i * VEC, s);
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc += RMS ? s[k] * s[k] : s[k];
    if constexpr (RESIDENT) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) s_res[k] = s[k];
    }
  }
  const float inv_n = 1.f / static_cast<float>(p.hidden);
  acc = block_sum(acc, scratch);

  float2 stats;
  if constexpr (RESIDENT) {
    stats = row_stats_resident<VEC>(s_res, live, acc, inv_n, p.eps, RMS, scratch);
  } else {
    stats = row_stats<T, VEC>(s_row, nvec, acc, inv_n, p.eps, RMS, scratch);
  }
  const float mean = stats.x, rstd = stats.y;

  // Pass 3: the outputs. (To the GGUF workspace: hidden / 8 is a multiple of 32, so each warp's threads all take
  // every iteration, and all reach the quantization's shuffles.)
  T* out = p.out ? static_cast<T*>(p.out) + row * p.hidden : nullptr;
  T* out2 = p.out2 ? static_cast<T*>(p.out2) + row * p.hidden : nullptr;
  for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
    float s[VEC], y[VEC];
    Vec<T, VEC> w = w_res, b = b_res;
    if constexpr (RESIDENT) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) s[k] = s_res[k];
    } else {
      load_vec<T, VEC>(s, s_row + i * VEC);
      w = vec_or_zero<T, VEC>(weight, i * VEC);
      b = vec_or_zero<T, VEC>(bias, i * VEC);
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) y[k] = norm_value<T>(s[k], mean, rstd, w.data[k], b.data[k], RMS);
    if constexpr (OUTPUT == kToOutRoundedQ8_1) {
      static_assert(VEC == 8, "four threads a 32-value block");
#pragma unroll
      for (int k = 0; k < VEC; ++k) y[k] = round_to<T>(y[k]);  // the values `out` would hold
      round_q8_1_part(y);
      store_vec<T, VEC>(out + i * VEC, y);
      continue;
    }
    if constexpr (OUTPUT != kToOut) {
      static_assert(VEC == 8, "four threads a 32-value block");
#pragma unroll
      for (int k = 0; k < VEC; ++k) y[k] = round_to<T>(y[k]);  // the values `out` would hold
      store_gguf_input<OUTPUT == kToGgufQ8_1>(p.gguf_work, p.rows, p.hidden, row, i * VEC, y, true);
      continue;
    }
    store_vec<T, VEC>(out + i * VEC, y);
    if (out2) {
      const Vec<T, VEC> w2 = RESIDENT ? w2_res : vec_or_zero<T, VEC>(weight2, i * VEC);
      const Vec<T, VEC> b2 = RESIDENT ? b2_res : vec_or_zero<T, VEC>(bias2, i * VEC);
#pragma unroll
      for (int k = 0; k < VEC; ++k) y[k] = norm_value<T>(s[k], mean, rstd, w2.data[k], b2.data[k], false);
      store_vec<T, VEC>(out2 + i * VEC, y);
    }
  }
}

template <typename T, int VEC, bool RESIDENT>
cudaError_t launch_typed(const NormParams& p, cudaStream_t stream) {
  const int64_t nvec = p.hidden / VEC;
  const int threads = static_cast<int>(nvec >= 1024 ? 1024 : round_up(nvec, 32));
  const dim3 grid(static_cast<unsigned>(p.rows));
  if constexpr (VEC == 8) {
    if (p.round_q8_1) {
      return launch_pdl(norm_kernel<T, VEC, true, kToOutRoundedQ8_1, RESIDENT>, grid, dim3(threads), 0, stream, p);
    }
    if (p.gguf_work) {
      const auto kernel = p.gguf_a8 ? norm_kernel<T, VEC, true, kToGgufQ8_1, RESIDENT>
                                    : norm_kernel<T, VEC, true, kToGgufF32, RESIDENT>;
      return launch_pdl(kernel, grid, dim3(threads), 0, stream, p);
    }
  }
  if (p.rms) return launch_pdl(norm_kernel<T, VEC, true, kToOut, RESIDENT>, grid, dim3(threads), 0, stream, p);
  return launch_pdl(norm_kernel<T, VEC, false, kToOut, RESIDENT>, grid, dim3(threads), 0, stream, p);
}

// RESIDENT where the row is at most one vector a thread (a block's 1024 threads).
template <typename T, int VEC>
cudaError_t launch_typed(const NormParams& p, cudaStream_t stream) {
  if (p.hidden / VEC <= 1024) return launch_typed<T, VEC, true>(p, stream);
  return launch_typed<T, VEC, false>(p, stream);
}

// 16-byte vectors need every row start 16-byte aligned: base pointers, row strides and the hidden size.
template <typename T>
bool can_vectorize(const NormParams& p) {
  constexpr int vec = 16 / sizeof(T);
  const void* pointers[] = {p.x, p.delta, p.delta2, p.weight, p.bias, p.weight2, p.bias2, p.out, p.out2, p.sum};
  for (const void* ptr : pointers) {
    if (ptr && !aligned16(ptr)) return false;
  }
  return p.hidden % vec == 0 && p.x_stride % vec == 0 && (!p.delta || p.delta_stride % vec == 0) &&
         (!p.delta2 || p.delta2_stride % vec == 0);
}

}  // namespace

cudaError_t launch_norm(const NormParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.hidden == 0) return cudaSuccess;
  if (p.rows > 0x7fffffff) return cudaErrorInvalidConfiguration;
  if (p.gguf_work || p.round_q8_1) {  // (NormParams::gguf_work, round_q8_1)
    if (!p.rms || p.weight2 || p.bias || p.delta2 || p.hidden % 256 || p.dtype == DType::kFloat32 ||
        (reinterpret_cast<uintptr_t>(p.gguf_work) & 15) || (p.gguf_work && p.round_q8_1))
      return cudaErrorInvalidValue;
    PATCHER_DISPATCH_DTYPE(p.dtype, T, {
      if (!can_vectorize<T>(p)) return cudaErrorInvalidValue;
      return launch_typed<T, 16 / sizeof(T)>(p, stream);
    });
  }
  PATCHER_DISPATCH_DTYPE(p.dtype, T, {
    if (can_vectorize<T>(p)) return launch_typed<T, 16 / sizeof(T)>(p, stream);
    return launch_typed<T, 1>(p, stream);
  });
  return cudaSuccess;
}

}  // namespace patcher
