// Matrix-vector products for decode: 1 to 8 rows of x against a row-major weight [N, K] (nn.Linear layout),
// with an optional norm prologue and the bias and the MLP activation fused into the epilogue. A template over the
// dtype, included by one .cu file per dtype (gemv_half.cu, gemv_bf16.cu, gemv_float.cu) so that nvcc builds them
// in parallel; the entry point is in gemv.cu.
//
// Bytes: the weight is read once and dominates (x is a few KB and stays in L1/L2), so the kernel is built to keep
// enough 16-byte weight loads in flight to saturate HBM: every warp owns ROWS output rows (2 rows, or 2 gate/up
// row pairs for SwiGLU), each lane streams 16-byte chunks of all of them with UNROLL chunks issued before the
// first is used, and the x chunk it loads serves every row of the warp. Matrices with few rows split K over the
// warps of a block so that every SM has enough warps streaming. Weights are loaded with the streaming cache hint
// (read once, evicted first) so they do not push x out of L1. The kernel is launched with programmatic dependent
// launch, and its first weight loads are issued before it waits for the previous kernel, so they overlap that
// kernel's tail.
//
// Norm prologue (NormPrologue): x is the residual stream; after the wait every block computes the residual sum
// and the norm of each row (from L2: a few KB) into shared memory, and the matrix product reads that. Block 0
// also writes the sum and the second LayerNorm (GPT-NeoX). So the decode step's add + norm kernels disappear:
// the redundant work is a few KB of L2 reads per block, overlapped with the weight loads already in flight.
//
// Grid: at most the blocks the GPU holds at once, each looping over the same number of tiles of rows (spread_grid),
// with the next tile's first weights in flight during the current one's reductions and store. So the prologue runs
// once a resident block rather than once a tile, and no short last wave trails the others.
//
// Accumulation is fp32; a warp reduction finishes each dot product, and lane 0 applies the epilogue with HF's
// rounding points:
//   plain:   out = round(act(round(x.w + b)))     (the act is skipped for kActNone: out = round(x.w + b))
//   SwiGLU:  out = round(round(silu(round(x.w_gate + b_gate))) * round(x.w_up + b_up))
//   RoPE:    the fused QKV projection of a decode step; a warp's two rows are a rotation pair (rope_pair_rows),
//            so lane 0 rounds both (round(x.w + b)), rotates them and writes q or the K/V cache slot, which makes
//            the separate rope_qkv_cache kernel unnecessary
#pragma once
#include <type_traits>

#include "common/common.cuh"
#include "gemv/params.h"
#include "rope/rope.cuh"

namespace patcher {
namespace {

constexpr int kWarps = 4;
constexpr int kRows = 2;  // the output rows a warp owns (its ROWS at every launch)

// One chunk of V weights, loaded raw (converted where it is used, so a chunk in flight costs 16 bytes of registers).
template <typename T, int V>
__device__ __forceinline__ Vec<T, V> load_weights(const T* src) {
  Vec<T, V> v;
  if constexpr (V * sizeof(T) == 16) {
    *reinterpret_cast<uint4*>(&v) = __ldcs(reinterpret_cast<const uint4*>(src));
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) v.data[i] = src[i];
  }
  return v;
}

template <typename T, int V>
__device__ __forceinline__ void load_x(float (&dst)[V], const T* src) {
  if constexpr (V * sizeof(T) == 16) {
    load_vec<T, V>(dst, src);
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) dst[i] = to_float(src[i]);
  }
}

// The weights of one loop iteration: UNROLL chunks of every row, this lane's first one at k0 (chunks step 32 * V
// apart). Chunks at or past k_end are not read (and not used).
template <typename T, int V, int NW, int UNROLL>
__device__ __forceinline__ void fetch_weights(Vec<T, V> (&w)[UNROLL][NW], const T* (&rows)[NW], int64_t k0,
                                              int64_t k_end) {
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const int64_t k = k0 + u * 32 * V;
    if (k < k_end) {
#pragma unroll
      for (int r = 0; r < NW; ++r) w[u][r] = load_weights<T, V>(rows[r] + k);
    }
  }
}

// Where the prologue reads its row(s) and parameters: global memory, or the shared copies of the staged path.
template <typename T>
struct PrologueSource {
  const T *x, *delta, *delta2, *weight, *bias;
  int64_t x_stride, delta_stride, delta2_stride;
};

// Staged path (16-byte vectors): every input of the prologue is copied into shared memory with cp.async, so each
// thread's loads are all in flight at once (one round trip to L2) and the passes below read shared memory. The
// norm's weight and bias are parameters that no kernel writes, so their copies start before the wait and overlap
// the previous kernel's tail; x and the deltas follow the wait. Layout after the [batch][k] x stage (in which x
// is staged): the deltas [batch][k] each, then weight and bias [k] each. Each thread copies and later reads the
// same vectors, so no barrier is needed. gemv_prologue_smem (gemv.cu) sizes it.
template <typename T>
__device__ __forceinline__ PrologueSource<T> staged_source(const GemvParams& p, T* xs) {
  const NormPrologue& n = p.norm;
  T* next = xs + p.batch * p.k;
  PrologueSource<T> src{xs, nullptr, nullptr, nullptr, nullptr, p.k, p.k, p.k};
  if (n.delta) src.delta = next, next += p.batch * p.k;
  if (n.delta2) src.delta2 = next, next += p.batch * p.k;
  src.weight = next;
  if (n.bias) src.bias = next + p.k;
  return src;
}

template <typename T, int V>
__device__ void copy_rows(T* dst, const void* src, int64_t stride, int64_t rows, int64_t k) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t v = threadIdx.x; v < k / V; v += blockDim.x)
      cp_async16(dst + r * k + v * V, static_cast<const T*>(src) + r * stride + v * V);
}

template <typename T, int V>
__device__ void stage_params(const GemvParams& p, const PrologueSource<T>& src) {
  copy_rows<T, V>(const_cast<T*>(src.weight), p.norm.weight, 0, 1, p.k);
  if (src.bias) copy_rows<T, V>(const_cast<T*>(src.bias), p.norm.bias, 0, 1, p.k);
}

template <typename T, int V>
__device__ void stage_rows(const GemvParams& p, const PrologueSource<T>& src) {
  const NormPrologue& n = p.norm;
  copy_rows<T, V>(const_cast<T*>(src.x), p.x, p.x_stride, p.batch, p.k);
  if (n.delta) copy_rows<T, V>(const_cast<T*>(src.delta), n.delta, n.delta_stride, p.batch, p.k);
  if (n.delta2) copy_rows<T, V>(const_cast<T*>(src.delta2), n.delta2, n.delta2_stride, p.batch, p.k);
  cp_async_wait_all();
}

// The norm prologue for any row (misaligned, or longer than the register path holds): h = norm(x [+ delta
// [+ delta2]]) of every row into `xs` [batch][k] (shared memory, in T: the norm's output is rounded to T anyway).
// Pass 1 stages the residual sum there and sums its squares (RMSNorm)
// or its values (LayerNorm); LayerNorm's variance takes a second pass over the staged row (mean first, as exact
// as torch's Welford); the last pass normalizes in place. Each thread re-reads only what it staged itself, so the
// passes need no barrier beyond the reductions'. `writer` (block 0) also stores the sum and the second LayerNorm.
template <typename T, int V>
__device__ void stage_normalized(const GemvParams& p, const PrologueSource<T>& src, T* xs, bool writer) {
  __shared__ float scratch[32];
  const NormPrologue& n = p.norm;
  const int64_t nvec = p.k / V;
  const float inv_k = 1.f / static_cast<float>(p.k);
  const T* weight = src.weight;
  const T* bias = src.bias;
  for (int64_t b = 0; b < p.batch; ++b) {
    const T* x = src.x + b * src.x_stride;
    const T* d = src.delta ? src.delta + b * src.delta_stride : nullptr;
    const T* d2 = src.delta2 ? src.delta2 + b * src.delta2_stride : nullptr;
    T* row = xs + b * p.k;
    float acc = 0.f;
    for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
      float s[V];
      load_vec<T, V>(s, x + v * V);
      if (d) add_residual<T, V>(s, d + v * V, d2 ? d2 + v * V : nullptr);
      store_vec<T, V>(row + v * V, s);  // exact: s is x or a sum already rounded to T
      if (writer && d) store_vec<T, V>(static_cast<T*>(n.sum) + b * p.k + v * V, s);
#pragma unroll
      for (int e = 0; e < V; ++e) acc += n.rms ? s[e] * s[e] : s[e];
    }
    acc = block_sum(acc, scratch);
    const float2 stats = row_stats<T, V>(row, nvec, acc, inv_k, n.eps, n.rms, scratch);
    const float mean = stats.x, rstd = stats.y;
    for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
      float s[V], y[V];
      load_vec<T, V>(s, row + v * V);
      if (writer && n.weight2) {
        const Vec<T, V> w2 = vec_or_zero<T, V>(static_cast<const T*>(n.weight2), v * V);
        const Vec<T, V> b2 = vec_or_zero<T, V>(static_cast<const T*>(n.bias2), v * V);
#pragma unroll
        for (int e = 0; e < V; ++e) y[e] = norm_value<T>(s[e], mean, rstd, w2.data[e], b2.data[e], false);
        store_vec<T, V>(static_cast<T*>(n.h2) + b * p.k + v * V, y);
      }
      const Vec<T, V> w = vec_or_zero<T, V>(weight, v * V), bv = vec_or_zero<T, V>(bias, v * V);
#pragma unroll
      for (int e = 0; e < V; ++e) y[e] = norm_value<T>(s[e], mean, rstd, w.data[e], bv.data[e], n.rms);
      store_vec<T, V>(row + v * V, y);
    }
  }
  __syncthreads();  // the product reads every thread's part of xs
}

// What a warp's rows are and what its epilogue does.
enum RowMode : int {
  kPlainRows = 0,   // rows first, first + 1; act none / gelu / gelu_tanh
  kPairedRows = 1,  // SwiGLU: gate rows first, first + 1 and their up rows n later
  kRopeRows = 2,    // fused QKV: the pair of rope_pair_rows, rotated and stored into q and the KV cache
};

// The rows one warp computes in one tile of the grid: ROWS output rows from `first` (with SwiGLU also their up rows
// n later), and its slice of K (a multiple of V long; the last slice takes the rest).
template <typename T, int V, int ROWS, int MODE, int KSPLIT>
struct WarpRows {
  static constexpr int NW = MODE == kPairedRows ? 2 * ROWS : ROWS;  // weight rows the warp streams
  int64_t first, k_begin, k_end;
  int64_t row_of[ROWS];  // the output rows (past the end: the last row, not stored)
  const T* rows[NW];
  bool live;

  __device__ __forceinline__ WarpRows(const GemvParams& p, int64_t tile, int warp) {
    constexpr int GROUPS = kWarps / KSPLIT;  // row groups per tile
    const int part = warp % KSPLIT;
    first = (tile * GROUPS + warp / KSPLIT) * ROWS;
    live = first < p.n;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) row_of[r] = first + r < p.n ? first + r : p.n - 1;
    if constexpr (MODE == kRopeRows) {
      if (live)
        rope_pair_rows(first / 2, static_cast<int>(p.rope.head_dim), static_cast<int>(p.rope.rotary_dim), row_of);
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      rows[r] = static_cast<const T*>(p.w) + row_of[r] * p.w_stride;
      if (MODE == kPairedRows) rows[ROWS + r] = static_cast<const T*>(p.w) + (row_of[r] + p.n) * p.w_stride;
    }
    const int64_t slice = (p.k / KSPLIT + V - 1) / V * V;
    k_begin = part * slice < p.k ? part * slice : p.k;
    k_end = part == KSPLIT - 1 ? p.k : (k_begin + slice < p.k ? k_begin + slice : p.k);
  }
};

// Lane 0's epilogue for one warp's rows, with HF's rounding points (see the top of this file).
template <typename T, int BMAX, int ROWS, int MODE, int NW>
__device__ __forceinline__ void store_rows(const GemvParams& p, int64_t first, const int64_t (&row_of)[ROWS],
                                           const float (&acc)[NW][BMAX]) {
  const T* bias = static_cast<const T*>(p.bias);
  T* out = static_cast<T*>(p.out);
  if constexpr (MODE == kRopeRows) {  // round as F.linear rounds its output, then rotate and store the pair
#pragma unroll
    for (int b = 0; b < BMAX; ++b) {
      if (b >= p.batch) break;
      float y[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) y[r] = round_to<T>(acc[r][b] + (bias ? to_float(bias[row_of[r]]) : 0.f));
      rope_store_pair<T>(p.rope, b, row_of, y, out);
    }
  } else {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int64_t o = first + r;
      if (o >= p.n) break;
#pragma unroll
      for (int b = 0; b < BMAX; ++b) {
        if (b >= p.batch) break;
        float y;
        if (MODE == kPairedRows) {
          const float gate = round_to<T>(acc[r][b] + (bias ? to_float(bias[o]) : 0.f));
          const float up = round_to<T>(acc[ROWS + r][b] + (bias ? to_float(bias[o + p.n]) : 0.f));
          y = round_to<T>(silu(gate)) * up;
        } else {
          y = acc[r][b] + (bias ? to_float(bias[o]) : 0.f);
          if (p.act != kActNone) y = gelu(round_to<T>(y), p.act == kActGeluTanh);
        }
        out[b * p.n + o] = from_float<T>(y);
      }
    }
  }
}

// The blocks an SM must hold at once (launch bounds): three for SwiGLU without the prologue, so that its bf16 form
// keeps to 168 registers (unbounded, the tile loop's bookkeeping takes it to 175: two blocks an SM); otherwise
// as many registers as the kernel wants.
template <int MODE, bool NORM>
constexpr int kLaunchBlocks = MODE == kPairedRows && !NORM ? 3 : 1;

// Each block has kWarps warps; KSPLIT of them share one group of ROWS output rows, each taking 1/KSPLIT of K
// (more warps in flight for matrices with few rows), and their partial sums meet in shared memory. A tile is
// what one block computes at once: kWarps / KSPLIT row groups. A block loops over tiles blockIdx.x, + gridDim.x, ...
// (launch_kernel sizes the grid), loading the first weights of the next tile before the warp reductions and the
// store of the current one.
// NORM: the norm prologue runs first, and x is read from its shared-memory stage (dynamic shared memory).
template <typename T, int V, int BMAX, int ROWS, int MODE, int UNROLL, int KSPLIT, bool NORM>
__global__ void __launch_bounds__(kWarps * 32, kLaunchBlocks<MODE, NORM>)
    gemv_kernel(const GemvParams p, int64_t tiles) {
  static_assert(MODE != kRopeRows || ROWS == 2, "a RoPE warp computes one rotation pair");
  using Rows = WarpRows<T, V, ROWS, MODE, KSPLIT>;
  constexpr int NW = Rows::NW;
  __shared__ float s_partial[kWarps][NW][BMAX];
  extern __shared__ __align__(16) unsigned char gemv_stage[];
  // The next kernel may launch at once: it reads only constants before its wait. Not so for the QKV projection's
  // RoPE + cache form, whose next kernel is the decode attention (common.cuh, griddep_trigger_after_wait).
  const bool feeds_attention = p.act == kActRopeCache;
  griddep_trigger_at_entry(feeds_attention);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int part = warp % KSPLIT;
  Rows t(p, blockIdx.x, warp);
  // Whole warps leave together (no block barrier without a K split or the prologue). A warp past the end in its
  // first tile is past it in every later one.
  if (KSPLIT == 1 && !NORM && !t.live) return;
  const T* x = static_cast<const T*>(p.x);
  int64_t x_stride = p.x_stride;

  // The first tile's weights are loaded before griddepcontrol.wait: weights are never written by an earlier
  // kernel, so under programmatic dependent launch these loads overlap the previous kernel's tail, which is most
  // of a small matrix's bytes. (An L2 prefetch of more weights here made large matrices slower: each warp's prefetch
  // raced its own loads through L2; registers are read once.) Each iteration then uses its chunks and loads the next
  // iteration's.
  const int64_t step = 32 * V;  // elements one warp-wide load covers
  Vec<T, V> w[UNROLL][NW];
  if (t.live) fetch_weights<T, V, NW, UNROLL>(w, t.rows, t.k_begin + lane * V, t.k_end);
  T* xs = reinterpret_cast<T*>(gemv_stage);  // NORM: the [batch][k] stage of the normalized x
  // The prologue's inputs copied into shared memory first (16-byte vectors, and room for them).
  bool staged = false;
  PrologueSource<T> src{};
  if constexpr (NORM && V > 1) {
    staged = p.stage_inputs;
    if (staged) {
      src = staged_source<T>(p, xs);
      stage_params<T, V>(p, src);
    }
  }
  griddep_wait();
  griddep_trigger_after_wait(feeds_attention);
  if constexpr (NORM) {
    if constexpr (V > 1) {
      if (staged) stage_rows<T, V>(p, src);
    }
    if (!staged) {
      const NormPrologue& n = p.norm;
      src = {static_cast<const T*>(p.x),
             static_cast<const T*>(n.delta),
             static_cast<const T*>(n.delta2),
             static_cast<const T*>(n.weight),
             static_cast<const T*>(n.bias),
             p.x_stride,
             n.delta_stride,
             n.delta2_stride};
    }
    stage_normalized<T, V>(p, src, xs, blockIdx.x == 0);
    if (KSPLIT == 1 && !t.live) return;
    x = xs;
    x_stride = p.k;
  }

  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    float acc[NW][BMAX];
#pragma unroll
    for (int r = 0; r < NW; ++r)
#pragma unroll
      for (int b = 0; b < BMAX; ++b) acc[r][b] = 0.f;
    if (t.live) {
      for (int64_t k0 = t.k_begin + lane * V; k0 < t.k_end; k0 += step * UNROLL) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          const int64_t k = k0 + u * step;
          if (k >= t.k_end) break;
#pragma unroll
          for (int b = 0; b < BMAX; ++b) {
            if (b < p.batch) {
              float xv[V];
              load_x<T, V>(xv, x + b * x_stride + k);
#pragma unroll
              for (int r = 0; r < NW; ++r)
#pragma unroll
                for (int j = 0; j < V; ++j) acc[r][b] += to_float(w[u][r].data[j]) * xv[j];
            }
          }
        }
        fetch_weights<T, V, NW, UNROLL>(w, t.rows, k0 + step * UNROLL, t.k_end);
      }
    }
    // The next tile's rows, and its first weights in flight during this tile's reductions and epilogue.
    Rows next = t;
    const bool more = tile + gridDim.x < tiles;
    if (more) {
      next = Rows(p, tile + gridDim.x, warp);
      if (next.live) fetch_weights<T, V, NW, UNROLL>(w, next.rows, next.k_begin + lane * V, next.k_end);
    }
#pragma unroll
    for (int r = 0; r < NW; ++r)
#pragma unroll
      for (int b = 0; b < BMAX; ++b) acc[r][b] = warp_sum(acc[r][b]);
    if (KSPLIT > 1) {  // add up the K slices of this row group (live is the same for the whole block)
      if (lane == 0) {
#pragma unroll
        for (int r = 0; r < NW; ++r)
#pragma unroll
          for (int b = 0; b < BMAX; ++b) s_partial[warp][r][b] = acc[r][b];
      }
      __syncthreads();
      if (part == 0) {
#pragma unroll
        for (int r = 0; r < NW; ++r)
#pragma unroll
          for (int b = 0; b < BMAX; ++b) {
            float total = 0.f;
#pragma unroll
            for (int q = 0; q < KSPLIT; ++q) total += s_partial[warp + q][r][b];
            acc[r][b] = total;
          }
      }
      if (more) __syncthreads();  // s_partial is read before the next tile writes it
    }
    if (lane == 0 && part == 0 && t.live) store_rows<T, BMAX, ROWS, MODE, NW>(p, t.first, t.row_of, acc);
    if (!more || (KSPLIT == 1 && !next.live)) return;  // no tile left for this warp
    t = next;
  }
}

int multiprocessors() {
  static const int count = [] {
    int device = 0, sms = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    return sms;
  }();
  return count;
}

// The grid for `tiles` tiles of a kernel of which `per_sm` blocks fit on an SM: as many waves as the tiles need,
// and the tiles spread evenly over the blocks of those waves, so that every block loops over the same number.
unsigned spread_grid(int64_t tiles, int per_sm) {
  const int64_t resident = static_cast<int64_t>(per_sm > 0 ? per_sm : 1) * multiprocessors();
  const int64_t waves = (tiles + resident - 1) / resident;
  return static_cast<unsigned>((tiles + waves - 1) / waves);
}

// Launches one instantiation over `tiles` tiles; the prologue's stage is dynamic shared memory, past 48 KB only with
// the opt-in.
template <typename T, int V, int BMAX, int MODE, int UNROLL, int KSPLIT>
cudaError_t launch_kernel(const GemvParams& p, int64_t tiles, cudaStream_t stream) {
  int per_sm = 0;
  if (!p.norm.weight) {
    const auto kernel = gemv_kernel<T, V, BMAX, kRows, MODE, UNROLL, KSPLIT, false>;
    // A short row's tile is little more than its reductions and store, which the SMs overlap across one-tile blocks
    // better than a block's loop does (SmolLM2's lm_head, K = 576). The RoPE QKV projection over whole rows also
    // takes one tile a block (Llama-3.1-8B's, 768 tiles: 20.1 us against 21.6 spread over 384 blocks).
    if (p.k < 1024 || (MODE == kRopeRows && KSPLIT == 1))
      return launch_pdl(kernel, dim3(static_cast<unsigned>(tiles)), dim3(kWarps * 32), 0, stream, p, tiles);
    const cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kWarps * 32, 0);
    if (err != cudaSuccess) return err;
    return launch_pdl(kernel, dim3(spread_grid(tiles, per_sm)), dim3(kWarps * 32), 0, stream, p, tiles);
  }
  const auto kernel = gemv_kernel<T, V, BMAX, kRows, MODE, UNROLL, KSPLIT, true>;
  const size_t smem = gemv_prologue_smem(p, p.stage_inputs);  // launch_gemv checked that it fits
  if (smem + 1024 > 48 * 1024) {  // with the kernel's static shared memory, past the default limit
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  const cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kWarps * 32, smem);
  if (err != cudaSuccess) return err;
  return launch_pdl(kernel, dim3(spread_grid(tiles, per_sm)), dim3(kWarps * 32), smem, stream, p, tiles);
}

// Few rows: split K over the 4 warps of a block, so that enough warps stream weights to fill every SM
// (without it a 1536-row matrix runs 768 warps, under 6 per SM, and the wave tail dominates).
bool split_k(const GemvParams& p) {
  return (p.n + kRows - 1) / kRows < 16 * multiprocessors() && p.k >= 1024;
}

template <typename T, int V, int BMAX, int MODE, int UNROLL>
cudaError_t launch_rows(const GemvParams& p, cudaStream_t stream) {
  const int64_t groups = (p.n + kRows - 1) / kRows;
  if (split_k(p)) return launch_kernel<T, V, BMAX, MODE, UNROLL, kWarps>(p, groups, stream);
  return launch_kernel<T, V, BMAX, MODE, UNROLL, 1>(p, (groups + kWarps - 1) / kWarps, stream);
}

// Chunks in flight a lane for SwiGLU (gate and up rows: 4 weight rows a warp). Fewer where a warp holds many
// accumulators (batch 4-8). At batch 1-2 bf16 takes 3, since at 4 its form without the prologue spills (96 and 154
// bytes at the 168-register bound, none at 3). At batch 1 fp16 takes 6 where that is a lane's whole slice of K in one
// iteration (5 or 6 chunks: Qwen2-1.5B's K of 1536), else 4 (at Llama-3.1-8B's K of 4096, 6 lowers the blocks an SM
// from 4 to 3 and leaves a short last iteration).
template <typename T, int V, int BMAX>
cudaError_t launch_swiglu(const GemvParams& p, cudaStream_t stream) {
  if constexpr (BMAX == 1 && std::is_same_v<T, __half>) {
    const int64_t slice = p.k / (split_k(p) ? kWarps : 1);
    const int64_t chunks = (slice + 32 * V - 1) / (32 * V);
    if (chunks > 4 && chunks <= 6) return launch_rows<T, V, BMAX, kPairedRows, 6>(p, stream);
  }
  constexpr int unroll = BMAX >= 4 ? 2 : (std::is_same_v<T, __nv_bfloat16> ? 3 : 4);
  return launch_rows<T, V, BMAX, kPairedRows, unroll>(p, stream);
}

template <typename T, int V, int BMAX>
cudaError_t launch_act(const GemvParams& p, cudaStream_t stream) {
  if (p.act == kActSiluMul) return launch_swiglu<T, V, BMAX>(p, stream);
  // Fewer chunks in flight when a warp already holds many accumulators (register pressure).
  if (p.act == kActRopeCache) return launch_rows<T, V, BMAX, kRopeRows, (BMAX >= 8 ? 2 : 4)>(p, stream);
  // fp16 at batch 1, K split over the block's warps and a lane's slice 12 chunks or more (Llama-3.1-8B's down, 14):
  // 5 chunks a lane in flight take one iteration fewer than 4.
  if constexpr (BMAX == 1 && std::is_same_v<T, __half>) {
    const int64_t chunks = (p.k / kWarps + 32 * V - 1) / (32 * V);
    if (split_k(p) && chunks >= 12 && (chunks + 4) / 5 < (chunks + 3) / 4)
      return launch_rows<T, V, BMAX, kPlainRows, 5>(p, stream);
  }
  return launch_rows<T, V, BMAX, kPlainRows, (BMAX >= 8 ? 2 : 4)>(p, stream);
}

template <typename T, int V>
cudaError_t launch_batch(const GemvParams& p, cudaStream_t stream) {
  if (p.batch <= 1) return launch_act<T, V, 1>(p, stream);
  if (p.batch <= 2) return launch_act<T, V, 2>(p, stream);
  if (p.batch <= 4) return launch_act<T, V, 4>(p, stream);
  return launch_act<T, V, 8>(p, stream);
}

template <typename T>
bool can_vectorize(const GemvParams& p) {
  constexpr int vec = 16 / sizeof(T);
  const NormPrologue& n = p.norm;
  const void* pointers[] = {p.w, p.x, n.delta, n.delta2, n.weight, n.bias, n.weight2, n.bias2, n.sum, n.h2};
  for (const void* ptr : pointers) {
    if (ptr && !aligned16(ptr)) return false;
  }
  return p.k % vec == 0 && p.w_stride % vec == 0 && p.x_stride % vec == 0 && (!n.delta || n.delta_stride % vec == 0) &&
         (!n.delta2 || n.delta2_stride % vec == 0);
}

// The dtype's launcher, which gemv_<dtype>.cu instantiates.
template <typename T>
cudaError_t launch_gemv_typed(const GemvParams& p, cudaStream_t stream) {
  if (can_vectorize<T>(p)) return launch_batch<T, 16 / sizeof(T)>(p, stream);
  // Element-wise loads (a misaligned or odd-sized input, rare in models): one kernel for 1-8 rows, a shorter build.
  return launch_act<T, 1, 8>(p, stream);
}

}  // namespace
}  // namespace patcher
