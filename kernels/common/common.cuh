// Shared device helpers: dtype conversions with explicit cast points, 16-byte vector access, reductions, and the
// one dispatch macro that turns a runtime dtype into a template parameter.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "common/types.h"

namespace patcher {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// The value a torch op whose output dtype is T would have stored: round to T, read back as float. This is how
// the kernels mirror HF's cast points (a residual add in fp16 rounds before the norm reads it, and so on).
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return to_float(from_float<T>(v));
}

// N elements moved with one load or store instruction (16 bytes for 8 halves or 4 floats).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T data[N];
};

template <typename T, int N>
__device__ __forceinline__ void load_vec(float (&dst)[N], const T* src) {
  const Vec<T, N> v = *reinterpret_cast<const Vec<T, N>*>(src);
#pragma unroll
  for (int i = 0; i < N; ++i) dst[i] = to_float(v.data[i]);
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* dst, const float (&src)[N]) {
  Vec<T, N> v;
#pragma unroll
  for (int i = 0; i < N; ++i) v.data[i] = from_float<T>(src[i]);
  *reinterpret_cast<Vec<T, N>*>(dst) = v;
}

// N elements of an optional parameter vector (a norm's bias) at offset i, zeros when it is absent.
template <typename T, int N>
__device__ __forceinline__ Vec<T, N> vec_or_zero(const T* src, int64_t i) {
  if (src) return *reinterpret_cast<const Vec<T, N>*>(src + i);
  Vec<T, N> v;
#pragma unroll
  for (int k = 0; k < N; ++k) v.data[k] = from_float<T>(0.f);
  return v;
}

// The fixed-point accumulators of int4_gemv_acc (Int4Params::acc; read by the int4 norm prologue and by decode
// attention): value * 2^28 in int64. Each block's fp32 sum is clamped to +-2^24 first, so up to 2^11 - 1 blocks add up
// without overflow (int4_gemv_acc checks the K slices); every fp32 value of magnitude 2^-5 or more converts exactly
// (its last mantissa bit is 2^-28 or coarser), so the sum is exact but for smaller terms' last bits and is rounded
// once, when read (from_fixed). The clamp only matters past +-2^24: fp16 outputs overflow at 65504 before it; a bf16
// output beyond it saturates there. A NaN sum comes out as -2^24. The reference mirrors both (patcher/ops/int4_ops.py:
// to_fixed, from_fixed).
constexpr float kFixedScale = 268435456.f;  // 2^28
constexpr float kFixedClamp = 16777216.f;   // 2^24

__device__ __forceinline__ long long to_fixed(float v) {
  return __float2ll_rn(fminf(fmaxf(v, -kFixedClamp), kFixedClamp) * kFixedScale);
}

__device__ __forceinline__ float from_fixed(long long a) { return __ll2float_rn(a) * (1.f / kFixedScale); }

// The residual sum of one vector of the stream, in place: s = x + delta, or (delta2 + delta) + x (GPT-NeoX's
// parallel residual), each add rounded to T as HF's adds round; from vectors already loaded (d2 read only where
// has_d2). Shared by launch_norm and the GEMV and int4 norm prologues.
template <typename T, int N>
__device__ __forceinline__ void add_residual(float (&s)[N], const Vec<T, N>& d, const Vec<T, N>& d2, bool has_d2) {
  if (has_d2) {
#pragma unroll
    for (int e = 0; e < N; ++e) s[e] = round_to<T>(round_to<T>(to_float(d2.data[e]) + to_float(d.data[e])) + s[e]);
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) s[e] = round_to<T>(s[e] + to_float(d.data[e]));
  }
}

// The same, loading delta and delta2 (which may be nullptr).
template <typename T, int N>
__device__ __forceinline__ void add_residual(float (&s)[N], const T* delta, const T* delta2) {
  add_residual<T, N>(s, *reinterpret_cast<const Vec<T, N>*>(delta), vec_or_zero<T, N>(delta2, 0), delta2 != nullptr);
}

// One element of a norm's output before its final rounding to T, as HF computes it (shared by launch_norm and the
// GEMV prologues): RMSNorm  weight * round(s * rstd)  (LlamaRMSNorm casts the normalized value, then scales);
// LayerNorm  (s - mean) * rstd * weight + bias  in fp32 (nn.LayerNorm).
template <typename T>
__device__ __forceinline__ float norm_value(float s, float mean, float rstd, T weight, T bias, bool rms) {
  if (rms) return to_float(weight) * round_to<T>(s * rstd);
  return (s - mean) * rstd * to_float(weight) + to_float(bias);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum over the whole block, returned to every thread. `scratch` holds 32 floats; blockDim.x is a multiple of 32.
// Safe to call repeatedly with the same scratch: the first barrier waits for readers of the previous call.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x >> 5) ? scratch[lane] : 0.f;
  return warp_sum(v);
}

// Mean and 1/std of a norm's row, from the block's first-pass sum `acc` (of squares for RMSNorm, of values for
// LayerNorm, already block-summed). LayerNorm's variance is a second pass over the row as staged at `row` (nvec
// vectors of N, each thread reading back its own: mean first, as exact as torch's Welford). Shared by launch_norm
// and the GEMV prologue.
template <typename T, int N>
__device__ __forceinline__ float2 row_stats(const T* row, int64_t nvec, float acc, float inv_n, float eps, bool rms,
                                            float* scratch) {
  if (rms) return make_float2(0.f, rsqrtf(acc * inv_n + eps));
  const float mean = acc * inv_n;
  float m2 = 0.f;
  for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
    float s[N];
    load_vec<T, N>(s, row + i * N);
#pragma unroll
    for (int k = 0; k < N; ++k) m2 += (s[k] - mean) * (s[k] - mean);
  }
  return make_float2(mean, rsqrtf(block_sum(m2, scratch) * inv_n + eps));
}

// row_stats where each thread holds its one vector of the row (s; none where !live) in registers: LayerNorm's
// variance pass reads them there, in the same order.
template <int N>
__device__ __forceinline__ float2 row_stats_resident(const float (&s)[N], bool live, float acc, float inv_n, float eps,
                                                     bool rms, float* scratch) {
  if (rms) return make_float2(0.f, rsqrtf(acc * inv_n + eps));
  const float mean = acc * inv_n;
  float m2 = 0.f;
  if (live) {
#pragma unroll
    for (int k = 0; k < N; ++k) m2 += (s[k] - mean) * (s[k] - mean);
  }
  return make_float2(mean, rsqrtf(block_sum(m2, scratch) * inv_n + eps));
}

// Activations in fp32, with the formulas of torch's CUDA kernels (so that, rounded to the dtype, they agree).
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

// Programmatic dependent launch (Hopper): a kernel launched with launch_pdl may start while the previous kernel
// in the stream is still finishing. It must call griddep_wait() before it reads anything an earlier kernel wrote
// or writes anything at all; only reads of constant data (weights) may come before. griddep_wait() returns once
// every earlier kernel of the stream has completed and its writes are visible. griddep_launch_dependents() lets
// the next kernel start launching now. Both are no-ops before sm_90.
//
// Look-ahead. Most kernels trigger at entry (griddep_trigger_at_entry), so the next kernel's blocks start and
// issue their weight loads while this one still waits; the kernel after that may start in turn, so any number of
// kernels may be in their pre-wait part at once, beside any earlier kernel that has not completed. Hence the
// rule: a pre-wait read may only touch data that no kernel of the stream writes (weights, norm parameters, RoPE
// tables). The one exception is decode_attention, which reads the cache position and earlier keys before its
// wait; the op just before it (the one that writes the current token's K/V or the sums it finishes) triggers after
// its wait (griddep_trigger_after_wait with feeds_attention), so the attention starts only once every kernel
// before that op has completed (docs/decode-fp16.md, "Where each kernel triggers").
__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void griddep_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// At kernel entry, before griddep_wait(): lets the next kernel launch now, so that its pre-wait part (constant
// loads only) overlaps this kernel. feeds_attention: the kernel is the op right before a decode attention, and
// triggers after its wait instead (griddep_trigger_after_wait). A kernel that may feed an attention calls both,
// at the two places, with the same feeds_attention; one that never does calls only this one.
__device__ __forceinline__ void griddep_trigger_at_entry(bool feeds_attention = false) {
  if (!feeds_attention) griddep_launch_dependents();
}

// After griddep_wait(). feeds_attention: the kernel is the op right before a decode attention, which reads the
// cache position and earlier keys before its own wait; triggering here keeps that attention from starting before
// every kernel ahead of this one (the previous step's next_token included) has completed. Must be uniform over
// the grid (a kernel parameter), like every trigger placement here.
__device__ __forceinline__ void griddep_trigger_after_wait(bool feeds_attention = false) {
  if (feeds_attention) griddep_launch_dependents();
}

// Whether the current GPU is a Hopper or newer (programmatic dependent launch).
inline bool hopper_or_newer() {
  int device = 0, major = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  return major >= 9;
}

// Asynchronous copies global -> shared (sm_80+): 16 bytes bypassing L1, or 4 / 8 bytes (`bytes`, through L1); the
// copies a thread issued complete at cp_async_wait_all, or for the ones before a cp_async_commit, at its wait.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem));
}

__device__ __forceinline__ void cp_async_small(void* smem, const void* gmem, int bytes) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if (bytes == 8) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(dst), "l"(gmem) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(gmem) : "memory");
  }
}

// Brings `bytes` at `gmem` (16-byte aligned, a multiple of 16) into L2 without waiting for them: one bulk prefetch on
// Hopper, one line prefetch per 128 bytes before.
__device__ __forceinline__ void prefetch_l2(const void* gmem, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(gmem), "r"(bytes) : "memory");
#else
  for (uint32_t at = 0; at < bytes; at += 128)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(static_cast<const char*>(gmem) + at) : "memory");
#endif
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Waits until at most N of the thread's committed groups are still in flight (groups complete in commit order).
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Whether launch_pdl may use programmatic dependent launch: true unless the host turned it off (patcher_set_pdl,
// called once by the Python loader, which reads PATCHER_DISABLE_PDL). Defined in pdl.cu.
bool pdl_enabled();

// Launches `kernel` with programmatic stream serialization on GPUs that have it (sm_90+), unless pdl_enabled() is
// false, else plainly.
template <typename... KernelArgs, typename... Args>
cudaError_t launch_pdl(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                       Args&&... args) {
  static const bool supported = hopper_or_newer();
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = supported && pdl_enabled() ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

__host__ __device__ inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

inline int round_up(int64_t n, int64_t multiple) { return static_cast<int>((n + multiple - 1) / multiple * multiple); }

}  // namespace patcher

// Runs the statement list with `T` bound to the element type of `dtype` (float, __half, __nv_bfloat16).
#define PATCHER_DISPATCH_DTYPE(dtype, T, ...) \
  switch (dtype) {                            \
    case ::patcher::DType::kFloat32: {        \
      using T = float;                        \
      __VA_ARGS__;                            \
    } break;                                  \
    case ::patcher::DType::kFloat16: {        \
      using T = __half;                       \
      __VA_ARGS__;                            \
    } break;                                  \
    case ::patcher::DType::kBFloat16: {       \
      using T = __nv_bfloat16;                \
      __VA_ARGS__;                            \
    } break;                                  \
    default:                                  \
      return cudaErrorInvalidValue;           \
  }
