// The CUDA implementations of the patcher:: torch ops (schemas: patcher/ops/library.py).
//
// Each op checks its inputs (device, dtype, shape, strides) with a clear message, allocates contiguous outputs,
// fills a launcher struct and launches on the current stream. Inputs are never copied: a tensor whose layout a
// kernel can't read is rejected. Nothing here syncs with the host, so every op can be captured in a CUDA graph.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "launchers.h"

namespace {

using at::Tensor;
using patcher::DType;
using OptTensor = std::optional<Tensor>;

DType dtype_of(const Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    default:
      TORCH_CHECK(false, "patcher: unsupported dtype ", t.scalar_type(), " (supported: float16, bfloat16, float32)");
  }
}

// Every tensor argument must live on x's CUDA device with x's dtype.
void check_like(const Tensor& t, const Tensor& x, const char* name) {
  TORCH_CHECK(t.is_cuda(), "patcher: ", name, " must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.device() == x.device(), "patcher: ", name, " is on ", t.device(), " but the input is on ", x.device());
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), "patcher: ", name, " has dtype ", t.scalar_type(),
              " but the input has ", x.scalar_type());
}

// A [hidden] parameter vector.
const void* vector_arg(const Tensor& t, const Tensor& x, int64_t n, const char* name) {
  check_like(t, x, name);
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n, "patcher: ", name, " must have shape [", n, "], got ", t.sizes());
  TORCH_CHECK(t.stride(0) == 1, "patcher: ", name, " must be contiguous");
  return t.data_ptr();
}

const void* optional_vector_arg(const OptTensor& t, const Tensor& x, int64_t n, const char* name) {
  return t.has_value() ? vector_arg(*t, x, n, name) : nullptr;
}

// The stride between rows of a tensor read as [rows, size(-1)]: the last dim contiguous, the others collapsing
// into one uniform stride (any slice of a contiguous tensor's last dim qualifies; a gather does not).
int64_t row_stride(const Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() >= 1, "patcher: ", name, " must have at least one dimension");
  TORCH_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1, "patcher: the last dimension of ", name,
              " must be contiguous (stride 1); got strides ", t.strides());
  int64_t stride = -1, expected = -1;
  for (int64_t i = t.dim() - 2; i >= 0; --i) {
    if (t.size(i) == 1) continue;
    if (stride < 0) {
      stride = t.stride(i);
      expected = stride * t.size(i);
    } else {
      TORCH_CHECK(t.stride(i) == expected, "patcher: ", name, " must be readable as rows of ", t.size(-1),
                  " with one row stride; got sizes ", t.sizes(), " and strides ", t.strides());
      expected *= t.size(i);
    }
  }
  if (stride < 0) return t.size(-1);  // a single row
  TORCH_CHECK(stride >= t.size(-1), "patcher: rows of ", name, " overlap (row stride ", stride, ")");
  return stride;
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "patcher: ", op, " kernel launch failed: ", cudaGetErrorString(err));
}

// ---- norms ------------------------------------------------------------------------------------------------

struct NormResult {
  Tensor out, out2, sum;
};

NormResult run_norm(const Tensor& x, const Tensor* delta, const OptTensor& delta2, const Tensor& weight,
                    const OptTensor& bias, const Tensor* weight2, const OptTensor& bias2, double eps, bool rms) {
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
    TORCH_CHECK(delta->sizes() == x.sizes(), "patcher: delta has shape ", delta->sizes(), " but x has ", x.sizes());
    p.delta = delta->data_ptr();
    p.delta_stride = row_stride(*delta, "delta");
    if (delta2.has_value()) {
      check_like(*delta2, x, "delta2");
      TORCH_CHECK(delta2->sizes() == x.sizes(), "patcher: delta2 has shape ", delta2->sizes(), " but x has ",
                  x.sizes());
      p.delta2 = delta2->data_ptr();
      p.delta2_stride = row_stride(*delta2, "delta2");
    }
    r.sum = at::empty(x.sizes(), x.options());
    p.sum = r.sum.data_ptr();
  }
  p.weight = vector_arg(weight, x, hidden, "weight");
  p.bias = optional_vector_arg(bias, x, hidden, "bias");
  r.out = at::empty(x.sizes(), x.options());
  p.out = r.out.data_ptr();
  if (weight2) {
    p.weight2 = vector_arg(*weight2, x, hidden, "weight2");
    p.bias2 = optional_vector_arg(bias2, x, hidden, "bias2");
    r.out2 = at::empty(x.sizes(), x.options());
    p.out2 = r.out2.data_ptr();
  }
  p.eps = static_cast<float>(eps);
  p.rms = rms;
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

// ---- attention prologue -----------------------------------------------------------------------------------

std::tuple<Tensor, Tensor, Tensor> rope_qkv(const Tensor& qkv, const Tensor& cos, const Tensor& sin,
                                            int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                                            bool interleaved) {
  TORCH_CHECK(qkv.is_cuda(), "patcher: qkv must be a CUDA tensor, got ", qkv.device());
  const c10::cuda::CUDAGuard guard(qkv.device());
  TORCH_CHECK(qkv.dim() == 3, "patcher: qkv must be [batch, tokens, width], got ", qkv.sizes());
  TORCH_CHECK(num_q_heads > 0 && num_kv_heads > 0 && head_dim > 0 && num_q_heads % num_kv_heads == 0,
              "patcher: bad head counts q ", num_q_heads, ", kv ", num_kv_heads, ", head_dim ", head_dim);
  TORCH_CHECK(!interleaved || num_q_heads == num_kv_heads, "patcher: interleaved qkv needs as many kv heads as q heads");
  const int64_t B = qkv.size(0), T = qkv.size(1);
  TORCH_CHECK(qkv.size(2) == (num_q_heads + 2 * num_kv_heads) * head_dim, "patcher: qkv width ", qkv.size(2),
              " != (", num_q_heads, " + 2 x ", num_kv_heads, ") x ", head_dim);
  TORCH_CHECK(qkv.size(2) <= 1 || qkv.stride(2) == 1, "patcher: the last dimension of qkv must be contiguous");
  for (const Tensor* t : {&cos, &sin}) {
    const char* name = t == &cos ? "cos" : "sin";
    check_like(*t, qkv, name);
    TORCH_CHECK(t->dim() == 3 && (t->size(0) == B || t->size(0) == 1) && t->size(1) == T,
                "patcher: ", name, " must be [", B, " or 1, ", T, ", rotary_dim], got ", t->sizes());
    TORCH_CHECK(t->size(2) <= 1 || t->stride(2) == 1, "patcher: the last dimension of ", name, " must be contiguous");
  }
  TORCH_CHECK(cos.sizes() == sin.sizes(), "patcher: cos ", cos.sizes(), " and sin ", sin.sizes(), " differ");
  const int64_t rotary = cos.size(2);
  TORCH_CHECK(rotary % 2 == 0 && rotary <= head_dim, "patcher: rotary_dim ", rotary, " must be even and <= ", head_dim);

  patcher::RopeQkvParams p{};
  p.dtype = dtype_of(qkv);
  p.batch = B;
  p.tokens = T;
  p.qkv = qkv.data_ptr();
  p.qkv_stride_b = qkv.stride(0);
  p.qkv_stride_t = qkv.stride(1);
  p.cos = cos.data_ptr();
  p.cos_stride_b = cos.size(0) == 1 ? 0 : cos.stride(0);
  p.cos_stride_t = cos.stride(1);
  p.sin = sin.data_ptr();
  p.sin_stride_b = sin.size(0) == 1 ? 0 : sin.stride(0);
  p.sin_stride_t = sin.stride(1);
  p.rotary_dim = rotary;
  p.num_q_heads = num_q_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.interleaved = interleaved;
  Tensor q = at::empty({B, num_q_heads, T, head_dim}, qkv.options());
  Tensor k = at::empty({B, num_kv_heads, T, head_dim}, qkv.options());
  Tensor v = at::empty({B, num_kv_heads, T, head_dim}, qkv.options());
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  check_launch(patcher::launch_rope_qkv(p, c10::cuda::getCurrentCUDAStream()), "rope_qkv");
  return {q, k, v};
}

// ---- activations ------------------------------------------------------------------------------------------

Tensor silu_and_mul(const Tensor& x) {
  TORCH_CHECK(x.is_cuda(), "patcher: x must be a CUDA tensor, got ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, "patcher: silu_and_mul needs an even last dimension, got ",
              x.sizes());
  patcher::ActivationParams p{};
  p.dtype = dtype_of(x);
  p.cols = x.size(-1) / 2;
  p.rows = p.cols == 0 ? 0 : x.numel() / x.size(-1);
  p.x = x.data_ptr();
  p.x_stride = row_stride(x, "x");
  auto sizes = x.sizes().vec();
  sizes.back() = p.cols;
  Tensor out = at::empty(sizes, x.options());
  p.out = out.data_ptr();
  check_launch(patcher::launch_silu_and_mul(p, c10::cuda::getCurrentCUDAStream()), "silu_and_mul");
  return out;
}

Tensor bias_gelu(const Tensor& x, const OptTensor& bias, bool tanh) {
  TORCH_CHECK(x.is_cuda(), "patcher: x must be a CUDA tensor, got ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  TORCH_CHECK(x.dim() >= 1, "patcher: bias_gelu needs at least one dimension");
  patcher::ActivationParams p{};
  p.dtype = dtype_of(x);
  p.cols = x.size(-1);
  p.rows = p.cols == 0 ? 0 : x.numel() / p.cols;
  p.x = x.data_ptr();
  p.x_stride = row_stride(x, "x");
  p.bias = optional_vector_arg(bias, x, p.cols, "bias");
  Tensor out = at::empty(x.sizes(), x.options());
  p.out = out.data_ptr();
  check_launch(patcher::launch_bias_gelu(p, tanh, c10::cuda::getCurrentCUDAStream()), "bias_gelu");
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(patcher, CUDA, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("layer_norm", &layer_norm);
  m.impl("dual_layer_norm", &dual_layer_norm);
  m.impl("add_layer_norm", &add_layer_norm);
  m.impl("add_dual_layer_norm", &add_dual_layer_norm);
  m.impl("rope_qkv", &rope_qkv);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("bias_gelu", &bias_gelu);
}
