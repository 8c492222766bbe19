// The GGUF decode GEMV (1 to 8 rows of x, every block type of gguf/params.h), a template over the activation dtype
// and the block type, and its launchers; included by one .cu file per dtype (gguf_half.cu, gguf_bf16.cu,
// gguf_float.cu), the entry point in gguf.cu. What it computes, and the rounding points: gguf/params.h.
//
// Work split. A block has 8 warps, one output row each; K is walked in chunks of 1024 values (gguf_blocks.cuh), a lane
// taking one 32-value block or K-quant sub-block (lane l: block l, or sub-block l % 8 of super-block l / 8: the same
// 32 values as the Q8_1 block that stage_x puts at index l). Per chunk the whole block first stages x's chunk in
// shared memory: quantized to Q8_1 (W4A8; a warp per 32 values: max |x| and sum(q) by warp shuffles) or as fp32
// (W4A16), from registers loaded a chunk ahead (XChunk), so no chunk waits on a global load of x. Each warp copies its
// row's chunk of weight bytes into its own shared stage, and each lane then reads its block from there. The weight
// bytes of the next chunk are loaded into registers while the current one is computed; the first chunk's before
// griddepcontrol.wait (weights are never written by an earlier kernel), so under programmatic dependent launch they
// overlap the previous kernel's tail.
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

namespace patcher {
namespace {

constexpr int kGgufWarps = 8;  // output rows per block
constexpr int kQ8Stride = 36;  // bytes of a staged Q8_1 block: q int8[32] | d fp32; 9 words, so lanes reading
                               // their own blocks' words hit distinct banks
constexpr int kXfStride = 33;  // floats of a staged W4A16 block (33: conflict-free for the same reason)

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

// A warp's share of x's chunk in registers: the values it stages (task t = warp + 8 i is row t / nq, 32-value block
// t % nq; each lane one value), loaded a chunk ahead as the weights are, so staging waits on no global load.
template <typename T, int BMAX>
struct XChunk {
  T v[BMAX * kChunkBlocks / kGgufWarps];
};

template <typename T, int BMAX>
__device__ __forceinline__ void fetch_x(XChunk<T, BMAX>& xr, const GgufGemvParams& p, int64_t chunk, int nq,
                                        int warp, int lane) {
  const T* x = static_cast<const T*>(p.x);
#pragma unroll
  for (int i = 0; i < BMAX * kChunkBlocks / kGgufWarps; ++i) {
    const int t = warp + kGgufWarps * i;
    if (t < p.batch * nq) xr.v[i] = x[(t / nq) * p.x_stride + (chunk * kChunkBlocks + t % nq) * 32 + lane];
  }
}

// x's chunk (nq blocks of 32 values, every row) from the warps' registers into shared memory, one warp per 32
// values. A8: Q8_1 as reference.quantize_q8_1: d = max|x| / 127, q = roundf(x * (1 / d)) (0 where d = 0), d kept as
// its fp16 value, s = sum(q) * d; the block's bytes q[32] | d at xs + (b * 32 + j) * kQ8Stride, s at
// s_a[b * 32 + j]. Otherwise x in fp32 at xs + ((b * 32 + j) * kXfStride + lane) floats.
template <typename T, bool A8, int BMAX>
__device__ __forceinline__ void stage_x(const XChunk<T, BMAX>& xr, const GgufGemvParams& p, int nq, uint8_t* xs,
                                        float* s_a, int warp, int lane) {
#pragma unroll
  for (int i = 0; i < BMAX * kChunkBlocks / kGgufWarps; ++i) {
    const int t = warp + kGgufWarps * i;
    if (t >= p.batch * nq) break;  // the same for the whole warp: the shuffles below see all 32 lanes
    const int b = t / nq, j = t % nq;
    const float v = to_float(xr.v[i]);
    if constexpr (A8) {
      float amax = fabsf(v);
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
      const float d = __fdiv_rn(amax, 127.f);
      const float inv = d == 0.f ? 0.f : __frcp_rn(d);
      const int q = static_cast<int>(roundf(__fmul_rn(v, inv)));  // roundf: halves away from zero, as llama.cpp
      int sum = q;
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
      const float stored = __half2float(__float2half_rn(d));
      uint8_t* blk = xs + (b * kChunkBlocks + j) * kQ8Stride;
      blk[lane] = static_cast<uint8_t>(static_cast<int8_t>(q));
      if (lane == 0) {
        *reinterpret_cast<float*>(blk + 32) = stored;
        s_a[b * kChunkBlocks + j] = __fmul_rn(static_cast<float>(sum), stored);
      }
    } else {
      reinterpret_cast<float*>(xs)[(b * kChunkBlocks + j) * kXfStride + lane] = v;
    }
  }
}

// Shared memory of one launch: the warps' weight stages, then x's chunk for `batch` rows.
template <int KIND>
size_t gguf_smem(int64_t batch, bool a8) {
  const size_t x_stage = a8 ? static_cast<size_t>(batch) * kChunkBlocks * (kQ8Stride + 4)
                            : static_cast<size_t>(batch) * kChunkBlocks * kXfStride * 4;
  return static_cast<size_t>(kGgufWarps) * kStageBytes<KIND> + x_stage;
}

// One lane's block of the chunk (at `chunk` in the warp's stage) times every row of x's staged chunk, into the
// lane's sums.
template <typename T, int KIND, bool A8, int BMAX>
__device__ __forceinline__ void accumulate(const uint8_t* chunk, const uint8_t* xs, const float* s_a, int batch,
                                           int lane, float (&acc)[BMAX], float (&acc_m)[BMAX]) {
  float scale[2], off;
  int q[8];
  parse_lane<KIND>(chunk, lane, scale, off, q);
  if constexpr (A8) {
#pragma unroll
    for (int b = 0; b < BMAX; ++b) {
      if (b >= batch) break;
      const uint8_t* xb = xs + (b * kChunkBlocks + lane) * kQ8Stride;
      const int* qa = reinterpret_cast<const int*>(xb);
      const float d_a = *reinterpret_cast<const float*>(xb + 32);
      if constexpr (KIND == kGgufQ6_K) {
        int isum0 = 0, isum1 = 0;  // elements 0..15 and 16..31
#pragma unroll
        for (int i = 0; i < 4; ++i) isum0 = __dp4a(q[i], qa[i], isum0);
#pragma unroll
        for (int i = 4; i < 8; ++i) isum1 = __dp4a(q[i], qa[i], isum1);
        const float t0 = __fmul_rn(__fmul_rn(scale[0], d_a), static_cast<float>(isum0));
        const float t1 = __fmul_rn(__fmul_rn(scale[1], d_a), static_cast<float>(isum1));
        acc[b] = __fadd_rn(acc[b], __fadd_rn(t0, t1));
      } else {
        int isum = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) isum = __dp4a(q[i], qa[i], isum);
        acc[b] = __fadd_rn(acc[b], __fmul_rn(__fmul_rn(scale[0], d_a), static_cast<float>(isum)));
        if constexpr (kHasOffset<KIND>) acc_m[b] = __fadd_rn(acc_m[b], __fmul_rn(off, s_a[b * kChunkBlocks + lane]));
      }
    }
  } else {
    float wv[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) wv[i] = round_to<T>(weight_at<KIND>(scale, off, q, i));
#pragma unroll
    for (int b = 0; b < BMAX; ++b) {
      if (b >= batch) break;
      const float* xb = reinterpret_cast<const float*>(xs) + (b * kChunkBlocks + lane) * kXfStride;
#pragma unroll
      for (int i = 0; i < 32; ++i) acc[b] = fmaf(wv[i], xb[i], acc[b]);
    }
  }
}

template <typename T, int KIND, bool A8, int BMAX>
__global__ void __launch_bounds__(kGgufWarps * 32) gguf_gemv_kernel(const GgufGemvParams p) {
  extern __shared__ __align__(16) uint8_t gguf_smem_bytes[];
  constexpr int kPerChunk = kChunkBlocks * 32 / kBlockValues<KIND>;  // blocks (super-blocks) a chunk
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kGgufWarps + warp;
  const bool live = n < p.n;  // warps past the last row still stage x with the others
  const int64_t nb = p.k / 32;                     // 32-value blocks (and Q8_1 blocks of x) a row
  const int64_t units = p.k / kBlockValues<KIND>;  // blocks (super-blocks) a row
  const int64_t chunks = (units + kPerChunk - 1) / kPerChunk;
  uint8_t* stage = gguf_smem_bytes + warp * kStageBytes<KIND>;
  uint8_t* xs = gguf_smem_bytes + kGgufWarps * kStageBytes<KIND>;
  float* s_a = reinterpret_cast<float*>(xs + p.batch * kChunkBlocks * kQ8Stride);  // A8: [batch][32]
  const uint8_t* row = p.blocks + (live ? n : 0) * p.row_bytes;
  auto window = [&](int64_t c) {
    const int64_t end = (c + 1) * kPerChunk < units ? (c + 1) * kPerChunk : units;
    return byte_window(row + c * kPerChunk * kBlockBytes<KIND>, row + end * kBlockBytes<KIND>);
  };
  auto blocks_in = [&](int64_t c) {  // 32-value blocks in chunk c (a multiple of 8 for the K-quants)
    return static_cast<int>(nb - c * kChunkBlocks < kChunkBlocks ? nb - c * kChunkBlocks : kChunkBlocks);
  };

  griddep_trigger_at_entry();  // no decode attention reads this op's output directly
  WeightChunk<KIND> w{};
  if (live) fetch_chunk<KIND>(w, window(0), lane);
  griddep_wait();
  XChunk<T, BMAX> xr;
  fetch_x<T, BMAX>(xr, p, 0, blocks_in(0), warp, lane);

  float acc[BMAX], acc_m[BMAX];
#pragma unroll
  for (int b = 0; b < BMAX; ++b) acc[b] = acc_m[b] = 0.f;
  for (int64_t c = 0; c < chunks; ++c) {
    const int nq = blocks_in(c);
    __syncthreads();  // every warp is done with the previous chunk's stages
    const uint8_t* chunk = nullptr;
    if (live) {
      chunk = store_chunk<KIND>(w, window(c), stage, lane);
      if (c + 1 < chunks) fetch_chunk<KIND>(w, window(c + 1), lane);  // in flight while this chunk is computed
    }
    stage_x<T, A8, BMAX>(xr, p, nq, xs, s_a, warp, lane);
    if (c + 1 < chunks) fetch_x<T, BMAX>(xr, p, c + 1, blocks_in(c + 1), warp, lane);  // likewise
    __syncthreads();
    if (live && lane < nq) accumulate<T, KIND, A8, BMAX>(chunk, xs, s_a, static_cast<int>(p.batch), lane, acc, acc_m);
  }
  if (!live) return;
  constexpr bool kOffsetSum = A8 && kHasOffset<KIND>;
#pragma unroll
  for (int b = 0; b < BMAX; ++b) {
    acc[b] = warp_sum(acc[b]);
    if constexpr (kOffsetSum) acc_m[b] = warp_sum(acc_m[b]);
  }
  if (lane != 0) return;
  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int b = 0; b < BMAX; ++b) {
    if (b >= p.batch) break;
    float y = kOffsetSum ? __fadd_rn(acc[b], acc_m[b]) : acc[b];
    if (p.bias) {
      const float bias = load_scalar(p.bias, p.bias_dtype, n);
      y = __fadd_rn(y, A8 ? bias : round_to<T>(bias));  // W4A16: the reference's bias.to(x.dtype)
    }
    out[b * p.n + n] = from_float<T>(y);
  }
}

template <typename T, int KIND, bool A8, int BMAX>
cudaError_t launch_gguf(const GgufGemvParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((p.n + kGgufWarps - 1) / kGgufWarps));
  return launch_pdl(gguf_gemv_kernel<T, KIND, A8, BMAX>, grid, dim3(kGgufWarps * 32), gguf_smem<KIND>(p.batch, A8),
                    stream, p);
}

template <typename T, int KIND, bool A8>
cudaError_t launch_gguf_batch(const GgufGemvParams& p, cudaStream_t stream) {
  if (p.batch <= 1) return launch_gguf<T, KIND, A8, 1>(p, stream);
  if (p.batch <= 2) return launch_gguf<T, KIND, A8, 2>(p, stream);
  if (p.batch <= 4) return launch_gguf<T, KIND, A8, 4>(p, stream);
  return launch_gguf<T, KIND, A8, 8>(p, stream);
}

template <typename T, int KIND>
cudaError_t launch_gguf_mode(const GgufGemvParams& p, cudaStream_t stream) {
  return p.quantize_activations ? launch_gguf_batch<T, KIND, true>(p, stream)
                                : launch_gguf_batch<T, KIND, false>(p, stream);
}

// The dtype's launcher over every kind, which gguf_<dtype>.cu instantiates.
template <typename T>
cudaError_t launch_gguf_gemv_typed(const GgufGemvParams& p, cudaStream_t stream) {
  switch (p.kind) {
    case kGgufQ4_0:
      return launch_gguf_mode<T, kGgufQ4_0>(p, stream);
    case kGgufQ4_1:
      return launch_gguf_mode<T, kGgufQ4_1>(p, stream);
    case kGgufQ8_0:
      return launch_gguf_mode<T, kGgufQ8_0>(p, stream);
    case kGgufQ4_K:
      return launch_gguf_mode<T, kGgufQ4_K>(p, stream);
    case kGgufQ5_K:
      return launch_gguf_mode<T, kGgufQ5_K>(p, stream);
    case kGgufQ6_K:
      return launch_gguf_mode<T, kGgufQ6_K>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace
}  // namespace patcher
