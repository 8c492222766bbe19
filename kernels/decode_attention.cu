// Decode attention over a static KV cache, reading only its filled part (flash-decoding, one kernel).
//
// Grid (splits, kv heads x head groups, batch). A block takes one or two query heads of one kv head (GQA: the
// group's heads, two at a time) of one row, and a contiguous share of the valid keys pad[b] .. slot. The number of
// shares actually used is decided in the kernel from the device-side `slot` (at most `splits`, and no share
// smaller than one block step of keys), so one captured CUDA graph serves every step and context length, and
// short contexts do not pay for merging many near-empty partials. The block's G query heads all use each key it
// loads; the other head groups of the same kv head read the same keys, mostly from L2.
//
// Inside a block, lane groups of D/8 lanes (padded to a power of two) each hold one key as 16-byte vectors. A step
// loads UNROLL keys per group, scores them against the G queries (fp32, scaled by HF's head_dim^-0.5), and folds
// them into a running softmax per head with one rescale per step. Groups are merged with shuffles within a warp and
// through shared memory across warps. With
// one share the block writes the output; otherwise each block writes its partial (max, sum, weighted V) and the
// last block of the (row, head group) to finish, found with an atomic counter that it resets, merges the partials.
// Softmax and the weighted sum are fp32; the output is rounded to the dtype once.
#include "common.cuh"

namespace patcher {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxSplits = 16;  // the last block merges this many partials with all loads in flight at once
constexpr float kLog2e = 1.4426950408889634f;  // scores are kept in log2 units, so exp2 (one MUFU op) serves

template <typename T, int D, int GMAX>
__global__ void __launch_bounds__(kThreads) decode_attention_kernel(const DecodeAttentionParams p) {
  constexpr int kActive = D / 8;                   // lanes of a group holding 8 dims each
  constexpr int kLanes = kActive <= 8 ? 8 : 16;    // group size, a power of two for xor shuffles
  constexpr int kGroups = kWarps * (32 / kLanes);  // keys in flight per block per unrolled position
  constexpr int kUnroll = GMAX >= 8 ? 2 : 4;       // keys per group per step (register budget)
  constexpr int kStep = kGroups * kUnroll;         // keys per block step
  __shared__ float s_m[kWarps][GMAX], s_l[kWarps][GMAX];
  __shared__ float s_acc[kWarps][GMAX][D];
  __shared__ float s_block_max[GMAX], s_block_sum[GMAX];
  __shared__ float s_factor[GMAX][kMaxSplits], s_share_sum[GMAX][kMaxSplits], s_denominator[GMAX];
  __shared__ bool s_last;

  // slot and pad are read before the wait (and the first keys, below): the decode step writes them only between
  // steps (slot) and before the first (pad), never in the kernel just before this one, which is the only one that
  // may still be running.
  // blockIdx.y: kv head and group of up to GMAX of its query heads (G of them in this block)
  const int group_size = static_cast<int>(p.num_q_heads / p.num_kv_heads);
  const int groups = (group_size + GMAX - 1) / GMAX;
  const int b = blockIdx.z, kvh = blockIdx.y / groups, split = blockIdx.x;
  const int first = static_cast<int>(blockIdx.y % groups) * GMAX;  // within the kv head's group
  const int head0 = kvh * group_size + first;                      // first query head of this block
  const int G = group_size - first < GMAX ? group_size - first : GMAX;
  const int64_t last_key = *p.slot, start = p.pad[b];
  const int64_t count = last_key + 1 - start;
  const int64_t wanted = (count + kStep - 1) / kStep;  // at least one block step of keys per share
  const int shares = static_cast<int>(wanted < p.splits ? (wanted > 1 ? wanted : 1) : p.splits);
  if (split >= shares) return;  // this block has no keys at this context length
  const int64_t chunk = (count + shares - 1) / shares;
  const int64_t lo = start + split * chunk;
  const int64_t hi = lo + chunk < last_key + 1 ? lo + chunk : last_key + 1;

  const int lane = threadIdx.x & 31;
  const int sub = lane % kLanes;
  const int group = (threadIdx.x >> 5) * (32 / kLanes) + lane / kLanes;
  const bool active = sub < kActive;
  const int d0 = sub * 8;
  const int64_t head_offset = (static_cast<int64_t>(b) * p.num_kv_heads + kvh) * p.capacity * D;
  const T* k_base = static_cast<const T*>(p.k_cache) + head_offset + d0;
  const T* v_base = static_cast<const T*>(p.v_cache) + head_offset + d0;

  // One block step of keys from `base`: kUnroll keys per lane group, K and V in fp32, zeros past hi; key `skip`
  // is left unloaded.
  float kv[kUnroll][8], vv[kUnroll][8];
  bool valid[kUnroll];
  const auto load_step = [&](int64_t base, int64_t skip) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t t = base + u * kGroups + group;
      valid[u] = t < hi;
      if (valid[u] && active && t != skip) {
        load_vec<T, 8>(kv[u], k_base + t * D);
        load_vec<T, 8>(vv[u], v_base + t * D);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) kv[u][j] = vv[u][j] = 0.f;
      }
    }
  };
  // The first block step is loaded before the wait, except the current token's key and value: the QKV kernel just
  // before this one writes them into the cache at slot, while every earlier key was written by kernels that have
  // finished (a kernel starts early only beside the one just before it, which waited for all earlier ones). At
  // short contexts that is all of the block's keys, and their memory latency overlaps the previous kernel's tail.
  load_step(lo, last_key);
  griddep_wait();
  griddep_launch_dependents();
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    if (lo + u * kGroups + group == last_key && valid[u] && active) {
      load_vec<T, 8>(kv[u], k_base + last_key * D);
      load_vec<T, 8>(vv[u], v_base + last_key * D);
    }
  }

  float q[GMAX][8];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
#pragma unroll
    for (int j = 0; j < 8; ++j) q[g][j] = 0.f;
    if (g < G && active) {
      load_vec<T, 8>(q[g], static_cast<const T*>(p.q) + ((b * p.num_q_heads + head0 + g) * D + d0));
#pragma unroll
      for (int j = 0; j < 8; ++j) q[g][j] *= p.scale * kLog2e;  // scores in log2 units: exp2 below
    }
  }
  float m[GMAX], l[GMAX], acc[GMAX][8];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[g][j] = 0.f;
  }

  // Every lane runs the same number of steps (the shuffles below need the whole warp).
  for (int64_t base = lo; base < hi; base += kStep) {
    if (base != lo) load_step(base, -1);
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      if (g >= G) break;
      float s[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        float dot = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) dot += q[g][j] * kv[u][j];
#pragma unroll
        for (int offset = kLanes / 2; offset > 0; offset >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
        s[u] = valid[u] ? dot : -INFINITY;
      }
      float mx = m[g];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) mx = fmaxf(mx, s[u]);
      if (mx == -INFINITY) continue;         // no key for this group in this step
      const float alpha = exp2f(m[g] - mx);  // 0 while m is still -inf
      l[g] *= alpha;
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[g][j] *= alpha;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const float prob = exp2f(s[u] - mx);  // 0 for an invalid key
        l[g] += prob;
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[g][j] += prob * vv[u][j];
      }
      m[g] = mx;
    }
  }

  // Merge the lane groups of each warp (shuffles between lanes holding the same dims), then the warps.
#pragma unroll
  for (int offset = kLanes; offset < 32; offset <<= 1) {
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      if (g >= G) break;
      const float other_m = __shfl_xor_sync(0xffffffffu, m[g], offset);
      const float other_l = __shfl_xor_sync(0xffffffffu, l[g], offset);
      const float mx = fmaxf(m[g], other_m);
      const float mine = m[g] == -INFINITY ? 0.f : exp2f(m[g] - mx);
      const float theirs = other_m == -INFINITY ? 0.f : exp2f(other_m - mx);
      l[g] = l[g] * mine + other_l * theirs;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float other_acc = __shfl_xor_sync(0xffffffffu, acc[g][j], offset);
        acc[g][j] = acc[g][j] * mine + other_acc * theirs;
      }
      m[g] = mx;
    }
  }
  const int warp = threadIdx.x >> 5;
  if (lane < kLanes) {
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      if (g >= G) break;
      if (sub == 0) {
        s_m[warp][g] = m[g];
        s_l[warp][g] = l[g];
      }
      if (active) {
#pragma unroll
        for (int j = 0; j < 8; ++j) s_acc[warp][g][d0 + j] = acc[g][j];
      }
    }
  }
  __syncthreads();
  // Each warp's weight in the block's softmax, once per (head, warp): exp2(m_warp - m_block), and the block's sum.
  if (threadIdx.x < G) {
    const int g = threadIdx.x;
    float mx = -INFINITY;
#pragma unroll
    for (int r = 0; r < kWarps; ++r) mx = fmaxf(mx, s_m[r][g]);
    float sum = 0.f;
#pragma unroll
    for (int r = 0; r < kWarps; ++r) {
      const float f = s_l[r][g] > 0.f ? exp2f(s_m[r][g] - mx) : 0.f;
      s_l[r][g] *= f;  // the warp's sum, rescaled
      s_m[r][g] = f;   // now the warp's factor
      sum += s_l[r][g];
    }
    s_block_max[g] = mx;
    s_block_sum[g] = sum;
  }
  __syncthreads();
  T* out = static_cast<T*>(p.out) + (static_cast<int64_t>(b) * p.num_q_heads + head0) * D;
  float* partials = p.partials + ((static_cast<int64_t>(b) * p.num_q_heads + head0) * p.splits) * (D + 2);
  for (int i = threadIdx.x; i < G * D; i += kThreads) {
    const int g = i / D, d = i % D;
    float weighted = 0.f;
#pragma unroll
    for (int r = 0; r < kWarps; ++r) weighted += s_acc[r][g][d] * s_m[r][g];
    if (shares == 1) {
      out[i] = from_float<T>(weighted / s_block_sum[g]);
    } else {
      float* part = partials + (static_cast<int64_t>(g) * p.splits + split) * (D + 2);
      part[d] = weighted;
      if (d == 0) {
        part[D] = s_block_max[g];
        part[D + 1] = s_block_sum[g];
      }
    }
  }
  if (shares == 1) return;

  // The last block of this (row, kv head) merges the partials of all shares.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int done = atomicAdd(p.counters + b * p.num_q_heads + head0, 1);
    s_last = done == shares - 1;
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  for (int i = threadIdx.x; i < G * shares; i += kThreads) {  // gather each share's max and sum
    const int g = i / shares, s = i % shares;
    const float* part = partials + (static_cast<int64_t>(g) * p.splits + s) * (D + 2);
    s_factor[g][s] = __ldcg(part + D);
    s_share_sum[g][s] = __ldcg(part + D + 1);
  }
  __syncthreads();
  if (threadIdx.x < G) {  // per head: the global max, each share's weight, the softmax denominator
    const int g = threadIdx.x;
    float mx = -INFINITY;
    for (int s = 0; s < shares; ++s) mx = fmaxf(mx, s_factor[g][s]);
    float denominator = 0.f;
    for (int s = 0; s < shares; ++s) {
      const float f = s_share_sum[g][s] > 0.f ? exp2f(s_factor[g][s] - mx) : 0.f;
      s_factor[g][s] = f;
      denominator += s_share_sum[g][s] * f;
    }
    s_denominator[g] = denominator;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < G * D; i += kThreads) {
    const int g = i / D, d = i % D;
    const float* part = partials + static_cast<int64_t>(g) * p.splits * (D + 2) + d;
    float values[kMaxSplits];
#pragma unroll
    for (int s = 0; s < kMaxSplits; ++s) values[s] = s < shares ? __ldcg(part + s * (D + 2)) : 0.f;
    float weighted = 0.f;
#pragma unroll
    for (int s = 0; s < kMaxSplits; ++s) weighted += s < shares ? values[s] * s_factor[g][s] : 0.f;
    out[i] = from_float<T>(weighted / s_denominator[g]);
  }
  if (threadIdx.x == 0) p.counters[b * p.num_q_heads + head0] = 0;  // ready for the next launch
}

template <typename T, int D>
cudaError_t launch_head_dim(const DecodeAttentionParams& p, cudaStream_t stream) {
  // A block serves at most two query heads of its kv head: with GQA (Llama 4, Qwen2 6 per kv head) more blocks share
  // the keys, so a short context is not a long serial loop over heads in few blocks (Qwen2-1.5B has 2 kv heads);
  // the group's other blocks read the same keys, mostly from L2.
  const int64_t group = p.num_q_heads / p.num_kv_heads;
  const int64_t per_block = group <= 1 ? 1 : 2;
  const dim3 grid(static_cast<unsigned>(p.splits),
                  static_cast<unsigned>(p.num_kv_heads * ((group + per_block - 1) / per_block)),
                  static_cast<unsigned>(p.batch));
  if (per_block == 1) return launch_pdl(decode_attention_kernel<T, D, 1>, grid, kThreads, 0, stream, p);
  return launch_pdl(decode_attention_kernel<T, D, 2>, grid, kThreads, 0, stream, p);
}

}  // namespace

cudaError_t launch_decode_attention(const DecodeAttentionParams& p, cudaStream_t stream) {
  if (p.batch == 0) return cudaSuccess;
  if (p.splits < 1 || p.splits > kMaxSplits || p.num_kv_heads < 1 || p.num_q_heads % p.num_kv_heads)
    return cudaErrorInvalidValue;
  PATCHER_DISPATCH_DTYPE(p.dtype, T, {
    switch (p.head_dim) {
      case 64:
        return launch_head_dim<T, 64>(p, stream);
      case 80:
        return launch_head_dim<T, 80>(p, stream);
      case 128:
        return launch_head_dim<T, 128>(p, stream);
      default:
        return cudaErrorInvalidValue;
    }
  });
  return cudaSuccess;
}

}  // namespace patcher
