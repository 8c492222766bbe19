// The activations' dtypes as the launchers take them, and the qualifier of helpers shared by host and device code.
// No op parameters here: each op family has its own params.h.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define PATCHER_HOST_DEVICE __host__ __device__
#else
#define PATCHER_HOST_DEVICE  // the bindings' host compiler
#endif

namespace patcher {

enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// The launcher of a per-dtype translation unit (an op's <name>_half.cu, _bf16.cu, _float.cu) for `dtype`, or
// nullptr for another value: `const auto launch = by_dtype(p.dtype, f_half, f_bf16, f_float);`.
template <typename F>
inline F by_dtype(DType dtype, F half, F bf16, F f32) {
  switch (dtype) {
    case DType::kFloat16:
      return half;
    case DType::kBFloat16:
      return bf16;
    case DType::kFloat32:
      return f32;
  }
  return nullptr;
}

}  // namespace patcher
