// The GGUF decode GEMV for the K-quants (Q4_K, Q5_K, Q6_K super-blocks of 256 values; 1 to 8 rows of x), a sibling
// of gguf_gemv_kernel (gguf_gemv.cuh) sharing its byte stream, x staging and launch shape; and the dtype's launcher
// over every kind, which gguf_<dtype>.cu instantiates. What it computes, and the rounding points: gguf/params.h.
//
// Work split. As gguf_gemv_kernel: 8 warps, one output row each; K walked in chunks of 1024 values, which are 4
// super-blocks (K is a multiple of 256, so a chunk holds 1 to 4 whole super-blocks); a lane takes one 32-value
// sub-block, lane l sub-block l % 8 of the chunk's super-block l / 8, the same 32 values as the Q8_1 block that
// stage_x puts at index l. A row's chunk (576, 704 or 840 bytes) goes through the warp's shared stage as a byte
// stream, the next chunk's bytes loaded into registers while the current one is computed, the first chunk's before
// griddepcontrol.wait (weights are never written by an earlier kernel; x is read only after it).
//
// Arithmetic, as reference.linear_w4a8 / linear_w4a16 form it. W4A8: Q4_K and Q5_K per sub-block one exact
// integer dot product isum (__dp4a over 8 words), the term (d_w * d_a) * isum with d_w = d * sc the fp32 product,
// and apart from it m_w * s_a with m_w = -(dmin * mn), summed apart and added at the end as Q4_1's are. Q6_K: two
// 16-value groups a sub-block, each its own isum and term (d * scales[g] * d_a) * isum with the sub-block's d_a;
// the pair is added first, then into the lane's sum, so a term passes through as many fp32 additions as a Q4_1
// term does (the m_w sum's final addition is the one Q6_K lacks). Every product and sum explicitly rounded (no
// contraction). W4A16: each weight formed as format.dequantize forms it, (d * sc) * q - dmin * mn or
// (d * scales[g]) * q, each product and the difference rounded once in fp32, then rounded to the dtype, then fused
// multiply-adds with x in fp32.
#pragma once
#include "gguf/gguf_gemv.cuh"

namespace patcher {
namespace {

constexpr int kChunkSuperBlocks = kChunkBlocks * 32 / 256;  // super-blocks per chunk of K: 4, 8 lanes each

// Sub-block j (0..7) of the super-block at sb (2-byte aligned): its 32 integers as signed bytes, element i in byte
// i % 4 of q[i / 4] (Q4_K: the nibble, Q5_K: nibble | high bit << 4, Q6_K: 6 bits - 32), and its scales. Q4_K, Q5_K:
// scale[0] = scale[1] = d * sc[j], dm = dmin * mn[j]. Q6_K: scale[h] = d * scales[2j + h] for the 16-value half h
// (elements 16h .. 16h + 15), dm = 0.
template <int KIND>
__device__ __forceinline__ void parse_sub_block(const uint8_t* sb, int j, float (&scale)[2], float& dm, int (&q)[8]) {
  if constexpr (KIND == kGgufQ6_K) {
    // Half h = j / 4 (128 values) reads ql[64h ..] and qh[32h ..]; its group g = j % 4 the low (g < 2) or high
    // nibbles of ql[64h + 32(g % 2) + e] and bits 2g, 2g + 1 of qh[32h + e].
    const int h = j >> 2, g = j & 3;
    const uint8_t* ql = sb + 64 * h + 32 * (g & 1);
    const uint8_t* qh = sb + 128 + 32 * h;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const unsigned low = (static_cast<unsigned>(load_word(ql + 4 * i)) >> (4 * (g >> 1))) & 0x0F0F0F0Fu;
      const unsigned high = ((static_cast<unsigned>(load_word(qh + 4 * i)) >> (2 * g)) & 0x03030303u) << 4;
      q[i] = static_cast<int>(__vsub4(low | high, 0x20202020u));  // 0..63 - 32 per byte, no borrow between bytes
    }
    const float d = load_fp16(sb + 208);
    const int8_t* scales = reinterpret_cast<const int8_t*>(sb + 192);
    scale[0] = __fmul_rn(d, static_cast<float>(scales[2 * j]));
    scale[1] = __fmul_rn(d, static_cast<float>(scales[2 * j + 1]));
    dm = 0.f;
  } else {
    // 6-bit sc, mn (format.k_scale_min): j < 4 in bits 0-5 of bytes j and j + 4 of `scales`; j >= 4 the low and
    // high nibbles of byte j + 4 and, as bits 4-5, the top two bits of bytes j - 4 (sc) and j (mn).
    const uint8_t* s = sb + 4;
    const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    const int mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    scale[0] = scale[1] = __fmul_rn(load_fp16(sb), static_cast<float>(sc));
    dm = __fmul_rn(load_fp16(sb + 2), static_cast<float>(mn));
    // qs chunk j / 2 (32 bytes) holds sub-block j in its low (j even) or high (j odd) nibbles; Q5_K's fifth bit of
    // element e is bit j of qh[e].
    const uint8_t* qs = sb + (KIND == kGgufQ4_K ? 16 : 48) + 32 * (j >> 1);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      unsigned v = (static_cast<unsigned>(load_word(qs + 4 * i)) >> (4 * (j & 1))) & 0x0F0F0F0Fu;
      if constexpr (KIND == kGgufQ5_K) {
        v |= ((static_cast<unsigned>(load_word(sb + 16 + 4 * i)) >> j) & 0x01010101u) << 4;
      }
      q[i] = static_cast<int>(v);
    }
  }
}

template <typename T, int KIND, bool A8, int BMAX>
__global__ void __launch_bounds__(kGgufWarps * 32) gguf_kquant_kernel(const GgufGemvParams p) {
  extern __shared__ __align__(16) uint8_t gguf_kquant_smem_bytes[];
  constexpr int SB = kBlockBytes<KIND>;
  constexpr bool kHasMin = KIND != kGgufQ6_K;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kGgufWarps + warp;
  const bool live = n < p.n;  // warps past the last row still stage x with the others
  const int64_t nb = p.k / 32;    // 32-value sub-blocks (and Q8_1 blocks of x)
  const int64_t nsb = p.k / 256;  // super-blocks
  const int64_t chunks = (nsb + kChunkSuperBlocks - 1) / kChunkSuperBlocks;
  uint8_t* stage = gguf_kquant_smem_bytes + warp * kStageBytes<KIND>;
  uint8_t* xs = gguf_kquant_smem_bytes + kGgufWarps * kStageBytes<KIND>;
  float* s_a = reinterpret_cast<float*>(xs + p.batch * kChunkBlocks * kQ8Stride);  // A8: [batch][32]
  const uint8_t* row = p.blocks + (live ? n : 0) * p.row_bytes;
  auto window = [&](int64_t c) {
    const int64_t end = (c + 1) * kChunkSuperBlocks < nsb ? (c + 1) * kChunkSuperBlocks : nsb;
    return byte_window(row + c * kChunkSuperBlocks * SB, row + end * SB);
  };

  auto blocks_in = [&](int64_t c) {  // 32-value blocks in chunk c: a multiple of 8 (whole super-blocks)
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
    float scale[2], dm;
    int q[8];
    parse_sub_block<KIND>(blocks + (lane >> 3) * SB, lane & 7, scale, dm, q);
    if constexpr (A8) {
#pragma unroll
      for (int b = 0; b < BMAX; ++b) {
        if (b >= p.batch) break;
        const uint8_t* xb = xs + (b * kChunkBlocks + lane) * kQ8Stride;
        const int* qa = reinterpret_cast<const int*>(xb);
        int isum0 = 0, isum1 = 0;  // elements 0..15 and 16..31
#pragma unroll
        for (int i = 0; i < 4; ++i) isum0 = __dp4a(q[i], qa[i], isum0);
#pragma unroll
        for (int i = 4; i < 8; ++i) isum1 = __dp4a(q[i], qa[i], isum1);
        const float d_a = *reinterpret_cast<const float*>(xb + 32);
        if constexpr (kHasMin) {
          const float t = __fmul_rn(__fmul_rn(scale[0], d_a), static_cast<float>(isum0 + isum1));
          acc[b] = __fadd_rn(acc[b], t);
          acc_m[b] = __fadd_rn(acc_m[b], __fmul_rn(-dm, s_a[b * kChunkBlocks + lane]));
        } else {
          const float t0 = __fmul_rn(__fmul_rn(scale[0], d_a), static_cast<float>(isum0));
          const float t1 = __fmul_rn(__fmul_rn(scale[1], d_a), static_cast<float>(isum1));
          acc[b] = __fadd_rn(acc[b], __fadd_rn(t0, t1));
        }
      }
    } else {
      float wv[32];
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        const float qi = static_cast<float>(static_cast<int8_t>(static_cast<unsigned>(q[i / 4]) >> (8 * (i % 4))));
        const float value = kHasMin ? __fsub_rn(__fmul_rn(scale[0], qi), dm) : __fmul_rn(scale[i / 16], qi);
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
    if constexpr (A8 && kHasMin) acc_m[b] = warp_sum(acc_m[b]);
  }
  if (lane != 0) return;
  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int b = 0; b < BMAX; ++b) {
    if (b >= p.batch) break;
    float y = A8 && kHasMin ? __fadd_rn(acc[b], acc_m[b]) : acc[b];
    if (p.bias) {
      const float bias = load_scalar(p.bias, p.bias_dtype, n);
      y = __fadd_rn(y, A8 ? bias : round_to<T>(bias));  // W4A16: the reference's bias.to(x.dtype)
    }
    out[b * p.n + n] = from_float<T>(y);
  }
}

template <typename T, int KIND, bool A8, int BMAX>
cudaError_t launch_gguf_kquant(const GgufGemvParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((p.n + kGgufWarps - 1) / kGgufWarps));
  return launch_pdl(gguf_kquant_kernel<T, KIND, A8, BMAX>, grid, dim3(kGgufWarps * 32),
                    gguf_smem<KIND>(p.batch, A8), stream, p);
}

template <typename T, int KIND, bool A8>
cudaError_t launch_gguf_kquant_batch(const GgufGemvParams& p, cudaStream_t stream) {
  if (p.batch <= 1) return launch_gguf_kquant<T, KIND, A8, 1>(p, stream);
  if (p.batch <= 2) return launch_gguf_kquant<T, KIND, A8, 2>(p, stream);
  if (p.batch <= 4) return launch_gguf_kquant<T, KIND, A8, 4>(p, stream);
  return launch_gguf_kquant<T, KIND, A8, 8>(p, stream);
}

template <typename T, int KIND>
cudaError_t launch_gguf_kquant_mode(const GgufGemvParams& p, cudaStream_t stream) {
  return p.quantize_activations ? launch_gguf_kquant_batch<T, KIND, true>(p, stream)
                                : launch_gguf_kquant_batch<T, KIND, false>(p, stream);
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
      return launch_gguf_kquant_mode<T, kGgufQ4_K>(p, stream);
    case kGgufQ5_K:
      return launch_gguf_kquant_mode<T, kGgufQ5_K>(p, stream);
    case kGgufQ6_K:
      return launch_gguf_kquant_mode<T, kGgufQ6_K>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace
}  // namespace patcher
