// GGUF weight blocks on the GPU: their layouts' constants, a row's bytes read as a stream of chunks, and the parsing
// of one 32-value block (or K-quant sub-block) into integers and scales. Shared by the decode GEMV (gguf_gemv.cuh) and
// the prefill path's dequantization (gguf_dequant.cuh). The layouts: gguf/params.h and patcher/gguf/format.py.
//
// A row is walked in chunks of 1024 values: 32 blocks of 32 values, or 4 super-blocks of 256 (K is a multiple of
// 256 for the K-quants, so a chunk holds whole super-blocks). GGUF blocks are 18, 20, 34, 144, 176 or 210 bytes, so
// a row's chunk is loaded as a byte stream: 16-byte vectors for its aligned body and single bytes for the unaligned
// head and tail, which keeps every global load of the body 16 bytes wide whatever the row's alignment.
#pragma once
#include <type_traits>

#include "common/common.cuh"
#include "gguf/params.h"

namespace patcher {
namespace {

constexpr int kChunkBlocks = 32;  // 32-value blocks (or sub-blocks) per chunk of K: one a lane

template <int KIND>
constexpr bool kKQuant = KIND == kGgufQ4_K || KIND == kGgufQ5_K || KIND == kGgufQ6_K;

// Calls launch(std::integral_constant<int, KIND>{}) for the GgufKind `kind` and returns what it returns: the one
// switch from a runtime kind to the kernels' KIND template parameter; cudaErrorInvalidValue for any other value.
template <typename Launch>
cudaError_t with_kind(int32_t kind, Launch&& launch) {
  switch (kind) {
    case kGgufQ4_0:
      return launch(std::integral_constant<int, kGgufQ4_0>{});
    case kGgufQ4_1:
      return launch(std::integral_constant<int, kGgufQ4_1>{});
    case kGgufQ8_0:
      return launch(std::integral_constant<int, kGgufQ8_0>{});
    case kGgufQ4_K:
      return launch(std::integral_constant<int, kGgufQ4_K>{});
    case kGgufQ5_K:
      return launch(std::integral_constant<int, kGgufQ5_K>{});
    case kGgufQ6_K:
      return launch(std::integral_constant<int, kGgufQ6_K>{});
  }
  return cudaErrorInvalidValue;
}

// Bytes and values of a block (a super-block for the K-quants), as gguf_block_bytes / gguf_block_values.
template <int KIND>
constexpr int kBlockBytes = KIND == kGgufQ4_0   ? 18
                            : KIND == kGgufQ4_1 ? 20
                            : KIND == kGgufQ8_0 ? 34
                            : KIND == kGgufQ4_K ? 144
                            : KIND == kGgufQ5_K ? 176
                                                : 210;
template <int KIND>
constexpr int kBlockValues = kKQuant<KIND> ? 256 : 32;

// Weight bytes of one row's chunk of K (kChunkBlocks * 32 values): 32 blocks, or 4 super-blocks.
template <int KIND>
constexpr int kChunkBytes = kChunkBlocks * 32 / kBlockValues<KIND> * kBlockBytes<KIND>;

// A warp's weight stage: one chunk's bytes, placed at the global address's offset mod 16 so that the aligned body
// lands on 16-byte boundaries of shared memory.
template <int KIND>
constexpr int kStageBytes = (kChunkBytes<KIND> + 15 + 15) / 16 * 16;

// 16-byte vectors of a chunk per lane: a chunk's body has at most chunk bytes / 16 of them.
template <int KIND>
constexpr int kVecsPerLane = (kChunkBytes<KIND> / 16 + 31) / 32;

// The bytes [lo, hi) of one row's chunk: head [lo, a) and tail [e, hi) are under 16 bytes each, the body [a, e)
// 16-byte aligned. hi - lo >= 18 (one block, the smallest), so lo <= a <= e <= hi.
struct ByteWindow {
  const uint8_t *lo, *a, *e, *hi;
};

__device__ __forceinline__ ByteWindow byte_window(const uint8_t* lo, const uint8_t* hi) {
  const uint8_t* a = lo + ((16 - (reinterpret_cast<uintptr_t>(lo) & 15)) & 15);
  const uint8_t* e = hi - (reinterpret_cast<uintptr_t>(hi) & 15);
  return {lo, a, e, hi};
}

// One lane's share of a chunk in registers: body vectors lane, lane + 32, ..., and one head (lanes 0-15) or tail
// (lanes 16-31) byte.
template <int KIND>
struct WeightChunk {
  uint4 v[kVecsPerLane<KIND>];
  uint8_t edge;
};

template <int KIND>
__device__ __forceinline__ void fetch_chunk(WeightChunk<KIND>& w, const ByteWindow& win, int lane) {
  const int64_t vectors = (win.e - win.a) / 16;
  const uint4* body = reinterpret_cast<const uint4*>(win.a);
#pragma unroll
  for (int j = 0; j < kVecsPerLane<KIND>; ++j) {
    const int64_t i = lane + 32 * j;
    if (i < vectors) w.v[j] = __ldcs(body + i);
  }
  const uint8_t* at = lane < 16 ? win.lo + lane : win.e + (lane - 16);
  const bool in = lane < 16 ? at < win.a : at < win.hi;
  w.edge = in ? *at : 0;
}

// Writes the chunk into the warp's stage; returns where its first block starts there.
template <int KIND>
__device__ __forceinline__ const uint8_t* store_chunk(const WeightChunk<KIND>& w, const ByteWindow& win, uint8_t* stage,
                                                      int lane) {
  const uint8_t* base = win.lo - (reinterpret_cast<uintptr_t>(win.lo) & 15);  // maps to stage[0]
  const int64_t vectors = (win.e - win.a) / 16;
  uint4* body = reinterpret_cast<uint4*>(stage + (win.a - base));
#pragma unroll
  for (int j = 0; j < kVecsPerLane<KIND>; ++j) {
    const int64_t i = lane + 32 * j;
    if (i < vectors) body[i] = w.v[j];
  }
  const uint8_t* at = lane < 16 ? win.lo + lane : win.e + (lane - 16);
  if (lane < 16 ? at < win.a : at < win.hi) stage[at - base] = w.edge;
  return stage + (win.lo - base);
}

// 4 bytes at a 2-byte aligned address (a block's fields are 2-byte aligned), little-endian; ALIGNED: the address is
// 4-byte aligned, one load.
template <bool ALIGNED = false>
__device__ __forceinline__ int load_word(const uint8_t* p) {
  if constexpr (ALIGNED) return *reinterpret_cast<const int*>(p);
  const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
  return static_cast<int>(static_cast<uint32_t>(h[0]) | (static_cast<uint32_t>(h[1]) << 16));
}

__device__ __forceinline__ float load_fp16(const uint8_t* p) {
  return __half2float(__ushort_as_half(*reinterpret_cast<const uint16_t*>(p)));
}

// One weight block: d (and m for Q4_1) in fp32, and its 32 integers as signed bytes, element i in byte i % 4 of
// q[i / 4] (Q4_0: nibble - 8, Q4_1: nibble, Q8_0: the int8).
template <int KIND>
__device__ __forceinline__ void parse_block(const uint8_t* blk, float& d, float& m, int (&q)[8]) {
  d = load_fp16(blk);
  m = 0.f;
  if constexpr (KIND == kGgufQ8_0) {
#pragma unroll
    for (int j = 0; j < 8; ++j) q[j] = load_word(blk + 2 + 4 * j);
  } else {
    const uint8_t* qs = blk + (KIND == kGgufQ4_1 ? 4 : 2);
    if constexpr (KIND == kGgufQ4_1) m = load_fp16(blk + 2);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const unsigned v = static_cast<unsigned>(load_word(qs + 4 * j));
      unsigned low = v & 0x0F0F0F0Fu, high = (v >> 4) & 0x0F0F0F0Fu;
      if constexpr (KIND == kGgufQ4_0) {
        low = __vsub4(low, 0x08080808u);  // per byte, no borrow between bytes
        high = __vsub4(high, 0x08080808u);
      }
      q[j] = static_cast<int>(low);       // elements 4j .. 4j + 3
      q[4 + j] = static_cast<int>(high);  // elements 16 + 4j .. 16 + 4j + 3
    }
  }
}

// Sub-block j (0..7) of the super-block at sb (2-byte aligned): its 32 integers as signed bytes, element i in byte
// i % 4 of q[i / 4] (Q4_K: the nibble, Q5_K: nibble | high bit << 4, Q6_K: 6 bits - 32), and its scales. Q4_K, Q5_K:
// scale[0] = scale[1] = d * sc[j], dm = dmin * mn[j]. Q6_K: scale[h] = d * scales[2j + h] for the 16-value half h
// (elements 16h .. 16h + 15), dm = 0. ALIGNED: Q4_K, Q5_K: sb is 4-byte aligned, and the words load whole; Q6_K
// (2-byte aligned, in a 4-byte aligned stage): the 4-byte words around them, each pair shifted into place.
// STORED: Q6_K's integers as stored, 0..63, the 32 they are offset by left to the caller (accumulate_x).
template <int KIND, bool ALIGNED = false, bool STORED = false>
__device__ __forceinline__ void parse_sub_block(const uint8_t* sb, int j, float (&scale)[2], float& dm, int (&q)[8]) {
  if constexpr (KIND == kGgufQ6_K) {
    // Half h = j / 4 (128 values) reads ql[64h ..] and qh[32h ..]; its group g = j % 4 the low (g < 2) or high
    // nibbles of ql[64h + 32(g % 2) + e] and bits 2g, 2g + 1 of qh[32h + e].
    const int h = j >> 2, g = j & 3;
    const uint8_t* ql = sb + 64 * h + 32 * (g & 1);
    const uint8_t* qh = sb + 128 + 32 * h;
    // Word i of ql and of qh shifted right by the group's nibble (4 (g / 2)) and bit pair (2g): each byte's bits
    // of the group then sit at its bottom.
    const unsigned low_shift = 4u * static_cast<unsigned>(g >> 1), high_shift = 2u * static_cast<unsigned>(g);
    unsigned lw[8], hw[8];
    if constexpr (ALIGNED) {
      // Words 0..8 from the word at or below each start (the 9th is inside the super-block: ql's 32 bytes are
      // followed by ql or qh, qh's by qh or the scales), each pair funnel-shifted by the start's offset and the
      // group's shift at once (the bits that come in from the next word at the top are masked off below).
      const int off = static_cast<int>(reinterpret_cast<uintptr_t>(sb) & 3);  // 0 or 2
      const unsigned shift = 8u * static_cast<unsigned>(off);
      // (offsets from sb itself, so that shared memory stays shared to the compiler)
      const uint32_t* l = reinterpret_cast<const uint32_t*>(ql - off);
      const uint32_t* hi = reinterpret_cast<const uint32_t*>(qh - off);
      uint32_t lv[9], hv[9];
#pragma unroll
      for (int i = 0; i < 9; ++i) lv[i] = l[i], hv[i] = hi[i];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        lw[i] = __funnelshift_rc(lv[i], lv[i + 1], shift + low_shift);
        hw[i] = __funnelshift_rc(hv[i], hv[i + 1], shift + high_shift);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        lw[i] = static_cast<unsigned>(load_word(ql + 4 * i)) >> low_shift;
        hw[i] = static_cast<unsigned>(load_word(qh + 4 * i)) >> high_shift;
      }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const unsigned low = lw[i] & 0x0F0F0F0Fu;
      const unsigned high = (hw[i] & 0x03030303u) << 4;
      // 0..63 - 32 per byte (no borrow between bytes), or 0..63 as stored
      q[i] = static_cast<int>(STORED ? low | high : __vsub4(low | high, 0x20202020u));
    }
    const float d = load_fp16(sb + 208);
    const int8_t* scales = reinterpret_cast<const int8_t*>(sb + 192);
    scale[0] = __fmul_rn(d, static_cast<float>(scales[2 * j]));
    scale[1] = __fmul_rn(d, static_cast<float>(scales[2 * j + 1]));
    dm = 0.f;
  } else {
    // 6-bit sc, mn (format.k_scale_min): j < 4 in bits 0-5 of bytes j and j + 4 of `scales`; j >= 4 the low and
    // high nibbles of byte j + 4 and, as bits 4-5, the top two bits of bytes j - 4 (sc) and j (mn).
    const uint8_t* s = sb + 4;
    const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    const int mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    scale[0] = scale[1] = __fmul_rn(load_fp16(sb), static_cast<float>(sc));
    dm = __fmul_rn(load_fp16(sb + 2), static_cast<float>(mn));
    // qs chunk j / 2 (32 bytes) holds sub-block j in its low (j even) or high (j odd) nibbles; Q5_K's fifth bit of
    // element e is bit j of qh[e].
    const uint8_t* qs = sb + (KIND == kGgufQ4_K ? 16 : 48) + 32 * (j >> 1);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      unsigned v = (static_cast<unsigned>(load_word<ALIGNED>(qs + 4 * i)) >> (4 * (j & 1))) & 0x0F0F0F0Fu;
      if constexpr (KIND == kGgufQ5_K) {
        v |= ((static_cast<unsigned>(load_word<ALIGNED>(sb + 16 + 4 * i)) >> j) & 0x01010101u) << 4;
      }
      q[i] = static_cast<int>(v);
    }
  }
}

// Lane `lane`'s 32 values of a row's chunk (the chunk's bytes at `chunk`): block `lane`, or sub-block lane % 8 of
// super-block lane / 8. q as parse_block gives it, scale[h] the scale of elements 16h .. 16h + 15, and `off` what is
// added to each scaled integer (Q4_1's m, the K-quants' -(dmin * mn); none for the others: kHasOffset).
template <int KIND>
constexpr bool kHasOffset = KIND == kGgufQ4_1 || KIND == kGgufQ4_K || KIND == kGgufQ5_K;

template <int KIND>
__device__ __forceinline__ void parse_lane(const uint8_t* chunk, int lane, float (&scale)[2], float& off, int (&q)[8]) {
  if constexpr (kKQuant<KIND>) {
    float dm;
    parse_sub_block<KIND>(chunk + (lane >> 3) * kBlockBytes<KIND>, lane & 7, scale, dm, q);
    off = -dm;
  } else {
    float d;
    parse_block<KIND>(chunk + lane * kBlockBytes<KIND>, d, off, q);
    scale[0] = scale[1] = d;
  }
}

// Element i of a parsed q, as float.
__device__ __forceinline__ float q_at(const int (&q)[8], int i) {
  return static_cast<float>(static_cast<int8_t>(static_cast<unsigned>(q[i / 4]) >> (8 * (i % 4))));
}

// Weight element i as format.dequantize forms it in fp32: scale * q (+ off), each step rounded once.
template <int KIND>
__device__ __forceinline__ float weight_at(const float (&scale)[2], float off, const int (&q)[8], int i) {
  const float scaled = __fmul_rn(scale[i / 16], q_at(q, i));
  return kHasOffset<KIND> ? __fadd_rn(scaled, off) : scaled;
}

// Weight elements 8 part .. 8 part + 7 (part 0..3, known only at run time), as weight_at forms each: words 2 part and
// 2 part + 1 of q, under scale[part / 2]. The words are picked by selects, so that q and scale stay in registers
// (indexing them by a run-time value would put them in local memory).
template <int KIND>
__device__ __forceinline__ void weights8(const float (&scale)[2], float off, const int (&q)[8], int part,
                                         float (&w)[8]) {
  unsigned lo = static_cast<unsigned>(q[0]), hi = static_cast<unsigned>(q[1]);
#pragma unroll
  for (int j = 1; j < 4; ++j) {
    lo = part == j ? static_cast<unsigned>(q[2 * j]) : lo;
    hi = part == j ? static_cast<unsigned>(q[2 * j + 1]) : hi;
  }
  const float s = part < 2 ? scale[0] : scale[1];
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const float v = static_cast<float>(static_cast<int8_t>((e < 4 ? lo : hi) >> (8 * (e % 4))));
    const float scaled = __fmul_rn(s, v);
    w[e] = kHasOffset<KIND> ? __fadd_rn(scaled, off) : scaled;
  }
}

}  // namespace
}  // namespace patcher
