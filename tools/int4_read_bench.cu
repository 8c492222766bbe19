// How fast can the int4 decode kernels' qweight reads alone go? A standalone CUDA program (no torch) that reads
// qweight-sized int32 matrices with no dequantization, in the int4 kernels' launch geometry, and prints GB/s:
//
//   plain       a grid-stride read of the same bytes with 2, 4 and 8 blocks of 256 threads per SM (the ceiling of
//               a standalone launch of this size)
//   row-major   the checkpoint layout qweight [K/8, N]: blocks of 256 threads = 8 warps of 32 columns, grid
//               (N / 256 tiles, splits); in a step lane 4g + q loads the 16-byte chunk of row r0 + q, columns 4g ..
//               4g + 3 of its warp, so a warp step is 4 rows x 128 bytes; DEPTH chunks in flight per lane
//               (int4_mma_kernel's kMmaPreload is 8)
//   tiled       the same work on a column-tiled copy [N/32][K/8][32], where a warp step is 512 contiguous bytes
//   units       the same work with each warp step's 512 bytes contiguous and the steps of all column warps side by
//               side ([K/32][N/32][4][32]); sweep: every warp step in the order the whole grid reads them
//
// Every loop uses a chunk before it loads the next one into the same registers: the other way round the compiler
// kept only 1-2 chunks in flight (int4_mma_kernel's main loop says how), and this benchmark's first tables measured
// that instead of the geometry.
// splits x1 gives the block count and bytes per block that patcher.ops.int4.splits_for picks at batch 1 (one wave of
// two blocks per SM; the real kernels' blocks are 128-column tiles of 4 column warps x 2 runs of K, the same 8 warps
// and bytes); x2 .. x8 give more blocks. Each matrix is read from enough copies to exceed L2.
// Build and run on the GPU machine: nvcc -std=c++17 -O3 -arch=sm_90a tools/int4_read_bench.cu -o /tmp/rb && /tmp/rb
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <vector>

#include "bench_common.cuh"

namespace {

using bench::mix;

// A lane's chunks of steps 0 .. steps - 1 (has(s): whether the lane has one at step s; at(s): its address), DEPTH in
// flight, folded into a checksum.
template <int DEPTH, typename Has, typename At>
__device__ unsigned read_lane(int steps, Has has, At at) {
  uint4 w[DEPTH] = {};
  bench::preload_lane(w, steps, has, at);
  return bench::stream_lane(w, steps, has, at, 0u);
}

template <int DEPTH, bool TILED>
__global__ void __launch_bounds__(256)
    pattern_read(const uint4* __restrict__ qw, int64_t rows, int64_t n, int splits, unsigned* sink) {
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4, q = lane % 4;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * 256 + warp * 32 + 4 * g;
  const int64_t per_split = ((rows + splits - 1) / splits + 3) / 4 * 4;
  const int64_t r_begin = blockIdx.y * per_split;
  const int64_t r_end = r_begin + per_split < rows ? r_begin + per_split : rows;
  const int64_t row0 = r_begin + q;
  // uint4 offsets: the lane's first chunk, and the step between two rows of the lane.
  const uint4* p = TILED ? qw + ((col / 32) * rows * 32 + col % 32) / 4 + row0 * 8 : qw + col / 4 + row0 * (n / 4);
  const int64_t stride = TILED ? 8 : n / 4;
  const int steps = static_cast<int>((r_end - r_begin + 3) / 4);
  const unsigned acc =
      read_lane<DEPTH>(steps, [&](int s) { return row0 + 4 * s < r_end; }, [&](int s) { return p + 4 * s * stride; });
  bench::keep(acc, sink);
}

// The same geometry and work per warp, on a copy laid out for it: in `units` order a warp step's 512 bytes (4 rows x
// 32 columns) are contiguous and the units of one 4-row step lie side by side over all N ([K/32][N/32][4][32]), so
// the warps of all tiles at one step read one contiguous stretch; in `sweep` order the units are in the order the
// launch reads them (step s of global warp w at unit s * warps + w), so that the whole grid reads one contiguous
// window, as the plain read does.
template <int DEPTH, bool SWEEP>
__global__ void __launch_bounds__(256)
    layout_read(const uint4* __restrict__ qw, int64_t rows, int64_t n, int splits, unsigned* sink) {
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t per_split = ((rows + splits - 1) / splits + 3) / 4 * 4;
  const int64_t r_begin = blockIdx.y * per_split;
  const int64_t r_end = r_begin + per_split < rows ? r_begin + per_split : rows;
  const int steps = r_end > r_begin ? static_cast<int>((r_end - r_begin + 3) / 4) : 0;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * gridDim.y * 8;
  const int64_t gw = (static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x) * 8 + warp;
  const int64_t col_warp = static_cast<int64_t>(blockIdx.x) * 8 + warp, units_per_step = n / 32;
  const int64_t count = rows * n / 4;  // uint4 in the matrix
  // uint4 index of step s (within the split) of this lane.
  auto at = [&](int s) -> int64_t {
    const int64_t unit = SWEEP ? s * warps + gw : (r_begin / 4 + s) * units_per_step + col_warp;
    return unit * 32 + lane;
  };
  const unsigned acc = read_lane<DEPTH>(steps, [&](int s) { return at(s) < count; }, [&](int s) { return qw + at(s); });
  bench::keep(acc, sink);
}

// Mean microseconds of one launch over 50, rotating through the copies so that L2 holds none of them.
template <typename Launch>
float time_us(const std::vector<int32_t*>& copies, Launch launch) {
  for (int i = 0; i < 3; ++i) launch(reinterpret_cast<const uint4*>(copies[i % copies.size()]));
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  const int iters = 50;
  cudaEventRecord(start);
  for (int i = 0; i < iters; ++i) launch(reinterpret_cast<const uint4*>(copies[i % copies.size()]));
  cudaEventRecord(stop);
  cudaEventSynchronize(stop);
  float ms = 0.f;
  cudaEventElapsedTime(&ms, start, stop);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms * 1000.f / iters;
}

template <int DEPTH, bool TILED>
float time_pattern(const std::vector<int32_t*>& copies, int64_t rows, int64_t n, int splits, unsigned* sink) {
  const dim3 grid(static_cast<unsigned>(n / 256), static_cast<unsigned>(splits));
  return time_us(copies,
                 [&](const uint4* qw) { pattern_read<DEPTH, TILED><<<grid, 256>>>(qw, rows, n, splits, sink); });
}

template <int DEPTH, bool SWEEP>
float time_layout(const std::vector<int32_t*>& copies, int64_t rows, int64_t n, int splits, unsigned* sink) {
  const dim3 grid(static_cast<unsigned>(n / 256), static_cast<unsigned>(splits));
  return time_us(copies, [&](const uint4* qw) { layout_read<DEPTH, SWEEP><<<grid, 256>>>(qw, rows, n, splits, sink); });
}

}  // namespace

int main() {
  return bench::for_each_shape([](const bench::Shape& s, const std::vector<int32_t*>& copies, size_t bytes, int sms,
                                  unsigned* sink) {
    const int64_t rows = s.k / 8;
    for (int per_sm = 2; per_sm <= 8; per_sm *= 2) {
      const int blocks = per_sm * sms;
      const float us =
          time_us(copies, [&](const uint4* p) { bench::plain_read<<<blocks, 256>>>(p, bytes / 16, sink); });
      printf("  plain, %d blocks/SM             %7.1f us %6.0f GB/s\n", per_sm, us, bench::gbs(bytes, us));
    }
    const int tiles = static_cast<int>(s.n / 256);
    for (int scale = 1; scale <= 8; scale *= 2) {
      int splits = scale * 2 * sms / tiles;
      splits = splits < 1 ? 1 : (splits > rows / 4 ? static_cast<int>(rows / 4) : splits);
      const float t[4] = {time_pattern<8, false>(copies, rows, s.n, splits, sink),
                          time_pattern<4, false>(copies, rows, s.n, splits, sink),
                          time_pattern<8, true>(copies, rows, s.n, splits, sink),
                          time_pattern<4, true>(copies, rows, s.n, splits, sink)};
      printf("  splits x%d (%3d): row-major depth 8 %6.0f GB/s, depth 4 %6.0f | tiled depth 8 %6.0f, depth 4 %6.0f\n",
             scale, splits, bench::gbs(bytes, t[0]), bench::gbs(bytes, t[1]), bench::gbs(bytes, t[2]),
             bench::gbs(bytes, t[3]));
      const float u[4] = {time_layout<8, false>(copies, rows, s.n, splits, sink),
                          time_layout<4, false>(copies, rows, s.n, splits, sink),
                          time_layout<8, true>(copies, rows, s.n, splits, sink),
                          time_layout<4, true>(copies, rows, s.n, splits, sink)};
      printf("  %15s  units     depth 8 %6.0f GB/s, depth 4 %6.0f | sweep depth 8 %6.0f, depth 4 %6.0f\n", "",
             bench::gbs(bytes, u[0]), bench::gbs(bytes, u[1]), bench::gbs(bytes, u[2]), bench::gbs(bytes, u[3]));
    }
  });
}
