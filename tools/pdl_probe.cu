// What does a kernel boundary cost in the graph-replayed decode step? A standalone CUDA program (no torch) that
// replays a CUDA graph of a chain of N kernels, each streaming its own `bytes` of weights (beyond L2) in the int4
// kernels' geometry (two 256-thread blocks per SM, 8 chunks of 16 bytes in flight a lane, the first 8 loaded before
// the wait), and prints the time per kernel for three ways a kernel can wait for the one before it:
//
//   plain   stream order: a kernel starts when the one before has ended
//   wait    programmatic dependent launch (as the decode step): blocks start while the kernel before is ending,
//           preload, then griddepcontrol.wait (returns once that whole grid has ended and its writes are visible)
//   flag    programmatic dependent launch, but the blocks wait on a counter the kernel before counts up as each of
//           its blocks ends (release/acquire at gpu scope) instead of on the grid's end
//
// and, from a %globaltimer timeline of every block, the median gap between a kernel's last block ending and the
// next kernel's blocks leaving their wait. Every kernel reads a value the one before wrote after its wait (the x of
// an op), so `flag` is a real dependency, not a bound. Then the same chain over Llama-3.1-8B gate/up's qweight
// (58.7 MB) with PDL, in the int4 kernels' geometry (224 blocks of 128-column tiles, 4 column warps x 2 or 3 runs of
// rows, as SwiGLU pairs too) against a contiguous read: the streaming rate the int4 ops could reach.
// Results (H100): evals/results/int4_phase_bounds_f9bd3c5.txt.
// Build and run on the GPU machine: nvcc -std=c++17 -O3 -arch=sm_90a tools/pdl_probe.cu -o /tmp/pp && /tmp/pp
// (`/tmp/pp gate_up`: the gate/up geometries only).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "../kernels/common.cuh"  // griddep_wait, griddep_launch_dependents
#include "bench_common.cuh"

namespace {

using patcher::griddep_launch_dependents;
using patcher::griddep_wait;

enum Mode : int { kPlain = 0, kWait = 1, kFlag = 2 };
constexpr int kChain = 64;
constexpr const char* kModeNames[] = {"plain", "wait", "flag"};

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

struct Link {
  const uint4* weights;  // this kernel's bytes
  int64_t chunks_per_block;
  const unsigned* in;     // the kernel before's output (nullptr for the first)
  unsigned* out;          // [gridDim.x]
  unsigned* done_before;  // the kernel before's counter (flag mode)
  unsigned* done;         // this kernel's counter
  uint64_t* times;        // [gridDim.x][3]: start, past the wait, end
  int mode;
  int64_t rows, n;  // the tiled geometry's qweight [rows, n] int32
  bool pairs;       // tiled as SwiGLU pairs (below)
};

// Where a thread's chunks are: step s at base + s * stride, `steps` of them.
struct Lane {
  const uint4* base;
  int64_t stride;
  int steps;
};

// Contiguous: block b streams its own run of chunks, thread t every THREADS-th. Tiled: the int4 kernels' geometry
// over a qweight [rows, n] (int32): block b the 128-column tile b, as 4 column warps x THREADS / 128 runs of rows;
// in a step lane 4g + q reads the 16-byte chunk of row r0 + q, columns 4g .. 4g + 3 of its warp's 32.
template <int THREADS>
__device__ Lane lane_of(const Link& l, bool tiled) {
  if (!tiled) {
    return {l.weights + blockIdx.x * l.chunks_per_block + threadIdx.x, THREADS,
            static_cast<int>(l.chunks_per_block / THREADS)};
  }
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int run = warp / 4, g = lane / 4, q = lane % 4;
  constexpr int kRuns = THREADS / 128;
  const int64_t per_run = (l.rows + 4 * kRuns - 1) / (4 * kRuns) * 4;
  const int64_t r0 = run * per_run, r1 = min(l.rows, r0 + per_run);
  const int steps = r1 - r0 - q > 0 ? static_cast<int>((r1 - r0 - q + 3) / 4) : 0;
  if (l.pairs) {  // two matrices [rows, n / 2] (gate, up): warps 0-1 the tile's 64 columns of one, 2-3 of the other
    const int64_t half = l.n / 2, col = blockIdx.x * 64 + (warp % 2) * 32 + 4 * g;
    const uint4* m = l.weights + (warp % 4) / 2 * (l.rows * half / 4);
    return {m + ((r0 + q) * half + col) / 4, half, steps};
  }
  const int64_t col = blockIdx.x * 128 + (warp % 4) * 32 + 4 * g;
  return {l.weights + ((r0 + q) * l.n + col) / 4, l.n, steps};
}

template <int THREADS, int DEPTH, bool TILED>
__global__ void __launch_bounds__(THREADS, 2) link_kernel(Link l) {
  const uint64_t t0 = now_ns();
  const Lane me = lane_of<THREADS>(l, TILED);
  const uint4* base = me.base;
  const int steps = me.steps;
  const auto has = [](int) { return true; };
  const auto at = [&](int s) { return base + s * me.stride; };
  uint4 w[DEPTH] = {};
  bench::preload_lane(w, steps, has, at);
  if (l.mode == kFlag) {
    griddep_launch_dependents();
    if (l.in != nullptr && threadIdx.x == 0) {
      unsigned seen = 0;
      do {
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(l.done_before) : "memory");
      } while (seen < gridDim.x);
    }
    __syncthreads();
  } else if (l.mode == kWait) {
    griddep_wait();
    griddep_launch_dependents();
  }
  const uint64_t t1 = now_ns();
  unsigned acc = l.in != nullptr ? l.in[(blockIdx.x * 7) % gridDim.x] : 0u;
  acc = bench::stream_lane(w, steps, has, at, acc);
  // The block's value (thread 0's, which has read the input), then its count at the counter.
  if (threadIdx.x == 0) l.out[blockIdx.x] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    if (l.mode == kFlag) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(l.done) : "memory");
    uint64_t* t = l.times + 3 * blockIdx.x;
    t[0] = t0;
    t[1] = t1;
    t[2] = now_ns();
  }
}

using bench::check;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// How each kernel of a chain reads: `blocks` (0: two an SM) of `threads`, `depth` chunks in flight a lane,
// contiguous runs of `bytes` in all, or tiled over a qweight [rows, n] (runs of rows a block: threads / 128).
struct Geometry {
  int threads, depth, blocks;
  bool tiled;
  int64_t rows, n;
  bool pairs;
};

template <int THREADS, int DEPTH, bool TILED>
void setup(void (*&kernel)(Link)) {
  kernel = link_kernel<THREADS, DEPTH, TILED>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 * 1024);
}

// The kernel for a geometry (the ones main measures), or nullptr.
using KernelFn = void (*)(Link);
KernelFn kernel_for(const Geometry& g) {
  KernelFn k = nullptr;
  if (g.threads == 256 && g.depth == 8) g.tiled ? setup<256, 8, true>(k) : setup<256, 8, false>(k);
  if (g.threads == 384 && g.depth == 4) g.tiled ? setup<384, 4, true>(k) : setup<384, 4, false>(k);
  return k;
}

// One chain of kChain kernels of `bytes` each in `mode`, replayed; prints us per kernel and the median gap.
int run_chain(int mode, size_t bytes, const Geometry& geo, int sms, int32_t* pool, size_t pool_bytes) {
  const int blocks = geo.tiled ? static_cast<int>(geo.n / 128) : (geo.blocks ? geo.blocks : 2 * sms);
  const int threads = geo.threads;
  const KernelFn kernel = kernel_for(geo);
  if (kernel == nullptr) return check(cudaErrorInvalidValue, "geometry");
  // 16-byte chunks a block, in whole steps of the block's threads (at least one); tiled: the matrix over the blocks.
  const int64_t per_block = geo.tiled
                                ? geo.rows * geo.n / 4 / blocks
                                : std::max<int64_t>(1, static_cast<int64_t>(bytes / 16 / blocks) / threads) * threads;
  const int copies = static_cast<int>(pool_bytes / (per_block * blocks * 16));
  unsigned *outs = nullptr, *counters = nullptr;
  uint64_t* times = nullptr;
  int err = check(cudaMalloc(&outs, sizeof(unsigned) * blocks * kChain), "malloc");
  err |= check(cudaMalloc(&counters, sizeof(unsigned) * kChain), "malloc");
  err |= check(cudaMalloc(&times, sizeof(uint64_t) * 3 * blocks * kChain), "malloc");
  if (err) return err;
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  cudaGraph_t graph;
  cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal);
  cudaMemsetAsync(counters, 0, sizeof(unsigned) * kChain, stream);
  for (int i = 0; i < kChain; ++i) {
    Link l;
    l.weights = reinterpret_cast<const uint4*>(pool) + (i % copies) * per_block * blocks;
    l.chunks_per_block = per_block;
    l.in = i > 0 ? outs + (i - 1) * blocks : nullptr;
    l.out = outs + i * blocks;
    l.done_before = i > 0 ? counters + i - 1 : nullptr;
    l.done = counters + i;
    l.times = times + static_cast<int64_t>(i) * 3 * blocks;
    l.mode = mode;
    l.rows = geo.rows;
    l.n = geo.n;
    l.pairs = geo.pairs;
    err |= bench::launch_link(kernel, dim3(blocks), dim3(threads), stream, mode != kPlain && i > 0, l);
  }
  err |= check(cudaStreamEndCapture(stream, &graph), "capture");
  if (err) return err;
  const float ms = bench::replay_ms(graph, stream, 20, err);
  // The timeline of the last replay: for each boundary, the next kernel's median block past its wait minus this
  // kernel's last block end; and each kernel's streaming (median block from its wait to its end).
  std::vector<uint64_t> t(3 * static_cast<size_t>(blocks) * kChain);
  cudaMemcpy(t.data(), times, t.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost);
  std::vector<double> gaps, spans;
  for (int i = 1; i < kChain; ++i) {
    uint64_t last_end = 0;
    std::vector<double> past_wait, span;
    for (int k = 0; k < blocks; ++k) {
      last_end = std::max(last_end, t[(static_cast<size_t>(i - 1) * blocks + k) * 3 + 2]);
      const uint64_t* m = &t[(static_cast<size_t>(i) * blocks + k) * 3];
      past_wait.push_back(static_cast<double>(m[1]));
      span.push_back(static_cast<double>(m[2] - m[1]));
    }
    gaps.push_back(median(past_wait) - static_cast<double>(last_end));
    spans.push_back(median(span));
  }
  const double us = 1e3 * ms / kChain;
  printf(
      "  %-5s %7.2f us a kernel (%6.0f GB/s)   gap, last block end -> next median past wait: %6.2f us   "
      "median block wait->end %6.2f us\n",
      kModeNames[mode], us, static_cast<double>(per_block * blocks * 16) / us / 1e3, median(gaps) / 1e3,
      median(spans) / 1e3);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  cudaFree(outs);
  cudaFree(counters);
  cudaFree(times);
  return err;
}

}  // namespace

int main(int argc, char** argv) {
  const bool gate_up_only = argc > 1 && std::string(argv[1]) == "gate_up";
  setvbuf(stdout, nullptr, _IOLBF, 0);  // each line as it is printed, also into a pipe
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const size_t pool_bytes = size_t{400} << 20;  // the chain rotates through it, so no kernel finds its bytes in L2
  int32_t* pool = nullptr;
  if (check(cudaMalloc(&pool, pool_bytes), "malloc")) return 1;
  cudaMemset(pool, 1, pool_bytes);
  int err = 0;
  const Geometry plain{256, 8, 0, false, 0, 0, false};
  for (const size_t mb : {2, 3, 8, 13, 29, 59}) {
    if (gate_up_only) break;
    printf("%zu MB a kernel, %d blocks of 256 threads, chain of %d\n", mb, 2 * sms, kChain);
    for (int mode : {kPlain, kWait, kFlag}) err |= run_chain(mode, mb << 20, plain, sms, pool, pool_bytes);
  }
  // Llama-3.1-8B gate/up's bytes (qweight 512 x 28672 int32: 224 tiles of 128 columns, one K slice), chained with
  // griddepcontrol.wait: the geometry and block count of the int4 kernels against a contiguous read.
  const int64_t rows = 512, n = 28672;
  const size_t bytes = static_cast<size_t>(rows * n * 4);
  const struct {
    const char* name;
    Geometry g;
  } shapes[] = {{"contiguous, two blocks an SM, 256 threads, 8 deep", {256, 8, 0, false, rows, n, false}},
                {"contiguous, 224 blocks, 256 threads, 8 deep", {256, 8, 224, false, rows, n, false}},
                {"contiguous, 224 blocks, 384 threads, 4 deep", {384, 4, 224, false, rows, n, false}},
                {"tiled, 224 blocks, 256 threads (2 runs), 8 deep", {256, 8, 0, true, rows, n, false}},
                {"tiled, 224 blocks, 384 threads (3 runs), 4 deep", {384, 4, 0, true, rows, n, false}},
                {"tiled as gate/up pairs (64 columns of each), 384 threads, 4 deep", {384, 4, 0, true, rows, n, true}}};
  printf("Llama-3.1-8B gate/up qweight (%.1f MB), chain of %d\n", static_cast<double>(bytes) / 1e6, kChain);
  for (const auto& s : shapes) {
    printf(" %s\n", s.name);
    err |= run_chain(kWait, bytes, s.g, sms, pool, pool_bytes);
  }
  cudaFree(pool);
  return err;
}
