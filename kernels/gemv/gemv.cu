// The decode GEMV's entry point: checks, then the kernel built for the dtype (gemv.cuh, one gemv_<dtype>.cu each).
#include "common/common.cuh"
#include "gemv/params.h"

namespace patcher {

cudaError_t launch_gemv_half(const GemvParams& p, cudaStream_t stream);
cudaError_t launch_gemv_bf16(const GemvParams& p, cudaStream_t stream);
cudaError_t launch_gemv_float(const GemvParams& p, cudaStream_t stream);

namespace {

size_t element_size(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

}  // namespace

// The x stage [batch][k]; staged (gemv.cuh) also the deltas [batch][k] each and the norm's weight and bias [k].
size_t gemv_prologue_smem(const GemvParams& p, bool staged) {
  if (!p.norm.weight) return 0;
  int64_t rows = p.batch;
  if (staged) rows += p.batch * ((p.norm.delta ? 1 : 0) + (p.norm.delta2 ? 1 : 0)) + 1 + (p.norm.bias ? 1 : 0);
  return static_cast<size_t>(rows * p.k) * element_size(p.dtype);
}

size_t gemv_max_smem() {
  constexpr int kMaxDevices = 64;
  static int optin[kMaxDevices] = {};  // per device, looked up once (the launch path calls this every time)
  int device = 0;
  cudaGetDevice(&device);
  int bytes = device < kMaxDevices ? optin[device] : 0;
  if (bytes == 0) {
    cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (device < kMaxDevices) optin[device] = bytes;  // the same value from any thread that races here
  }
  return static_cast<size_t>(bytes) - 1024;  // the kernel's static shared memory (partial sums, scratch) fits in 1 KB
}

cudaError_t launch_gemv(const GemvParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.n == 0) return cudaSuccess;
  if (p.batch > 8) return cudaErrorInvalidValue;
  if (p.act == kActRopeCache && (p.n % 2 || p.rope.head_dim % 2 || p.rope.rotary_dim % 2)) return cudaErrorInvalidValue;
  GemvParams q = p;
  // The staged prologue needs 16-byte rows (the kernel takes it with its vectorized loads only) and the room.
  q.stage_inputs =
      p.norm.weight && p.k % (16 / element_size(p.dtype)) == 0 && gemv_prologue_smem(p, true) <= gemv_max_smem();
  if (gemv_prologue_smem(q, q.stage_inputs) > gemv_max_smem()) return cudaErrorInvalidValue;
  const auto launch = by_dtype(p.dtype, launch_gemv_half, launch_gemv_bf16, launch_gemv_float);
  return launch ? launch(q, stream) : cudaErrorInvalidValue;
}

}  // namespace patcher
