// The tensor-core GPTQ int4 decode kernel: fp16/bf16 activations, groups of a multiple of 32 k, no act-order.
//
// Why tensor cores for a matrix-vector product: on CUDA cores every weight costs its dequantization plus one FMA
// per row of x, so the cost grows with the batch. Here mma.sync m16n8k16 (fp32 accumulation) takes 16 output
// columns x 16 k of dequantized weights (A) against 16 k x 8 rows of x (B; rows past the batch are zeros), so one
// instruction serves the whole batch and a weight costs its dequantization alone (measured against the CUDA-core
// kernel: docs/decode-int4.md).
//
// Layout. A warp owns 32 columns of the tile. In each step lane 4g + q loads the 16-byte chunk at qweight row
// r0 + q, columns 4g .. 4g + 3 of the warp's 32, so a warp step is 4 rows x 32 columns (four 128-byte row
// segments). The lane dequantizes its chunk to the exact integers q - z in T (dequantize_zeros: about 9 instructions a
// word of 8 weights in fp16, 11 in bf16) into the pairs (k0,k4) (k1,k5) (k2,k6) (k3,k7), and those pairs are its A
// fragments as they are; the group's scales multiply its fp32 sums once a group (GroupTerms::fold). So the kernel
// computes x . s(q - z) with the exact weights, where the reference (and HF's GPTQ linears, and the CUDA-core kernel)
// first round each weight s(q - z) to fp16 (for bf16 activations then to bf16): it differs from them by that
// rounding, and from the exact product (the tests' float64 reference) by less; it is also fewer instructions a word.
// In MMA (h, jj), A row g is column 4g + 2h and row g + 8 is column 4g + 2h + 1 (h picks 2 of the lane's 4 columns);
// k slots (2q, 2q+1) are pair 2jj of row r0 + q and (2q+8, 2q+9) pair 2jj + 1. The order of k inside an MMA is free
// as long as B follows it, so x is staged in shared memory with every 8 k stored in that pair order, and one 16-byte
// shared load gives a lane its four B fragments (B column g = batch row g). The C fragments are columns x batch rows:
// lane (g, q) ends with column 4g + 2h (c0, c1) and column 4g + 2h + 1 (c2, c3), for batch rows 2q and 2q + 1.
//
// A block is a 128-column tile as 4 column warps x 2 runs of its K slice (256 threads; narrower tiles of whole heads
// take more runs), each lane with kMmaPreload 16-byte chunks in flight. The runs and the slices meet as in the
// CUDA-core kernel (int4_tile.cuh: finish_tile), or for SwiGLU in pairs of gate and up columns (finish_pair).
#pragma once
#include <algorithm>
#include <type_traits>

#include "int4/int4_tile.cuh"

namespace patcher {
namespace {

constexpr int kMmaPreload = 6;  // 16-byte qweight chunks in flight per lane

// qweight rows per K slice: whole steps of 4 rows, so that every lane's rows stay 4 apart across slices and runs.
__host__ __device__ inline int64_t mma_rows_per_split(int64_t rows, int64_t splits) {
  return ((rows + splits - 1) / splits + 3) / 4 * 4;
}

// Bytes of the x stage (batch x slice in T), rounded to 16: the slice's group parameters follow it.
__host__ __device__ inline int64_t mma_x_stage_bytes(const Int4Params& p, int64_t elem_bytes) {
  return (p.batch * mma_rows_per_split(p.k / 8, p.splits) * 8 * elem_bytes + 15) / 16 * 16;
}

// The scales and zero points of a block's K slice and column tile, copied into shared memory before
// griddepcontrol.wait (they are constant), so that a group change reads them there instead of waiting on a global
// load issued one group (4 steps at group size 128) earlier: scales [groups][tile_width] fp16, then qzeros
// [groups][tile_width / 8] words. kInt4GroupStageBytes (int4/params.h) bounds it.
struct SliceGroups {
  const __half* scales;
  const uint32_t* zeros;
  int64_t first;  // group of the slice's first k
  int tile_width;

  // GroupParams of `group` for the 4 columns from tile column c (c % 4 == 0).
  __device__ __forceinline__ GroupParams at(int64_t group, int c) const {
    const int64_t i = group - first;
    GroupParams g;
    g.scales = *reinterpret_cast<const uint2*>(scales + i * tile_width + c);
    g.zeros = zeros[i * (tile_width / 8) + c / 8] >> (4 * (c % 8));
    return g;
  }
};

// Issues the copies of the groups of k_begin .. k_end (one cp.async group; the caller waits for it), columns of
// the tile that exist only. `span`: the columns one segment gives the tile (the tile width, or half of it for a
// SwiGLU pair, whose second half is the up segment's same columns: pair_info).
__device__ SliceGroups stage_groups(const Int4Params& p, const TileInfo& t, int tile_width, int span, int64_t k_begin,
                                    int64_t k_end, char* at) {
  SliceGroups s;
  s.first = k_begin / p.group_size;
  s.tile_width = tile_width;
  const int groups = k_end > k_begin ? static_cast<int>((k_end - 1) / p.group_size - s.first + 1) : 0;
  __half* scales = reinterpret_cast<__half*>(at);
  uint32_t* zeros = reinterpret_cast<uint32_t*>(scales + groups * tile_width);
  const int quads = tile_width / 4, words = tile_width / 8;
  for (int i = threadIdx.x; i < groups * quads; i += blockDim.x) {
    const int g = i / quads, c = i % quads * 4, member = c / span, mc = c - member * span;
    const Int4Segment& seg = p.seg[t.seg + member];
    if (mc < t.width)
      cp_async_small(scales + g * tile_width + c,
                     static_cast<const __half*>(seg.scales) + (s.first + g) * seg.n + t.col0 + mc, 8);
  }
  for (int i = threadIdx.x; i < groups * words; i += blockDim.x) {
    const int g = i / words, c = i % words * 8, member = c / span, mc = c - member * span;
    const Int4Segment& seg = p.seg[t.seg + member];
    if (mc < t.width)
      cp_async_small(zeros + g * words + c / 8, seg.qzeros + (s.first + g) * (seg.n / 8) + (t.col0 + mc) / 8, 4);
  }
  cp_async_commit();
  s.scales = scales;
  s.zeros = zeros;
  return s;
}

// SwiGLU ops (gate and up of equal width as two segments, out = silu(gate) * up) run as pairs: a block's first half
// of column warps takes gate columns col0 .. col0 + tile_width / 2 - 1 and its second half the same columns of up,
// so a block holds both inputs of its outputs and with one K slice finishes alone (finish_pair), bit for bit the
// sums of separate gate and up tiles.
__host__ __device__ inline bool mma_paired(const Int4Params& p) { return p.epilogue == kInt4SiluMul; }

__host__ __device__ inline int64_t mma_pairs(const Int4Params& p, int tile_width) {
  return (p.seg[0].n + tile_width / 2 - 1) / (tile_width / 2);
}

// Whether the tensor-core kernel takes this op (launch_int4_gemv_typed checks the dtype): groups of whole steps
// (a lane's rows, 4 apart, then meet every group in turn) and tiles of whole warps.
inline bool mma_applies(const Int4Params& p) {
  const int64_t width = int4_tile_width(p);
  return !p.act_order && p.group_size % 32 == 0 && width % (mma_paired(p) ? 64 : 32) == 0 && width <= kThreads;
}

// -(zero) in the form dequantize_zeros subtracts, per column of a lane's 4: fp16 -(1024 + z) and -(64 + z)
// (as int4_dequant.cuh: group_dequant), bf16 -(128 + z) (bf16 steps by 1 from 128 to 256).
struct ZeroTerms {
  uint32_t a[4], b[4];
};

template <typename T>
__device__ __forceinline__ ZeroTerms zero_terms(uint32_t zeros, int zero_offset) {
  ZeroTerms t;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const uint32_t z = ((zeros >> (4 * c)) & 0xFu) + static_cast<uint32_t>(zero_offset);
    if constexpr (std::is_same_v<T, __half>) {
      t.a[c] = (0xE400u + z) * 0x10001u;        // -(1024 + z) in both halves
      t.b[c] = (0xD400u + 16u * z) * 0x10001u;  // -(64 + z)
    } else {
      t.a[c] = (0xC300u + z) * 0x10001u;  // -(128 + z)
      t.b[c] = t.a[c];
    }
  }
  return t;
}

__device__ __forceinline__ uint32_t lop_or(uint32_t word, uint32_t mask, uint32_t magic) {
  uint32_t bits;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(bits) : "r"(word), "r"(mask), "r"(magic));
  return bits;
}

// The 8 weights of one word of column c as exact q - zero in T, as the pairs (k0,k4) (k1,k5) (k2,k6) (k3,k7).
// fp16: nibbles at bit 0 of a byte land in 1024's mantissa (1024 + q), those at bit 4 as 1024 + 16q, brought to
// 64 + q by a fused multiply by 1/16 (int4_dequant.cuh: dequantize_word); bf16: each nibble shifted to bit 0 lands in
// 128's mantissa. Subtracting (magic + zero) leaves q - zero exactly.
template <typename T>
__device__ __forceinline__ void dequantize_zeros(uint32_t word, const ZeroTerms& z, int c, uint32_t (&out)[4]) {
  if constexpr (std::is_same_v<T, __half>) {
    const __half2 sixteenth = __float2half2_rn(0.0625f);
    __half2 za, zb, v;
    memcpy(&za, &z.a[c], 4);
    memcpy(&zb, &z.b[c], 4);
    const uint32_t high = word >> 8;
    const uint32_t n[4] = {lop_or(word, 0x000F000Fu, 0x64006400u), lop_or(word, 0x00F000F0u, 0x64006400u),
                           lop_or(high, 0x000F000Fu, 0x64006400u), lop_or(high, 0x00F000F0u, 0x64006400u)};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      memcpy(&v, &n[j], 4);
      v = (j & 1) ? __hfma2(v, sixteenth, zb) : __hadd2(v, za);
      memcpy(&out[j], &v, 4);
    }
  } else {
    __nv_bfloat162 za, v;
    memcpy(&za, &z.a[c], 4);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t n = lop_or(word >> (4 * j), 0x000F000Fu, 0x43004300u);
      memcpy(&v, &n, 4);
      v = __hadd2(v, za);
      memcpy(&out[j], &v, 4);
    }
  }
}

// c += A (16 x 16) * B (16 x 8), fp32 accumulation.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// The A fragments of a lane's chunk, a_pairs [column][pair (k_j, k_j+4)], into acc[h] (columns 4g + 2h and
// 4g + 2h + 1) against its x chunk (the B fragments of those 8 k).
template <typename T>
__device__ __forceinline__ void mma_fragments(float (&acc)[2][4], const uint32_t (&a_pairs)[4][4], const uint4& xv) {
  const uint32_t xb[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int jj = 0; jj < 2; ++jj) {
      const int c0 = 2 * h, c1 = 2 * h + 1;
      const uint32_t a[4] = {a_pairs[c0][2 * jj], a_pairs[c1][2 * jj], a_pairs[c0][2 * jj + 1],
                             a_pairs[c1][2 * jj + 1]};
      mma_16816<T>(acc[h], a, xb[2 * jj], xb[2 * jj + 1]);
    }
  }
}

// One step of a lane: its 16-byte qweight chunk (4 columns x 8 k, one group) as the exact integers q - zero
// (dequantize_zeros) into the group's sums `part`; the scales multiply those once a group (GroupTerms::fold).
template <typename T>
__device__ __forceinline__ void mma_chunk_exact(float (&part)[2][4], const uint4& chunk, const uint4& xv,
                                                const ZeroTerms& z) {
  const uint32_t words[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
  uint32_t a_pairs[4][4];
#pragma unroll
  for (int c = 0; c < 4; ++c) dequantize_zeros<T>(words[c], z, c, a_pairs[c]);
  mma_fragments<T>(part, a_pairs, xv);
}

// A group's parameters for a lane's 4 columns as mma_chunk_exact and the fold take them: the zero terms and the
// scales. fold adds the group's sums times each column's scale into acc and clears them for the next group; C
// fragment element i of acc[h] is column 4g + 2h + (i >> 1) (the layout in the header).
template <typename T>
struct GroupTerms {
  ZeroTerms z;
  float scale[4];

  __device__ __forceinline__ GroupTerms(const GroupParams& g, int zero_offset)
      : z(zero_terms<T>(g.zeros, zero_offset)) {
    const __half* sh = reinterpret_cast<const __half*>(&g.scales);
#pragma unroll
    for (int c = 0; c < 4; ++c) scale[c] = __half2float(sh[c]);
  }

  __device__ __forceinline__ void fold(float (&acc)[2][4], float (&part)[2][4]) const {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        acc[h][i] = fmaf(part[h][i], scale[2 * h + (i >> 1)], acc[h][i]);
        part[h][i] = 0.f;
      }
    }
  }
};

// Pair `pair`: its gate columns (segment 0; the up columns are the same in segment 1), as TileInfo with both members.
__device__ __forceinline__ TileInfo pair_info(const Int4Params& p, int pair, int tile_width) {
  TileInfo t{};
  t.col0 = static_cast<int64_t>(pair) * (tile_width / 2);
  const int64_t left = p.seg[0].n - t.col0;
  t.width = static_cast<int>(left < tile_width / 2 ? left : tile_width / 2);
  t.group = pair;
  t.members = 2;
  return t;
}

// finish_tile for a pair: the runs' sums red [runs][batch][tile_width] (gate columns, then up) become fin
// [gate, up][batch][tile_width / 2], as finish_values takes a gate/up tile group; with K slices they meet as the
// slices of one tile do, both members' rows of partial sums written by every block.
template <typename T>
__device__ void finish_pair(const Int4Params& p, const TileInfo& t, float* smem, int runs, int tile_width) {
  const Team team = whole_block();
  team.sync();
  const int half = tile_width / 2, per_member = static_cast<int>(p.batch) * half;
  float* fin = smem + runs * static_cast<int>(p.batch) * tile_width;
  for (int i = team.tid; i < 2 * per_member; i += team.size) {
    const int m = i / per_member, b = (i % per_member) / half, c = i % half;
    fin[i] = add_runs(p, smem, runs, tile_width, b, m * half + c);
  }
  const TileSplit split{static_cast<int>(blockIdx.y), p.splits, {p.splits, p.splits}, p.splits == 1};
  if (split.direct) {
    finish_values<T>(p, t, fin, half, team);  // each thread reads back the fin elements it wrote
    return;
  }
  const int64_t n_total = int4_total_width(p);
  for (int i = team.tid; i < 2 * per_member; i += team.size) {
    const int m = i / per_member, b = (i % per_member) / half, c = i % half;
    if (c < t.width) *partial_at(p, n_total, split.slot, b, segment_offset(p, m) + t.col0 + c) = fin[i];
  }
  if (last_to_arrive(p, t, split.expected, team)) finish_from_partials<T>(p, t, fin, half, split, team);
}

template <typename T, bool NORM>
__global__ void __launch_bounds__(kThreads, 2) int4_mma_kernel(const Int4Params p, int tile_width) {
  // The next kernel may launch at once: it reads only constants before its wait. Not so for the op before a decode
  // attention (feeds_attention, Int4Params).
  const bool feeds_attention = p.feeds_attention || p.epilogue == kInt4RopeCache;
  griddep_trigger_at_entry(feeds_attention);
  extern __shared__ float smem[];
  const bool paired = mma_paired(p);
  const TileInfo t = paired ? pair_info(p, blockIdx.x, tile_width) : tile_info(p, blockIdx.x, tile_width);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int col_warps = tile_width / 32, runs = static_cast<int>(blockDim.x) / 32 / col_warps;
  const int run = warp / col_warps, warp_col = (warp % col_warps) * 32;
  // The warp's segment and its first column there (a pair's second half of warps: the up segment).
  const int span = paired ? tile_width / 2 : tile_width, member = warp_col / span,
            member_col = warp_col - member * span;
  const Int4Segment& seg = p.seg[t.seg + member];

  // This block's slice of qweight rows and this warp's run inside it, both in whole steps of 4 rows.
  const int64_t rows = p.k / 8, per_split = mma_rows_per_split(rows, p.splits);
  const int64_t r_begin = min(rows, blockIdx.y * per_split), r_end = min(rows, r_begin + per_split);
  const int64_t per_run = (r_end - r_begin + 4 * runs - 1) / (4 * runs) * 4;
  const int64_t run_begin = min(r_end, r_begin + run * per_run), run_end = min(r_end, run_begin + per_run);
  // The loop counts in int (a run is at most K/8 rows), since its bookkeeping is most of a step's instructions: the
  // warp's steps, and this lane's rows of the run, q, q + 4, ... < run_rows (lane_rows - 4s > 0 at a step it has).
  const int run_rows = static_cast<int>(run_end - run_begin), steps = (run_rows + 3) / 4, lane_rows = run_rows - q;
  const bool warp_live = member_col < t.width, live = member_col + 4 * g < t.width;
  const int64_t col = t.col0 + member_col + 4 * g;
  const int64_t row_stride = seg.n / 4, step_stride = 4 * row_stride;  // uint4 per qweight row; per lane step
  const uint4* next_chunk = reinterpret_cast<const uint4*>(seg.qweight + col) + (run_begin + q) * row_stride;

  // Constant data before griddepcontrol.wait, as in the CUDA-core kernel: the first chunks, the first two groups.
  uint4 w[kMmaPreload] = {};
#pragma unroll
  for (int j = 0; j < kMmaPreload; ++j) {
    if (live && 4 * j < lane_rows) w[j] = __ldcs(next_chunk + j * step_stride);
  }
  next_chunk += kMmaPreload * step_stride;
  const int64_t k0 = r_begin * 8, len = (r_end - r_begin) * 8;
  const SliceGroups groups = stage_groups(p, t, tile_width, span, k0, k0 + len,
                                          reinterpret_cast<char*>(smem) + mma_x_stage_bytes(p, sizeof(T)));
  if (!skips_wait(p, k0)) griddep_wait();
  if (blockIdx.y == 0) clear_share(p, blockIdx.x, gridDim.x);  // slice 0 never skips the wait
  // (A block that skips the wait triggers here all the same, where feeds_attention asks for it.)
  griddep_trigger_after_wait(feeds_attention);

  T* xs = reinterpret_cast<T*>(smem);  // [batch][len], every 8 k in the pair order (0,4) (1,5) (2,6) (3,7)
  stage_x<T, NORM>(
      p, k0, len, blockIdx.x == 0, in_second(p, t), [=](int b, int64_t i, float v) {
        xs[b * len + (i & ~int64_t{7}) + 2 * (i & 3) + ((i >> 2) & 1)] = from_float<T>(v);
      });
  cp_async_wait_all();
  __syncthreads();

  // Groups are whole steps (mma_applies) and runs start on a step, so the lanes of a warp change group together:
  // at step `change` to group next_group, then every group_steps steps.
  const int64_t group_rows = p.group_size / 8;
  const int group_steps = static_cast<int>(group_rows / 4);
  int64_t next_group = run_begin / group_rows + 1;
  int change = static_cast<int>((next_group * group_rows - run_begin) / 4);
  float acc[2][4] = {};
  if (warp_live) {
    const int tile_col = warp_col + 4 * g;
    // Zero scales for dead lanes (their sums count for nothing) and for a run with no rows (nothing staged).
    GroupTerms<T> d(live && lane_rows > 0 ? groups.at(next_group - 1, tile_col) : GroupParams{}, p.zero_offset);
    float part[2][4] = {};  // the current group's sums, before its scales (GroupTerms::fold)
    const T* x_lane = xs + g * len + (run_begin + q - r_begin) * 8;  // B column g is batch row g
    const bool x_row = g < p.batch;
    // One lane step s on its chunk wj (w[s % kMmaPreload]).
    const auto step = [&](int s, uint4& wj) {
      if (s == change) {  // the next group (a step the warp has lies in the slice, so its group is staged)
        d.fold(acc, part);
        d = GroupTerms<T>(live ? groups.at(next_group, tile_col) : GroupParams{}, p.zero_offset);
        change += group_steps;
        ++next_group;
      }
      // B is zero past the batch and past the run (whose x is not staged), so whatever A holds there adds 0.
      uint4 xv = make_uint4(0, 0, 0, 0);
      if (x_row && 4 * s < lane_rows) xv = *reinterpret_cast<const uint4*>(x_lane + 32 * s);
      mma_chunk_exact<T>(part, wj, xv, d.z);
      // The chunk kMmaPreload steps on, into the registers just read: loaded into a copy before the use instead,
      // the compiler moves the chunk home at the next step, which then waits for it (1-2 chunks in flight, not
      // kMmaPreload).
      if (live && 4 * (s + kMmaPreload) < lane_rows) wj = __ldcs(next_chunk);
      next_chunk += step_stride;
    };
    // The steps in whole rounds of kMmaPreload without a test, then the rest, leaving the loop at the warp's last
    // step: one loop whose unrolled steps each tested s < steps ran much slower (docs/decode-int4.md). With the norm
    // prologue the untested rounds are no faster, so that kernel only leaves at the last step.
    int s0 = 0;
    if constexpr (!NORM) {
      for (; s0 + kMmaPreload <= steps; s0 += kMmaPreload) {
#pragma unroll
        for (int j = 0; j < kMmaPreload; ++j) step(s0 + j, w[j]);
      }
    }
    for (; s0 < steps; s0 += kMmaPreload) {
#pragma unroll
      for (int j = 0; j < kMmaPreload; ++j) {
        if (s0 + j >= steps) break;
        step(s0 + j, w[j]);
      }
    }
    d.fold(acc, part);  // the last group's sums
  }

  // The runs' partial sums, red [runs][batch][tile_width], over x's stage (no longer read).
  __syncthreads();
  float* red = smem;
  if (live) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int b = 2 * q + (i & 1);
        if (b < p.batch) red[(run * p.batch + b) * tile_width + warp_col + 4 * g + 2 * h + (i >> 1)] = acc[h][i];
      }
    }
  }
  if (paired) {
    finish_pair<T>(p, t, smem, runs, tile_width);
  } else {
    finish_tile<T>(p, t, smem, runs, tile_width, k_slices(p, t), whole_block());
  }
}

template <typename T>
cudaError_t launch_mma(const Int4Params& p, cudaStream_t stream) {
  const int tile_width = static_cast<int>(int4_tile_width(p));
  const int col_warps = tile_width / 32, runs = kThreads / 32 / col_warps;
  const dim3 block(col_warps * runs * 32);
  const int64_t tiles = mma_paired(p) ? mma_pairs(p, tile_width) : int4_tiles(p);  // at most int4_tiles(p)
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(p.splits));
  size_t smem = 0;
  const cudaError_t fits = launch_smem<T>(p, mma_x_stage_bytes(p, sizeof(T)), int4_group_stage_bytes(p), runs,
                                          static_cast<int>(block.x), tile_width, smem);
  if (fits != cudaSuccess) return fits;
  const auto kernel = p.norm.weight ? int4_mma_kernel<T, true> : int4_mma_kernel<T, false>;
  if (smem + 1024 > 48 * 1024) {  // with the kernel's static shared memory, past the default limit
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  return launch_pdl(kernel, grid, block, smem, stream, p, tile_width);
}

}  // namespace
}  // namespace patcher
