// Input checks shared by the torch glue files (torch_bindings.cpp, int4_bindings.cpp): every op checks device,
// dtype, shape and strides with a clear message before it fills a launcher struct.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

#include "launchers.h"

namespace patcher_glue {

using at::Tensor;
using patcher::DType;
using OptTensor = std::optional<Tensor>;

// Numbers in error messages are formatted with std::to_string, never streamed: with torch 2.11 on the GPU machine,
// streaming an integer into a TORCH_CHECK message crashed the process inside std::ostream::_M_insert<long>
// (cuda-gdb backtrace), while messages made only of strings worked.
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

}  // namespace patcher_glue
