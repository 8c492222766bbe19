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

// A thread's 8 values of x as a GGUF product takes them: x's own (load8), or with SILU the gated MLP's
// silu(gate) * up from x = [gate | up] (up k values after gate), rounded as silu_and_mul rounds it
// (kernels/activation/activation.cu).
template <typename T, bool VEC, bool SILU>
__device__ __forceinline__ void load8_input(float (&v)[8], const void* x, int64_t x_stride, int64_t row, int64_t col,
                                            int64_t k) {
  load8<T, VEC>(v, x, x_stride, row, col);
  if constexpr (SILU) {
    float up[8];
    load8<T, VEC>(up, x, x_stride, row, col + k);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = round_to<T>(round_to<T>(silu(v[i])) * up[i]);
  }
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

// The thread's 8 values replaced by their rounding through Q8_1 (quantize_q8_1_part's q * d, exact in fp32:
// |q| <= 127, d an fp16 value), as the GEMV's W4A8 product sees them. Every thread of the warp must reach it.
__device__ __forceinline__ void round_q8_1_part(float (&v)[8]) {
  int q[8];
  const float d = quantize_q8_1_part(v, q);
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = __fmul_rn(static_cast<float>(q[i]), d);
}

// A Q8_1 block's d, s = d * sum(q) and sum(q), for the block at (row, col) of the workspace's [batch, k] (gguf/params.h).
__device__ __forceinline__ void store_q8_1_scales(void* work, int64_t batch, int64_t k, int64_t row, int64_t col,
                                                  float d, int sum) {
  const int64_t nb = k / 32, blk = row * nb + col / 32;
  float* xd = reinterpret_cast<float*>(static_cast<int8_t*>(work) + batch * k);
  xd[blk] = d;
  xd[batch * nb + blk] = __fmul_rn(static_cast<float>(sum), d);
  reinterpret_cast<int*>(xd + 2 * batch * nb)[blk] = sum;
}

// A thread's 8 values of x [batch, k] (row `row`, columns col .. col + 7) into the GGUF GEMV's workspace
// (gguf/params.h), as the GEMV reads them: W4A8 Q8_1 (int8 q; the block's first thread its d, s = d * sum(q) and
// sum(q)), W4A16 fp32. Every thread of the warp must reach the W4A8 shuffles; `live` false: a thread that only
// takes part in them.
template <bool A8>
__device__ __forceinline__ void store_gguf_input(void* work, int64_t batch, int64_t k, int64_t row, int64_t col,
                                                 const float (&v)[8], bool live) {
  if constexpr (A8) {
    int q[8];
    const float d = quantize_q8_1_part(v, q);
    int sum = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) sum += q[i];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    if (!live) return;
    uint32_t packed[2] = {0u, 0u};
#pragma unroll
    for (int i = 0; i < 8; ++i) packed[i / 4] |= (static_cast<uint32_t>(q[i]) & 0xFFu) << (8 * (i % 4));
    int8_t* xq = static_cast<int8_t*>(work);
    *reinterpret_cast<uint2*>(xq + row * k + col) = make_uint2(packed[0], packed[1]);
    if (col % 32 == 0) store_q8_1_scales(work, batch, k, row, col, d, sum);  // the block's first thread
  } else {
    if (!live) return;
    float* xf = static_cast<float*>(work) + row * k + col;
    *reinterpret_cast<float4*>(xf) = make_float4(v[0], v[1], v[2], v[3]);
    *reinterpret_cast<float4*>(xf + 4) = make_float4(v[4], v[5], v[6], v[7]);
  }
}

// store_gguf_input for a warp that holds one 32-value block of x, a value a lane (lane = col % 32): the same
// scale, integers and sums as four threads of 8 values form them (the maximum and the integer sum do not depend on
// the order they are taken in). Every lane of the warp must reach it.
template <bool A8>
__device__ __forceinline__ void store_gguf_input_warp(void* work, int64_t batch, int64_t k, int64_t row, int64_t col,
                                                      float v) {
  if constexpr (A8) {
    float amax = fabsf(v);
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float d = __fdiv_rn(amax, 127.f);
    const float inv = d == 0.f ? 0.f : __frcp_rn(d);
    const int q = static_cast<int>(roundf(__fmul_rn(v, inv)));
    int sum = q;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    static_cast<int8_t*>(work)[row * k + col] = static_cast<int8_t>(q);
    if (col % 32 == 0) store_q8_1_scales(work, batch, k, row, col, __half2float(__float2half_rn(d)), sum);
  } else {
    static_cast<float*>(work)[row * k + col] = v;
  }
}

}  // namespace
}  // namespace patcher
