// RoPE ops: parameters and launchers (rope.cu).
//
// Plain structs of pointers, sizes and strides for the torch glue (kernels/bindings.cpp) and the kernels: nothing
// here includes torch. Strides are in elements. Every launcher returns the CUDA error of its launch (cudaSuccess when
// nothing had to be launched).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/types.h"

namespace patcher {

// Fused QKV projection output -> q, k, v in head layout with RoPE (NeoX half rotation) on the first rotary_dim
// dims of q and k. Source layout per token: [q heads | k heads | v heads], or with `interleaved`
// [head][q | k | v] (GPT-NeoX query_key_value, which has as many kv heads as q heads).
struct RopeQkvParams {
  DType dtype;
  int64_t batch, tokens;
  const void* qkv;  // [batch, tokens, (Hq + 2 Hkv) * D], last dim contiguous
  int64_t qkv_stride_b, qkv_stride_t;
  const void* cos;  // [batch or 1, tokens, rotary_dim], last dim contiguous; stride_b 0 broadcasts
  int64_t cos_stride_b, cos_stride_t;
  const void* sin;
  int64_t sin_stride_b, sin_stride_t;
  int64_t rotary_dim;
  int64_t num_q_heads, num_kv_heads, head_dim;
  bool interleaved;
  void* q;  // [batch, Hq, tokens, D] contiguous
  void* k;  // [batch, Hkv, tokens, D] contiguous
  void* v;  // [batch, Hkv, tokens, D] contiguous
};
cudaError_t launch_rope_qkv(const RopeQkvParams& p, cudaStream_t stream);

// The decode-step attention prologue: like rope_qkv for one token per row, but K and V go straight into the
// static cache at index `slot`, at rope position slot - pad[b] (left-padded rows start later).
struct RopeCacheParams {
  DType dtype;
  int64_t batch;
  const void* qkv;  // [batch, (Hq + 2 Hkv) * D], row stride qkv_stride
  int64_t qkv_stride;
  const void* cos;  // [positions, rotary_dim] contiguous tables
  const void* sin;
  int64_t rotary_dim, table_len;
  const int64_t* slot;  // [1] device: the cache index written this step
  const int64_t* pad;   // [batch] device: leading pad tokens of each row
  int64_t num_q_heads, num_kv_heads, head_dim;
  bool interleaved;
  void* q;        // [batch, Hq, D] contiguous
  void* k_cache;  // [batch, Hkv, capacity, D] contiguous
  void* v_cache;
  int64_t capacity;
};
cudaError_t launch_rope_qkv_cache(const RopeCacheParams& p, cudaStream_t stream);

}  // namespace patcher
