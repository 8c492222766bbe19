// GPTQ int4 ops: parameters and launchers (int4.cu).
//
// Plain structs of pointers, sizes and strides for the torch glue (kernels/bindings.cpp) and the kernels: nothing
// here includes torch. Strides are in elements. Every launcher returns the CUDA error of its launch (cudaSuccess when
// nothing had to be launched).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/types.h"
#include "gemv/params.h"
#include "norm/params.h"
#include "rope/params.h"

namespace patcher {

// A GPTQ 4-bit linear in the checkpoint's own layout (patcher/gptq/format.py). Several segments side by side form
// one logical output (q | k | v of LLaMA/Qwen2, gate | up), so fused projections need no concatenated copy.
//   W[k, n] = scales[g, n] * (q[k, n] - zero[g, n]),  g = act_order ? g_idx[k] : k / group_size
struct Int4Segment {
  const int32_t* qweight;  // [k / 8, n]: 8 consecutive k of one column per word
  const int32_t* qzeros;   // [groups, n / 8]: 8 consecutive columns per word
  const void* scales;      // [groups, n] fp16
  const int32_t* g_idx;    // [k] (read only with act_order)
  const void* bias;        // [n] fp16, or nullptr
  int64_t n;
};
constexpr int kInt4MaxSegments = 3;

// What follows the matrix product in the last block of a column tile:
//   kInt4Store:    out[b, col] = act(round(x.w) + bias)            (act from GemvAct: none, gelu, gelu_tanh)
//   kInt4SiluMul:  out[b, col] = silu(gate) * up                   (two segments of equal width: gate, up)
//   kInt4RopeCache: the decode-step attention prologue of rope_qkv_cache: q [batch, Hq, D] with RoPE, K/V into
//                  k_cache/v_cache at `slot` (tiles are whole heads)
enum Int4Epilogue : int32_t { kInt4Store = 0, kInt4SiluMul = 1, kInt4RopeCache = 2 };

// x [batch, k] (batch 1..8), or, with the norm prologue, the residual stream from which x is computed in the kernel
// (NormPrologue; here the blocks of the first column tile write `sum` and h2, each its own slice).
struct Int4Params {
  DType dtype;  // of x and the outputs
  int64_t batch, k;
  int num_segments;
  Int4Segment seg[kInt4MaxSegments];
  int64_t group_size;  // without act_order (k / group_size is the group; a multiple of 8)
  bool act_order;
  int32_t zero_offset;  // 1 for the v1 format (stores zero - 1), 0 for v2
  const void* x;
  int64_t x_stride;
  // A second input for k >= x2_k (0: none): the op reads [x | x2] along k, as one linear over two activations
  // (GPT-NeoX's attention output and MLP hidden through [W_dense; W_mlp_out]). Not with the norm prologue.
  const void* x2;
  int64_t x2_stride, x2_k;
  // x2 was written before the stream's previous kernel began (the caller's promise): blocks whose K slice reads only
  // x2 skip griddepcontrol.wait and stream their weights while that kernel runs (GPT-NeoX's MLP half of the output
  // pair beside the attention). Every tile still has a slice that waits, and its last block writes the output.
  // "Began" implies "the writer has completed" only while the previous kernel triggers after its wait: it is the
  // decode attention, which does (kernels/attention/decode_attention.cu).
  bool x2_early;
  // The op right before decode_attention_qkv_acc (int4_gemv_acc and int4_norm_gemv_acc as the QKV projection): it
  // triggers the next kernel's launch after its wait rather than at entry, since that attention reads the slot
  // and earlier keys before its own wait (common.cuh, griddep_trigger_after_wait). The RoPE + cache epilogue
  // (kInt4RopeCache) is treated so without it.
  bool feeds_attention;
  NormPrologue norm;
  // The meeting deferred to the consumer (int4_gemv_acc): with `acc` set (kInt4Store, no activation, no bias, no
  // norm prologue), every block adds its sums of its tile and K slice into acc [batch, sum of n] as fixed-point
  // int64 (int4_tile.cuh: to_fixed) and ends there; no partial sums, counters or epilogue. The next op's norm
  // prologue reads acc as its delta (NormPrologue::delta_fixed). Integer adds are associative, so the result does
  // not depend on the order the blocks arrive in.
  int64_t* acc;
  // clear_count int64 zeroed after griddepcontrol.wait by the blocks that wait (or nullptr): the accumulator an
  // earlier op filled and an op before this one consumed, made ready for its next use.
  int64_t* clear;
  int64_t clear_count;
  // Epilogue.
  int32_t epilogue;
  int32_t act;
  void* out;             // kInt4Store: [batch, sum of n]; kInt4SiluMul: [batch, n]; kInt4RopeCache: q [batch, Hq, D]
  RopeCacheParams rope;  // kInt4RopeCache: the tables, heads and caches (its qkv and q fields are not used)
  // A second linear of the same input in the same launch (int4_qkv_mlp_in: GPT-NeoX's MLP input beside its QKV):
  // segments from `second` on (0: none) read the prologue's second LayerNorm (norm.weight2, bias2) instead of its
  // first, and their tiles store act2(round(x.w) + bias) into out2 [batch, their widths side by side].
  int32_t second;
  int32_t act2;
  void* out2;
  // Work split: K is cut into `splits` slices; partial sums of the slices meet in `partials` and the last block of
  // each column tile (found with `counters`, zero on entry and left zero) finishes it. With splits == 1 and one
  // segment per tile, neither is used.
  int32_t splits;
  int32_t* counters;  // [tiles], the first of the workspace's kInt4Counters
  float* partials;    // [splits, batch, sum of n], after the counters
};
// Columns of the op's logical output: its segments side by side (one rule for the bindings and the kernels).
PATCHER_HOST_DEVICE inline int64_t int4_total_width(const Int4Params& p) {
  int64_t n = 0;
  for (int s = 0; s < p.num_segments; ++s) n += p.seg[s].n;
  return n;
}
// Column offset of segment s in the logical output (q | k | v), or with Int4Params::second, of out2's first segment.
PATCHER_HOST_DEVICE inline int64_t segment_offset(const Int4Params& p, int s) {
  int64_t offset = 0;
  for (int i = 0; i < s; ++i) offset += p.seg[i].n;
  return offset;
}
// Tile counters at the front of an int4 workspace, the same number for every op: the decode step runs all its int4
// ops on one workspace, each leaving its counters zero and its partial sums behind, so an op with more tiles than
// another must not find that op's partial sums where its counters are.
constexpr int64_t kInt4Counters = 4096;
// Column tile width: 128, or for kInt4RopeCache the fewest whole heads that make whole warps (one head where that
// exceeds 256 columns). The Python side (patcher/ops/int4.py) sizes the workspace with the same rule.
int64_t int4_tile_width(const Int4Params& p);
int64_t int4_tiles(const Int4Params& p);
// The split rule's shared-memory limits, which the bindings check and patcher/ops/int4.py mirrors: x staged for a K
// slice (int4_stage_bytes), and the tensor-core kernel's scales and zero points of one K slice (bytes; int4_mma.cuh:
// SliceGroups). With the x stage and the tile values a block then stays within 72 KB, so three of Pythia's
// 160-thread blocks still fit an SM.
constexpr int64_t kInt4StageBytes = 32 * 1024;
constexpr int64_t kInt4GroupStageBytes = 40 * 1024;
// Bytes of a block's x stage at p.splits K slices: the tensor-core kernel holds x in the activations' 2-byte dtype,
// in whole 4-row steps of its slice (int4_mma.cuh: mma_x_stage_bytes), the CUDA-core kernel in fp32.
int64_t int4_stage_bytes(const Int4Params& p);
// Shared memory the tensor-core kernel's scales and zero points of one K slice take (the split rule raises splits
// until they fit kInt4GroupStageBytes); 0 with act-order. The Python side (patcher/ops/int4.py) mirrors it.
int64_t int4_group_stage_bytes(const Int4Params& p);
cudaError_t launch_int4_gemv(const Int4Params& p, cudaStream_t stream);
// The add + norm prologue of the int4 ops (p.norm, p.x, p.batch, p.k, p.dtype) as its own kernel: h [batch, k]
// contiguous, and p.norm.sum / h2 where set. cudaErrorNotSupported where the prologue cannot take this x (norm_fits).
cudaError_t launch_int4_norm_prologue(const Int4Params& p, void* h, cudaStream_t stream);

// Dequantization for prefill (more than 8 rows): W [k, n] in the dtype of `out`, exactly the reference's values
// (fp16 multiply as the checkpoint's torch kernels do, then a cast), for a cuBLAS matmul.
struct Int4DequantParams {
  DType dtype;
  int64_t k;
  Int4Segment seg;
  int64_t group_size;
  bool act_order;
  int32_t zero_offset;
  void* out;  // [k, out_stride], this segment's columns start at out
  int64_t out_stride;
};
cudaError_t launch_int4_dequantize(const Int4DequantParams& p, cudaStream_t stream);

}  // namespace patcher
