// The GGUF decode GEMV (1 to 8 rows of x, every block type of gguf/params.h), templates over the activation dtype
// and the block type; the launchers are in gguf_launch.cuh, the entry point in gguf.cu, and a faster form for W4A8
// over aligned blocks in gguf_gemv_aligned.cuh. What it computes, and the rounding points: gguf/params.h.
//
// Two kernels a product. The input kernel writes x once into the workspace in the form the GEMV's lanes read:
// W4A8, quantized to Q8_1 (gguf_q8_1.cuh: q int8 | d | s = sum(q) * d | sum(q), params.h has the layout); W4A16, in
// fp32.
// Four threads a 32-value block, 8 values each. The GEMV then reads only weights and the workspace, so no block of
// it repeats another's work on x and none waits at a barrier for the others.
//
// Work split of the GEMV. A block has 8 warps, one output row each; a warp walks its row in chunks of 1024 values
// (gguf_blocks.cuh), lane l taking one 32-value block or K-quant sub-block of each: block l, or sub-block l % 8 of
// super-block l / 8, which is x's 32-value block 32 c + l in chunk c. A chunk's weight bytes come into registers as
// 16-byte vectors two chunks ahead of their use, then through the warp's shared stage to the lanes that parse them.
// The first two chunks are requested before griddepcontrol.wait (weights are never written by an earlier kernel),
// so under programmatic dependent launch they overlap the input kernel.
//
// Arithmetic, as reference.linear_w4a8 / linear_w4a16 form it, every product and sum explicitly rounded (no
// contraction into fused multiply-adds). W4A8: per lane block one exact integer dot product isum (__dp4a over 8
// words), the term (scale * d_a) * isum, summed per lane over the chunks, then over the lanes; the offsets' terms
// off * s_a (Q4_1's m, the K-quants' -(dmin * mn)) summed apart and added at the end, as the reference adds its
// second matmul. Q6_K: two 16-value groups a sub-block, each its own isum and term with the sub-block's d_a, the pair
// added first, then into the lane's sum, so a term passes through as many fp32 additions as a Q4_1 term does (the
// offset sum's final addition is the one Q6_K lacks). W4A16: each weight formed as format.dequantize forms it and
// rounded to the dtype, then fused multiply-adds with x in fp32.
#pragma once
#include "gguf/gguf_blocks.cuh"
#include "gguf/gguf_q8_1.cuh"

namespace patcher {
namespace {

constexpr int kGgufWarps = 8;  // output rows per block
// Chunks of weights in a lane's registers ahead of their use: three for the 32-value block types, two for the
// K-quants, whose parsing holds more registers (docs/gguf.md, "Alternatives measured").
template <int KIND>
constexpr int kGgufDepth = kKQuant<KIND> ? 2 : 3;
constexpr int kInputThreads = 256;

__device__ __forceinline__ float load_scalar(const void* p, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kFloat16:
      return __half2float(static_cast<const __half*>(p)[i]);
    case DType::kBFloat16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

// x [batch, k] into the workspace (params.h), a thread 8 values; every thread of a warp reaches the shuffles of the
// quantization (a thread past the end works on a clamped copy and stores nothing). SILU: x is [gate | up]
// (GgufGemvParams::silu_mul_input), and the values are silu_and_mul's, round(round(silu(gate)) * up).
template <typename T, bool A8, bool VEC, bool SILU>
__global__ void __launch_bounds__(kInputThreads) gguf_input_kernel(const GgufGemvParams p) {
  griddep_trigger_at_entry();  // the GEMV after it reads only weights before its wait
  griddep_wait();
  const Part8 t = part8(p.batch, p.k, kInputThreads);
  float v[8];
  load8_input<T, VEC, SILU>(v, p.x, p.x_stride, t.row, t.col, p.k);
  store_gguf_input<A8>(p.work, p.batch, p.k, t.row, t.col, v, t.live);
}

// x's Q8_1 block `blk` of batch row b, as the W4A8 dot product reads it from the workspace (gguf/params.h): its 32
// int8 values as 8 words, d, s = d * sum(q) for the types with an offset, and sum(q) for Q4_0's stored nibbles.
struct XBlock {
  int qa[8];
  float d, s;
  int sum;
};

template <int KIND, bool STORED>
__device__ __forceinline__ XBlock load_x_block(const GgufGemvParams& p, int b, int64_t blk) {
  const int8_t* xq = static_cast<const int8_t*>(p.work);
  const int64_t nb = p.k / 32;
  const float* xd = reinterpret_cast<const float*>(xq + p.batch * p.k);
  const int* xsum = reinterpret_cast<const int*>(xd + 2 * p.batch * nb);
  const int4* qv = reinterpret_cast<const int4*>(xq + b * p.k + blk * 32);
  const int4 lo = qv[0], hi = qv[1];
  XBlock x = {{lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w}, xd[b * nb + blk], 0.f, 0};
  if constexpr (kHasOffset<KIND>) x.s = xd[(p.batch + b) * nb + blk];
  if constexpr (STORED && KIND == kGgufQ4_0) x.sum = xsum[b * nb + blk];
  return x;
}

// A lane's parsed block (parse_lane) times one batch row's x block, into that row's sums. STORED: Q4_0's q are its
// nibbles as stored (0..15, gguf_gemv_aligned.cuh), and the 8 they are offset by comes off the integer sum as
// 8 * sum(q_a), which the input kernel writes after the blocks' d and s; Q6_K's are its 6 bits as stored (0..63),
// and the 32 comes off each 16-value half's sum by a dp4a of -32 in every byte against q_a. Either way the same
// integer sums, exactly.
template <int KIND, bool STORED>
__device__ __forceinline__ void accumulate_x(const float (&scale)[2], float off, const int (&q)[8], const XBlock& x,
                                             float& acc, float& acc_m) {
  if constexpr (KIND == kGgufQ6_K) {
    int isum0 = 0, isum1 = 0;  // elements 0..15 and 16..31
#pragma unroll
    for (int i = 0; i < 4; ++i) isum0 = __dp4a(q[i], x.qa[i], isum0);
#pragma unroll
    for (int i = 4; i < 8; ++i) isum1 = __dp4a(q[i], x.qa[i], isum1);
    if constexpr (STORED) {
      constexpr int kMinus32 = static_cast<int>(0xE0E0E0E0u);  // -32 in each signed byte
#pragma unroll
      for (int i = 0; i < 4; ++i) isum0 = __dp4a(kMinus32, x.qa[i], isum0);
#pragma unroll
      for (int i = 4; i < 8; ++i) isum1 = __dp4a(kMinus32, x.qa[i], isum1);
    }
    const float t0 = __fmul_rn(__fmul_rn(scale[0], x.d), static_cast<float>(isum0));
    const float t1 = __fmul_rn(__fmul_rn(scale[1], x.d), static_cast<float>(isum1));
    acc = __fadd_rn(acc, __fadd_rn(t0, t1));
  } else {
    int isum = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) isum = __dp4a(q[i], x.qa[i], isum);
    if constexpr (STORED && KIND == kGgufQ4_0) isum -= 8 * x.sum;  // sum((q - 8) q_a), exactly
    acc = __fadd_rn(acc, __fmul_rn(__fmul_rn(scale[0], x.d), static_cast<float>(isum)));
    if constexpr (kHasOffset<KIND>) acc_m = __fadd_rn(acc_m, __fmul_rn(off, x.s));
  }
}

// A lane's parsed block times x's 32-value block `blk` of every row (from the workspace), into the lane's sums.
template <typename T, int KIND, bool A8, int BMAX, bool STORED = false>
__device__ __forceinline__ void accumulate_parsed(const float (&scale)[2], float off, const int (&q)[8],
                                                  const GgufGemvParams& p, int64_t blk, float (&acc)[BMAX],
                                                  float (&acc_m)[BMAX]) {
  if constexpr (A8) {
#pragma unroll
    for (int b = 0; b < BMAX; ++b) {
      if (b >= p.batch) break;
      accumulate_x<KIND, STORED>(scale, off, q, load_x_block<KIND, STORED>(p, b, blk), acc[b], acc_m[b]);
    }
  } else {
    float wv[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) wv[i] = round_to<T>(weight_at<KIND>(scale, off, q, i));
#pragma unroll
    for (int b = 0; b < BMAX; ++b) {
      if (b >= p.batch) break;
      const float4* xb = reinterpret_cast<const float4*>(static_cast<const float*>(p.work) + b * p.k + blk * 32);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float4 x = xb[i];
        acc[b] = fmaf(wv[4 * i], x.x, acc[b]);
        acc[b] = fmaf(wv[4 * i + 1], x.y, acc[b]);
        acc[b] = fmaf(wv[4 * i + 2], x.z, acc[b]);
        acc[b] = fmaf(wv[4 * i + 3], x.w, acc[b]);
      }
    }
  }
}

// One lane's block of the chunk (at `chunk` in the warp's stage) times x's 32-value block `blk` of every row.
template <typename T, int KIND, bool A8, int BMAX>
__device__ __forceinline__ void accumulate(const uint8_t* chunk, const GgufGemvParams& p, int64_t blk, int lane,
                                           float (&acc)[BMAX], float (&acc_m)[BMAX]) {
  float scale[2], off;
  int q[8];
  parse_lane<KIND>(chunk, lane, scale, off, q);
  accumulate_parsed<T, KIND, A8, BMAX>(scale, off, q, p, blk, acc, acc_m);
}

// The warp's (first) output row: the launch's segments' rows one after the other (every segment is of the launch's
// KIND); a warp that takes several rows takes n .. n + rows_per_warp - 1 of one segment (every segment's row count a
// multiple of rows_per_warp).
// Only the segment's index is kept; its fields are read from the parameters (__grid_constant__: the constant bank,
// indexed) where they are used, so that a segment costs no registers across the main loop.
struct WarpRow {
  int s;      // segment
  int64_t n;  // row of the segment; n >= p.seg[s].n: a warp past the last row
};
__device__ __forceinline__ WarpRow warp_row(const GgufGemvParams& p, int warp, int rows_per_warp = 1) {
  int64_t n = (static_cast<int64_t>(blockIdx.x) * kGgufWarps + warp) * rows_per_warp;
  int s = 0;
#pragma unroll
  for (int i = 1; i < kGgufMaxSegments; ++i) {
    if (i < p.segments && n >= p.seg[s].n) {
      n -= p.seg[s].n;
      s = i;
    }
  }
  return {s, n};
}

// The lanes' sums of row n of segment g into its column of the output, each batch row: the lanes' terms summed over
// the warp, the offset terms apart (added at the end, as the reference adds its second matmul), then the bias.
template <typename T, int KIND, bool A8, int BMAX>
__device__ __forceinline__ void store_row(const GgufGemvParams& p, const GgufSegment& g, int64_t n, int lane,
                                          float (&acc)[BMAX], float (&acc_m)[BMAX]) {
  constexpr bool kOffsetSum = A8 && kHasOffset<KIND>;
#pragma unroll
  for (int b = 0; b < BMAX; ++b) {
    acc[b] = warp_sum(acc[b]);
    if constexpr (kOffsetSum) acc_m[b] = warp_sum(acc_m[b]);
  }
  if (lane != 0) return;
  T* out = static_cast<T*>(p.out) + g.out_col + n;
#pragma unroll
  for (int b = 0; b < BMAX; ++b) {
    if (b >= p.batch) break;
    float y = kOffsetSum ? __fadd_rn(acc[b], acc_m[b]) : acc[b];
    if (g.bias) {
      const float bias = load_scalar(g.bias, g.bias_dtype, n);
      y = __fadd_rn(y, A8 ? bias : round_to<T>(bias));  // W4A16: the reference's bias.to(x.dtype)
    }
    out[b * p.out_stride] = from_float<T>(y);
  }
}

template <typename T, int KIND, bool A8, int BMAX>
__global__ void __launch_bounds__(kGgufWarps * 32) gguf_gemv_kernel(const __grid_constant__ GgufGemvParams p) {
  __shared__ __align__(16) uint8_t stages[kGgufWarps][kStageBytes<KIND>];
  constexpr int kPerChunk = kChunkBlocks * 32 / kBlockValues<KIND>;  // blocks (super-blocks) a chunk
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  griddep_trigger_at_entry(p.feeds_attention);
  const WarpRow r = warp_row(p, warp);
  const int64_t n = r.n;
  const GgufSegment& g = p.seg[r.s];
  if (n >= g.n) return;                            // a warp past the last row (no barrier waits for it)
  const int64_t nb = p.k / 32;                     // 32-value blocks (and Q8_1 blocks of x) a row
  const int64_t units = p.k / kBlockValues<KIND>;  // blocks (super-blocks) a row
  const int64_t chunks = (units + kPerChunk - 1) / kPerChunk;
  uint8_t* stage = stages[warp];
  const uint8_t* row = g.blocks + n * g.row_bytes;
  auto window = [&](int64_t c) {
    const int64_t end = (c + 1) * kPerChunk < units ? (c + 1) * kPerChunk : units;
    return byte_window(row + c * kPerChunk * kBlockBytes<KIND>, row + end * kBlockBytes<KIND>);
  };

  WeightChunk<KIND> w[kGgufDepth<KIND>];
#pragma unroll
  for (int i = 0; i < kGgufDepth<KIND>; ++i) {
    if (i < chunks) fetch_chunk<KIND>(w[i], window(i), lane);
  }
  griddep_wait();
  griddep_trigger_after_wait(p.feeds_attention);

  float acc[BMAX], acc_m[BMAX];
#pragma unroll
  for (int b = 0; b < BMAX; ++b) acc[b] = acc_m[b] = 0.f;
  for (int64_t c0 = 0; c0 < chunks; c0 += kGgufDepth<KIND>) {
#pragma unroll
    for (int i = 0; i < kGgufDepth<KIND>; ++i) {  // chunk c from the registers w[i], which then take chunk c + depth
      const int64_t c = c0 + i;
      if (c >= chunks) break;
      const uint8_t* chunk = store_chunk<KIND>(w[i], window(c), stage, lane);
      if (c + kGgufDepth<KIND> < chunks) fetch_chunk<KIND>(w[i], window(c + kGgufDepth<KIND>), lane);
      __syncwarp();
      const int64_t blk = c * kChunkBlocks + lane;
      if (blk < nb) accumulate<T, KIND, A8, BMAX>(chunk, p, blk, lane, acc, acc_m);
      __syncwarp();  // the stage is rewritten by the next chunk
    }
  }
  store_row<T, KIND, A8, BMAX>(p, g, n, lane, acc, acc_m);
}

}  // namespace
}  // namespace patcher
