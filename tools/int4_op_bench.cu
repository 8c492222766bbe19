// The int4 decode ops' kernel (the tensor-core kernel, int4_mma.cuh, as launch_int4_gemv runs it for fp16 at batch
// 1), timed as evals.ops times it but without torch: a CUDA graph of 64 launches, each with programmatic dependent
// launch as in the decode step, cycling over enough copies of the weights that they come from HBM. It builds in
// ~10 s against any copy of kernels/ (-I), so variants of a kernel can be compared in one GPU call; the printed
// out[0] shows whether a variant still computes the same output. Random weights (GPTQ v1, g128), batch 1.
// The ops are the decode step's at Llama-3.1-8B and Pythia-2.8B shapes, with two simplifications: QKV stores its
// output (the step's op applies RoPE and writes the cache), and Pythia's QKV + MLP input runs one LayerNorm
// (the step's op reads a second one for the MLP half). K slices as patcher.ops.int4.splits_for picks them on an
// H100 (132 SMs).
// Build and run on the GPU machine:
//   nvcc -std=c++17 -O3 -arch=sm_90a tools/int4_op_bench.cu -o /tmp/ob -Ikernels && /tmp/ob
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "int4.cu"

namespace patcher {
// The dtype dispatch of int4.cu, reduced to the tensor-core kernel for fp16 (the others are not built here).
cudaError_t launch_int4_gemv_half(const Int4Params& p, cudaStream_t stream) { return launch_mma<__half>(p, stream); }
cudaError_t launch_int4_gemv_bf16(const Int4Params&, cudaStream_t) { return cudaErrorNotSupported; }
cudaError_t launch_int4_gemv_float(const Int4Params&, cudaStream_t) { return cudaErrorNotSupported; }
}  // namespace patcher

namespace {

using patcher::Int4Params;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    exit(1);
  }
}

__device__ uint32_t hash(size_t i, uint32_t seed) {
  uint32_t h = static_cast<uint32_t>(i) * 2654435761u + seed;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  h *= 3266489917u;
  return h ^ (h >> 16);
}

__global__ void fill_words(uint32_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) p[i] = hash(i, seed);
}

// base + step * (0 .. 63), fp16.
__global__ void fill_halves(__half* p, size_t n, float base, float step, uint32_t seed) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    p[i] = __float2half(base + step * static_cast<float>(hash(i, seed) % 64));
}

struct Op {
  const char* name;
  int64_t k;
  std::vector<int64_t> widths;  // segments
  int epilogue;
  int splits;
  bool norm;  // RMSNorm prologue (LayerNorm where `layer_norm`)
  bool layer_norm;
};

constexpr int64_t kGroupSize = 128;
constexpr int kChain = 64, kReplays = 30;

// One op's parameters over freshly allocated random weights; x, the norm weight, out and the workspace shared.
Int4Params make_op(const Op& op, const void* x, const void* norm_weight, void* out, int32_t* workspace, uint32_t seed) {
  using namespace patcher;
  const int64_t rows = op.k / 8, groups = op.k / kGroupSize;
  Int4Params p{};
  p.dtype = DType::kFloat16;
  p.batch = 1;
  p.k = op.k;
  p.num_segments = static_cast<int>(op.widths.size());
  for (int s = 0; s < p.num_segments; ++s) {
    const int64_t n = op.widths[s];
    int32_t *qweight, *qzeros;
    __half* scales;
    check(cudaMalloc(&qweight, rows * n * 4), "malloc");
    check(cudaMalloc(&qzeros, groups * n / 2), "malloc");
    check(cudaMalloc(&scales, groups * n * 2), "malloc");
    fill_words<<<1024, 256>>>(reinterpret_cast<uint32_t*>(qweight), rows * n, seed + 2 * s);
    fill_words<<<256, 256>>>(reinterpret_cast<uint32_t*>(qzeros), groups * n / 8, seed + 2 * s + 1);
    fill_halves<<<256, 256>>>(scales, groups * n, 0.001f, 0.0001f, seed);
    p.seg[s] = Int4Segment{qweight, qzeros, scales, nullptr, nullptr, n};
  }
  p.group_size = kGroupSize;
  p.zero_offset = 1;  // v1 checkpoints store zero - 1
  p.x = x;
  p.x_stride = op.k;
  if (op.norm) {
    p.norm.weight = norm_weight;
    p.norm.eps = 1e-5f;
    p.norm.rms = !op.layer_norm;
  }
  p.epilogue = op.epilogue;
  p.act = kActNone;
  p.out = out;
  p.splits = op.splits;
  p.counters = workspace;
  p.partials = reinterpret_cast<float*>(workspace + kInt4Counters);
  return p;
}

void free_op(const Int4Params& p) {
  for (int s = 0; s < p.num_segments; ++s) {
    cudaFree(const_cast<int32_t*>(p.seg[s].qweight));
    cudaFree(const_cast<int32_t*>(p.seg[s].qzeros));
    cudaFree(const_cast<void*>(p.seg[s].scales));
  }
}

void bench(const Op& op) {
  using namespace patcher;
  int64_t width = 0;
  for (int64_t n : op.widths) width += n;
  const int64_t groups = op.k / kGroupSize;
  const double bytes = static_cast<double>(op.k / 8 * width * 4 + groups * width * 2 + groups * width / 2);
  const int copies = std::max(2, static_cast<int>((360 << 20) / bytes));  // >= 360 MB: none in the 50 MB L2
  __half *x, *norm_weight, *out;
  int32_t* workspace;
  Int4Params sizing{};  // the partials' rows as launch_int4_gemv needs them (int4.cu: int4_partial_rows)
  sizing.splits = op.splits;
  sizing.k = op.k;
  const int64_t workspace_words = kInt4Counters + int4_partial_rows(sizing) * width;  // batch 1
  check(cudaMalloc(&x, op.k * 2), "malloc");
  check(cudaMalloc(&norm_weight, op.k * 2), "malloc");
  check(cudaMalloc(&out, width * 2), "malloc");
  check(cudaMalloc(&workspace, workspace_words * 4), "malloc");
  check(cudaMemset(workspace, 0, workspace_words * 4), "memset");  // the tile counters start at zero
  fill_halves<<<64, 256>>>(x, op.k, -2.f, 0.0625f, 7);
  fill_halves<<<64, 256>>>(norm_weight, op.k, 0.5f, 0.015625f, 9);
  std::vector<Int4Params> params;
  for (int c = 0; c < copies; ++c) params.push_back(make_op(op, x, norm_weight, out, workspace, 11 + 16 * c));

  cudaStream_t stream;
  check(cudaStreamCreate(&stream), "stream");
  check(launch_int4_gemv(params[0], stream), "launch");
  check(cudaStreamSynchronize(stream), "first run");
  cudaGraph_t graph;
  check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "capture");
  for (int i = 0; i < kChain; ++i) check(launch_int4_gemv(params[i % copies], stream), "launch");
  check(cudaStreamEndCapture(stream, &graph), "capture");
  cudaGraphExec_t exec;
  check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  for (int r = 0; r < 3; ++r) check(cudaGraphLaunch(exec, stream), "replay");
  cudaEvent_t start, end;
  cudaEventCreate(&start);
  cudaEventCreate(&end);
  cudaEventRecord(start, stream);
  for (int r = 0; r < kReplays; ++r) check(cudaGraphLaunch(exec, stream), "replay");
  cudaEventRecord(end, stream);
  check(cudaStreamSynchronize(stream), "replay");
  float ms = 0;
  cudaEventElapsedTime(&ms, start, end);
  const double us = 1e3 * ms / kReplays / kChain;
  __half first;
  check(cudaMemcpy(&first, out, 2, cudaMemcpyDeviceToHost), "copy");
  printf("  %-34s %2d slices %7.2f us %6.0f GB/s   out[0] = %g\n", op.name, op.splits, us, bytes / us / 1e3,
         static_cast<double>(__half2float(first)));

  cudaEventDestroy(start);
  cudaEventDestroy(end);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  for (const Int4Params& p : params) free_op(p);
  cudaFree(x);
  cudaFree(norm_weight);
  cudaFree(out);
  cudaFree(workspace);
}

}  // namespace

int main() {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  using patcher::kInt4SiluMul;
  using patcher::kInt4Store;
  const Op ops[] = {
      {"llama-3.1-8b gate/up", 4096, {14336, 14336}, kInt4SiluMul, 1, false, false},
      {"llama-3.1-8b norm + gate/up", 4096, {14336, 14336}, kInt4SiluMul, 1, true, false},
      {"llama-3.1-8b down", 14336, {4096}, kInt4Store, 8, false, false},
      {"llama-3.1-8b o_proj", 4096, {4096}, kInt4Store, 8, false, false},
      {"llama-3.1-8b norm + QKV", 4096, {4096, 1024, 1024}, kInt4Store, 5, true, false},
      {"pythia-2.8b LN + QKV | MLP input", 2560, {7680, 10240}, kInt4Store, 1, true, true},
      {"pythia-2.8b MLP output", 10240, {2560}, kInt4Store, 13, false, false},
  };
  printf("fp16, batch 1, g128, us a launch (graph of %d, %d replays); twice\n", kChain, kReplays);
  for (int round = 0; round < 2; ++round)
    for (const Op& op : ops) bench(op);
  return 0;
}
