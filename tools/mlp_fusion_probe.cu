// Would Llama-3.1-8B's int4 MLP run faster as one kernel? A standalone CUDA program (no torch) that replays a CUDA
// graph of a chain of MLP layers, each streaming gate/up's and down's qweight (beyond L2) in the int4 kernels'
// geometry with no arithmetic, and prints the time a layer for:
//
//   separate  as the decode step runs it: gate/up (224 blocks of 64 gate + 64 up columns, one K slice), then down
//             under programmatic dependent launch (32 tiles of 128 columns x 8 K slices = 256 blocks, its first
//             chunks loaded before griddepcontrol.wait), each down block adding its 128 sums into a 64-bit fixed-point
//             accumulator (red.global.add.u64), as int4_gemv_acc does
//   fused     one kernel: each gate/up block, once its 64 hidden values would be known, streams the 64 rows of down's
//             weights those values multiply (128 KB, all 4096 columns) and adds its 4096 partial sums into the
//             accumulator: no boundary between gate/up and down, but 224 x 4096 atomic adds a layer instead of 8 x 4096
//   fused, no atomics / atomics only    the two halves of the fused kernel's down part, to see which costs
//
// Each layer's kernels read a value the one before wrote (the x of an op), so the dependencies are real.
// Build and run on the GPU machine: nvcc -std=c++17 -O3 -arch=sm_90a tools/mlp_fusion_probe.cu -o /tmp/mp && /tmp/mp
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "../kernels/common.cuh"  // griddep_wait, griddep_launch_dependents
#include "bench_common.cuh"

namespace {

using patcher::griddep_launch_dependents;
using patcher::griddep_wait;

constexpr int kLayers = 32, kThreads = 256, kDepth = 6;  // the int4 kernels' 256-thread blocks, 6 chunks a lane
constexpr int64_t kHidden = 4096, kInter = 14336;
constexpr int64_t kGateRows = kHidden / 8, kDownRows = kInter / 8;  // qweight rows (8 k a row)
constexpr int kPairs = static_cast<int>(kInter / 64), kDownTiles = static_cast<int>(kHidden / 128), kDownSlices = 8;

enum Mode : int { kSeparate = 0, kFused = 1, kFusedNoAtomics = 2, kFusedAtomicsOnly = 3 };
constexpr const char* kModeNames[] = {"separate", "fused", "fused, no atomics", "fused, atomics only"};

struct Layer {
  const uint4* gate_up;     // gate [512, 14336] then up [512, 14336], int32 words as uint4 chunks
  const uint4* down;        // [1792, 4096]
  const unsigned* in;       // the layer before's output, or nullptr
  unsigned* hidden;         // [kPairs]: the gate/up kernel's output (separate mode)
  unsigned long long* acc;  // [4096]: the layer's fixed-point sums
  unsigned* out;            // [1]: read by the next layer
  int mode;
};

// The gate/up pair tile `pair` in the int4 kernels' geometry: warps 0-1 its 64 gate columns, 2-3 the same 64 up
// columns (4 column warps x 2 runs of rows); lane 4g + q reads row r0 + q, 4 columns from 4g, every 4th row.
__device__ unsigned stream_gate_up(const Layer& l, int pair, unsigned acc) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, run = warp / 4, g = lane / 4, q = lane % 4;
  const int64_t per_run = kGateRows / 2, r0 = run * per_run;
  const int64_t col = pair * 64 + (warp % 2) * 32 + 4 * g;
  const uint4* m = l.gate_up + (warp % 4) / 2 * (kGateRows * kInter / 4);
  const uint4* base = m + ((r0 + q) * kInter + col) / 4;
  const int steps = static_cast<int>(per_run / 4);
  const auto has = [](int) { return true; };
  const auto at = [&](int s) { return base + static_cast<int64_t>(s) * kInter; };  // 4 rows of kInter / 4 chunks
  uint4 w[kDepth] = {};
  bench::preload_lane(w, steps, has, at);
  if (l.in != nullptr) {
    griddep_wait();
    acc ^= l.in[0];
  }
  griddep_launch_dependents();
  return bench::stream_lane(w, steps, has, at, acc);
}

// Separate mode's first kernel: gate/up, its block's value as its hidden output.
__global__ void __launch_bounds__(kThreads, 2) gate_up_kernel(Layer l) {
  const unsigned acc = stream_gate_up(l, blockIdx.x, 0u);
  __shared__ unsigned s;
  if (threadIdx.x == 0) s = 0;
  __syncthreads();
  atomicXor(&s, acc);
  __syncthreads();
  if (threadIdx.x == 0) l.hidden[blockIdx.x] = s;
}

// Separate mode's second kernel: down, tile blockIdx.x (128 columns), K slice blockIdx.y; the block's 128 sums into
// the accumulator; the last layer block (0, 0) writes out.
__global__ void __launch_bounds__(kThreads, 2) down_kernel(Layer l) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, run = warp / 4, g = lane / 4, q = lane % 4;
  const int64_t per_slice = kDownRows / kDownSlices, per_run = per_slice / 2;
  const int64_t r0 = blockIdx.y * per_slice + run * per_run, col = blockIdx.x * 128 + (warp % 4) * 32 + 4 * g;
  const uint4* base = l.down + ((r0 + q) * kHidden + col) / 4;
  const int steps = static_cast<int>(per_run / 4);
  const auto has = [](int) { return true; };
  const auto at = [&](int s) { return base + static_cast<int64_t>(s) * kHidden; };
  uint4 w[kDepth] = {};
  bench::preload_lane(w, steps, has, at);
  griddep_wait();
  griddep_launch_dependents();
  unsigned acc = l.hidden[(blockIdx.y * 28 + threadIdx.x) % kPairs];  // the x stage: hidden values of its slice
  acc = bench::stream_lane(w, steps, has, at, acc);
  __shared__ unsigned sums[kThreads];
  sums[threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.x < 128)  // column c of the tile: the runs' and lanes' values folded, then one add
    atomicAdd(l.acc + blockIdx.x * 128 + threadIdx.x,
              static_cast<unsigned long long>(sums[threadIdx.x] ^ sums[threadIdx.x + 128]));
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) l.out[0] = acc;
}

// The fused kernel: gate/up pair tile blockIdx.x, then the 8 qweight rows of down its 64 hidden values multiply,
// every column: warp w takes columns 512 w .. 512 w + 511 as 16 chunks of 32 columns x 8 rows (two 16-byte loads a
// lane), 8 loads a lane in flight, and adds each chunk's 32 sums into the accumulator.
__global__ void __launch_bounds__(kThreads, 2) fused_kernel(Layer l) {
  unsigned acc = stream_gate_up(l, blockIdx.x, 0u);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, q = lane % 4;  // lane 4g + q: rows q and q + 4 of the chunk, columns 4g .. 4g + 3
  const uint4* rows = l.down + (static_cast<int64_t>(blockIdx.x) * 8 * kHidden) / 4;
  constexpr int kChunks = 16, kAhead = 4;  // chunks a warp; chunks (2 loads each) in flight
  const bool loads = l.mode != kFusedAtomicsOnly, atomics = l.mode != kFusedNoAtomics;
  const auto chunk_at = [&](int c, int half) {
    const int64_t col = warp * 512 + c * 32 + 4 * g;
    return rows + ((q + 4 * half) * kHidden + col) / 4;
  };
  uint4 w[kAhead][2] = {};
  if (loads) {
#pragma unroll
    for (int c = 0; c < kAhead; ++c) w[c][0] = __ldcs(chunk_at(c, 0)), w[c][1] = __ldcs(chunk_at(c, 1));
  }
  __syncthreads();  // where the block's gate/up runs would meet and SwiGLU make the 64 hidden values
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int slot = c % kAhead;
    unsigned v = acc ^ bench::mix(w[slot][0]) ^ bench::mix(w[slot][1]);
    if (loads && c + kAhead < kChunks)
      w[slot][0] = __ldcs(chunk_at(c + kAhead, 0)), w[slot][1] = __ldcs(chunk_at(c + kAhead, 1));
    // the 32 columns' sums: each lane's value folded over the 8 lanes of its columns (q and the two halves)
    v ^= __shfl_xor_sync(0xffffffffu, v, 1);
    v ^= __shfl_xor_sync(0xffffffffu, v, 2);
    if (atomics) atomicAdd(l.acc + warp * 512 + c * 32 + lane, static_cast<unsigned long long>(v));
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) l.out[0] = acc;
}

using bench::check;

// One chain of kLayers layers in `mode`, replayed; prints us a layer.
int run_chain(int mode, const uint4* const (&gate_up)[2], const uint4* const (&down)[2]) {
  unsigned *hidden = nullptr, *outs = nullptr;
  unsigned long long* acc = nullptr;
  int err = check(cudaMalloc(&hidden, sizeof(unsigned) * kPairs * kLayers), "malloc");
  err |= check(cudaMalloc(&outs, sizeof(unsigned) * kLayers), "malloc");
  err |= check(cudaMalloc(&acc, sizeof(unsigned long long) * kHidden * kLayers), "malloc");
  if (err) return err;
  for (const void* k : {reinterpret_cast<const void*>(gate_up_kernel), reinterpret_cast<const void*>(down_kernel),
                        reinterpret_cast<const void*>(fused_kernel)})
    err |= check(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 * 1024), "attribute");
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  cudaGraph_t graph;
  cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal);
  cudaMemsetAsync(acc, 0, sizeof(unsigned long long) * kHidden * kLayers, stream);
  for (int i = 0; i < kLayers; ++i) {
    Layer l{gate_up[i % 2], down[i % 2], i > 0 ? outs + i - 1 : nullptr, hidden + i * kPairs, acc + i * kHidden,
            outs + i,       mode};
    if (mode == kSeparate) {
      err |= bench::launch_link(gate_up_kernel, dim3(kPairs), dim3(kThreads), stream, i > 0, l);
      err |= bench::launch_link(down_kernel, dim3(kDownTiles, kDownSlices), dim3(kThreads), stream, true, l);
    } else {
      err |= bench::launch_link(fused_kernel, dim3(kPairs), dim3(kThreads), stream, i > 0, l);
    }
  }
  err |= check(cudaStreamEndCapture(stream, &graph), "capture");
  if (err) return err;
  const double us = 1e3 * bench::replay_ms(graph, stream, 20, err) / kLayers;
  const double bytes = static_cast<double>(2 * kGateRows * kInter + kDownRows * kHidden) * 4;
  printf("  %-22s %7.2f us a layer (%6.0f GB/s)\n", kModeNames[mode], us, bytes / us / 1e3);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  cudaFree(hidden);
  cudaFree(outs);
  cudaFree(acc);
  return err;
}

}  // namespace

int main() {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  // Two copies of each matrix, alternated over the layers: 176 MB, so no layer finds the one before's bytes in L2.
  const size_t gate_up_bytes = static_cast<size_t>(2 * kGateRows * kInter) * 4;
  const size_t down_bytes = static_cast<size_t>(kDownRows * kHidden) * 4;
  uint4 *gate_up[2] = {}, *down[2] = {};
  int err = 0;
  for (int c = 0; c < 2; ++c) {
    err |= check(cudaMalloc(&gate_up[c], gate_up_bytes), "malloc");
    err |= check(cudaMalloc(&down[c], down_bytes), "malloc");
    if (err) return err;
    cudaMemset(gate_up[c], 1, gate_up_bytes);
    cudaMemset(down[c], 1, down_bytes);
  }
  const uint4* const gu[2] = {gate_up[0], gate_up[1]};
  const uint4* const dn[2] = {down[0], down[1]};
  printf("Llama-3.1-8B MLP qweight (gate/up %.1f MB + down %.1f MB), chain of %d layers\n", gate_up_bytes / 1e6,
         down_bytes / 1e6, kLayers);
  for (int round = 0; round < 2; ++round) {
    for (int mode : {kSeparate, kFused, kFusedNoAtomics, kFusedAtomicsOnly}) err |= run_chain(mode, gu, dn);
  }
  for (int c = 0; c < 2; ++c) cudaFree(gate_up[c]), cudaFree(down[c]);
  return err;
}
