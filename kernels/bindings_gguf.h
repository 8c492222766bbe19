// The CUDA implementations of the GGUF ops (schemas and references: patcher/ops/gguf.py; kernels: gguf/), a part of
// bindings.cpp, which includes it once and registers them.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "glue.h"
#include "gguf/params.h"

namespace {

using namespace patcher_glue;
using TensorList = c10::ArrayRef<Tensor>;
using OptTensorList = const c10::List<std::optional<Tensor>>&;

int32_t gguf_kind(c10::string_view kind, const char* op = "gguf_gemv") {
  if (kind == "Q4_0") return patcher::kGgufQ4_0;
  if (kind == "Q4_1") return patcher::kGgufQ4_1;
  if (kind == "Q8_0") return patcher::kGgufQ8_0;
  if (kind == "Q4_K") return patcher::kGgufQ4_K;
  if (kind == "Q5_K") return patcher::kGgufQ5_K;
  if (kind == "Q6_K") return patcher::kGgufQ6_K;
  TORCH_CHECK(false, "patcher: ", op, " takes Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K blocks, got '", std::string(kind),
              "' (other types run the reference: patcher.gguf.reference)");
}

// One GGUF weight of a product, checked against x: its segment of the launch, writing columns from out_col.
patcher::GgufSegment gguf_segment(const Tensor& x, const Tensor& blocks, c10::string_view kind, const OptTensor& bias,
                                  int64_t out_col) {
  patcher::GgufSegment g{};
  g.kind = gguf_kind(kind);
  const int64_t bytes = patcher::gguf_block_bytes(g.kind), values = patcher::gguf_block_values(g.kind);
  TORCH_CHECK(blocks.is_cuda() && blocks.device() == x.device(), "patcher: blocks must be on ", x.device(),
              ", got ", blocks.device());
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2, "patcher: blocks must be uint8 [out_features, ",
              "in_features / ", std::to_string(values), " * ", std::to_string(bytes), "], got ", blocks.scalar_type(),
              " ", dims(blocks.sizes()));
  TORCH_CHECK(blocks.is_contiguous(), "patcher: blocks must be contiguous, got strides ", dims(blocks.strides()));
  TORCH_CHECK(blocks.size(1) > 0 && blocks.size(1) % bytes == 0, "patcher: ", std::string(kind), " rows of ",
              std::to_string(blocks.size(1)), " bytes are not whole ", std::to_string(bytes), "-byte blocks");
  TORCH_CHECK((reinterpret_cast<uintptr_t>(blocks.data_ptr()) & 1) == 0,
              "patcher: blocks must start at an even address (their fp16 scales are read as 2-byte words)");
  const int64_t k = blocks.size(1) / bytes * values;
  TORCH_CHECK(x.size(-1) % values == 0, "patcher: gguf_gemv needs in_features to be a multiple of ",
              std::to_string(values), " (one ", std::string(kind), " block), got ", std::to_string(x.size(-1)));
  TORCH_CHECK(x.size(-1) == k, "patcher: x ", dims(x.sizes()), " does not match the weight's in_features ",
              std::to_string(k));
  g.n = blocks.size(0);
  g.blocks = static_cast<const uint8_t*>(blocks.data_ptr());
  g.row_bytes = blocks.size(1);
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_cuda() && bias->device() == x.device(), "patcher: bias must be on ", x.device(), ", got ",
                bias->device());
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == g.n && bias->stride(0) == 1, "patcher: bias must be a ",
                "contiguous [", std::to_string(g.n), "] tensor, got ", dims(bias->sizes()));
    g.bias = bias->data_ptr();
    g.bias_dtype = dtype_of(*bias);
  }
  g.out_col = out_col;
  return g;
}

// The block types of a comma-separated `kinds` ("Q4_K,Q4_K,Q6_K"), in order.
std::vector<c10::string_view> split_kinds(c10::string_view kinds) {
  std::vector<c10::string_view> kind;
  for (size_t at = 0;;) {
    const size_t comma = kinds.find(',', at);
    kind.push_back(kinds.substr(at, comma == c10::string_view::npos ? c10::string_view::npos : comma - at));
    if (comma == c10::string_view::npos) break;
    at = comma + 1;
  }
  return kind;
}

// A checked gguf_gemv_cat launch: its parameters, output and workspace (on x's device: the caller holds its guard).
struct GgufLaunch {
  patcher::GgufGemvParams p;
  Tensor out, work;
};

GgufLaunch gguf_launch(const Tensor& x, TensorList blocks, c10::string_view kinds, OptTensorList biases,
                       bool quantize_activations) {
  TORCH_CHECK(x.is_cuda(), "patcher: x must be a CUDA tensor, got ", x.device());
  TORCH_CHECK(x.dim() >= 1, "patcher: x must have at least one dimension");
  const int64_t count = static_cast<int64_t>(blocks.size());
  TORCH_CHECK(count >= 1 && count <= patcher::kGgufMaxSegments, "patcher: gguf_gemv_cat takes 1 to ",
              std::to_string(patcher::kGgufMaxSegments), " weights, got ", std::to_string(count));
  const std::vector<c10::string_view> kind = split_kinds(kinds);
  TORCH_CHECK(static_cast<int64_t>(kind.size()) == count && static_cast<int64_t>(biases.size()) == count,
              "patcher: gguf_gemv_cat needs a kind (comma-separated) and a bias (or None) for each of its ",
              std::to_string(count), " weights, got '", std::string(kinds), "' and ", std::to_string(biases.size()),
              " biases");
  patcher::GgufGemvParams p{};
  p.dtype = dtype_of(x);
  p.quantize_activations = quantize_activations;
  p.segments = static_cast<int32_t>(count);
  int64_t cols = 0;
  for (int64_t i = 0; i < count; ++i) {
    p.seg[i] = gguf_segment(x, blocks[i], kind[i], biases[i], cols);
    cols += p.seg[i].n;
  }
  p.k = x.size(-1);
  p.batch = x.numel() / std::max<int64_t>(p.k, 1);
  TORCH_CHECK(p.batch <= patcher::kGgufMaxBatch, "patcher: gguf_gemv takes 1 to 8 rows of x (a decode step), got ",
              std::to_string(p.batch), "; more rows run the reference (dequantize + matmul)");
  p.x = x.data_ptr();
  p.x_stride = row_stride(x, "x");
  auto sizes = x.sizes().vec();
  sizes.back() = cols;
  Tensor out = at::empty(sizes, x.options());
  p.out = out.data_ptr();
  p.out_stride = cols;
  Tensor work = at::empty({patcher::gguf_gemv_work_bytes(p.batch, p.k, quantize_activations)},
                          x.options().dtype(at::kByte));
  p.work = work.data_ptr();
  return {p, out, work};
}

// [x @ W_0^T (+ b_0) | x @ W_1^T (+ b_1) | ...] [..., sum N_i] for the 1 to 8 rows of a decode step, each W_i the
// GGUF rows blocks[i] [N_i, K / block values * block bytes] as GGUFLinear holds them, of the i-th of the
// comma-separated `kinds`.
Tensor gguf_gemv_cat(const Tensor& x, TensorList blocks, c10::string_view kinds, OptTensorList biases,
                     bool quantize_activations) {
  TORCH_CHECK(x.is_cuda(), "patcher: x must be a CUDA tensor, got ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  GgufLaunch l = gguf_launch(x, blocks, kinds, biases, quantize_activations);
  check_launch(patcher::launch_gguf_gemv(l.p, c10::cuda::getCurrentCUDAStream()), "gguf_gemv");
  return l.out;
}

// gguf_gemv_cat(silu_and_mul(gate_up)) for the 1 to 8 rows of a decode step, gate_up [..., 2K] a gated MLP's
// [gate | up]: the input kernel takes the activation's values itself (GgufGemvParams::silu_mul_input).
Tensor gguf_silu_mul_gemv_cat(const Tensor& gate_up, TensorList blocks, c10::string_view kinds, OptTensorList biases,
                              bool quantize_activations) {
  TORCH_CHECK(gate_up.is_cuda(), "patcher: gate_up must be a CUDA tensor, got ", gate_up.device());
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "patcher: gate_up must be [..., 2 * in_features] ",
              "([gate | up]), got ", dims(gate_up.sizes()));
  const c10::cuda::CUDAGuard guard(gate_up.device());
  GgufLaunch l = gguf_launch(gate_up.narrow(-1, 0, gate_up.size(-1) / 2), blocks, kinds, biases, quantize_activations);
  l.p.silu_mul_input = true;
  check_launch(patcher::launch_gguf_gemv(l.p, c10::cuda::getCurrentCUDAStream()), "gguf_gemv");
  return l.out;
}

// y [..., N] = x [..., K] . W^T (+ bias) for the 1 to 8 rows of a decode step, W the GGUF rows `blocks`
// [N, K / block values * block bytes] as GGUFLinear holds them (blocks of 32 values, super-blocks of 256 for the
// K-quants).
Tensor gguf_gemv(const Tensor& x, const Tensor& blocks, c10::string_view kind, const OptTensor& bias,
                 bool quantize_activations) {
  const std::vector<Tensor> one{blocks};
  c10::List<std::optional<Tensor>> biases;
  biases.push_back(bias);
  return gguf_gemv_cat(x, one, kind, biases, quantize_activations);
}

// p's kind, n, k, blocks and row_bytes for the GGUF rows `blocks` [N, K / block values * block bytes] of `kind`.
void dequantize_params(patcher::GgufDequantizeParams& p, const Tensor& blocks, c10::string_view kind) {
  p.kind = gguf_kind(kind, "gguf_dequantize");
  const int64_t bytes = patcher::gguf_block_bytes(p.kind), values = patcher::gguf_block_values(p.kind);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "patcher: blocks must be contiguous uint8 [out_features, bytes per row], got ", blocks.scalar_type(),
              " ", dims(blocks.sizes()));
  TORCH_CHECK(blocks.size(1) > 0 && blocks.size(1) % bytes == 0, "patcher: ", std::string(kind), " rows of ",
              std::to_string(blocks.size(1)), " bytes are not whole ", std::to_string(bytes), "-byte blocks");
  TORCH_CHECK((reinterpret_cast<uintptr_t>(blocks.data_ptr()) & 1) == 0,
              "patcher: blocks must start at an even address (their fp16 scales are read as 2-byte words)");
  p.n = blocks.size(0);
  p.k = blocks.size(1) / bytes * values;
  p.blocks = static_cast<const uint8_t*>(blocks.data_ptr());
  p.row_bytes = blocks.size(1);
}

// Several GGUF weights of one K (a projection's modules, each of its own type; `kinds` comma-separated) dequantized
// to dtype into one [sum of their N, K], one after another along the rows: the prefill path's weight for one GEMM.
Tensor gguf_dequantize_cat(TensorList blocks, c10::string_view kinds, at::ScalarType dtype) {
  TORCH_CHECK(!blocks.empty(), "patcher: gguf_dequantize_cat needs at least one weight");
  TORCH_CHECK(blocks[0].is_cuda(), "patcher: blocks must be CUDA tensors, got ", blocks[0].device());
  const c10::cuda::CUDAGuard guard(blocks[0].device());
  const std::vector<c10::string_view> kind = split_kinds(kinds);
  TORCH_CHECK(kind.size() == blocks.size(), "patcher: gguf_dequantize_cat needs a kind (comma-separated) for each of ",
              "its ", std::to_string(blocks.size()), " weights, got '", std::string(kinds), "'");
  std::vector<patcher::GgufDequantizeParams> parts(blocks.size());
  int64_t rows = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    TORCH_CHECK(blocks[i].device() == blocks[0].device(), "patcher: blocks must be on one device, got ",
                blocks[i].device(), " and ", blocks[0].device());
    dequantize_params(parts[i], blocks[i], kind[i]);
    TORCH_CHECK(parts[i].k == parts[0].k, "patcher: gguf_dequantize_cat's weights must share K, got ",
                std::to_string(parts[i].k), " and ", std::to_string(parts[0].k));
    rows += parts[i].n;
  }
  Tensor out = at::empty({rows, parts[0].k}, blocks[0].options().dtype(dtype));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  int64_t row = 0;
  for (patcher::GgufDequantizeParams& p : parts) {
    p.dtype = dtype_of(out);
    p.out = static_cast<char*>(out.data_ptr()) + row * p.k * static_cast<int64_t>(out.element_size());
    check_launch(patcher::launch_gguf_dequantize(p, stream), "gguf_dequantize");
    row += p.n;
  }
  return out;
}

// The GGUF rows `blocks` [N, K / block values * block bytes] dequantized to dtype [N, K]: the prefill path's
// weights for a GEMM.
Tensor gguf_dequantize(const Tensor& blocks, c10::string_view kind, at::ScalarType dtype) {
  const std::vector<Tensor> one{blocks};
  return gguf_dequantize_cat(one, kind, dtype);
}

// x [..., K] rounded through Q8_1 blocks of 32 (q * d in x's dtype): the prefill path's W4A8 activations. silu_mul:
// x is [gate | up] [..., 2K], and the values rounded are silu_and_mul(x) [..., K].
Tensor round_q8_1(const Tensor& x, bool silu_mul) {
  TORCH_CHECK(x.is_cuda(), "patcher: x must be a CUDA tensor, got ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  patcher::Q8_1RoundParams p{};
  p.dtype = dtype_of(x);
  const int64_t per_block = silu_mul ? 64 : 32;  // values of x a Q8_1 block of the output takes
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % per_block == 0, "patcher: round_q8_1 needs a multiple of ",
              std::to_string(per_block), " values a row", silu_mul ? " ([gate | up] halves of a multiple of 32)" : "",
              ", got ", dims(x.sizes()));
  p.k = silu_mul ? x.size(-1) / 2 : x.size(-1);
  p.rows = p.k ? x.numel() / x.size(-1) : 0;
  p.x = x.data_ptr();
  p.x_stride = row_stride(x, "x");
  p.silu_mul_input = silu_mul;
  auto sizes = x.sizes().vec();
  sizes.back() = p.k;
  Tensor out = at::empty(sizes, x.options());
  p.out = out.data_ptr();
  check_launch(patcher::launch_round_q8_1(p, c10::cuda::getCurrentCUDAStream()), "round_q8_1");
  return out;
}

}  // namespace
