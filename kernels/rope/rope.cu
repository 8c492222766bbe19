// The attention prologue: fused QKV projection output -> q, k, v in head layout, RoPE applied to q and k.
//
// One block per token. Each thread produces output elements directly from the projection output, so the split
// into heads, the transpose to [B, H, T, D], the rotation and the copy of v are one pass over the data.
// Rotation (HF's apply_rotary_pos_emb, NeoX half rotation, on the first R = rotary_dim dims only, which is
// how Pythia's partial rotary works):
//   y[d] = x[d] * cos[d] + rotate_half(x)[d] * sin[d],  rotate_half(x)[d] = -x[d + R/2] (d < R/2), x[d - R/2]
// Each product and the sum are rounded to the dtype, as the separate torch ops round them.
//
// rope_qkv_cache is the decode-step variant: one token per row and one thread per element, K and V written straight
// into the static KV cache at `slot`, the rotation at position slot - pad[row], cos/sin read from precomputed tables.
#include "common/common.cuh"
#include "rope/rope.cuh"

namespace patcher {
namespace {

constexpr int kRopeCacheThreads = 128;

// What both prefill kernels need of their block's token: batch row b and position t (one block per token), the
// token's projection row and cos/sin rows, and the head geometry as ints.
template <typename T>
struct TokenRow {
  int64_t b, t;
  const T *src, *cos, *sin;
  int D, hq, hkv, R;
};

template <typename T>
__device__ __forceinline__ TokenRow<T> token_row(const RopeQkvParams& p) {
  TokenRow<T> r;
  r.b = blockIdx.x / p.tokens;
  r.t = blockIdx.x % p.tokens;
  r.src = static_cast<const T*>(p.qkv) + r.b * p.qkv_stride_b + r.t * p.qkv_stride_t;
  r.cos = static_cast<const T*>(p.cos) + r.b * p.cos_stride_b + r.t * p.cos_stride_t;
  r.sin = static_cast<const T*>(p.sin) + r.b * p.sin_stride_b + r.t * p.sin_stride_t;
  r.D = static_cast<int>(p.head_dim);
  r.hq = static_cast<int>(p.num_q_heads);
  r.hkv = static_cast<int>(p.num_kv_heads);
  r.R = static_cast<int>(p.rotary_dim);
  return r;
}

template <typename T>
__global__ void __launch_bounds__(256) rope_qkv_kernel(const RopeQkvParams p) {
  griddep_trigger_at_entry();  // the next kernel reads only constants before its wait
  griddep_wait();
  const TokenRow<T> r = token_row<T>(p);
  const int64_t b = r.b, t = r.t;
  const int D = r.D, hq = r.hq, hkv = r.hkv, R = r.R;
  const int width = (hq + 2 * hkv) * D;
  for (int e = threadIdx.x; e < width; e += blockDim.x) {
    const Slot s = locate(e, D, hq, hkv, p.interleaved);
    const float y = rotate(r.src, e, s, R, r.cos, r.sin);
    const int64_t heads = s.part == 0 ? hq : hkv;
    T* dst = static_cast<T*>(s.part == 0 ? p.q : (s.part == 1 ? p.k : p.v));
    dst[((b * heads + s.head) * p.tokens + t) * D + s.d] = from_float<T>(y);
  }
}

// The vector path (head_dim a multiple of VEC, 16-byte aligned rows): the block stages its token's projection row in
// shared memory with 16-byte loads, then each thread produces VEC consecutive outputs of one head and stores them
// with one 16-byte store. The rotation partners are R/2 away, which need not be a vector boundary (Pythia's R/2 is
// 10), so they are read from the staged row. The scalar kernel above did one 2-byte load and store and two integer
// divisions per element: 31% of HBM bandwidth at 4096 tokens x hidden 4096.
template <typename T, int VEC>
__global__ void __launch_bounds__(256) rope_qkv_vec_kernel(const RopeQkvParams p) {
  extern __shared__ __align__(16) unsigned char rope_stage[];
  T* row = reinterpret_cast<T*>(rope_stage);
  griddep_trigger_at_entry();  // the next kernel reads only constants before its wait
  griddep_wait();
  const TokenRow<T> r = token_row<T>(p);
  const int64_t b = r.b, t = r.t;
  const int D = r.D, hq = r.hq, hkv = r.hkv, R = r.R;
  const int nvec = (hq + 2 * hkv) * D / VEC;
  for (int v = threadIdx.x; v < nvec; v += blockDim.x)
    *reinterpret_cast<Vec<T, VEC>*>(row + v * VEC) = *reinterpret_cast<const Vec<T, VEC>*>(r.src + v * VEC);
  __syncthreads();
  for (int v = threadIdx.x; v < nvec; v += blockDim.x) {
    const int e = v * VEC;
    Slot s = locate(e, D, hq, hkv, p.interleaved);  // the vector lies in one head: D is a multiple of VEC
    const int64_t heads = s.part == 0 ? hq : hkv;
    T* dst = static_cast<T*>(s.part == 0 ? p.q : (s.part == 1 ? p.k : p.v)) +
             ((b * heads + s.head) * p.tokens + t) * D + s.d;
    float y[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j, ++s.d) y[j] = rotate(row, e + j, s, R, r.cos, r.sin);
    store_vec<T, VEC>(dst, y);
  }
}

// One thread an element: the grid is (batch rows, blocks of a row's (hq + 2 hkv) * D elements), so that every load
// of the projection row is in flight at once (a block looping over a row waits for its loads once an iteration).
template <typename T>
__global__ void __launch_bounds__(kRopeCacheThreads) rope_qkv_cache_kernel(const RopeCacheParams p) {
  // The next kernel is the decode attention, which reads the slot and earlier keys before its wait: it starts
  // only after this kernel's wait (common.cuh, griddep_trigger_after_wait).
  griddep_wait();
  griddep_trigger_after_wait(true);
  const int64_t b = blockIdx.x;
  const int D = static_cast<int>(p.head_dim), hq = static_cast<int>(p.num_q_heads);
  const int hkv = static_cast<int>(p.num_kv_heads), R = static_cast<int>(p.rotary_dim);
  const int e = static_cast<int>(blockIdx.y) * kRopeCacheThreads + static_cast<int>(threadIdx.x);
  if (e >= (hq + 2 * hkv) * D) return;
  const int64_t slot = *p.slot;
  const RopeRow<T> row = rope_row<T>(p, slot, b);
  const T* src = static_cast<const T*>(p.qkv) + b * p.qkv_stride;
  const Slot s = locate(e, D, hq, hkv, p.interleaved);
  store_qkv<T>(p, static_cast<T*>(p.q), b, slot, s, from_float<T>(rotate(src, e, s, R, row.cos, row.sin)));
}

}  // namespace

cudaError_t launch_rope_qkv(const RopeQkvParams& p, cudaStream_t stream) {
  const int64_t blocks = p.batch * p.tokens;
  if (blocks == 0) return cudaSuccess;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(blocks));
  PATCHER_DISPATCH_DTYPE(p.dtype, T, {
    constexpr int vec = 16 / sizeof(T);
    const size_t smem = static_cast<size_t>((p.num_q_heads + 2 * p.num_kv_heads) * p.head_dim) * sizeof(T);
    // The staged row must fit the default 48 KB of shared memory (Pythia-12B's fp16 row is 30 KB).
    const bool vector = p.head_dim % vec == 0 && p.qkv_stride_b % vec == 0 && p.qkv_stride_t % vec == 0 &&
                        aligned16(p.qkv) && aligned16(p.q) && aligned16(p.k) && aligned16(p.v) && smem <= 48 * 1024;
    if (vector) return launch_pdl(rope_qkv_vec_kernel<T, vec>, grid, dim3(256), smem, stream, p);
    return launch_pdl(rope_qkv_kernel<T>, grid, dim3(256), 0, stream, p);
  });
  return cudaSuccess;
}

cudaError_t launch_rope_qkv_cache(const RopeCacheParams& p, cudaStream_t stream) {
  if (p.batch == 0) return cudaSuccess;
  const int64_t width = (p.num_q_heads + 2 * p.num_kv_heads) * p.head_dim;
  const int64_t blocks = (width + kRopeCacheThreads - 1) / kRopeCacheThreads;  // a row's
  const dim3 grid(static_cast<unsigned>(p.batch), static_cast<unsigned>(blocks));
  PATCHER_DISPATCH_DTYPE(p.dtype, T,
                         return launch_pdl(rope_qkv_cache_kernel<T>, grid, dim3(kRopeCacheThreads), 0, stream, p));
  return cudaSuccess;
}

}  // namespace patcher
