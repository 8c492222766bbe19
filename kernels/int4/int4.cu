// GPTQ int4 entry points: the decode kernel (int4_gemv.cuh, built per dtype in int4_<dtype>.cu) and the
// dequantization kernel of the prefill path.
#include <algorithm>
#include <type_traits>

#include "int4/int4_gemv.cuh"

namespace patcher {
namespace {

// W[k, n] for prefill: one thread per (qweight row, column), 8 values of one column, stores coalesced along n.
template <typename T>
__global__ void __launch_bounds__(256) int4_dequantize_kernel(const Int4DequantParams p) {
  const int64_t n = p.seg.n;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= (p.k / 8) * n) return;
  const int64_t r = i / n, col = i % n;
  const uint32_t word = static_cast<uint32_t>(p.seg.qweight[i]);
  const __half* scales = static_cast<const __half*>(p.seg.scales);
  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const int64_t k = r * 8 + e;
    const int64_t g = p.act_order ? p.seg.g_idx[k] : k / p.group_size;
    const int q = static_cast<int>((word >> (4 * e)) & 0xFu) - zero_point(p.seg, g, col, p.zero_offset);
    out[k * p.out_stride + col] = from_float<T>(__half2float(__hmul(__int2half_rn(q), scales[g * n + col])));
  }
}

// The int4 ops' add + norm prologue as a kernel of its own (int4_norm_prologue), one block a row: h = norm(x [+
// deltas]) [batch, k], and sum and h2 where p.norm asks for them, staged exactly as the ops' prologue stages x. In
// an op every block computes its rows' statistics over all of K from L2, so that prologue's reads grow with blocks x
// rows; the decode step runs this kernel in front and the op reads h (docs/decode-int4.md says from which batch on).
// 512 threads a row, 16 elements each (K <= 8192, as in the ops), faster than 256 threads at batch 4 and 8.
// fp16 rows of K <= 4096 take a narrow form: 8 elements a thread, held to 64 registers (56, no spills), so that the
// block fits an SM beside one block of the int4 op before it (two of 128 registers fill an SM) and launches early;
// the 16-element form takes 86 and finds room only on an SM that op has left. bf16 and fp32 keep the 16-element form
// (held to 64 registers they spill 6 and 16 bytes).
constexpr int kNormPrologueThreads = 512, kNormPrologueElems = 16, kNormPrologueNarrowElems = 8;

template <typename T, int ELEMS, int MIN_BLOCKS>
__global__ void __launch_bounds__(kNormPrologueThreads, MIN_BLOCKS) int4_norm_prologue_kernel(Int4Params p, T* h) {
  // The op after it reads only constants before its wait, so it may launch now and issue its weight loads while
  // this kernel waits. (Measured alone, with every other kernel triggering after its wait, this placement lost to
  // the one after the wait: docs/decode-int4.md, "Alternatives measured".)
  griddep_trigger_at_entry();
  const int64_t b = blockIdx.x;  // this block's row, as a batch of one
  p.batch = 1;
  p.x = static_cast<const T*>(p.x) + b * p.x_stride;
  if (p.norm.delta && p.norm.delta_fixed) {
    p.norm.delta = static_cast<const int64_t*>(p.norm.delta) + b * p.norm.delta_stride;
  } else if (p.norm.delta) {
    p.norm.delta = static_cast<const T*>(p.norm.delta) + b * p.norm.delta_stride;
  }
  if (p.norm.delta2) p.norm.delta2 = static_cast<const T*>(p.norm.delta2) + b * p.norm.delta2_stride;
  if (p.norm.sum) p.norm.sum = static_cast<T*>(p.norm.sum) + b * p.k;
  if (p.norm.h2) p.norm.h2 = static_cast<T*>(p.norm.h2) + b * p.k;
  T* out = h + b * p.k;
  // The norm's weights and biases before the wait: they are constant, and loaded after the statistics, as the ops
  // do, they cost a round trip (L2 keeps little of them between steps) on the step's critical path.
  constexpr int V = 16 / sizeof(T), PER = ELEMS / V;
  NormVecs<T, V> early[PER];
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int64_t v = threadIdx.x + static_cast<int64_t>(j) * kNormPrologueThreads;
    if (v < p.k / V) early[j] = norm_vecs<T, V>(p, false, p.norm.h2 != nullptr, v * V);
  }
  griddep_wait();
  stage_x<T, true, ELEMS>(p, 0, p.k, true, false, [=](int, int64_t i, float v) { out[i] = from_float<T>(v); }, early);
}

// The narrow form for fp16 rows it holds, else the 16-element form (above).
template <typename T>
cudaError_t launch_norm_prologue_typed(const Int4Params& p, T* h, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.batch)), block(kNormPrologueThreads);
  if constexpr (std::is_same_v<T, __half>) {
    if (norm_fits<T>(p, kNormPrologueThreads, kNormPrologueNarrowElems))
      return launch_pdl(int4_norm_prologue_kernel<T, kNormPrologueNarrowElems, 2>, grid, block, 0, stream, p, h);
  }
  if (!norm_fits<T>(p, kNormPrologueThreads, kNormPrologueElems)) return cudaErrorNotSupported;
  return launch_pdl(int4_norm_prologue_kernel<T, kNormPrologueElems, 1>, grid, block, 0, stream, p, h);
}

}  // namespace

cudaError_t launch_int4_norm_prologue(const Int4Params& p, void* h, cudaStream_t stream) {
  if (p.batch == 0) return cudaSuccess;
  if (!p.norm.weight || p.batch > 8) return cudaErrorInvalidValue;
  PATCHER_DISPATCH_DTYPE(p.dtype, T, { return launch_norm_prologue_typed<T>(p, static_cast<T*>(h), stream); });
  return cudaErrorInvalidValue;
}

int64_t int4_tile_width(const Int4Params& p) {
  if (p.epilogue != kInt4RopeCache) return 128;
  // Whole heads, in whole warps of the tensor-core kernel where that stays within one block (80-wide heads: 160).
  const int64_t head = p.rope.head_dim;
  int64_t width = head;
  while (width % 32) width += head;
  return width <= kThreads ? width : head;
}

int64_t int4_stage_bytes(const Int4Params& p) {
  if (p.dtype != DType::kFloat32 && mma_applies(p)) return mma_x_stage_bytes(p, 2);  // as launch_int4_gemv_typed
  return p.batch * ((p.k / 8 + p.splits - 1) / p.splits) * 8 * 4;
}

int64_t int4_group_stage_bytes(const Int4Params& p) {
  if (p.act_order) return 0;
  // A slice of `span` k starts at a multiple of span: on a group boundary when span is a multiple of the group
  // size, else anywhere, spanning at most two groups more than span / group_size.
  const int64_t span = mma_rows_per_split(p.k / 8, p.splits) * 8;
  const int64_t groups = span % p.group_size == 0 ? span / p.group_size : span / p.group_size + 2;
  return (groups * int4_tile_width(p) * 5 / 2 + 15) / 16 * 16;  // 2-byte scales, 4-bit zeros per column
}

int64_t int4_tiles(const Int4Params& p) {
  const int64_t width = int4_tile_width(p);
  int64_t tiles = 0;
  for (int s = 0; s < p.num_segments; ++s) tiles += (p.seg[s].n + width - 1) / width;
  return tiles;
}

cudaError_t launch_int4_gemv(const Int4Params& p, cudaStream_t stream) {
  if (p.batch == 0) return cudaSuccess;
  if (p.batch > 8 || p.splits < 1 || p.k % 8) return cudaErrorInvalidValue;
  const auto launch = by_dtype(p.dtype, launch_int4_gemv_half, launch_int4_gemv_bf16, launch_int4_gemv_float);
  return launch ? launch(p, stream) : cudaErrorInvalidValue;
}

cudaError_t launch_int4_dequantize(const Int4DequantParams& p, cudaStream_t stream) {
  const int64_t threads = (p.k / 8) * p.seg.n;
  if (threads == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((threads + 255) / 256));
  PATCHER_DISPATCH_DTYPE(p.dtype, T, {
    int4_dequantize_kernel<T><<<grid, 256, 0, stream>>>(p);
    return cudaGetLastError();
  });
  return cudaSuccess;
}

}  // namespace patcher
