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

}  // namespace patcher
