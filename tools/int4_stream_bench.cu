// Can a persistent grid with a shared-memory ring fed by the bulk copy engine read int4 weights at HBM speed?
// A standalone CUDA program (no torch), the follow-up of int4_read_bench.cu (whose register-prefetch geometry
// caps the reads at 44-56% of HBM). It reads qweight-sized int32 matrices in the checkpoint layout [K/8, N] with
// no dequantization and prints GB/s:
//
//   plain    a grid-stride read of the same bytes, 8 blocks of 256 threads per SM (the standalone ceiling)
//   stream   one or two blocks per SM, each taking an equal run of the matrix's stages (a stage: TR qweight rows of
//            one 128-column tile; stages ordered tile by tile, K fastest). A producer warp issues one bulk copy
//            (cp.async.bulk, 512 bytes) per row of a stage into a ring of S stages, completing on the stage's
//            mbarrier; 8 consumer warps read each stage as the tensor-core kernel reads its chunks (lane 4g + q:
//            row q of a 4-row step, columns 4g .. 4g + 3 of its warp's 32) and release the slot.
//
// Every launch is timed inside a CUDA graph of 50 launches, rotating through enough copies that L2 holds none.
// Build and run on the GPU machine: nvcc -std=c++17 -O3 -arch=sm_90a tools/int4_stream_bench.cu -o /tmp/sb && /tmp/sb
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "../kernels/tma.cuh"  // the mbarrier and copy PTX wrappers the int4 kernel uses
#include "bench_common.cuh"

namespace {

using namespace patcher;
using bench::mix;

constexpr int kTileCols = 128;     // columns of a stage (512 bytes of a qweight row)
constexpr int kConsumerWarps = 8;  // 4 column warps x 2 runs of rows
constexpr int kThreads = 32 * (kConsumerWarps + 1);

// How a stage reaches shared memory: one bulk copy per qweight row (512 bytes each), one 2-D tensor copy of the
// whole stage (a tensor map over [K/8, N]), or one bulk copy of a stage stored contiguously (a repacked layout).
enum Mode { kRows, kTensor, kContiguous };

template <int TR, int S, Mode MODE>
__global__ void __launch_bounds__(kThreads)
    stream_read(const __grid_constant__ CUtensorMap map, const int32_t* __restrict__ qw, int64_t rows, int64_t n,
                int64_t per_block, unsigned* sink) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char ring[];  // [S][TR][kTileCols] int32
  __shared__ uint64_t full[S], empty[S];
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t k_stages = (rows + TR - 1) / TR, total = k_stages * (n / kTileCols);
  const int64_t first = blockIdx.x * per_block, count = first < total ? min(per_block, total - first) : 0;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      bar_init(&full[s], 1);
      bar_init(&empty[s], kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  constexpr int kStageBytes = TR * kTileCols * 4;
  if (warp == kConsumerWarps) {  // the producer
    for (int64_t i = 0; i < count; ++i) {
      const int slot = static_cast<int>(i % S);
      if (i >= S) bar_wait(&empty[slot], static_cast<unsigned>((i / S - 1) & 1));
      const int64_t u = first + i, tile = u / k_stages, row0 = (u % k_stages) * TR;
      const int stage_rows = static_cast<int>(min(static_cast<int64_t>(TR), rows - row0));
      unsigned char* dst = ring + slot * kStageBytes;
      if (MODE == kRows) {
        if (lane == 0) bar_expect(&full[slot], static_cast<unsigned>(stage_rows * kTileCols * 4));
        __syncwarp();
        for (int r = lane; r < stage_rows; r += 32) {
          bulk_copy(dst + r * kTileCols * 4, qw + (row0 + r) * n + tile * kTileCols, kTileCols * 4, &full[slot]);
        }
      } else if (lane == 0) {
        bar_expect(&full[slot], kStageBytes);
        if (MODE == kTensor) {
          tensor_copy(dst, &map, static_cast<int>(tile * kTileCols), static_cast<int>(row0), &full[slot]);
        } else {
          bulk_copy(dst, qw + u * (kStageBytes / 4), kStageBytes, &full[slot]);
        }
      }
    }
    return;
  }
  const int col_warp = warp % 4, run = warp / 4, g = lane / 4, q = lane % 4;
  unsigned acc = 0;
  for (int64_t i = 0; i < count; ++i) {
    const int slot = static_cast<int>(i % S);
    bar_wait(&full[slot], static_cast<unsigned>((i / S) & 1));
    const uint4* stage = reinterpret_cast<const uint4*>(ring + slot * kStageBytes);
#pragma unroll
    for (int s = 0; s < TR / 8; ++s) {
      const int row = run * (TR / 2) + 4 * s + q;
      acc ^= mix(stage[row * (kTileCols / 4) + col_warp * 8 + g]);
    }
    __syncwarp();
    if (lane == 0) bar_arrive(&empty[slot]);
  }
  bench::keep(acc, sink);
#endif
}

#define CHECK(call)                                                                \
  do {                                                                             \
    const cudaError_t e = (call);                                                  \
    if (e != cudaSuccess) {                                                        \
      printf("%s failed: %s (line %d)\n", #call, cudaGetErrorString(e), __LINE__); \
      return -1.f;                                                                 \
    }                                                                              \
  } while (0)

// Mean microseconds of one launch: a graph of 50 launches rotating through the copies, replayed 5 times.
template <typename Launch>
float time_us(const std::vector<int32_t*>& copies, Launch launch) {
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const int iters = 50;
  cudaGraph_t graph;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < iters; ++i) launch(copies[i % copies.size()], stream);
  CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  CHECK(cudaGraphLaunch(exec, stream));  // warm-up
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  CHECK(cudaEventRecord(start, stream));
  for (int r = 0; r < 5; ++r) CHECK(cudaGraphLaunch(exec, stream));
  CHECK(cudaEventRecord(stop, stream));
  CHECK(cudaEventSynchronize(stop));
  float ms = 0.f;
  CHECK(cudaEventElapsedTime(&ms, start, stop));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  return ms * 1000.f / (5 * iters);
}

// A tensor map over qweight [rows, n] int32 with boxes of TR rows x 128 columns.
CUtensorMap tensor_map(const int32_t* qw, int64_t rows, int64_t n, int tr) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  CUtensorMap map{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(n), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(n) * 4};
  const cuuint32_t box[2] = {kTileCols, static_cast<cuuint32_t>(tr)}, elems[2] = {1, 1};
  const CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_INT32, 2, const_cast<int32_t*>(qw), dims, strides, box, elems,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) printf("cuTensorMapEncodeTiled failed: %d\n", static_cast<int>(r));
  return map;
}

template <int TR, int S, Mode MODE>
float time_stream(const std::vector<int32_t*>& copies, int64_t rows, int64_t n, int sms, int per_sm, unsigned* sink) {
  const size_t smem = static_cast<size_t>(S) * TR * kTileCols * 4;
  CHECK(cudaFuncSetAttribute(stream_read<TR, S, MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(smem)));
  const int blocks = sms * per_sm;
  const int64_t total = (rows + TR - 1) / TR * (n / kTileCols), per_block = (total + blocks - 1) / blocks;
  std::vector<CUtensorMap> maps;
  for (const int32_t* c : copies) maps.push_back(tensor_map(c, rows, n, TR));
  return time_us(copies, [&](const int32_t* qw, cudaStream_t st) {
    const size_t i = static_cast<size_t>(std::find(copies.begin(), copies.end(), qw) - copies.begin());
    stream_read<TR, S, MODE><<<blocks, kThreads, smem, st>>>(maps[i], qw, rows, n, per_block, sink);
  });
}

}  // namespace

int main() {
  return bench::for_each_shape(
      [](const bench::Shape& s, const std::vector<int32_t*>& copies, size_t bytes, int sms, unsigned* sink) {
        const int64_t rows = s.k / 8;
        const int plain_blocks = 8 * sms;
        const float plain = time_us(copies, [&](const int32_t* p, cudaStream_t st) {
          bench::plain_read<<<plain_blocks, 256, 0, st>>>(reinterpret_cast<const uint4*>(p), bytes / 16, sink);
        });
        printf("  plain, 8 blocks/SM                    %6.1f us %6.0f GB/s\n", plain, bench::gbs(bytes, plain));
        // Which stage rows x ring stages x blocks per SM reads fastest, for each way a stage is copied.
        struct Variant {
          const char* name;
          float us;
        };
        const Variant variants[] = {
            {"rows   32 x  4 stages, 1/SM", time_stream<32, 4, kRows>(copies, rows, s.n, sms, 1, sink)},
            {"rows   32 x 12 stages, 1/SM", time_stream<32, 12, kRows>(copies, rows, s.n, sms, 1, sink)},
            {"rows   32 x  6 stages, 2/SM", time_stream<32, 6, kRows>(copies, rows, s.n, sms, 2, sink)},
            {"tensor 32 x  4 stages, 1/SM", time_stream<32, 4, kTensor>(copies, rows, s.n, sms, 1, sink)},
            {"tensor 32 x  8 stages, 1/SM", time_stream<32, 8, kTensor>(copies, rows, s.n, sms, 1, sink)},
            {"tensor 32 x 12 stages, 1/SM", time_stream<32, 12, kTensor>(copies, rows, s.n, sms, 1, sink)},
            {"tensor 16 x 12 stages, 1/SM", time_stream<16, 12, kTensor>(copies, rows, s.n, sms, 1, sink)},
            {"tensor 32 x  6 stages, 2/SM", time_stream<32, 6, kTensor>(copies, rows, s.n, sms, 2, sink)},
            {"tensor 64 x  3 stages, 1/SM", time_stream<64, 3, kTensor>(copies, rows, s.n, sms, 1, sink)},
            {"tensor 64 x  6 stages, 1/SM", time_stream<64, 6, kTensor>(copies, rows, s.n, sms, 1, sink)},
            {"contig 32 x  4 stages, 1/SM", time_stream<32, 4, kContiguous>(copies, rows, s.n, sms, 1, sink)},
            {"contig 32 x 12 stages, 1/SM", time_stream<32, 12, kContiguous>(copies, rows, s.n, sms, 1, sink)},
            {"contig 32 x  6 stages, 2/SM", time_stream<32, 6, kContiguous>(copies, rows, s.n, sms, 2, sink)},
        };
        for (const Variant& v : variants)
          printf("  %-36s %6.1f us %6.0f GB/s\n", v.name, v.us, bench::gbs(bytes, v.us));
      });
}
