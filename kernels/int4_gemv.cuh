// The GPTQ int4 decode kernel (a template over the activation dtype), included by one .cu file per dtype
// (int4_half.cu, int4_bf16.cu, int4_float.cu) so that nvcc builds the dtypes in parallel: in one file the
// 48 instantiations took 90 s of a first-use build. The entry points are in int4.cu.
//
// GPTQ int4 matrix-vector products for decode (1 to 8 rows of x), with the dequantization in the kernel, an
// optional norm prologue (the residual add and RMSNorm/LayerNorm of the restructured stack) and a fused epilogue
// (bias, GELU, SwiGLU, or RoPE with K/V written into the static cache); and the dequantization kernel of the
// prefill path.
//
// Weights stay in the checkpoint's layout: qweight int32 [K/8, N] holds 8 consecutive k of one column per word,
// so one 16-byte load is 4 adjacent columns x 8 k, and the threads of a warp read consecutive bytes of a row.
//
// Work split. The output columns are cut into tiles (128 columns; one head when RoPE follows, so that the two
// halves a rotation pairs sit in one tile) and K into `splits` slices; one block per (tile, slice). threadIdx.x
// picks 4 columns of the tile, threadIdx.y a run of qweight rows of the slice. Each thread issues its first
// weight loads before griddepcontrol.wait, so with programmatic dependent launch they are in flight while the
// previous kernel finishes and while this block prepares x. x for the slice (normalized in the prologue when the
// norm is fused) is staged in shared memory as floats. Partial sums of the slices meet in a global fp32
// workspace; the last block to finish a tile (an atomic counter per tile, reset by that block) adds them up and
// runs the epilogue, so the whole op is one kernel.
//
// Arithmetic. Every weight is formed exactly as the reference forms it, round_fp16(s * (q - z)), then multiplied
// with x in fp32. Without act-order a word's 8 nibbles share one group, and two weights are made per instruction:
// the 0x6400 trick turns nibbles into fp16 (1024 + q is exact), one __hsub2 leaves q - zero (exact), one __hmul2
// applies the scale (the reference's rounding). With act-order (g_idx a permutation of the groups) every k has
// its own group, and the weights are formed one at a time: correct, and slower.
#pragma once
#include "common.cuh"
#include "rope.cuh"

namespace patcher {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kStageFloats = 8192;  // shared x stage: batch * slice length (32 KB); the split rule keeps to it
constexpr int kNormElems = 32;          // norm prologue: row elements per thread held in registers (K <= 32 x threads)

struct TileInfo {
  int seg;       // segment of this tile
  int64_t col0;  // first column, within the segment
  int width;     // columns (<= tile width)
  int group;     // counter index: the tile, or for SwiGLU the gate/up tile pair
  int members;   // tiles in the group (2 for SwiGLU)
};

__device__ __forceinline__ TileInfo tile_info(const Int4Params& p, int tile, int tile_width) {
  TileInfo t{};
  int local = tile;
  while (t.seg + 1 < p.num_segments) {
    const int tiles = static_cast<int>((p.seg[t.seg].n + tile_width - 1) / tile_width);
    if (local < tiles) break;
    local -= tiles;
    ++t.seg;
  }
  t.col0 = static_cast<int64_t>(local) * tile_width;
  const int64_t left = p.seg[t.seg].n - t.col0;
  t.width = static_cast<int>(left < tile_width ? left : tile_width);
  t.group = p.epilogue == kInt4SiluMul ? local : tile;
  t.members = p.epilogue == kInt4SiluMul ? 2 : 1;
  return t;
}

// Column offset of segment s in the logical output (q | k | v).
__device__ __forceinline__ int64_t segment_offset(const Int4Params& p, int s) {
  int64_t offset = 0;
  for (int i = 0; i < s; ++i) offset += p.seg[i].n;
  return offset;
}

// The 8 weights of one word (k0..k7 of one column) as 4 float2: (k0,k4) (k1,k5) (k2,k6) (k3,k7).
// OR-ing a nibble into the mantissa of 1024 (0x6400) gives 1024 + q exactly; subtracting 1024 + zero leaves
// q - zero exactly; the fp16 multiply by the scale rounds as the reference's does.
__device__ __forceinline__ void dequantize_word(uint32_t word, __half2 zero1024, __half2 scale, float2 (&out)[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t bits = ((word >> (4 * j)) & 0x000F000Fu) | 0x64006400u;
    __half2 h;
    memcpy(&h, &bits, 4);
    out[j] = __half22float2(__hmul2(__hsub2(h, zero1024), scale));
  }
}

__device__ __forceinline__ int zero_point(const Int4Segment& s, int64_t g, int64_t col, int offset) {
  const uint32_t word = static_cast<uint32_t>(s.qzeros[g * (s.n / 8) + col / 8]);
  return static_cast<int>((word >> (4 * (col % 8))) & 0xFu) + offset;
}

// The scales and zero points of one group for 4 adjacent columns (col % 4 == 0): one 8-byte load of scales and
// one qzeros word (its 4 nibbles from (col % 8) on).
struct GroupParams {
  uint2 scales;
  uint32_t zeros;
};

__device__ __forceinline__ GroupParams load_group(const Int4Segment& s, int64_t g, int64_t col) {
  GroupParams out;
  out.scales = *reinterpret_cast<const uint2*>(static_cast<const __half*>(s.scales) + g * s.n + col);
  out.zeros = static_cast<uint32_t>(s.qzeros[g * (s.n / 8) + col / 8]) >> (4 * (col % 8));
  return out;
}

// A group's parameters as dequantize_word takes them: the scale and 1024 + zero point, each in both halves.
__device__ __forceinline__ void group_halves(const GroupParams& g, int zero_offset, __half2 (&scale)[4],
                                             __half2 (&zero1024)[4]) {
  const __half* sh = reinterpret_cast<const __half*>(&g.scales);
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    scale[c] = __half2half2(sh[c]);
    zero1024[c] = __float2half2_rn(1024.f + static_cast<float>(((g.zeros >> (4 * c)) & 0xFu) + zero_offset));
  }
}

// Stages x[b, k0 : k0 + len] in shared memory; with the norm prologue, the normalized residual sum (each block
// computes the row statistics over all of K, from L2, and keeps its own slice). Blocks of tile 0 write `sum` and
// `h2` for their slice, so every element is written once. Each thread holds its share of a row in registers
// (16-byte loads, all issued at once), so the statistics cost one pass of loads, not three dependent ones.
template <typename T, bool NORM>
__device__ void stage_x(const Int4Params& p, float* xs, int64_t k0, int64_t len, bool writer) {
  const int tid = threadIdx.y * blockDim.x + threadIdx.x, nthreads = blockDim.x * blockDim.y;
  if constexpr (!NORM) {
    for (int64_t i = tid; i < p.batch * len; i += nthreads) {
      const int b = static_cast<int>(i / len);
      xs[i] = to_float(static_cast<const T*>(p.x)[b * p.x_stride + k0 + i % len]);
    }
  } else {
    constexpr int V = 16 / sizeof(T), PER = kNormElems / V;  // vector width, vectors per thread
    __shared__ float scratch[32];
    const auto block_total = [&](float v) {  // block_sum for a 2-D block (a whole number of warps)
      v = warp_sum(v);
      __syncthreads();
      if ((tid & 31) == 0) scratch[tid >> 5] = v;
      __syncthreads();
      v = (tid & 31) < nthreads / 32 ? scratch[tid & 31] : 0.f;
      return warp_sum(v);
    };
    const float inv_n = 1.f / static_cast<float>(p.k);
    const int64_t nvec = p.k / V;
    const T* w = static_cast<const T*>(p.norm.weight);
    const T* bias = static_cast<const T*>(p.norm.bias);
    const T* w2 = static_cast<const T*>(p.norm.weight2);
    const T* b2 = static_cast<const T*>(p.norm.bias2);
    for (int b = 0; b < p.batch; ++b) {
      const T* x = static_cast<const T*>(p.x) + b * p.x_stride;
      const T* d = p.norm.delta ? static_cast<const T*>(p.norm.delta) + b * p.norm.delta_stride : nullptr;
      const T* d2 = p.norm.delta2 ? static_cast<const T*>(p.norm.delta2) + b * p.norm.delta2_stride : nullptr;
      float s[PER][V];
      float acc = 0.f;
#pragma unroll
      for (int j = 0; j < PER; ++j) {
        const int64_t v = tid + static_cast<int64_t>(j) * nthreads;
        if (v >= nvec) break;
        load_vec<T, V>(s[j], x + v * V);
        if (d) add_residual<T, V>(s[j], d + v * V, d2 ? d2 + v * V : nullptr);
#pragma unroll
        for (int e = 0; e < V; ++e) acc += p.norm.rms ? s[j][e] * s[j][e] : s[j][e];
      }
      acc = block_total(acc);
      float mean = 0.f, rstd;
      if (p.norm.rms) {
        rstd = rsqrtf(acc * inv_n + p.norm.eps);
      } else {
        mean = acc * inv_n;
        float m2 = 0.f;
#pragma unroll
        for (int j = 0; j < PER; ++j) {
          if (tid + static_cast<int64_t>(j) * nthreads >= nvec) break;
#pragma unroll
          for (int e = 0; e < V; ++e) m2 += (s[j][e] - mean) * (s[j][e] - mean);
        }
        rstd = rsqrtf(block_total(m2) * inv_n + p.norm.eps);
      }
#pragma unroll
      for (int j = 0; j < PER; ++j) {
        const int64_t v = tid + static_cast<int64_t>(j) * nthreads;
        if (v >= nvec) break;
        const int64_t k = v * V;
        if (k < k0 || k >= k0 + len) continue;  // another block's slice (slices are whole vectors: multiples of 8)
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const float h =
              norm_value<T>(s[j][e], mean, rstd, w[k + e], bias ? bias[k + e] : from_float<T>(0.f), p.norm.rms);
          xs[b * len + k - k0 + e] = round_to<T>(h);
          if (writer) {
            if (p.norm.delta) static_cast<T*>(p.norm.sum)[b * p.k + k + e] = from_float<T>(s[j][e]);
            if (w2) {
              const float h2 =
                  norm_value<T>(s[j][e], mean, rstd, w2[k + e], b2 ? b2[k + e] : from_float<T>(0.f), false);
              static_cast<T*>(p.norm.h2)[b * p.k + k + e] = from_float<T>(h2);
            }
          }
        }
      }
    }
  }
}

// The finished tile values (rounded dot product + bias, as F.linear's output and the bias add round them) are in
// `fin` [members][batch][tile_width]; this writes the op's output.
template <typename T>
__device__ void epilogue(const Int4Params& p, const TileInfo& t, const float* fin, int tile_width) {
  const int tid = threadIdx.y * blockDim.x + threadIdx.x, nthreads = blockDim.x * blockDim.y;
  T* out = static_cast<T*>(p.out);
  if (p.epilogue == kInt4Store) {
    int64_t n_total = 0;
    for (int s = 0; s < p.num_segments; ++s) n_total += p.seg[s].n;
    const int64_t base = segment_offset(p, t.seg) + t.col0;
    for (int i = tid; i < p.batch * tile_width; i += nthreads) {
      const int b = i / tile_width, c = i % tile_width;
      if (c >= t.width) continue;
      float y = fin[i];
      if (p.act != kActNone) y = gelu(y, p.act == kActGeluTanh);
      out[b * n_total + base + c] = from_float<T>(y);
    }
  } else if (p.epilogue == kInt4SiluMul) {
    const int64_t n = p.seg[0].n;
    for (int i = tid; i < p.batch * tile_width; i += nthreads) {
      const int b = i / tile_width, c = i % tile_width;
      if (c >= t.width) continue;
      const float gate = fin[i], up = fin[p.batch * tile_width + i];
      out[b * n + t.col0 + c] = from_float<T>(round_to<T>(silu(gate)) * up);
    }
  } else {  // kInt4RopeCache: the tile is one head (q, k or v) of one token per row
    const RopeCacheParams& r = p.rope;
    const int D = static_cast<int>(r.head_dim), hq = static_cast<int>(r.num_q_heads);
    const int hkv = static_cast<int>(r.num_kv_heads), R = static_cast<int>(r.rotary_dim);
    const int64_t slot = *r.slot;
    const Slot head = locate(static_cast<int>(segment_offset(p, t.seg) + t.col0), D, hq, hkv, r.interleaved);
    for (int i = tid; i < p.batch * D; i += nthreads) {
      const int b = i / D, d = i % D;
      const RopeRow<T> row = rope_row<T>(r, slot, b);
      const Slot s{head.part, head.head, d};
      store_qkv<T>(r, out, b, slot, s, from_float<T>(rotate(fin + b * tile_width, d, s, R, row.cos, row.sin)));
    }
  }
}

template <typename T, int BMAX, bool NORM, bool ACT_ORDER>
__global__ void __launch_bounds__(kThreads, 2) int4_gemv_kernel(const Int4Params p, int tile_width) {
  extern __shared__ float smem[];
  __shared__ int s_last;
  const TileInfo t = tile_info(p, blockIdx.x, tile_width);
  const Int4Segment& seg = p.seg[t.seg];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int tid = ty * blockDim.x + tx, nthreads = blockDim.x * blockDim.y;

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
  griddep_wait();
  griddep_launch_dependents();

  const int64_t k0 = r_begin * 8, len = (r_end - r_begin) * 8;
  float* xs = smem;  // [batch][len]
  stage_x<T, NORM>(p, xs, k0, len, blockIdx.x == 0);
  __syncthreads();

  float acc[BMAX][4] = {};
  if (live) {
    __half2 scale[4], zero1024[4];  // without act-order: the current group's, per column
    group_halves(cur, p.zero_offset, scale, zero1024);
    for (int64_t r0 = t_begin; r0 < t_end; r0 += kPreload) {
#pragma unroll
      for (int j = 0; j < kPreload; ++j) {
        const int64_t r = r0 + j;
        if (r >= t_end) break;
        const uint4 word = w[j];
        if (r + kPreload < t_end) w[j] = __ldcs(qw + (r + kPreload - t_begin) * qw_stride);
        const uint32_t words[4] = {word.x, word.y, word.z, word.w};
        const float* xr = xs + (r - r_begin) * 8;
        if constexpr (!ACT_ORDER) {
          if (r == group_end) {  // a new group: the prefetched parameters, and the next group's are loaded
            ++group;
            group_end += group_rows;
            group_halves(next, p.zero_offset, scale, zero1024);
            if (group_end < t_end) next = load_group(seg, group + 1, col);
          }
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            float2 q[4];
            dequantize_word(words[c], zero1024[c], scale[c], q);
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
      }
    }
  }

  // Sum the threadIdx.y runs of the block: red [blockDim.y][batch][tile_width], over x's stage (no longer read).
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
  __syncthreads();
  const int per_member = static_cast<int>(p.batch) * tile_width;
  float* fin = smem + blockDim.y * per_member;  // [members][batch][tile_width]
  const bool direct = p.splits == 1 && t.members == 1;
  int64_t n_total = 0;
  for (int s = 0; s < p.num_segments; ++s) n_total += p.seg[s].n;
  for (int i = tid; i < per_member; i += nthreads) {
    const int b = i / tile_width, c = i % tile_width;
    float v = 0.f;
    for (int y = 0; y < static_cast<int>(blockDim.y); ++y) v += red[(y * p.batch + b) * tile_width + c];
    if (direct) {
      fin[i] = v;
    } else if (c < t.width) {
      p.partials[(blockIdx.y * p.batch + b) * n_total + segment_offset(p, t.seg) + t.col0 + c] = v;
    }
  }
  if (!direct) {
    // The last block of the tile group adds up every slice's partials (those of every member tile).
    __threadfence();
    __syncthreads();
    if (tid == 0) {
      const int expected = p.splits * t.members;
      const int arrived = atomicAdd(p.counters + t.group, 1) + 1;
      s_last = arrived == expected;
      if (s_last) p.counters[t.group] = 0;  // every block of the group has counted: leave it zero
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    for (int i = tid; i < t.members * per_member; i += nthreads) {
      const int m = i / per_member, b = (i % per_member) / tile_width, c = i % tile_width;
      if (c >= t.width) continue;
      const int s = t.members == 2 ? m : t.seg;
      const int64_t column = segment_offset(p, s) + t.col0 + c;
      float v = 0.f;
#pragma unroll 8
      for (int split = 0; split < p.splits; ++split) v += __ldcg(p.partials + (split * p.batch + b) * n_total + column);
      fin[i] = v;
    }
  }
  // Round as F.linear rounds its output, then add the bias in the dtype (GPTQLinear: out + bias.to(x.dtype)).
  for (int i = tid; i < t.members * per_member; i += nthreads) {
    const int m = i / per_member, c = i % tile_width;
    const Int4Segment& s = p.seg[t.members == 2 ? m : t.seg];
    float v = round_to<T>(fin[i]);
    if (s.bias && c < t.width)
      v = round_to<T>(v + round_to<T>(__half2float(static_cast<const __half*>(s.bias)[t.col0 + c])));
    fin[i] = v;
  }
  __syncthreads();
  epilogue<T>(p, t, fin, tile_width);
}

template <typename T, int BMAX>
cudaError_t launch_batch(const Int4Params& p, cudaStream_t stream) {
  const int tile_width = static_cast<int>(int4_tile_width(p));
  const int cols = (tile_width + 3) / 4;
  int runs = kThreads / cols;
  while (cols * runs % 32) --runs;  // whole warps (the block reductions use full-warp shuffles)
  const dim3 block(cols, runs);
  const dim3 grid(static_cast<unsigned>(int4_tiles(p)), static_cast<unsigned>(p.splits));
  const int64_t rows = p.k / 8, per_split = (rows + p.splits - 1) / p.splits;
  const int64_t stage = p.batch * per_split * 8;
  const int64_t reduce = static_cast<int64_t>(block.y) * p.batch * tile_width;
  const int64_t members = p.epilogue == kInt4SiluMul ? 2 : 1;
  const size_t smem = ((stage > reduce ? stage : reduce) + members * p.batch * tile_width) * sizeof(float);
  if (stage > kStageFloats || smem > 48 * 1024) return cudaErrorInvalidConfiguration;
  const bool norm = p.norm.weight != nullptr;
  if (norm) {  // the prologue's register-resident rows: 16-byte vectors, at most kNormElems per thread
    constexpr int V = 16 / sizeof(T);
    const void* pointers[] = {p.x,         p.norm.delta,   p.norm.delta2, p.norm.weight,
                              p.norm.bias, p.norm.weight2, p.norm.bias2};
    for (const void* ptr : pointers) {
      if (ptr && !aligned16(ptr)) return cudaErrorNotSupported;
    }
    if (p.k % V || p.x_stride % V || (p.norm.delta && p.norm.delta_stride % V) ||
        (p.norm.delta2 && p.norm.delta2_stride % V) || p.k > static_cast<int64_t>(kNormElems) * block.x * block.y) {
      return cudaErrorNotSupported;
    }
  }
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
