// Decode attention: parameters and launcher (decode_attention.cu).
//
// Plain structs of pointers, sizes and strides for the torch glue (kernels/bindings.cpp) and the kernels: nothing
// here includes torch. Strides are in elements. Every launcher returns the CUDA error of its launch (cudaSuccess when
// nothing had to be launched).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/types.h"
#include "rope/params.h"

namespace patcher {

// Decode attention over the filled part of a static cache (flash-decoding): q [B, Hq, D] against keys
// pad[b] .. slot of k_cache/v_cache [B, Hkv, capacity, D]. The keys are split over `splits` blocks per
// (row, kv head); the last block to finish merges the partial softmaxes, so it is one kernel.
// MHA and GQA (Hq a multiple of Hkv, up to 8 query heads per kv head); D in {64, 80, 128}.
struct DecodeAttentionParams {
  DType dtype;
  int64_t batch, num_q_heads, num_kv_heads, head_dim, capacity;
  const void* q;
  const void* k_cache;
  const void* v_cache;
  const int64_t* slot;  // [1] device: last valid key index (keys pad[b] .. slot are attended)
  const int64_t* pad;   // [batch] device
  float scale;
  int32_t splits;
  float* partials;    // [batch, Hq, splits, D + 2] workspace
  int32_t* counters;  // [batch, Hq] workspace (one per head group, at its first head), zero on entry and left zero
  void* out;          // [batch, Hq * D] contiguous
  // Or, with qkv_acc set (q not read): q and the current token's K/V come from the QKV projection's fixed-point
  // accumulator (int4_norm_gemv_acc), [batch, (Hq + 2 Hkv) * D] int64 in rope's layout, rounded as that op's
  // epilogue rounds (then + qkv_bias [batch, same width] in the dtype, where not nullptr); RoPE applied with
  // rope's tables; the kernel writes K/V into the caches at slot. Of rope, the tables, rotary_dim, table_len, pad and
  // interleaved are read, and the caches written through its k_cache/v_cache (k_cache/v_cache above are read-only).
  const int64_t* qkv_acc;
  const void* qkv_bias;
  // Or, with qkv set (q and qkv_acc not read): q and the current token's K/V from the QKV projection's output
  // [batch, (Hq + 2 Hkv) * D] in the dtype and rope's layout (as rope_qkv_cache reads it), RoPE applied and K/V
  // written as with qkv_acc. The kernel before this one triggers after its wait, as rope_qkv_cache does.
  const void* qkv;
  // With gguf_work set (and qkv, head_dim a multiple of 32): the output goes to a GGUF GEMV's workspace
  // (gguf/params.h, batch rows of Hq * D) as its input kernel would write it, Q8_1 blocks (gguf_a8) or fp32, not to
  // out.
  void* gguf_work;
  bool gguf_a8;
  RopeCacheParams rope;
};
cudaError_t launch_decode_attention(const DecodeAttentionParams& p, cudaStream_t stream);

}  // namespace patcher
