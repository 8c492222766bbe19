// The W4A8 decode GEMV where every chunk of a row starts 16-byte aligned: the blocks 16-byte aligned and, for the
// 32-value types (Q4_0, Q4_1, Q8_0), K a multiple of 256 (8k blocks of 18, 20 or 34 bytes are whole 16-byte vectors),
// as every real model's projections are; Q4_K and Q5_K (144 and 176-byte super-blocks) at any K; Q6_K with the blocks
// 8-byte aligned and K a multiple of 1024 (a chunk of 4 super-blocks is 840 bytes: whole 8-byte vectors, which Q6_K's
// chunks are read in). Work split and arithmetic are gguf_gemv_kernel's (gguf_gemv.cuh): a warp a row (up to four at
// batch 1: gguf_aligned_rows), chunks of 1024 values (one 32-value block or sub-block a lane) read from the warp's
// shared stage, and the same fp32 terms summed in the same order, so the two kernels agree bit for bit; the chunks
// ahead of their use wait in registers (the K-quants, as there, and the 32-value types' long rows at batch 1) or in a
// ring of shared stages (the 32-value types; Q4_K and Q5_K four rows a warp). What alignment saves is the instructions
// around the arithmetic, which bound the general kernel (about 230 a Q4_0 chunk against 8 dp4a a lane): a chunk is
// whole 16-byte vectors at a fixed stride (no byte window, no edge bytes); a lane reads its block from the stage as the
// 4-byte words that cover it, shifted into place by a funnel shift (a 32-value block or a Q6_K super-block starts 0 or
// 2 bytes into a word; Q4_K's and Q5_K's words are aligned), rather than as 2-byte halves; and Q4_0's nibbles enter the
// dot product as stored (0..15), the 8 they are offset by subtracted once as 8 * sum(q_a) from the workspace, in place
// of a per-byte subtraction on each word.
#pragma once
#include "gguf/gguf_aligned.cuh"
#include "gguf/gguf_gemv.cuh"

namespace patcher {
namespace {

// The 32-value types' chunks ahead of their use wait in a ring of kAlignedRing shared stages a warp, copied there by
// cp.async, so that they hold no registers (four chunks are a K = 4096 row whole; two for each of a warp's four
// rows): more bytes in flight for the smaller register file (Q4_0 batch 1: 40 registers, not 64). The K-quants keep
// theirs in registers, as the general kernel does, except Q4_K and Q5_K four rows a warp (below): one row a warp
// through the ring measured slower for them (docs/gguf.md).
template <int ROWS>
constexpr int kAlignedRing = ROWS == 1 ? 4 : 2;  // (four rows of four stages would pass 48 KB of static shared memory)
// Q4_0 and Q4_1 at batch 1 over rows of at least kAlignedLongK values (Llama-3.1-8B's down projection: 14 chunks a
// row, 4096 rows) take the registers' path (IN_REGISTERS) instead: Q4_0's down projection measured 12.3 us against
// 16.8 through the ring, Q4_1's the same either way; a ring eight deep did not close the gap (docs/gguf.md). Where
// every segment's rows are even, two rows a warp (each x block a lane loads serving both dot products).
constexpr int64_t kAlignedLongK = 8192;

// Output rows a warp takes: four for Q4_0, Q4_1, Q4_K and Q5_K at batch 1 in a launch of at least kAlignedWideRows
// rows, every segment's row count a multiple of 4 (gguf_aligned_rows), their chunks in a ring two deep; two over long
// rows (kAlignedLongK, in registers); one otherwise. Each row's terms are summed as with one row a warp. Four rows a
// warp measured faster for Llama-3.1-8B's gate/up (28672 rows) and slower for its QKV (6144) and down (4096)
// projections, whose rows then leave the SMs short of warps, as two rows a warp through the ring measured for all three
// (docs/gguf.md). Q4_K and Q5_K take four rows too (a chunk of 576 or 704 bytes: four rows of two stages are within 48
// KB of static shared memory), which measured faster for Llama-3.1-8B's Q4_K gate/up than two rows a warp in registers
// and, as for Q4_0, slower from 4096 rows (its QKV, o and down); not Q8_0 (1088 bytes) or Q6_K (its chunks are 8-byte
// vectors).
template <int KIND>
constexpr bool kAlignedWideKind = KIND == kGgufQ4_0 || KIND == kGgufQ4_1 || KIND == kGgufQ4_K || KIND == kGgufQ5_K;
constexpr int64_t kAlignedWideRows = 16384;
// The K-quants take two rows a warp (chunks in registers) at batch 1 where the 32-value types take two, over rows of at
// least kAlignedLongK values, and Q6_K in launches of at least kAlignedWideRows rows too (a Q6_K lm_head).
template <int KIND>
constexpr bool kAlignedMultiRowKind = kAlignedWideKind<KIND> || kKQuant<KIND>;

template <typename T, int KIND, int BMAX, int ROWS, bool IN_REGISTERS = kKQuant<KIND>>
__global__ void __launch_bounds__(kGgufWarps * 32) gguf_gemv_aligned_kernel(const __grid_constant__ GgufGemvParams p) {
  static_assert(
      ROWS == 1 || (IN_REGISTERS ? ROWS == 2 && kAlignedMultiRowKind<KIND> : ROWS == 4 && kAlignedWideKind<KIND>),
      "four rows a warp through the ring (Q4_0, Q4_1, Q4_K, Q5_K), two in registers (those and Q6_K)");
  using Vec = AlignedVec<KIND>;
  __shared__ __align__(16) uint8_t stages[kGgufWarps][IN_REGISTERS ? 1 : kAlignedRing<ROWS>][ROWS][kChunkBytes<KIND>];
  constexpr int kPerChunk = kChunkBlocks * 32 / kBlockValues<KIND>;  // blocks (super-blocks) a chunk
  constexpr int kFullVectors = kChunkBytes<KIND> / kVecBytes<KIND>;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  griddep_trigger_at_entry(p.feeds_attention);
  const WarpRow wr = warp_row(p, warp, ROWS);
  const int64_t n = wr.n;
  const GgufSegment& g = p.seg[wr.s];
  if (n >= g.n) return;  // a warp past the last row (no barrier waits for it); its ROWS rows are all in g
  // Chunk, block and vector indices in 32 bits (gguf_rows_aligned admits k < 2^30); the row's offset in 64.
  const int nb = static_cast<int>(p.k / 32);                  // 32-value blocks (sub-blocks) a row, and of x
  const int units = static_cast<int>(p.k / kBlockValues<KIND>);  // blocks (super-blocks) a row
  const int chunks = (units + kPerChunk - 1) / kPerChunk;
  // The last chunk too is whole vectors: 8k blocks of the 32-value types (K a multiple of 256), 1-3 super-blocks
  // of 144 or 176 bytes, or Q6_K's 4 (K a multiple of 1024).
  const int tail_vectors = (units - (chunks - 1) * kPerChunk) * kBlockBytes<KIND> / kVecBytes<KIND>;
  const Vec* row = reinterpret_cast<const Vec*>(g.blocks + n * g.row_bytes);
  const int64_t row_vectors = g.row_bytes / kVecBytes<KIND>;  // row n + 1 starts there (rows of whole vectors)
  auto vectors_of = [&](int c) { return c + 1 < chunks ? kFullVectors : tail_vectors; };

  float acc[ROWS][BMAX], acc_m[ROWS][BMAX];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
#pragma unroll
    for (int b = 0; b < BMAX; ++b) acc[r][b] = acc_m[r][b] = 0.f;
  }
  // The lane's block of chunk c of each row, whole in `stage` (one chunk a row), into the sums.
  auto accumulate_chunk = [&](const uint8_t (*stage)[kChunkBytes<KIND>], int c) {
    const int blk = c * kChunkBlocks + lane;
    if (blk >= nb) return;
    float scale[ROWS][2], off[ROWS];
    int q[ROWS][8];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) parse_aligned_block<KIND, true>(stage[r], lane, scale[r], off[r], q[r]);
    if constexpr (ROWS == 1) {
      accumulate_parsed<T, KIND, true, BMAX, true>(scale[0], off[0], q[0], p, blk, acc[0], acc_m[0]);
    } else {
#pragma unroll
      for (int b = 0; b < BMAX; ++b) {
        if (b >= p.batch) break;
        const XBlock x = load_x_block<KIND, true>(p, b, blk);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) accumulate_x<KIND, true>(scale[r], off[r], q[r], x, acc[r][b], acc_m[r][b]);
      }
    }
  };

  if constexpr (!IN_REGISTERS) {
    static_assert(sizeof(Vec) == 16, "the ring is filled by 16-byte copies");
    // Chunk c into its stage of the ring, then one commit group (empty past the last chunk, so that the group that
    // holds chunk c is always the (c + 1)-th).
    auto fetch = [&](int c) {
      if (c < chunks) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          Vec* stage = reinterpret_cast<Vec*>(stages[warp][c % kAlignedRing<ROWS>][r]);
#pragma unroll
          for (int j = 0; j < kAlignedVecs<KIND>; ++j) {
            const int i = lane + 32 * j;
            if (i < vectors_of(c)) cp_async16(stage + i, row + r * row_vectors + c * kFullVectors + i);
          }
        }
      }
      cp_async_commit();
    };
#pragma unroll
    for (int i = 0; i < kAlignedRing<ROWS>; ++i) fetch(i);
    griddep_wait();
    griddep_trigger_after_wait(p.feeds_attention);
    for (int c = 0; c < chunks; ++c) {
      cp_async_wait_group<kAlignedRing<ROWS> - 1>();  // this lane's copies of chunk c have landed
      __syncwarp();                                   // and every lane's
      accumulate_chunk(stages[warp][c % kAlignedRing<ROWS>], c);
      __syncwarp();  // every lane is done with the stage, which now takes chunk c + ring
      fetch(c + kAlignedRing<ROWS>);
    }
  } else {
    constexpr int kDepth = kGgufDepth<KIND>;
    // Chunk c of each of the warp's rows into the registers w[r].
    auto fetch = [&](AlignedChunk<KIND> (&w)[ROWS], int c) {
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
#pragma unroll
        for (int j = 0; j < kAlignedVecs<KIND>; ++j) {
          const int i = lane + 32 * j;
          if (i < vectors_of(c)) w[r].v[j] = __ldcs(row + r * row_vectors + c * kFullVectors + i);
        }
      }
    };
    AlignedChunk<KIND> w[kDepth][ROWS];
#pragma unroll
    for (int i = 0; i < kDepth; ++i) {
      if (i < chunks) fetch(w[i], i);
    }
    griddep_wait();
    griddep_trigger_after_wait(p.feeds_attention);
    for (int c0 = 0; c0 < chunks; c0 += kDepth) {
#pragma unroll
      for (int i = 0; i < kDepth; ++i) {  // chunk c from the registers w[i], which then take chunk c + depth
        const int c = c0 + i;
        if (c >= chunks) break;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          Vec* stage = reinterpret_cast<Vec*>(stages[warp][0][r]);
#pragma unroll
          for (int j = 0; j < kAlignedVecs<KIND>; ++j) {
            if (lane + 32 * j < vectors_of(c)) stage[lane + 32 * j] = w[i][r].v[j];
          }
        }
        if (c + kDepth < chunks) fetch(w[i], c + kDepth);
        __syncwarp();
        accumulate_chunk(stages[warp][0], c);
        __syncwarp();  // the stage is rewritten by the next chunk
      }
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) store_row<T, KIND, true, BMAX>(p, g, n + r, lane, acc[r], acc_m[r]);
}

// Output rows a warp of the aligned kernel takes for `p` at batch 1, `rows` the launch's over all segments: for Q4_0,
// Q4_1, Q4_K and Q5_K four through the ring in a launch of at least kAlignedWideRows rows, two in registers over rows
// of at least kAlignedLongK values; for Q6_K two in registers in either case; where every segment's rows are a
// multiple of that; one otherwise.
template <int KIND>
int gguf_aligned_rows(const GgufGemvParams& p, int64_t rows) {
  if (!kAlignedMultiRowKind<KIND>) return 1;
  const bool wide = rows >= kAlignedWideRows, long_rows = p.k >= kAlignedLongK;
  const int per_warp = kAlignedWideKind<KIND> ? (wide ? 4 : long_rows ? 2 : 1) : (wide || long_rows ? 2 : 1);
  for (int i = 0; i < p.segments; ++i) {
    if (p.seg[i].n % per_warp) return 1;
  }
  return per_warp;
}

// Whether every segment of `p` (all of type KIND) meets the aligned kernel's layout: blocks aligned to its vectors,
// rows of whole chunks of them (K a multiple of 256; of 1024 for Q6_K).
template <int KIND>
bool gguf_rows_aligned(const GgufGemvParams& p) {
  for (int i = 0; i < p.segments; ++i) {
    if (!rows_of_aligned_chunks<KIND>(p.k, p.seg[i].blocks)) return false;
  }
  return true;
}

}  // namespace
}  // namespace patcher
