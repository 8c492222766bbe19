// The GGUF prefill path's two kernels, templates over the dtype, sharing the GEMV's block parsing (gguf_blocks.cuh);
// included by one .cu file per dtype (gguf_half.cu, gguf_bf16.cu, gguf_float.cu). What they compute: gguf/params.h.
//
// Prefill multiplies many rows by the same weights, so it is a GEMM for cuBLAS: the weights are dequantized into a
// dtype buffer (four threads a 32-value block or sub-block, 8 values each written as 16-byte vectors) and, for W4A8,
// the activations rounded through Q8_1 (four threads a 32-value block, 16-byte loads and stores).
#pragma once
#include "gguf/gguf_blocks.cuh"

namespace patcher {
namespace {

constexpr int kDequantThreads = 256;

// One thread 8 values, four threads a 32-value block or sub-block: each of the four parses the block (its bytes
// come once from memory, then from L1) and writes its 8 values, so a warp's stores cover 128 contiguous values.
template <typename T, int KIND>
__global__ void __launch_bounds__(kDequantThreads) gguf_dequantize_kernel(const GgufDequantizeParams p) {
  const int64_t per_row = p.k / 8;  // 8-value parts a row
  const int64_t unit = static_cast<int64_t>(blockIdx.x) * kDequantThreads + threadIdx.x;
  if (unit >= p.n * per_row) return;
  const int64_t row = unit / per_row, c = (unit % per_row) / 4;  // c: the 32-value block
  const int part = static_cast<int>(unit % 4);
  // Block c is lane c % 32 of chunk c / 32 (gguf_blocks.cuh).
  const uint8_t* chunk = p.blocks + row * p.row_bytes + (c / kChunkBlocks) * kChunkBytes<KIND>;
  float scale[2], off;
  int q[8];
  parse_lane<KIND>(chunk, static_cast<int>(c % kChunkBlocks), scale, off, q);
  float w[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) w[e] = weight_at<KIND>(scale, off, q, part * 8 + e);
  T* out = static_cast<T*>(p.out) + row * p.k + c * 32 + part * 8;  // 16-byte aligned (32 for fp32)
  if constexpr (sizeof(T) == 2) {
    store_vec<T, 8>(out, w);
  } else {
    float lo[4], hi[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) lo[e] = w[e], hi[e] = w[4 + e];
    store_vec<T, 4>(out, lo);
    store_vec<T, 4>(out + 4, hi);
  }
}

template <typename T, int KIND>
cudaError_t launch_gguf_dequantize_kind(const GgufDequantizeParams& p, cudaStream_t stream) {
  const int64_t units = p.n * (p.k / 8);
  gguf_dequantize_kernel<T, KIND>
      <<<static_cast<unsigned>((units + kDequantThreads - 1) / kDequantThreads), kDequantThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

// The dtype's dequantize launcher over every kind, which gguf_<dtype>.cu instantiates.
template <typename T>
cudaError_t launch_gguf_dequantize_typed(const GgufDequantizeParams& p, cudaStream_t stream) {
  switch (p.kind) {
    case kGgufQ4_0:
      return launch_gguf_dequantize_kind<T, kGgufQ4_0>(p, stream);
    case kGgufQ4_1:
      return launch_gguf_dequantize_kind<T, kGgufQ4_1>(p, stream);
    case kGgufQ8_0:
      return launch_gguf_dequantize_kind<T, kGgufQ8_0>(p, stream);
    case kGgufQ4_K:
      return launch_gguf_dequantize_kind<T, kGgufQ4_K>(p, stream);
    case kGgufQ5_K:
      return launch_gguf_dequantize_kind<T, kGgufQ5_K>(p, stream);
    case kGgufQ6_K:
      return launch_gguf_dequantize_kind<T, kGgufQ6_K>(p, stream);
  }
  return cudaErrorInvalidValue;
}

constexpr int kRoundThreads = 256;

// 8 consecutive values a thread, 4 threads a 32-value block (max |x| over the 4 by two shuffles); every thread of a
// warp reaches the shuffles (a thread past the end works on a clamped copy and stores nothing). VEC: x's rows start
// 16-byte aligned, so a thread's 8 values load as one or two 16-byte vectors; otherwise one value at a time. The
// output is contiguous with rows of a multiple of 32 values, so its stores are always whole vectors.
template <typename T, bool VEC>
__global__ void __launch_bounds__(kRoundThreads) round_q8_1_kernel(const Q8_1RoundParams p) {
  const int64_t per_row = p.k / 8;
  const int64_t total = p.rows * per_row;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kRoundThreads + threadIdx.x;
  const bool live = g < total;
  const int64_t at = live ? g : total - 1;
  const int64_t row = at / per_row, col = (at % per_row) * 8;
  const T* src = static_cast<const T*>(p.x) + row * p.x_stride + col;
  float v[8];
  if constexpr (VEC && sizeof(T) == 2) {
    load_vec<T, 8>(v, src);
  } else if constexpr (VEC) {
    float lo[4], hi[4];
    load_vec<T, 4>(lo, src);
    load_vec<T, 4>(hi, src + 4);
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = lo[i], v[4 + i] = hi[i];
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = to_float(src[i]);
  }
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  // As stage_x (gguf_gemv.cuh) and reference.quantize_q8_1: d = max|x| / 127, q = roundf(x * (1 / d)).
  const float d = __fdiv_rn(amax, 127.f);
  const float inv = d == 0.f ? 0.f : __frcp_rn(d);
  const float stored = __half2float(__float2half_rn(d));
  float y[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) y[i] = __fmul_rn(roundf(__fmul_rn(v[i], inv)), stored);
  if (!live) return;
  T* dst = static_cast<T*>(p.out) + row * p.k + col;
  if constexpr (sizeof(T) == 2) {
    store_vec<T, 8>(dst, y);
  } else {
    float lo[4], hi[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) lo[i] = y[i], hi[i] = y[4 + i];
    store_vec<T, 4>(dst, lo);
    store_vec<T, 4>(dst + 4, hi);
  }
}

template <typename T>
cudaError_t launch_round_q8_1_typed(const Q8_1RoundParams& p, cudaStream_t stream) {
  const int64_t threads = p.rows * (p.k / 8);
  const unsigned grid = static_cast<unsigned>((threads + kRoundThreads - 1) / kRoundThreads);
  const bool vec = (reinterpret_cast<uintptr_t>(p.x) & 15) == 0 && (p.x_stride * sizeof(T)) % 16 == 0;
  if (vec) {
    round_q8_1_kernel<T, true><<<grid, kRoundThreads, 0, stream>>>(p);
  } else {
    round_q8_1_kernel<T, false><<<grid, kRoundThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace
}  // namespace patcher
