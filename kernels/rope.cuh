// RoPE on one token's fused QKV projection output, shared by rope.cu and the int4 QKV epilogue (int4.cu).
#pragma once

#include "common.cuh"

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

// The rotated value of element e, or the element itself outside the rotary dims and for v.
// `src` holds one token's projection output (or one head of it) as T, or as floats already rounded to T.
template <typename T, typename S>
__device__ __forceinline__ float rotate(const S* src, int e, const Slot& s, int R, const T* cos, const T* sin) {
  const float x = to_float(src[e]);
  if (s.part == 2 || s.d >= R) return x;
  const int half = R / 2;
  const float rotated = s.d < half ? -to_float(src[e + half]) : to_float(src[e - half]);
  // __fmul_rn/__fadd_rn keep fp32 from contracting into an FMA: torch rounds each product separately.
  return round_to<T>(
      __fadd_rn(round_to<T>(__fmul_rn(x, to_float(cos[s.d]))), round_to<T>(__fmul_rn(rotated, to_float(sin[s.d])))));
}

}  // namespace patcher
