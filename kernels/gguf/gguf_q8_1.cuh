// Activations through Q8_1 (reference.quantize_q8_1), shared by the decode GEMV's input kernel (gguf_gemv.cuh) and
// the prefill path's rounding (gguf_dequant.cuh): four consecutive threads hold one 32-value block, 8 values each.
#pragma once
#include "common/common.cuh"

namespace patcher {
namespace {

// Thread g's part of x [rows, k] (4 threads a 32-value block, 8 values each): its row and first column, and
// whether it is live; a thread past the end takes the last part (so that it reaches the shuffles) and stores nothing.
struct Part8 {
  int64_t row, col;
  bool live;
};

__device__ __forceinline__ Part8 part8(int64_t rows, int64_t k, int threads) {
  const int64_t per_row = k / 8, total = rows * per_row;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * threads + threadIdx.x;
  const int64_t at = g < total ? g : total - 1;
  return {at / per_row, (at % per_row) * 8, g < total};
}

// A thread's 8 consecutive values of row `row`, column `col` (a multiple of 8). VEC: x's rows start 16-byte aligned,
// so they load as one or two 16-byte vectors; otherwise one value at a time.
template <typename T, bool VEC>
__device__ __forceinline__ void load8(float (&v)[8], const void* x, int64_t x_stride, int64_t row, int64_t col) {
  const T* src = static_cast<const T*>(x) + row * x_stride + col;
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
}

// Whether x's rows (and so every thread's 8 values) start 16-byte aligned.
template <typename T>
bool rows_aligned16(const void* x, int64_t x_stride) {
  return (reinterpret_cast<uintptr_t>(x) & 15) == 0 && (x_stride * static_cast<int64_t>(sizeof(T))) % 16 == 0;
}

// The thread's 8 values quantized with its block's scale: d = max|x| / 127 (max over the four threads by two
// shuffles, so every thread of the warp must reach this), q = roundf(x * (1 / d)) (halves away from zero, as
// llama.cpp; 0 where d = 0). Returns d's fp16 value, the scale the block stores.
__device__ __forceinline__ float quantize_q8_1_part(const float (&v)[8], int (&q)[8]) {
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  const float d = __fdiv_rn(amax, 127.f);
  const float inv = d == 0.f ? 0.f : __frcp_rn(d);
#pragma unroll
  for (int i = 0; i < 8; ++i) q[i] = static_cast<int>(roundf(__fmul_rn(v[i], inv)));
  return __half2float(__float2half_rn(d));
}

}  // namespace
}  // namespace patcher
