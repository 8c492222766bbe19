// transformers' sampling warpers and the draw on the m largest scores of each row (sampling/params.h), read from the
// scores themselves:
//
//   select   block c of row b: the m largest of its part of the row, as order-preserving 32-bit keys, into the
//            workspace (select_registers: a threshold, then a rank selection of the few keys above it); the last
//            block of the row to finish (a ticket): the m largest of the parts' candidates, the same way, and:
//   sort the m survivors by id                         (the order the warped scores are kept and drawn in)
//   s = v * (1 / temperature)                          (torch's CUDA division of a tensor by a scalar)
//   top-k:  s < the k-th largest s         -> -inf     (the k-th largest survivor, scaled)
//   top-p:  s sorted ascending, stably; cumulative softmax <= 1 - top_p -> -inf, the largest always kept
//   min-p:  softmax(s) < min_p * its max   -> -inf, the first maximum always kept
//   draw  = softmax(s) / noise                         (its argmax is a draw from softmax(s))
//
// Why: top-k's m = 2 x top_k survivors are all the warpers can keep. As torch ops the step is a float cast of the
// logits, torch.topk over the vocabulary (a multi-pass radix selection and a sort: several kernels) and about a
// dozen small kernels for the warpers, each paying its launch and drain inside the graph; here one kernel, and
// next_token maps the draw's argmax through the sorted ids.
//
// Every softmax follows torch's warp softmax for rows of at most 1024 floats (one warp a row: lane l holds entries
// l, l + 32, ...; a lane's maximum and sum in that order, then a butterfly over the lanes; exp(x - max) / sum), so
// that its probabilities round as torch's do (the tests compare with the torch reference). The cumulative sum of
// top-p is a warp's scan (each lane a run of entries, then across the lanes); torch's scan adds in another order, so
// a token whose cumulative probability lies within rounding of 1 - top_p may go the other way (as between torch on
// the CPU and on the GPU).
#include <cfloat>

#include "common/common.cuh"
#include "sampling/params.h"

namespace patcher {
namespace {

constexpr int kThreads = 256;
constexpr int kPerThread = kSampleSurvivorsPartElems / kThreads;  // a part's scores, in registers
constexpr int kWarps = kThreads / 32;

// A float's key: unsigned order of keys is the order of the floats (NaN with the sign bit clear above +inf, as
// torch.topk ranks NaN first). 0 (a NaN's key) marks "no score" in the selection.
__device__ __forceinline__ uint32_t order_key(float v) {
  const uint32_t u = __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_value(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// The inclusive prefix sum of v over the lanes of a warp, in lane order; every lane calls it.
template <typename T>
__device__ __forceinline__ T warp_inclusive_sum(T v) {
  const int lane = static_cast<int>(threadIdx.x & 31);
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const T other = __shfl_up_sync(0xffffffffu, v, offset);
    if (lane >= offset) v += other;
  }
  return v;
}

constexpr int kCandidatesMax = 512;  // keys at or above the threshold that the rank selection takes

struct SelectScratch {
  int hist[256];
  int sums[kWarps];
  uint32_t digit;
  int before;
  alignas(16) uint32_t maxima[kThreads];  // each thread's largest key (read 16 bytes at a time)
  uint32_t threshold;
  uint32_t candidate_key[kCandidatesMax];
  int candidate_position[kCandidatesMax];
};

// The r-th largest (1 <= r <= the number of nonzero keys) of the keys the block's threads hold, and in `greater`
// how many are larger: a radix selection, 8 bits a pass. `for_keys(f)` calls f(key) on each of the calling
// thread's keys (0 for none).
template <typename ForKeys>
__device__ uint32_t block_select(ForKeys for_keys, int r, SelectScratch& sh, int& greater) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  uint32_t prefix = 0, mask = 0;
  greater = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = static_cast<int>(threadIdx.x); i < 256; i += kThreads) sh.hist[i] = 0;
    __syncthreads();
    for_keys([&](uint32_t key) {
      if (key != 0 && (key & mask) == prefix) atomicAdd(&sh.hist[(key >> shift) & 255u], 1);
    });
    __syncthreads();
    if (threadIdx.x < 32) {  // lane l scans digits 255 - 8l down to 248 - 8l
      int sum = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) sum += sh.hist[255 - 8 * lane - j];
      const int inclusive = warp_inclusive_sum(sum);
      int before = inclusive - sum;
      if (before < r && r <= inclusive) {  // the lane whose digits hold the r-th largest
        int digit = 255 - 8 * lane;
        while (before + sh.hist[digit] < r) before += sh.hist[digit--];
        sh.digit = static_cast<uint32_t>(digit);
        sh.before = before;
      }
    }
    __syncthreads();
    prefix |= sh.digit << shift;
    mask |= 255u << shift;
    r -= sh.before;
    greater += sh.before;
  }
  return prefix;
}

// The exclusive prefix sum of v over the block's threads in thread order; `total`: the sum over all.
__device__ int block_exclusive_sum(int v, SelectScratch& sh, int& total) {
  const int lane = static_cast<int>(threadIdx.x & 31), warp = static_cast<int>(threadIdx.x >> 5);
  const int inclusive = warp_inclusive_sum(v);
  if (lane == 31) sh.sums[warp] = inclusive;
  __syncthreads();
  int offset = 0;
  total = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    offset += w < warp ? sh.sums[w] : 0;
    total += sh.sums[w];
  }
  __syncthreads();  // sh.sums is reused
  return offset + inclusive - v;
}

// Writes the keys above `kth` and the first `need` keys equal to it (in thread order, then each thread's order) to
// put(slot, key, index), slots from 0; `greater` keys are above kth. for_each(f) calls f(key, index) on the calling
// thread's keys, in a fixed order.
template <typename ForEach, typename Put>
__device__ void block_compact(ForEach for_each, uint32_t kth, int greater, int need, SelectScratch& sh, Put put) {
  int above = 0, equal = 0, total = 0;
  for_each([&](uint32_t key, int) {
    above += key > kth;
    equal += key == kth;
  });
  above = block_exclusive_sum(above, sh, total);
  equal = block_exclusive_sum(equal, sh, total);
  for_each([&](uint32_t key, int index) {
    if (key > kth) {
      put(above++, key, index);
    } else if (key == kth) {
      if (equal < need) put(greater + equal, key, index);
      ++equal;
    }
  });
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

// The `take` largest of the keys the block's threads hold in registers (at least `take` of them nonzero), written
// by put(slot, key, j * kThreads + t) for the key in register j of thread t: slots 0 .. take - 1. Which of several
// keys equal to the take-th largest are written is fixed by the keys' places, the same every launch.
//
// A threshold no larger than the take-th largest key: the take-th largest of the threads' maxima (take threads hold
// a key at least that large). Only keys at or above it can be written, and for scores of a vocabulary they are
// few (about 1.1-1.3 x take for normal logits): each of them counts the others above it (its rank). Where more tie
// at the top, the radix selection instead.
template <typename Put>
__device__ void select_registers(const uint32_t (&key)[kPerThread], int take, SelectScratch& sh, Put put) {
  const int tid = static_cast<int>(threadIdx.x);
  uint32_t largest = 0;
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) largest = max(largest, key[j]);
  sh.maxima[tid] = largest;
  if (tid == 0) sh.threshold = 1u;  // key 0 is no score
  __syncthreads();
  if (take <= kThreads) {
    int above = 0, equal = 0;
    for (int k = 0; k < kThreads; k += 4) {
      const uint4 q = *reinterpret_cast<const uint4*>(&sh.maxima[k]);
      above += (q.x > largest) + (q.y > largest) + (q.z > largest) + (q.w > largest);
      equal += (q.x == largest) + (q.y == largest) + (q.z == largest) + (q.w == largest);
    }
    if (above < take && take <= above + equal && largest > 1u) sh.threshold = largest;  // every writer: one value
  }
  __syncthreads();
  const uint32_t threshold = sh.threshold;
  int count = 0;
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) count += key[j] >= threshold;
  int total;
  int at = block_exclusive_sum(count, sh, total);
  if (total <= kCandidatesMax) {
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      if (key[j] >= threshold) {
        sh.candidate_key[at] = key[j];
        sh.candidate_position[at++] = j * kThreads + tid;
      }
    }
    __syncthreads();
    for (int i = tid; i < total; i += kThreads) {
      const uint32_t k = sh.candidate_key[i];
      int rank = 0;
      for (int c = 0; c < total; ++c) {
        const uint32_t other = sh.candidate_key[c];
        rank += other > k || (other == k && c < i);
      }
      if (rank < take) put(rank, k, sh.candidate_position[i]);
    }
    __syncthreads();  // the candidates' space is reused by the next selection
    return;
  }
  int greater;
  const auto mine = [&](auto f) {
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) f(key[j]);
  };
  const uint32_t kth = block_select(mine, take, sh, greater);
  const auto each = [&](auto f) {
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) f(key[j], j * kThreads + tid);
  };
  block_compact(each, kth, greater, take - greater, sh, put);
}

struct WarpScratch {
  float v[kSampleSurvivorsMax];      // the survivors' scores, in the order selected
  int vid[kSampleSurvivorsMax];      // their ids
  float s[kSampleSurvivorsMax];      // the scores in id order, then warped
  int id[kSampleSurvivorsMax];       // the ids in increasing order
  int order[kSampleSurvivorsMax];    // top-p's ascending order: an index into s
  float probs[kSampleSurvivorsMax];  // a softmax
  uint32_t kth_key;                  // top-k's threshold (the smallest score with fewer than k survivors above it)
};

// The warpers and the draw on row b's m survivors in w.v / w.vid; writes the row's outputs. The sorts are rank
// sorts (each entry counts those before it: m compares a thread, one barrier) and the cumulative sum a warp scan.
__device__ void warp_row(const SampleSurvivorsParams& p, int64_t b, int m, WarpScratch& w) {
  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31;
  const bool top_k = p.top_k > 0 && p.top_k < m;
  // Each survivor's place in id order (ids are distinct), and top-k's threshold: the k-th largest is the smallest
  // score with fewer than k scores above it.
  for (int i = tid; i < m; i += kThreads) {
    const int my_id = w.vid[i];
    const float my_v = w.v[i];
    int place = 0, larger = 0;
    for (int j = 0; j < m; ++j) {
      place += w.vid[j] < my_id;
      larger += w.v[j] > my_v;
    }
    w.s[place] = my_v;
    w.id[place] = my_id;
    if (top_k && larger < p.top_k) atomicMin(&w.kth_key, order_key(my_v));
  }
  __syncthreads();
  float kth = -INFINITY;
  if (top_k) {
    kth = key_value(w.kth_key);
    if (p.scale) kth *= p.inv_temperature;
  }
  for (int i = tid; i < m; i += kThreads) {
    float v = w.s[i];
    if (p.scale) v *= p.inv_temperature;
    w.s[i] = v < kth ? -INFINITY : v;
  }
  __syncthreads();

  if (p.top_p_on) {
    // A stable ascending sort of s (equal scores in id order), staged in probs for the softmax.
    for (int i = tid; i < m; i += kThreads) {
      const float x = w.s[i];
      int rank = 0;
      for (int j = 0; j < m; ++j) {
        const float y = w.s[j];
        rank += y < x || (y == x && j < i);
      }
      w.order[rank] = i;
      w.probs[rank] = x;
    }
    __syncthreads();
    if (tid < 32) {
      warp_softmax(w.probs, w.probs, m);
      __syncwarp();
      // The cumulative sum in sorted order: lane l sums a run of entries, a scan over the lanes adds the runs before.
      const int run = (m + 31) / 32, first = min(m, lane * run), end = min(m, first + run);
      float sum = 0.0f;
      for (int j = first; j < end; ++j) sum += w.probs[j];
      float cumulative = warp_inclusive_sum(sum) - sum;
      for (int j = first; j < end; ++j) {
        cumulative += w.probs[j];
        if (j < m - 1 && cumulative <= p.top_p_limit) w.s[w.order[j]] = -INFINITY;  // the largest always kept
      }
    }
    __syncthreads();
  }

  if (p.min_p > 0.0f) {
    if (tid < 32) {
      warp_softmax(w.s, w.probs, m);
      __syncwarp();
      float best = -1.0f;  // the first maximum of the probabilities, always kept
      int first = INT32_MAX;
      for (int i = lane; i < m; i += 32) {
        if (w.probs[i] > best) best = w.probs[i], first = i;
      }
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, best, offset);
        const int at = __shfl_xor_sync(0xffffffffu, first, offset);
        if (other > best || (other == best && at < first)) best = other, first = at;
      }
      const float limit = p.min_p * best;
      for (int i = lane; i < m; i += 32) {
        if (i != first && w.probs[i] < limit) w.s[i] = -INFINITY;
      }
    }
    __syncthreads();
  }

  if (tid < 32) warp_softmax(w.s, w.probs, m);
  __syncthreads();
  for (int i = tid; i < m; i += kThreads) {
    p.warped[b * p.m + i] = w.s[i];
    p.sorted_ids[b * p.m + i] = w.id[i];
    p.draw[b * p.m + i] = w.probs[i] / p.noise[b * p.noise_stride + i];
  }
}

// Grid: (parts, batch). Block (c, b) writes the m largest keys of part c of row b (fewer where the part is shorter;
// key 0 pads) and their indices to the workspace; the row's last block to finish selects and warps the row.
template <typename T>
__global__ void __launch_bounds__(kThreads) sample_survivors_kernel(const SampleSurvivorsParams p) {
  __shared__ SelectScratch sh;
  __shared__ WarpScratch w;
  __shared__ bool last;
  griddep_trigger_at_entry();  // next_token reads nothing before its wait
  griddep_wait();
  const int tid = static_cast<int>(threadIdx.x), c = static_cast<int>(blockIdx.x), parts = static_cast<int>(gridDim.x);
  const int64_t b = blockIdx.y;
  const int m = static_cast<int>(p.m), vocab = static_cast<int>(p.vocab);
  const int per_part = (vocab + parts - 1) / parts, begin = min(vocab, c * per_part);
  const int count = min(vocab, begin + per_part) - begin;
  // workspace: the rows' tickets, then keys [batch][parts][m], then indices [batch][parts][m]
  uint32_t* ticket = p.workspace + b;
  uint32_t* keys = p.workspace + p.batch + b * parts * m;
  int* indices = reinterpret_cast<int*>(p.workspace + p.batch + p.batch * parts * m) + b * parts * m;

  const T* row = static_cast<const T*>(p.scores) + b * p.scores_stride + begin;
  uint32_t key[kPerThread];
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int i = j * kThreads + tid;
    key[j] = i < count ? order_key(to_float(row[i])) : 0u;
  }
  const int take = min(m, count);
  if (take > 0) {
    select_registers(key, take, sh, [&](int slot, uint32_t k, int position) {
      keys[c * m + slot] = k;
      indices[c * m + slot] = begin + position;
    });
  }
  for (int slot = take + tid; slot < m; slot += kThreads) keys[c * m + slot] = 0u;

  __threadfence();  // this block's candidates before its ticket; after the ticket (last block) the others'
  __syncthreads();
  if (tid == 0) {
    last = atomicAdd(ticket, 1u) == static_cast<uint32_t>(parts - 1);
    if (last) {
      __threadfence();
      *ticket = 0u;  // zero for the next launch
    }
    w.kth_key = UINT32_MAX;
  }
  __syncthreads();
  if (!last) return;

  // The row's m largest of its parts' candidates (read from L2, __ldcg: other blocks wrote them): in registers
  // where they fit, as the parts' scores were, else read again each pass.
  const int n = parts * m;
  const auto put = [&](int slot, uint32_t k, int index) {
    w.v[slot] = key_value(k);
    w.vid[slot] = __ldcg(indices + index);
  };
  if (n <= kSampleSurvivorsPartElems) {
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int i = j * kThreads + tid;
      key[j] = i < n ? __ldcg(keys + i) : 0u;
    }
    select_registers(key, m, sh, put);
  } else {
    const auto candidates = [&](auto f) {
      for (int base = 0; base < n; base += kThreads) f(base + tid < n ? __ldcg(keys + base + tid) : 0u);
    };
    int greater;
    const uint32_t kth = block_select(candidates, m, sh, greater);
    const auto each = [&](auto f) {
      for (int i = tid; i < n; i += kThreads) f(__ldcg(keys + i), i);
    };
    block_compact(each, kth, greater, m - greater, sh, put);
  }
  __syncthreads();
  warp_row(p, b, m, w);
}

}  // namespace

cudaError_t launch_sample_survivors(const SampleSurvivorsParams& p, cudaStream_t stream) {
  if (p.batch == 0) return cudaSuccess;
  if (p.m < 1 || p.m > kSampleSurvivorsMax || p.m > p.vocab || p.vocab > kSampleSurvivorsMaxVocab)
    return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(sample_survivors_parts(p.vocab)), static_cast<unsigned>(p.batch));
  PATCHER_DISPATCH_DTYPE(p.dtype, T, {
    return launch_pdl(sample_survivors_kernel<T>, grid, dim3(kThreads), 0, stream, p);
  });
  return cudaSuccess;
}

}  // namespace patcher
