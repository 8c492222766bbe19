// GPTQ weights from the checkpoint's words: the group parameters of 4 adjacent columns and the dequantization of a
// qweight word, each weight round_fp16(scale * (q - zero)) as the reference forms it (the CUDA-core kernel's form;
// the tensor-core kernel takes q - zero exactly, int4_mma.cuh: dequantize_zeros).
#pragma once

#include "common/common.cuh"
#include "int4/params.h"

namespace patcher {
namespace {

__device__ __forceinline__ int zero_point(const Int4Segment& s, int64_t g, int64_t col, int offset) {
  const uint32_t word = static_cast<uint32_t>(s.qzeros[g * (s.n / 8) + col / 8]);
  return static_cast<int>((word >> (4 * (col % 8))) & 0xFu) + offset;
}

// The scales and zero points of one group for 4 adjacent columns (col % 4 == 0): one 8-byte load of scales and
// one qzeros word (its 4 nibbles from (col % 8) on).
struct GroupParams {
  uint2 scales;
  uint32_t zeros;
};

__device__ __forceinline__ GroupParams load_group(const Int4Segment& s, int64_t g, int64_t col) {
  GroupParams out;
  out.scales = *reinterpret_cast<const uint2*>(static_cast<const __half*>(s.scales) + g * s.n + col);
  out.zeros = static_cast<uint32_t>(s.qzeros[g * (s.n / 8) + col / 8]) >> (4 * (col % 8));
  return out;
}

// A group's parameters for 4 adjacent columns c as dequantize_word takes them, each in both halves of a half2: the
// scale, -(1024 + zero) and -(64 + zero). Zero points are 0 .. 16, so both sums are exact in fp16 and their bit
// patterns are written directly (at 1024 fp16 steps by 1, at 64 by 1/16, that is 16 units of the last place).
struct Dequant {
  __half2 scale[4], minus_z1024[4], minus_z64[4];
};

__device__ __forceinline__ __half2 bits_half2(uint32_t half_bits) {
  const uint32_t both = half_bits | (half_bits << 16);
  __half2 h;
  memcpy(&h, &both, 4);
  return h;
}

__device__ __forceinline__ Dequant group_dequant(const GroupParams& g, int zero_offset) {
  Dequant d;
  const __half* sh = reinterpret_cast<const __half*>(&g.scales);
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const uint32_t z = ((g.zeros >> (4 * c)) & 0xFu) + static_cast<uint32_t>(zero_offset);
    d.scale[c] = __half2half2(sh[c]);
    d.minus_z1024[c] = bits_half2(0xE400u + z);      // -(1024 + z)
    d.minus_z64[c] = bits_half2(0xD400u + 16u * z);  // -(64 + z)
  }
  return d;
}

// (word & mask) | 0x64006400 in one instruction: the masked nibbles in the mantissas of two fp16 1024s.
__device__ __forceinline__ __half2 nibbles_in_1024(uint32_t word, uint32_t mask) {
  uint32_t bits;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(bits) : "r"(word), "r"(mask), "r"(0x64006400u));
  __half2 h;
  memcpy(&h, &bits, 4);
  return h;
}

// The 8 weights of one word of column c (k0 .. k7), each round_fp16(scale * (q - zero)) as the reference forms it,
// as the pairs (k0,k4) (k1,k5) (k2,k6) (k3,k7). Nibbles at bit 0 of a byte land in 1024's mantissa as 1024 + q,
// those at bit 4 as 1024 + 16q, which a fused multiply by 1/16 brings to 64 + q. Subtracting 1024 + zero (or
// 64 + zero) leaves q - zero exactly (small integers), so the multiply by the scale is the only rounding, as in the
// reference. 13 instructions for 8 weights.
__device__ __forceinline__ void dequantize_word(uint32_t word, const Dequant& d, int c, __half2 (&out)[4]) {
  const __half2 sixteenth = __float2half2_rn(0.0625f);
  const uint32_t high = word >> 8;  // k2, k3 | k6, k7 where k0, k1 | k4, k5 were
  out[0] = __hmul2(__hadd2(nibbles_in_1024(word, 0x000F000Fu), d.minus_z1024[c]), d.scale[c]);
  out[1] = __hmul2(__hfma2(nibbles_in_1024(word, 0x00F000F0u), sixteenth, d.minus_z64[c]), d.scale[c]);
  out[2] = __hmul2(__hadd2(nibbles_in_1024(high, 0x000F000Fu), d.minus_z1024[c]), d.scale[c]);
  out[3] = __hmul2(__hfma2(nibbles_in_1024(high, 0x00F000F0u), sixteenth, d.minus_z64[c]), d.scale[c]);
}

}  // namespace
}  // namespace patcher
