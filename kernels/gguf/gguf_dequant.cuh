// The GGUF prefill path's two kernels, templates over the dtype, sharing the GEMV's block parsing (gguf_blocks.cuh);
// included by one .cu file per dtype (gguf_half.cu, gguf_bf16.cu, gguf_float.cu). What they compute: gguf/params.h.
//
// Prefill multiplies many rows by the same weights, so it is a GEMM for cuBLAS: the weights are dequantized into a
// dtype buffer (four threads a 32-value block or sub-block, 8 values each written as 16-byte vectors) and, for W4A8,
// the activations rounded through Q8_1 (four threads a 32-value block, 16-byte loads and stores).
#pragma once
#include "gguf/gguf_aligned.cuh"
#include "gguf/gguf_blocks.cuh"
#include "gguf/gguf_q8_1.cuh"

namespace patcher {
namespace {

constexpr int kDequantThreads = 256;

// Values i .. i + 7 of the T buffer `out` (i a multiple of 8), rounded to T: one 16-byte store, two for fp32. The
// store is indexed from the buffer's start in vectors: through a T* to the values, the compiler wrote them as four
// 4-byte stores.
template <typename T>
__device__ __forceinline__ void store8(void* out, int64_t i, const float (&v)[8]) {
  if constexpr (sizeof(T) == 2) {
    uint32_t words[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const T lo = from_float<T>(v[2 * w]), hi = from_float<T>(v[2 * w + 1]);
      uint16_t l, h;
      memcpy(&l, &lo, 2);
      memcpy(&h, &hi, 2);
      words[w] = static_cast<uint32_t>(l) | (static_cast<uint32_t>(h) << 16);
    }
    static_cast<uint4*>(out)[i / 8] = make_uint4(words[0], words[1], words[2], words[3]);
  } else {
    static_cast<float4*>(out)[i / 4] = make_float4(v[0], v[1], v[2], v[3]);
    static_cast<float4*>(out)[i / 4 + 1] = make_float4(v[4], v[5], v[6], v[7]);
  }
}

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
  weights8<KIND>(scale, off, q, part, w);
  store8<T>(p.out, row * p.k + c * 32 + part * 8, w);
}

// The aligned form (gguf_aligned.cuh; rows_of_aligned_chunks): a warp a chunk of a row (1024 values), its blocks read
// once as whole vectors into the warp's shared stage, then four passes over 8 consecutive 32-value blocks (or
// sub-blocks), four lanes a block, each lane parsing its block from the stage as words and writing 8 of its values:
// a pass's stores cover 256 contiguous values, as a warp's of the kernel above. The general kernel's lanes each read
// their block from global memory in 2-byte halves, four lanes the same bytes. The values are the general kernel's:
// the same scale, offset and integers through weights8.
constexpr int kDequantWarps = 8;

template <typename T, int KIND>
__global__ void __launch_bounds__(kDequantWarps * 32) gguf_dequantize_aligned_kernel(const GgufDequantizeParams p) {
  using Vec = AlignedVec<KIND>;
  __shared__ __align__(16) uint8_t stages[kDequantWarps][kChunkBytes<KIND>];
  constexpr int kPerChunk = kChunkBlocks * 32 / kBlockValues<KIND>;  // blocks (super-blocks) a full chunk
  constexpr int kFullVectors = kChunkBytes<KIND> / kVecBytes<KIND>;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int chunks = static_cast<int>((p.k + kChunkBlocks * 32 - 1) / (kChunkBlocks * 32));  // a row
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kDequantWarps + warp;                   // the warp's chunk
  if (g >= p.n * chunks) return;  // the whole warp (no barrier joins the warps)
  const int64_t row = g / chunks;
  const int c = static_cast<int>(g - row * chunks);
  // The last chunk too is whole vectors: 8k blocks of the 32-value types (K a multiple of 256), 1-3 super-blocks of
  // 144 or 176 bytes, or Q6_K's 4 (K a multiple of 1024).
  const int units = min(kPerChunk, static_cast<int>(p.k / kBlockValues<KIND>) - c * kPerChunk);
  const int vectors = units * kBlockBytes<KIND> / kVecBytes<KIND>;
  const Vec* src = reinterpret_cast<const Vec*>(p.blocks + row * p.row_bytes) + c * kFullVectors;
  Vec* stage = reinterpret_cast<Vec*>(stages[warp]);
#pragma unroll
  for (int j = 0; j < kAlignedVecs<KIND>; ++j) {
    const int i = lane + 32 * j;
    if (i < vectors) stage[i] = __ldcs(src + i);
  }
  __syncwarp();
  const int blocks = units * kBlockValues<KIND> / 32;  // 32-value blocks (sub-blocks) of the chunk
  const int part = lane & 3;
  const int64_t at = row * p.k + static_cast<int64_t>(c) * kChunkBlocks * 32 + part * 8;  // in the output
  for (int b = lane >> 2; b < blocks; b += 8) {
    float scale[2], off;
    int q[8];
    parse_aligned_block<KIND>(stages[warp], b, scale, off, q);
    if constexpr (KIND == kGgufQ4_0) {  // (the nibbles as stored: 0..15)
#pragma unroll
      for (int j = 0; j < 8; ++j) q[j] = static_cast<int>(__vsub4(static_cast<unsigned>(q[j]), 0x08080808u));
    }
    float w[8];
    weights8<KIND>(scale, off, q, part, w);
    store8<T>(p.out, at + b * 32, w);
  }
}

template <typename T, int KIND>
cudaError_t launch_gguf_dequantize_kind(const GgufDequantizeParams& p, cudaStream_t stream) {
  if (rows_of_aligned_chunks<KIND>(p.k, p.blocks)) {
    const int64_t warps = p.n * ((p.k + kChunkBlocks * 32 - 1) / (kChunkBlocks * 32));
    gguf_dequantize_aligned_kernel<T, KIND><<<static_cast<unsigned>((warps + kDequantWarps - 1) / kDequantWarps),
                                              kDequantWarps * 32, 0, stream>>>(p);
    return cudaGetLastError();
  }
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
// a multiple of 32 values, so its stores are always whole vectors. SILU: the values are the gated MLP's activation
// (Q8_1RoundParams::silu_mul_input).
template <typename T, bool VEC, bool SILU>
__global__ void __launch_bounds__(kRoundThreads) round_q8_1_kernel(const Q8_1RoundParams p) {
  const Part8 t = part8(p.rows, p.k, kRoundThreads);
  float v[8];
  load8_input<T, VEC, SILU>(v, p.x, p.x_stride, t.row, t.col, p.k);
  round_q8_1_part(v);
  if (!t.live) return;
  store8<T>(p.out, t.row * p.k + t.col, v);
}

template <typename T>
cudaError_t launch_round_q8_1_typed(const Q8_1RoundParams& p, cudaStream_t stream) {
  const int64_t threads = p.rows * (p.k / 8);
  const unsigned grid = static_cast<unsigned>((threads + kRoundThreads - 1) / kRoundThreads);
  const bool vec = rows_aligned16<T>(p.x, p.x_stride);  // (with the up half k values on: k a multiple of 32)
  if (p.silu_mul_input) {
    if (vec) round_q8_1_kernel<T, true, true><<<grid, kRoundThreads, 0, stream>>>(p);
    else round_q8_1_kernel<T, false, true><<<grid, kRoundThreads, 0, stream>>>(p);
  } else {
    if (vec) round_q8_1_kernel<T, true, false><<<grid, kRoundThreads, 0, stream>>>(p);
    else round_q8_1_kernel<T, false, false><<<grid, kRoundThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace
}  // namespace patcher
