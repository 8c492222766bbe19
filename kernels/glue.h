// The torch side's input checks, shared by the ops of bindings.cpp and bindings_int4.h: every op checks device,
// dtype, shape and strides with a clear message before it fills a launcher struct.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <optional>
#include <string>

#include "attention/params.h"
#include "common/types.h"
#include "norm/params.h"
#include "rope/params.h"

namespace patcher_glue {

using at::Tensor;
using patcher::DType;
using OptTensor = std::optional<Tensor>;

// Numbers in error messages are formatted with std::to_string, never streamed: with torch 2.11, streaming an integer
// into a TORCH_CHECK message crashed the process inside std::ostream::_M_insert<long>, while messages made only of
// strings worked.
inline std::string dims(c10::IntArrayRef values) {
  std::string text = "[";
  for (size_t i = 0; i < values.size(); ++i) text += (i ? ", " : "") + std::to_string(values[i]);
  return text + "]";
}

inline DType dtype_of(const Tensor& t) {
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
inline void check_like(const Tensor& t, const Tensor& x, const char* name) {
  TORCH_CHECK(t.is_cuda(), "patcher: ", name, " must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.device() == x.device(), "patcher: ", name, " is on ", t.device(), " but the input is on ", x.device());
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), "patcher: ", name, " has dtype ", t.scalar_type(),
              " but the input has ", x.scalar_type());
}

// A [hidden] parameter vector.
inline const void* vector_arg(const Tensor& t, const Tensor& x, int64_t n, const char* name) {
  check_like(t, x, name);
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n, "patcher: ", name, " must have shape [", std::to_string(n), "], got ",
              dims(t.sizes()));
  TORCH_CHECK(t.stride(0) == 1, "patcher: ", name, " must be contiguous");
  return t.data_ptr();
}

inline const void* optional_vector_arg(const OptTensor& t, const Tensor& x, int64_t n, const char* name) {
  return t.has_value() ? vector_arg(*t, x, n, name) : nullptr;
}

// The stride between rows of a tensor read as [rows, size(-1)]: the last dim contiguous, the others collapsing
// into one uniform stride (any slice of a contiguous tensor's last dim qualifies; a gather does not).
inline int64_t row_stride(const Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() >= 1, "patcher: ", name, " must have at least one dimension");
  TORCH_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1, "patcher: the last dimension of ", name,
              " must be contiguous (stride 1); got strides ", dims(t.strides()));
  int64_t stride = -1, expected = -1;
  for (int64_t i = t.dim() - 2; i >= 0; --i) {
    if (t.size(i) == 1) continue;
    if (stride < 0) {
      stride = t.stride(i);
      expected = stride * t.size(i);
    } else {
      TORCH_CHECK(t.stride(i) == expected, "patcher: ", name, " must be readable as rows of ",
                  std::to_string(t.size(-1)), " with one row stride; got sizes ", dims(t.sizes()), " and strides ",
                  dims(t.strides()));
      expected *= t.size(i);
    }
  }
  if (stride < 0) return t.size(-1);  // a single row
  TORCH_CHECK(stride >= t.size(-1), "patcher: rows of ", name, " overlap (row stride ", std::to_string(stride), ")");
  return stride;
}

inline void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "patcher: ", op, " kernel launch failed: ", cudaGetErrorString(err));
}

inline void check_cache(const Tensor& cache, const Tensor& like, int64_t batch, int64_t heads, int64_t head_dim,
                        const char* name) {
  check_like(cache, like, name);
  TORCH_CHECK(cache.dim() == 4 && cache.size(0) == batch && cache.size(1) == heads && cache.size(3) == head_dim,
              "patcher: ", name, " must be [", std::to_string(batch), ", ", std::to_string(heads), ", capacity, ",
              std::to_string(head_dim), "], got ", dims(cache.sizes()));
  TORCH_CHECK(cache.is_contiguous(), "patcher: ", name, " must be contiguous");
}

inline void check_index(const Tensor& t, int64_t n, const Tensor& like, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.device() == like.device(), "patcher: ", name, " must be on ", like.device());
  TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 1 && t.size(0) == n && t.is_contiguous(), "patcher: ", name,
              " must be a contiguous int64 tensor of shape [", std::to_string(n), "], got ", t.scalar_type(), " ",
              dims(t.sizes()));
}

// The decode-step RoPE + cache arguments (rope_qkv_cache, int4_qkv_rope_cache): cos/sin tables [positions, rotary]
// on `like`'s device and dtype, slot [1] and pad [batch] int64 indices, and the two [batch, kv_heads, capacity,
// head_dim] caches. Returns the rotary dim.
inline int64_t check_rope_cache_args(const Tensor& like, const Tensor& cos, const Tensor& sin, const Tensor& slot,
                                     const Tensor& pad, const Tensor& k_cache, const Tensor& v_cache, int64_t batch,
                                     int64_t kv_heads, int64_t head_dim) {
  for (const Tensor* t : {&cos, &sin}) {
    check_like(*t, like, t == &cos ? "cos" : "sin");
    TORCH_CHECK(t->dim() == 2 && t->is_contiguous(), "patcher: cos/sin tables must be contiguous [positions, rotary]");
  }
  TORCH_CHECK(cos.sizes() == sin.sizes(), "patcher: cos and sin tables differ in shape");
  const int64_t rotary = cos.size(1);
  TORCH_CHECK(rotary % 2 == 0 && rotary <= head_dim && cos.size(0) > 0, "patcher: bad rotary table ",
              dims(cos.sizes()));
  check_index(slot, 1, like, "slot");
  check_index(pad, batch, like, "pad");
  check_cache(k_cache, like, batch, kv_heads, head_dim, "k_cache");
  check_cache(v_cache, like, batch, kv_heads, head_dim, "v_cache");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "patcher: k_cache and v_cache differ in shape");
  return rotary;
}

// The optional norm prologue of the decode GEMVs (norm_gemv, norm_gemv_rope_cache, int4_gemv, int4_qkv_rope_cache):
// x is then the residual stream, and the op computes sum = x + delta (+ delta2) and normalizes it. Returns the
// op's extra outputs: sum (when delta is given) and h2 (when norm_weight2 is), else empty tensors. With
// `fixed_delta` (the int4 ops) delta may also be an int4_gemv_acc accumulator: int64 [batch, k] in fixed point.
struct Prologue {
  Tensor sum, h2;
};

inline Prologue fill_prologue(patcher::NormPrologue& p, const Tensor& x, int64_t K, const OptTensor& delta,
                              const OptTensor& delta2, const OptTensor& norm_weight, const OptTensor& norm_bias,
                              const OptTensor& norm_weight2, const OptTensor& norm_bias2, double eps, bool rms,
                              bool fixed_delta = false) {
  Prologue r;
  r.sum = at::empty({0}, x.options());
  r.h2 = at::empty({0}, x.options());
  TORCH_CHECK(norm_weight.has_value() || (!delta.has_value() && !norm_weight2.has_value()),
              "patcher: delta and norm_weight2 need norm_weight (the norm prologue)");
  if (!norm_weight.has_value()) return r;
  TORCH_CHECK(!delta2.has_value() || delta.has_value(), "patcher: delta2 needs delta");
  TORCH_CHECK(!rms || (!norm_weight2.has_value() && !norm_bias.has_value()),
              "patcher: RMSNorm takes no bias and no second weight");
  const auto sizes = x.sizes();
  if (delta.has_value()) {
    p.delta_fixed = fixed_delta && delta->scalar_type() == at::kLong;
    if (p.delta_fixed) {
      TORCH_CHECK(delta->is_cuda() && delta->device() == x.device(), "patcher: delta is on ", delta->device(),
                  " but the input is on ", x.device());
    } else {
      check_like(*delta, x, "delta");
    }
    TORCH_CHECK(delta->sizes() == sizes, "patcher: delta ", dims(delta->sizes()), " must match x ", dims(sizes));
    p.delta = delta->data_ptr();
    p.delta_stride = row_stride(*delta, "delta");
    if (delta2.has_value()) {
      check_like(*delta2, x, "delta2");
      TORCH_CHECK(delta2->sizes() == sizes, "patcher: delta2 ", dims(delta2->sizes()), " must match x ", dims(sizes));
      p.delta2 = delta2->data_ptr();
      p.delta2_stride = row_stride(*delta2, "delta2");
    }
    r.sum = at::empty(sizes, x.options());
    p.sum = r.sum.data_ptr();
  }
  p.weight = vector_arg(*norm_weight, x, K, "norm_weight");
  p.bias = optional_vector_arg(norm_bias, x, K, "norm_bias");
  if (norm_weight2.has_value()) {
    p.weight2 = vector_arg(*norm_weight2, x, K, "norm_weight2");
    p.bias2 = optional_vector_arg(norm_bias2, x, K, "norm_bias2");
    r.h2 = at::empty(sizes, x.options());
    p.h2 = r.h2.data_ptr();
  }
  p.eps = static_cast<float>(eps);
  p.rms = rms;
  return r;
}

// The RoPE + KV-cache target of the decode-step attention prologues (rope_qkv_cache, norm_gemv_rope_cache,
// int4_qkv_rope_cache, decode_attention_qkv_acc), checked: everything but q. `like` is the tensor whose dtype and
// device the rest must share, `width` the projection width it produces.
inline void fill_rope_cache(patcher::RopeCacheParams& p, const Tensor& like, int64_t B, int64_t width,
                            const Tensor& cos, const Tensor& sin, const Tensor& slot, const Tensor& pad,
                            Tensor& k_cache, Tensor& v_cache, int64_t num_q_heads, int64_t num_kv_heads,
                            int64_t head_dim, bool interleaved) {
  TORCH_CHECK(num_q_heads > 0 && num_kv_heads > 0 && num_q_heads % num_kv_heads == 0 && head_dim > 0,
              "patcher: bad head counts q ", std::to_string(num_q_heads), ", kv ", std::to_string(num_kv_heads));
  TORCH_CHECK(!interleaved || num_q_heads == num_kv_heads,
              "patcher: interleaved qkv needs as many kv heads as q heads");
  TORCH_CHECK(width == (num_q_heads + 2 * num_kv_heads) * head_dim, "patcher: qkv width ", std::to_string(width),
              " != (", std::to_string(num_q_heads), " + 2 x ", std::to_string(num_kv_heads), ") x ",
              std::to_string(head_dim));
  p.rotary_dim = check_rope_cache_args(like, cos, sin, slot, pad, k_cache, v_cache, B, num_kv_heads, head_dim);
  p.dtype = dtype_of(like);
  p.batch = B;
  p.cos = cos.data_ptr();
  p.sin = sin.data_ptr();
  p.table_len = cos.size(0);
  p.slot = slot.data_ptr<int64_t>();
  p.pad = pad.data_ptr<int64_t>();
  p.num_q_heads = num_q_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.interleaved = interleaved;
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.capacity = k_cache.size(2);
}

// fill_rope_cache, and q [B, Hq, D] allocated for the prologue to write.
inline Tensor rope_cache_target(patcher::RopeCacheParams& p, const Tensor& like, int64_t B, int64_t width,
                                const Tensor& cos, const Tensor& sin, const Tensor& slot, const Tensor& pad,
                                Tensor& k_cache, Tensor& v_cache, int64_t num_q_heads, int64_t num_kv_heads,
                                int64_t head_dim, bool interleaved) {
  fill_rope_cache(p, like, B, width, cos, sin, slot, pad, k_cache, v_cache, num_q_heads, num_kv_heads, head_dim,
                  interleaved);
  Tensor q = at::empty({B, num_q_heads, head_dim}, like.options());
  p.q = q.data_ptr();
  return q;
}

// The checks and parameters decode_attention and decode_attention_qkv_acc share: B rows of Hq query heads of D over
// the caches; `like` gives the dtype and device. Returns the output [B, Hq * D] (p.out set).
inline Tensor attention_params(patcher::DecodeAttentionParams& p, const Tensor& like, int64_t B, int64_t Hq,
                               int64_t D, const Tensor& k_cache, const Tensor& v_cache, const Tensor& slot,
                               const Tensor& pad, double scale, int64_t splits, Tensor& workspace, const char* op) {
  TORCH_CHECK(D == 64 || D == 80 || D == 128, "patcher: ", op, " supports head_dim 64, 80 and 128, got ",
              std::to_string(D));
  TORCH_CHECK(k_cache.dim() == 4, "patcher: k_cache must be [batch, kv_heads, capacity, head_dim]");
  const int64_t Hkv = k_cache.size(1);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0 && Hq / Hkv <= 8, "patcher: ", std::to_string(Hq), " query heads over ",
              std::to_string(Hkv), " kv heads: need a multiple, at most 8 per kv head");
  check_cache(k_cache, like, B, Hkv, D, "k_cache");
  check_cache(v_cache, like, B, Hkv, D, "v_cache");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "patcher: k_cache and v_cache differ in shape");
  check_index(slot, 1, like, "slot");
  check_index(pad, B, like, "pad");
  TORCH_CHECK(splits >= 1 && splits <= 16, "patcher: splits must be in 1..16, got ", std::to_string(splits));
  const int64_t counters = (B * Hq + 63) / 64 * 64;
  const int64_t needed = counters + B * Hq * splits * (D + 2);
  TORCH_CHECK(workspace.is_cuda() && workspace.device() == like.device() && workspace.scalar_type() == at::kInt &&
                  workspace.is_contiguous() && workspace.numel() >= needed,
              "patcher: workspace must be a zeroed contiguous int32 CUDA tensor of at least ", std::to_string(needed),
              " elements (patcher.ops.decode_attention_workspace)");
  p.dtype = dtype_of(like);
  p.batch = B;
  p.num_q_heads = Hq;
  p.num_kv_heads = Hkv;
  p.head_dim = D;
  p.capacity = k_cache.size(2);
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.slot = slot.data_ptr<int64_t>();
  p.pad = pad.data_ptr<int64_t>();
  p.scale = static_cast<float>(scale);
  p.splits = static_cast<int32_t>(splits);
  p.counters = workspace.data_ptr<int32_t>();
  p.partials = reinterpret_cast<float*>(workspace.data_ptr<int32_t>() + counters);
  Tensor out = at::empty({B, Hq * D}, like.options());
  p.out = out.data_ptr();
  return out;
}

}  // namespace patcher_glue
