// The GPTQ int4 decode kernels (templates over the activation dtype), included by one .cu file per dtype
// (int4_half.cu, int4_bf16.cu, int4_float.cu) so that nvcc builds the dtypes in parallel: in one file the
// 48 instantiations took 90 s of a first-use build. The entry points are in int4.cu.
//
// GPTQ int4 matrix-vector products for decode (1 to 8 rows of x), with the dequantization in the kernel, an
// optional norm prologue (the residual add and RMSNorm/LayerNorm in front of the linear) and a fused epilogue
// (bias, GELU, SwiGLU, or RoPE with K/V written into the static cache). Two kernels share the work split and the
// epilogues of int4_tile.cuh: the tensor-core kernel of int4_mma.cuh takes fp16/bf16 activations without act-order
// (the common case); the CUDA-core kernel below takes the rest (fp32 activations, act-order, group sizes that are
// not a multiple of 32, heads that tile badly).
//
// CUDA-core kernel. threadIdx.x picks 4 columns of the tile, threadIdx.y a run of qweight rows of the slice. x for
// the slice (normalized in the prologue when the norm is fused) is staged in shared memory as floats.
//
// Arithmetic. Every weight is formed exactly as the reference forms it, round_fp16(s * (q - z)), then multiplied
// with x in fp32. Without act-order a word's 8 nibbles share one group, and two weights are made per instruction:
// dequantize_word (int4_dequant.cuh) puts nibbles into fp16 mantissas, leaves q - zero exactly and applies the scale
// with the reference's one rounding. With act-order (g_idx a permutation of the groups) every k has
// its own group, and the weights are formed one at a time: correct, and slower.
#pragma once
#include <type_traits>

#include "int4/int4_mma.cuh"
#include "int4/int4_tile.cuh"

namespace patcher {
namespace {

template <typename T, int BMAX, bool NORM, bool ACT_ORDER>
__global__ void __launch_bounds__(kThreads, 2) int4_gemv_kernel(const Int4Params p, int tile_width) {
  // The next kernel may launch at once: it reads only constants before its wait. Not so for the op before a decode
  // attention (feeds_attention, Int4Params).
  const bool feeds_attention = p.feeds_attention || p.epilogue == kInt4RopeCache;
  griddep_trigger_at_entry(feeds_attention);
  extern __shared__ float smem[];
  const TileInfo t = tile_info(p, blockIdx.x, tile_width);
  const Int4Segment& seg = p.seg[t.seg];
  const int tx = threadIdx.x, ty = threadIdx.y;

  // This block's slice of qweight rows, and this thread's run inside it.
  const int64_t rows = p.k / 8;
  const int64_t per_split = (rows + p.splits - 1) / p.splits;
  const int64_t r_begin = min(rows, blockIdx.y * per_split), r_end = min(rows, r_begin + per_split);
  const int64_t per_thread = (r_end - r_begin + blockDim.y - 1) / blockDim.y;
  const int64_t t_begin = min(r_end, r_begin + ty * per_thread), t_end = min(r_end, t_begin + per_thread);
  const int64_t col = t.col0 + 4 * tx;
  const bool live = 4 * tx < t.width;
  const int64_t qw_stride = seg.n / 4;                                                        // uint4 per qweight row
  const uint4* qw = reinterpret_cast<const uint4*>(seg.qweight + col) + t_begin * qw_stride;  // this run's first row
  // qweight rows in flight per thread: 8, or 4 where 4-8 rows of x already take the registers (8 spills there).
  constexpr int kPreload = BMAX <= 2 ? 8 : 4;

  // Constant data is loaded before griddepcontrol.wait (the weights of the first kPreload rows, the scales and
  // zero points of the first two groups), so it is in flight while the previous kernel finishes.
  uint4 w[kPreload] = {};
#pragma unroll
  for (int j = 0; j < kPreload; ++j) {
    if (live && t_begin + j < t_end) w[j] = __ldcs(qw + j * qw_stride);
  }
  const int64_t group_rows = ACT_ORDER ? 1 : p.group_size / 8;  // qweight rows per group (group_size % 8 == 0)
  int64_t group = t_begin / group_rows, group_end = (group + 1) * group_rows;  // group_end: its first row past
  GroupParams cur{}, next{};
  if (!ACT_ORDER && live && t_begin < t_end) {
    cur = load_group(seg, group, col);
    if (group_end < t_end) next = load_group(seg, group + 1, col);
  }
  const int64_t k0 = r_begin * 8, len = (r_end - r_begin) * 8;
  if (!skips_wait(p, k0)) griddep_wait();
  if (blockIdx.y == 0) clear_share(p, blockIdx.x, gridDim.x);  // slice 0 never skips the wait
  // (A block that skips the wait triggers here all the same, where feeds_attention asks for it.)
  griddep_trigger_after_wait(feeds_attention);

  float* xs = smem;  // [batch][len]
  stage_x<T, NORM>(p, k0, len, blockIdx.x == 0, in_second(p, t),
                   [=](int b, int64_t i, float v) { xs[b * len + i] = v; });
  __syncthreads();

  float acc[BMAX][4] = {};
  if (live) {
    Dequant d = group_dequant(cur, p.zero_offset);  // without act-order: the current group's
    for (int64_t r0 = t_begin; r0 < t_end; r0 += kPreload) {
#pragma unroll
      for (int j = 0; j < kPreload; ++j) {
        const int64_t r = r0 + j;
        if (r >= t_end) break;
        const uint32_t words[4] = {w[j].x, w[j].y, w[j].z, w[j].w};
        const float* xr = xs + (r - r_begin) * 8;
        if constexpr (!ACT_ORDER) {
          if (r == group_end) {  // a new group: the prefetched parameters, and the next group's are loaded
            ++group;
            group_end += group_rows;
            d = group_dequant(next, p.zero_offset);
            if (group_end < t_end) next = load_group(seg, group + 1, col);
          }
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            __half2 h[4];
            dequantize_word(words[c], d, c, h);
            float2 q[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) q[j] = __half22float2(h[j]);
#pragma unroll
            for (int b = 0; b < BMAX; ++b) {
              if (b < p.batch) {
                const float4 lo = *reinterpret_cast<const float4*>(xr + b * len);
                const float4 hi = *reinterpret_cast<const float4*>(xr + b * len + 4);
                acc[b][c] += lo.x * q[0].x + hi.x * q[0].y + lo.y * q[1].x + hi.y * q[1].y + lo.z * q[2].x +
                             hi.z * q[2].y + lo.w * q[3].x + hi.w * q[3].y;
              }
            }
          }
        } else {  // every k has its own group: one weight at a time
          const __half* scales = static_cast<const __half*>(seg.scales);
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const int64_t g = seg.g_idx[r * 8 + e];
#pragma unroll
            for (int c = 0; c < 4; ++c) {
              const int q = static_cast<int>((words[c] >> (4 * e)) & 0xFu) - zero_point(seg, g, col + c, p.zero_offset);
              const float wv = __half2float(__hmul(__int2half_rn(q), scales[g * seg.n + col + c]));
#pragma unroll
              for (int b = 0; b < BMAX; ++b) {
                if (b < p.batch) acc[b][c] += xr[b * len + e] * wv;
              }
            }
          }
        }
        // The row kPreload on, into the registers just read (as in int4_mma_kernel: loaded before the use, into a
        // copy, the compiler waited for each load one row later).
        if (r + kPreload < t_end) w[j] = __ldcs(qw + (r + kPreload - t_begin) * qw_stride);
      }
    }
  }

  // The runs' partial sums, red [blockDim.y][batch][tile_width], over x's stage (no longer read).
  __syncthreads();
  float* red = smem;
  if (live) {
#pragma unroll
    for (int b = 0; b < BMAX; ++b) {
      if (b < p.batch) {
#pragma unroll
        for (int c = 0; c < 4; ++c) red[(ty * p.batch + b) * tile_width + 4 * tx + c] = acc[b][c];
      }
    }
  }
  finish_tile<T>(p, t, smem, blockDim.y, tile_width, k_slices(p, t), whole_block());
}

template <typename T, int BMAX>
cudaError_t launch_batch(const Int4Params& p, cudaStream_t stream) {
  const int tile_width = static_cast<int>(int4_tile_width(p));
  // 4 columns per thread, in whole eighths of a warp, and runs in fours: whole warps for any tile width (the block
  // reductions use full-warp shuffles); threads past the tile's width idle.
  const int cols = round_up((tile_width + 3) / 4, 8), runs = kThreads / cols / 4 * 4;
  if (runs == 0) return cudaErrorInvalidConfiguration;  // a tile over 256 columns (heads that wide)
  const dim3 block(cols, runs);
  const dim3 grid(static_cast<unsigned>(int4_tiles(p)), static_cast<unsigned>(p.splits));
  const int64_t rows = p.k / 8, per_split = (rows + p.splits - 1) / p.splits;
  size_t smem = 0;
  const cudaError_t fits = launch_smem<T>(p, p.batch * per_split * 8 * 4, 0, block.y, cols * block.y, tile_width, smem);
  if (fits != cudaSuccess) return fits;
  const bool norm = p.norm.weight != nullptr;
#define PATCHER_INT4_LAUNCH(NORM, ACT) \
  return launch_pdl(int4_gemv_kernel<T, BMAX, NORM, ACT>, grid, block, smem, stream, p, tile_width)
  if constexpr (BMAX == 1 || BMAX == 8) {  // act-order: batch 1, or 2-8 rows as 8 (launch_int4_gemv_typed)
    if (norm && p.act_order) PATCHER_INT4_LAUNCH(true, true);
    if (p.act_order) PATCHER_INT4_LAUNCH(false, true);
  }
  if (norm) PATCHER_INT4_LAUNCH(true, false);
  PATCHER_INT4_LAUNCH(false, false);
#undef PATCHER_INT4_LAUNCH
}

// Batch-size dispatch for one dtype; int4_<dtype>.cu instantiate it.
template <typename T>
cudaError_t launch_int4_gemv_typed(const Int4Params& p, cudaStream_t stream) {
  if constexpr (!std::is_same_v<T, float>) {
    if (mma_applies(p)) return launch_mma<T>(p, stream);
  }
  // The act-order kernels (the slow per-k path) exist for 1 and 8 rows only: a shorter build.
  if (p.act_order && p.batch > 1) return launch_batch<T, 8>(p, stream);
  if (p.batch <= 1) return launch_batch<T, 1>(p, stream);
  if (p.batch <= 2) return launch_batch<T, 2>(p, stream);
  if (p.batch <= 4) return launch_batch<T, 4>(p, stream);
  return launch_batch<T, 8>(p, stream);
}

}  // namespace

cudaError_t launch_int4_gemv_half(const Int4Params& p, cudaStream_t stream);
cudaError_t launch_int4_gemv_bf16(const Int4Params& p, cudaStream_t stream);
cudaError_t launch_int4_gemv_float(const Int4Params& p, cudaStream_t stream);

}  // namespace patcher
