// transformers' sampling warpers and the draw on top-k's survivors, one block a row (sampling/params.h):
//
//   sort the m survivors by id                         (the order the warped scores are kept and drawn in)
//   s = v * (1 / temperature)                          (torch's CUDA division of a tensor by a scalar)
//   top-k:  s < the k-th largest s         -> -inf     (the k-th largest: the input's k-th value, scaled)
//   top-p:  s sorted ascending, stably; cumulative softmax <= 1 - top_p -> -inf, the largest always kept
//   min-p:  softmax(s) < min_p * its max   -> -inf, the first maximum always kept
//   draw  = softmax(s) / noise                         (its argmax is a draw from softmax(s))
//
// Why: as torch ops these are about a dozen small kernels a decode step (a sort of the ids, a gather, the division,
// a top-k, the mask, a sort, softmax, cumsum, the compare, a scatter, the fill, softmax and the division of the draw,
// then a scatter into the vocabulary), each paying its launch and drain inside the graph; here one kernel, and
// next_token maps the draw's argmax through the sorted ids.
//
// Every softmax follows torch's warp softmax for rows of at most 1024 floats (one warp a row: lane l holds entries
// l, l + 32, ...; a lane's maximum and sum in that order, then a butterfly over the lanes; exp(x - max) / sum), so
// that its probabilities round as torch's do (the tests compare with the torch reference). The cumulative sum of
// top-p is sequential; torch's scan adds in another order, so a token whose cumulative probability lies within
// rounding of 1 - top_p may go the other way (as between torch on the CPU and on the GPU).
#include <cfloat>

#include "common/common.cuh"
#include "sampling/params.h"

namespace patcher {
namespace {

constexpr int kWarpSurvivorsThreads = 256;

// Ascending bitonic sort of n entries (a power of two) by `less(i, j)`, exchanging with `swap(i, j)`; all threads.
template <typename Less, typename Swap>
__device__ void bitonic_sort(int n, Less less, Swap swap) {
  for (int k = 2; k <= n; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = static_cast<int>(threadIdx.x); i < n; i += static_cast<int>(blockDim.x)) {
        const int l = i ^ j;
        if (l > i && ((i & k) == 0 ? less(l, i) : less(i, l))) swap(i, l);
      }
      __syncthreads();
    }
  }
}

// softmax of x[0 .. m) into out, as torch's warp softmax computes it (above); warp 0 only. out may be x.
__device__ void warp_softmax(const float* x, float* out, int m) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  int width = 1;
  while (width < m) width <<= 1;
  const int lanes = width < 32 ? width : 32, iterations = width / lanes;
  float max_value = -INFINITY;
  if (lane < lanes) {
    max_value = lane < m ? x[lane] : -INFINITY;
    for (int it = 1; it < iterations; ++it) {
      const int i = it * lanes + lane;
      const float v = i < m ? x[i] : -INFINITY;
      max_value = max_value > v ? max_value : v;
    }
  }
  for (int offset = lanes / 2; offset > 0; offset >>= 1) {
    const float other = __shfl_xor_sync(0xffffffffu, max_value, offset);
    max_value = max_value < other ? other : max_value;
  }
  float sum = 0.0f;
  if (lane < lanes) {
    for (int it = 0; it < iterations; ++it) {
      const int i = it * lanes + lane;
      if (i < m) sum += expf(x[i] - max_value);
    }
  }
  for (int offset = lanes / 2; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane < lanes) {
    for (int it = 0; it < iterations; ++it) {
      const int i = it * lanes + lane;
      if (i < m) out[i] = expf(x[i] - max_value) / sum;
    }
  }
}

__global__ void __launch_bounds__(kWarpSurvivorsThreads) warp_survivors_kernel(const WarpSurvivorsParams p) {
  __shared__ float s[kWarpSurvivorsMax];      // the scores, in id order
  __shared__ int64_t id[kWarpSurvivorsMax];   // the ids, then in increasing order
  __shared__ int order[kWarpSurvivorsMax];    // an index into s: the input's order, then top-p's sort
  __shared__ float probs[kWarpSurvivorsMax];  // a softmax
  griddep_trigger_at_entry();                 // next_token reads nothing before its wait
  griddep_wait();
  const int64_t b = blockIdx.x;
  const int m = static_cast<int>(p.m);
  const int tid = static_cast<int>(threadIdx.x), threads = static_cast<int>(blockDim.x);
  int width = 1;
  while (width < m) width <<= 1;

  // The survivors by id: sort (id, input position), the padding past m last.
  for (int i = tid; i < width; i += threads) {
    id[i] = i < m ? p.ids[b * p.ids_stride + i] : INT64_MAX;
    order[i] = i;
  }
  __syncthreads();
  bitonic_sort(
      width, [&](int i, int j) { return id[i] < id[j] || (id[i] == id[j] && order[i] < order[j]); },
      [&](int i, int j) {
        const int64_t t = id[i];
        id[i] = id[j], id[j] = t;
        const int o = order[i];
        order[i] = order[j], order[j] = o;
      });
  const float* values = p.values + b * p.values_stride;
  for (int i = tid; i < m; i += threads) {
    float v = values[order[i]];
    if (p.scale) v *= p.inv_temperature;
    if (p.top_k > 0 && p.top_k < m) {
      float kth = values[p.top_k - 1];  // the input is in descending order, and scaling keeps it
      if (p.scale) kth *= p.inv_temperature;
      if (v < kth) v = -INFINITY;
    }
    s[i] = v;
  }
  __syncthreads();

  if (p.top_p_on) {
    // A stable ascending sort of s: (score, position in id order), the padding past m last.
    for (int i = tid; i < width; i += threads) order[i] = i;
    __syncthreads();
    auto score = [&](int i) { return order[i] < m ? s[order[i]] : INFINITY; };
    bitonic_sort(
        width, [&](int i, int j) { return score(i) < score(j) || (score(i) == score(j) && order[i] < order[j]); },
        [&](int i, int j) {
          const int o = order[i];
          order[i] = order[j], order[j] = o;
        });
    for (int i = tid; i < m; i += threads) probs[i] = s[order[i]];  // the sorted scores (staged for the softmax)
    __syncthreads();
    if (tid < 32) warp_softmax(probs, probs, m);
    __syncthreads();
    if (tid == 0) {
      float cumulative = 0.0f;
      for (int j = 0; j < m - 1; ++j) {  // the last (largest) is always kept
        cumulative += probs[j];
        if (cumulative <= p.top_p_limit) s[order[j]] = -INFINITY;
      }
    }
    __syncthreads();
  }

  if (p.min_p > 0.0f) {
    if (tid < 32) warp_softmax(s, probs, m);
    __syncthreads();
    if (tid == 0) {
      int first = 0;
      for (int i = 1; i < m; ++i) first = probs[i] > probs[first] ? i : first;
      const float limit = p.min_p * probs[first];
      for (int i = 0; i < m; ++i)
        if (i != first && probs[i] < limit) s[i] = -INFINITY;
    }
    __syncthreads();
  }

  if (tid < 32) warp_softmax(s, probs, m);
  __syncthreads();
  for (int i = tid; i < m; i += threads) {
    p.warped[b * p.m + i] = s[i];
    p.sorted_ids[b * p.m + i] = id[i];
    p.draw[b * p.m + i] = probs[i] / p.noise[b * p.noise_stride + i];
  }
}

}  // namespace

cudaError_t launch_warp_survivors(const WarpSurvivorsParams& p, cudaStream_t stream) {
  if (p.batch == 0) return cudaSuccess;
  if (p.m < 1 || p.m > kWarpSurvivorsMax) return cudaErrorInvalidValue;
  return launch_pdl(warp_survivors_kernel, dim3(static_cast<unsigned>(p.batch)), dim3(kWarpSurvivorsThreads), 0, stream,
                    p);
}

}  // namespace patcher
