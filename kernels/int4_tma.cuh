// The Hopper GPTQ int4 decode kernel: the tensor-core arithmetic of int4_mma.cuh, fed by the bulk tensor copy
// engine (TMA) through a ring of shared-memory stages, in a persistent grid of one block per SM.
//
// Status: off unless PATCHER_INT4_TMA=1, because measured on the H100 it is not faster than int4_mma.cuh (batch 1,
// one machine, `python -m evals.ops --ops int4` with and without the switch: Llama-3.1-8B gate/up 46.1 us against
// 45.0, Pythia fused LN+QKV 17.3 against 15.3, the other ops up to 30% slower; int4 TPOT Pythia-2.8B 2.24 ms against
// 1.95, Llama-3.1-8B 4.76 against 3.80). Where its time goes, measured by switching parts off (throwaway builds, the
// same op table, with the blocks meeting once after the stream instead of inside it): the copy stream alone runs at
// the standalone benchmark's speed (gate/up 22.8 us, 2674 GB/s; Pythia QKV 5.8 us); staging x after
// griddepcontrol.wait adds about 2 us to every op; the arithmetic adds 4 us (Pythia QKV) to 12 us (gate/up): 8
// consumer warps per SM hide too little latency, and the 16-byte chunk reads meet 4-way bank conflicts (ncu: 68% of
// shared wavefronts excessive) since the copy engine writes the 512-byte rows unpadded; meeting the other blocks adds
// 7-10 us, one global round trip after another for each tile a block finishes (inside the stream, as below, the
// same round trips stall the ring instead: measured a little faster than meeting once after it).
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
// the shape. A run crosses tiles: where a block's part of a tile ends, its consumer warps hand their sums to
// finish_tile (int4_tile.cuh) as the split kernels' slices do: partial sums meet in the workspace, one row per block
// that touches the tile, and the last to arrive runs the epilogue; a block that holds a whole tile finishes it
// directly. Meanwhile the producer warp keeps the ring full (4 stages of 16-20 KB).
//
// Block. Warps 0 .. consumers - 1 compute (column warps x runs of the stage's rows, as int4_mma.cuh lays out a step:
// lane 4g + q takes row q of each 4-row step, columns 4g .. 4g + 3 of its warp's 32); the last warp's first lane is
// the producer. x (normalized by the prologue where fused) is staged whole in shared memory before the loop, in the
// mma pair order, since a run may need any part of K.
#pragma once
#include <cuda.h>          // CUtensorMap
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include <atomic>
#include <cstring>

#include "int4_mma.cuh"
#include "tma.cuh"

namespace patcher {
namespace {

constexpr int kTmaRows = 32;              // qweight rows per stage
constexpr int kTmaStageK = 8 * kTmaRows;  // k per stage
constexpr int kTmaMaxStages = 4;          // ring depth (fewer where shared memory runs out)
constexpr int kTmaMaxWarps = 11;          // up to 10 consumer warps and the producer
constexpr int64_t kTmaStageX = 32768;     // batch x K elements of x kept in shared memory (64 KB)
constexpr int64_t kTmaSmem = 225 * 1024;  // dynamic shared memory of one block (Hopper: 227 KB with the static)

struct Int4Maps {  // one tensor map per segment and tensor
  CUtensorMap qweight[kInt4MaxSegments], scales[kInt4MaxSegments], zeros[kInt4MaxSegments];
};

// The launch's shape, as the host works it out (tma_plan) and the kernel reads it.
struct TmaPlan {
  int tile_width, col_warps, runs, stages;
  int stage_groups, group_shift;  // group rows per stage copy; (k within a stage) >> group_shift: its group there
  int tiles, grid;
  int64_t k_stages, per_block;                    // stages per tile; stages per block
  int q_bytes, s_bytes, stage_bytes, copy_bytes;  // a stage: qweight, then scales, then zeros (128-byte aligned)
  int x_offset, x_stride, red_offset;             // x [batch][x_stride] in T; runs' sums, then finished values
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

template <typename T, bool NORM>
__global__ void __launch_bounds__(kTmaMaxWarps * 32, 1)
    int4_tma_kernel(const Int4Params p, const __grid_constant__ Int4Maps maps, const TmaPlan plan) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char ring[];  // the stages, x, the sums (TmaPlan)
  __shared__ uint64_t full[kTmaMaxStages], empty[kTmaMaxStages];
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int consumers = plan.col_warps * plan.runs, S = plan.stages, tw = plan.tile_width;
  const int64_t first = blockIdx.x * plan.per_block;
  const int count = static_cast<int>(min(plan.per_block, plan.k_stages * plan.tiles - first));
  const bool producer = warp == consumers && lane == 0;

  // The producer's position: stage `stage` of tile `tile` goes into slot `slot` (no divisions in the loops).
  int64_t tile = first / plan.k_stages, stage = first % plan.k_stages;
  int slot = 0;
  const auto issue = [&] {  // that stage's qweight rows, then the scales and zero points of its groups
    const TileInfo t = tile_info(p, static_cast<int>(tile), tw);
    const int first_group = static_cast<int>(stage * kTmaStageK / p.group_size);
    unsigned char* dst = ring + slot * plan.stage_bytes;
    const int col = static_cast<int>(t.col0);
    bar_expect(&full[slot], static_cast<unsigned>(plan.copy_bytes));
    tensor_copy(dst, &maps.qweight[t.seg], col, static_cast<int>(stage * kTmaRows), &full[slot]);
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

  T* xs = reinterpret_cast<T*>(ring + plan.x_offset);  // [batch][x_stride], every 8 k in the mma pair order
  const int64_t x_stride = plan.x_stride;
  stage_x<T, NORM>(p, 0, p.k, blockIdx.x == 0, [=](int b, int64_t i, float v) {
    xs[b * x_stride + (i & ~int64_t{7}) + 2 * (i & 3) + ((i >> 2) & 1)] = from_float<T>(v);
  });
  __syncthreads();

  if (warp >= consumers) {  // the producer refills each slot once every consumer warp has released it
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

  const int col_warp = warp % plan.col_warps, run = warp / plan.col_warps, g = lane / 4, q = lane % 4;
  const int warp_col = col_warp * 32, steps = 8 / plan.runs;  // 4-row steps of this warp in each stage
  const int lane_col = warp_col + 4 * g;                      // the lane's first column of the tile
  const Team team{static_cast<int>(threadIdx.x), consumers * 32, 1};
  float* red = reinterpret_cast<float*>(ring + plan.red_offset);
  float acc[2][4] = {};
  tile = first / plan.k_stages;
  stage = first % plan.k_stages;
  slot = 0;
  unsigned phase = 0;
  constexpr int kMaxSteps = 8;  // steps (8 / runs) as a compile-time bound: the loops unroll, the loads go first
  for (int i = 0; i < count; ++i) {
    bar_wait(&full[slot], phase);
    const unsigned char* src = ring + slot * plan.stage_bytes;
    const uint4* qw = reinterpret_cast<const uint4*>(src);                                         // [32][tw / 4]
    const __half* scales = reinterpret_cast<const __half*>(src + plan.q_bytes);                    // [groups][tw]
    const uint32_t* zeros = reinterpret_cast<const uint32_t*>(src + plan.q_bytes + plan.s_bytes);  // [groups][tw/8]
    const T* x_stage = xs + g * x_stride + stage * kTmaStageK;
    uint4 chunk[kMaxSteps], xv[kMaxSteps];
#pragma unroll
    for (int j = 0; j < kMaxSteps; ++j) {
      const int r = (run * steps + j) * 4 + q;  // this lane's row of the stage
      if (j < steps) {
        chunk[j] = qw[r * (tw / 4) + lane_col / 4];
        xv[j] = g < p.batch ? *reinterpret_cast<const uint4*>(x_stage + r * 8) : make_uint4(0, 0, 0, 0);
      }
    }
    int current = -1;  // the group (within the stage) whose parameters d holds
    Dequant d;
#pragma unroll
    for (int j = 0; j < kMaxSteps; ++j) {
      if (j >= steps) break;
      const int group = ((run * steps + j) * 32) >> plan.group_shift;  // a step's 32 k share one group
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
      team.sync();  // the previous tile's finish has read red
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
      finish_tile<T>(p, t, red, plan.runs, tw, stage_runs(p, plan, t, tile), team);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[h][e] = 0.f;
      }
    }
    if (++stage == plan.k_stages) {
      stage = 0;
      ++tile;
    }
  }
#endif
}

// ---- host side ----------------------------------------------------------------------------------------------

// A 2-D tensor map over a row-major [outer, inner] tensor of `elem` bytes per element, boxes of box_outer x
// box_inner. False where the driver rejects it (the op then takes the tensor-core kernel).
inline bool encode_map(CUtensorMap& map, CUtensorMapDataType type, int elem, const void* base, int64_t inner,
                       int64_t outer, int box_inner, int box_outer) {
  static const auto encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      fn = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  if (!encode || !aligned16(base)) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(inner), static_cast<cuuint64_t>(outer)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(inner * elem)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_inner), static_cast<cuuint32_t>(box_outer)};
  const cuuint32_t unit[2] = {1, 1};
  return encode(&map, type, 2, const_cast<void*>(base), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

inline int align128(int64_t bytes) { return static_cast<int>((bytes + 127) / 128 * 128); }

// The launch of an fp16/bf16 op on the TMA kernel, or false where it does not take the op: not asked for
// (PATCHER_INT4_TMA=1) or not a Hopper GPU, act-order, K not whole stages, groups that do not tile a stage (the group
// size must be 32, 64, 128 or 256, or a multiple of 256), widths that are not whole 32-column warps, batch x K over the
// x stage.
template <typename T>
bool tma_plan(const Int4Params& p, TmaPlan& plan, size_t& smem) {
  static const bool enabled = hopper_or_newer() && env_flag("PATCHER_INT4_TMA");
  const int64_t gs = p.group_size, tw = int4_tile_width(p);
  if (!enabled || p.act_order || p.k % kTmaStageK || !(gs % kTmaStageK == 0 || (gs % 32 == 0 && kTmaStageK % gs == 0)))
    return false;
  if (tw % 32 || tw > 256 || p.batch * p.k > kTmaStageX) return false;
  for (int s = 0; s < p.num_segments; ++s) {
    if (p.seg[s].n % 32) return false;  // (qzeros rows must be whole 16 bytes for the copy engine)
  }
  plan.tile_width = static_cast<int>(tw);
  plan.col_warps = plan.tile_width / 32;
  plan.runs = plan.col_warps <= 2 ? 8 / plan.col_warps : (plan.col_warps <= 5 ? 2 : 1);
  if (!norm_fits<T>(p, (plan.col_warps * plan.runs + 1) * 32)) return false;
  plan.stage_groups = gs >= kTmaStageK ? 1 : static_cast<int>(kTmaStageK / gs);
  // Within a stage (k < 256) k >> group_shift is the group counted from the stage's first: log2 of the group sizes
  // that divide 256, and 8 (always group 0) for the multiples of 256.
  plan.group_shift = 8;
  while ((int64_t{1} << plan.group_shift) > gs) --plan.group_shift;
  plan.q_bytes = kTmaRows * plan.tile_width * 4;
  plan.s_bytes = align128(plan.stage_groups * plan.tile_width * 2);
  const int z_bytes = plan.stage_groups * plan.tile_width / 2;
  plan.stage_bytes = plan.q_bytes + plan.s_bytes + align128(z_bytes);
  plan.copy_bytes = plan.q_bytes + plan.stage_groups * plan.tile_width * 2 + z_bytes;
  plan.x_stride = static_cast<int>(p.k + 8);  // 16 bytes of padding: batch rows start in different banks
  const int x_bytes = align128(p.batch * plan.x_stride * static_cast<int64_t>(sizeof(T)));
  const int members = p.epilogue == kInt4SiluMul ? 2 : 1;
  const int red_bytes = (plan.runs + members) * static_cast<int>(p.batch) * plan.tile_width * 4;
  plan.stages = kTmaMaxStages;
  while (plan.stages > 1 && plan.stages * plan.stage_bytes + x_bytes + red_bytes > kTmaSmem) --plan.stages;
  if (plan.stages < 2) return false;
  plan.x_offset = plan.stages * plan.stage_bytes;
  plan.red_offset = plan.x_offset + x_bytes;
  smem = static_cast<size_t>(plan.red_offset + red_bytes);

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
    if (!encode_map(maps.qweight[s], CU_TENSOR_MAP_DATA_TYPE_INT32, 4, seg.qweight, seg.n, rows, plan.tile_width,
                    kTmaRows) ||
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
  int device = 0;
  cudaGetDevice(&device);
  const uint64_t bit = uint64_t{1} << (device % 64);
  if (!(raised[p.norm.weight ? 1 : 0].load() & bit)) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kTmaSmem));
    if (err != cudaSuccess) return err;
    raised[p.norm.weight ? 1 : 0].fetch_or(bit);
  }
  launched = true;
  const dim3 block((plan.col_warps * plan.runs + 1) * 32);
  return launch_pdl(kernel, dim3(static_cast<unsigned>(plan.grid)), block, smem, stream, p, maps, plan);
}

}  // namespace
}  // namespace patcher
