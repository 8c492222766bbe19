// The CUDA implementations of the GPTQ int4 ops (schemas: patcher/ops/int4_ops.py; kernels: int4/), a part of
// bindings.cpp, which includes it once and registers them.
//
// A GPTQ linear arrives as parallel lists (qweight, qzeros, scales, g_idx, bias), one entry per segment: the q, k
// and v projections of a layer, or gate and up, read side by side as one output without a concatenated copy.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "glue.h"
#include "int4/params.h"

namespace {

using namespace patcher_glue;
using TensorList = c10::ArrayRef<Tensor>;
using OptTensorList = const c10::List<std::optional<Tensor>>&;

// The segments' tensors, checked against x and against each other. Returns the input size K.
int64_t fill_segments(const Tensor& x, TensorList qweight, TensorList qzeros, TensorList scales, TensorList g_idx,
                      OptTensorList bias, int64_t group_size, bool act_order, patcher::Int4Segment* out) {
  const size_t count = qweight.size();
  TORCH_CHECK(count >= 1 && count <= patcher::kInt4MaxSegments, "patcher: int4 ops take 1 to ",
              std::to_string(patcher::kInt4MaxSegments), " weight segments, got ", std::to_string(count));
  TORCH_CHECK(qzeros.size() == count && scales.size() == count && g_idx.size() == count && bias.size() == count,
              "patcher: qweight, qzeros, scales, g_idx and bias must list the same number of segments");
  const int64_t K = qweight[0].size(0) * 8;
  TORCH_CHECK(act_order || (group_size > 0 && group_size % 8 == 0),
              "patcher: without act-order the group size must "
              "be a positive multiple of 8 (pass in_features for one group), got ",
              std::to_string(group_size));
  for (size_t s = 0; s < count; ++s) {
    const std::string seg = "segment " + std::to_string(s) + ": ";
    const Tensor& qw = qweight[s];
    TORCH_CHECK(qw.is_cuda() && qw.device() == x.device(), "patcher: ", seg, "qweight must be on ", x.device());
    TORCH_CHECK(qw.scalar_type() == at::kInt && qw.dim() == 2 && qw.is_contiguous(), "patcher: ", seg,
                "qweight must be a contiguous int32 [in_features / 8, out_features] tensor, got ", qw.scalar_type(),
                " ", dims(qw.sizes()));
    TORCH_CHECK(qw.size(0) * 8 == K, "patcher: ", seg, "in_features ", std::to_string(qw.size(0) * 8),
                " differs from segment 0's ", std::to_string(K));
    const int64_t n = qw.size(1);
    TORCH_CHECK(n % 8 == 0 && n > 0, "patcher: ", seg, "out_features must be a positive multiple of 8, got ",
                std::to_string(n));
    const int64_t groups = act_order ? scales[s].size(0) : (K + group_size - 1) / group_size;
    TORCH_CHECK(scales[s].is_cuda() && scales[s].device() == x.device() && scales[s].scalar_type() == at::kHalf &&
                    scales[s].dim() == 2 && scales[s].size(0) == groups && scales[s].size(1) == n &&
                    scales[s].is_contiguous(),
                "patcher: ", seg, "scales must be contiguous float16 [", std::to_string(groups), ", ",
                std::to_string(n), "], got ", scales[s].scalar_type(), " ", dims(scales[s].sizes()));
    TORCH_CHECK(qzeros[s].is_cuda() && qzeros[s].device() == x.device() && qzeros[s].scalar_type() == at::kInt &&
                    qzeros[s].dim() == 2 && qzeros[s].size(0) == groups && qzeros[s].size(1) == n / 8 &&
                    qzeros[s].is_contiguous(),
                "patcher: ", seg, "qzeros must be contiguous int32 [", std::to_string(groups), ", ",
                std::to_string(n / 8), "], got ", dims(qzeros[s].sizes()));
    TORCH_CHECK(g_idx[s].is_cuda() && g_idx[s].device() == x.device() && g_idx[s].scalar_type() == at::kInt &&
                    g_idx[s].dim() == 1 && g_idx[s].size(0) == K && g_idx[s].is_contiguous(),
                "patcher: ", seg, "g_idx must be contiguous int32 [", std::to_string(K), "]");
    const void* b = nullptr;
    const std::optional<Tensor> bs = bias.get(s);
    if (bs.has_value()) {
      TORCH_CHECK(bs->is_cuda() && bs->device() == x.device() && bs->scalar_type() == at::kHalf && bs->dim() == 1 &&
                      bs->size(0) == n && bs->is_contiguous(),
                  "patcher: ", seg, "bias must be contiguous float16 [", std::to_string(n), "]");
      b = bs->data_ptr();
    }
    out[s] = {qw.data_ptr<int32_t>(),
              qzeros[s].data_ptr<int32_t>(),
              scales[s].data_ptr(),
              g_idx[s].data_ptr<int32_t>(),
              b,
              n};
  }
  return K;
}

void check_x(const Tensor& x, int64_t K, const char* name) {
  TORCH_CHECK(x.is_cuda(), "patcher: ", name, " must be a CUDA tensor, got ", x.device());
  dtype_of(x);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "patcher: ", name, " ", dims(x.sizes()), " does not match the weight's ",
              "in_features ", std::to_string(K));
}

// The workspace of a split-K launch: [counters (kInt4Counters) | partials (splits * batch * N floats)].
void attach_workspace(patcher::Int4Params& p, Tensor& workspace) {
  const int64_t n_total = patcher::int4_total_width(p);
  const int64_t counters = patcher::kInt4Counters;
  TORCH_CHECK(patcher::int4_tiles(p) <= counters, "patcher: ", std::to_string(patcher::int4_tiles(p)),
              " column tiles exceed the int4 workspace's ", std::to_string(counters), " counters");
  const int64_t needed = counters + int64_t{p.splits} * p.batch * n_total;
  TORCH_CHECK(workspace.is_cuda() && workspace.scalar_type() == at::kInt && workspace.is_contiguous() &&
                  workspace.numel() >= needed,
              "patcher: the int4 workspace must be a zeroed contiguous int32 CUDA tensor of at least ",
              std::to_string(needed), " elements (patcher.ops.int4.workspace)");
  p.counters = workspace.data_ptr<int32_t>();
  p.partials = reinterpret_cast<float*>(workspace.data_ptr<int32_t>() + counters);
}

// Whether p.splits K slices fit the kernels' shared memory: the x stage and the tensor-core kernel's scales and zero
// points of a slice (int4/params.h: kInt4StageBytes, kInt4GroupStageBytes).
bool splits_fit(const patcher::Int4Params& p) {
  return patcher::int4_stage_bytes(p) <= patcher::kInt4StageBytes &&
         patcher::int4_group_stage_bytes(p) <= patcher::kInt4GroupStageBytes;
}

void check_splits(const patcher::Int4Params& p) {
  const int64_t rows = p.k / 8;
  TORCH_CHECK(p.splits >= 1 && p.splits <= rows, "patcher: splits must be in 1..", std::to_string(rows), ", got ",
              std::to_string(p.splits));
  TORCH_CHECK(splits_fit(p), "patcher: ", std::to_string(p.splits), " K slices do not fit the int4 kernel's shared ",
              "memory (x for batch x K / splits at most 32 KB, a slice's group parameters at most 40 KB); raise ",
              "splits (patcher.ops.int4.splits_for)");
}

void check_int4_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err != cudaErrorNotSupported, "patcher: ", op, ": the fused norm needs 16-byte aligned rows (x, delta, ",
              "norm weights) and hidden size <= 5120 (8192 for 128-wide tiles); use the separate norm op");
  check_launch(err, op);
}

// The decode ops' launch: `splits` K slices (checked against the shared x stage), the caller's workspace.
void launch_split(patcher::Int4Params& p, int64_t splits, Tensor& workspace, const char* op) {
  p.splits = static_cast<int32_t>(splits);
  check_splits(p);
  attach_workspace(p, workspace);
  check_int4_launch(patcher::launch_int4_gemv(p, c10::cuda::getCurrentCUDAStream()), op);
}

// The op's parameters from its weights and x; x_width: x's part of in_features (all of it but for int4_gemv_cat).
patcher::Int4Params base_params(const Tensor& x, TensorList qweight, TensorList qzeros, TensorList scales,
                                TensorList g_idx, OptTensorList bias, int64_t group_size, bool act_order,
                                int64_t zero_offset, int64_t x_width = -1) {
  patcher::Int4Params p{};
  p.num_segments = static_cast<int>(qweight.size());
  p.k = fill_segments(x, qweight, qzeros, scales, g_idx, bias, group_size, act_order, p.seg);
  check_x(x, x_width < 0 ? p.k : x_width, "x");
  TORCH_CHECK(zero_offset == 0 || zero_offset == 1, "patcher: zero_offset must be 1 (GPTQ v1) or 0 (v2)");
  p.dtype = dtype_of(x);
  p.group_size = act_order ? 1 : group_size;
  p.act_order = act_order;
  p.zero_offset = static_cast<int32_t>(zero_offset);
  p.batch = x.numel() / x.size(-1);
  return p;
}

// The matrix-vector kernel's input: 1 to 8 rows of x with one row stride.
void matrix_vector_input(patcher::Int4Params& p, const Tensor& x) {
  TORCH_CHECK(p.batch >= 1 && p.batch <= 8, "patcher: int4 matrix-vector ops take 1 to 8 rows of x, got ",
              std::to_string(p.batch), " (int4_linear handles any number)");
  p.x = x.data_ptr();
  p.x_stride = row_stride(x, "x");
}

// The matrix-vector params of an op behind the add + norm prologue (int4_gemv and the decode step's QKV and MLP
// ops), with that prologue's outputs.
std::tuple<patcher::Int4Params, Prologue> norm_params(const Tensor& x, const OptTensor& delta, const OptTensor& delta2,
                                                      const OptTensor& norm_weight, const OptTensor& norm_bias,
                                                      const OptTensor& norm_weight2, const OptTensor& norm_bias2,
                                                      double eps, bool rms, TensorList qweight, TensorList qzeros,
                                                      TensorList scales, TensorList g_idx, OptTensorList bias,
                                                      int64_t group_size, bool act_order, int64_t zero_offset) {
  patcher::Int4Params p = base_params(x, qweight, qzeros, scales, g_idx, bias, group_size, act_order, zero_offset);
  matrix_vector_input(p, x);
  Prologue pro =
      fill_prologue(p.norm, x, p.k, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps, rms, true);
  return {p, pro};
}

// The int4 ops' add + norm prologue as its own kernel (the decode step runs it in front of the int4 op that reads
// the norm): (h, sum, h2), as those ops' prologue computes them.
std::tuple<Tensor, Tensor, Tensor> int4_norm_prologue(const Tensor& x, const OptTensor& delta, const OptTensor& delta2,
                                                      const OptTensor& norm_weight, const OptTensor& norm_bias,
                                                      const OptTensor& norm_weight2, const OptTensor& norm_bias2,
                                                      double eps, bool rms) {
  TORCH_CHECK(x.is_cuda(), "patcher: x must be a CUDA tensor, got ", x.device());
  TORCH_CHECK(x.dim() == 2, "patcher: x must be [batch, hidden] (one token per row), got ", dims(x.sizes()));
  TORCH_CHECK(norm_weight.has_value(), "patcher: int4_norm_prologue needs norm_weight");
  const c10::cuda::CUDAGuard guard(x.device());
  patcher::Int4Params p{};
  p.k = x.size(1);
  check_x(x, p.k, "x");
  p.dtype = dtype_of(x);
  p.batch = x.size(0);
  matrix_vector_input(p, x);
  Prologue pro =
      fill_prologue(p.norm, x, p.k, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps, rms, true);
  Tensor h = at::empty(x.sizes(), x.options());
  check_int4_launch(patcher::launch_int4_norm_prologue(p, h.data_ptr(), c10::cuda::getCurrentCUDAStream()),
                    "int4_norm_prologue");
  return {h, pro.sum, pro.h2};
}

int32_t activation_code(c10::string_view activation, int num_segments) {
  if (activation == "none") return patcher::kActNone;
  if (activation == "gelu") return patcher::kActGelu;
  if (activation == "gelu_tanh") return patcher::kActGeluTanh;
  if (activation == "silu_mul") {
    TORCH_CHECK(num_segments == 2, "patcher: silu_mul takes two segments (gate, up)");
    return patcher::kActSiluMul;
  }
  TORCH_CHECK(false, "patcher: activation must be none, gelu, gelu_tanh or silu_mul, got ", activation);
}

std::tuple<Tensor, Tensor, Tensor> int4_gemv(const Tensor& x, const OptTensor& delta, const OptTensor& delta2,
                                             const OptTensor& norm_weight, const OptTensor& norm_bias,
                                             const OptTensor& norm_weight2, const OptTensor& norm_bias2, double eps,
                                             bool rms, TensorList qweight, TensorList qzeros, TensorList scales,
                                             TensorList g_idx, OptTensorList bias, int64_t group_size, bool act_order,
                                             int64_t zero_offset, c10::string_view activation, int64_t splits,
                                             Tensor& workspace) {
  TORCH_CHECK(x.is_cuda(), "patcher: x must be a CUDA tensor, got ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  auto [p, pro] = norm_params(x, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps, rms, qweight,
                              qzeros, scales, g_idx, bias, group_size, act_order, zero_offset);
  const int32_t act = activation_code(activation, p.num_segments);
  p.epilogue = act == patcher::kActSiluMul ? patcher::kInt4SiluMul : patcher::kInt4Store;
  p.act = act == patcher::kActSiluMul ? patcher::kActNone : act;
  if (p.epilogue == patcher::kInt4SiluMul) {
    TORCH_CHECK(p.seg[0].n == p.seg[1].n, "patcher: silu_mul needs gate and up of equal width");
  }
  const int64_t n_out = p.epilogue == patcher::kInt4SiluMul ? p.seg[0].n : patcher::int4_total_width(p);
  auto sizes = x.sizes().vec();
  sizes.back() = n_out;
  Tensor out = at::empty(sizes, x.options());
  p.out = out.data_ptr();
  launch_split(p, splits, workspace, "int4_gemv");
  return {out, pro.sum, pro.h2};
}

// The parameters of a linear over [x | x2] (x [batch, k1], x2 [batch, k - k1]; or x alone where x2 is absent), as
// GPT-NeoX's attention output and MLP hidden through its two output projections stacked along k. x2_early: x2 was
// written before the stream's previous kernel began (Int4Params::x2_early; the caller's promise).
patcher::Int4Params cat_params(const Tensor& x, const OptTensor& x2, TensorList qweight, TensorList qzeros,
                               TensorList scales, TensorList g_idx, OptTensorList bias, int64_t group_size,
                               bool act_order, int64_t zero_offset, bool x2_early, const char* op) {
  if (!x2.has_value()) {
    TORCH_CHECK(!x2_early, "patcher: ", op, ": x2_early needs x2");
    patcher::Int4Params p = base_params(x, qweight, qzeros, scales, g_idx, bias, group_size, act_order, zero_offset);
    matrix_vector_input(p, x);
    return p;
  }
  TORCH_CHECK(x2->is_cuda() && x2->device() == x.device(), "patcher: x and x2 must be CUDA tensors on one device, ",
              "got ", x.device(), " and ", x2->device());
  TORCH_CHECK(x.dim() == 2 && x2->dim() == 2 && x2->size(0) == x.size(0) && x2->scalar_type() == x.scalar_type(),
              "patcher: ", op, " takes x [batch, k1] and x2 [batch, k2] of one dtype, got ", x.scalar_type(), " ",
              dims(x.sizes()), " and ", x2->scalar_type(), " ", dims(x2->sizes()));
  const int64_t k1 = x.size(1);
  TORCH_CHECK(k1 % 8 == 0 && k1 > 0, "patcher: ", op, " needs x's width a positive multiple of 8, got ",
              std::to_string(k1));
  patcher::Int4Params p = base_params(x, qweight, qzeros, scales, g_idx, bias, group_size, act_order, zero_offset, k1);
  TORCH_CHECK(k1 + x2->size(1) == p.k, "patcher: x and x2 widths ", std::to_string(k1), " + ",
              std::to_string(x2->size(1)), " do not add up to the weight's in_features ", std::to_string(p.k));
  matrix_vector_input(p, x);
  p.x2 = x2->data_ptr();
  p.x2_stride = row_stride(*x2, "x2");
  p.x2_k = k1;
  p.x2_early = x2_early;
  return p;
}

// out = [x | x2] @ W + bias (cat_params).
Tensor int4_gemv_cat(const Tensor& x, const Tensor& x2, TensorList qweight, TensorList qzeros, TensorList scales,
                     TensorList g_idx, OptTensorList bias, int64_t group_size, bool act_order, int64_t zero_offset,
                     int64_t splits, Tensor& workspace, bool x2_early) {
  TORCH_CHECK(x.is_cuda(), "patcher: x must be a CUDA tensor, got ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  patcher::Int4Params p = cat_params(x, x2, qweight, qzeros, scales, g_idx, bias, group_size, act_order, zero_offset,
                                     x2_early, "int4_gemv_cat");
  p.epilogue = patcher::kInt4Store;
  p.act = patcher::kActNone;
  Tensor out = at::empty({x.size(0), patcher::int4_total_width(p)}, x.options());
  p.out = out.data_ptr();
  launch_split(p, splits, workspace, "int4_gemv_cat");
  return out;
}

// acc += [x | x2] @ W in fixed point (cat_params; x2 optional), with the meeting of the K slices left to the op that
// reads acc as its norm prologue's delta (Int4Params::acc). No bias: the caller hands it to that prologue as delta2.
// `clear`, when given, is zeroed once this op's inputs are ready (Int4Params::clear).
// The accumulator side of int4_gemv_acc and int4_norm_gemv_acc: no bias (the reader of acc adds it, as its
// prologue's delta2 or decode_attention_qkv_acc's bias_rows), acc [batch, width] int64, `clear` zeroed, and at most
// 2047 terms into an accumulator; then the launch.
void launch_acc(patcher::Int4Params& p, const Tensor& x, OptTensorList bias, int64_t splits, Tensor& workspace,
                Tensor& acc, const OptTensor& clear, const char* op) {
  for (size_t s = 0; s < bias.size(); ++s) {
    TORCH_CHECK(!bias.get(s).has_value(), "patcher: ", op, " adds no bias (the reader of acc adds it, as its ",
                "prologue's delta2); pass None for every segment");
  }
  p.epilogue = patcher::kInt4Store;
  p.act = patcher::kActNone;
  const int64_t n = patcher::int4_total_width(p);
  TORCH_CHECK(acc.is_cuda() && acc.device() == x.device() && acc.scalar_type() == at::kLong && acc.is_contiguous() &&
                  acc.dim() == 2 && acc.size(0) == p.batch && acc.size(1) == n,
              "patcher: acc must be a contiguous int64 [", std::to_string(p.batch), ", ", std::to_string(n),
              "] tensor on ", x.device(), ", got ", acc.scalar_type(), " ", dims(acc.sizes()));
  p.acc = acc.data_ptr<int64_t>();
  if (clear.has_value()) {
    TORCH_CHECK(clear->is_cuda() && clear->device() == x.device() && clear->scalar_type() == at::kLong &&
                    clear->is_contiguous(),
                "patcher: clear must be a contiguous int64 tensor on ", x.device());
    TORCH_CHECK(!clear->is_same(acc), "patcher: clear must not be acc");
    p.clear = clear->data_ptr<int64_t>();
    p.clear_count = clear->numel();
  }
  // Each K slice of a tile adds one term of at most 2^52 (kernels/common.cuh: to_fixed).
  p.splits = static_cast<int32_t>(splits);
  TORCH_CHECK(splits < 2048, "patcher: ", op, " adds at most 2047 terms (K slices) into an accumulator; got splits ",
              std::to_string(splits));
  launch_split(p, splits, workspace, op);
}

void int4_gemv_acc(const Tensor& x, const OptTensor& x2, TensorList qweight, TensorList qzeros, TensorList scales,
                   TensorList g_idx, OptTensorList bias, int64_t group_size, bool act_order, int64_t zero_offset,
                   int64_t splits, Tensor& workspace, Tensor& acc, const OptTensor& clear, bool x2_early,
                   bool feeds_attention) {
  TORCH_CHECK(x.is_cuda(), "patcher: x must be a CUDA tensor, got ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  patcher::Int4Params p = cat_params(x, x2, qweight, qzeros, scales, g_idx, bias, group_size, act_order, zero_offset,
                                     x2_early, "int4_gemv_acc");
  p.feeds_attention = feeds_attention;
  launch_acc(p, x, bias, splits, workspace, acc, clear, "int4_gemv_acc");
}

// int4_gemv_acc behind the add + norm prologue of int4_gemv (one input, no second one): the decode step's QKV
// projection whose sums decode_attention_qkv_acc finishes. Returns (sum, h2) as int4_gemv does.
std::tuple<Tensor, Tensor> int4_norm_gemv_acc(const Tensor& x, const OptTensor& delta, const OptTensor& delta2,
                                              const OptTensor& norm_weight, const OptTensor& norm_bias,
                                              const OptTensor& norm_weight2, const OptTensor& norm_bias2, double eps,
                                              bool rms, TensorList qweight, TensorList qzeros, TensorList scales,
                                              TensorList g_idx, OptTensorList bias, int64_t group_size, bool act_order,
                                              int64_t zero_offset, int64_t splits, Tensor& workspace, Tensor& acc,
                                              const OptTensor& clear) {
  TORCH_CHECK(x.is_cuda(), "patcher: x must be a CUDA tensor, got ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  auto [p, pro] = norm_params(x, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps, rms, qweight,
                              qzeros, scales, g_idx, bias, group_size, act_order, zero_offset);
  p.feeds_attention = true;  // the QKV projection: decode_attention_qkv_acc runs next
  launch_acc(p, x, bias, splits, workspace, acc, clear, "int4_norm_gemv_acc");
  return {pro.sum, pro.h2};
}

// The attention prologue of int4_qkv_rope_cache and int4_qkv_mlp_in: p's segments [0, qkv_segments) are q | k | v
// (whole heads), whose tiles apply RoPE and write K/V into the caches; returns q [batch, Hq, D].
Tensor rope_cache_epilogue(patcher::Int4Params& p, const Tensor& x, int qkv_segments, const Tensor& cos,
                           const Tensor& sin, const Tensor& slot, const Tensor& pad, Tensor& k_cache, Tensor& v_cache,
                           int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, bool interleaved,
                           const char* op) {
  TORCH_CHECK(x.dim() == 2, "patcher: x must be [batch, hidden] (one token per row), got ", dims(x.sizes()));
  TORCH_CHECK(head_dim > 0 && head_dim % 4 == 0 && head_dim <= 256, "patcher: ", op,
              " needs head_dim a positive multiple of 4, at most 256; got ", std::to_string(head_dim));
  int64_t width = 0;
  for (int s = 0; s < qkv_segments; ++s) {
    TORCH_CHECK(p.seg[s].n % head_dim == 0, "patcher: every q/k/v segment must be whole heads of ",
                std::to_string(head_dim));
    width += p.seg[s].n;
  }
  Tensor q = rope_cache_target(p.rope, x, p.batch, width, cos, sin, slot, pad, k_cache, v_cache, num_q_heads,
                               num_kv_heads, head_dim, interleaved);
  p.epilogue = patcher::kInt4RopeCache;
  p.act = patcher::kActNone;
  p.out = q.data_ptr();
  return q;
}

std::tuple<Tensor, Tensor, Tensor> int4_qkv_rope_cache(
    const Tensor& x, const OptTensor& delta, const OptTensor& delta2, const OptTensor& norm_weight,
    const OptTensor& norm_bias, const OptTensor& norm_weight2, const OptTensor& norm_bias2, double eps, bool rms,
    TensorList qweight, TensorList qzeros, TensorList scales, TensorList g_idx, OptTensorList bias, int64_t group_size,
    bool act_order, int64_t zero_offset, const Tensor& cos, const Tensor& sin, const Tensor& slot, const Tensor& pad,
    Tensor& k_cache, Tensor& v_cache, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, bool interleaved,
    int64_t splits, Tensor& workspace) {
  TORCH_CHECK(x.is_cuda(), "patcher: x must be a CUDA tensor, got ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  auto [p, pro] = norm_params(x, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps, rms, qweight,
                              qzeros, scales, g_idx, bias, group_size, act_order, zero_offset);
  Tensor q = rope_cache_epilogue(p, x, p.num_segments, cos, sin, slot, pad, k_cache, v_cache, num_q_heads, num_kv_heads,
                                 head_dim, interleaved, "int4_qkv_rope_cache");
  launch_split(p, splits, workspace, "int4_qkv_rope_cache");
  return {q, pro.sum, pro.h2};
}

// GPT-NeoX's parallel residual in one launch: the residual add and both LayerNorms, then the QKV projection of the
// first (RoPE, K/V into the caches) and the MLP's input projection of the second (with its GELU): segments
// [0, qkv_segments) are q | k | v, the rest the MLP's. Returns (q [batch, Hq, D], hidden [batch, MLP width], sum).
// Or, without the norm prologue, x and x2 are the two LayerNorms' outputs (int4_norm_prologue's h and h2), and sum
// is empty.
std::tuple<Tensor, Tensor, Tensor> int4_qkv_mlp_in(
    const Tensor& x, const OptTensor& delta, const OptTensor& delta2, const OptTensor& norm_weight,
    const OptTensor& norm_bias, const OptTensor& norm_weight2, const OptTensor& norm_bias2, double eps, bool rms,
    TensorList qweight, TensorList qzeros, TensorList scales, TensorList g_idx, OptTensorList bias, int64_t group_size,
    bool act_order, int64_t zero_offset, const Tensor& cos, const Tensor& sin, const Tensor& slot, const Tensor& pad,
    Tensor& k_cache, Tensor& v_cache, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, bool interleaved,
    int64_t qkv_segments, c10::string_view activation, int64_t splits, Tensor& workspace, const OptTensor& x2) {
  TORCH_CHECK(x.is_cuda(), "patcher: x must be a CUDA tensor, got ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  auto [p, pro] = norm_params(x, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps, rms, qweight,
                              qzeros, scales, g_idx, bias, group_size, act_order, zero_offset);
  TORCH_CHECK(qkv_segments >= 1 && qkv_segments < p.num_segments, "patcher: int4_qkv_mlp_in needs 1 to ",
              std::to_string(p.num_segments - 1), " q/k/v segments followed by the MLP's, got qkv_segments ",
              std::to_string(qkv_segments), " of ", std::to_string(p.num_segments));
  if (x2.has_value()) {
    TORCH_CHECK(!norm_weight.has_value(), "patcher: int4_qkv_mlp_in takes x2 only without the norm prologue");
    check_like(*x2, x, "x2");
    TORCH_CHECK(x2->sizes() == x.sizes(), "patcher: x2 ", dims(x2->sizes()), " must match x ", dims(x.sizes()));
    p.x2 = x2->data_ptr();  // read whole by the MLP's tiles (Int4Params::second)
    p.x2_stride = row_stride(*x2, "x2");
  } else {
    TORCH_CHECK(norm_weight.has_value() && norm_weight2.has_value() && !rms,
                "patcher: int4_qkv_mlp_in takes both LayerNorms (norm_weight and norm_weight2), or their outputs as x "
                "and x2");
  }
  p.norm.h2 = nullptr;  // the MLP's tiles normalize with the second LayerNorm themselves
  Tensor q = rope_cache_epilogue(p, x, static_cast<int>(qkv_segments), cos, sin, slot, pad, k_cache, v_cache,
                                 num_q_heads, num_kv_heads, head_dim, interleaved, "int4_qkv_mlp_in");
  const int32_t act = activation_code(activation, p.num_segments);
  TORCH_CHECK(act != patcher::kActSiluMul, "patcher: int4_qkv_mlp_in takes none, gelu or gelu_tanh");
  p.second = static_cast<int32_t>(qkv_segments);
  p.act2 = act;
  Tensor hidden =
      at::empty({p.batch, patcher::int4_total_width(p) - patcher::segment_offset(p, p.second)}, x.options());
  p.out2 = hidden.data_ptr();
  launch_split(p, splits, workspace, "int4_qkv_mlp_in");
  return {q, hidden, pro.sum};
}

// Any number of rows: up to 8 through the matrix-vector kernel (workspace allocated here), more through a
// dequantized weight and cuBLAS. Segments are concatenated along the output.
Tensor int4_linear(const Tensor& x, TensorList qweight, TensorList qzeros, TensorList scales, TensorList g_idx,
                   OptTensorList bias, int64_t group_size, bool act_order, int64_t zero_offset) {
  TORCH_CHECK(x.is_cuda(), "patcher: x must be a CUDA tensor, got ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  patcher::Int4Params p = base_params(x, qweight, qzeros, scales, g_idx, bias, group_size, act_order, zero_offset);
  const int64_t K = p.k;
  const int64_t n_total = patcher::int4_total_width(p);
  auto sizes = x.sizes().vec();
  sizes.back() = n_total;
  if (p.batch >= 1 && p.batch <= 8) {
    matrix_vector_input(p, x);
    p.epilogue = patcher::kInt4Store;
    p.act = patcher::kActNone;
    // A fixed split for this path (the decode step picks its own from the GPU's size): enough blocks for any GPU.
    const int64_t k_rows = K / 8;
    p.splits = static_cast<int32_t>((k_rows + 63) / 64);
    while (!splits_fit(p)) ++p.splits;
    Tensor out = at::empty(sizes, x.options());
    p.out = out.data_ptr();
    Tensor workspace = at::zeros({patcher::kInt4Counters + int64_t{p.splits} * p.batch * n_total},
                                 x.options().dtype(at::kInt));
    attach_workspace(p, workspace);
    check_launch(patcher::launch_int4_gemv(p, c10::cuda::getCurrentCUDAStream()), "int4_linear");
    return out;
  }
  Tensor weight = at::empty({K, n_total}, x.options());
  int64_t column = 0;
  for (int s = 0; s < p.num_segments; ++s) {
    patcher::Int4DequantParams d{};
    d.dtype = p.dtype;
    d.k = K;
    d.seg = p.seg[s];
    d.group_size = p.group_size;
    d.act_order = p.act_order;
    d.zero_offset = p.zero_offset;
    d.out = static_cast<char*>(weight.data_ptr()) + column * weight.element_size();
    d.out_stride = n_total;
    check_launch(patcher::launch_int4_dequantize(d, c10::cuda::getCurrentCUDAStream()), "int4_dequantize");
    column += p.seg[s].n;
  }
  Tensor out = at::matmul(x, weight);
  column = 0;
  for (int s = 0; s < p.num_segments; ++s) {  // GPTQLinear adds the bias after the matmul, in the dtype
    const std::optional<Tensor> b = bias.get(s);
    if (b.has_value()) out.narrow(-1, column, p.seg[s].n).add_(b->to(x.scalar_type()));
    column += p.seg[s].n;
  }
  return out;
}

}  // namespace
