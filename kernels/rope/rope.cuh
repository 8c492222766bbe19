// RoPE on one token's fused QKV projection output, shared by rope.cu, the int4 QKV epilogue (int4/int4_tile.cuh),
// the dense QKV GEMV's epilogue (gemv/gemv.cuh) and the attention that finishes the QKV sums (attention/).
#pragma once

#include "common/common.cuh"
#include "rope/params.h"

namespace patcher {

// Where element e (of one token's projection output) goes: part 0 q / 1 k / 2 v, head, dim.
struct Slot {
  int part, head, d;
};

__device__ __forceinline__ Slot locate(int e, int D, int hq, int hkv, bool interleaved) {
  Slot s;
  s.d = e % D;
  const int slot = e / D;
  if (interleaved) {  // [head][q | k | v]
    s.head = slot / 3;
    s.part = slot % 3;
  } else {  // [q heads | k heads | v heads]
    s.part = slot < hq ? 0 : (slot < hq + hkv ? 1 : 2);
    s.head = s.part == 0 ? slot : (s.part == 1 ? slot - hq : slot - hq - hkv);
  }
  return s;
}

// RoPE of dim d < R of a q or k head: x * cos + rotate_half(x) * sin, each product and the sum rounded to T as
// torch rounds them; `partner` is the head's value at d + R/2 (for d < R/2) or d - R/2, both already rounded to T,
// and cos_d / sin_d the tables' entries at d.
template <typename T>
__device__ __forceinline__ float rope_value(float x, float partner, int d, int R, float cos_d, float sin_d) {
  const float rotated = d < R / 2 ? -partner : partner;
  // __fmul_rn/__fadd_rn keep fp32 from contracting into an FMA: torch rounds each product separately.
  return round_to<T>(__fadd_rn(round_to<T>(__fmul_rn(x, cos_d)), round_to<T>(__fmul_rn(rotated, sin_d))));
}

// The rotated value of element e, or the element itself outside the rotary dims and for v.
// `src` holds one token's projection output (or one head of it) as T, or as floats already rounded to T.
template <typename T, typename S>
__device__ __forceinline__ float rotate(const S* src, int e, const Slot& s, int R, const T* cos, const T* sin) {
  const float x = to_float(src[e]);
  if (s.part == 2 || s.d >= R) return x;
  return rope_value<T>(x, to_float(src[s.d < R / 2 ? e + R / 2 : e - R / 2]), s.d, R, to_float(cos[s.d]),
                       to_float(sin[s.d]));
}

// The dense QKV GEMV computes two output rows per warp, paired so that its epilogue can rotate them: within each
// head-sized block of D rows, pair j < R/2 is the rotation pair (j, j + R/2), and the pairs after it take the
// unrotated dims two by two (D and R are even).
__device__ __forceinline__ void rope_pair_rows(int64_t pair, int D, int R, int64_t (&rows)[2]) {
  const int64_t base = pair / (D / 2) * D;
  const int j = static_cast<int>(pair % (D / 2)), half = R / 2;
  rows[0] = base + (j < half ? j : R + 2 * (j - half));
  rows[1] = base + (j < half ? j + half : R + 2 * (j - half) + 1);
}

// The cos/sin rows of row b's position in this decode step, slot - pad[b], clamped so that no row (a finished or
// fully padded one included) reads outside the tables.
template <typename T>
struct RopeRow {
  const T* cos;
  const T* sin;
};

template <typename T>
__device__ __forceinline__ RopeRow<T> rope_row(const RopeCacheParams& p, int64_t slot, int64_t b) {
  int64_t pos = slot - p.pad[b];
  pos = pos < 0 ? 0 : (pos >= p.table_len ? p.table_len - 1 : pos);
  return {static_cast<const T*>(p.cos) + pos * p.rotary_dim, static_cast<const T*>(p.sin) + pos * p.rotary_dim};
}

// Stores one finished element of row b where the decode step wants it: q into `q` [batch, Hq, D], K and V into
// the cache at `slot`.
template <typename T>
__device__ __forceinline__ void store_qkv(const RopeCacheParams& p, T* q, int64_t b, int64_t slot, const Slot& s, T y) {
  if (s.part == 0) {
    q[(b * p.num_q_heads + s.head) * p.head_dim + s.d] = y;
  } else {
    T* cache = static_cast<T*>(s.part == 1 ? p.k_cache : p.v_cache);
    cache[((b * p.num_kv_heads + s.head) * p.capacity + slot) * p.head_dim + s.d] = y;
  }
}

// Rotates one pair of rope_pair_rows (the projection outputs y, already rounded to T) for row b of the batch and
// stores it, as rope_qkv_cache does.
template <typename T>
__device__ __forceinline__ void rope_store_pair(const RopeCacheParams& p, int64_t b, const int64_t (&rows)[2],
                                                const float (&y)[2], T* q) {
  const int D = static_cast<int>(p.head_dim), hq = static_cast<int>(p.num_q_heads);
  const int hkv = static_cast<int>(p.num_kv_heads), R = static_cast<int>(p.rotary_dim);
  const int64_t slot = *p.slot;
  const RopeRow<T> row = rope_row<T>(p, slot, b);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const Slot s = locate(static_cast<int>(rows[i]), D, hq, hkv, p.interleaved);
    float out = y[i];
    // the pair is (d, d + R/2): the partner of row 0 is y[1], and the other way
    if (s.part != 2 && s.d < R)
      out = rope_value<T>(y[i], y[1 - i], s.d, R, to_float(row.cos[s.d]), to_float(row.sin[s.d]));
    store_qkv<T>(p, q, b, slot, s, from_float<T>(out));
  }
}

}  // namespace patcher
