// The GGUF prefill path's two kernels, templates over the dtype, sharing the GEMV's block parsing (gguf_blocks.cuh);
// included by one .cu file per dtype (gguf_half.cu, gguf_bf16.cu, gguf_float.cu). What they compute: gguf/params.h.
//
// Prefill multiplies many rows by the same weights, so it is a GEMM for cuBLAS: the weights are dequantized into a
// dtype buffer (four threads a 32-value block or sub-block, 8 values each written as 16-byte vectors) and, for W4A8,
// the activations rounded through Q8_1 (four threads a 32-value block, 16-byte loads and stores).
#pragma once
#include "gguf/gguf_blocks.cuh"
#include "gguf/gguf_q8_1.cuh"

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
  return with_kind(p.kind, [&](auto kind) { return launch_gguf_dequantize_kind<T, kind.value>(p, stream); });
}

constexpr int kRoundThreads = 256;

// 8 consecutive values a thread, 4 threads a 32-value block (gguf_q8_1.cuh); every thread of a warp reaches the
// shuffles (a thread past the end works on a clamped copy and stores nothing). The output is contiguous with rows of
// a multiple of 32 values, so its stores are always whole vectors.
template <typename T, bool VEC>
__global__ void __launch_bounds__(kRoundThreads) round_q8_1_kernel(const Q8_1RoundParams p) {
  const Part8 t = part8(p.rows, p.k, kRoundThreads);
  float v[8];
  load8<T, VEC>(v, p.x, p.x_stride, t.row, t.col);
  int q[8];
  const float d = quantize_q8_1_part(v, q);
  float y[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) y[i] = __fmul_rn(static_cast<float>(q[i]), d);  // exact: |q| <= 127, d an fp16 value
  if (!t.live) return;
  T* dst = static_cast<T*>(p.out) + t.row * p.k + t.col;
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
  if (rows_aligned16<T>(p.x, p.x_stride)) {
    round_q8_1_kernel<T, true><<<grid, kRoundThreads, 0, stream>>>(p);
  } else {
    round_q8_1_kernel<T, false><<<grid, kRoundThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace
}  // namespace patcher
