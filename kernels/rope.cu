// The attention prologue: fused QKV projection output -> q, k, v in head layout, RoPE applied to q and k.
//
// One block per token. Each thread produces output elements directly from the projection output, so the split
// into heads, the transpose to [B, H, T, D], the rotation and the copy of v are one pass over the data.
// Rotation (HF's apply_rotary_pos_emb, NeoX half rotation, on the first R = rotary_dim dims only, which is
// how Pythia's partial rotary works):
//   y[d] = x[d] * cos[d] + rotate_half(x)[d] * sin[d],  rotate_half(x)[d] = -x[d + R/2] (d < R/2), x[d - R/2]
// Each product and the sum are rounded to the dtype, as the separate torch ops round them.
#include "common.cuh"

namespace patcher {
namespace {

template <typename T>
__global__ void __launch_bounds__(256) rope_qkv_kernel(const RopeQkvParams p) {
  const int64_t b = blockIdx.x / p.tokens;
  const int64_t t = blockIdx.x % p.tokens;
  const T* src = static_cast<const T*>(p.qkv) + b * p.qkv_stride_b + t * p.qkv_stride_t;
  const T* cos = static_cast<const T*>(p.cos) + b * p.cos_stride_b + t * p.cos_stride_t;
  const T* sin = static_cast<const T*>(p.sin) + b * p.sin_stride_b + t * p.sin_stride_t;
  const int64_t D = p.head_dim, R = p.rotary_dim, half = p.rotary_dim / 2;
  const int64_t hq = p.num_q_heads, hkv = p.num_kv_heads;
  const int64_t width = (hq + 2 * hkv) * D;

  for (int64_t e = threadIdx.x; e < width; e += blockDim.x) {
    int64_t part, head, d;  // part: 0 q, 1 k, 2 v
    if (p.interleaved) {
      head = e / (3 * D);
      part = (e / D) % 3;
      d = e % D;
    } else {
      const int64_t slot = e / D;
      d = e % D;
      part = slot < hq ? 0 : (slot < hq + hkv ? 1 : 2);
      head = part == 0 ? slot : (part == 1 ? slot - hq : slot - hq - hkv);
    }
    const float x = to_float(src[e]);
    float y = x;
    if (part < 2 && d < R) {
      const float rotated = d < half ? -to_float(src[e + half]) : to_float(src[e - half]);
      // __fmul_rn/__fadd_rn keep fp32 from contracting into an FMA: torch rounds each product separately.
      y = round_to<T>(__fadd_rn(round_to<T>(__fmul_rn(x, to_float(cos[d]))),
                                round_to<T>(__fmul_rn(rotated, to_float(sin[d])))));
    }
    const int64_t heads = part == 0 ? hq : hkv;
    T* dst = static_cast<T*>(part == 0 ? p.q : (part == 1 ? p.k : p.v));
    dst[((b * heads + head) * p.tokens + t) * D + d] = from_float<T>(y);
  }
}

}  // namespace

cudaError_t launch_rope_qkv(const RopeQkvParams& p, cudaStream_t stream) {
  const int64_t blocks = p.batch * p.tokens;
  if (blocks == 0) return cudaSuccess;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  PATCHER_DISPATCH_DTYPE(p.dtype, T, rope_qkv_kernel<T><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(p));
  return cudaGetLastError();
}

}  // namespace patcher
