// The GGUF decode GEMV (Q4_0, Q4_1, Q8_0 blocks; 1 to 8 rows of x), a template over the activation dtype, and the
// parts the K-quants' kernel shares with it (gguf_kquant.cuh, which includes this file and is included by one .cu
// file per dtype: gguf_half.cu, gguf_bf16.cu, gguf_float.cu); the entry point is in gguf.cu. What it computes, and
// the rounding points: gguf/params.h.
//
// Work split. A block has 8 warps, one output row each; K is walked in chunks of 32 blocks (1024 values), one
// 32-value block a lane. Per chunk the whole block first stages x's chunk in shared memory: quantized to Q8_1
// (W4A8; a warp per 32 values: max |x| and sum(q) by warp shuffles) or as fp32 (W4A16), from registers that were
// loaded a chunk ahead (XChunk), so no chunk waits on a global load of x. Each warp copies its row's
// chunk of weight bytes into its own shared stage, and each lane then reads its block from there: GGUF blocks are
// 18, 20 or 34 bytes, so a row is loaded as a byte stream, 16-byte vectors for the aligned body and single bytes
// for the unaligned head and tail, which keeps every global load of the body 16 bytes wide whatever the row's
// alignment. The weight bytes of the next chunk are loaded into registers while the current one is computed; the
// first chunk's are loaded before griddepcontrol.wait (weights are never written by an earlier kernel), so under
// programmatic dependent launch they overlap the previous kernel's tail.
//
// Arithmetic. W4A8: the integer dot product of a block (__dp4a over 8 words; Q4_0's nibbles minus 8 per byte) is
// exact; it is scaled as the reference scales it, (d_w * d_a) * isum, with explicitly rounded products and sums
// (no contraction into fused multiply-adds), summed per lane over the chunks, then over the lanes. Q4_1's
// m_w * s_a terms are summed apart and added at the end, as the reference adds its second matmul. W4A16: each
// weight formed as gguf.quants forms it and rounded to the dtype, then fused multiply-adds with x in fp32.
#pragma once
#include "common/common.cuh"
#include "gguf/params.h"

namespace patcher {
namespace {

constexpr int kGgufWarps = 8;        // output rows per block
constexpr int kChunkBlocks = 32;     // 32-value blocks per chunk of K: one a lane
constexpr int kQ8Stride = 36;        // bytes of a staged Q8_1 block: q int8[32] | d fp32; 9 words, so lanes reading
                                     // their own blocks' words hit distinct banks
constexpr int kXfStride = 33;        // floats of a staged W4A16 block (33: conflict-free for the same reason)

template <int KIND>
constexpr bool kKQuant = KIND == kGgufQ4_K || KIND == kGgufQ5_K || KIND == kGgufQ6_K;

// Bytes and values of a block (a super-block for the K-quants), as gguf_block_bytes / gguf_block_values.
template <int KIND>
constexpr int kBlockBytes = KIND == kGgufQ4_0   ? 18
                            : KIND == kGgufQ4_1 ? 20
                            : KIND == kGgufQ8_0 ? 34
                            : KIND == kGgufQ4_K ? 144
                            : KIND == kGgufQ5_K ? 176
                                                : 210;
template <int KIND>
constexpr int kBlockValues = kKQuant<KIND> ? 256 : 32;

// Weight bytes of one row's chunk of K (kChunkBlocks * 32 values): 32 blocks, or 4 super-blocks.
template <int KIND>
constexpr int kChunkBytes = kChunkBlocks * 32 / kBlockValues<KIND> * kBlockBytes<KIND>;

// A warp's weight stage: one chunk's bytes, placed at the global address's offset mod 16 so that the aligned body
// lands on 16-byte boundaries of shared memory.
template <int KIND>
constexpr int kStageBytes = (kChunkBytes<KIND> + 15 + 15) / 16 * 16;

// 16-byte vectors of a chunk per lane: a chunk's body has at most chunk bytes / 16 of them.
template <int KIND>
constexpr int kVecsPerLane = (kChunkBytes<KIND> / 16 + 31) / 32;

// The bytes [lo, hi) of one row's chunk: head [lo, a) and tail [e, hi) are under 16 bytes each, the body [a, e)
// 16-byte aligned. hi - lo >= 18 (one block, the smallest), so lo <= a <= e <= hi.
struct ByteWindow {
  const uint8_t *lo, *a, *e, *hi;
};

__device__ __forceinline__ ByteWindow byte_window(const uint8_t* lo, const uint8_t* hi) {
  const uint8_t* a = lo + ((16 - (reinterpret_cast<uintptr_t>(lo) & 15)) & 15);
  const uint8_t* e = hi - (reinterpret_cast<uintptr_t>(hi) & 15);
  return {lo, a, e, hi};
}

// One lane's share of a chunk in registers: body vectors lane, lane + 32, ..., and one head (lanes 0-15) or tail
// (lanes 16-31) byte.
template <int KIND>
struct WeightChunk {
  uint4 v[kVecsPerLane<KIND>];
  uint8_t edge;
};

template <int KIND>
__device__ __forceinline__ void fetch_chunk(WeightChunk<KIND>& w, const ByteWindow& win, int lane) {
  const int64_t vectors = (win.e - win.a) / 16;
  const uint4* body = reinterpret_cast<const uint4*>(win.a);
#pragma unroll
  for (int j = 0; j < kVecsPerLane<KIND>; ++j) {
    const int64_t i = lane + 32 * j;
    if (i < vectors) w.v[j] = __ldcs(body + i);
  }
  const uint8_t* at = lane < 16 ? win.lo + lane : win.e + (lane - 16);
  const bool in = lane < 16 ? at < win.a : at < win.hi;
  w.edge = in ? *at : 0;
}

// Writes the chunk into the warp's stage; returns where its first block starts there.
template <int KIND>
__device__ __forceinline__ const uint8_t* store_chunk(const WeightChunk<KIND>& w, const ByteWindow& win,
                                                      uint8_t* stage, int lane) {
  const uint8_t* base = win.lo - (reinterpret_cast<uintptr_t>(win.lo) & 15);  // maps to stage[0]
  const int64_t vectors = (win.e - win.a) / 16;
  uint4* body = reinterpret_cast<uint4*>(stage + (win.a - base));
#pragma unroll
  for (int j = 0; j < kVecsPerLane<KIND>; ++j) {
    const int64_t i = lane + 32 * j;
    if (i < vectors) body[i] = w.v[j];
  }
  const uint8_t* at = lane < 16 ? win.lo + lane : win.e + (lane - 16);
  if (lane < 16 ? at < win.a : at < win.hi) stage[at - base] = w.edge;
  return stage + (win.lo - base);
}

// 4 bytes at a 2-byte aligned address (a block's fields are 2-byte aligned), little-endian.
__device__ __forceinline__ int load_word(const uint8_t* p) {
  const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
  return static_cast<int>(static_cast<uint32_t>(h[0]) | (static_cast<uint32_t>(h[1]) << 16));
}

__device__ __forceinline__ float load_fp16(const uint8_t* p) {
  return __half2float(__ushort_as_half(*reinterpret_cast<const uint16_t*>(p)));
}

// One weight block: d (and m for Q4_1) in fp32, and its 32 integers as signed bytes, element i in byte i % 4 of
// q[i / 4] (Q4_0: nibble - 8, Q4_1: nibble, Q8_0: the int8).
template <int KIND>
__device__ __forceinline__ void parse_block(const uint8_t* blk, float& d, float& m, int (&q)[8]) {
  d = load_fp16(blk);
  m = 0.f;
  if constexpr (KIND == kGgufQ8_0) {
#pragma unroll
    for (int j = 0; j < 8; ++j) q[j] = load_word(blk + 2 + 4 * j);
  } else {
    const uint8_t* qs = blk + (KIND == kGgufQ4_1 ? 4 : 2);
    if constexpr (KIND == kGgufQ4_1) m = load_fp16(blk + 2);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const unsigned v = static_cast<unsigned>(load_word(qs + 4 * j));
      unsigned low = v & 0x0F0F0F0Fu, high = (v >> 4) & 0x0F0F0F0Fu;
      if constexpr (KIND == kGgufQ4_0) {
        low = __vsub4(low, 0x08080808u);  // per byte, no borrow between bytes
        high = __vsub4(high, 0x08080808u);
      }
      q[j] = static_cast<int>(low);        // elements 4j .. 4j + 3
      q[4 + j] = static_cast<int>(high);   // elements 16 + 4j .. 16 + 4j + 3
    }
  }
}

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

template <typename T, int KIND, bool A8, int BMAX>
__global__ void __launch_bounds__(kGgufWarps * 32) gguf_gemv_kernel(const GgufGemvParams p) {
  extern __shared__ __align__(16) uint8_t gguf_smem_bytes[];
  constexpr int TS = kBlockBytes<KIND>;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kGgufWarps + warp;
  const bool live = n < p.n;  // warps past the last row still stage x with the others
  const int64_t nb = p.k / 32;
  const int64_t chunks = (nb + kChunkBlocks - 1) / kChunkBlocks;
  uint8_t* stage = gguf_smem_bytes + warp * kStageBytes<KIND>;
  uint8_t* xs = gguf_smem_bytes + kGgufWarps * kStageBytes<KIND>;
  float* s_a = reinterpret_cast<float*>(xs + p.batch * kChunkBlocks * kQ8Stride);  // A8: [batch][32]
  const uint8_t* row = p.blocks + (live ? n : 0) * p.row_bytes;
  auto window = [&](int64_t c) {
    const int64_t end = (c + 1) * kChunkBlocks < nb ? (c + 1) * kChunkBlocks : nb;
    return byte_window(row + c * kChunkBlocks * TS, row + end * TS);
  };

  auto blocks_in = [&](int64_t c) {  // 32-value blocks in chunk c
    return static_cast<int>(nb - c * kChunkBlocks < kChunkBlocks ? nb - c * kChunkBlocks : kChunkBlocks);
  };

  WeightChunk<KIND> w{};
  if (live) fetch_chunk<KIND>(w, window(0), lane);
  griddep_wait();
  griddep_launch_dependents();
  XChunk<T, BMAX> xr;
  fetch_x<T, BMAX>(xr, p, 0, blocks_in(0), warp, lane);

  float acc[BMAX], acc_m[BMAX];
#pragma unroll
  for (int b = 0; b < BMAX; ++b) acc[b] = acc_m[b] = 0.f;
  for (int64_t c = 0; c < chunks; ++c) {
    const int nq = blocks_in(c);
    __syncthreads();  // every warp is done with the previous chunk's stages
    const uint8_t* blocks = nullptr;
    if (live) {
      blocks = store_chunk<KIND>(w, window(c), stage, lane);
      if (c + 1 < chunks) fetch_chunk<KIND>(w, window(c + 1), lane);  // in flight while this chunk is computed
    }
    stage_x<T, A8, BMAX>(xr, p, nq, xs, s_a, warp, lane);
    if (c + 1 < chunks) fetch_x<T, BMAX>(xr, p, c + 1, blocks_in(c + 1), warp, lane);  // likewise
    __syncthreads();
    if (!live || lane >= nq) continue;
    float d, m;
    int q[8];
    parse_block<KIND>(blocks + lane * TS, d, m, q);
    if constexpr (A8) {
#pragma unroll
      for (int b = 0; b < BMAX; ++b) {
        if (b >= p.batch) break;
        const uint8_t* xb = xs + (b * kChunkBlocks + lane) * kQ8Stride;
        const int* qa = reinterpret_cast<const int*>(xb);
        int isum = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) isum = __dp4a(q[j], qa[j], isum);
        const float d_a = *reinterpret_cast<const float*>(xb + 32);
        acc[b] = __fadd_rn(acc[b], __fmul_rn(__fmul_rn(d, d_a), static_cast<float>(isum)));
        if constexpr (KIND == kGgufQ4_1) acc_m[b] = __fadd_rn(acc_m[b], __fmul_rn(m, s_a[b * kChunkBlocks + lane]));
      }
    } else {
      float wv[32];
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        const float qi = static_cast<float>(static_cast<int8_t>(static_cast<unsigned>(q[i / 4]) >> (8 * (i % 4))));
        const float value = KIND == kGgufQ4_1 ? __fadd_rn(__fmul_rn(d, qi), m) : __fmul_rn(d, qi);
        wv[i] = round_to<T>(value);
      }
#pragma unroll
      for (int b = 0; b < BMAX; ++b) {
        if (b >= p.batch) break;
        const float* xb = reinterpret_cast<const float*>(xs) + (b * kChunkBlocks + lane) * kXfStride;
#pragma unroll
        for (int i = 0; i < 32; ++i) acc[b] = fmaf(wv[i], xb[i], acc[b]);
      }
    }
  }
  if (!live) return;
#pragma unroll
  for (int b = 0; b < BMAX; ++b) {
    acc[b] = warp_sum(acc[b]);
    acc_m[b] = warp_sum(acc_m[b]);
  }
  if (lane != 0) return;
  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int b = 0; b < BMAX; ++b) {
    if (b >= p.batch) break;
    float y = A8 && KIND == kGgufQ4_1 ? __fadd_rn(acc[b], acc_m[b]) : acc[b];
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

}  // namespace
}  // namespace patcher
