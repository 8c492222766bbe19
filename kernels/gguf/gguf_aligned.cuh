// A row's GGUF blocks read as whole vectors: where every chunk of a row (kChunkBlocks * 32 values, gguf_blocks.cuh)
// starts aligned to the vectors it is read in, a chunk is those vectors at a fixed stride, and a block is parsed from
// a copy of the chunk in shared memory as the 4-byte words that cover it (shifted into place by a funnel shift where
// it starts 2 bytes into a word) rather than as 2-byte halves. That holds for the 32-value types (Q4_0, Q4_1, Q8_0:
// blocks of 18, 20 or 34 bytes) with K a multiple of 256 (8k blocks are whole 16-byte vectors), Q4_K and Q5_K (144
// and 176-byte super-blocks), and Q6_K with K a multiple of 1024 (4 super-blocks are 840 bytes: whole 8-byte
// vectors), the rows' blocks aligned to those vectors: every real model's projections. Shared by the decode GEMV
// (gguf_gemv_aligned.cuh) and the prefill dequantization (gguf_dequant.cuh).
#pragma once
#include <type_traits>

#include "gguf/gguf_blocks.cuh"

namespace patcher {
namespace {

// The global vectors a chunk is read in: 16 bytes, but 8 for Q6_K, whose chunk of 4 super-blocks is 840 bytes (a
// row of whole chunks starts every chunk 8-byte aligned).
template <int KIND>
using AlignedVec = std::conditional_t<KIND == kGgufQ6_K, uint2, uint4>;
template <int KIND>
constexpr int kVecBytes = static_cast<int>(sizeof(AlignedVec<KIND>));
// 4-byte words of the stage that cover a lane's block: its 18, 20 or 34 bytes from an offset of 0 or 2 mod 4.
template <int KIND>
constexpr int kLaneWords = KIND == kGgufQ8_0 ? 9 : 5;
// Vectors of a full chunk a lane loads (the chunk's vectors spread over the lanes).
template <int KIND>
constexpr int kAlignedVecs = (kChunkBytes<KIND> / kVecBytes<KIND> + 31) / 32;

template <int KIND>
struct AlignedChunk {
  AlignedVec<KIND> v[kAlignedVecs<KIND>];
};

// Block `b` of the chunk in `stage` (16-byte aligned): d, Q4_1's m, and the 32 integers as 8 words of 4 bytes
// (Q4_0's nibbles as stored, 0..15; Q4_1's likewise; Q8_0's int8).
template <int KIND>
__device__ __forceinline__ void parse_aligned(const uint8_t* stage, int b, float& d, float& m, int (&q)[8]) {
  const int at = b * kBlockBytes<KIND>;
  const uint32_t* src = reinterpret_cast<const uint32_t*>(stage + (at & ~3));
  const unsigned shift = 8u * static_cast<unsigned>(at & 3);  // 0 or 16: every block size is even
  uint32_t w[kLaneWords<KIND>];
#pragma unroll
  for (int i = 0; i < kLaneWords<KIND>; ++i) w[i] = src[i];
  const uint32_t head = __funnelshift_rc(w[0], w[1], shift);  // the block's first 4 bytes
  d = __half2float(__ushort_as_half(static_cast<unsigned short>(head & 0xFFFFu)));
  m = KIND == kGgufQ4_1 ? __half2float(__ushort_as_half(static_cast<unsigned short>(head >> 16))) : 0.f;
  // The integers start 2 bytes in (4 for Q4_1): word j is bytes 4j .. 4j + 3 of them, which a funnel shift by
  // `shift` plus that start takes from w[j] and w[j + 1] (a shift of 32 gives w[j + 1] itself).
  constexpr unsigned kStart = KIND == kGgufQ4_1 ? 32u : 16u;
  if constexpr (KIND == kGgufQ8_0) {
#pragma unroll
    for (int j = 0; j < 8; ++j) q[j] = static_cast<int>(__funnelshift_rc(w[j], w[j + 1], shift + kStart));
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t v = __funnelshift_rc(w[j], w[j + 1], shift + kStart);
      q[j] = static_cast<int>(v & 0x0F0F0F0Fu);             // elements 4j .. 4j + 3
      q[4 + j] = static_cast<int>((v >> 4) & 0x0F0F0F0Fu);  // elements 16 + 4j .. 16 + 4j + 3
    }
  }
}

// Block (sub-block) b of the chunk in `stage` as the aligned kernels take it: the 32 integers (Q4_0's nibbles as
// stored; Q6_K's too with STORED) and, as parse_lane gives them, scale[2] (one value twice but for Q6_K's 16-value
// halves) and the offset (the K-quants' -(dmin * mn[j]), Q4_1's m).
template <int KIND, bool STORED = false>
__device__ __forceinline__ void parse_aligned_block(const uint8_t* stage, int b, float (&scale)[2], float& off,
                                                    int (&q)[8]) {
  if constexpr (kKQuant<KIND>) {
    float dm;
    parse_sub_block<KIND, true, STORED>(stage + (b >> 3) * kBlockBytes<KIND>, b & 7, scale, dm, q);
    off = -dm;
  } else {
    parse_aligned<KIND>(stage, b, scale[0], off, q);
    scale[1] = scale[0];
  }
}

// Whether rows of K values whose blocks start at `blocks` are whole chunks of aligned vectors (above). K < 2^30 keeps
// the kernels' chunk, block and vector indices in 32 bits.
template <int KIND>
bool rows_of_aligned_chunks(int64_t k, const uint8_t* blocks) {
  if (k % (KIND == kGgufQ6_K ? 1024 : 256) || k >= (int64_t{1} << 30)) return false;
  return reinterpret_cast<uintptr_t>(blocks) % kVecBytes<KIND> == 0;
}

}  // namespace
}  // namespace patcher
