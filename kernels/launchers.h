// The C++ interface between the torch glue (torch_bindings.cpp) and the kernels (*.cu).
//
// Plain structs of pointers, sizes and strides, one launcher per op family. Nothing here includes torch, so the
// .cu files compile fast and can be built and checked without it. Strides are in elements. Every launcher
// returns the CUDA error of its launch (cudaSuccess when nothing had to be launched).
#pragma once

#include <cuda.h>  // CUtensorMap (the decode-step kernel's weight maps)
#include <cuda_runtime.h>

#include <cstdint>

namespace patcher {

enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// RMSNorm and LayerNorm, optionally with the residual add fused in front and a second affine (dual LayerNorm).
//   sum  = x + delta                 (one delta)     or   (delta2 + delta) + x    (GPT-NeoX parallel residual)
//   out  = norm(sum) * weight (+ bias), out2 = norm(sum) * weight2 + bias2 (same mean and variance)
struct NormParams {
  DType dtype;
  int64_t rows, hidden;
  const void* x;  // [rows, hidden], row stride x_stride
  int64_t x_stride;
  const void* delta;  // nullptr: no residual add
  int64_t delta_stride;
  const void* delta2;  // nullptr: at most one delta
  int64_t delta2_stride;
  const void* weight;   // [hidden]
  const void* bias;     // [hidden] or nullptr
  const void* weight2;  // [hidden] or nullptr (no second output)
  const void* bias2;    // [hidden] or nullptr
  void* out;            // [rows, hidden] contiguous
  void* out2;           // [rows, hidden] contiguous, or nullptr
  void* sum;            // [rows, hidden] contiguous; required when delta is set, else nullptr
  float eps;
  bool rms;
};
cudaError_t launch_norm(const NormParams& p, cudaStream_t stream);

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

// Elementwise MLP activations.
//   silu_and_mul: out[r, c] = silu(x[r, c]) * x[r, cols + c]     x [rows, 2 cols]
//   bias_gelu:    out[r, c] = gelu(x[r, c] + bias[c])            x [rows, cols]
struct ActivationParams {
  DType dtype;
  int64_t rows, cols;  // of the output
  const void* x;
  int64_t x_stride;  // row stride of x
  const void* bias;  // bias_gelu: [cols] or nullptr
  void* out;         // [rows, cols] contiguous
};
cudaError_t launch_silu_and_mul(const ActivationParams& p, cudaStream_t stream);
cudaError_t launch_bias_gelu(const ActivationParams& p, bool tanh, cudaStream_t stream);

}  // namespace patcher

namespace patcher {

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

// The norm prologue of the decode matrix-vector kernels (dense and int4): x is then the residual stream, and the
// kernel makes its own input from it with the rounding of launch_norm:
//   sum = x + delta (or (delta2 + delta) + x),  h = norm(sum) * weight (+ bias)
// One block writes `sum` (when delta is set) and h2 = the second LayerNorm of sum (when weight2 is set), so the
// separate add + norm kernel of the decode step is not needed. weight == nullptr: no prologue, x is the input.
struct NormPrologue {
  const void* delta;  // [batch, k] rows, or nullptr
  int64_t delta_stride;
  // delta is an int4 op's fixed-point accumulator (int64, Int4Params::acc) instead of rows in the dtype: the int4
  // kernels' prologue rounds each value to the dtype first, as that op's own epilogue would have.
  bool delta_fixed;
  const void* delta2;  // nullptr: at most one delta
  int64_t delta2_stride;
  const void* weight;   // [k]
  const void* bias;     // [k] or nullptr
  const void* weight2;  // [k] or nullptr (no h2)
  const void* bias2;    // [k] or nullptr
  float eps;
  bool rms;
  void* sum;  // [batch, k] contiguous, when delta is set
  void* h2;   // [batch, k] contiguous, when weight2 is set
};

// Matrix-vector products for decode (1 to 8 rows of x), with an optional norm prologue and fused epilogues.
//   out[b, n] = act(h[b] . w[n] + bias[n])                                       act: none, gelu, gelu_tanh
//   kSiluMul:  out[b, n] = silu(h[b] . w[n] + bias[n]) * (h[b] . w[N + n] + bias[N + n])   w is [gate; up]
// h is x, or the prologue's normalized residual sum. Each intermediate is rounded to the dtype where HF's
// separate ops would round it.
//   kRopeCache: w is one token's fused q|k|v projection; RoPE and the cache writes of rope_qkv_cache follow:
//              q [batch, Hq, D] goes to `out`, K and V into rope.k_cache/v_cache at *rope.slot (bias as for none)
enum GemvAct : int32_t { kActNone = 0, kActGelu = 1, kActGeluTanh = 2, kActSiluMul = 3, kActRopeCache = 4 };
struct GemvParams {
  DType dtype;
  int64_t batch;  // rows of x, 1..8
  int64_t n;      // output columns (w has n rows, or 2n for kActSiluMul)
  int64_t k;
  const void* x;  // [batch, k], row stride x_stride
  int64_t x_stride;
  NormPrologue norm;
  const void* w;  // [rows, k], row stride w_stride
  int64_t w_stride;
  const void* bias;  // [rows] or nullptr
  void* out;         // [batch, n] contiguous
  int32_t act;
  RopeCacheParams rope;  // kActRopeCache: the tables, heads and caches (its qkv and q fields are not used)
  bool stage_inputs;     // set by launch_gemv: the prologue copies its inputs into shared memory first
};
// Shared memory of the norm prologue: the [batch, k] stage of h, and with `staged` also copies of its inputs.
// The most a block may have.
size_t gemv_prologue_smem(const GemvParams& p, bool staged);
size_t gemv_max_smem();
cudaError_t launch_gemv(const GemvParams& p, cudaStream_t stream);

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
  RopeCacheParams rope;
};
cudaError_t launch_decode_attention(const DecodeAttentionParams& p, cudaStream_t stream);

// The decode step's last op (next_token.cu): each row's next token, the argmax of its scores (torch.argmax's order:
// NaN first, then the first index of the maximum), or pad_token once the row has finished; then finished |= token
// in eos, tokens[b, slot + 1] = token, x[b] = embed[token] (when embed is set), and slot += 1.
struct NextTokenParams {
  DType dtype;  // of scores
  int64_t batch, vocab;
  const void* scores;  // [batch, vocab], row stride scores_stride
  int64_t scores_stride;
  int64_t* tokens;  // [batch, columns], row stride tokens_stride (no write where slot + 1 >= columns)
  int64_t tokens_stride, columns;
  int64_t* slot;             // [1] device: the current token's column
  uint8_t* finished;         // [batch] device (torch.bool)
  const int64_t* eos;        // [num_eos] device, -1 for unused entries
  int32_t num_eos;
  const int64_t* pad_token;  // [] device
  const void* embed;         // [embed_rows, hidden] contiguous, or nullptr (no x)
  int64_t embed_rows, hidden, embed_elem_bytes;
  void* x;                   // [batch, hidden] contiguous, embed's dtype
  int32_t* workspace;  // next_token_workspace_size(batch) int32, zero on entry and left zero
};
constexpr int kNextTokenMaxParts = 64, kNextTokenMaxBatch = 64;
inline int64_t next_token_workspace_size(int64_t batch) {
  return 1 + 2 * batch * kNextTokenMaxParts;  // the ticket, then each part's value and index
}
cudaError_t launch_next_token(const NextTokenParams& p, cudaStream_t stream);

// ---- GPTQ int4 ---------------------------------------------------------------------------------------------
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
  bool x2_early;
  // qweight rows per warp run to prefetch into L2 past the register preload, before griddepcontrol.wait (the
  // tensor-core kernel; its launcher sets it from an L2 budget).
  int32_t prefetch_rows;
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
  float* partials;    // [int4_partial_rows, batch, sum of n], after the counters
};
#ifdef __CUDACC__
#define PATCHER_HOST_DEVICE __host__ __device__
#else
#define PATCHER_HOST_DEVICE  // the bindings' host compiler
#endif
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
// another must not find that op's partial sums where its counters are (as when the region was sized per op).
constexpr int64_t kInt4Counters = 4096;
// Column tile width: 128, or for kInt4RopeCache the fewest whole heads that make whole warps (one head where that
// exceeds 256 columns). The Python side (patcher/ops/int4.py) sizes the workspace with the same rule.
int64_t int4_tile_width(const Int4Params& p);
int64_t int4_tiles(const Int4Params& p);
// Rows of partial sums the workspace holds: `splits` for the split kernels, and for the TMA kernel (int4_tma.cuh)
// one per block that shares a tile, at most one per 256 k.
int64_t int4_partial_rows(const Int4Params& p);
// The split rule's shared-memory limits, which the bindings check and patcher/ops/int4.py mirrors: x staged for a K
// slice (int4_stage_bytes), and the tensor-core kernel's scales and zero points of one K slice (bytes; int4_mma.cuh:
// SliceGroups). With the x stage and the tile values a block then stays within 72 KB, so three of Pythia's
// 160-thread blocks still fit an SM.
constexpr int64_t kInt4StageBytes = 32 * 1024;
constexpr int64_t kInt4GroupStageBytes = 40 * 1024;
// Bytes of a block's x stage at p.splits K slices: the tensor-core kernel holds x in the activations' 2-byte dtype,
// in whole 4-row steps of its slice (int4_mma.cuh: mma_x_stage_bytes), the CUDA-core kernel in fp32. (The limit was
// 8192 elements for both, which at 4-8 rows cut Llama-3.1-8B's gate/up and down into more K slices than the SMs hold
// at once: patcher/ops/int4.py, splits_for, has what the 2-byte stage measured.)
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

namespace patcher {

// ---- The int4 decode step: one persistent kernel for every decoder layer (step.cuh) -----------------------------
// The decode step of a model whose decoder linears are all GPTQ int4 runs as one cooperative kernel of one block
// per SM: the layers' stages (add + norm + GEMVs, attention, GEMVs) meet at grid-wide barriers, and each block's
// producer warp streams its share of every stage's weights through a shared-memory ring with the copy engine,
// without waiting for the barriers, so HBM keeps streaming while the blocks meet. The host describes the step
// (StepDesc), plans it (plan_step: sizes and whether it fits), fills the device arrays (fill_step) and launches it
// (launch_step); the torch glue is step_bindings.cpp.

// One int4 linear of a layer as the host hands it over: the segments of one logical output (q | k | v, gate | up).
struct StepLinearDesc {
  Int4Segment seg[kInt4MaxSegments];
  int num_segments;
};

struct StepLayerDesc {
  StepLinearDesc qkv, out, mlp_in, mlp_out;
  const void* norm_weight[2];  // the input norm, the post-attention norm (GPT-NeoX: the two LayerNorms)
  const void* norm_bias[2];    // or nullptr
  void* k_cache;               // [batch, kv_heads, capacity, head_dim] of this layer
  void* v_cache;
};

struct StepDesc {
  DType dtype;  // of activations, norms and caches: fp16 or bf16
  int64_t batch, hidden, num_layers;
  const StepLayerDesc* layers;
  int64_t group_size;  // of every linear (no act-order); >= in_features for one group
  int32_t zero_offset;
  bool parallel_residual, rms;
  float eps;
  int32_t mlp_act;  // kActSiluMul (gate | up), kActGelu or kActGeluTanh
  int64_t num_q_heads, num_kv_heads, head_dim, rotary_dim, capacity, table_len;
  bool interleaved;  // GPT-NeoX's [head][q | k | v] projection layout
  float scale;
  int32_t attention_splits;  // most key shares per (row, kv head); 1..16
  const void* cos;           // [table_len, rotary_dim]
  const void* sin;
  const int64_t* slot;  // [1] device
  const int64_t* pad;   // [batch] device
  // The step's activation buffers (contiguous, dtype): resid[i] [batch, hidden] (resid[0] holds the embeddings
  // on entry), delta[0] the attention output projection, delta[1] the MLP's, qkv [batch, qkv width],
  // attn [batch, q_heads * head_dim], act [batch, intermediate].
  void* resid[2];
  void* delta[2];
  void* qkv;
  void* attn;
  void* act;
};

// A linear as the kernel reads it. Its output columns are cut into strips of 128 (4 column warps of 32; gate | up:
// 64 gate and the 64 up columns of the same outputs), and K into units of 256 (32 qweight rows): a unit is one
// strip x 256 k, one copy into the ring. The scalar fields (StepLinearInfo) are copied into shared memory at the
// start of each stage that runs the linear, so the unit loop reads none of them from global memory.
struct StepLinearInfo {
  const void* bias[kInt4MaxSegments];  // fp16 [n], or nullptr
  void* out;                           // [batch, out_width]
  float* partials;                     // [slots, batch, strips * 128]: a block's sums of a strip shared with others
  unsigned* flags;                     // [strips, slots]: set to the stage's tag once those partial sums are stored
  int32_t n[kInt4MaxSegments];
  int32_t strips_before[kInt4MaxSegments + 1];  // strips of the segments before each (gate | up: of the gate)
  int32_t num_segments, strips;
  int32_t k, k_units;       // K, and units of 256 k (the last one may be partly past K)
  int32_t unit_begin;       // its first unit in the stage's sequence (the linears' units one after the other)
  int32_t silu;             // gate | up, out = silu(gate) * up
  int32_t act;              // kActNone, kActGelu, kActGeluTanh
  int32_t x_offset, x_stride;  // its input in the stage's x area (elements): row b at x_offset + b * x_stride
  int32_t zero_offset;      // 1 for GPTQ v1
  int32_t group_shift;      // k >> group_shift is the group (>= 30: one group)
  int32_t groups_per_unit;  // rows of a unit's scale and zero boxes
  int32_t box_columns;      // columns of a scale box: 128, or 64 for gate | up (a box per half)
  int32_t scale_bytes, zero_bytes;  // of one box in the ring, 128-byte aligned
  int32_t slots;            // rows of partial sums a strip needs at most (blocks that share it)
  int32_t out_width;
};

struct StepLinear {  // aligned as CUtensorMap (the copy engine reads the maps in place)
  CUtensorMap qweight[kInt4MaxSegments];  // [k / 8, n] int32, boxes of 32 rows x 32 columns (128-byte swizzle)
  CUtensorMap scales[kInt4MaxSegments];   // [groups, n] fp16, boxes of groups_per_unit x box_columns
  CUtensorMap zeros[kInt4MaxSegments];    // [groups, n / 8] int32, boxes of groups_per_unit x box_columns / 8
  StepLinearInfo info;
};

struct StepNorm {
  const void* resid;   // [batch, hidden]: the residual stream before this add
  const void* delta;   // or nullptr (first layer)
  const void* delta2;  // or nullptr
  void* resid_out;     // the sum, written by block 0 where delta is set
  const void* weight;
  const void* bias;
  const void* weight2;  // GPT-NeoX's second LayerNorm, or nullptr
  const void* bias2;
};

struct StepAttention {
  void* k_cache;  // this layer's
  void* v_cache;
};

constexpr int kStepMaxLinears = 2;  // per stage

// One stage between two grid barriers: the attention of a layer (reading `qkv`, writing `attn`), or up to two
// linears, their inputs staged from plain buffers or by the stage's add + norm (over the hidden size).
struct StepStage {
  int32_t attention;  // 1: the stage is the attention
  StepAttention ad;
  int32_t num_linears;
  int32_t linear[kStepMaxLinears];  // indices into StepPlan::linears
  int32_t units;                    // of all its linears
  int32_t norm;                     // 0: inputs are buffers (x); 1: x0 = norm; 2: x0, x1 = GPT-NeoX's two LayerNorms
  StepNorm nd;
  const void* x[kStepMaxLinears];   // the plain input [batch, k] of the linear reading x index i, when norm == 0
};

// What a launch reads (passed by value); the stages and linears live in device memory (fill_step).
struct StepPlan {
  DType dtype;
  int32_t batch, hidden, num_stages, blocks, ring_slots, slot_bytes;
  // dynamic shared memory, from a 1024-byte boundary: the ring, then these
  int32_t x_offset, norm_offset, red_offset, attn_offset, smem_bytes;
  const StepStage* stages;
  const StepLinear* linears;
  int32_t rms;
  float eps;
  int32_t num_q_heads, num_kv_heads, head_dim, rotary_dim, interleaved, splits, qkv_width;
  int64_t capacity, table_len;
  float scale;
  const void* cos;
  const void* sin;
  const int64_t* slot;
  const int64_t* pad;
  const void* qkv;
  void* attn;
  float* attn_partials;    // [batch, q_heads, splits, head_dim + 2]
  int32_t* attn_counters;  // [batch, q_heads]
  unsigned long long* barrier;  // [arrivals, epoch, launches]
  // nullptr, or [blocks][stages][kStepMarks] %globaltimer readings of each block's thread 0 (step_timeline).
  unsigned long long* timeline;
  // Bounds for the timeline (PATCHER_STEP_BOUNDS; the results are then wrong): 1 skips the units' arithmetic,
  // 2 the weight copies (the producer only arrives), 3 both.
  int32_t bounds;
};
// A stage's timeline marks: its start (after the barrier), after the attention, after the inputs are staged,
// after the linears' units (the arrival at the next barrier); then the nanoseconds of the units' phase spent
// waiting for weights in the ring, and in the strips' meetings.
constexpr int kStepMarks = 6;

// The plan's sizes, or why the step kernel cannot take this model (reason set, cudaErrorNotSupported).
struct StepLayout {
  StepPlan plan;
  int64_t array_bytes;      // the stages and linears (device)
  int64_t workspace_bytes;  // barrier, counters and partial sums (device, zeroed once)
  int32_t final_resid;      // the resid buffer that holds the residual stream after the last layer
  const char* reason;
};
cudaError_t plan_step(const StepDesc& d, StepLayout& layout);
// Fills `host` (array_bytes, aligned as StepLinear) with the stages and linears as they will sit at `device_arrays`,
// with the workspace at `workspace`; the caller copies it there. Completes layout.plan.
cudaError_t fill_step(const StepDesc& d, StepLayout& layout, void* host, void* device_arrays, void* workspace);
cudaError_t launch_step(const StepPlan& plan, cudaStream_t stream);

}  // namespace patcher

