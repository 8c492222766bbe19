// The online-softmax core of decode attention (decode_attention.cu): a block of 8 warps attends up to GMAX query
// heads of one kv head over a share of the keys. Lane groups of D/8 lanes (padded to a power of two) each hold one
// key of a block step as 16-byte vectors; a step scores kUnroll keys per group against the heads (fp32, scores in
// log2 units so that exp2 serves) and folds them into a running softmax per head with one rescale per step. The
// groups merge by shuffles within a warp and through shared memory across warps; with one share the block writes the
// output, otherwise each block writes its partial (max, sum, weighted V) and the last block of the head group to
// finish, found with an atomic counter that it resets, merges the partials. Softmax and the weighted sum are fp32;
// the output is rounded to the dtype once.
#pragma once

#include "attention/params.h"
#include "common/common.cuh"

namespace patcher {

constexpr int kAttnWarps = 8;                  // warps of a block
constexpr int kAttnMaxSplits = 16;             // the last block merges this many partials at once
constexpr float kLog2e = 1.4426950408889634f;  // scores are kept in log2 units, so exp2 (one MUFU op) serves

// A block's lane groups for head dim D, and its keys per step.
template <int D, int GMAX>
struct AttnShape {
  static constexpr int kActive = D / 8;                       // lanes of a group holding 8 dims each
  static constexpr int kLanes = kActive <= 8 ? 8 : 16;        // group size, a power of two for xor shuffles
  static constexpr int kGroups = kAttnWarps * (32 / kLanes);  // keys in flight per block per unrolled position
  static constexpr int kUnroll = GMAX >= 8 ? 2 : 4;           // keys per group per step (register budget)
  static constexpr int kStep = kGroups * kUnroll;             // keys per block step
};

// The shared memory of a block's merges (up to 2 heads of 128 dims).
struct AttnShared {
  float m[kAttnWarps][2], l[kAttnWarps][2];
  float acc[kAttnWarps][2][128];
  float block_max[2], block_sum[2];
  float factor[2][kAttnMaxSplits], share_sum[2][kAttnMaxSplits], denominator[2];
  int last;
};

// Up to this many block steps of keys a (row, kv head) takes one share: the merge of several (partials written, an
// atomic, the last block's reads) costs more than the steps it would spread (docs/decode-fp16.md).
constexpr int kAttnSingleShareSteps = 3;

// The shares a (row, kv head) splits its `count` keys into: at most `splits`, none smaller than a block step, and one
// up to kAttnSingleShareSteps steps, so short contexts do not pay for merging near-empty partials.
template <int D, int GMAX>
__device__ __forceinline__ int attention_shares(int64_t count, int splits) {
  const int64_t wanted = (count + AttnShape<D, GMAX>::kStep - 1) / AttnShape<D, GMAX>::kStep;
  if (wanted <= kAttnSingleShareSteps) return 1;
  return static_cast<int>(wanted < splits ? wanted : splits);
}

// A block's share of the keys start .. last_key of a (row, kv head): keys lo .. hi - 1 of share `split` out of
// `shares` (attention_shares); a block with split >= shares has none.
struct AttnRange {
  int shares;
  int64_t lo, hi;
};

template <int D, int GMAX>
__device__ __forceinline__ AttnRange attention_range(int64_t start, int64_t last_key, int splits, int split) {
  const int64_t count = last_key + 1 - start;
  const int shares = attention_shares<D, GMAX>(count, splits);
  const int64_t chunk = (count + shares - 1) / shares;
  const int64_t lo = start + split * chunk;
  return {shares, lo, lo + chunk < last_key + 1 ? lo + chunk : last_key + 1};
}

// An empty running softmax for each head.
template <int GMAX>
__device__ __forceinline__ void attend_init(float (&m)[GMAX], float (&l)[GMAX], float (&acc)[GMAX][8]) {
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[g][j] = 0.f;
  }
}

// One block step of this lane group: kUnroll keys (kv, vv; `valid` false past the share) folded into the running
// softmax (m, l, acc) of each of the G heads (q already scaled into log2 units).
template <int D, int GMAX>
__device__ __forceinline__ void attend_step(const float (&q)[GMAX][8],
                                            const float (&kv)[AttnShape<D, GMAX>::kUnroll][8],
                                            const float (&vv)[AttnShape<D, GMAX>::kUnroll][8],
                                            const bool (&valid)[AttnShape<D, GMAX>::kUnroll], int G, float (&m)[GMAX],
                                            float (&l)[GMAX], float (&acc)[GMAX][8]) {
  constexpr int kUnroll = AttnShape<D, GMAX>::kUnroll, kLanes = AttnShape<D, GMAX>::kLanes;
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

// The block's result for its share: the lane groups merged (shuffles between lanes holding the same dims), then the
// warps (through S); with one share the G heads' output rows go to `store` (store(i, value) for element i of head0's
// row of [batch, Hq * D], called by every thread of a warp for 32 consecutive i), otherwise the share's partial to
// `partials` (head0's [G][splits][D + 2]) and the last block to arrive at `counter` merges all shares into `store`
// and resets the counter. `sync` is the block's barrier (every thread of the 8 warps).
template <int D, int GMAX, typename Store, typename Sync>
__device__ void attend_finish(AttnShared& S, float (&m)[GMAX], float (&l)[GMAX], float (&acc)[GMAX][8], int G,
                              int shares, int split, int splits, Store store, float* partials, int* counter,
                              Sync sync) {
  constexpr int kActive = AttnShape<D, GMAX>::kActive, kLanes = AttnShape<D, GMAX>::kLanes;
  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const int sub = lane % kLanes, d0 = sub * 8;
  const bool active = sub < kActive;
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
  if (lane < kLanes) {
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      if (g >= G) break;
      if (sub == 0) {
        S.m[warp][g] = m[g];
        S.l[warp][g] = l[g];
      }
      if (active) {
#pragma unroll
        for (int j = 0; j < 8; ++j) S.acc[warp][g][d0 + j] = acc[g][j];
      }
    }
  }
  sync();
  // Each warp's weight in the block's softmax, once per (head, warp): exp2(m_warp - m_block), and the block's sum.
  if (tid < G) {
    const int g = tid;
    float mx = -INFINITY;
#pragma unroll
    for (int r = 0; r < kAttnWarps; ++r) mx = fmaxf(mx, S.m[r][g]);
    float sum = 0.f;
#pragma unroll
    for (int r = 0; r < kAttnWarps; ++r) {
      const float f = S.l[r][g] > 0.f ? exp2f(S.m[r][g] - mx) : 0.f;
      S.l[r][g] *= f;  // the warp's sum, rescaled
      S.m[r][g] = f;   // now the warp's factor
      sum += S.l[r][g];
    }
    S.block_max[g] = mx;
    S.block_sum[g] = sum;
  }
  sync();
  for (int i = tid; i < G * D; i += kAttnWarps * 32) {
    const int g = i / D, d = i % D;
    float weighted = 0.f;
#pragma unroll
    for (int r = 0; r < kAttnWarps; ++r) weighted += S.acc[r][g][d] * S.m[r][g];
    if (shares == 1) {
      store(i, weighted / S.block_sum[g]);
    } else {
      float* part = partials + (static_cast<int64_t>(g) * splits + split) * (D + 2);
      part[d] = weighted;
      if (d == 0) {
        part[D] = S.block_max[g];
        part[D + 1] = S.block_sum[g];
      }
    }
  }
  if (shares == 1) return;

  // The last block of this head group merges the partials of all shares.
  __threadfence();
  sync();
  if (tid == 0) S.last = atomicAdd(counter, 1) == shares - 1;
  sync();
  if (!S.last) return;
  __threadfence();
  for (int i = tid; i < G * shares; i += kAttnWarps * 32) {  // gather each share's max and sum
    const int g = i / shares, s = i % shares;
    const float* part = partials + (static_cast<int64_t>(g) * splits + s) * (D + 2);
    S.factor[g][s] = __ldcg(part + D);
    S.share_sum[g][s] = __ldcg(part + D + 1);
  }
  sync();
  if (tid < G) {  // per head: the global max, each share's weight, the softmax denominator
    const int g = tid;
    float mx = -INFINITY;
    for (int s = 0; s < shares; ++s) mx = fmaxf(mx, S.factor[g][s]);
    float denominator = 0.f;
    for (int s = 0; s < shares; ++s) {
      const float f = S.share_sum[g][s] > 0.f ? exp2f(S.factor[g][s] - mx) : 0.f;
      S.factor[g][s] = f;
      denominator += S.share_sum[g][s] * f;
    }
    S.denominator[g] = denominator;
  }
  sync();
  for (int i = tid; i < G * D; i += kAttnWarps * 32) {
    const int g = i / D, d = i % D;
    const float* part = partials + static_cast<int64_t>(g) * splits * (D + 2) + d;
    float values[kAttnMaxSplits];
#pragma unroll
    for (int s = 0; s < kAttnMaxSplits; ++s) values[s] = s < shares ? __ldcg(part + s * (D + 2)) : 0.f;
    float weighted = 0.f;
#pragma unroll
    for (int s = 0; s < kAttnMaxSplits; ++s) weighted += s < shares ? values[s] * S.factor[g][s] : 0.f;
    store(i, weighted / S.denominator[g]);
  }
  if (tid == 0) *counter = 0;  // ready for the next launch (or layer)
}

}  // namespace patcher
