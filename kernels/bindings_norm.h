// The CUDA implementations of the norm ops, and of the norms that feed a GGUF projection (into its GEMV's workspace,
// or rounded through Q8_1 for its prefill GEMM); a part of bindings.cpp, which includes it once and registers them
// (schemas and references: patcher/ops/norm.py, patcher/ops/gguf.py; kernels: norm/).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include "bindings_gguf.h"
#include "glue.h"
#include "norm/params.h"

namespace {

using namespace patcher_glue;

struct NormResult {
  Tensor out, out2, sum;
};

// gguf: the output goes to that GGUF GEMV launch's workspace instead (NormParams::gguf_work; out stays undefined).
// round: out is rounded through Q8_1 (NormParams::round_q8_1).
NormResult run_norm(const Tensor& x, const Tensor* delta, const OptTensor& delta2, const Tensor& weight,
                    const OptTensor& bias, const Tensor* weight2, const OptTensor& bias2, double eps, bool rms,
                    const patcher::GgufGemvParams* gguf = nullptr, bool round = false) {
  TORCH_CHECK(x.is_cuda(), "patcher: x must be a CUDA tensor, got ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t hidden = x.size(-1);
  patcher::NormParams p{};
  p.dtype = dtype_of(x);
  p.rows = hidden == 0 ? 0 : x.numel() / hidden;
  p.hidden = hidden;
  p.x = x.data_ptr();
  p.x_stride = row_stride(x, "x");
  NormResult r;
  if (delta) {
    check_like(*delta, x, "delta");
    TORCH_CHECK(delta->sizes() == x.sizes(), "patcher: delta has shape ", dims(delta->sizes()), " but x has ",
                dims(x.sizes()));
    p.delta = delta->data_ptr();
    p.delta_stride = row_stride(*delta, "delta");
    if (delta2.has_value()) {
      check_like(*delta2, x, "delta2");
      TORCH_CHECK(delta2->sizes() == x.sizes(), "patcher: delta2 has shape ", dims(delta2->sizes()), " but x has ",
                  dims(x.sizes()));
      p.delta2 = delta2->data_ptr();
      p.delta2_stride = row_stride(*delta2, "delta2");
    }
    r.sum = at::empty(x.sizes(), x.options());
    p.sum = r.sum.data_ptr();
  }
  p.weight = vector_arg(weight, x, hidden, "weight");
  p.bias = optional_vector_arg(bias, x, hidden, "bias");
  if (gguf) {
    p.gguf_work = gguf->work;
    p.gguf_a8 = gguf->quantize_activations;
  } else {
    r.out = at::empty(x.sizes(), x.options());
    p.out = r.out.data_ptr();
  }
  if (weight2) {
    p.weight2 = vector_arg(*weight2, x, hidden, "weight2");
    p.bias2 = optional_vector_arg(bias2, x, hidden, "bias2");
    r.out2 = at::empty(x.sizes(), x.options());
    p.out2 = r.out2.data_ptr();
  }
  p.eps = static_cast<float>(eps);
  p.rms = rms;
  p.round_q8_1 = round;
  check_launch(patcher::launch_norm(p, c10::cuda::getCurrentCUDAStream()), "norm");
  return r;
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  return run_norm(x, nullptr, std::nullopt, weight, std::nullopt, nullptr, std::nullopt, eps, true).out;
}

std::tuple<Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& delta, const Tensor& weight, double eps) {
  auto r = run_norm(x, &delta, std::nullopt, weight, std::nullopt, nullptr, std::nullopt, eps, true);
  return {r.out, r.sum};
}

Tensor layer_norm(const Tensor& x, const Tensor& weight, const OptTensor& bias, double eps) {
  return run_norm(x, nullptr, std::nullopt, weight, bias, nullptr, std::nullopt, eps, false).out;
}

std::tuple<Tensor, Tensor> dual_layer_norm(const Tensor& x, const Tensor& weight, const OptTensor& bias,
                                           const Tensor& weight2, const OptTensor& bias2, double eps) {
  auto r = run_norm(x, nullptr, std::nullopt, weight, bias, &weight2, bias2, eps, false);
  return {r.out, r.out2};
}

std::tuple<Tensor, Tensor> add_layer_norm(const Tensor& x, const Tensor& delta, const OptTensor& delta2,
                                          const Tensor& weight, const OptTensor& bias, double eps) {
  auto r = run_norm(x, &delta, delta2, weight, bias, nullptr, std::nullopt, eps, false);
  return {r.out, r.sum};
}

std::tuple<Tensor, Tensor, Tensor> add_dual_layer_norm(const Tensor& x, const Tensor& delta, const OptTensor& delta2,
                                                       const Tensor& weight, const OptTensor& bias,
                                                       const Tensor& weight2, const OptTensor& bias2, double eps) {
  auto r = run_norm(x, &delta, delta2, weight, bias, &weight2, bias2, eps, false);
  return {r.out, r.out2, r.sum};
}

// Whether the norm kernel can write a GGUF GEMV's workspace for x (NormParams::gguf_work): 16-bit values, hidden a
// multiple of 256, rows of x, delta and the weight 16-byte aligned.
bool norm_writes_gguf(const Tensor& x, const Tensor* delta, const Tensor& weight) {
  const auto rows_aligned = [](const Tensor& t) {
    return (reinterpret_cast<uintptr_t>(t.data_ptr()) & 15) == 0 && t.dim() >= 1 && t.stride(-1) == 1 &&
           (t.dim() == 1 || t.stride(-2) % 8 == 0);
  };
  return (x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16) && x.size(-1) % 256 == 0 &&
         rows_aligned(x) && (!delta || rows_aligned(*delta)) && weight.scalar_type() == x.scalar_type() &&
         rows_aligned(weight);
}

// rms_norm(x [+ delta]) into gguf_gemv_cat, for the 1 to 8 rows of a decode step: (out, sum), sum = x + delta (an
// empty tensor where delta is None). The norm kernel writes the GEMV's workspace itself where it can
// (norm_writes_gguf), so no input kernel runs; otherwise the norm, then gguf_gemv_cat. feeds_attention: the
// projection is a QKV whose output decode_attention_qkv reads next (GgufGemvParams::feeds_attention).
std::tuple<Tensor, Tensor> gguf_norm_gemv_cat(const Tensor& x, const OptTensor& delta, const Tensor& norm_weight,
                                              double eps, TensorList blocks, c10::string_view kinds,
                                              OptTensorList biases, bool quantize_activations, bool feeds_attention) {
  TORCH_CHECK(x.is_cuda(), "patcher: x must be a CUDA tensor, got ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  GgufLaunch l = gguf_launch(x, blocks, kinds, biases, quantize_activations);
  const Tensor* d = delta.has_value() ? &*delta : nullptr;
  const bool fused = norm_writes_gguf(x, d, norm_weight);
  l.p.work_ready = fused;
  l.p.feeds_attention = feeds_attention;
  NormResult r = run_norm(x, d, std::nullopt, norm_weight, std::nullopt, nullptr, std::nullopt, eps, true,
                          fused ? &l.p : nullptr);
  if (!fused) {
    l.p.x = r.out.data_ptr();
    l.p.x_stride = r.out.size(-1);
  }
  check_launch(patcher::launch_gguf_gemv(l.p, c10::cuda::getCurrentCUDAStream()), "gguf_gemv");
  return {l.out, d ? r.sum : at::empty({0}, x.options())};
}

// round_q8_1(rms_norm(x [+ delta])): a GGUF W4A8 projection's prefill input, (out, sum) with sum = x + delta (an
// empty tensor where delta is None). The norm kernel rounds its output itself where it can (norm_writes_gguf);
// otherwise the norm, then round_q8_1.
std::tuple<Tensor, Tensor> rms_norm_q8_1(const Tensor& x, const OptTensor& delta, const Tensor& weight, double eps) {
  TORCH_CHECK(x.is_cuda(), "patcher: x must be a CUDA tensor, got ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  const Tensor* d = delta.has_value() ? &*delta : nullptr;
  const bool fused = norm_writes_gguf(x, d, weight);
  NormResult r = run_norm(x, d, std::nullopt, weight, std::nullopt, nullptr, std::nullopt, eps, true, nullptr, fused);
  return {fused ? r.out : round_q8_1(r.out, false), d ? r.sum : at::empty({0}, x.options())};
}

}  // namespace
