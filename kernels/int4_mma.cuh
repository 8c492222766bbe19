// The tensor-core GPTQ int4 decode kernel: fp16/bf16 activations, groups of a multiple of 32 k, no act-order.
//
// Why tensor cores for a matrix-vector product: on CUDA cores every weight costs its dequantization plus one FMA
// per row of x, so the cost grows with the batch. Here mma.sync m16n8k16 (fp32 accumulation) takes 16 output
// columns x 16 k of dequantized weights (A) against 16 k x 8 rows of x (B; rows past the batch are zeros), so one
// instruction serves the whole batch and a weight costs its dequantization alone. Measured on the H100 against the
// CUDA-core kernel (PATCHER_INT4_CUDA_CORES=1, one machine, one session): batch 4 and 8 1.2-1.9x faster
// (Llama-3.1-8B gate/up 83.9 -> 54.7 us at batch 4, 148 -> 76 us at batch 8); batch 1 about even (whole-model
// decode 3-4% faster).
//
// What batch 1 is still short of, measured on the H100 (fp16, `python -m evals.ops --ops int4`, with parts of the
// kernel switched off in throwaway builds): with no weight loads at all Llama-3.1-8B gate/up still took 32 us of its
// 45 (the SASS had ~140 instructions per 4-row step: 64-bit index arithmetic, a shift, an AND and an OR per weight
// pair), so the large ops were instruction-bound; dequantize_word (int4_tile.cuh) and int32 loop counts take a step
// to about 85 (gate/up 45.1 -> 40.5 us, down 22.8 -> 21.1). For the small ops the fixed costs dominate: the K slices
// meeting in the workspace costs 2-4 us an op (Pythia-2.8B dense 8.7 -> 5.0 us without it), the norm prologue about
// 3 us (Pythia fused QKV). A per-block timeline (globaltimer at each phase, throwaway build) then showed where: the
// last block of a tile read the other slices' partial sums one L2 round trip per row, and the norm prologue's writing
// blocks loaded the norm weights one round trip per element behind their global stores (int4_tile.cuh); with both
// fixed, Pythia dense 8.2 -> 6.3 us, mlp_out 13.5 -> 11.3, fused LN+QKV 13.9 -> 12.7, Llama o_proj 10.1 -> 8.7. A
// split without the meeting, one 512-thread block per 32- or 64-column tile over all of K, measured faster only for
// the out projections (Pythia dense 6.2 -> 5.3 us, Llama o_proj 8.7 -> 7.8) and slower elsewhere (Llama gate/up
// 39.7 -> 61.1, int4 TPOT Llama 3.42 -> 4.09 ms for every op): dropped. Tried and dropped: L2 prefetches of the rows
// ahead inside the loop (bulk or per line: every op 2-15% slower; kept for a while instead: a prefetch of the rows
// after the register preload issued before griddepcontrol.wait, now off by default, mma_prefetch_bytes); 3 or 4 blocks
// per SM (spills; only gate/up faster); the K slices of a tile meeting in a thread-block cluster through distributed
// shared memory instead of the workspace (clusters of up to 8 blocks: slower, Pythia fused QKV 14.6 -> 22.2 us, Llama
// down 21.0 -> 35.9, int4 TPOT Pythia 1.85 -> 2.08 ms, Llama 3.54 -> 4.31); earlier, a 16-stage cp.async ring for the
// chunks and a 4-groups-ahead ring for the parameters (large matrices 5-10% faster, small ones 10-20% slower);
// 256-column tiles. And fewer blocks per SM (a split rule for 256 or 384 threads an SM instead of 512), so that with
// programmatic dependent launch the next op's blocks could be resident and load their weights during this op's tail:
// much slower (Pythia mlp_in 12.1 -> 21.4 us, int4 TPOT Pythia 1.81 -> 2.07-2.42 ms), so the warps per SM are what the
// ops need most; yet more 16-byte chunks in flight per lane (12 or 16 in the kernel without the norm prologue, which
// has the registers for them since its group parameters moved to shared memory) made decode no faster (int4 TPOT
// Pythia 1.80 -> 1.84-1.90 ms, Llama 3.43 -> 3.44-3.53; measured while the loop's loads had 1-2 chunks in flight, see
// the main loop; with that fixed, 12 again made no op faster: Llama gate/up 36.9 -> 36.8 us, the others 0.1-0.8 us
// slower); skipping the norm prologue's two block reductions (a bound for statistics computed once elsewhere) saved
// only 0.5 us on Pythia's fused LN+QKV. With every weight's dequantization replaced by 3 shifts (wrong results, a
// bound) Llama gate/up took 33.0 us and Pythia's int4_qkv_mlp_in 16.6 (against 35.9 and 20.0, the kernels of that
// day); Nsight Compute (evals/results/ncu_int4_stalls.txt) has a warp issuing every 7.3 cycles, 2.5 of them
// waiting on global loads (the fault below) and 1.7 on fixed-latency dependencies, with 3.4 warps a scheduler.
// After that fault's fix (docs/int4_decode.md, "What bounds the int4 kernels now"; bounds and a per-block timeline):
// with no dequantization and no mma.sync Llama gate/up still took 35.2 us of 36.9, and with its weights in L2 97% of
// the cold time; what is left is each block's fixed start (preload, prefetch issue, staging: 2.3-6.5 us to the wait;
// the prefetch is off since, mma_prefetch_bytes) and end (meeting, epilogue: 1.2-5.8 us) and SMs that run one block
// beside SMs that run two. That bound was probably faulty: built the same way at f9bd3c5, a loop that only loads
// and folds its chunks makes the compiler load one step's chunk in every 4-8 into spare registers and move it home
// right after the load (this kernel's loop has no such move). With the load unpredicated, the loads alone stream at
// HBM rate (gate/up 19.4 us, 3.1 TB/s). The ~10 us of gate/up's 34 that was then put down to the arithmetic was
// mostly the main loop's form: the same arithmetic in a clean loop costs ~2 us over the loads, and written so, the
// kernel's gate/up takes 26 us (the main loop; docs/int4_decode.md, "The int4 loop's form, not its arithmetic").
//
// Layout. A warp owns 32 columns of the tile. In each step lane 4g + q loads the 16-byte chunk at qweight row
// r0 + q, columns 4g .. 4g + 3 of the warp's 32, so a warp step is 4 rows x 32 columns (four 128-byte row
// segments). The lane dequantizes its chunk to the exact integers q - z in T (dequantize_zeros: about 9 instructions a
// word of 8 weights in fp16, 11 in bf16) into the pairs (k0,k4) (k1,k5) (k2,k6) (k3,k7), and those pairs are its A
// fragments as they are; the group's scales multiply its fp32 sums once a group (GroupTerms::fold), as the persistent
// step kernel does (step.cuh). So the kernel computes x . s(q - z) with the exact weights, where the reference (and
// HF's GPTQ linears, and this project's other int4 kernels) first round each weight s(q - z) to fp16 (for bf16
// activations then to bf16): it differs from them by that rounding, and from the exact product (the tests' float64
// reference, patcher/ops/reference.py: int4_linear) by less. Before, each weight was formed as the reference forms it,
// 4 more multiplies a word (13 instructions, and for bf16 a conversion of each pair on top); measured on the H100
// (fp16, batch 1, g128; one call, HEAD's kernels against these, each process twice, tools/int4_op_bench.cu and `python
// -m evals.tpot --random-config MODEL --int4-random 128 --modes patched --new-tokens 64 --repeats 3 --no-profile`):
// Llama-3.1-8B gate/up 25.9 -> 24.5 us, down 15.5 -> 15.1, o_proj 8.6 -> 8.2, Pythia-2.8B LN + QKV | MLP input 17.2
// -> 16.2; int4 TPOT Llama-3.1-8B 2.521 / 2.517 -> 2.427 / 2.429 ms, Pythia-2.8B 1.165 / 1.163 -> 1.109 / 1.101,
// Qwen2-1.5B 1.157 / 1.158 -> 1.098 / 1.108 (docs/int4_decode.md, "Exact weights, scales on the sums"). In MMA
// (h, jj), A row g is column 4g + 2h and row g + 8 is column 4g + 2h + 1 (h picks 2 of the lane's 4 columns); k slots
// (2q, 2q+1) are pair 2jj of row r0 + q and (2q+8, 2q+9) pair 2jj + 1. The order of k inside an MMA is free as long as
// B follows it, so x is staged in shared memory with every 8 k stored in that pair order, and one 16-byte shared load
// gives a lane its four B fragments (B column g = batch row g). The C fragments are columns x batch rows: lane (g, q)
// ends with column 4g + 2h (c0, c1) and column 4g + 2h + 1 (c2, c3), for batch rows 2q and 2q + 1.
//
// A block's warps are its tile's column warps times runs of the K slice (in whole steps of 4 rows: 2 runs of a
// 128-column tile, or 3 in the wide shape for long slices, MmaShape); the runs and the slices meet as in the
// CUDA-core kernel (int4_tile.cuh: finish_tile), or for SwiGLU in pairs of gate and up columns (finish_pair).
#pragma once
#include <algorithm>
#include <type_traits>

#include "int4_tile.cuh"

namespace patcher {
namespace {

// Two block shapes. A 128-column tile as 4 column warps x 2 runs of K (256 threads), each lane with 6 16-byte
// qweight chunks in flight, or "wide": 4 x 3 runs (384 threads) with 4 chunks a lane, at 80 registers a thread so
// that two blocks still share an SM (24 warps where there were 16). Every op takes the 256-thread shape; the wide one
// is there to compare (PATCHER_INT4_MMA_BLOCK=384; mma_wide says why). The norm prologue holds at most kNormElems
// row elements a thread (NORM_ELEMS of stage_x; fewer registers at 384 threads, K <= 16 x 384).
template <bool WIDE>
struct MmaShape {
  static constexpr int kThreads = WIDE ? 384 : 256;
  static constexpr int kPreload = WIDE ? 4 : 6;  // 16-byte qweight chunks in flight per lane
  static constexpr int kNormElems = WIDE ? 16 : 32;
};

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
// [groups][tile_width / 8] words. kInt4GroupStageBytes (launchers.h) bounds it. Measured on the
// H100 (fp16, batch 1, `evals.ops --ops int4`), alone: Llama-3.1-8B gate/up 40.3 -> 39.3 us, down 21.1 -> 20.7
// (a bound, with no group changes at all: 38.6 and 20.3); with the acq_rel meeting (int4_tile.cuh: finish_tile),
// every op 1-5% faster (gate/up 40.5 -> 39.5, Pythia-2.8B fused LN+QKV 14.6 -> 13.9) and int4 TPOT Pythia-2.8B
// 1.85 -> 1.79 ms, Llama-3.1-8B 3.53 -> 3.43.
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
// so a block holds both inputs of its outputs. With one K slice it then finishes alone, where a gate tile and an up
// tile in two blocks met through the workspace (finish_pair); the sums are the same, bit for bit (each column's
// lanes, runs and slices are as before). Measured on the H100 (fp16, one call, gate/up tiles then pairs; `evals.ops
// --ops int4 --decode-batches 1,4`): Qwen2-1.5B gate/up 13.5 -> 12.9 us at batch 1 and 20.3 -> 14.4 at batch 4,
// Llama-3.1-8B gate/up 36.9 -> 36.9 and 46.7 -> 45.6; int4 TPOT Qwen2-1.5B 1.567 -> 1.446 ms.
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
// (as int4_tile.cuh: group_dequant), bf16 -(128 + z) (bf16 steps by 1 from 128 to 256).
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
// 64 + q by a fused multiply by 1/16 (int4_tile.cuh: dequantize_word); bf16: each nibble shifted to bit 0 lands in
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

// Two fp16 weights as the A operand's halves in T: as they are, or for bf16 activations the reference's cast to bf16.
template <typename T>
__device__ __forceinline__ uint32_t operand(__half2 w) {
  uint32_t bits;
  if constexpr (std::is_same_v<T, __half>) {
    memcpy(&bits, &w, 4);
  } else {
    const __nv_bfloat162 b = __float22bfloat162_rn(__half22float2(w));
    memcpy(&bits, &b, 4);
  }
  return bits;
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

// The A fragments of a lane's chunk, a_pairs [column][pair (k_j, k_j+4)], into acc0[h] and acc1[h] (columns 4g + 2h
// and 4g + 2h + 1) against its x chunk (the B fragments of those 8 k): the chunk's first two pairs into acc0, the
// last two into acc1. Given one array twice, one chain of dependent mma; the persistent step kernel (step.cuh) gives
// two, so that each chain is half as long.
template <typename T>
__device__ __forceinline__ void mma_pairs(float (&acc0)[2][4], float (&acc1)[2][4], const uint32_t (&a_pairs)[4][4],
                                          const uint4& xv) {
  const uint32_t xb[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int jj = 0; jj < 2; ++jj) {
      const int c0 = 2 * h, c1 = 2 * h + 1;
      const uint32_t a[4] = {a_pairs[c0][2 * jj], a_pairs[c1][2 * jj], a_pairs[c0][2 * jj + 1],
                             a_pairs[c1][2 * jj + 1]};
      mma_16816<T>(jj == 0 ? acc0[h] : acc1[h], a, xb[2 * jj], xb[2 * jj + 1]);
    }
  }
}

// One step of a lane: its 16-byte qweight chunk (4 columns x 8 k, one group) dequantized as the reference does
// (round(scale * (q - zero)), then for bf16 the reference's cast) into acc. The Hopper copy-engine kernel's form.
template <typename T>
__device__ __forceinline__ void mma_chunk(float (&acc)[2][4], const uint4& chunk, const uint4& xv, const Dequant& d) {
  const uint32_t words[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
  uint32_t a_pairs[4][4];
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    __half2 w[4];
    dequantize_word(words[c], d, c, w);
#pragma unroll
    for (int j = 0; j < 4; ++j) a_pairs[c][j] = operand<T>(w[j]);
  }
  mma_pairs<T>(acc, acc, a_pairs, xv);
}

// The same step with the weights as the exact integers q - zero (dequantize_zeros) into the group's sums, part0 and
// part1 as mma_pairs takes them (this kernel gives one array twice); the scales multiply those once a group
// (GroupTerms::fold).
template <typename T>
__device__ __forceinline__ void mma_chunk_exact(float (&part0)[2][4], float (&part1)[2][4], const uint4& chunk,
                                                const uint4& xv, const ZeroTerms& z) {
  const uint32_t words[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
  uint32_t a_pairs[4][4];
#pragma unroll
  for (int c = 0; c < 4; ++c) dequantize_zeros<T>(words[c], z, c, a_pairs[c]);
  mma_pairs<T>(part0, part1, a_pairs, xv);
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

template <typename T, bool NORM, bool WIDE>
__global__ void __launch_bounds__(MmaShape<WIDE>::kThreads, 2) int4_mma_kernel(const Int4Params p, int tile_width) {
  constexpr int kMmaPreload = MmaShape<WIDE>::kPreload;
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
  // The rows after those into L2 while the block waits for the previous kernel and stages x: lane i the warp's 32
  // columns (128 bytes) of rows 32 + i, 64 + i, ... of its run. Off unless PATCHER_INT4_PREFETCH_MB is set
  // (prefetch_rows is 0 then; mma_prefetch_bytes says why).
  if (warp_live) {
    const int ahead = min(run_rows, 4 * kMmaPreload + p.prefetch_rows);
    const uint32_t bytes = static_cast<uint32_t>(min(32, t.width - member_col)) * 4;
    const int32_t* rows0 = seg.qweight + t.col0 + member_col + run_begin * seg.n;
    for (int r = 4 * kMmaPreload + lane; r < ahead; r += 32) prefetch_l2(rows0 + r * seg.n, bytes);
  }
  const int64_t k0 = r_begin * 8, len = (r_end - r_begin) * 8;
  const SliceGroups groups = stage_groups(p, t, tile_width, span, k0, k0 + len,
                                          reinterpret_cast<char*>(smem) + mma_x_stage_bytes(p, sizeof(T)));
  if (!skips_wait(p, k0)) griddep_wait();
  if (blockIdx.y == 0) clear_share(p, blockIdx.x, gridDim.x);  // slice 0 never skips the wait
  griddep_launch_dependents();

  T* xs = reinterpret_cast<T*>(smem);  // [batch][len], every 8 k in the pair order (0,4) (1,5) (2,6) (3,7)
  stage_x<T, NORM, MmaShape<WIDE>::kNormElems>(
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
      mma_chunk_exact<T>(part, part, wj, xv, d.z);
      // The chunk kPreload steps on, into the registers just read. Loaded before the use into a copy instead
      // (`chunk = wj`, then the load), the compiler loaded into spare registers and moved the chunk home at
      // the next step, so each step waited there for the load issued one step before: in flight were 1-2
      // chunks, not kMmaPreload (its SASS; the Nsight Compute stalls are in the header).
      if (live && 4 * (s + kMmaPreload) < lane_rows) wj = __ldcs(next_chunk);
      next_chunk += step_stride;
    };
    // The steps in whole rounds of kMmaPreload without a test, then the rest, leaving the loop at the warp's last
    // step. Written as one loop whose unrolled steps each tested s < steps and skipped the step if not, the same
    // arithmetic ran much slower. On the H100 (fp16, batch 1, tools/int4_op_bench.cu, one call, us; that form ->
    // this one, both with the block shapes of the time): Llama-3.1-8B gate/up 31.8 -> 26.0, norm + gate/up 33.6 ->
    // 28.4, down 17.5 -> 15.8, o_proj 9.1 -> 8.7, norm + QKV 12.7 -> 11.4, Pythia-2.8B LN + QKV | MLP input 23.7 ->
    // 16.9; int4 TPOT Llama-3.1-8B 2.93 -> 2.70 ms, Pythia-2.8B 1.32 -> 1.20-1.25. Of that, the rounds without a
    // test gave 0.6-1.5 us on the large ops (an earlier build of the bench: gate/up 27.5 -> 26.0, down 16.3 -> 15.7);
    // with the norm prologue they spilled registers and were slower (norm + gate/up 28.6 -> 29.1, on the 384-thread
    // blocks of the time), so that kernel only leaves at the last step. (On the 256-thread blocks with 6 chunks the
    // rounds do not spill, but measured no faster: norm + gate/up 26.8 -> 26.5 us, norm + QKV 11.2 -> 11.3, int4 TPOT
    // Llama-3.1-8B 2.602 / 2.596 -> 2.607 / 2.603 ms; evals/results/qkv_acc_04fa667.txt, call 1.)
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

// Bytes of an op's qweight prefetched into L2 before griddepcontrol.wait (int4_mma_kernel), at most: none by
// default, PATCHER_INT4_PREFETCH_MB=n for n MB (to compare). The prefetch was to use HBM while a block waits for the
// kernel before it; but that kernel's last blocks are still streaming then, and the prefetches compete with them on
// the step's critical path. The 16 MB that had paid when it landed (int4 TPOT Llama-3.1-8B 3.464 -> 3.414 ms) cost
// time once the output projections' sums went unmet (8222ec9), the more the larger the budget. Measured on the H100
// (fp16, batch 1, g128; `python -m evals.tpot --random-config MODEL --int4-random 128 --modes patched --new-tokens 64
// --repeats 3`, two rounds interleaved in one call; ms; evals/results/prefetch_budget_b73329a.txt has the sweep of
// budgets in between, and the rows as one 2-D tensor-map box a warp, slower at every budget above 2 MB):
//   budget          16 MB          none
//   Llama-3.1-8B    3.046, 3.048   2.921, 2.912
//   Pythia-2.8B     1.362, 1.401   1.343, 1.333
//   Qwen2-1.5B      1.391, 1.405   1.398, 1.398
inline int64_t mma_prefetch_bytes() {
  static const int64_t bytes = int64_t{std::max(0, env_int("PATCHER_INT4_PREFETCH_MB"))} << 20;
  return bytes;
}

// Whether an op takes the wide blocks (MmaShape): only with PATCHER_INT4_MMA_BLOCK=384 (=256 or unset: never). They
// paid for long K slices while the main loop's unrolled steps each tested whether the warp had them (see the main
// loop): with that form, measured on the H100 (fp16, batch 1, `evals.ops --ops int4,int4_neox`; rows a slice: 256 ->
// 384 threads, us) Llama-3.1-8B gate/up (512) 36.9 -> 32.6-32.8, with the norm (512) 37.6 -> 35.1, down (224) 19.0
// -> 18.3-18.4, Pythia-2.8B output pair (124) 13.4 -> 12.6-12.8, so 128-column tiles of at least 96 rows a slice (384
// with the norm) took them. With the loop as it is the 256-thread blocks are faster but for one op
// (tools/int4_op_bench.cu, us, 384 -> 256 threads: Llama gate/up 26.0 -> 25.1, with the norm 28.4 -> 26.6, down
// 15.8 -> 15.4; Pythia MLP output 10.4 -> 10.6), and with 6 chunks a lane instead of 8 more so (Llama o_proj 8.7 ->
// 8.5, norm + QKV 11.4 -> 11.2). int4 TPOT (evals.tpot with --int4-random 128 --modes patched --new-tokens 64
// --repeats 3, one call, two rounds interleaved; ms), the rule with 8 chunks -> every op at 256 threads with 6
// chunks: Llama-3.1-8B 2.698 / 2.705 -> 2.631 / 2.616, Pythia-2.8B 1.248 / 1.261 -> 1.196 / 1.193, Qwen2-1.5B 1.321
// -> 1.222.
template <typename T>
bool mma_wide(const Int4Params& p, int tile_width) {
  static const bool forced = env_int("PATCHER_INT4_MMA_BLOCK") == 384;
  return forced && tile_width == 128 && norm_fits<T>(p, MmaShape<true>::kThreads, MmaShape<true>::kNormElems);
}

template <typename T, bool WIDE>
cudaError_t launch_mma_shape(const Int4Params& op, int tile_width, cudaStream_t stream) {
  const int col_warps = tile_width / 32, runs = MmaShape<WIDE>::kThreads / 32 / col_warps;
  const dim3 block(col_warps * runs * 32);
  const int64_t tiles = mma_paired(op) ? mma_pairs(op, tile_width) : int4_tiles(op);  // at most int4_tiles(op)
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(op.splits));
  Int4Params p = op;
  const int64_t row_bytes = static_cast<int64_t>(grid.x) * grid.y * block.x / 32 * 128;  // one row of every warp run
  p.prefetch_rows = static_cast<int32_t>(mma_prefetch_bytes() / row_bytes);              // 0 by default
  size_t smem = 0;
  const cudaError_t fits = launch_smem<T>(p, mma_x_stage_bytes(p, sizeof(T)), int4_group_stage_bytes(p), runs,
                                          static_cast<int>(block.x), tile_width, smem, MmaShape<WIDE>::kNormElems);
  if (fits != cudaSuccess) return fits;
  const auto kernel = p.norm.weight ? int4_mma_kernel<T, true, WIDE> : int4_mma_kernel<T, false, WIDE>;
  if (smem + 1024 > 48 * 1024) {  // with the kernel's static shared memory, past the default limit
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  return launch_pdl(kernel, grid, block, smem, stream, p, tile_width);
}

template <typename T>
cudaError_t launch_mma(const Int4Params& op, cudaStream_t stream) {
  const int tile_width = static_cast<int>(int4_tile_width(op));
  if (mma_wide<T>(op, tile_width)) return launch_mma_shape<T, true>(op, tile_width, stream);
  return launch_mma_shape<T, false>(op, tile_width, stream);
}

}  // namespace
}  // namespace patcher
