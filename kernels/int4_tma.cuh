// The Hopper GPTQ int4 decode kernel: the tensor-core arithmetic of int4_mma.cuh, fed by the bulk tensor copy
// engine (TMA) through a ring of shared-memory stages, in a persistent grid of one block per SM.
//
// Status: off unless PATCHER_INT4_TMA=1, because measured on the H100 it is not faster than int4_mma.cuh (batch 1,
// fp16, one machine, `python -m evals.ops --ops int4` ops with and without the switch,
// evals/results/int4_tma_bounds.txt): Pythia-2.8B fused LN+QKV 15.6 us against 13.9, dense 7.8 against 8.2, mlp_in 15.7
// against 11.6, mlp_out 19.6 against 13.5; Llama-3.1-8B fused norm+QKV 17.1 against 13.8, o_proj 10.6 against 10.1,
// gate/up 36.6 against 39.3, down 21.1 against 20.5; int4 TPOT Pythia-2.8B 2.36 ms against 1.81, Llama-3.1-8B 3.87
// against 3.43.
//
// Where its time goes, measured by switching parts off in a throwaway build (same op table and machine): without
// meeting the other blocks (no partial sums, no epilogue) every op is faster than the tensor-core kernel (Pythia fused
// LN+QKV 10.4 us, dense 4.7, mlp_in 10.2, mlp_out 10.7; Llama 12.6, 7.5, 33.3, 17.5), so the meeting, 3-9 us an
// op, is what keeps it behind; without the arithmetic as well: 7.9, 3.6, 7.4, 7.9 and 9.9, 5.7, 25.7, 13.6; staging x
// after griddepcontrol.wait costs up to 2 us of that. (Earlier measurements, before the changes below: the copy
// stream alone at the standalone benchmark's speed, gate/up 22.8 us; the arithmetic 4-12 us with 8 consumer warps
// and 4-way bank conflicts.) What changed since, measured against the previous version of this kernel on one H100:
// each column warp's 32 columns come in a box of their own under the copy engine's 128-byte swizzle, read without bank
// conflicts (stage_row), every op 2-7% faster; and a finisher warp takes the meeting of every tile part but a block's
// last, so its round trips no longer stall the consumers: Llama gate/up 43.1 -> 36.6 us, down 24.5 -> 21.1, o_proj
// 11.6 -> 10.6, Pythia dense 8.7 -> 7.8, but Pythia mlp_out 17.4 -> 19.6 (its blocks hold one or two parts). 16
// consumer warps instead of 8 (96 registers a thread) measured no faster.
//
// Why. The register-prefetch kernels (int4_gemv.cuh, int4_mma.cuh) keep 8 16-byte chunks in flight per lane in one
// wave of two 256-thread blocks per SM; measured on the H100 that geometry caps the qweight reads alone at 44-56% of
// HBM bandwidth (tools/int4_read_bench.cu). One 2-D tensor copy per stage, issued by one thread, holds a whole
// 16 KB stage in flight; tools/int4_stream_bench.cu measured this ring over the checkpoint layout at 2560-2683
// GB/s for Llama-3.1-8B's gate/up and down (88-95% of a plain grid-stride read of the same bytes) and 1.8-2.0 TB/s
// for the 8-13 MB matrices, with 4 stages of 32 qweight rows per block. No repacking: the tensor maps read
// qweight [K/8, N], scales [G, N] and qzeros [G, N/8] where the checkpoint keeps them.
//
// Work split. A stage is 32 qweight rows (256 k) of one column tile (128 columns, or whole heads with RoPE), with
// the scales and zero points of the groups those rows meet. The stages are numbered tile by tile, K fastest, and
// every block takes an equal run of them (the last block possibly fewer), so the blocks carry equal bytes whatever
// the shape. A run crosses tiles: each part of a tile a block holds meets the other blocks' parts through finish_tile
// (int4_tile.cuh) as the split kernels' slices do: partial sums meet in the workspace, one row per block that touches
// the tile, and the last to arrive runs the epilogue; a block that holds a whole tile finishes it directly.
//
// Block. Warps 0 .. consumers - 1 compute (column warps x runs of the stage's rows, as int4_mma.cuh lays out a step:
// lane 4g + q takes one row of each 4-row step, columns 4g .. 4g + 3 of its warp's 32); the next warp's first lane is
// the producer, keeping the ring full (4 stages of 16-20 KB); the last warp is the finisher: the consumers hand it the
// sums of each tile part but the last through shared memory (named barriers kSumsFull / kSumsFree) and go on with
// the stream while it meets the other blocks; the last part they finish themselves. x (normalized by the prologue
// where fused) is staged whole in shared memory before the loop, in the mma pair order, since a run may need any
// part of K.
#pragma once
#include <cuda.h>          // CUtensorMap
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include <atomic>
#include <cstring>

#include "int4_mma.cuh"
#include "tma.cuh"

namespace patcher {
namespace {

constexpr int kTmaRows = 32;                  // qweight rows per stage
constexpr int kTmaStageK = 8 * kTmaRows;      // k per stage
constexpr int kTmaBoxBytes = kTmaRows * 128;  // one column warp's share of a stage: 32 rows x 32 columns
constexpr int kTmaMaxStages = 4;              // ring depth (fewer where shared memory runs out)
constexpr int kTmaMaxSteps = 4;               // a consumer warp's 4-row steps per stage, at most (runs of 2 or more)
constexpr int kTmaMaxWarps = 16;              // 14 consumers at most, the producer and the finisher: 128 registers
constexpr int64_t kTmaStageX = 32768;         // batch x K elements of x kept in shared memory (64 KB)
constexpr int64_t kTmaSmem = 225 * 1024;      // dynamic shared memory of one block (Hopper: 227 KB with the static)
// Named barriers (0 is __syncthreads): the consumer warps' and the finisher warp's own (Team; finish_tile keeps a
// flag for each of 0 .. 2), and the two that hand a tile part's sums from the consumers to the finisher.
constexpr int kConsumerTeam = 1, kFinisherTeam = 2, kSumsFull = 3, kSumsFree = 4;

struct Int4Maps {  // one tensor map per segment and tensor
  CUtensorMap qweight[kInt4MaxSegments], scales[kInt4MaxSegments], zeros[kInt4MaxSegments];
};

// The launch's shape, as the host works it out (tma_plan) and the kernel reads it.
struct TmaPlan {
  int tile_width, col_warps, runs, stages;
  int stage_groups, group_shift;  // group rows per stage copy; (k within a stage) >> group_shift: its group there
  int tiles, grid;
  int64_t k_stages, per_block;                     // stages per tile; stages per block
  int q_bytes, s_bytes, stage_bytes, param_bytes;  // a stage: qweight boxes, scales, zeros; the bytes of the last two
  int x_offset, x_stride, red_offset;              // x [batch][x_stride] in T; runs' sums, a part's sums, finished
};

// Blocks that hold part of tile `tile`, and the first of them.
__device__ __forceinline__ int tile_first_block(const TmaPlan& plan, int64_t tile) {
  return static_cast<int>(tile * plan.k_stages / plan.per_block);
}
__device__ __forceinline__ int tile_blocks(const TmaPlan& plan, int64_t tile) {
  return static_cast<int>(((tile + 1) * plan.k_stages - 1) / plan.per_block) - tile_first_block(plan, tile) + 1;
}

// How this block's sums of tile `tile` meet the other blocks' (finish_tile).
__device__ __forceinline__ TileSplit stage_runs(const Int4Params& p, const TmaPlan& plan, const TileInfo& t,
                                                int64_t tile) {
  TileSplit s{};
  s.slot = static_cast<int>(blockIdx.x) - tile_first_block(plan, tile);
  if (t.members == 1) {
    s.slots[0] = s.slots[1] = s.expected = tile_blocks(plan, tile);
    s.direct = s.expected == 1;
  } else {  // SwiGLU: gate tile t.group and up tile t.group + (gate's tiles) finish together
    const int64_t gate_tiles = (p.seg[0].n + plan.tile_width - 1) / plan.tile_width;
    s.slots[0] = tile_blocks(plan, t.group);
    s.slots[1] = tile_blocks(plan, t.group + gate_tiles);
    s.expected = s.slots[0] + s.slots[1];
  }
  return s;
}

__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Row of a stage (0 .. 31) that lane quad q reads in the warp's step s (0 .. 7): rows 8 (s / 2) + 2q + s % 2, so that
// the four rows of one load differ in bits 1-2 and, under the copy engine's 128-byte swizzle (16-byte chunk c of row
// r stored at chunk c ^ (r % 8)), the 8 lanes of each quarter warp (columns 4g of two g, four rows) read 8 different
// chunk positions: no bank conflicts. The mma takes any assignment of rows to steps, as each lane's x follows its row;
// with groups of 64 k or more the 8 rows of a pair of steps share a group.
__device__ __forceinline__ int stage_row(int s, int q) { return 8 * (s / 2) + 2 * q + (s % 2); }

template <typename T, bool NORM>
__global__ void __launch_bounds__(kTmaMaxWarps * 32, 1)
    int4_tma_kernel(const Int4Params p, const __grid_constant__ Int4Maps maps, const TmaPlan plan) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char dynamic[];
  // The stages, x, the sums (TmaPlan), from a 1024-byte boundary: the 128-byte swizzle is a function of the address.
  unsigned char* ring = dynamic + ((1024u - (smem_addr(dynamic) & 1023u)) & 1023u);
  __shared__ uint64_t full[kTmaMaxStages], empty[kTmaMaxStages];
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int consumers = plan.col_warps * plan.runs, S = plan.stages, tw = plan.tile_width;
  const int handoff = (consumers + 1) * 32;  // threads meeting at kSumsFull / kSumsFree: the consumers, the finisher
  const int64_t first = blockIdx.x * plan.per_block;
  const int count = static_cast<int>(min(plan.per_block, plan.k_stages * plan.tiles - first));
  const bool producer = warp == consumers && lane == 0;

  // The producer's position: stage `stage` of tile `tile` goes into slot `slot` (no divisions in the loops).
  int64_t tile = first / plan.k_stages, stage = first % plan.k_stages;
  int slot = 0;
  const auto issue = [&] {  // that stage's qweight rows (one box per column warp with columns), scales, zero points
    const TileInfo t = tile_info(p, static_cast<int>(tile), tw);
    const int first_group = static_cast<int>(stage * kTmaStageK / p.group_size);
    const int live = (t.width + 31) / 32, col = static_cast<int>(t.col0), row = static_cast<int>(stage * kTmaRows);
    unsigned char* dst = ring + slot * plan.stage_bytes;
    bar_expect(&full[slot], static_cast<unsigned>(live * kTmaBoxBytes + plan.param_bytes));
    for (int w = 0; w < live; ++w)
      tensor_copy(dst + w * kTmaBoxBytes, &maps.qweight[t.seg], col + 32 * w, row, &full[slot]);
    tensor_copy(dst + plan.q_bytes, &maps.scales[t.seg], col, first_group, &full[slot]);
    tensor_copy(dst + plan.q_bytes + plan.s_bytes, &maps.zeros[t.seg], col / 8, first_group, &full[slot]);
    if (++stage == plan.k_stages) {
      stage = 0;
      ++tile;
    }
    if (++slot == S) slot = 0;
  };

  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      bar_init(&full[s], 1);
      bar_init(&empty[s], static_cast<unsigned>(consumers));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  // The first stages are constant data: in flight before griddepcontrol.wait, while the previous kernel finishes.
  if (producer) {
    for (int i = 0; i < min(S, count); ++i) issue();
  }
  griddep_wait();
  griddep_launch_dependents();
  clear_share(p, blockIdx.x, gridDim.x);

  T* xs = reinterpret_cast<T*>(ring + plan.x_offset);  // [batch][x_stride], every 8 k in the mma pair order
  const int64_t x_stride = plan.x_stride;
  stage_x<T, NORM>(p, 0, p.k, blockIdx.x == 0, false, [=](int b, int64_t i, float v) {
    xs[b * x_stride + (i & ~int64_t{7}) + 2 * (i & 3) + ((i >> 2) & 1)] = from_float<T>(v);
  });
  __syncthreads();

  float* red = reinterpret_cast<float*>(ring + plan.red_offset);  // [runs][batch][tile_width]
  const int per_part = static_cast<int>(p.batch) * tw;
  if (warp == consumers) {  // the producer refills each slot once every consumer warp has released it
    if (producer) {
      unsigned phase = 0;  // of the slot's previous use
      for (int i = S; i < count; ++i) {
        if (slot == 0 && i > S) phase ^= 1u;
        bar_wait(&empty[slot], phase);
        issue();
      }
    }
    return;
  }
  const int members = p.epilogue == kInt4SiluMul ? 2 : 1;
  if (warp == consumers + 1) {
    // The finisher: for each tile part but the block's last, in turn, the runs' sums into `part` (red is then free
    // again for the consumers), then the meeting with the other blocks of the tile (finish_tile), whose round trips
    // no longer hold up the stream. The last part the consumers finish themselves, all of them: measured on the H100
    // with the finisher taking every part, each op took 3-6 us more (the last block of a tile reads the other blocks'
    // partial sums, and one warp reads them 4 columns after one another).
    float* part = red + (plan.runs + members) * per_part;  // [batch][tw], then finish_tile's [members][batch][tw]
    const Team team{lane, 32, kFinisherTeam};
    named_arrive(kSumsFree, handoff);
    for (int64_t t_index = first / plan.k_stages; t_index < (first + count - 1) / plan.k_stages; ++t_index) {
      named_sync(kSumsFull, handoff);
      for (int i = lane; i < per_part; i += 32) part[i] = add_runs(p, red, plan.runs, tw, i / tw, i % tw);
      named_arrive(kSumsFree, handoff);
      const TileInfo t = tile_info(p, static_cast<int>(t_index), tw);
      finish_tile<T>(p, t, part, 1, tw, stage_runs(p, plan, t, t_index), team);
    }
    return;
  }

  const int col_warp = warp % plan.col_warps, run = warp / plan.col_warps, g = lane / 4, q = lane % 4;
  const int steps = 8 / plan.runs;             // steps of this warp in each stage
  const int lane_col = col_warp * 32 + 4 * g;  // the lane's first column of the tile
  float acc[2][4] = {};
  tile = first / plan.k_stages;
  stage = first % plan.k_stages;
  slot = 0;
  unsigned phase = 0;
  for (int i = 0; i < count; ++i) {
    bar_wait(&full[slot], phase);
    const unsigned char* src = ring + slot * plan.stage_bytes;
    const unsigned char* box = src + col_warp * kTmaBoxBytes;                                      // [32][128 B]
    const __half* scales = reinterpret_cast<const __half*>(src + plan.q_bytes);                    // [groups][tw]
    const uint32_t* zeros = reinterpret_cast<const uint32_t*>(src + plan.q_bytes + plan.s_bytes);  // [groups][tw/8]
    const T* x_stage = xs + g * x_stride + stage * kTmaStageK;
    uint4 chunk[kTmaMaxSteps], xv[kTmaMaxSteps];  // (a compile-time bound: the loops unroll, the loads go first)
#pragma unroll
    for (int j = 0; j < kTmaMaxSteps; ++j) {
      const int r = stage_row(run * steps + j, q);
      if (j < steps) {
        chunk[j] = *reinterpret_cast<const uint4*>(box + r * 128 + ((g ^ (r & 7)) << 4));
        xv[j] = g < p.batch ? *reinterpret_cast<const uint4*>(x_stage + r * 8) : make_uint4(0, 0, 0, 0);
      }
    }
    int current = -1;  // the group (within the stage) whose parameters d holds
    Dequant d;
#pragma unroll
    for (int j = 0; j < kTmaMaxSteps; ++j) {
      if (j >= steps) break;
      const int group = (stage_row(run * steps + j, q) * 8) >> plan.group_shift;
      if (group != current) {
        current = group;
        GroupParams gp;
        gp.scales = *reinterpret_cast<const uint2*>(scales + group * tw + lane_col);
        gp.zeros = zeros[group * (tw / 8) + lane_col / 8] >> (4 * (lane_col % 8));
        d = group_dequant(gp, p.zero_offset);
      }
      mma_chunk<T>(acc, chunk[j], xv[j], d);
    }
    __syncwarp();
    if (lane == 0) bar_arrive(&empty[slot]);  // the slot is free for the producer
    if (++slot == S) {
      slot = 0;
      phase ^= 1u;
    }

    if (stage == plan.k_stages - 1 || i == count - 1) {  // this block's part of the tile is done
      const TileInfo t = tile_info(p, static_cast<int>(tile), tw);
      named_sync(kSumsFree, handoff);  // red [runs][batch][tw] is free
      if (lane_col < t.width) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int b = 2 * q + (e & 1);
            if (b < p.batch) red[(run * p.batch + b) * tw + lane_col + 2 * h + (e >> 1)] = acc[h][e];
          }
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[h][e] = 0.f;
      }
      if (i < count - 1) named_arrive(kSumsFull, handoff);  // to the finisher; the last part is finished below
    }
    if (++stage == plan.k_stages) {
      stage = 0;
      ++tile;
    }
  }
  const int64_t last = (first + count - 1) / plan.k_stages;
  const TileInfo t = tile_info(p, static_cast<int>(last), tw);
  finish_tile<T>(p, t, red, plan.runs, tw, stage_runs(p, plan, t, last),
                 {lane + 32 * warp, consumers * 32, kConsumerTeam});
#endif
}

// ---- host side ----------------------------------------------------------------------------------------------

inline int align128(int64_t bytes) { return static_cast<int>((bytes + 127) / 128 * 128); }
inline int align1024(int64_t bytes) { return static_cast<int>((bytes + 1023) / 1024 * 1024); }

// The launch of an fp16/bf16 op on the TMA kernel, or false where it does not take the op: not asked for
// (PATCHER_INT4_TMA=1) or not a Hopper GPU, two outputs (a block's tiles share one x stage), act-order, K not whole
// stages, groups that do not tile a stage (the group size must be 32, 64, 128 or 256, or a multiple of 256), widths
// that are not whole 32-column warps, tiles wider than 7 column warps (14 consumer warps with the producer and the
// finisher make kTmaMaxWarps), batch x K over the x stage.
template <typename T>
bool tma_plan(const Int4Params& p, TmaPlan& plan, size_t& smem) {
  static const bool enabled = hopper_or_newer() && env_flag("PATCHER_INT4_TMA");
  const int64_t gs = p.group_size, tw = int4_tile_width(p);
  if (!enabled || p.act_order || p.second || p.k % kTmaStageK ||
      !(gs % kTmaStageK == 0 || (gs % 32 == 0 && kTmaStageK % gs == 0)))
    return false;
  if (tw % 32 || tw > 7 * 32 || p.batch * p.k > kTmaStageX) return false;
  for (int s = 0; s < p.num_segments; ++s) {
    if (p.seg[s].n % 32) return false;  // (qzeros rows must be whole 16 bytes for the copy engine)
  }
  plan.tile_width = static_cast<int>(tw);
  plan.col_warps = plan.tile_width / 32;
  // Runs of a stage's 8 steps: 8 consumer warps for tiles of 1 or 2 column warps, else 2 runs of 4 steps
  // (kTmaMaxSteps), 6 to 14 consumer warps.
  plan.runs = plan.col_warps <= 2 ? 8 / plan.col_warps : 2;
  if (!norm_fits<T>(p, (plan.col_warps * plan.runs + 2) * 32)) return false;
  plan.stage_groups = gs >= kTmaStageK ? 1 : static_cast<int>(kTmaStageK / gs);
  // Within a stage (k < 256) k >> group_shift is the group counted from the stage's first: log2 of the group sizes
  // that divide 256, and 8 (always group 0) for the multiples of 256.
  plan.group_shift = 8;
  while ((int64_t{1} << plan.group_shift) > gs) --plan.group_shift;
  plan.q_bytes = plan.col_warps * kTmaBoxBytes;
  plan.s_bytes = align128(plan.stage_groups * plan.tile_width * 2);
  const int z_bytes = plan.stage_groups * plan.tile_width / 2;
  plan.stage_bytes = align1024(plan.q_bytes + plan.s_bytes + align128(z_bytes));  // the swizzled boxes: 1024-aligned
  plan.param_bytes = plan.stage_groups * plan.tile_width * 2 + z_bytes;
  plan.x_stride = static_cast<int>(p.k + 8);  // 16 bytes of padding: batch rows start in different banks
  const int x_bytes = align128(p.batch * plan.x_stride * static_cast<int64_t>(sizeof(T)));
  const int members = p.epilogue == kInt4SiluMul ? 2 : 1;
  // The runs' sums and the consumers' finished values, then the finisher's part and finished values.
  const int red_bytes = (plan.runs + 2 * members + 1) * static_cast<int>(p.batch) * plan.tile_width * 4;
  plan.stages = kTmaMaxStages;
  // 1024 bytes more than the plan: the kernel starts the ring at the first 1024-byte boundary.
  while (plan.stages > 1 && plan.stages * plan.stage_bytes + x_bytes + red_bytes + 1024 > kTmaSmem) --plan.stages;
  if (plan.stages < 2) return false;
  plan.x_offset = plan.stages * plan.stage_bytes;
  plan.red_offset = plan.x_offset + x_bytes;
  smem = static_cast<size_t>(plan.red_offset + red_bytes + 1024);

  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  plan.tiles = static_cast<int>(int4_tiles(p));
  plan.k_stages = p.k / kTmaStageK;
  const int64_t total = plan.k_stages * plan.tiles;
  plan.per_block = (total + sms - 1) / sms;
  plan.grid = static_cast<int>((total + plan.per_block - 1) / plan.per_block);
  return true;
}

template <typename T>
cudaError_t launch_tma(const Int4Params& p, const TmaPlan& plan, size_t smem, cudaStream_t stream, bool& launched) {
  launched = false;
  Int4Maps maps;
  std::memset(&maps, 0, sizeof(maps));
  const int64_t rows = p.k / 8, groups = (p.k + p.group_size - 1) / p.group_size;
  for (int s = 0; s < p.num_segments; ++s) {
    const Int4Segment& seg = p.seg[s];
    if (!encode_map(maps.qweight[s], CU_TENSOR_MAP_DATA_TYPE_INT32, 4, seg.qweight, seg.n, rows, 32, kTmaRows,
                    CU_TENSOR_MAP_SWIZZLE_128B) ||
        !encode_map(maps.scales[s], CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, seg.scales, seg.n, groups, plan.tile_width,
                    plan.stage_groups) ||
        !encode_map(maps.zeros[s], CU_TENSOR_MAP_DATA_TYPE_INT32, 4, seg.qzeros, seg.n / 8, groups, plan.tile_width / 8,
                    plan.stage_groups)) {
      return cudaSuccess;  // not launched: the caller takes another kernel
    }
  }
  auto kernel = p.norm.weight ? int4_tma_kernel<T, true> : int4_tma_kernel<T, false>;
  // The dynamic shared memory limit is per device and kernel: raised once for each (up to 64 devices).
  static std::atomic<uint64_t> raised[2]{};
  const int which = p.norm.weight ? 1 : 0;
  int device = 0;
  cudaGetDevice(&device);
  const uint64_t bit = uint64_t{1} << (device % 64);
  if (!(raised[which].load() & bit)) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kTmaSmem));
    if (err != cudaSuccess) return err;
    raised[which].fetch_or(bit);
  }
  launched = true;
  const dim3 block((plan.col_warps * plan.runs + 2) * 32);  // the consumers, the producer, the finisher
  return launch_pdl(kernel, dim3(static_cast<unsigned>(plan.grid)), block, smem, stream, p, maps, plan);
}

}  // namespace
}  // namespace patcher
