// Decode attention over a static KV cache, reading only its filled part (flash-decoding, one kernel).
//
// Grid (query heads, batch, splits). A block takes one query head (GQA: the heads of one kv head in blocks side by
// side, reading the same keys, mostly from L2) of one row, and a contiguous share of the valid keys pad[b] .. slot.
// The number of shares actually used is decided in the kernel from the device-side `slot` (at most `splits`, and no
// share smaller than one block step of keys), so one captured CUDA graph serves every step and context length, and
// short contexts do not pay for merging many near-empty partials. (attention.cuh's core takes up to two heads a
// block; launch_head_dim says why this kernel takes one.)
//
// Inside a block, the online softmax of attention.cuh: lane groups hold a key
// each, the scores are fp32 scaled by HF's head_dim^-0.5, one share writes the output, several merge in the last
// block to finish.
//
// Where the QKV projection hands its sums on unmet (int4_norm_gemv_acc into a fixed-point accumulator, so its K
// slices never meet; kFromAcc), this kernel finishes it for the heads it takes: it rounds q and the current token's
// K/V as the projection's epilogue would, applies RoPE and writes K/V into the cache, so the QKV op ends when its
// blocks have added their sums: the decode step's default for LLaMA/Qwen2 int4 (DecodeOptions.defer_qkv;
// docs/decode-int4.md has what it saves). From a projection's finished output (the GGUF GEMV's, whose warps each
// write one output row, so that no epilogue holds a rotation pair; kFromQkv) it does rope_qkv_cache's work the same
// way, in place of that kernel.
#include <type_traits>

#include "attention/attention.cuh"
#include "gguf/gguf_q8_1.cuh"
#include "rope/rope.cuh"

namespace patcher {
namespace {

constexpr int kThreads = kAttnWarps * 32;
constexpr int kMaxSplits = kAttnMaxSplits;
// From this many working blocks (query heads x rows) on, the kernel that finishes the QKV sums is held to 128
// registers a thread (no spills), so that its block fits an SM beside one block of the int4 QKV op before it (two
// 256-thread blocks of 128 registers fill an SM); compiled freely it takes 150-160 and finds room only on an SM that
// op has left. That paid for Llama-3.1-8B's 32 heads and cost for Qwen2-1.5B's 12 (docs/decode-int4.md). The int4
// split rule places these blocks beside the ops next to the attention by the same count (patcher/ops/int4.py:
// Beside).
constexpr int64_t kAttnTwoPerSmHeads = 32;

// Where q and the current token's K/V come from: q itself, the QKV accumulator (DecodeAttentionParams::qkv_acc) or
// the projection's output (qkv).
enum AttnSource { kFromQ, kFromAcc, kFromQkv };
// Where the output goes: out, or a GGUF GEMV's workspace as Q8_1 blocks or fp32 (DecodeAttentionParams::gguf_work).
enum AttnOutput { kToOut, kToGgufQ8_1, kToGgufF32 };

// One element of q or of the current token's K/V, made from the QKV accumulator: round(round(sum) + bias), as
// finish_values forms the projection's output (or from the output: the value itself), then for q and k within the
// rotary dims RoPE (rope.cuh: rope_value) with the partner dim d +- R/2 made the same way. Split in two so that
// everything but the sums (bias, cos/sin: constants; pad: set before the first step) is read before the wait for the
// QKV kernel, and the sums themselves in one batch after it: one round trip (each lane making its own 8 dims of every
// head, with the table loads behind per-dim tests, took ~8 dependent round trips a head).
struct AccElement {
  int64_t at;  // the element's index in the accumulator or output; its partner's is at + partner
  int partner, d, R;
  bool rotated;                      // q or k within the rotary dims
  float bias;                        // the element's bias (0 without one)
  float partner_bias, cos_d, sin_d;  // used only where rotated
};

// Dim d of head `head` of part 0 (q), 1 (k) or 2 (v) of row b.
template <typename T>
__device__ __forceinline__ AccElement acc_element(const DecodeAttentionParams& p, int64_t b, const RopeRow<T>& row,
                                                  int part, int head, int d) {
  const RopeCacheParams& r = p.rope;
  const int D = static_cast<int>(p.head_dim), R = static_cast<int>(r.rotary_dim), half = R / 2;
  const int64_t hq = p.num_q_heads, hkv = p.num_kv_heads, width = (hq + 2 * hkv) * D;
  // The head's first element in the projection's layout (rope.cuh: locate, inverted).
  const int64_t slot = r.interleaved ? head * 3 + part : (part == 0 ? head : (part == 1 ? hq : hq + hkv) + head);
  const int64_t at = b * width + slot * D;
  // Every load is unconditional (indices clamped into range, unused values dropped), so they are all in flight at
  // once.
  const int dr = min(d, max(R, 1) - 1), pd = dr < half ? dr + half : dr - half;  // in the rotary dims; its partner
  const T* bias = static_cast<const T*>(p.qkv_bias);
  AccElement e;
  e.at = at + d;
  e.partner = pd - d;
  e.d = d;
  e.R = R;
  e.rotated = part < 2 && d < R;
  e.bias = bias ? to_float(bias[at + d]) : 0.f;
  e.partner_bias = bias ? to_float(bias[at + pd]) : 0.f;
  e.cos_d = R > 0 ? to_float(row.cos[dr]) : 0.f;
  e.sin_d = R > 0 ? to_float(row.sin[dr]) : 0.f;
  return e;
}

// The element's value from its sum and its partner's (or its and its partner's output values), as loaded.
template <typename T>
__device__ __forceinline__ float made_value(const AccElement& e, bool has_bias, long long sum, long long partner_sum) {
  const auto value = [&](long long v, float bias_value) {
    const float x = round_to<T>(from_fixed(v));
    return has_bias ? round_to<T>(x + bias_value) : x;
  };
  const float x = value(sum, e.bias);
  return e.rotated ? rope_value<T>(x, value(partner_sum, e.partner_bias), e.d, e.R, e.cos_d, e.sin_d) : x;
}
template <typename T>
__device__ __forceinline__ float made_value(const AccElement& e, bool, T value, T partner_value) {
  const float x = to_float(value);
  return e.rotated ? rope_value<T>(x, to_float(partner_value), e.d, e.R, e.cos_d, e.sin_d) : x;
}

template <typename T, int D, int SOURCE, int MINB = 1, int OUTPUT = kToOut>
__global__ void __launch_bounds__(kThreads, MINB) decode_attention_kernel(const DecodeAttentionParams p) {
  constexpr int GMAX = 1, G = 1;  // query heads a block: attention.cuh's core in its one-head form
  constexpr bool MADE = SOURCE != kFromQ;  // q and the current token's K/V made by the block (acc_element)
  // What an element is made from, as loaded: a fixed-point sum or an output value.
  using Raw = std::conditional_t<SOURCE == kFromAcc, long long, T>;
  using Shape = AttnShape<D, GMAX>;
  constexpr int kActive = Shape::kActive, kLanes = Shape::kLanes, kGroups = Shape::kGroups;
  constexpr int kUnroll = Shape::kUnroll, kStep = Shape::kStep;
  __shared__ AttnShared S;

  // slot and pad are read before the wait (and the first keys, below): the decode step writes them only between
  // steps (slot, next_token) and before the first (pad). The kernel just before this one (the QKV projection, or
  // rope_qkv_cache) triggers this launch only after its own wait (feeds_attention, common.cuh), so every kernel
  // before that one, the previous step's next_token included, has completed when this kernel starts.
  // blockIdx.x: query head (of kv head head / group_size); y: row; z: share
  const int group_size = static_cast<int>(p.num_q_heads / p.num_kv_heads);
  const int head = blockIdx.x, b = blockIdx.y, kvh = head / group_size, split = blockIdx.z;
  const bool writes_kv = head % group_size == 0;  // the kv head's first query head writes its K/V into the cache
  const int64_t last_key = *p.slot;
  const AttnRange range = attention_range<D, GMAX>(p.pad[b], last_key, p.splits, split);
  if (split >= range.shares) return;  // this block has no keys at this context length
  const int shares = range.shares;
  const int64_t lo = range.lo, hi = range.hi;

  const int lane = threadIdx.x & 31;
  const int sub = lane % kLanes;
  const int group = (threadIdx.x >> 5) * (32 / kLanes) + lane / kLanes;
  const bool active = sub < kActive;
  const int d0 = sub * 8;
  const int64_t head_offset = (static_cast<int64_t>(b) * p.num_kv_heads + kvh) * p.capacity * D;
  const T* k_base = static_cast<const T*>(p.k_cache) + head_offset + d0;
  const T* v_base = static_cast<const T*>(p.v_cache) + head_offset + d0;

  // One block step of keys from `base`: kUnroll keys per lane group, K and V in fp32, zeros past hi; key `skip`
  // is left unloaded, and from the accumulator the current token's key always (this kernel makes it: put_current).
  float kv[kUnroll][8], vv[kUnroll][8];
  bool valid[kUnroll];
  const auto load_step = [&](int64_t base, int64_t skip) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t t = base + u * kGroups + group;
      valid[u] = t < hi;
      if (valid[u] && active && t != skip && !(MADE && t == last_key)) {
        load_vec<T, 8>(kv[u], k_base + t * D);
        load_vec<T, 8>(vv[u], v_base + t * D);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) kv[u][j] = vv[u][j] = 0.f;
      }
    }
  };
  // q, and the current token's key and value: from p.q and the cache, or (MADE) made by the block from the QKV
  // accumulator or output into shared memory, one element a thread (acc_element: all but the sums read before the
  // wait), then read as the lanes hold them. Only the block that attends over the current token (the share holding
  // slot) makes its K/V; of those, the kv head's first query head's block writes them into the cache.
  constexpr int kMade = ((GMAX + 2) * D + kThreads - 1) / kThreads;  // elements a thread makes, at most
  const bool holds_current = lo <= last_key && last_key < hi;
  const int tid = static_cast<int>(threadIdx.x), count = (holds_current ? G + 2 : G) * D;
  AccElement made_from[MADE ? kMade : 1];
  if constexpr (MADE) {
    const RopeRow<T> row = rope_row<T>(p.rope, last_key, b);
#pragma unroll
    for (int k = 0; k < kMade; ++k) {
      const int i = min(tid + k * kThreads, count - 1);  // clamped: past count, loaded and dropped
      const int m = i / D, d = i % D;                    // m < G: the block's q head; G: k; G + 1: v
      made_from[k] = acc_element<T>(p, b, row, m < G ? 0 : m - G + 1, m < G ? head : kvh, d);
    }
  }
  // The first block step is loaded before the wait, except the current token's key and value: the QKV kernel just
  // before this one writes them into the cache at slot, while every earlier key was written by kernels that have
  // finished (that kernel triggers this launch after its wait, which waited for all earlier ones). At short
  // contexts that is all of the block's keys, and their memory latency overlaps the previous kernel's tail.
  load_step(lo, last_key);
  // The share's next block steps into L2, one bulk prefetch each for K and V: otherwise each comes from HBM after
  // the previous step's arithmetic. At most kAttnSingleShareSteps - 1 of them: all of a one-share context, and of a
  // long one no more than L2 keeps beside the weights streaming through it. The current token's row among them is
  // harmless (L2 is where its write lands).
  if (threadIdx.x == 0 && hi > lo + kStep) {
    const int64_t from = lo + kStep, to = min(hi, from + (kAttnSingleShareSteps - 1) * kStep);
    const uint32_t bytes = static_cast<uint32_t>((to - from) * D * sizeof(T));
    prefetch_l2(static_cast<const T*>(p.k_cache) + head_offset + from * D, bytes);
    prefetch_l2(static_cast<const T*>(p.v_cache) + head_offset + from * D, bytes);
  }
  griddep_wait();
  // After the wait, not at entry: the op after it may be GPT-NeoX's int4 output pair (Int4Params::x2_early), whose
  // blocks that skip their wait read the MLP hidden state that the kernel before this one wrote; triggering here
  // keeps them from starting before that kernel has completed. (A trigger after the key loop lost:
  // docs/decode-int4.md.)
  griddep_launch_dependents();
  float cur_k[8] = {}, cur_v[8] = {};
  __shared__ float made[GMAX + 2][D];  // MADE: q of the block's heads, then K and V
  if constexpr (MADE) {
    const Raw* source = static_cast<const Raw*>(SOURCE == kFromAcc ? static_cast<const void*>(p.qkv_acc) : p.qkv);
    Raw sum[kMade], partner_sum[kMade];
#pragma unroll
    for (int k = 0; k < kMade; ++k) {
      sum[k] = source[made_from[k].at];
      partner_sum[k] = source[made_from[k].at + made_from[k].partner];
    }
#pragma unroll
    for (int k = 0; k < kMade; ++k) {
      const int i = tid + k * kThreads, m = i / D, d = i % D;
      if (i >= count) break;
      const float y = made_value<T>(made_from[k], p.qkv_bias != nullptr, sum[k], partner_sum[k]);
      made[m < G ? m : GMAX + m - G][d] = y;
      if (m >= G && writes_kv) {
        T* cache = static_cast<T*>(m == G ? p.rope.k_cache : p.rope.v_cache);  // p.k_cache/v_cache, writable
        cache[head_offset + last_key * D + d] = from_float<T>(y);
      }
    }
    __syncthreads();
    if (active && holds_current) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        cur_k[j] = made[GMAX][d0 + j];
        cur_v[j] = made[GMAX + 1][d0 + j];
      }
    }
  }
  float q[GMAX][8];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
#pragma unroll
    for (int j = 0; j < 8; ++j) q[g][j] = 0.f;
    if (active) {  // (G == GMAX: the block's one head)
      if constexpr (MADE) {
#pragma unroll
        for (int j = 0; j < 8; ++j) q[g][j] = made[g][d0 + j];
      } else {
        load_vec<T, 8>(q[g], static_cast<const T*>(p.q) + ((b * p.num_q_heads + head) * D + d0));
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) q[g][j] *= p.scale * kLog2e;  // scores in log2 units: exp2 below
    }
  }

  const auto put_current = [&](int64_t base) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * kGroups + group == last_key && valid[u] && active) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          kv[u][j] = cur_k[j];
          vv[u][j] = cur_v[j];
        }
      }
    }
  };
  if constexpr (MADE) {
    put_current(lo);
  } else {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (lo + u * kGroups + group == last_key && valid[u] && active) {
        load_vec<T, 8>(kv[u], k_base + last_key * D);
        load_vec<T, 8>(vv[u], v_base + last_key * D);
      }
    }
  }
  float m[GMAX], l[GMAX], acc[GMAX][8];
  attend_init(m, l, acc);

  // Every lane runs the same number of steps (the shuffles need the whole warp).
  for (int64_t base = lo; base < hi; base += kStep) {
    if (base != lo) {
      load_step(base, -1);
      if constexpr (MADE) put_current(base);
    }
    attend_step<D, GMAX>(q, kv, vv, valid, G, m, l, acc);
  }
  float* partials = p.partials + ((static_cast<int64_t>(b) * p.num_q_heads + head) * p.splits) * (D + 2);
  const auto sync = [] { __syncthreads(); };
  int* counter = p.counters + b * p.num_q_heads + head;
  if constexpr (OUTPUT == kToOut) {
    T* out = static_cast<T*>(p.out) + (static_cast<int64_t>(b) * p.num_q_heads + head) * D;
    const auto store = [out](int i, float v) { out[i] = from_float<T>(v); };
    attend_finish<D, GMAX>(S, m, l, acc, G, shares, split, p.splits, store, partials, counter, sync);
  } else {
    // The value rounded to the dtype, as the GEMV's input kernel would read it from out.
    static_assert(D % 32 == 0, "a Q8_1 block within one head");
    const int64_t k = p.num_q_heads * D, col = static_cast<int64_t>(head) * D;
    const auto store = [&p, b, k, col](int i, float v) {
      store_gguf_input_warp<OUTPUT == kToGgufQ8_1>(p.gguf_work, p.batch, k, b, col + i, round_to<T>(v));
    };
    attend_finish<D, GMAX>(S, m, l, acc, G, shares, split, p.splits, store, partials, counter, sync);
  }
}

template <typename T, int D>
cudaError_t launch_head_dim(const DecodeAttentionParams& p, cudaStream_t stream) {
  // One query head a block, also with GQA (Llama 4, Qwen2 6 heads a kv head): the blocks of a kv head read the same
  // keys, mostly from L2, and each step of a block is half the dependent work of two heads (two heads a block
  // measured slower: docs/decode-int4.md).
  // The share is the slowest index, so the blocks of share 0, which every context has, are dispatched first, and
  // those of the shares a short context leaves empty (which read slot and exit) after them. With the share as the
  // fastest index every head's working block sat behind `splits - 1` empty ones: at 150-200 registers a thread (the
  // kernel that finishes the QKV sums, compiled freely) one block fits an SM, and those blocks find room only where
  // the QKV kernel before has left an SM.
  const dim3 grid(static_cast<unsigned>(p.num_q_heads), static_cast<unsigned>(p.batch),
                  static_cast<unsigned>(p.splits));
  if (p.qkv_acc && p.num_q_heads * p.batch >= kAttnTwoPerSmHeads)
    return launch_pdl(decode_attention_kernel<T, D, kFromAcc, 2>, grid, kThreads, 0, stream, p);
  if (p.qkv_acc) return launch_pdl(decode_attention_kernel<T, D, kFromAcc>, grid, kThreads, 0, stream, p);
  if constexpr (D % 32 == 0) {
    if (p.qkv && p.gguf_work) {
      const auto kernel = p.gguf_a8 ? decode_attention_kernel<T, D, kFromQkv, 1, kToGgufQ8_1>
                                    : decode_attention_kernel<T, D, kFromQkv, 1, kToGgufF32>;
      return launch_pdl(kernel, grid, kThreads, 0, stream, p);
    }
  }
  if (p.gguf_work) return cudaErrorInvalidValue;  // (head_dim 80: a Q8_1 block would span two heads' blocks)
  if (p.qkv) return launch_pdl(decode_attention_kernel<T, D, kFromQkv>, grid, kThreads, 0, stream, p);
  return launch_pdl(decode_attention_kernel<T, D, kFromQ>, grid, kThreads, 0, stream, p);
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
