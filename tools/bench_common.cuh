// What the standalone int4 read benchmarks (int4_read_bench.cu, int4_stream_bench.cu, pdl_probe.cu) share: the qweight
// shapes of the decode ops, the copies that keep a matrix out of L2, the folding of loaded chunks into a sink (so the
// loads are kept), a grid-stride plain read (the standalone ceiling) and the loop over shapes that prints their
// results.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <utility>
#include <vector>

#include "../kernels/common.cuh"  // launch_with_pdl, the kernels' launch under programmatic dependent launch

namespace bench {

__device__ __forceinline__ unsigned mix(uint4 c) { return c.x ^ (c.y * 3u) ^ (c.z * 5u) ^ (c.w * 7u); }

// Keeps a loop's loads: the folded value is stored only if it hits a constant, practically never.
__device__ __forceinline__ void keep(unsigned acc, unsigned* sink) {
  if (acc == 0x12345678u) *sink = acc;
}

__global__ void __launch_bounds__(256) plain_read(const uint4* __restrict__ p, int64_t count, unsigned* sink) {
  unsigned acc = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * 256)
    acc ^= mix(__ldcs(p + i));
  keep(acc, sink);
}

// A lane's first DEPTH chunks (has(s): whether the lane has one at step s; at(s): its address) into w.
template <int DEPTH, typename Has, typename At>
__device__ __forceinline__ void preload_lane(uint4 (&w)[DEPTH], int steps, Has has, At at) {
#pragma unroll
  for (int j = 0; j < DEPTH; ++j) {
    if (j < steps && has(j)) w[j] = __ldcs(at(j));
  }
}

// A lane's steps 0 .. steps - 1, its first DEPTH chunks in w, DEPTH in flight, folded into acc; each chunk is used
// before the next is loaded into its registers (int4_read_bench.cu's header says why).
template <int DEPTH, typename Has, typename At>
__device__ __forceinline__ unsigned stream_lane(uint4 (&w)[DEPTH], int steps, Has has, At at, unsigned acc) {
  for (int s0 = 0; s0 < steps; s0 += DEPTH) {
#pragma unroll
    for (int j = 0; j < DEPTH; ++j) {
      const int s = s0 + j;
      if (s >= steps) break;
      acc ^= mix(w[j]);
      if (s + DEPTH < steps && has(s + DEPTH)) w[j] = __ldcs(at(s + DEPTH));
    }
  }
  return acc;
}

// A decode op's GPTQ qweight: int32 [k / 8, n].
struct Shape {
  const char* name;
  int64_t k, n;
};

constexpr Shape kShapes[] = {
    {"Pythia-2.8B qkv 2560x7680", 2560, 7680},       {"Pythia-2.8B mlp_in 2560x10240", 2560, 10240},
    {"Pythia-2.8B mlp_out 10240x2560", 10240, 2560}, {"Llama-3.1-8B qkv 4096x6144", 4096, 6144},
    {"Llama-3.1-8B o_proj 4096x4096", 4096, 4096},   {"Llama-3.1-8B gate/up 4096x28672", 4096, 28672},
    {"Llama-3.1-8B down 14336x4096", 14336, 4096}};

// For each shape: enough copies of its qweight (400 MB in all, every byte 0x01) that launches rotating through them
// find none in L2, then body(shape, copies, bytes, sms, sink) with the shape's name and size printed first. Returns
// the exit status: 0 when no CUDA call failed.
template <typename Body>
int for_each_shape(Body body) {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  unsigned* sink = nullptr;
  cudaMalloc(&sink, sizeof(unsigned));
  for (const Shape& s : kShapes) {
    const size_t bytes = static_cast<size_t>(s.k / 8 * s.n) * 4;
    std::vector<int32_t*> copies(static_cast<size_t>(400e6 / static_cast<double>(bytes)) + 1);
    for (int32_t*& c : copies) {
      cudaMalloc(&c, bytes);
      cudaMemset(c, 1, bytes);
    }
    printf("%s, %.1f MB\n", s.name, static_cast<double>(bytes) / 1e6);
    body(s, copies, bytes, sms, sink);
    for (int32_t* c : copies) cudaFree(c);
  }
  cudaFree(sink);
  const cudaError_t err = cudaGetLastError();
  printf("%s\n", cudaGetErrorString(err));
  return err == cudaSuccess ? 0 : 1;
}

// GB/s of reading `bytes` in `us` microseconds.
inline double gbs(size_t bytes, float us) { return static_cast<double>(bytes) / us / 1e3; }

// 0, or 1 with the error printed after `what`.
inline int check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    return 1;
  }
  return 0;
}

// One link of a chain of kernels captured into a graph (the probes): `pdl` launches it with programmatic stream
// serialization, as the decode step does (not for a chain's first kernel, which follows a memset in stream order).
// Dynamic shared memory of 100 KB a block, so that at most two blocks share an SM, as the int4 kernels' registers
// allow.
template <typename... KernelArgs, typename... Args>
int launch_link(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, cudaStream_t stream, bool pdl, Args&&... args) {
  return check(patcher::launch_with_pdl(kernel, grid, block, 100 * 1024, stream, pdl, std::forward<Args>(args)...),
               "launch");
}

// Milliseconds a replay of `graph` takes: instantiated, replayed 3 times to warm up, then `replays` times between
// two events. Adds 1 to `err` where a call fails.
inline float replay_ms(cudaGraph_t graph, cudaStream_t stream, int replays, int& err) {
  cudaGraphExec_t exec;
  err |= check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  if (err) return 0.f;
  for (int r = 0; r < 3; ++r) cudaGraphLaunch(exec, stream);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  cudaEventRecord(a, stream);
  for (int r = 0; r < replays; ++r) cudaGraphLaunch(exec, stream);
  cudaEventRecord(b, stream);
  err |= check(cudaStreamSynchronize(stream), "replay");
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaGraphExecDestroy(exec);
  return ms / static_cast<float>(replays);
}

}  // namespace bench
